"""The sizes of a model's parts, as its `config.json` gives them: the language model (`TextShape`), the vision tower
(`VisionShape`), and one parameter tensor (`Tensor`)."""

from __future__ import annotations

from dataclasses import dataclass

QWEN3_VL = ("qwen3_vl", "qwen3_vl_moe")  # one vision tower and text attention; the MoE one has experts as MLPs


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor: its name in the transformers model, shape and part ("text", "vision", "head")."""

    name: str
    shape: tuple[int, ...]
    part: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def in_tower(self) -> bool:
        """Inside the vision module (what model.freeze_vision_tower freezes): a projector outside it trains."""
        return self.name.startswith(("model.visual.", "model.vision_tower.", "model.vision_model."))

    @property
    def is_linear_weight(self) -> bool:
        """A weight of an `nn.Linear` (what LoRA's "all-linear" wraps): 2-D, not an embedding table, not a MoE router
        (`mlp.gate`, a bare parameter) nor its experts (3-D)."""
        return len(self.shape) == 2 and not self.name.endswith(("embed_tokens.weight", "pos_embed.weight",
                                                                 "position_embedding.weight", "mlp.gate.weight",
                                                                 "mm_input_projection_weight"))


@dataclass(frozen=True)
class TextShape:
    hidden_size: int
    dense_intermediate_size: int  # config.json `intermediate_size`: a dense layer's MLP width
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    attention_bias: bool  # q/k/v biases (Qwen2 family)
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3 family)
    # Mixture of experts (Qwen3-VL-MoE): the layers whose MLP is `num_experts` SiLU-gated experts of
    # `moe_intermediate_size` with a linear router picking `num_experts_per_tok` per token; none for a dense model.
    sparse_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def intermediate_size(self) -> int:
        """The MLP width one token runs through, as the activation estimate counts it: a dense layer's, or the
        picked experts' together (num_experts_per_tok x moe_intermediate_size; the released Qwen3-VL-MoE configs make
        it equal to their unused `intermediate_size`), the wider of the two when the model has both kinds."""
        dense = self.dense_intermediate_size if len(self.sparse_layers) < self.num_layers else 0
        return max(dense, self.num_experts_per_tok * self.moe_intermediate_size if self.sparse_layers else 0)


@dataclass(frozen=True)
class VisionShape:
    kind: str  # the model type whose vision tower this is
    depth: int
    hidden_size: int
    intermediate_size: int  # a block's MLP width (GLM-4.1V: its out_hidden_size)
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    num_position_embeddings: int = 0  # Qwen3-VL / GLM-4.1V learned position table
    deepstack_layers: int = 0  # Qwen3-VL extra mergers feeding early LM layers
    merger_intermediate_size: int = 0  # GLM-4.1V: its merger's gated MLP width (vision_config.intermediate_size)
    attention_bias: bool = False  # GLM-4.1V: biases of the tower's qkv projection
    qk_norm: bool = False  # InternViT: RMSNorm over q and k (InternViT-6B)
    layer_norm: bool = True  # InternViT: LayerNorm (with bias), else RMSNorm
    final_norm: bool = True  # InternViT: a LayerNorm after the last block unless it mean-pools

