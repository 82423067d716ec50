"""The reward models of a config (`reward_model` functions), sized for the memory plan, and their memory.

Each distinct `reward_model` entry of `reward.functions` and `reward.recipes` (one per key, as
`RewardSet` builds them) is a model on every rank's GPU. Its parameters are counted by building it
on the meta device from its `config.json` (any sequence-classification architecture transformers
knows; nothing is read but the config). A reward model the plan cannot read (a Hub id, no local
folder) is listed as not counted rather than guessed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vlrft.errors import UserError
from vlrft.plan.memory_plan import PHASES, Component


@dataclass(frozen=True)
class RewardModelShape:
    key: str  # the reward's key (its alias, or "reward_model")
    path: str
    parameters: int
    dtype_bytes: int  # in the dtype it loads in on a GPU
    offload: bool  # weights in host memory between calls (the GPU default)
    batch_size: int
    max_length: int
    hidden_size: int
    intermediate_size: int

    @property
    def weight_bytes(self) -> int:
        return self.parameters * self.dtype_bytes

    @property
    def activation_bytes(self) -> int:
        """One batch through one layer at a time (inference, no KV cache): the residual stream, its norm, q/k/v and
        attention output (about 4 x hidden per token) and the MLP's gate, up and activation (3 x intermediate)."""
        tokens = self.batch_size * self.max_length
        return tokens * (4 * self.hidden_size + 3 * self.intermediate_size) * self.dtype_bytes


def reward_model_entries(reward_cfg) -> dict[str, dict]:
    """key -> kwargs of each distinct `reward_model` function (as `RewardSet.from_config` keys them)."""
    entries: dict[str, dict] = {}
    groups = [reward_cfg.functions, *reward_cfg.recipes.values()]
    for functions in groups:
        for fc in functions:
            if fc.name == "reward_model":
                entries.setdefault(fc.alias or fc.name, dict(fc.kwargs))
    return entries


def reward_model_shape(key: str, kwargs: dict) -> RewardModelShape | None:
    """The shape of one reward model on a GPU; None when it runs on the CPU (`device: cpu`). Raises `UserError`
    when its config cannot be read."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    device = str(kwargs.get("device", "auto"))
    if device == "cpu":
        return None
    path = str(kwargs.get("path", ""))
    trust = bool(kwargs.get("trust_remote_code", False))
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForSequenceClassification.from_config(config, trust_remote_code=trust)
    except Exception as exc:  # noqa: BLE001 - any reason it cannot be read is reported, not guessed around
        raise UserError(f"reward model {key!r} ({path}): cannot read its config ({type(exc).__name__}: {exc})") from None
    text = getattr(config, "text_config", None) or config
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    dtype = str(kwargs.get("dtype", "auto"))
    dtype = "bfloat16" if dtype == "auto" else dtype  # what RewardModel's "auto" loads on a GPU
    offload = kwargs.get("offload")
    return RewardModelShape(
        key=key, path=path, parameters=sum(p.numel() for p in model.parameters()),
        dtype_bytes=torch.empty((), dtype=getattr(torch, dtype)).element_size(),
        offload=True if offload is None else bool(offload),
        batch_size=int(kwargs.get("batch_size", 8)), max_length=int(kwargs.get("max_length", 4096)),
        hidden_size=hidden, intermediate_size=int(getattr(text, "intermediate_size", 4 * hidden) or 4 * hidden))


def reward_model_shapes(reward_cfg) -> tuple[list[RewardModelShape], list[str]]:
    """(shapes of the GPU reward models, one line per reward model the plan cannot count)."""
    shapes, not_counted = [], []
    for key, kwargs in reward_model_entries(reward_cfg).items():
        try:
            shape = reward_model_shape(key, kwargs)
        except UserError as exc:
            not_counted.append(str(exc))
            continue
        if shape is not None:
            shapes.append(shape)
    return shapes, not_counted


def reward_model_components(reward_models: Sequence[RewardModelShape], ranks_per_node: int
                            ) -> tuple[list[Component], list[Component]]:
    """(per-GPU, first node's host) components of the reward models: an offloaded one is on the GPU only while it
    scores (the rollout phase, beside the awake engine) and in pinned host memory on every rank of the node; a
    resident one holds its weights in both phases."""
    gpu, host = [], []
    for rm in reward_models:
        where = f"reward model {rm.key!r} ({rm.parameters / 1e9:.2f} B parameters, {rm.path})"
        if rm.offload:
            gpu.append(Component(f"reward_model:{rm.key}", rm.weight_bytes + rm.activation_bytes, ("rollout",),
                                 f"{where}: copied to the GPU for scoring, with one batch's activations"))
            host.append(Component(f"reward_model:{rm.key}", rm.weight_bytes * ranks_per_node, PHASES,
                                  f"{where}: pinned weights of each of the node's {ranks_per_node} rank(s) (offload)"))
        else:
            gpu.append(Component(f"reward_model:{rm.key}", rm.weight_bytes, ("rollout", "train"),
                                 f"{where}: resident on the GPU (offload: false)"))
            gpu.append(Component(f"reward_model_activations:{rm.key}", rm.activation_bytes, ("rollout",),
                                 f"{where}: one batch of {rm.batch_size} x {rm.max_length} tokens"))
    return gpu, host
