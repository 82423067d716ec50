"""What both engine weight-loading workers (tests/vllm_load_worker.py, tests/sglang_load_worker.py) share: the
NaN-filled engine model, the policy's weight-sync buckets (full, or LoRA-merged with non-zero B), and the report."""

from __future__ import annotations

import socket

import torch
from torch import nn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fill_with_nan(engine_model: nn.Module) -> None:
    with torch.no_grad():
        for param in engine_model.parameters():
            param.fill_(float("nan"))


def policy_buckets(model_dir: str, lora: bool) -> tuple[float, list[tuple[str, torch.Tensor]]]:
    """(the base checkpoint's sum, the (name, tensor) pairs vlrft's weight sync sends for the policy in `model_dir`)."""
    from vlrft.models.actor import apply_lora
    from vlrft.models.loading import load_policy
    from vlrft.models.weights import PolicyWeights

    policy = load_policy(model_dir, dtype="float32", device="cpu")
    base_sum = float(sum(t.double().sum() for t in policy.state_dict().values()))
    if lora:
        torch.manual_seed(0)
        policy = apply_lora(policy, rank=4, alpha=8, dropout=0.0, target_modules=["all-linear"])
        with torch.no_grad():  # PEFT starts B at zero; non-zero, the merged weights differ from the base ones
            for name, param in policy.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.05)
    sent = [pair for bucket in PolicyWeights(policy, torch.float32).buckets(1 << 16, "cpu") for pair in bucket]
    return base_sum, sent


def report(engine_model: nn.Module, loaded, base_sum: float, sent: list[tuple[str, torch.Tensor]]) -> dict:
    """What the engine model holds after `load_weights`: `loaded` as it reported (None: the parameters no longer
    holding only NaN, i.e. written at least in part), those still holding a NaN, and the sums."""
    params = dict(engine_model.named_parameters())
    if loaded is None:
        loaded = [name for name, p in params.items() if not torch.isnan(p).all()]
    with torch.no_grad():
        return {
            "architecture": type(engine_model).__name__,
            "params": sorted(params),
            "loaded": sorted(loaded),
            "still_nan": sorted(name for name, p in params.items() if torch.isnan(p).any()),
            "base_sum": base_sum,
            "sent_sum": float(sum(t.double().sum() for _, t in sent)),
            "engine_sum": float(sum(p.double().sum() for p in params.values())),
            "sent": len(sent),
        }
