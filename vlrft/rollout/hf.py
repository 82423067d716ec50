"""The embedded engine: batched sampling with transformers `generate` (KV cache), on the policy itself.

It shares the policy's parameters, so `update_weights` has nothing to copy. Vision inputs are
encoded once per prompt (transformers encodes before expanding to `num_return_sequences`), and
every sampling option is mapped explicitly onto a `GenerationConfig`. Per-token logprobs are those
of the distribution the token was sampled from (after temperature / top-k / top-p / min-p /
repetition penalty), recorded step by step without keeping every step's full-vocabulary scores.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Callable, ContextManager

import torch

from vlrft.data.processor import left_pad
from vlrft.rollout.base import Rollouts, SamplingParams, cut_at_stop
from vlrft.tokens import TokenSpec

if TYPE_CHECKING:
    from vlrft.data import PromptBatch


# Models whose `generate` gives the copies of a prompt with two or more images the wrong image features when
# num_return_sequences > 1: transformers 5.24's Glm4vForConditionalGeneration._expand_multimodal_outputs repeats
# each image n times in a row (a, a, a, b, b, b) where the n copies of the prompt need (a, b, a, b, a, b), so the
# first and last copies saw the other image (their logprobs differed from the trainer's by up to 0.18). For these
# the engine repeats the prompts itself; the vision tower then runs once per copy.
REPEAT_PROMPTS_FOR = ("Glm4vForConditionalGeneration",)


class _LogprobRecorder:
    """Logits processor (placed after the warpers) recording the logprob of each sampled token under the final scores.

    At step t it keeps log_softmax(scores_t); at step t+1 the token sampled at t is the last column
    of `input_ids`, so only one [batch, vocab] tensor is alive at a time.
    """

    def __init__(self) -> None:
        self._last: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._take(input_ids[:, -1])
        self._last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        if self._last is not None:
            self.steps.append(self._last.gather(1, tokens[:, None].to(self._last.device)).squeeze(1))
            self._last = None

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """[batch, generated] logprobs once generation is done."""
        self._take(sequences[:, -1])
        if not self.steps:
            return torch.zeros((sequences.shape[0], 0))
        return torch.stack(self.steps, dim=1).cpu()


class HFEngine:
    """Rollouts with `model.generate` on the (unwrapped) policy; `max_batch_prompts` prompts per call."""

    def __init__(self, get_model: Callable[[], torch.nn.Module], processor, tokens: TokenSpec,
                 max_batch_prompts: int = 16, record_logprobs: bool = True, share_prompts: bool | None = None,
                 whole_weights: Callable[[], ContextManager] | None = None, static_cache: bool | None = None,
                 lean_decode: bool = True, cuda_graph_decode: bool | None = None,
                 autocast: Callable[[], ContextManager] | None = None):
        self._get_model = get_model
        # The trainer's mixed precision (bf16 autocast on GPUs; nothing on CPU): sampling computes in the precision
        # the policy's training forward computes in, not in its float32 master weights.
        self._autocast = autocast or contextlib.nullcontext
        # Context in which the policy's parameters are whole on this rank (a sharded policy gathers
        # them for the duration of a `generate` call, so ranks decode independently).
        self._whole_weights = whole_weights or contextlib.nullcontext
        self._holding = False  # inside `holding_weights`
        self.processor = processor
        self.tokens = tokens
        self.max_batch_prompts = max_batch_prompts
        self.record_logprobs = record_logprobs
        self.share_prompts = share_prompts  # None: when the model supports it (vlrft.decoding)
        # Group decoder only (vlrft.decoding chooses the decoder from these): a preallocated KV cache for
        # transformers' layers (None: on CUDA)
        self.static_cache = static_cache
        self.lean_decode = lean_decode  # Qwen-family decode steps without transformers' modules
        # lean steps replayed as a CUDA graph (rollout.cuda_graph_decode; None: on a CUDA device)
        self.cuda_graph_decode = cuda_graph_decode

    def generation_config(self, sampling: SamplingParams):
        from transformers import GenerationConfig

        options = dict(
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=sampling.min_new_tokens,
            num_return_sequences=sampling.n,
            eos_token_id=list(self.tokens.eos_ids) + [i for i in sampling.stop_token_ids if i not in self.tokens.eos_ids],
            pad_token_id=self.tokens.pad_id,
            repetition_penalty=sampling.repetition_penalty,
            suppress_tokens=list(self.tokens.suppressed_ids) or None,
            use_cache=True,
        )
        if sampling.greedy:
            options.update(do_sample=False)
        else:
            # The warpers are passed to `generate` as logits processors (`sampling_warpers`), ahead of
            # the logprob recorder: `generate` appends its own warpers after every custom processor,
            # so a recorder there would see the untempered scores. Here every warper is neutral;
            # top_k=0 and min_p=0.0 (not None) keep `generate` from filling them from the checkpoint's
            # generation_config.json (Qwen-VL Instruct ships a small top_k) or its own default (50).
            options.update(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0)
        if sampling.stop:
            options["stop_strings"] = list(sampling.stop)
        return GenerationConfig(**options)

    @contextlib.contextmanager
    def holding_weights(self) -> Iterator[None]:
        """Keep the policy's weights whole across several `generate` calls (gathered once, on entry).

        Making them whole is a collective under FSDP2/ZeRO-3, so every rank must do it equally
        often: multi-turn rollouts hold them for all their turns, since one rank's trajectories may
        need more turns (more `generate` calls) than another's. Nested calls gather nothing.
        """
        if self._holding:
            yield
            return
        with self._whole_weights():
            self._holding = True
            try:
                yield
            finally:
                self._holding = False

    def generate(self, batch: "PromptBatch", sampling: SamplingParams) -> Rollouts:
        with self.holding_weights(), self._autocast():
            return self._generate(batch, sampling)

    @torch.no_grad()
    def _generate(self, batch: "PromptBatch", sampling: SamplingParams) -> Rollouts:
        if sampling.greedy and sampling.n > 1:  # every greedy sample is the same: decode once, repeat
            one = self._generate(batch, dataclasses.replace(sampling, n=1))
            rows = [r for r in range(len(one)) for _ in range(sampling.n)]
            return Rollouts(n=sampling.n, completion_ids=[one.completion_ids[r] for r in rows],
                            finish_reasons=[one.finish_reasons[r] for r in rows],
                            logprobs=None if one.logprobs is None else [one.logprobs[r] for r in rows],
                            texts=[one.texts[r] for r in rows])
        from transformers import LogitsProcessorList

        from vlrft.decoding import sampling_warpers
        from vlrft.models.actor import base_of
        from vlrft.sampling import hf_decoder
        from vlrft.vision import mm_token_type_ids, token_type_kwargs

        model = self._get_model()
        # the group decoder for the families vlrft.sampling names (the memory plan reads the same: every supported
        # family); another, or share_prompts=False, through transformers' generate
        model_type = getattr(getattr(base_of(model), "config", None), "model_type", None)
        if hf_decoder(str(model_type)) != "generate" and self.share_prompts is not False:
            return self._generate_groups(model, batch, sampling)
        was_training = model.training
        model.eval()

        copies = sampling.n if type(base_of(model)).__name__ in REPEAT_PROMPTS_FOR else 1
        config = self.generation_config(dataclasses.replace(sampling, n=sampling.n // copies))
        warpers = sampling_warpers(sampling)
        device = next(model.parameters()).device
        stop_ids = set(config.eos_token_id)
        completions: list[list[int]] = []
        reasons: list[str] = []
        logprobs: list[list[float]] = []
        try:
            for start in range(0, len(batch), self.max_batch_prompts):
                index = [i for i in range(start, min(start + self.max_batch_prompts, len(batch)))
                         for _ in range(copies)]
                input_ids, attention = left_pad([batch.prompt_ids[i] for i in index], self.tokens.pad_id)
                types = mm_token_type_ids(input_ids, self.tokens.image_token_id, self.tokens.video_token_id)
                kwargs = dict(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                              **token_type_kwargs(model, types.to(device)))
                kwargs.update(batch.visual.select(index).to(device).model_inputs())
                recorder = _LogprobRecorder() if self.record_logprobs else None
                processors = LogitsProcessorList([*warpers, *([recorder] if recorder else [])])
                out = model.generate(**kwargs, generation_config=config, logits_processor=processors,
                                     tokenizer=self.processor.tokenizer if sampling.stop else None)
                new = out[:, input_ids.shape[1]:].cpu()
                step_lp = recorder.finish(out) if recorder else None
                for row in range(new.shape[0]):
                    ids, reason = cut_at_stop(new[row].tolist(), stop_ids, sampling.max_new_tokens)
                    if sampling.stop:  # generate pads after a stop string: cut right after the string
                        ids, reason = self._cut_at_stop_string(ids, sampling, reason)
                    completions.append(ids)
                    reasons.append(reason)
                    if step_lp is not None:
                        logprobs.append(step_lp[row, : len(ids)].tolist())
        finally:
            model.train(was_training)
        texts = self.processor.tokenizer.batch_decode(completions, skip_special_tokens=True)
        return Rollouts(n=sampling.n, completion_ids=completions, finish_reasons=reasons,
                        logprobs=logprobs if self.record_logprobs else None, texts=texts)

    def _generate_groups(self, model, batch: "PromptBatch", sampling: SamplingParams) -> Rollouts:
        """Each prompt prefilled once, its cache shared by the group (vlrft.decoding)."""
        from vlrft.decoding import decode_groups

        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        stop_ids = set(self.tokens.eos_ids) | set(sampling.stop_token_ids)
        ids: list[list[int]] = []
        logprobs: list[list[float]] = []
        reasons: list[str] = []
        try:
            for start in range(0, len(batch), self.max_batch_prompts):
                index = list(range(start, min(start + self.max_batch_prompts, len(batch))))
                rows = decode_groups(model, [batch.prompt_ids[i] for i in index],
                                     batch.visual.select(index).to(device), sampling,
                                     pad_id=self.tokens.pad_id, stop_ids=stop_ids,
                                     image_token_id=self.tokens.image_token_id,
                                     video_token_id=self.tokens.video_token_id,
                                     suppressed_ids=self.tokens.suppressed_ids, tokenizer=self.processor.tokenizer,
                                     static_cache=self.static_cache,
                                     lean_step=self.lean_decode, cuda_graph=self.cuda_graph_decode)
                ids.extend(rows.ids)
                logprobs.extend(rows.logprobs)
                reasons.extend(rows.reasons)
        finally:
            model.train(was_training)
        texts = self.processor.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return Rollouts(n=sampling.n, completion_ids=ids, finish_reasons=reasons,
                        logprobs=logprobs if self.record_logprobs else None, texts=texts)

    def _cut_at_stop_string(self, ids: list[int], sampling: SamplingParams, reason: str) -> tuple[list[int], str]:
        """Cut after the first token whose prefix text contains a stop string (generate pads past it)."""
        decode = self.processor.tokenizer.decode
        text = decode(ids)
        hits = [text.find(s) + len(s) for s in sampling.stop if s in text]
        if not hits:
            return ids, reason
        end = min(hits)
        lo, hi = 1, len(ids)
        while lo < hi:  # smallest prefix whose decoded text reaches the end of the stop string
            mid = (lo + hi) // 2
            if len(decode(ids[:mid])) >= end:
                hi = mid
            else:
                lo = mid + 1
        return ids[:lo], "stop"

    def update_weights(self, model: torch.nn.Module) -> None:
        """Nothing to copy: generation runs on the policy's own parameters."""

    def sleep(self) -> None:
        """Nothing to release: transformers keeps no cache between `generate` calls."""

    def wake(self) -> None:
        """Nothing to restore."""
