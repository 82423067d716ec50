"""Same vision-tower calls on every rank: a forward without images runs the tower on a tiny dummy image.

Under a sharding strategy (FSDP2, DeepSpeed ZeRO) each vision block gathers its weights from all
ranks when it runs, in forward and again in backward: a collective. A rank whose micro-batch has
no image (a text-only prompt) would skip the tower, and the rank that has one would wait forever
in the vision block's all-gather. So before a forward that encodes prompts, the ranks agree on
which visual kinds (images, videos) some rank encodes in this forward; a rank without that kind
runs the tower once on the smallest input the model accepts (one image of one merged token,
`spatial_merge_size`² patches) at the point where real images are encoded, and adds
`0 * sum(output)` to the language model's input embeddings. The term adds exactly nothing to
values and gradients (the tower's gradient from it is zero, and the gradients of the ranks that
encoded real images are summed with those zeros), but the tower's blocks now run, forward and
backward, on every rank the same number of times, in the same order relative to the other modules.

When no rank has a kind in a forward, nobody runs the tower for it, so a text-only run costs
nothing and gradients stay exactly those of one process (an unused tower keeps `grad=None`).

Multi-turn training encodes the images tools returned mid-trajectory in a second pass (the
continuation after the shared prompt pass), so a forward can run the tower twice: the ranks agree
on both passes in the same all-reduce (`VisualKinds.later_*`), and a rank whose rows got no tool
image runs the dummy in its continuation pass when another rank's rows got one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from vlrft.vision import VisualBatch


@dataclass(frozen=True)
class VisualKinds:
    """Which visual kinds a forward encodes (images, videos), and which it encodes in a later pass.

    The later pass is multi-turn training's continuation pass, which encodes the images tools
    returned mid-trajectory (`SequenceBatch.completion_visual`) after the prompts' pass: the tower
    runs once per kind in each pass, so ranks agree on both passes at once (one all-reduce).
    """

    images: bool = False
    videos: bool = False
    later_images: bool = False
    later_videos: bool = False

    @classmethod
    def of(cls, visual: VisualBatch, later: VisualBatch | None = None) -> "VisualKinds":
        return cls(visual.num_images > 0, visual.num_videos > 0,
                   later is not None and later.num_images > 0, later is not None and later.num_videos > 0)

    def lacking(self, anyone: "VisualKinds") -> "VisualKinds":
        """The kinds `anyone` (some rank) encodes and this forward does not: those the tower runs on a dummy for."""
        return VisualKinds(*(a and not o for a, o in zip(dataclasses.astuple(anyone), dataclasses.astuple(self))))

    def merged(self) -> "VisualKinds":
        """The kinds of one pass that encodes the prompts' images and the tools' together."""
        return VisualKinds(self.images or self.later_images, self.videos or self.later_videos)

    @property
    def first_pass(self) -> bool:
        return self.images or self.videos

    @property
    def later_pass(self) -> bool:
        return self.later_images or self.later_videos


# Given this rank's kinds, the kinds some rank has in the same forward (an all-reduce over ranks).
AgreeOnKinds = Callable[[VisualKinds], VisualKinds]


def language_model_of(backbone: nn.Module) -> nn.Module:
    """The decoder stack inside a VLM backbone (it receives the input embeddings with the visual features)."""
    for name in ("language_model", "text_model"):
        module = getattr(backbone, name, None)
        if isinstance(module, nn.Module):
            return module
    raise TypeError(f"{type(backbone).__name__} has no .language_model; sharded training of mixed text and image "
                    "prompts needs the standard transformers VLM layout")


def dummy_visual_input(model: nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(pixel values, grid_thw) of the smallest image a Qwen-VL vision tower accepts: 1 x m x m patches.

    m is the spatial merge size (2), so the tower sees 4 patches and returns one merged token. A tower without grids
    (Gemma 3's SigLIP, InternVL's InternViT, LLaVA-OneVision's SigLIP: every crop is image_size x image_size) gets
    one such crop and no grid; a tiled one (SmolVLM's: pixels [samples, tiles, C, H, W]) one sample of one such tile
    (all zero, which SmolVLM drops as padding unless, as here, no tile is real: then it encodes the first).
    """
    vision = model.config.vision_config
    if not hasattr(vision, "temporal_patch_size") and hasattr(vision, "image_size"):
        size = vision.image_size  # InternViT's is [height, width]
        height, width = (size, size) if isinstance(size, int) else size
        tiled = "pixel_attention_mask" in inspect.signature(model.get_image_features).parameters
        return torch.zeros((1,) * (1 + tiled) + (int(getattr(vision, "num_channels", 3)), height, width),
                           device=device), None
    merge = int(getattr(vision, "spatial_merge_size", 2))
    channels = int(getattr(vision, "in_channels", getattr(vision, "in_chans", 3)))
    temporal = int(getattr(vision, "temporal_patch_size", 2))
    patch = int(vision.patch_size)
    pixels = torch.zeros((merge * merge, channels * temporal * patch * patch), device=device)
    grid = torch.tensor([[1, merge, merge]], dtype=torch.long, device=device)
    return pixels, grid


def _sum_of_used_features(output) -> torch.Tensor:
    """Sum of what the language model consumes from a vision-encoder output: the merged tokens (and Qwen3-VL's
    deepstack features), nothing else, so backward reaches exactly the modules real images reach."""
    tensors = list(output.pooler_output)
    for layer in getattr(output, "deepstack_features", None) or ():
        tensors.extend(layer if isinstance(layer, (list, tuple)) else [layer])
    return sum(t.float().sum() for t in tensors)


def dummy_vision_term(model: nn.Module, kinds: VisualKinds, device: torch.device) -> torch.Tensor:
    """0 x (sum of the vision tower's outputs on a dummy image), once per kind in `kinds`: a zero that ran the tower.

    `model` is the transformers model (`get_image_features` / `get_video_features`), or a PEFT wrapper.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    pixels, grid = dummy_visual_input(base, device)
    total = torch.zeros((), device=device)
    if kinds.images:
        grids = {} if grid is None else {"image_grid_thw": grid}
        if grid is None and "image_sizes" in inspect.signature(base.get_image_features).parameters:
            # LLaVA-OneVision: two crop-sized images of one prompt, one crop each (an image alone gets anyres crops)
            grids = {"image_sizes": torch.tensor([list(pixels.shape[-2:])] * 2, device=device),
                     "batch_num_images": torch.tensor([2], device=device)}
        images = pixels.expand(2, -1, -1, -1) if "batch_num_images" in grids else pixels
        total = total + _sum_of_used_features(base.get_image_features(pixel_values=images, **grids, return_dict=True))
    if kinds.videos and hasattr(base, "get_video_features"):  # a family without videos (Gemma 3) never encodes one
        # without a grid (LLaVA-OneVision): a video of one frame, [videos, frames, channels, height, width]
        videos = {"pixel_values_videos": pixels, "video_grid_thw": grid} if grid is not None else \
            {"pixel_values_videos": pixels[None]}
        total = total + _sum_of_used_features(base.get_video_features(**videos, return_dict=True))
    return 0.0 * total


@contextlib.contextmanager
def balanced_vision_calls(model: nn.Module, backbone: nn.Module, visual: VisualBatch, agree: AgreeOnKinds | None,
                          device: torch.device, *, encoded_before_backbone: bool = False) -> Iterator[None]:
    """Context for one prompt-encoding backbone forward: run the tower on a dummy for kinds other ranks encode.

    `agree` is None for strategies that need no balancing (one process, DDP): nothing happens. Every
    rank must enter this context for the same forwards (it all-reduces once). See `dummy_vision_calls`.
    """
    if agree is None:
        yield
        return
    ours = VisualKinds.of(visual)
    with dummy_vision_calls(model, backbone, ours.lacking(agree(ours)), device,
                            encoded_before_backbone=encoded_before_backbone):
        yield


@contextlib.contextmanager
def dummy_vision_calls(model: nn.Module, backbone: nn.Module, missing: VisualKinds, device: torch.device, *,
                       later: bool = False, encoded_before_backbone: bool = False) -> Iterator[None]:
    """Context for one backbone forward that runs the tower on a dummy for the kinds in `missing`.

    `later`: the forward is the continuation pass (`missing.later_*` count), else the prompts' pass
    (`missing.images/videos`). The dummy runs where real images are encoded, so every rank calls
    the same modules in the same order (DeepSpeed ZeRO-3 checks that order across ranks): at once
    when the caller encodes images before calling the backbone (`encoded_before_backbone`), else
    inside the backbone, just before its language model. Its zero is added to the language model's
    input embeddings, so backward reaches the tower where it does for real images.
    """
    kinds = VisualKinds(missing.later_images, missing.later_videos) if later else \
        VisualKinds(missing.images, missing.videos)
    if not kinds.first_pass:
        yield
        return
    ready = dummy_vision_term(model, kinds, device) if encoded_before_backbone else None
    handle = None

    def add_dummy(module, args, kwargs):
        handle.remove()  # once: the first decoder call is the one that carries this pass's inputs
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            raise TypeError(f"{type(backbone).__name__} calls its language model without inputs_embeds; "
                            "vlrft cannot balance vision calls for it")
        term = ready if ready is not None else dummy_vision_term(model, kinds, device)
        kwargs["inputs_embeds"] = embeds + term.to(embeds.device, embeds.dtype)
        return args, kwargs

    # prepend: before any other pre-hook of the language model (ZeRO-3 records it as called when its hook runs)
    handle = language_model_of(backbone).register_forward_pre_hook(add_dummy, with_kwargs=True, prepend=True)
    try:
        yield
    finally:
        handle.remove()
