"""Reward model: a `transformers` sequence-classification model scoring prompt + completion text.

    reward:
      functions:
        - {name: reward_model, kwargs: {path: /models/my-rm, batch_size: 16}}

The trainer loads it at start (`prepare`: a load of several GB from shared storage must not count
against `reward.timeout_s` at the first step); used alone it loads on first use. It runs batched
under `torch.inference_mode`, in bfloat16 on a GPU and float32 on the CPU unless `dtype` says, and
keeps the *end* of over-long texts (left truncation) because the completion is what it judges.

On a GPU its weights stay in (pinned) host memory between calls (`offload`, on by default there): they are
copied to the GPU for each call and dropped there after, so the reward model takes no GPU memory while the
policy trains, and beside an awake vLLM/SGLang only while it scores. The price is one host-to-device copy of
the weights per call (a 7B model in bfloat16: about 15 GB, under a second at pinned PCIe 4 rates).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from vlrft.errors import ConfigError
from vlrft.rewards.registry import reward


def load_dtype(dtype: str, device: str) -> str:
    """The dtype a reward model loads in: `dtype`, or for "auto" bfloat16 on a GPU (half of float32's memory, beside
    the policy and the rollout engine) and float32 on the CPU."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if str(device).startswith("cuda") else "float32"


class HostResidentWeights:
    """A frozen model's parameters and buffers kept in host memory (pinned for a CUDA `device`), copied to `device`
    for one use and dropped there after. The same `nn.Parameter` objects are re-pointed (tied weights, one
    parameter used by two modules, are copied once); the copies are real copies even to the CPU, so CPU tests
    exercise the round trip."""

    def __init__(self, model, device: str):
        import torch

        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        self.parameters, self.buffers = [], []
        for param in model.parameters():  # each re-pointed as it is pinned: one tensor's copy at a time, not two models
            param.data = param.data.pin_memory() if pin else param.data
            self.parameters.append((param, param.data))
        for module in model.modules():
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = buffer.pin_memory() if pin else buffer
                    self.buffers.append((module, name, module._buffers[name]))

    def _point_at_host(self) -> None:
        for param, host in self.parameters:
            param.data = host
        for module, name, host in self.buffers:
            module._buffers[name] = host

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        import torch

        try:
            for param, host in self.parameters:
                param.data = host.to(self.device, non_blocking=True, copy=True)
            for module, name, host in self.buffers:
                module._buffers[name] = host.to(self.device, non_blocking=True, copy=True)
            yield
        finally:
            self._point_at_host()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the freed copies back to the GPU, not kept in torch's cache


@reward("reward_model")
class RewardModel:
    """Callable reward: `logits[:, label_index]` of an `AutoModelForSequenceClassification` per completion."""

    def __init__(
        self,
        path: str = "",
        batch_size: int = 8,
        max_length: int = 4096,
        device: str = "auto",
        dtype: str = "auto",
        use_chat_template: bool = True,
        label_index: int = 0,
        trust_remote_code: bool = False,
        offload: bool | None = None,
    ):
        if not path:
            raise ConfigError("reward function 'reward_model' needs kwargs.path: a folder or Hub id of a sequence-classification model")
        if batch_size < 1 or max_length < 1:
            raise ConfigError(f"reward function 'reward_model': batch_size={batch_size} and max_length={max_length} must be >= 1")
        self.path = path
        self.batch_size = batch_size
        self.max_length = max_length
        self.device = device
        self.dtype = dtype
        self.use_chat_template = use_chat_template
        self.label_index = label_index
        self.trust_remote_code = trust_remote_code
        self.offload = offload  # None: on a GPU
        self._model = None
        self._device = None
        self._host_weights: HostResidentWeights | None = None
        self._tokenizer = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RewardModel(path={self.path!r}, loaded={self._model is not None})"

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":  # this rank's GPU: scoring runs in threads of its own, whose current device is GPU 0
            device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
        dtype = load_dtype(self.dtype, device)
        tokenizer = AutoTokenizer.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
        tokenizer.truncation_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(
            self.path, dtype=getattr(torch, dtype), trust_remote_code=self.trust_remote_code
        )
        if model.config.pad_token_id is None:  # the classifier pools the last non-pad token
            model.config.pad_token_id = tokenizer.pad_token_id
        if not 0 <= self.label_index < model.config.num_labels:
            raise ConfigError(
                f"reward function 'reward_model': label_index={self.label_index} but {self.path} has {model.config.num_labels} label(s)"
            )
        model.eval()
        if getattr(model.config, "use_cache", None):  # a decoder would return a KV cache: batch x length, per layer
            model.config.use_cache = False
        offload = self.offload if self.offload is not None else str(device).startswith("cuda")
        self._host_weights = HostResidentWeights(model, device) if offload else None
        self._tokenizer, self._model, self._device = tokenizer, model if offload else model.to(device), device

    def _uses_chat_template(self) -> bool:
        return self.use_chat_template and bool(getattr(self._tokenizer, "chat_template", None))

    def _text(self, prompt: str, completion: str) -> str:
        tok = self._tokenizer
        if self._uses_chat_template():
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            return tok.apply_chat_template(messages, tokenize=False)
        return prompt + completion

    def __call__(self, completions: list[str], prompts: list[str], **kwargs: Any) -> list[float]:
        import torch

        with self._lock:  # one load, and one batch loop at a time on the device
            if self._model is None:
                self._load()
            texts = [self._text(p, c) for p, c in zip(prompts, completions)]
            # Sort by length so each batch pads little; results go back to the original order.
            order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
            scores = [0.0] * len(texts)
            on_device = self._host_weights.on_device() if self._host_weights else contextlib.nullcontext()
            with on_device:
                for start in range(0, len(order), self.batch_size):
                    chunk = order[start : start + self.batch_size]
                    batch = self._tokenizer(
                        [texts[i] for i in chunk], padding=True, truncation=True, max_length=self.max_length,
                        return_tensors="pt", add_special_tokens=not self._uses_chat_template(),  # the template has them
                    ).to(self._device)
                    with torch.inference_mode():
                        logits = self._model(**batch).logits[:, self.label_index]
                    for i, value in zip(chunk, logits.float().cpu().tolist()):
                        scores[i] = value
            return scores

    def prepare(self) -> None:
        """Load the model now, outside any scoring timeout."""
        with self._lock:
            if self._model is None:
                self._load()

    def close(self) -> None:
        """Drop the model (frees its memory); it reloads on the next call."""
        with self._lock:
            self._model = self._tokenizer = self._host_weights = None
