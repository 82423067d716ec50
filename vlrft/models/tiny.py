"""Build tiny VLMs locally: random weights, a locally trained tokenizer, the family's own chat template.

Families: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE (ChatML, `<|image_pad|>`; the MoE one with Qwen3-VL's
vision tower and processor and a sparse-expert MLP in every decoder layer, as the released Qwen3-VL-30B-A3B), Gemma 3
(`<start_of_turn>`, a SigLIP tower whose image is always mm_tokens_per_image `<image_soft_token>`s, sliding and
global attention layers) and GLM-4.1V (`[gMASK]<sop>`, `<|user|>`,
`<|begin_of_image|><|image|><|end_of_image|>`, GLM-4's pre-tokenizer, `<|endoftext|>` / `<|user|>` /
`<|observation|>` ending a turn as the released GLM-4.1V-9B-Thinking's generation_config does); InternVL 3 and
LLaVA-OneVision (ChatML over Qwen2's tokenizer and a Qwen2 language model; InternVL: an image as up to 4 tiles + a
thumbnail of `<IMG_CONTEXT>`s between `<img>` and `</img>`; LLaVA-OneVision: `<image>` expanded to anyres crops);
SmolVLM (`<|im_start|>User:`, `<end_of_utterance>`, images split into 32 x 32 tiles of 4 `<image>` tokens each plus
the whole image, a SigLIP-style tower, the pixel-shuffle connector and a Llama).

Tests, the demo and the benchmarks need a real `transformers` VLM and processor but no hub access.
`build_tiny_vlm` writes a folder that `from_pretrained` (and `vlrft.models.load_policy`) reads like
any Hub checkpoint. Everything is deterministic: the same spec gives bitwise the same folder content.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from vlrft.models.chat_template import (GEMMA3_CHAT_TEMPLATE, GLM4V_CHAT_TEMPLATE, INTERNVL_CHAT_TEMPLATE,
                                        LLAVA_ONEVISION_CHAT_TEMPLATE, QWEN_VL_CHAT_TEMPLATE, SMOLVLM_CHAT_TEMPLATE)
from vlrft.models.tiny_tokenizers import build_tokenizer
from vlrft.vision_stack import has_torchvision

Arch = Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "gemma3", "internvl",
               "llava_onevision", "smolvlm"]
ARCHES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "gemma3", "internvl",
                           "llava_onevision", "smolvlm")


@dataclass(frozen=True)
class TinySpec:
    """Sizes of a tiny VLM. Defaults make a model of about 0.3 M parameters that builds in < 1 s."""

    arch: Arch = "qwen2_vl"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vision_depth: int = 2
    vision_hidden_size: int = 32
    vision_heads: int = 2
    vocab_size: int = 512
    # Image processor bounds (pixels); small so tests and the demo stay fast.
    min_pixels: int = 28 * 28
    max_pixels: int = 28 * 28 * 16
    seed: int = 0
    tie_word_embeddings: bool = False
    # Qwen3-VL-MoE's experts: every decoder layer's MLP is `num_experts` SiLU-gated experts of
    # `moe_intermediate_size`, `num_experts_per_tok` of them picked per token by a linear router.
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    extra: dict = field(default_factory=dict)

    @property
    def patch_size(self) -> int:
        return 16 if self.arch in ("qwen3_vl", "qwen3_vl_moe") else 14

    @property
    def family(self) -> str:
        """'glm4v', 'gemma3' or 'qwen' (the tokenizer, chat template and special tokens the four Qwen families
        share)."""
        return self.arch if self.arch in ("glm4v", "gemma3", "internvl", "llava_onevision", "smolvlm") else "qwen"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


GEMMA3_IMAGE_SIZE = 32  # tiny SigLIP: 32 x 32 pixels in patches of 8, pooled 2 x 2 to 4 tokens an image


def _build_gemma3_processor(spec: "TinySpec"):
    """Gemma 3's processor: its image processor resizing every image to the tower's square (no pan-and-scan), and
    `image_seq_length` soft tokens per image."""
    from transformers import Gemma3Processor

    size = {"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE}
    if has_torchvision():
        from transformers import Gemma3ImageProcessor

        image_processor = Gemma3ImageProcessor(size=size, do_pan_and_scan=False)
    else:
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        image_processor = Gemma3ImageProcessorPil(size=size, do_pan_and_scan=False)
    return Gemma3Processor(image_processor=image_processor, tokenizer=build_tokenizer(spec.vocab_size, "gemma3"),
                           chat_template=GEMMA3_CHAT_TEMPLATE, image_seq_length=4)


def _build_gemma3_config(spec: TinySpec, tokenizer):
    """Gemma3Config with the released layout at tiny sizes: sliding-window and global layers, head_dim and
    query_pre_attn_scalar set apart from hidden / heads, tied embeddings, a SigLIP tower pooled to 4 tokens."""
    from transformers import Gemma3Config

    ids = tokenizer.convert_tokens_to_ids
    text = dict(vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, query_pre_attn_scalar=spec.head_dim,
                sliding_window=16, layer_types=["sliding_attention"] * (spec.num_layers - 1) + ["full_attention"],
                max_position_embeddings=4096, pad_token_id=ids("<pad>"), bos_token_id=ids("<bos>"),
                eos_token_id=[ids("<eos>"), ids("<end_of_turn>")])
    vision = dict(hidden_size=spec.vision_hidden_size, intermediate_size=2 * spec.vision_hidden_size,
                  num_hidden_layers=spec.vision_depth, num_attention_heads=spec.vision_heads,
                  image_size=GEMMA3_IMAGE_SIZE, patch_size=8, vision_use_head=False)  # as released: no pooling head
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                        boi_token_index=ids("<start_of_image>"), eoi_token_index=ids("<end_of_image>"),
                        image_token_index=ids("<image_soft_token>"), tie_word_embeddings=True, **spec.extra)


INTERNVL_TILE = 32  # tiny InternViT: 32 x 32 tiles in patches of 8, pixel-shuffled (0.5) to 4 tokens a tile


def _build_internvl_processor(spec: "TinySpec"):
    """InternVL 3's processor: GOT-OCR2's image processor cutting an image into up to 4 square tiles by its aspect
    ratio (plus a thumbnail when there are several), 4 `<IMG_CONTEXT>` tokens a tile; with torchvision its video
    processor too."""
    from transformers import InternVLProcessor

    tiles = dict(size={"height": INTERNVL_TILE, "width": INTERNVL_TILE}, crop_to_patches=True, min_patches=1,
                 max_patches=4)
    if has_torchvision():
        from transformers import GotOcr2ImageProcessor, InternVLVideoProcessor

        image_processor = GotOcr2ImageProcessor(**tiles)
        video_processor = InternVLVideoProcessor(size=tiles["size"])
        processor_cls = InternVLProcessor
    else:
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

        from vlrft.models.loading import _image_only_processor_class

        image_processor, video_processor = GotOcr2ImageProcessorPil(**tiles), None
        processor_cls = _image_only_processor_class(InternVLProcessor)
    return processor_cls(image_processor=image_processor, tokenizer=build_tokenizer(spec.vocab_size, "internvl"),
                         video_processor=video_processor, image_seq_length=4, chat_template=INTERNVL_CHAT_TEMPLATE)


def _build_internvl_config(spec: TinySpec, tokenizer):
    """InternVLConfig with InternVL 3's layout at tiny sizes: an InternViT tower (layer scale, no qk norm, mean
    pooling off, CLS token dropped) whose last layer is pixel-shuffled by 0.5 into a 2-layer MLP projector, and a Qwen2
    language model with q/k/v biases."""
    from transformers import InternVLConfig

    ids = tokenizer.convert_tokens_to_ids
    text = dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
                intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                max_position_embeddings=4096, bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
                pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=spec.tie_word_embeddings)
    vision = dict(hidden_size=spec.vision_hidden_size, intermediate_size=2 * spec.vision_hidden_size,
                  num_hidden_layers=spec.vision_depth, num_attention_heads=spec.vision_heads,
                  image_size=[INTERNVL_TILE, INTERNVL_TILE], patch_size=[8, 8], use_qk_norm=False,
                  use_mean_pooling=True, layer_scale_init_value=0.1)
    return InternVLConfig(vision_config=vision, text_config=text, image_token_id=ids("<IMG_CONTEXT>"),
                          image_seq_length=4, downsample_ratio=0.5, projector_hidden_act="gelu",
                          vision_feature_layer=-1, vision_feature_select_strategy="default",
                          tie_word_embeddings=spec.tie_word_embeddings, **spec.extra)


LLAVA_ONEVISION_CROP = 16  # tiny SigLIP: 16 x 16 crops in patches of 8, 4 tokens a crop
# anyres grids (as the released 384 x 384 crops' pinpoints, at the tiny crop): up to 2 x 2 crops besides the base
LLAVA_ONEVISION_PINPOINTS = [[16, 16], [16, 32], [32, 16], [32, 32]]


def _build_llava_onevision_processor(spec: "TinySpec"):
    """LLaVA-OneVision's processor: an image alone in its prompt is the whole image resized to one crop plus the
    crops of the best anyres grid (`image_sizes` tells the model how to unpad their features); each image of a
    multi-image prompt is one crop padded to a square. With torchvision its video processor too."""
    from transformers import LlavaOnevisionProcessor

    crop = {"height": LLAVA_ONEVISION_CROP, "width": LLAVA_ONEVISION_CROP}
    images = dict(size=crop, image_grid_pinpoints=LLAVA_ONEVISION_PINPOINTS)
    if has_torchvision():
        from transformers import LlavaOnevisionImageProcessor, LlavaOnevisionVideoProcessor

        image_processor = LlavaOnevisionImageProcessor(**images)
        video_processor = LlavaOnevisionVideoProcessor(size=crop)
        processor_cls = LlavaOnevisionProcessor
    else:
        from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
            LlavaOnevisionImageProcessorPil)

        from vlrft.models.loading import _image_only_processor_class

        image_processor, video_processor = LlavaOnevisionImageProcessorPil(**images), None
        processor_cls = _image_only_processor_class(LlavaOnevisionProcessor)
    return processor_cls(image_processor=image_processor,
                         tokenizer=build_tokenizer(spec.vocab_size, "llava_onevision"),
                         video_processor=video_processor, num_image_tokens=4, vision_feature_select_strategy="full",
                         vision_aspect_ratio="anyres_max_9", chat_template=LLAVA_ONEVISION_CHAT_TEMPLATE)


def _build_llava_onevision_config(spec: TinySpec, tokenizer):
    """LlavaOnevisionConfig with the released layout at tiny sizes: a SigLIP tower without pooling head, all its
    patch features ("full"), a 2-layer MLP projector, an image_newline vector, anyres_max_9 and a Qwen2 language
    model."""
    from transformers import LlavaOnevisionConfig

    ids = tokenizer.convert_tokens_to_ids
    text = dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
                intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                max_position_embeddings=4096, bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
                pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=spec.tie_word_embeddings)
    vision = dict(model_type="siglip_vision_model", hidden_size=spec.vision_hidden_size,
                  intermediate_size=2 * spec.vision_hidden_size, num_hidden_layers=spec.vision_depth,
                  num_attention_heads=spec.vision_heads, image_size=LLAVA_ONEVISION_CROP, patch_size=8,
                  vision_use_head=False)
    return LlavaOnevisionConfig(vision_config=vision, text_config=text, image_token_index=ids("<image>"),
                                video_token_index=ids("<video>"), vision_feature_select_strategy="full",
                                vision_feature_layer=-1, vision_aspect_ratio="anyres_max_9",
                                image_grid_pinpoints=LLAVA_ONEVISION_PINPOINTS,
                                tie_word_embeddings=spec.tie_word_embeddings, **spec.extra)


# Tiny SmolVLM: 32 x 32 tiles in patches of 8, pixel-shuffled 2 x 2 to 4 `<image>` tokens a tile; the longest edge
# resized to 64, so an image is 2 x 1 or 2 x 2 tiles plus its global 32 x 32 view.
SMOLVLM_TILE, SMOLVLM_LONGEST_EDGE = 32, 64


def _build_smolvlm_processor(spec: "TinySpec"):
    """SmolVLM's processor: image splitting into max_image_size tiles plus the global image (PIL backend without
    torchvision, then no video processor), image_seq_len `<image>` tokens a tile."""
    from transformers import SmolVLMProcessor

    sizes = dict(size={"longest_edge": SMOLVLM_LONGEST_EDGE}, max_image_size={"longest_edge": SMOLVLM_TILE},
                 do_image_splitting=True)
    processor_cls = SmolVLMProcessor
    if has_torchvision():
        from transformers import SmolVLMImageProcessor, SmolVLMVideoProcessor

        image_processor, video_processor = SmolVLMImageProcessor(**sizes), SmolVLMVideoProcessor(**sizes)
    else:
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

        from vlrft.models.loading import _image_only_processor_class

        image_processor, video_processor = SmolVLMImageProcessorPil(**sizes), None
        processor_cls = _image_only_processor_class(SmolVLMProcessor)
    return processor_cls(image_processor=image_processor, tokenizer=build_tokenizer(spec.vocab_size, "smolvlm"),
                         video_processor=video_processor, image_seq_len=4, chat_template=SMOLVLM_CHAT_TEMPLATE)


def _build_smolvlm_config(spec: TinySpec, tokenizer):
    """SmolVLMConfig as released (SmolVLM2): a Llama language model, a SigLIP-style tower over 32 x 32 tiles and the
    pixel-shuffle connector (scale_factor 2: 16 patches to 4 tokens a tile)."""
    from transformers import SmolVLMConfig

    ids = tokenizer.convert_tokens_to_ids
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
                intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                max_position_embeddings=4096, rms_norm_eps=1e-5, pad_token_id=ids("<|im_end|>"),
                bos_token_id=ids("<|im_start|>"), eos_token_id=ids("<end_of_utterance>"),
                tie_word_embeddings=spec.tie_word_embeddings)
    vision = dict(hidden_size=spec.vision_hidden_size, intermediate_size=2 * spec.vision_hidden_size,
                  num_hidden_layers=spec.vision_depth, num_attention_heads=spec.vision_heads,
                  image_size=SMOLVLM_TILE, patch_size=8)
    return SmolVLMConfig(text_config=text, vision_config=vision, scale_factor=2, image_token_id=ids("<image>"),
                         tie_word_embeddings=spec.tie_word_embeddings, **spec.extra)


def _build_glm4v_processor(spec: "TinySpec"):
    """GLM-4.1V's processor: its image (and, with torchvision, video) processor from a config dict as in its
    preprocessor_config.json. Its resize bounds count the two temporal frames of an image (`smart_resize` compares
    t * h * w with them), so they are twice the pixel bounds of the Qwen tiny models."""
    from transformers import Glm4vProcessor

    tokenizer = build_tokenizer(spec.vocab_size, "glm4v")
    vision = dict(patch_size=spec.patch_size, temporal_patch_size=2, merge_size=2)
    size = {"shortest_edge": 2 * spec.min_pixels, "longest_edge": 2 * spec.max_pixels}
    if has_torchvision():
        from transformers import Glm4vImageProcessor, Glm4vVideoProcessor

        image_processor = Glm4vImageProcessor(size=size, **vision)
        video_processor = Glm4vVideoProcessor(size=size, max_image_size={"longest_edge": 2 * spec.max_pixels},
                                              **vision)
        processor_cls = Glm4vProcessor
    else:
        from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

        from vlrft.models.loading import _image_only_processor_class

        image_processor, video_processor = Glm4vImageProcessorPil(size=size, **vision), None
        processor_cls = _image_only_processor_class(Glm4vProcessor)
    return processor_cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
                         chat_template=GLM4V_CHAT_TEMPLATE)


def build_processor(spec: TinySpec = TinySpec()):
    """The real transformers processor for `spec.arch`, with the PIL image backend when torchvision is absent."""
    if spec.family == "glm4v":
        return _build_glm4v_processor(spec)
    if spec.family == "gemma3":
        return _build_gemma3_processor(spec)
    if spec.family == "internvl":
        return _build_internvl_processor(spec)
    if spec.family == "llava_onevision":
        return _build_llava_onevision_processor(spec)
    if spec.family == "smolvlm":
        return _build_smolvlm_processor(spec)
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor

    qwen3 = spec.arch in ("qwen3_vl", "qwen3_vl_moe")  # Qwen3-VL-MoE ships Qwen3-VL's processor
    tokenizer = build_tokenizer(spec.vocab_size)
    size = {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}
    vision = dict(patch_size=spec.patch_size, temporal_patch_size=2, merge_size=2)
    if has_torchvision():
        from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor, Qwen3VLVideoProcessor

        image_processor = Qwen2VLImageProcessor(size=size, **vision)
        video_cls = Qwen3VLVideoProcessor if qwen3 else Qwen2VLVideoProcessor
        video_processor = video_cls(size=size, **vision)
    else:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        image_processor = Qwen2VLImageProcessorPil(size=size, **vision)
        video_processor = None
    processor_cls = (Qwen3VLProcessor if qwen3
                     else {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor}[spec.arch])
    if video_processor is None:
        from vlrft.models.loading import _image_only_processor_class

        processor_cls = _image_only_processor_class(processor_cls)
    return processor_cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=QWEN_VL_CHAT_TEMPLATE,
    )


def _build_glm4v_config(spec: TinySpec, tokenizer):
    """Glm4vConfig with the released GLM-4.1V's layout at tiny sizes: half the head dim rotated, M-RoPE sections
    over the rotated half, the vision MLP as wide as the text hidden size (`out_hidden_size`)."""
    from transformers import Glm4vConfig

    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in [
        ("image_token_id", "<|image|>"), ("video_token_id", "<|video|>"),
        ("image_start_token_id", "<|begin_of_image|>"), ("image_end_token_id", "<|end_of_image|>"),
        ("video_start_token_id", "<|begin_of_video|>"), ("video_end_token_id", "<|end_of_video|>"),
    ]}
    half = spec.head_dim // 4  # rotary half-dim of the rotated half (partial_rotary_factor 0.5)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    text = dict(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=4096, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
        # as the released config says: transformers' GLM-4.1V always has q/k/v biases, vLLM's only when this is set
        # (without it vLLM's loaders drop those biases at every weight sync)
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]},
    )
    vision = dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden_size, num_heads=spec.vision_heads,
                  out_hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                  patch_size=spec.patch_size, image_size=spec.patch_size * 8, spatial_merge_size=2,
                  temporal_patch_size=2)
    return Glm4vConfig(text_config=text, vision_config=vision, tie_word_embeddings=spec.tie_word_embeddings, **ids,
                       **spec.extra)


def build_config(spec: TinySpec, tokenizer):
    """The transformers config for `spec`, with token ids taken from the tokenizer."""
    if spec.family == "glm4v":
        return _build_glm4v_config(spec, tokenizer)
    if spec.family == "gemma3":
        return _build_gemma3_config(spec, tokenizer)
    if spec.family == "internvl":
        return _build_internvl_config(spec, tokenizer)
    if spec.family == "llava_onevision":
        return _build_llava_onevision_config(spec, tokenizer)
    if spec.family == "smolvlm":
        return _build_smolvlm_config(spec, tokenizer)
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig, Qwen3VLMoeConfig

    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in [
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ]}
    half = spec.head_dim // 2  # M-RoPE splits the rotary half-dim across (t, h, w)
    mrope_section = [half - 2 * (half // 3), half // 3, half // 3]
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    if spec.arch == "qwen2_vl":
        vision = dict(depth=spec.vision_depth, embed_dim=spec.vision_hidden_size, hidden_size=spec.hidden_size,
                      num_heads=spec.vision_heads, mlp_ratio=2, patch_size=spec.patch_size)
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section}
        cls = Qwen2VLConfig
    elif spec.arch == "qwen2_5_vl":
        vision = dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden_size, out_hidden_size=spec.hidden_size,
                      intermediate_size=2 * spec.vision_hidden_size, num_heads=spec.vision_heads,
                      patch_size=spec.patch_size, window_size=112,
                      fullatt_block_indexes=[spec.vision_depth - 1])
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section}
        cls = Qwen2_5_VLConfig
    else:
        vision = dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden_size, out_hidden_size=spec.hidden_size,
                      intermediate_size=2 * spec.vision_hidden_size, num_heads=spec.vision_heads,
                      patch_size=spec.patch_size, num_position_embeddings=64,
                      deepstack_visual_indexes=[0])
        text["head_dim"] = spec.head_dim
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section,
                                   "mrope_interleaved": True}
        cls = Qwen3VLConfig
        if spec.arch == "qwen3_vl_moe":  # the released 30B-A3B's layout: experts in every layer, top-k renormalised
            text.update(num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                        moe_intermediate_size=spec.moe_intermediate_size, decoder_sparse_step=1, mlp_only_layers=[])
            cls = Qwen3VLMoeConfig
    return cls(text_config=text, vision_config=vision, tie_word_embeddings=spec.tie_word_embeddings, **ids, **spec.extra)


def build_tiny_model(spec: TinySpec, tokenizer):
    """Random-weight model for `spec`, initialised under `spec.seed` so it is the same on every machine."""
    from transformers import AutoModelForImageTextToText

    config = build_config(spec, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
        if spec.arch == "gemma3":  # transformers starts the projector at zero: images would not reach the logits
            with torch.no_grad():
                model.model.multi_modal_projector.mm_input_projection_weight.normal_(
                    std=config.text_config.initializer_range)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = getattr(config.text_config, "bos_token_id", None)
    return model


def _release_vision_names(path: Path) -> None:
    """LLaVA-OneVision's SigLIP tower under its released names (`vision_tower.vision_model.*`, llava-hf's checkpoints):
    transformers 5 keeps it without `vision_model` in memory and saves a model built from a config so, which vLLM's
    loader refuses; a model loaded from the released layout is saved (and synced) in that layout again."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    renamed = {("vision_tower.vision_model." + name.removeprefix("vision_tower."))
               if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model.") else name: value
               for name, value in tensors.items()}
    save_file(renamed, str(path), metadata={"format": "pt"})


def build_tiny_vlm(out_dir: str | Path, spec: TinySpec = TinySpec()) -> Path:
    """Build a tiny `spec.arch` model + processor and save both to `out_dir` with `save_pretrained`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    processor = build_processor(spec)
    model = build_tiny_model(spec, processor.tokenizer)
    model.save_pretrained(out)
    if spec.arch == "llava_onevision":
        _release_vision_names(out / "model.safetensors")
    processor.save_pretrained(out)
    (out / "vlrft_tiny_spec.json").write_text(json.dumps(asdict(spec), indent=2, sort_keys=True))
    return out
