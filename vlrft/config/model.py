"""The `model:` section: the policy, its LoRA adapters and the models derived from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vlrft.config.options import option


@dataclass
class LoraConfig:
    """LoRA through PEFT; rank 0 means full fine-tuning."""

    rank: int = option(0, "LoRA rank; 0 = full fine-tuning (every parameter trains)", minimum=0)
    alpha: int = option(16, "LoRA scaling numerator (the update is scaled by alpha / rank)", minimum=1)
    dropout: float = option(0.0, "dropout on the LoRA adapters' input")
    target_modules: list[str] = option(help="modules that get adapters: ['all-linear'] or module names such as "
                                       "['q_proj', 'v_proj']", factory=lambda: ["all-linear"])


@dataclass
class ModelConfig:
    """The policy, and the reference and critic models derived from it."""

    path: str = option("", "the policy: a local folder (or Hub-format checkpoint) with weights and a processor")
    build_recipe: str | None = option(None, "build model.path with this function ('module:function' or "
                                      "'path/to/file.py:function', given the folder to fill) when it does not exist "
                                      "yet, e.g. examples/demo_models.py:build_shapes_demo")
    dtype: Literal["float32", "bfloat16", "float16"] = option(
        "bfloat16", "compute dtype on GPU: the reference model's weights, the policy's autocast in training and in the "
        "hf engine's sampling, FSDP2's gathers (the policy's weights and optimizer stay float32); CPU computes in "
        "float32 (VLRFT_CPU_MIXED_PRECISION=1 takes the GPU's mixed precision there, for tests)")
    attn_implementation: str = option("sdpa", "transformers attention kernel: 'sdpa', 'eager' or 'flash_attention_2'")
    trust_remote_code: bool = option(False, "allow model folders that ship their own Python code (transformers' "
                                     "trust_remote_code)")
    gradient_checkpointing: bool = option(False, "recompute activations in backward: less memory, about a third "
                                          "more compute")
    freeze_vision_tower: bool = option(False, "train only the language model; the vision encoder (and its "
                                       "merger) gets no gradient")
    lora: LoraConfig = option(help="LoRA adapters (model.lora.rank > 0 turns them on)", factory=LoraConfig)
    ref_path: str | None = option(None, "reference policy for the KL term; default: model.path (loaded only "
                                  "when algorithm.kl_coef > 0)")
    critic_path: str | None = option(None, "value model for algorithm.advantage=gae; default: model.path with a "
                                     "fresh value head")

