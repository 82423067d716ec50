"""ActorVL: the policy being trained, and the optional critic (value head) for PPO with GAE.

`ActorVL.logprobs(batch)` returns per-token logprobs and entropy of completion tokens only. The
vision encoder runs once per distinct prompt in a micro-batch (its features are shared by the
group's rows through transformers' `mm_encoder_outputs`, so gradients from every row reach it),
the LM head sees only completion positions, a chunk at a time (`vlrft.models.logprobs`).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import NamedTuple

import torch
from torch import nn
from transformers.cache_utils import Cache

from vlrft.errors import MissingDependencyError, UserError
from vlrft.models.logprobs import SamplingTruncation, token_logprobs
from vlrft.batch import SequenceBatch, last_positions, width_classes
from vlrft.models.positions import (follow_released_rope_rule, has_rope_index, positions_after,
                                    prompt_positions)
from vlrft.models.router_loss import RouterLogits
from vlrft.models.prompt_cache import (cache_argument, cache_through_checkpointing, prefix_cache, recorded_cache,
                                      recording_cache)
from vlrft.models.staged_backward import StagedBackward
from vlrft.models.vision_attention import use_segment_attention
from vlrft.models.vision_balance import AgreeOnKinds, VisualKinds, dummy_vision_calls
from vlrft.vision import SLICING_RULES, Layout, VisualBatch, mm_token_type_ids, token_type_kwargs

VISION_MODULE_NAMES = ("visual", "vision_tower", "vision_model", "vision_encoder")


class TokenLogprobs(NamedTuple):
    """A named tuple, not a dataclass: wrappers that hook a module's output tensors (DeepSpeed ZeRO-3
    gathers the LM head for backward that way) only look inside tuples, lists and dicts."""

    logprobs: torch.Tensor  # [B, C], zero where completion_mask == 0
    entropy: torch.Tensor  # [B, C]
    # [B, C] log of the mass the rollout's top-k / top-p / min-p keep (`sampling_truncation`); None without one
    kept_log_mass: torch.Tensor | None = None
    # MoE routers' load-balancing loss of this forward's tokens (`ActorVL.router_aux_loss`); None when not asked
    router_aux_loss: torch.Tensor | None = None


def base_of(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (LoRA layers are injected in place, so they stay active)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def split_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(backbone returning hidden states, LM head) of an image-text-to-text model."""
    base = base_of(model)
    backbone, head = getattr(base, "model", None), getattr(base, "lm_head", None)
    if backbone is None or head is None:
        raise TypeError(f"{type(base).__name__} has no .model/.lm_head pair; vlrft needs the standard transformers "
                        "layout of AutoModelForImageTextToText models")
    return backbone, head


def vision_module(model: nn.Module) -> nn.Module | None:
    backbone, _ = split_head(model)
    for name in VISION_MODULE_NAMES:
        if isinstance(getattr(backbone, name, None), nn.Module):
            return getattr(backbone, name)
    return None


def _select_encoder_output(output, order: list[int]):
    """A copy of a transformers vision-encoder output keeping per-item features in `order` (repeats allowed)."""
    fields = {"pooler_output": [output.pooler_output[i] for i in order]}
    deepstack = getattr(output, "deepstack_features", None)
    if deepstack is not None:
        fields["deepstack_features"] = [[layer[i] for i in order] for layer in deepstack]
    return type(output)(**fields)


def _item_order(counts: tuple[int, ...], row_prompt: tuple[int, ...]) -> list[int]:
    """Indices of images (or videos) in a batch of distinct prompts, repeated for every row using them."""
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    return [starts[p] + k for p in row_prompt for k in range(counts[p])]


# Families with 1-D positions and causal attention everywhere (a Qwen2 language model behind their vision tower;
# SmolVLM's Llama): a continuation after a cached prompt sits at the prompt's length + 1, + 2, ..., which the shared
# forward places too.
ONE_D_SHARING = ("internvl", "llava_onevision", "smolvlm")


def one_d_positions(model: nn.Module) -> bool:
    """Whether the model's positions are 1-D ([B, L], not M-RoPE's [3, B, L]) and the shared forward may use them."""
    return getattr(base_of(model).config, "model_type", None) in ONE_D_SHARING


def supports_prompt_sharing(model: nn.Module) -> bool:
    """Whether the shared forward can place tokens after a cached prompt: by the model's M-RoPE rule (Qwen-VL,
    GLM-4.1V), or at plain 1-D positions for causal models (InternVL 3, LLaVA-OneVision, SmolVLM:
    `ONE_D_SHARING`).

    Gemma 3 cannot: half its layers attend within a sliding window, and each image's tokens attend to each other both
    ways (`token_type_ids`), which the shared forward's prompt caches (`vlrft.models.prompt_cache`) are not built or
    tested for; its rows each run in full (prompt and completion in one causal+bidirectional forward), exact but
    without the saving."""
    backbone, _ = split_head(model)
    return has_rope_index(backbone) or one_d_positions(model)


class VisionInputs:
    """Builds the visual keyword arguments of a training forward for rows sharing prompts."""

    def __init__(self, model: nn.Module):
        self.model = model
        backbone, _ = split_head(model)
        self.shared = "mm_encoder_outputs" in inspect.signature(backbone.forward).parameters

    def encodes_before_backbone(self, visual: VisualBatch) -> bool:
        """Whether `__call__` runs the vision tower itself (shared features), not the backbone (repeated pixels)."""
        extra_rows = any(SLICING_RULES.get(k, None) is None or SLICING_RULES[k].layout in (Layout.IMAGE_ROWS,
                         Layout.VIDEO_ROWS) for k in visual.extra)
        # Gemma 3's images have no grid (one pixel row per image): its tower runs inside the backbone
        ungridded = visual.pixel_values is not None and visual.num_images and visual.image_grid_thw is None
        return self.shared and not extra_rows and not ungridded

    def __call__(self, visual: VisualBatch, row_prompt: tuple[int, ...]) -> dict:
        if not self.encodes_before_backbone(visual):
            return visual.select(list(row_prompt)).model_inputs()  # generic path: pixels repeated per row
        base = base_of(self.model)
        kwargs: dict = {}
        encoded: dict = {}
        if visual.pixel_values is not None and visual.num_images:
            order = _item_order(visual.images_per_sample, row_prompt)
            features = base.get_image_features(pixel_values=visual.pixel_values, image_grid_thw=visual.image_grid_thw,
                                               return_dict=True)
            encoded["image"] = _select_encoder_output(features, order)
            kwargs["image_grid_thw"] = visual.image_grid_thw[order]
            image_order = order
        else:
            image_order = []
        if visual.pixel_values_videos is not None and visual.num_videos:
            order = _item_order(visual.videos_per_sample, row_prompt)
            features = base.get_video_features(pixel_values_videos=visual.pixel_values_videos,
                                               video_grid_thw=visual.video_grid_thw, return_dict=True)
            encoded["video"] = _select_encoder_output(features, order)
            kwargs["video_grid_thw"] = visual.video_grid_thw[order]
            video_order = order
        else:
            video_order = []
        for key, value in visual.extra.items():
            layout = SLICING_RULES[key].layout
            index = {Layout.PER_IMAGE: image_order, Layout.PER_VIDEO: video_order,
                     Layout.PER_SAMPLE: list(row_prompt)}[layout]
            kwargs[key] = value[index]
        if encoded:
            kwargs["mm_encoder_outputs"] = encoded
        return kwargs


class ActorVL(nn.Module):
    """The policy: an `AutoModelForImageTextToText` model (optionally LoRA-wrapped) with completion logprobs."""

    def __init__(self, model: nn.Module, image_token_id: int, video_token_id: int, chunk_tokens: int = 1024,
                 suppressed_ids: tuple[int, ...] = (), router_aux_loss: bool = False):
        super().__init__()
        self.model = model
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.chunk_tokens = chunk_tokens
        # One SDPA call per segment length in the vision tower, not one per window/frame (vlrft.models.vision_attention)
        use_segment_attention(vision_module(model))
        follow_released_rope_rule(model)  # text after a long video where the checkpoints (and vLLM) place it
        self.suppressed_ids = tuple(suppressed_ids)  # never sampled by the engines (vision placeholders)
        self._vision = VisionInputs(model)
        self.share_prompts = supports_prompt_sharing(model)
        # Set by sharding strategies: ranks agree per forward on the visual kinds to encode, so every rank runs
        # the vision tower equally often (`vlrft.models.vision_balance`). None: each rank encodes what it has.
        self.agree_on_visual_kinds: AgreeOnKinds | None = None
        # Take the shared-prompt path (two backbone calls) even when no prompt repeats, so every rank calls the
        # sharded blocks equally often whatever its rows: set for token-budget micro-batches under sharding.
        self.share_every_forward = False
        # The shared forward runs the completions in classes of similar length (`vlrft.batch.width_classes`).
        self.split_completion_widths = True
        # The rollout's top-k / top-p / min-p: when set, each forward also returns the log of the mass they keep
        # (`TokenLogprobs.kept_log_mass`), which truncated importance sampling needs to compare like with like.
        self.sampling_truncation: SamplingTruncation | None = None
        # MoE: forwards with gradients also return the routers' load-balancing loss (`vlrft.models.router_loss`)
        self.router_aux_loss = router_aux_loss
        self._routers: RouterLogits | None = None  # collecting during one `logprobs` call
        # The shared forward's backward one backbone call at a time (`vlrft.models.staged_backward`): no gradient of
        # the completion calls waits for the prompt pass's. Needs a `.backward()` (not `torch.autograd.grad`) and
        # gradient hooks that allow a parameter's accumulator to fire once per call: set by such strategies.
        self.backward_in_stages = False

    def _router_kwargs(self) -> dict:
        return {} if self._routers is None else {"output_router_logits": True}

    def _keep_routers(self, output, mask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        if self._routers is not None:
            self._routers.add(output, mask, rows)

    def _agreed_kinds(self, ours: VisualKinds) -> VisualKinds | None:
        """The visual kinds some rank encodes in this forward (one all-reduce, which every rank makes once per
        forward); None when this strategy needs no balancing."""
        return None if self.agree_on_visual_kinds is None else self.agree_on_visual_kinds(ours)

    def _dummy_calls(self, lacking: VisualKinds | None, device: torch.device, *, later: bool = False,
                     encoded_before_backbone: bool = False):
        """Context for one backbone pass: the tower runs on a dummy for the `lacking` kinds of this pass."""
        if lacking is None:
            return contextlib.nullcontext()
        backbone, _ = split_head(self.model)
        return dummy_vision_calls(self.model, backbone, lacking, device, later=later,
                                  encoded_before_backbone=encoded_before_backbone)

    def hidden_states(self, batch: SequenceBatch) -> torch.Tensor:
        """Final-layer hidden states [B, P + C, H] of the rows, each row computed in full."""
        backbone, _ = split_head(self.model)
        kwargs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                      **token_type_kwargs(backbone, mm_token_type_ids(batch.input_ids, self.image_token_id,
                                                                      self.video_token_id)))
        device = batch.input_ids.device
        anyone = self._agreed_kinds(VisualKinds.of(batch.visual, batch.completion_visual))
        if batch.has_completion_images or (anyone is not None and anyone.later_pass):
            # Multi-turn: each row's prompt images, then its tool images, encoded inside the backbone in one pass.
            # Sharded, every rank does it this way when any rank's rows have tool images, so all of them run the
            # tower at the same point (ZeRO-3 follows the order of module calls).
            visual = batch.row_visual()
            lacking = None if anyone is None else VisualKinds.of(visual).lacking(anyone.merged())
            with self._dummy_calls(lacking, device):
                kwargs.update(visual.model_inputs())
                out = backbone(**kwargs, **self._router_kwargs())
                self._keep_routers(out, batch.attention_mask)
                return out.last_hidden_state
        early = self._vision.encodes_before_backbone(batch.visual)
        lacking = None if anyone is None else VisualKinds.of(batch.visual).lacking(anyone)
        with self._dummy_calls(lacking, device, encoded_before_backbone=early):
            kwargs.update(self._vision(batch.visual, batch.row_prompt))
            out = backbone(**kwargs, **self._router_kwargs())
            self._keep_routers(out, batch.attention_mask)
            return out.last_hidden_state

    def predicting_states(self, batch: SequenceBatch) -> torch.Tensor:
        """Hidden states [B, C, H] that predict each completion token (the state before it)."""
        p, c = batch.prompt_width, batch.completion_width
        classes = self._width_classes(batch) if self.share_prompts else None
        if self.share_prompts and (batch.visual.num_samples < len(batch) or self.share_every_forward
                                   or classes is not None):
            return self._predicting_states_shared(batch, classes)
        return self.hidden_states(batch)[:, p - 1:p - 1 + c]

    def _predicting_states_shared(self, batch: SequenceBatch,
                                  classes: list[tuple[list[int], int]] | None = None) -> torch.Tensor:
        """Each distinct prompt runs once; its KV cache is repeated for the rows that continue it.

        Gradients flow from every row's completion through the shared cache into the one prompt
        pass. Completion positions continue the prompt's last position (M-RoPE text positions), so
        the result equals the full forward of every row. The caches (`vlrft.models.prompt_cache`)
        never grow on a checkpoint replay, so this also holds under gradient checkpointing. `classes`
        (`_width_classes`): one completion call per class of similar lengths; None: one call.
        """
        backbone, _ = split_head(self.model)
        p, c = batch.prompt_width, batch.completion_width
        first_row: dict[int, int] = {}
        for r, u in enumerate(batch.row_prompt):
            first_row.setdefault(u, r)
        prompt_rows = torch.tensor([first_row[u] for u in range(batch.visual.num_samples)], device=batch.input_ids.device)
        ids, mask = batch.input_ids[prompt_rows, :p], batch.attention_mask[prompt_rows, :p]
        mm = mm_token_type_ids(ids, self.image_token_id, self.video_token_id)
        visual = batch.visual.model_inputs()
        positions = prompt_positions(backbone, ids, mask, mm, visual)
        # [3, B, L] for M-RoPE; a 1-D model takes one of its (equal) axes, and no per-token types
        axes = (lambda x: x[0]) if one_d_positions(self.model) else (lambda x: x)
        types = (lambda t: token_type_kwargs(backbone, t)) if one_d_positions(self.model) else \
            (lambda t: {"mm_token_type_ids": t})
        rows = torch.tensor(batch.row_prompt, device=ids.device)
        completion_ids = batch.input_ids[:, p:]
        completion_mm, completion_visual = torch.zeros_like(completion_ids), {}
        if batch.has_completion_images:
            # Multi-turn: tool images inside the completions. Their positions follow the model's rule over the
            # whole row; the completion pass encodes them and places their features on their placeholders.
            full_mm = mm_token_type_ids(batch.input_ids, self.image_token_id, self.video_token_id)
            completion_positions = prompt_positions(backbone, batch.input_ids, batch.attention_mask, full_mm,
                                                    batch.row_visual().model_inputs())[:, :, p:]
            completion_mm, completion_visual = full_mm[:, p:], batch.completion_visual.model_inputs()
        else:
            completion_positions = positions_after(positions, rows, torch.arange(1, c + 1, device=ids.device))
        # Sharded: the ranks agree on both passes' vision calls at once (the continuation pass encodes tool images).
        ours = VisualKinds.of(batch.visual, batch.completion_visual)
        anyone = self._agreed_kinds(ours)
        lacking = None if anyone is None else ours.lacking(anyone)
        recorded = recording_cache()
        staged = StagedBackward() if self.backward_in_stages and torch.is_grad_enabled() else None
        with cache_through_checkpointing(backbone):
            with self._dummy_calls(lacking, ids.device):
                prompt_out = backbone(input_ids=ids, attention_mask=mask, **types(mm), position_ids=axes(positions),
                                      use_cache=True, **cache_argument(backbone, recorded), **visual,
                                      **self._router_kwargs())
            prompt_out, recorded = _staged_output(staged, prompt_out, recorded)
            self._keep_routers(prompt_out, batch.attention_mask[:, :p], rows)
            last_prompt_state = prompt_out.last_hidden_state[rows, p - 1:p]
            if classes is None:
                with self._dummy_calls(lacking, ids.device, later=True):
                    completion_out = backbone(input_ids=completion_ids, attention_mask=batch.attention_mask,
                                              position_ids=axes(completion_positions),
                                              use_cache=True, **cache_argument(backbone, prefix_cache(recorded, rows)),
                                              **types(completion_mm), **completion_visual, **self._router_kwargs())
                completion_out, _ = _staged_output(staged, completion_out)
                self._keep_routers(completion_out, batch.attention_mask[:, p:])
                return self._exits(staged, torch.cat([last_prompt_state, completion_out.last_hidden_state[:, :c - 1]],
                                                     dim=1))
            pieces, order = [], []
            for members, width in classes:  # one call per class of similar lengths, padded to its own width
                idx = torch.tensor(members, device=ids.device)
                out = backbone(input_ids=completion_ids[idx, :width],
                               attention_mask=batch.attention_mask[idx, :p + width],
                               position_ids=axes(completion_positions[:, idx, :width]),
                               use_cache=True, **cache_argument(backbone, prefix_cache(recorded, rows[idx])),
                               **types(completion_mm[idx, :width]), **self._router_kwargs())
                out, _ = _staged_output(staged, out)
                self._keep_routers(out, batch.attention_mask[idx, p:p + width])
                states = torch.cat([last_prompt_state[idx], out.last_hidden_state[:, :width - 1]], dim=1)
                pieces.append(nn.functional.pad(states, (0, 0, 0, c - width)))
                order += members
        back = torch.empty(len(order), dtype=torch.long)
        back[torch.tensor(order)] = torch.arange(len(order))
        return self._exits(staged, torch.cat(pieces)[back.to(ids.device)])

    def _exits(self, staged: StagedBackward | None, states: torch.Tensor) -> torch.Tensor:
        """The shared forward's states (and the router logits it kept) through `staged`'s backward node."""
        if staged is None:
            return states
        kept = [] if self._routers is None else self._routers.tensors()
        states, *kept = staged.close([states, *kept])
        if self._routers is not None:
            self._routers.replace(kept)
        return states

    def _width_classes(self, batch: SequenceBatch) -> list[tuple[list[int], int]] | None:
        """(rows, width) of each completion call of the shared forward (`vlrft.batch.width_classes`), or None for
        one call over all rows: with tool images in completions, when off, or under sharding strategies
        (`agree_on_visual_kinds` set), where every rank must call the sharded blocks equally often."""
        if not self.split_completion_widths or batch.has_completion_images or self.agree_on_visual_kinds is not None:
            return None
        # a row's last sampled position, not its count of sampled tokens: multi-turn rows have observation holes
        lengths = [max(1, n) for n in last_positions(batch.completion_mask)]
        classes = width_classes(lengths)
        if len(classes) == 1:
            return None
        return [(members, max(lengths[i] for i in members)) for members in classes]

    def logprobs(self, batch: SequenceBatch, temperature: float = 1.0) -> TokenLogprobs:
        """Logprob and entropy of each completion token under softmax(logits / temperature)."""
        _, head = split_head(self.model)
        self._routers = RouterLogits(self.model) if self.router_aux_loss and torch.is_grad_enabled() else None
        try:
            states = self.predicting_states(batch)
            routers, self._routers = self._routers, None
        finally:
            self._routers = None
        p, c = batch.prompt_width, batch.completion_width
        mask = batch.completion_mask.bool()
        predicting = states[mask]
        targets = batch.input_ids[:, p:p + c][mask]
        lp, ent, *kept = token_logprobs(predicting, head, targets, temperature, self.chunk_tokens, self.suppressed_ids,
                                        truncation=self.sampling_truncation)
        def scattered(values: torch.Tensor) -> torch.Tensor:
            return torch.zeros(mask.shape, dtype=torch.float32, device=states.device).masked_scatter(mask, values)

        return TokenLogprobs(scattered(lp), scattered(ent), scattered(kept[0]) if kept else None,
                             None if routers is None else routers.loss())

    def forward(self, batch: SequenceBatch, temperature: float = 1.0) -> TokenLogprobs:
        return self.logprobs(batch, temperature)


class _StagedOutput(NamedTuple):
    """What the rest of the shared forward reads of a backbone call's output."""

    last_hidden_state: torch.Tensor
    router_logits: tuple[torch.Tensor, ...] | None = None


def _staged_output(staged: StagedBackward | None, output, recorded: Cache | None = None
                   ) -> tuple[object, Cache | None]:
    """`output` (and a prompt pass's key/value records in `recorded`) as the rest of the shared forward reads them:
    through `staged`'s hand-off of this call, or as they are without `staged`."""
    if staged is None:
        return output, recorded
    records = [t for layer in recorded.layers for t in (layer.keys, layer.values)] if recorded is not None else []
    routers = list(getattr(output, "router_logits", None) or ())
    state, *handed = staged.cut([output.last_hidden_state, *routers, *records])
    kv = handed[len(routers):]
    read = recorded_cache(list(zip(kv[::2], kv[1::2]))) if recorded is not None else None
    return _StagedOutput(state, tuple(handed[:len(routers)]) if routers else None), read


class CriticVL(nn.Module):
    """Value model for GAE: a VLM backbone with a scalar head; V(state before each completion token)."""

    def __init__(self, model: nn.Module, image_token_id: int, video_token_id: int):
        super().__init__()
        self.actor_like = ActorVL(model, image_token_id, video_token_id)
        backbone, head = split_head(model)
        self.value_head = nn.Linear(head.in_features, 1)  # not weight.shape: a ZeRO-3 shard holds no elements
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, batch: SequenceBatch) -> torch.Tensor:
        states = self.actor_like.predicting_states(batch)  # each distinct prompt once, as the policy's forward
        # Outside autocast: values in the head's own dtype (float32, or FSDP2's gathered dtype), not bf16 matmuls
        with torch.autocast(states.device.type, enabled=False):
            values = self.value_head(states.to(self.value_head.weight.dtype)).float().squeeze(-1)
        return values * batch.completion_mask


def freeze_vision(model: nn.Module) -> int:
    """Stop gradients into the vision tower (and its merger); returns how many parameters were frozen."""
    vision = vision_module(model)
    if vision is None:
        return 0
    count = 0
    for param in vision.parameters():
        param.requires_grad_(False)
        count += param.numel()
    return count


def apply_lora(model: nn.Module, rank: int, alpha: int, dropout: float, target_modules: list[str],
               exclude_vision: bool = False) -> nn.Module:
    """Wrap the model with PEFT LoRA adapters (only the adapters train); `exclude_vision` (model.freeze_vision_tower):
    none in the vision tower, its merger or Qwen3-VL's deepstack mergers, which "all-linear" would otherwise reach.

    Qwen3-VL-MoE's experts are 3-D parameters, not linear layers: a target naming one ('experts.gate_up_proj',
    'experts.down_proj', or the bare names) puts an adapter on every expert of it (PEFT's `target_parameters`:
    rank x experts in each factor); 'all-linear' alone leaves them, and the routers, frozen."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise MissingDependencyError(f"model.lora.rank > 0 needs the package 'peft' ({exc}); install it with: "
                                     "pip install 'vlrft[peft]'") from exc
    import re

    experts = _expert_parameter_targets(model, target_modules)
    module_targets = [t for t in target_modules if t not in experts]
    targets = "all-linear" if module_targets == ["all-linear"] else module_targets
    exclude = None
    vision = vision_module(model) if exclude_vision else None
    vision_name = None
    if vision is not None:
        vision_name = next(n for n, m in model.named_modules() if m is vision)
        exclude = re.escape(vision_name) + r"(\..*)?"  # PEFT full-matches it against each module's name
    if targets != "all-linear":
        _check_lora_names(model, targets, vision_name)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none",
                        exclude_modules=exclude, target_parameters=experts or None)
    return get_peft_model(model, config)


def _expert_parameter_targets(model: nn.Module, targets: list[str]) -> list[str]:
    """The targets that name a 3-D parameter (a MoE layer's experts) rather than a module: the full name's suffix."""
    stacked = [name for name, p in model.named_parameters() if p.dim() == 3]
    return [t for t in targets if t != "all-linear" and any(n == t or n.endswith("." + t) for n in stacked)]


def _check_lora_names(model: nn.Module, targets: list[str], vision_name: str | None) -> None:
    """Refuse plain module names that wrap no linear layer the adapters may reach (outside the vision tower when it is
    frozen), naming the model's own: families name their layers differently (GLM-4.1V's text MLP is one fused
    `gate_up_proj` where Qwen has `gate_proj` and `up_proj`, which in GLM-4.1V only exist in the vision tower), and
    PEFT trains silently on whatever part of the list matches. Dotted names and patterns are left to PEFT."""
    linear = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)
              and not (vision_name and (name == vision_name or name.startswith(vision_name + ".")))}
    missing = [t for t in targets if t.isidentifier() and t not in linear]
    if missing:
        where = " outside the frozen vision tower" if vision_name else ""
        # Qwen3-VL-MoE: experts are 3-D parameters (gate_up_proj, down_proj) and the router a bare weight
        experts = any(name.endswith(".experts") for name, _ in model.named_modules())
        moe = (" (its MoE experts are 3-D parameters, which 'experts.gate_up_proj' and 'experts.down_proj' name for "
               "adapters on every expert; its routers are bare weights, trained only by full fine-tuning)") \
            if experts else ""
        raise UserError(f"model.lora.target_modules: {missing} name no linear layer of {type(model).__name__}{where}; "
                        f"its linear layers are {sorted(linear)} (or use ['all-linear']){moe}")

