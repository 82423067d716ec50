"""A model's shape from its `config.json` alone: every parameter tensor, counted without building the model.

The memory plan needs exact parameter counts (per part: language model, vision tower, LM head)
and the sizes that drive activations and the KV cache. Reading `config.json` instead of
instantiating the model keeps `vlrft plan` instant and lets it work for a 72B model on a laptop.
Supported: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE (its experts counted whole, and the
parameters one token runs through as `active_parameters`), GLM-4.1V, Gemma 3, InternVL 3 and LLaVA-OneVision
(both with a Qwen2 language model, as released), and SmolVLM (a Llama language model).

The sizes are `vlrft.plan.shapes` (TextShape, VisionShape) and each family's tensors `vlrft.plan.tensors`;
this module reads them from `config.json` into a `ModelShape`, which counts them.

Hub names that are not local folders (e.g. `Qwen/Qwen2.5-VL-7B-Instruct`) resolve to the copies
of their published `config.json` architecture fields shipped in `vlrft/plan/model_configs/`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from vlrft.errors import UserError
from vlrft.families import MODEL_TYPES
from vlrft.plan.shapes import QWEN3_VL, Tensor, TextShape, VisionShape
from vlrft.plan.tensors import model_tensors

SUPPORTED = MODEL_TYPES  # every family vlrft trains (vlrft.families) has a shape rule here
SHIPPED_CONFIGS = Path(__file__).resolve().parent / "model_configs"


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    text: TextShape
    vision: VisionShape
    tie_word_embeddings: bool
    source: str  # where the config was read from
    checkpoint_bytes: int = 4  # bytes per weight in the checkpoint files (config.json `dtype`; float32 if unsaid)

    def tensors(self) -> list[Tensor]:
        return model_tensors(self.model_type, self.text, self.vision, self.tie_word_embeddings)

    def count(self, part: str | None = None) -> int:
        return sum(t.numel for t in self.tensors() if part is None or t.part == part)

    def tower_count(self) -> int:
        """Parameters model.freeze_vision_tower freezes: the vision module's (not a projector outside it)."""
        return sum(t.numel for t in self.tensors() if t.in_tower)

    @property
    def num_parameters(self) -> int:
        return self.count()

    @property
    def active_parameters(self) -> int:
        """Parameters one token's forward runs through: all of a dense model; of a MoE model, each sparse layer's
        experts counted for the `num_experts_per_tok` of `num_experts` its router picks (the model card's "A3B")."""
        t = self.text
        if not t.sparse_layers:
            return self.num_parameters
        experts = sum(x.numel for x in self.tensors() if ".mlp.experts." in x.name)
        return self.num_parameters - experts + experts * t.num_experts_per_tok // t.num_experts

    def blocks(self) -> dict[str, int]:
        """Parameters per unit a sharded strategy gathers at once: each decoder layer and vision block, and the
        "root" (embeddings, LM head, norms, merger: everything outside the repeated blocks)."""
        by_block: dict[str, int] = {}
        for t in self.tensors():
            match = re.match(r"(.*\.(?:layers|blocks)\.\d+)\.", t.name)
            key = match.group(1) if match else "root"
            by_block[key] = by_block.get(key, 0) + t.numel
        return by_block

    def largest_layer(self) -> int:
        return max(n for name, n in self.blocks().items() if name != "root")

    def lora_targets(self, target_modules: list[str], exclude_vision: bool = False) -> list[Tensor]:
        """The weights of the linear layers LoRA wraps ("all-linear": all but lm_head), and the MoE experts' 3-D
        weights a target names by suffix ('experts.gate_up_proj'); `exclude_vision` (model.freeze_vision_tower):
        none in the vision tower."""
        linear = [t for t in target_modules if t != "all-linear"]
        return [t for t in self.tensors() if not (exclude_vision and t.in_tower) and (
            (t.is_linear_weight and t.name != "lm_head.weight"
             and ("all-linear" in target_modules or t.name.rsplit(".", 2)[-2] in linear))
            or (len(t.shape) == 3 and any(t.name == x or t.name.endswith("." + x) for x in linear)))]

    def lora_parameters(self, rank: int, target_modules: list[str], exclude_vision: bool = False,
                        part: str | None = None) -> int:
        """LoRA adapter parameters: rank * (in + out) per targeted linear layer (`lora_targets`, of `part` only when
        given); for an experts' [E, out, in] weight rank * E * (in + out) (PEFT's adapter on a parameter: rank x E in
        each factor)."""
        return sum(rank * (t.shape[0] + t.shape[1]) if len(t.shape) == 2
                   else rank * t.shape[0] * (t.shape[1] + t.shape[2])
                   for t in self.lora_targets(target_modules, exclude_vision) if part is None or t.part == part)


# ------------------------------------------------------------------ reading config.json


def _get(d: dict, *keys: str, default=None, where: str = ""):
    for key in keys:
        if key in d and d[key] is not None:
            return d[key]
    if default is not None:
        return default
    raise UserError(f"{where}: config.json has none of {', '.join(keys)}; is this a Qwen-VL model config?")


def shape_from_config(config: dict, source: str = "config.json") -> ModelShape:
    """`ModelShape` from a parsed `config.json` (text fields at the top level or under `text_config`)."""
    model_type = config.get("model_type", "")
    if model_type not in SUPPORTED:
        raise UserError(f"{source}: model_type {model_type!r} is not one vlrft can plan for; supported: "
                        f"{', '.join(SUPPORTED)}")
    if model_type == "gemma3":
        return _gemma3_shape(config, source)
    if model_type in ("internvl", "llava_onevision"):
        return _qwen2_tower_shape(config, source)
    if model_type == "smolvlm":
        return _smolvlm_shape(config, source)
    text_cfg = {**config, **(config.get("text_config") or {})}
    vision_cfg = config.get("vision_config") or {}
    w = source
    if model_type == "glm4v":
        return _glm4v_shape(config, text_cfg, vision_cfg, source)
    hidden = int(_get(text_cfg, "hidden_size", where=w))
    heads = int(_get(text_cfg, "num_attention_heads", where=w))
    qwen3 = model_type in QWEN3_VL
    layers = int(_get(text_cfg, "num_hidden_layers", where=w))
    experts = int(text_cfg.get("num_experts") or text_cfg.get("num_local_experts") or 0) \
        if model_type == "qwen3_vl_moe" else 0
    step = int(text_cfg.get("decoder_sparse_step") or 1)
    dense_layers = set(text_cfg.get("mlp_only_layers") or [])
    # transformers' Qwen3VLMoeTextDecoderLayer: experts where the layer is not in mlp_only_layers and
    # (index + 1) % decoder_sparse_step == 0
    sparse = tuple(i for i in range(layers) if experts and i not in dense_layers and (i + 1) % step == 0)
    text = TextShape(
        hidden_size=hidden,
        dense_intermediate_size=int(_get(text_cfg, "intermediate_size", where=w)),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_get(text_cfg, "num_key_value_heads", default=heads)),
        head_dim=int(text_cfg.get("head_dim") or hidden // heads) if qwen3 else hidden // heads,
        vocab_size=int(_get(text_cfg, "vocab_size", where=w)),
        attention_bias=bool(text_cfg.get("attention_bias", False)) if qwen3 else True,
        qk_norm=qwen3,
        sparse_layers=sparse,
        num_experts=experts,
        num_experts_per_tok=int(_get(text_cfg, "num_experts_per_tok", where=w)) if sparse else 0,
        moe_intermediate_size=int(_get(text_cfg, "moe_intermediate_size", where=w)) if sparse else 0,
    )
    if model_type == "qwen2_vl":
        vh = int(_get(vision_cfg, "embed_dim", where=w + " vision_config"))
        inter = int(vh * float(_get(vision_cfg, "mlp_ratio", default=4)))
        out_hidden = int(_get(vision_cfg, "hidden_size", default=hidden))
    else:
        vh = int(_get(vision_cfg, "hidden_size", where=w + " vision_config"))
        inter = int(_get(vision_cfg, "intermediate_size", where=w + " vision_config"))
        out_hidden = int(_get(vision_cfg, "out_hidden_size", default=hidden))
    vision = VisionShape(
        kind=model_type,
        depth=int(_get(vision_cfg, "depth", where=w + " vision_config")),
        hidden_size=vh,
        intermediate_size=inter,
        out_hidden_size=out_hidden,
        patch_size=int(_get(vision_cfg, "patch_size", default=16 if qwen3 else 14)),
        temporal_patch_size=int(_get(vision_cfg, "temporal_patch_size", default=2)),
        spatial_merge_size=int(_get(vision_cfg, "spatial_merge_size", default=2)),
        in_channels=int(_get(vision_cfg, "in_channels", "in_chans", default=3)),
        num_position_embeddings=int(vision_cfg.get("num_position_embeddings") or 0),
        deepstack_layers=len(vision_cfg.get("deepstack_visual_indexes") or []),
    )
    tied = config.get("tie_word_embeddings", text_cfg.get("tie_word_embeddings", False))
    return ModelShape(model_type, text, vision, bool(tied), source, _checkpoint_bytes(config, text_cfg))


def _checkpoint_bytes(config: dict, text_cfg: dict) -> int:
    stored = str(text_cfg.get("dtype") or text_cfg.get("torch_dtype") or "float32")
    return 2 if stored in ("bfloat16", "float16") else 4


def _glm4v_shape(config: dict, text_cfg: dict, vision_cfg: dict, w: str) -> ModelShape:
    """GLM-4.1V (transformers' Glm4vForConditionalGeneration): head_dim = hidden_size / heads, as its attention
    computes it; the tower's learned position table has (image_size / patch_size)^2 rows."""
    hidden = int(_get(text_cfg, "hidden_size", where=w))
    heads = int(_get(text_cfg, "num_attention_heads", where=w))
    text = TextShape(
        hidden_size=hidden,
        dense_intermediate_size=int(_get(text_cfg, "intermediate_size", where=w)),
        num_layers=int(_get(text_cfg, "num_hidden_layers", where=w)),
        num_heads=heads,
        num_kv_heads=int(_get(text_cfg, "num_key_value_heads", default=heads)),
        head_dim=hidden // heads,
        vocab_size=int(_get(text_cfg, "vocab_size", where=w)),
        attention_bias=True,
        qk_norm=False,
    )
    wv = w + " vision_config"
    vh = int(_get(vision_cfg, "hidden_size", where=wv))
    patch = int(_get(vision_cfg, "patch_size", default=14))
    out_hidden = int(_get(vision_cfg, "out_hidden_size", default=hidden))
    vision = VisionShape(
        kind="glm4v",
        depth=int(_get(vision_cfg, "depth", where=wv)),
        hidden_size=vh,
        intermediate_size=out_hidden,  # Glm4VisionMlp is out_hidden_size wide
        out_hidden_size=out_hidden,
        patch_size=patch,
        temporal_patch_size=int(_get(vision_cfg, "temporal_patch_size", default=2)),
        spatial_merge_size=int(_get(vision_cfg, "spatial_merge_size", default=2)),
        in_channels=int(_get(vision_cfg, "in_channels", default=3)),
        num_position_embeddings=(int(_get(vision_cfg, "image_size", default=336)) // patch) ** 2,
        merger_intermediate_size=int(_get(vision_cfg, "intermediate_size", where=wv)),
        attention_bias=bool(vision_cfg.get("attention_bias", False)),
    )
    tied = config.get("tie_word_embeddings", text_cfg.get("tie_word_embeddings", False))
    return ModelShape("glm4v", text, vision, bool(tied), w, _checkpoint_bytes(config, text_cfg))


def _gemma3_shape(config: dict, w: str) -> ModelShape:
    """Gemma 3: its released config.json leaves most sizes to transformers' defaults (Gemma3TextConfig,
    SiglipVisionConfig), so they are read through those classes (configs only, no model is built)."""
    from transformers import Gemma3Config

    try:
        parsed = Gemma3Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    except (TypeError, ValueError) as exc:
        raise UserError(f"{w}: not a Gemma 3 config transformers can read ({exc})") from None
    t, v = parsed.text_config, parsed.vision_config
    text = TextShape(hidden_size=t.hidden_size, dense_intermediate_size=t.intermediate_size,
                     num_layers=t.num_hidden_layers, num_heads=t.num_attention_heads,
                     num_kv_heads=t.num_key_value_heads, head_dim=t.head_dim, vocab_size=t.vocab_size,
                     attention_bias=False, qk_norm=True)
    if getattr(v, "vision_use_head", False):
        raise UserError(f"{w}: a SigLIP tower with its pooling head (vision_use_head) is not Gemma 3's layout")
    # an image is (image_size / patch)^2 patches average-pooled to mm_tokens_per_image tokens: pooled `merge` x `merge`
    side = v.image_size // v.patch_size
    merge = max(1, side // max(1, round(int(parsed.mm_tokens_per_image) ** 0.5)))
    vision = VisionShape(kind="gemma3", depth=v.num_hidden_layers, hidden_size=v.hidden_size,
                         intermediate_size=v.intermediate_size, out_hidden_size=t.hidden_size, patch_size=v.patch_size,
                         temporal_patch_size=1, spatial_merge_size=merge, in_channels=v.num_channels,
                         num_position_embeddings=side ** 2)
    tied = bool(config.get("tie_word_embeddings", getattr(parsed, "tie_word_embeddings", True)))
    text_cfg = {**config, **(config.get("text_config") or {})}
    return ModelShape("gemma3", text, vision, tied, w, _checkpoint_bytes(config, text_cfg))


def _qwen2_tower_shape(config: dict, w: str) -> ModelShape:
    """InternVL 3 and LLaVA-OneVision: a Qwen2 language model (q/k/v biases, no head norms) and their own towers; the
    released config.json leaves many sizes to transformers' defaults, so it is read through their config classes
    (configs only, no model is built)."""
    from transformers import InternVLConfig, LlavaOnevisionConfig

    model_type = config["model_type"]
    cls = InternVLConfig if model_type == "internvl" else LlavaOnevisionConfig
    try:
        parsed = cls(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    except (TypeError, ValueError) as exc:
        raise UserError(f"{w}: not a {model_type} config transformers can read ({exc})") from None
    t, v = parsed.text_config, parsed.vision_config
    if t.model_type != "qwen2":
        raise UserError(f"{w}: vlrft plans {model_type} with a Qwen2 language model (as released), not "
                        f"{t.model_type!r}")
    text = TextShape(hidden_size=t.hidden_size, dense_intermediate_size=t.intermediate_size,
                     num_layers=t.num_hidden_layers, num_heads=t.num_attention_heads,
                     num_kv_heads=t.num_key_value_heads, head_dim=t.hidden_size // t.num_attention_heads,
                     vocab_size=t.vocab_size, attention_bias=True, qk_norm=False)
    if model_type == "internvl":
        side = [int(x) for x in (v.image_size if isinstance(v.image_size, (list, tuple)) else [v.image_size] * 2)]
        patch = [int(x) for x in (v.patch_size if isinstance(v.patch_size, (list, tuple)) else [v.patch_size] * 2)]
        if side[0] != side[1] or patch[0] != patch[1] or not v.use_absolute_position_embeddings:
            raise UserError(f"{w}: vlrft plans InternVL with square tiles and patches and absolute positions")
        # pixel shuffle by downsample_ratio: (1 / ratio)^2 patches become one token, like a spatial merge
        vision = VisionShape(kind="internvl", depth=v.num_hidden_layers, hidden_size=v.hidden_size,
                             intermediate_size=v.intermediate_size, out_hidden_size=t.hidden_size, patch_size=patch[0],
                             temporal_patch_size=1, spatial_merge_size=round(1 / parsed.downsample_ratio),
                             in_channels=v.num_channels, num_position_embeddings=(side[0] // patch[0]) ** 2,
                             attention_bias=bool(v.attention_bias), qk_norm=bool(v.use_qk_norm),
                             layer_norm=v.norm_type == "layer_norm", final_norm=not v.use_mean_pooling)
    else:
        if getattr(v, "vision_use_head", False) or not getattr(parsed, "multimodal_projector_bias", True):
            raise UserError(f"{w}: vlrft plans LLaVA-OneVision with a SigLIP tower without pooling head and a "
                            "projector with biases, as released")
        vision = VisionShape(kind="llava_onevision", depth=v.num_hidden_layers, hidden_size=v.hidden_size,
                             intermediate_size=v.intermediate_size, out_hidden_size=t.hidden_size,
                             patch_size=v.patch_size, temporal_patch_size=1, spatial_merge_size=1,
                             in_channels=v.num_channels, num_position_embeddings=(v.image_size // v.patch_size) ** 2)
    text_cfg = {**config, **(config.get("text_config") or {})}
    return ModelShape(model_type, text, vision, bool(parsed.tie_word_embeddings), w, _checkpoint_bytes(config, text_cfg))


def _smolvlm_shape(config: dict, w: str) -> ModelShape:
    """SmolVLM: a Llama language model, a SigLIP tower over image_size^2 tiles, and a connector that pixel-shuffles
    scale_factor x scale_factor patches into one token; read through SmolVLMConfig (its sub-configs' defaults)."""
    from transformers import SmolVLMConfig

    try:
        parsed = SmolVLMConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    except (TypeError, ValueError) as exc:
        raise UserError(f"{w}: not a SmolVLM config transformers can read ({exc})") from None
    t, v = parsed.text_config, parsed.vision_config
    if getattr(t, "attention_bias", False) or getattr(t, "mlp_bias", False):
        raise UserError(f"{w}: a language model with attention or MLP biases is not SmolVLM's released layout")
    text = TextShape(hidden_size=t.hidden_size, dense_intermediate_size=t.intermediate_size,
                     num_layers=t.num_hidden_layers, num_heads=t.num_attention_heads,
                     num_kv_heads=t.num_key_value_heads or t.num_attention_heads,
                     head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
                     vocab_size=t.vocab_size, attention_bias=False, qk_norm=False)
    side = v.image_size // v.patch_size
    vision = VisionShape(kind="smolvlm", depth=v.num_hidden_layers, hidden_size=v.hidden_size,
                         intermediate_size=v.intermediate_size, out_hidden_size=t.hidden_size, patch_size=v.patch_size,
                         temporal_patch_size=1, spatial_merge_size=int(parsed.scale_factor),
                         in_channels=v.num_channels, num_position_embeddings=side ** 2)
    tied = bool(config.get("tie_word_embeddings", getattr(parsed, "tie_word_embeddings", False)))
    text_cfg = {**config, **(config.get("text_config") or {})}
    return ModelShape("smolvlm", text, vision, tied, w, _checkpoint_bytes(config, text_cfg))


def shipped_config_path(name: str) -> Path:
    return SHIPPED_CONFIGS / (name.replace("/", "--") + ".json")


def load_model_shape(model_path: str, model_config: str | None = None) -> ModelShape:
    """The shape of `model_path` (a local folder, or a Hub name with a shipped config), or of `model_config`."""
    if model_config:
        path = Path(model_config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise UserError(f"--model-config {model_config}: no such file; pass a config.json or a model folder")
    else:
        local = Path(model_path) / "config.json"
        shipped = shipped_config_path(model_path)
        path = local if local.is_file() else shipped
        if not path.is_file():
            names = sorted(p.stem.replace("--", "/") for p in SHIPPED_CONFIGS.glob("*.json"))
            raise UserError(f"model.path={model_path!r} is neither a local model folder with config.json nor a model "
                            f"whose config ships with vlrft ({', '.join(names)}); pass --model-config PATH/config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: cannot read it as JSON ({exc})") from None
    return shape_from_config(config, str(path))
