"""Every parameter tensor of each supported family, by name and shape, from its `TextShape` and `VisionShape`:
`model_tensors` lists them in the order and with the names of the family's checkpoint."""

from __future__ import annotations

from vlrft.plan.shapes import QWEN3_VL, Tensor, TextShape, VisionShape


def model_tensors(model_type: str, text: TextShape, vision: VisionShape, tied: bool) -> list[Tensor]:
    """The parameter tensors of a `model_type` model; `tied`: the LM head shares the embedding's weight."""
    if model_type == "glm4v":
        return _glm4v_text_tensors(text, tied) + _glm4v_vision_tensors(vision)
    if model_type == "gemma3":
        return _gemma3_text_tensors(text, tied) + _siglip_tensors(vision)
    if model_type == "internvl":
        return _text_tensors(text, tied) + _internvl_vision_tensors(vision)
    if model_type == "llava_onevision":
        return _text_tensors(text, tied) + _llava_onevision_vision_tensors(vision)
    if model_type == "smolvlm":  # its connector: pixel shuffle, then one bias-free linear
        v = vision
        return (_text_tensors(text, tied, "model.text_model.")
                + _siglip_tower(v, "model.vision_model.")
                + [Tensor("model.connector.modality_projection.proj.weight",
                          (v.out_hidden_size, v.hidden_size * v.spatial_merge_size ** 2), "vision")])
    return _text_tensors(text, tied) + _vision_tensors(vision)


def _text_tensors(t: TextShape, tied: bool, prefix: str = "model.language_model.") -> list[Tensor]:
    h, q, kv = t.hidden_size, t.num_heads * t.head_dim, t.kv_dim
    out = [Tensor(f"{prefix}embed_tokens.weight", (t.vocab_size, h), "text")]
    for i in range(t.num_layers):
        p = f"{prefix}layers.{i}."
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out.append(Tensor(f"{p}self_attn.{name}.weight", (rows, h), "text"))
            if t.attention_bias:
                out.append(Tensor(f"{p}self_attn.{name}.bias", (rows,), "text"))
        out.append(Tensor(f"{p}self_attn.o_proj.weight", (h, q), "text"))
        if t.qk_norm:
            out += [Tensor(f"{p}self_attn.q_norm.weight", (t.head_dim,), "text"),
                    Tensor(f"{p}self_attn.k_norm.weight", (t.head_dim,), "text")]
        if i in t.sparse_layers:  # experts as two 3-D tensors (gate and up fused), the router a bare [E, h] weight
            e, mi = t.num_experts, t.moe_intermediate_size
            out += [Tensor(f"{p}mlp.experts.gate_up_proj", (e, 2 * mi, h), "text"),
                    Tensor(f"{p}mlp.experts.down_proj", (e, h, mi), "text"),
                    Tensor(f"{p}mlp.gate.weight", (e, h), "text")]
        else:
            i_size = t.dense_intermediate_size
            out += [Tensor(f"{p}mlp.gate_proj.weight", (i_size, h), "text"),
                    Tensor(f"{p}mlp.up_proj.weight", (i_size, h), "text"),
                    Tensor(f"{p}mlp.down_proj.weight", (h, i_size), "text")]
        out += [Tensor(f"{p}input_layernorm.weight", (h,), "text"),
                Tensor(f"{p}post_attention_layernorm.weight", (h,), "text")]
    out.append(Tensor(f"{prefix}norm.weight", (h,), "text"))
    if not tied:
        out.append(Tensor("lm_head.weight", (t.vocab_size, h), "head"))
    return out


def _linear(name: str, out_f: int, in_f: int) -> list[Tensor]:
    return [Tensor(f"{name}.weight", (out_f, in_f), "vision"), Tensor(f"{name}.bias", (out_f,), "vision")]


def _norm(name: str, dim: int, bias: bool) -> list[Tensor]:
    return [Tensor(f"{name}.weight", (dim,), "vision")] + ([Tensor(f"{name}.bias", (dim,), "vision")] if bias else [])


def _vision_tensors(v: VisionShape) -> list[Tensor]:
    h, m = v.hidden_size, v.hidden_size * v.spatial_merge_size ** 2
    p = "model.visual."
    patch = (h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    out = [Tensor(f"{p}patch_embed.proj.weight", patch, "vision")]
    layer_norm = v.kind != "qwen2_5_vl"  # Qwen2.5-VL uses RMSNorm (no bias) in the vision tower
    if v.kind in QWEN3_VL:
        out.append(Tensor(f"{p}patch_embed.proj.bias", (h,), "vision"))
        out.append(Tensor(f"{p}pos_embed.weight", (v.num_position_embeddings, h), "vision"))
    for i in range(v.depth):
        b = f"{p}blocks.{i}."
        out += _norm(f"{b}norm1", h, layer_norm) + _norm(f"{b}norm2", h, layer_norm)
        out += _linear(f"{b}attn.qkv", 3 * h, h) + _linear(f"{b}attn.proj", h, h)
        if v.kind == "qwen2_vl":
            out += _linear(f"{b}mlp.fc1", v.intermediate_size, h) + _linear(f"{b}mlp.fc2", h, v.intermediate_size)
        elif v.kind == "qwen2_5_vl":
            out += (_linear(f"{b}mlp.gate_proj", v.intermediate_size, h) + _linear(f"{b}mlp.up_proj", v.intermediate_size, h)
                    + _linear(f"{b}mlp.down_proj", h, v.intermediate_size))
        else:
            out += _linear(f"{b}mlp.linear_fc1", v.intermediate_size, h) + _linear(f"{b}mlp.linear_fc2", h, v.intermediate_size)
    if v.kind in QWEN3_VL:
        mergers = [(f"{p}merger", h)] + [(f"{p}deepstack_merger_list.{i}", m) for i in range(v.deepstack_layers)]
        for name, norm_dim in mergers:
            out += (_norm(f"{name}.norm", norm_dim, True) + _linear(f"{name}.linear_fc1", m, m)
                    + _linear(f"{name}.linear_fc2", v.out_hidden_size, m))
    else:
        out += _norm(f"{p}merger.ln_q", h, layer_norm)
        out += _linear(f"{p}merger.mlp.0", m, m) + _linear(f"{p}merger.mlp.2", v.out_hidden_size, m)
    return out


def _glm4v_text_tensors(t: TextShape, tied: bool) -> list[Tensor]:
    """GLM-4's decoder: q/k/v with biases, o without, one fused gate_up_proj, and four RMSNorms per layer (after
    attention and after the MLP too)."""
    h, q, kv, i_size = t.hidden_size, t.num_heads * t.head_dim, t.kv_dim, t.dense_intermediate_size
    out = [Tensor("model.language_model.embed_tokens.weight", (t.vocab_size, h), "text")]
    for i in range(t.num_layers):
        p = f"model.language_model.layers.{i}."
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out += [Tensor(f"{p}self_attn.{name}.weight", (rows, h), "text"),
                    Tensor(f"{p}self_attn.{name}.bias", (rows,), "text")]
        out += [Tensor(f"{p}self_attn.o_proj.weight", (h, q), "text"),
                Tensor(f"{p}mlp.gate_up_proj.weight", (2 * i_size, h), "text"),
                Tensor(f"{p}mlp.down_proj.weight", (h, i_size), "text")]
        out += [Tensor(f"{p}{norm}.weight", (h,), "text") for norm in
                ("input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm", "post_mlp_layernorm")]
    out.append(Tensor("model.language_model.norm.weight", (h,), "text"))
    if not tied:
        out.append(Tensor("lm_head.weight", (t.vocab_size, h), "head"))
    return out


def _glm4v_vision_tensors(v: VisionShape) -> list[Tensor]:
    """GLM-4.1V's tower: a learned position table, RMSNorm blocks whose gated MLP is out_hidden_size wide (no
    biases), a 2x2 convolution down to out_hidden_size, and a merger with a projection, a LayerNorm and a gated MLP
    of vision_config.intermediate_size."""
    h, o, p = v.hidden_size, v.out_hidden_size, "model.visual."
    out = [Tensor(f"{p}embeddings.position_embedding.weight", (v.num_position_embeddings, h), "vision"),
           Tensor(f"{p}patch_embed.proj.weight", (h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
                  "vision"),
           Tensor(f"{p}patch_embed.proj.bias", (h,), "vision")]
    for i in range(v.depth):
        b = f"{p}blocks.{i}."
        out += [Tensor(f"{b}norm1.weight", (h,), "vision"), Tensor(f"{b}norm2.weight", (h,), "vision"),
                Tensor(f"{b}attn.qkv.weight", (3 * h, h), "vision")]
        if v.attention_bias:
            out.append(Tensor(f"{b}attn.qkv.bias", (3 * h,), "vision"))
        out += [Tensor(f"{b}attn.proj.weight", (h, h), "vision"),
                Tensor(f"{b}mlp.gate_proj.weight", (v.intermediate_size, h), "vision"),
                Tensor(f"{b}mlp.up_proj.weight", (v.intermediate_size, h), "vision"),
                Tensor(f"{b}mlp.down_proj.weight", (h, v.intermediate_size), "vision")]
    m, merge = v.merger_intermediate_size, v.spatial_merge_size
    out += [Tensor(f"{p}merger.proj.weight", (o, o), "vision"),
            Tensor(f"{p}merger.post_projection_norm.weight", (o,), "vision"),
            Tensor(f"{p}merger.post_projection_norm.bias", (o,), "vision"),
            Tensor(f"{p}merger.gate_proj.weight", (m, o), "vision"),
            Tensor(f"{p}merger.up_proj.weight", (m, o), "vision"),
            Tensor(f"{p}merger.down_proj.weight", (o, m), "vision"),
            Tensor(f"{p}post_conv_layernorm.weight", (h,), "vision"),
            Tensor(f"{p}downsample.weight", (o, h, merge, merge), "vision"),
            Tensor(f"{p}downsample.bias", (o,), "vision"),
            Tensor(f"{p}post_layernorm.weight", (h,), "vision")]
    return out


def _gemma3_text_tensors(t: TextShape, tied: bool) -> list[Tensor]:
    """Gemma 3's decoder: no biases, RMSNorm on each q and k head, a gated MLP, four norms a layer (before and after
    attention and the MLP)."""
    h, q, kv, i_size = t.hidden_size, t.num_heads * t.head_dim, t.kv_dim, t.dense_intermediate_size
    out = [Tensor("model.language_model.embed_tokens.weight", (t.vocab_size, h), "text")]
    for i in range(t.num_layers):
        p = f"model.language_model.layers.{i}."
        out += [Tensor(f"{p}self_attn.q_proj.weight", (q, h), "text"),
                Tensor(f"{p}self_attn.k_proj.weight", (kv, h), "text"),
                Tensor(f"{p}self_attn.v_proj.weight", (kv, h), "text"),
                Tensor(f"{p}self_attn.o_proj.weight", (h, q), "text"),
                Tensor(f"{p}self_attn.q_norm.weight", (t.head_dim,), "text"),
                Tensor(f"{p}self_attn.k_norm.weight", (t.head_dim,), "text"),
                Tensor(f"{p}mlp.gate_proj.weight", (i_size, h), "text"),
                Tensor(f"{p}mlp.up_proj.weight", (i_size, h), "text"),
                Tensor(f"{p}mlp.down_proj.weight", (h, i_size), "text")]
        out += [Tensor(f"{p}{norm}.weight", (h,), "text") for norm in
                ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm")]
    out.append(Tensor("model.language_model.norm.weight", (h,), "text"))
    if not tied:
        out.append(Tensor("lm_head.weight", (t.vocab_size, h), "head"))
    return out


def _siglip_tensors(v: VisionShape) -> list[Tensor]:
    """Gemma 3's SigLIP tower (no pooling head, as released) and its projector (a bare [vision, text] weight after an
    RMSNorm): every image is image_size^2 pixels whatever its own size."""
    h = v.hidden_size
    return _siglip_tower(v) + [
        Tensor("model.multi_modal_projector.mm_input_projection_weight", (h, v.out_hidden_size), "vision"),
        Tensor("model.multi_modal_projector.mm_soft_emb_norm.weight", (h,), "vision")]


def _siglip_tower(v: VisionShape, p: str = "model.vision_tower.") -> list[Tensor]:
    """A SigLIP vision tower without its pooling head (Gemma 3, LLaVA-OneVision, SmolVLM's `model.vision_model`)."""
    h = v.hidden_size
    out = [
        Tensor(f"{p}embeddings.patch_embedding.weight", (h, v.in_channels, v.patch_size, v.patch_size), "vision"),
        Tensor(f"{p}embeddings.patch_embedding.bias", (h,), "vision"),
        Tensor(f"{p}embeddings.position_embedding.weight", (v.num_position_embeddings, h), "vision")]
    for i in range(v.depth):
        b = f"{p}encoder.layers.{i}."
        out += _norm(f"{b}layer_norm1", h, True)
        for name in ("k_proj", "v_proj", "q_proj", "out_proj"):
            out += _linear(f"{b}self_attn.{name}", h, h)
        out += _norm(f"{b}layer_norm2", h, True)
        out += _linear(f"{b}mlp.fc1", v.intermediate_size, h) + _linear(f"{b}mlp.fc2", h, v.intermediate_size)
    out += _norm(f"{p}post_layernorm", h, True)
    return out


def _llava_onevision_vision_tensors(v: VisionShape) -> list[Tensor]:
    """LLaVA-OneVision: its SigLIP tower, a 2-layer MLP projector (with biases) to the text width, and the learned
    `image_newline` vector ending each row of an anyres image's features."""
    o, p = v.out_hidden_size, "model.multi_modal_projector."
    return ([Tensor("model.image_newline", (o,), "vision")] + _siglip_tower(v)
            + _linear(f"{p}linear_1", o, v.hidden_size) + _linear(f"{p}linear_2", o, o))


def _internvl_vision_tensors(v: VisionShape) -> list[Tensor]:
    """InternVL's InternViT: a CLS token, an absolute position table over a tile's patches + CLS, blocks with q/k/v
    (biased when attention_bias), a projection, an MLP, two norms and two layer-scale vectors; and the projector: a
    LayerNorm over the pixel-shuffled features (hidden / downsample_ratio^2 wide) and a 2-layer MLP."""
    h, p = v.hidden_size, "model.vision_tower."
    out = [Tensor(f"{p}embeddings.cls_token", (1, 1, h), "vision"),
           Tensor(f"{p}embeddings.position_embeddings", (1, v.num_position_embeddings + 1, h), "vision"),
           Tensor(f"{p}embeddings.patch_embeddings.projection.weight", (h, v.in_channels, v.patch_size, v.patch_size),
                  "vision"),
           Tensor(f"{p}embeddings.patch_embeddings.projection.bias", (h,), "vision")]
    for i in range(v.depth):
        b = f"{p}encoder.layer.{i}."
        out += [Tensor(f"{b}lambda_1", (h,), "vision"), Tensor(f"{b}lambda_2", (h,), "vision")]
        for name in ("q_proj", "k_proj", "v_proj"):
            out += _linear(f"{b}attention.{name}", h, h) if v.attention_bias else \
                [Tensor(f"{b}attention.{name}.weight", (h, h), "vision")]
        out += _linear(f"{b}attention.projection_layer", h, h)
        if v.qk_norm:
            out += [Tensor(f"{b}attention.q_norm.weight", (h,), "vision"),
                    Tensor(f"{b}attention.k_norm.weight", (h,), "vision")]
        out += _linear(f"{b}mlp.fc1", v.intermediate_size, h) + _linear(f"{b}mlp.fc2", h, v.intermediate_size)
        out += _norm(f"{b}layernorm_before", h, v.layer_norm) + _norm(f"{b}layernorm_after", h, v.layer_norm)
    if v.final_norm:
        out += _norm(f"{p}layernorm", h, v.layer_norm)
    shuffled, o, q = h * v.spatial_merge_size ** 2, v.out_hidden_size, "model.multi_modal_projector."
    return out + _norm(f"{q}layer_norm", shuffled, True) + _linear(f"{q}linear_1", o, shuffled) + \
        _linear(f"{q}linear_2", o, o)
