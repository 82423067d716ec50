"""Group decoding for the transformers engine: each prompt is prefilled once, then n completions continue it.

`transformers.generate` expands every prompt n times before its prefill (n prefills of the same
tokens) and keeps computing rows that already stopped. This loop prefills each distinct prompt
once (vision encoder included), repeats the KV cache for the group, decodes only the rows still
running, and uses transformers' own logits processors for every sampling option, so sampling
means exactly what it means in `generate`. Positions follow the model's M-RoPE rule, the same
one the trainer's shared-prompt forward uses, so rollout and training see identical inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlrft.data.processor import left_pad
from vlrft.errors import DivergedError
from vlrft.models.actor import split_head
from vlrft.models.positions import prompt_positions
from vlrft.models.precision import active_autocast_dtype
from vlrft.rollout.graph_decode import WARMUP_STEPS, CudaGraphDecoder, FixedRowsDecoder
from vlrft.rollout.lean_decode import LeanDecoder, unsupported_reason
from vlrft.rollout.base import FINISH_LENGTH, FINISH_STOP, SamplingParams
from vlrft.vision import VisualBatch, mm_token_type_ids

# Prompts of different lengths whose padded prefill would take an attention mask of this many elements or more
# ([prompts, 1, length, length]: 64 MiB of bool, and SDPA turns it into an additive one per layer call) are prefilled
# in groups of one length each, unpadded (`_prefill_groups`). 4 prompts of 16.6k tokens in one call: 1.1 GB of mask.
PREFILL_MASK_ELEMENTS = 1 << 26
# The prompts of a decode call are prefilled this many (padded) prompt tokens at a time at most: the prefill holds a
# layer's activations of all the tokens it runs (about 200 KB per token for a 7B model), and a call takes all the
# rank's prompts. A prompt longer than this runs alone. `vlrft.plan.memory.PREFILL_TOKENS` repeats it.
PREFILL_TOKENS = 1 << 15
# Prompts at least this long (padded) are held once per group in the lean decoder's KV cache, not once per row
# (`LeanDecoder(share_prompt=True)`); shorter ones are copied per row, which takes fewer ops per step.
SHARED_PROMPT_TOKENS = 128


@dataclass
class DecodedRows:
    """Per completion row: generated ids (stop token included), logprobs and finish reason."""

    ids: list[list[int]]
    logprobs: list[list[float]]
    reasons: list[str]


def sampling_warpers(sampling: SamplingParams):
    """transformers' temperature / top-k / top-p / min-p warpers for `sampling`, in `generate`'s order."""
    from transformers import LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, \
        TopPLogitsWarper

    warpers = LogitsProcessorList()
    if sampling.greedy:
        return warpers
    if sampling.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:
        warpers.append(TopKLogitsWarper(top_k=sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=sampling.top_p))
    if sampling.min_p > 0:
        warpers.append(MinPLogitsWarper(min_p=sampling.min_p))
    return warpers


def sampling_processors(sampling: SamplingParams, suppressed_ids: tuple[int, ...], device, tokenizer=None):
    """transformers logits processors for `sampling`, in the order `generate` applies them."""
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, SuppressTokensLogitsProcessor

    processors = LogitsProcessorList()
    if sampling.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(penalty=sampling.repetition_penalty))
    if suppressed_ids:
        processors.append(SuppressTokensLogitsProcessor(list(suppressed_ids), device=device))
    processors.extend(sampling_warpers(sampling))
    return processors


class _SuppressTokens:
    """`SuppressTokensLogitsProcessor` with its vocabulary mask built once, not at every step."""

    def __init__(self, suppressed_ids: tuple[int, ...], vocab_size: int, device):
        self.mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.mask[[i for i in suppressed_ids if i < vocab_size]] = True

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(self.mask, float("-inf"))


def step_processors(sampling: SamplingParams, suppressed_ids: tuple[int, ...], vocab_size: int, device) -> list:
    """The processors of `sampling_processors` as a plain list for the per-token loop.

    Called one by one (`LogitsProcessorList.__call__` inspects each processor's signature at
    every step), with the suppression mask precomputed; the scores are those `generate` computes.
    """
    from transformers import SuppressTokensLogitsProcessor

    return [_SuppressTokens(suppressed_ids, vocab_size, device) if isinstance(p, SuppressTokensLogitsProcessor) else p
            for p in sampling_processors(sampling, suppressed_ids, device)]


def sample_tokens(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [rows, vocab], by inverse CDF: one uniform number per row.

    The first token whose cumulative probability reaches u, for u uniform in (0, total]: a token of
    probability 0 is never taken (its cumulative sum equals its predecessor's) and the index stays in
    range whatever the rounding. `torch.multinomial` draws an exponential per vocabulary entry instead
    (CPU: 0.27 ms for 16 x 512, most of the sampling bookkeeping of a decode step).
    """
    cdf = probs.cumsum(dim=-1)
    u = (1.0 - torch.rand(probs.shape[0], 1, dtype=cdf.dtype, device=cdf.device)) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).squeeze(1)


def _select_rows(cache, index: torch.Tensor) -> None:
    """Keep only `index` rows of a KV cache (static layers have no batch_select_indices of their own)."""
    from transformers import StaticCache

    if not isinstance(cache, StaticCache):
        cache.batch_select_indices(index)
        return
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
            layer.batch_size = len(index)


class HalvingRowsDecoder:
    """A decoder whose stopped rows are dropped from it only once at most half of its rows are still reported.

    Dropping rows copies the whole KV cache (`keep` of `LeanDecoder` / `_TransformersDecoder`). Dropping them
    at every step where some row stopped would copy it up to once per step: on a GPU, 128 rows of a 7B
    model stopping at scattered steps copy it about a hundred times per decode call (terabytes of memory
    traffic, worked out from the shapes). Until the next
    halving a stopped row is computed on, fed token 0, and not reported; the copies then add up to about
    two caches per call. The reported rows' arithmetic and the sampling are unchanged.
    """

    def __init__(self, decoder, rows: int):
        self.decoder, self.rows = decoder, rows  # rows: how many `decoder` computes
        self.alive: torch.Tensor | None = None  # rows of `decoder` still reported (None: all of them)
        self.tokens: torch.Tensor | None = None  # a step's input for every row of `decoder`

    def keep(self, index: torch.Tensor) -> None:
        """Report only rows `index` of those reported so far."""
        alive = index if self.alive is None else self.alive.index_select(0, index)
        if 2 * alive.shape[0] <= self.rows:  # shapes only: no device sync
            self.decoder.keep(alive)
            self.rows, self.alive, self.tokens = alive.shape[0], None, None
        else:
            self.alive = alive
            if self.tokens is None:
                self.tokens = torch.zeros(self.rows, dtype=torch.long, device=alive.device)

    def step(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        if self.alive is None:
            return self.decoder.step(tokens, step)
        self.tokens.index_copy_(0, self.alive, tokens)
        return self.decoder.step(self.tokens, step).index_select(0, self.alive)


class _TransformersDecoder:
    """Decode steps through transformers' layers (any model), optionally `torch.compile`d.

    Holds what the steps carry: the group's KV cache, the attention mask buffer and the rows' M-RoPE
    positions. The same interface as `LeanDecoder` (`keep`, `step`). Falls back to eager if compiling fails.
    """

    def __init__(self, backbone, cache, rows: torch.Tensor, prompt_mask: torch.Tensor, position: torch.Tensor,
                 max_new_tokens: int, mm_dtype: torch.dtype, static_cache: bool, compile_step: bool):
        self.backbone = backbone
        # A decode step carries no image or video: the multimodal wrapper would only embed the ids and
        # pass them on, so the text decoder is called directly (same modules, one wrapper less per token).
        self.text_model = getattr(backbone, "language_model", None)
        self.cache, self.static_cache = cache, static_cache
        _select_rows(cache, rows)
        self.prompt_len = prompt_mask.shape[1]
        # With a static cache the model attends over every preallocated position (future ones masked);
        # a dynamic one holds exactly the positions so far.
        self.attention = _step_mask_buffer(backbone, prompt_mask, self.prompt_len + max_new_tokens)
        self.position = position  # [3, rows]: the last position; each new token adds 1 on all axes
        self.mm = torch.zeros(len(rows), 1, dtype=mm_dtype, device=position.device)
        self.compiled = None
        if compile_step:
            try:
                self.compiled = torch.compile(self._eager, dynamic=True)
            except Exception as error:  # noqa: BLE001 - no compiler / unsupported platform: decode eagerly
                _warn_compile(error)

    def keep(self, index: torch.Tensor) -> None:
        """Drop every row not in `index` (rows that stopped)."""
        _select_rows(self.cache, index)
        self.attention, self.position, self.mm = self.attention[index], self.position[:, index], self.mm[:len(index)]

    def step(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        """Feed `tokens` [rows] as generated token number `step` (0-based); the new hidden states [rows, hidden]."""
        self.position += 1  # as vlrft.models.positions.positions_after places them
        self.attention[..., self.prompt_len + step] = True
        mask = self.attention if self.static_cache else self.attention[..., :self.prompt_len + step + 1]
        args = (tokens[:, None], mask, self.position[:, :, None], self.mm, self.cache)
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as error:  # noqa: BLE001 - e.g. inductor without a C++ compiler
                _warn_compile(error)
                self.compiled = None
        return self._eager(*args)

    def _eager(self, tokens, attention, position, mm, cache):
        if self.text_model is not None:
            out = self.text_model(input_ids=tokens, attention_mask=attention, position_ids=position,
                                  past_key_values=cache, use_cache=True)
        else:
            out = self.backbone(input_ids=tokens, attention_mask=attention, position_ids=position,
                                past_key_values=cache, use_cache=True, mm_token_type_ids=mm)
        return out.last_hidden_state[:, -1]


def _warn_compile(error: Exception) -> None:
    import warnings

    warnings.warn(f"rollout.compile_decode: torch.compile failed ({type(error).__name__}: {str(error)[:200]}); "
                  "decoding eagerly", RuntimeWarning, stacklevel=3)


def _lean_applies(backbone, position: torch.Tensor) -> bool:
    """Whether the lean step can decode: a supported text decoder, and text positions (equal on all axes)."""
    text_model = getattr(backbone, "language_model", None)
    if text_model is None or unsupported_reason(text_model) is not None:
        return False
    return bool((position == position[0]).all())


def _step_mask_buffer(backbone, prompt_mask: torch.Tensor, length: int) -> torch.Tensor:
    """The decode steps' attention mask over `length` positions, the prompt's filled in.

    With SDPA it is kept in the boolean [rows, 1, 1, length] form the attention layers take, which
    transformers passes through as it is, so no mask is built at each step (the same values it
    would build). Other kernels (eager's additive mask, flash-attention's padding mask) get the
    2D padding mask and build their own.
    """
    rows, prompt_len = prompt_mask.shape
    config = getattr(getattr(backbone, "language_model", backbone), "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa":
        buffer = torch.zeros(rows, 1, 1, length, dtype=torch.bool, device=prompt_mask.device)
        buffer[:, 0, 0, :prompt_len] = prompt_mask.bool()
        return buffer
    buffer = torch.zeros(rows, length, dtype=prompt_mask.dtype, device=prompt_mask.device)
    buffer[:, :prompt_len] = prompt_mask
    return buffer


def _prefill_groups(mask: torch.Tensor) -> list[torch.Tensor]:
    """The prompts (rows of the left-padded `mask`) to prefill together, longest first: all in one call, unless that
    call would run more than PREFILL_TOKENS padded tokens, or prompts of different lengths whose attention mask would
    reach PREFILL_MASK_ELEMENTS (such a group keeps to one length: unpadded, its attention needs no mask)."""
    prompts = mask.shape[0]
    lengths = mask.sum(dim=1).tolist()
    groups: list[list[int]] = []
    for prompt in sorted(range(prompts), key=lambda i: -lengths[i]):
        group = groups[-1] if groups else []
        width = lengths[group[0]] if group else lengths[prompt]  # the group's longest: its first
        ragged = bool(group) and lengths[prompt] != width
        count = len(group) + 1
        if group and (count * width > PREFILL_TOKENS or (ragged and count * width * width >= PREFILL_MASK_ELEMENTS)):
            group = []
        if not group:
            groups.append(group)
        group.append(prompt)
    if len(groups) == 1:
        return [torch.arange(prompts, device=mask.device)]
    return [torch.tensor(sorted(group), device=mask.device) for group in groups]


def _prefill(backbone, ids: torch.Tensor, mask: torch.Tensor, mm: torch.Tensor, positions: torch.Tensor,
             visual: VisualBatch, cache, groups: list[torch.Tensor]):
    """The prompts through the backbone: (each prompt's last hidden state [prompts, hidden], its KV cache).

    One padded call, or one call per group of `groups`, padded to the group's longest prompt, whose caches are then
    merged into one left-padded dynamic cache (a group's layer at a time); the decode steps' masks never attend to
    the padding.
    """
    if len(groups) == 1:
        out = backbone(input_ids=ids, attention_mask=mask, mm_token_type_ids=mm, position_ids=positions,
                       use_cache=True, past_key_values=cache, **visual.model_inputs())
        return out.last_hidden_state[:, -1].clone(), out.past_key_values  # not a view holding every position
    from transformers import DynamicCache

    length = ids.shape[1]
    last = None
    parts: list[tuple[torch.Tensor, list]] = []  # (prompts, per layer (keys, values))
    for index in groups:
        n = int(mask[index].sum(dim=1).max())  # the group's longest prompt
        out = backbone(input_ids=ids[index, -n:], attention_mask=mask[index, -n:], mm_token_type_ids=mm[index, -n:],
                       position_ids=positions[:, index, -n:], use_cache=True,
                       **visual.select(index.tolist()).model_inputs())
        hidden = out.last_hidden_state[:, -1]
        if last is None:
            last = hidden.new_empty(ids.shape[0], hidden.shape[-1])
        last[index] = hidden
        hidden = None  # a view: it would keep the group's every position alive through the merge
        parts.append((index, [[layer.keys, layer.values] for layer in out.past_key_values.layers]))
        out = None
    merged = DynamicCache()
    for layer in range(len(parts[0][1])):
        padded = []
        for which in (0, 1):  # keys, values
            first = parts[0][1][layer][which]
            buffer = first.new_zeros(ids.shape[0], first.shape[1], length, first.shape[3])
            for index, layers in parts:
                tensor = layers[layer][which]
                buffer[index, :, length - tensor.shape[2]:] = tensor
                layers[layer][which] = None  # the group's copy goes as soon as it is merged
            padded.append(buffer)
        merged.update(*padded, layer)
    return last, merged


@torch.no_grad()
def decode_groups(model, prompt_ids: list[list[int]], visual: VisualBatch, sampling: SamplingParams, *,
                  pad_id: int, stop_ids: set[int], image_token_id: int, video_token_id: int,
                  suppressed_ids: tuple[int, ...] = (), tokenizer=None, static_cache: bool = True,
                  compile_step: bool = False, lean_step: bool = True, cuda_graph: bool | None = None) -> DecodedRows:
    """Sample `sampling.n` completions for each prompt; rows are ordered prompt by prompt.

    With `static_cache` the KV cache, attention mask, token history and outputs are allocated once
    for prompt + max_new_tokens positions and written in place each step (rows that stop are
    dropped by one index_select once at most half of the rows still run: `HalvingRowsDecoder`);
    With `lean_step`, Qwen-family text decoders take their decode steps through
    `vlrft.rollout.lean_decode` (same arithmetic, about half the dispatched ops and none of the modules'
    Python); other models through transformers. `compile_step` compiles the per-token step (the lean one, or
    the backbone call). With `cuda_graph` too, the lean steps keep every row and
    every position (`vlrft.rollout.graph_decode`) and on CUDA are replayed as one CUDA graph; elsewhere
    those fixed-shape steps run eagerly. `cuda_graph=None`: on a CUDA device only. Long prompts of different lengths
    prefill in groups (`_prefill_groups`), and from SHARED_PROMPT_TOKENS a prompt's KV cache is held once
    for its group in the lean steps.
    """
    backbone, head = split_head(model)
    device = head.weight.device
    ids, mask = (t.to(device) for t in left_pad(prompt_ids, pad_id))
    prompt_len, max_new = ids.shape[1], sampling.max_new_tokens
    mm = mm_token_type_ids(ids, image_token_id, video_token_id)
    positions = prompt_positions(backbone, ids, mask, mm, visual.model_inputs())
    use_lean = lean_step and _lean_applies(backbone, positions[:, :, -1])
    cache = None
    # transformers' StaticCache allocates values in the keys' dtype, which under autocast differ (float32 rotated
    # keys, bf16 values) and the first write fails: under autocast the transformers layers decode on a dynamic cache.
    autocast_on = active_autocast_dtype(device) is not None
    groups = _prefill_groups(mask)
    # A batch prefilled in groups fills a dynamic cache (merged from the groups'), not a static one.
    static_cache = static_cache and not use_lean and not autocast_on and len(groups) == 1
    if static_cache:
        from transformers import StaticCache

        cache = StaticCache(config=backbone.config, max_cache_len=prompt_len + max_new)
    last, prefill_cache = _prefill(backbone, ids, mask, mm, positions, visual, cache, groups)
    rows = torch.arange(len(prompt_ids), device=device).repeat_interleave(sampling.n)
    hidden = last[rows]
    position = positions[:, rows, -1]  # [3, rows]: the last prompt position
    if cuda_graph is None:
        cuda_graph = device.type == "cuda"
    decoder = _make_decoder(backbone, prefill_cache, rows, mask[rows], position, max_new, mm.dtype,
                            lean=use_lean, cuda_graph=cuda_graph, autocast_on=autocast_on,
                            share_prompt=sampling.n > 1 and prompt_len >= SHARED_PROMPT_TOKENS,
                            static_cache=static_cache, compile_step=compile_step)
    prefill_cache = None  # it now lives in the decoder
    total = len(rows)
    # Buffers for every position the group can reach, written in place: the history (prompt + generated
    # ids: what repetition penalty and stop strings look at), and the outputs.
    history = torch.full((total, prompt_len + max_new), pad_id, dtype=ids.dtype, device=device)
    history[:, :prompt_len] = ids[rows]
    out_ids = torch.full((total, max_new), pad_id, dtype=torch.long, device=device)
    out_logprobs = torch.zeros(total, max_new, dtype=torch.float32, device=device)
    lengths = torch.zeros(total, dtype=torch.long, device=device)
    stopped = torch.zeros(total, dtype=torch.bool, device=device)
    processors = step_processors(sampling, suppressed_ids, head.weight.shape[0], device)
    stop_strings = _stop_string_criteria(tokenizer, sampling.stop)
    stop_tensor = torch.tensor(sorted(stop_ids), device=device)

    alive = torch.arange(total, device=device)  # original row of each running row
    vocab = head.weight.shape[0]
    # Whether some step's distribution was not a distribution (NaN/inf logits: diverged weights), kept on the device
    # and read once after the loop: a read per step would make the host wait for every step.
    broken = torch.zeros((), dtype=torch.bool, device=device)
    for step in range(max_new):
        seen = history[:, :prompt_len + step]
        scores = head(hidden).float()
        for processor in processors:
            scores = processor(seen, scores)
        if step < sampling.min_new_tokens:  # too early to stop
            scores = scores.index_fill(1, stop_tensor, float("-inf"))
        tokens, token_logprobs, not_finite = _next_tokens(scores, sampling.greedy, vocab)
        broken |= not_finite
        history[:, prompt_len + step] = tokens
        out_ids[alive, step] = tokens
        out_logprobs[alive, step] = token_logprobs
        lengths[alive] = step + 1
        finished = torch.isin(tokens, stop_tensor)
        if stop_strings is not None:
            finished |= stop_strings(history[:, :prompt_len + step + 1], scores).to(device)
        stopped[alive] = finished  # running rows were not stopped before: no boolean indexing (a device sync)
        if step == max_new - 1:
            break
        keep = ~finished
        running = int(keep.sum())  # the step's device sync (and `nonzero` below where rows stopped)
        if running == 0:
            break
        if running < keep.shape[0]:  # drop the rows that stopped from every later step
            index = keep.nonzero().squeeze(1)
            alive, tokens, history = alive[index], tokens[index], history[index]
            decoder.keep(index)
        hidden = decoder.step(tokens, step)
    if bool(broken):
        raise DivergedError("sampling: the policy's next-token distribution is not finite (NaN or inf logits): its "
                            "weights have diverged. Lower train.lr or train.max_grad_norm and resume from the last "
                            "checkpoint saved before it (train.resume=auto, or train.resume=<checkpoint>)")
    return _decoded_rows(out_ids, out_logprobs, lengths, stopped)


def _stop_string_criteria(tokenizer, stop: tuple[str, ...]):
    """transformers' stop-string matcher over the token history, or None without stop strings."""
    if not stop:
        return None
    from transformers import StopStringCriteria

    return StopStringCriteria(tokenizer, list(stop))


def _decoded_rows(out_ids: torch.Tensor, out_logprobs: torch.Tensor, lengths: torch.Tensor,
                  stopped: torch.Tensor) -> DecodedRows:
    """Each row's ids and logprobs up to its length, and its finish reason: one host copy of each buffer."""
    ids_out, lp_out = out_ids.tolist(), out_logprobs.tolist()
    lengths_out, stopped_out = lengths.tolist(), stopped.tolist()
    return DecodedRows([row[:k] for row, k in zip(ids_out, lengths_out)],
                       [row[:k] for row, k in zip(lp_out, lengths_out)],
                       [FINISH_STOP if s else FINISH_LENGTH for s in stopped_out])


def _make_decoder(backbone, prefill_cache, rows: torch.Tensor, row_mask: torch.Tensor, position: torch.Tensor,
                  max_new: int, mm_dtype: torch.dtype, *, lean: bool, cuda_graph: bool, autocast_on: bool,
                  share_prompt: bool, static_cache: bool, compile_step: bool):
    """The decoder of `decode_groups`: the lean step (fixed shapes under a CUDA graph, or replayed eagerly off CUDA)
    or transformers' layers, rows that stop dropped by `HalvingRowsDecoder` unless the shapes are fixed."""
    # The capture's warm-up steps write slots of their own: a call too short for them decodes without a graph.
    fixed = cuda_graph and max_new > WARMUP_STEPS
    if lean:
        if autocast_on:
            # The prefill's weight casts stay in autocast's cache until the region ends; the lean steps cast (and
            # concatenate) their own, so drop those: one bf16 copy of the weights while decoding, not two.
            torch.clear_autocast_cache()
        decoder = LeanDecoder(backbone.language_model, prefill_cache, rows, row_mask, position[0], max_new,
                              fixed_shapes=fixed, share_prompt=share_prompt, compiled=compile_step)
        if fixed:  # fixed-shape steps keep every row anyway
            return CudaGraphDecoder(decoder) if row_mask.device.type == "cuda" else FixedRowsDecoder(decoder)
    else:
        decoder = _TransformersDecoder(backbone, prefill_cache, rows, row_mask, position, max_new, mm_dtype,
                                       static_cache, compile_step)
    return HalvingRowsDecoder(decoder, len(rows))


def _next_tokens(scores: torch.Tensor, greedy: bool, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step's ids and their logprobs from the processed scores, and whether the distribution was not finite.

    NaN probabilities make the inverse CDF answer `vocab` (out of range): such an id never reaches an index
    operation (clamped here, the call refused by the caller); a NaN row's argmax is in range but its logprob is NaN.
    """
    tokens = scores.argmax(dim=-1) if greedy else sample_tokens(torch.softmax(scores, dim=-1))
    broken = (tokens >= vocab).any()
    tokens = tokens.clamp(max=vocab - 1)
    token_logprobs = torch.log_softmax(scores, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, token_logprobs, broken | token_logprobs.isnan().any()
