"""What vLLM and SGLang receive for a `PromptBatch`: our prompt token ids and our visual inputs, never text.

Pure Python (no engine import), so every rule here is unit-tested on CPU.

One tokenization (docs/design.md, spine rule 1), engine by engine:

* SGLang takes our prompt ids verbatim together with our processor's tensors: `input_ids` plus one
  `{"format": "processor_output", "pixel_values": ..., "image_grid_thw": ...}` item per prompt. With
  every media item in that format the engine skips its own processor and keeps `input_ids` as given
  (`load_mm_data` fast path and `process_and_combine_mm_data` in
  python/sglang/srt/multimodal/processors/base_processor.py; the format is documented in SGLang's
  "Query VLM with Offline Engine" page). `ProcessorOutput` also answers attribute access because
  SGLang versions before PR #23435 read the grids for M-RoPE with `getattr(ret, "image_grid_thw")`
  from this very dict (python/sglang/srt/multimodal/processors/qwen_vl.py).
* vLLM (V1, 0.10+) always runs its own multimodal processor on `multi_modal_data` and, for token
  prompts, replaces each `<|image_pad|>` / `<|video_pad|>` target with `prod(grid_thw) / merge**2`
  copies: `_apply_hf_processor_main` returns `is_update_applied=False` for `list[int]` prompts and
  `_apply_prompt_updates` expands every match (vllm/multimodal/processing/processor.py;
  `Qwen2VLMultiModalProcessor._get_prompt_updates` in vllm/model_executor/models/qwen2_vl.py).
  Already-expanded ids would be expanded again, and vLLM's dict inputs accept only embeddings
  (`image_embeds` + `image_grid_thw`, `Qwen2VLMultiModalDataParser`), not processed pixels. So we
  hand vLLM our ids with each run of N placeholders folded back to the one placeholder the chat
  template wrote (an id-level inverse of the processor's expansion, not a re-tokenization) and the
  PIL images our processor saw, already fitted to the patch grid so vLLM's resize is the identity.
  vLLM expands them again and `vlrft.rollout.outputs.vllm_samples` checks that the prompt ids vLLM
  ran equal ours exactly, so any difference (another grid, another template) fails loudly, naming
  the sample, instead of training on a prompt the engine never saw.

Qwen3-VL videos interleave timestamp text between frame groups; folding them needs the text, so the
vLLM path refuses them (SGLang and the transformers engine take them).

InternVL 3's processor writes `<img>` + N `<IMG_CONTEXT>` + `</img>` for an image whose prompt had one
`<IMG_CONTEXT>`, and vLLM's replacement (vllm/model_executor/models/interns1.py, which vLLM runs for
transformers' `InternVLForConditionalGeneration`) writes the `<img>` / `</img>` around the run itself,
so they are dropped with the fold (`unwrap_image_runs`). SmolVLM's processor writes an image as text: its tiles, each
`<fake_token_around_image><row_r_col_c>` and its placeholders, then `<fake_token_around_image><global-img>`, the
whole image's placeholders and `<fake_token_around_image>`; vLLM's Idefics3 processor writes the same from the one
`<image>` of the chat template, so each image's text folds to that token (`fold_tiled_images`).

LLaVA-OneVision has no grids: each image (video) must be one run, folded whatever its length, and
vLLM's `<image>` / `<video>` replacement is checked by the exact-ids check. A prompt whose images its
processor encoded together (one crop each) is refused: vLLM's processor crops every image as if alone.

Sources read (main branches, 2025-2026):
https://github.com/vllm-project/vllm/blob/main/vllm/multimodal/processing/processor.py
https://github.com/vllm-project/vllm/blob/main/vllm/model_executor/models/qwen2_vl.py
https://github.com/vllm-project/vllm/blob/main/vllm/model_executor/models/qwen3_vl.py
https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/multimodal/processors/base_processor.py
https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/multimodal/processors/qwen_vl.py
https://github.com/sgl-project/sglang/pull/23435 (M-RoPE grids of processor_output inputs)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vlrft.errors import UserError

if TYPE_CHECKING:
    import torch

    from vlrft.data import PromptBatch
    from vlrft.tokens import TokenSpec


class EngineInputError(UserError):
    """A prompt that an engine cannot be given without breaking the one-tokenization rule."""


@dataclass(frozen=True)
class PromptRequest:
    """One prompt as an engine request, with what we expect the engine to have run."""

    payload: dict[str, Any]  # the engine's own request fields for this prompt
    prompt_ids: list[int]  # our prompt ids; the engine's final prompt must equal them
    name: str  # "source (id ...)" for error messages
    seed: int | None = None  # the request's sampling seed (`vlrft.sampling.request_seed`); None: the engine's stream


def sample_name(batch: "PromptBatch", index: int) -> str:
    sample = batch.samples[index]
    return f"{sample.source} (id {sample.id!r})"


def placeholder_runs(ids: Sequence[int], token_id: int) -> list[int]:
    """Lengths of the maximal runs of `token_id` in `ids`, in order."""
    runs: list[int] = []
    previous = None
    for tok in ids:
        if tok == token_id:
            if previous == token_id:
                runs[-1] += 1
            else:
                runs.append(1)
        previous = tok
    return runs


def tokens_per_item(grid_thw: "torch.Tensor | None", merge_size: int) -> list[int]:
    """Placeholder tokens of each image (or video): prod(t, h, w) / merge_size**2."""
    if grid_thw is None:
        return []
    return [int(n) for n in (grid_thw.prod(-1) // (merge_size * merge_size)).tolist()]


def fold_vision_placeholders(ids: Sequence[int], image_token_id: int, video_token_id: int,
                             image_tokens: Sequence[int] | int, video_tokens: Sequence[int] | int,
                             name: str) -> list[int]:
    """Our prompt ids with each image's (video's) run of placeholders folded to one placeholder.

    `image_tokens[k]` is how many placeholders image k must own; every image must be exactly one
    run of that length (likewise videos), otherwise the fold would not be the inverse of the
    processor's expansion and we refuse the prompt rather than guess. A count instead of a list
    (families without grids, whose token counts follow from crops and sizes: LLaVA-OneVision) asks
    for that many runs of any length; the exact-ids check after vLLM's expansion checks the lengths.
    """
    for token_id, expected, kind in ((image_token_id, image_tokens, "image"), (video_token_id, video_tokens, "video")):
        runs = placeholder_runs(ids, token_id)
        if isinstance(expected, int):
            if len(runs) != expected:
                raise EngineInputError(f"{name}: the prompt has {len(runs)} {kind} placeholder runs ({runs} tokens "
                                       f"long) but {expected} {kind}s, each of which must be one run")
            continue
        expected = list(expected)
        if runs != expected:
            hint = (" (this model splits a video into frame groups with timestamp text between them; vLLM "
                    "re-expands placeholders itself, so such prompts cannot keep one tokenization: use "
                    "rollout.engine=sglang or rollout.engine=hf for videos)") if kind == "video" and \
                sum(runs) == sum(expected) else ""
            raise EngineInputError(f"{name}: the prompt's {kind} placeholder runs are {runs} tokens long but its "
                                   f"{kind}s need {expected}{hint}")
    folded: list[int] = []
    for tok in ids:
        if tok in (image_token_id, video_token_id) and folded and folded[-1] == tok:
            continue
        folded.append(tok)
    return folded


def unwrap_image_runs(ids: Sequence[int], token_id: int, start_id: int, end_id: int, name: str) -> list[int]:
    """Our ids without the `start_id` / `end_id` around each run of `token_id` (InternVL's `<img>` / `</img>`).

    Every run must sit between one start and one end token and every start / end around a run,
    as the processor wrote them; anything else is refused rather than guessed.
    """
    out: list[int] = []
    i = 0
    while i < len(ids):
        tok = ids[i]
        if tok == start_id:
            j = i + 1
            while j < len(ids) and ids[j] == token_id:
                j += 1
            if j == i + 1 or j == len(ids) or ids[j] != end_id:
                raise EngineInputError(f"{name}: an image start token (id {start_id}) at position {i} is not "
                                       f"followed by its placeholders (id {token_id}) and its end token (id {end_id})")
            out.extend(ids[i + 1:j])
            i = j + 1
            continue
        if tok in (token_id, end_id):
            raise EngineInputError(f"{name}: token id {tok} at position {i} is outside an image's start and end "
                                   f"tokens (ids {start_id}, {end_id})")
        out.append(tok)
        i += 1
    return out


def fold_tiled_images(ids: Sequence[int], token_id: int, fake_id: int, global_id: int, name: str) -> list[int]:
    """Our ids with each image's text folded to one `token_id` (SmolVLM / Idefics3).

    The processor writes an image as its tiles, `<fake_token_around_image><row_r_col_c>` + N placeholders each (with
    newlines between rows), then the whole image, `<fake_token_around_image><global-img>` + N placeholders +
    `<fake_token_around_image>` (an image not split: the whole image alone); vLLM writes all of it from the one
    `<image>` of the chat template. A span from a `<fake_token_around_image>` to the one closing its `<global-img>`
    run is folded; one that does not close is refused rather than guessed.
    """
    out: list[int] = []
    i = 0
    while i < len(ids):
        if ids[i] != fake_id:
            out.append(ids[i])
            i += 1
            continue
        try:
            j = ids.index(global_id, i) + 1
        except ValueError:
            raise EngineInputError(f"{name}: an image's text at position {i} (id {fake_id}) has no whole-image "
                                   f"token (id {global_id}) after it") from None
        start = j
        while j < len(ids) and ids[j] == token_id:
            j += 1
        if j == start or j == len(ids) or ids[j] != fake_id:
            raise EngineInputError(f"{name}: the whole-image token at position {start - 1} is not followed by its "
                                   f"placeholders (id {token_id}) and an image boundary token (id {fake_id})")
        out.append(token_id)
        i = j + 1
    return out


@dataclass(frozen=True)
class ImageText:
    """Tokens a processor writes around each image's placeholders that vLLM writes itself from the one placeholder
    of the chat template, undone before vLLM sees our ids."""

    start: int  # InternVL's `<img>`; SmolVLM's `<fake_token_around_image>`
    end: int  # InternVL's `</img>`; SmolVLM's `<global-img>`
    tiled: bool  # False: `start` + run + `end` (`unwrap_image_runs`); True: SmolVLM's tiles (`fold_tiled_images`)

    def fold(self, ids: Sequence[int], token_id: int, name: str) -> list[int]:
        if self.tiled:
            return fold_tiled_images(ids, token_id, self.start, self.end, name)
        return unwrap_image_runs(ids, token_id, self.start, self.end, name)


def image_wrappers(processor: Any) -> ImageText | None:
    """The text around each image the processor writes and vLLM writes itself (InternVL's `<img>` / `</img>`,
    SmolVLM's tiles); None for processors that write placeholders only."""
    names = {cls.__name__ for cls in type(processor).__mro__}
    if "InternVLProcessor" in names:  # its image-only one too
        return ImageText(int(processor.start_image_token_id), int(processor.end_image_token_id), tiled=False)
    if names & {"SmolVLMProcessor", "Idefics3Processor"}:
        convert = processor.tokenizer.convert_tokens_to_ids
        return ImageText(int(convert(processor.fake_image_token)), int(convert(processor.global_image_token)),
                         tiled=True)
    return None


def expand_vision_placeholders(ids: Sequence[int], image_token_id: int, video_token_id: int,
                               image_tokens: Sequence[int], video_tokens: Sequence[int]) -> list[int]:
    """The processor's expansion (each placeholder -> its item's token count): what vLLM does to folded ids."""
    counts = {image_token_id: iter(image_tokens), video_token_id: iter(video_tokens)}
    out: list[int] = []
    for tok in ids:
        out.extend([tok] * next(counts[tok]) if tok in counts else [tok])
    return out


def pixel_bounds(processor: Any, data_cfg: Any) -> dict[str, dict[str, int]]:
    """`{"image": {"min_pixels", "max_pixels"}, "video": {...}}`: the bounds our processor resizes to.

    `data.min_pixels` / `data.max_pixels` intersected with the processor's own (as `PromptEncoder`
    fits media); engines get them as engine-wide processor options, so their memory profiling
    (largest image) and resize rules are the trainer's.
    """
    from vlrft.data.processor import _pixel_bounds

    out: dict[str, dict[str, int]] = {}
    for kind, attr in (("image", "image_processor"), ("video", "video_processor")):
        sub = getattr(processor, attr, None)
        bounds = _pixel_bounds(sub, data_cfg) if sub is not None else None
        if bounds is not None:
            out[kind] = {"min_pixels": bounds.min_pixels, "max_pixels": bounds.max_pixels}
    return out


def video_metadata_dict(metadata: Any) -> dict[str, Any]:
    """Frame-sampling metadata as a plain dict (what vLLM's `(frames, metadata)` video items carry)."""
    keys = ("total_num_frames", "fps", "width", "height", "duration", "video_backend", "frames_indices")
    out = {k: getattr(metadata, k) for k in keys if getattr(metadata, k, None) is not None}
    if "frames_indices" in out:
        out["frames_indices"] = [int(i) for i in out["frames_indices"]]
    return out


# The engines that hand a prompt's images to vLLM's processor (`vllm_requests`).
VLLM_PROCESSOR_ENGINES = ("vllm", "vllm_server")
_ONE_CROP_EACH = ("LLaVA-OneVision encodes each image of a multi-image prompt as one crop, but vLLM's processor crops "
                  "every image as if alone (anyres), so the prompt cannot keep one tokenization")


def prompt_refusal(engine: str, model_type: str, num_images: int) -> str | None:
    """Why `rollout.engine=engine` cannot take a `model_type` prompt with `num_images` images (None: it can); the
    trainer checks every sample with it when the data is read, before any step draws one."""
    if engine in VLLM_PROCESSOR_ENGINES and model_type == "llava_onevision" and num_images > 1:
        return (f"{num_images} images in one prompt: {_ONE_CROP_EACH}; give each prompt one image or set "
                "rollout.engine=hf")
    return None


def check_images_encoded_alone(visual: Any, name: str) -> None:
    """Refuse a LLaVA-OneVision prompt whose images its processor encoded together.

    LLaVA-OneVision's processor gives each image of a multi-image prompt one crop (plus a newline
    token), an image alone its base crop and anyres grid (2 crops or more). vLLM's processor is
    handed a prompt's images as one flat list, which transformers takes as images each alone in its
    prompt, so it would crop them otherwise (and fails to place the placeholders). Images that each
    were encoded alone (a multi-turn trajectory's tool images) are what vLLM computes.
    """
    groups = visual.extra.get("batch_num_images")
    if groups is not None and any(int(n) > 1 for n in groups.tolist()):
        raise EngineInputError(f"{name}: {_ONE_CROP_EACH}: use rollout.engine=hf for prompts with several images")


def vllm_requests(batch: "PromptBatch", tokens: "TokenSpec",
                  wrappers: ImageText | None = None) -> list[PromptRequest]:
    """One vLLM prompt dict per prompt: folded ids + the PIL images / video frames our processor saw;
    `wrappers`: `image_wrappers(processor)`, the text around each image that vLLM writes itself."""
    requests = []
    for i in range(len(batch)):
        visual = batch.visual.select([i])
        name = sample_name(batch, i)
        check_images_encoded_alone(visual, name)
        # Grid families own prod(grid) / merge**2 placeholders an item; others (LLaVA-OneVision) one run each.
        image_tokens = tokens_per_item(visual.image_grid_thw, visual.merge_size) \
            if visual.image_grid_thw is not None else visual.num_images
        if wrappers is not None and wrappers.tiled:  # its pixel values are tiles: one folded placeholder an image
            image_tokens = len(batch.images[i])
        video_tokens = tokens_per_item(visual.video_grid_thw, visual.merge_size) \
            if visual.video_grid_thw is not None else visual.num_videos
        ids = list(batch.prompt_ids[i])
        if wrappers is not None:
            ids = wrappers.fold(ids, tokens.image_token_id, name)
        folded = fold_vision_placeholders(ids, tokens.image_token_id, tokens.video_token_id,
                                          image_tokens, video_tokens, name)
        payload: dict[str, Any] = {"prompt_token_ids": folded}
        media: dict[str, Any] = {}
        if batch.images[i]:
            media["image"] = list(batch.images[i])
        if batch.videos[i]:
            # Frames are sampled already; the metadata keeps the timing M-RoPE needs, and the processor
            # must not sample again.
            media["video"] = [(video.frames, video_metadata_dict(video.metadata)) for video in batch.videos[i]]
            payload["mm_processor_kwargs"] = {"do_sample_frames": False}
        if media:
            payload["multi_modal_data"] = media
        requests.append(PromptRequest(payload, list(batch.prompt_ids[i]), name))
    return requests


class ProcessorOutput(dict):
    """Our processor's tensors for one prompt, as SGLang's `processor_output` media item.

    A plain `dict` (SGLang recognises preprocessed items with `isinstance(item, dict)`) whose keys
    are also readable as attributes, because some SGLang versions read the grids with `getattr`.
    """

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __reduce__(self):  # pickles as a plain dict subclass (SGLang ships requests between processes)
        return (ProcessorOutput, (dict(self),))


def sglang_requests(batch: "PromptBatch") -> list[PromptRequest]:
    """One SGLang request per prompt: our ids verbatim and, with media, our processor's tensors."""
    requests = []
    for i in range(len(batch)):
        # Keys of modalities this prompt has (a text-only prompt of a mixed batch selects zero-row tensors).
        inputs = {key: value for key, value in batch.visual.select([i]).model_inputs().items() if value.shape[0]}
        # SGLang's batch form: one list per request; `[None]` is its "no media" entry (`GenerateReqInput`).
        payload: dict[str, Any] = {"input_ids": list(batch.prompt_ids[i]), "image_data": [None]}
        if inputs:
            # Own storage: a view would pickle the whole batch's pixels into every request.
            tensors = {key: value.detach().clone() for key, value in inputs.items()}
            payload["image_data"] = [ProcessorOutput(format="processor_output", **tensors)]
        requests.append(PromptRequest(payload, list(batch.prompt_ids[i]), sample_name(batch, i)))
    return requests
