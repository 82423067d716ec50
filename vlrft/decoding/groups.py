"""Group decoding: each prompt is prefilled once, then `n` completions continue it, sampled as `generate` samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlrft.data.processor import left_pad
from vlrft.decoding.prefill import prefill, prefill_groups
from vlrft.decoding.processors import next_tokens, step_processors, stop_string_criteria
from vlrft.decoding.table import VARIANTS, DecodeInputs, Decoder, choose, lean_applies
from vlrft.decoding.transformers_layers import has_sliding_window
from vlrft.errors import DivergedError
from vlrft.models.actor import split_head
from vlrft.models.positions import has_rope_index, prompt_positions
from vlrft.models.precision import active_autocast_dtype
from vlrft.sampling import FINISH_LENGTH, FINISH_STOP, SamplingParams, shares_prompt
from vlrft.vision import VisualBatch, mm_token_type_ids


@dataclass
class DecodedRows:
    """Per completion row: generated ids (stop token included), logprobs and finish reason."""

    ids: list[list[int]]
    logprobs: list[list[float]]
    reasons: list[str]


@dataclass
class _Loop:
    """What the per-token loop reads besides the decoder: the head, the sampling and its processors."""

    head: torch.nn.Module
    sampling: SamplingParams
    processors: list
    stop_strings: object  # transformers' StopStringCriteria, or None
    stop_tensor: torch.Tensor
    pad_id: int


@torch.no_grad()
def decode_groups(model, prompt_ids: list[list[int]], visual: VisualBatch, sampling: SamplingParams, *,
                  pad_id: int, stop_ids: set[int], image_token_id: int, video_token_id: int,
                  suppressed_ids: tuple[int, ...] = (), tokenizer=None, static_cache: bool | None = None,
                  lean_step: bool = True, cuda_graph: bool | None = None) -> DecodedRows:
    """Sample `sampling.n` completions for each prompt; rows are ordered prompt by prompt.

    The decoder is the variant `vlrft.decoding.table.choose` names for the model, the device and the options:
    `lean_step` (rollout.lean_decode), `cuda_graph` (rollout.cuda_graph_decode; None: on CUDA), `static_cache`
    (None: on CUDA).
    """
    backbone, head = split_head(model)
    device = head.weight.device
    ids, mask = (t.to(device) for t in left_pad(prompt_ids, pad_id))
    prompt_len, max_new = ids.shape[1], sampling.max_new_tokens
    mm = mm_token_type_ids(ids, image_token_id, video_token_id)
    positions = prompt_positions(backbone, ids, mask, mm, visual.model_inputs())
    if not has_rope_index(backbone):  # 1-D positions (Gemma 3, InternVL 3, LLaVA-OneVision, SmolVLM): one axis
        positions = positions[:1]
    groups = prefill_groups(mask)
    variant = VARIANTS[choose(lean=lean_step and lean_applies(backbone, positions[:, :, -1]), device=device,
                              max_new_tokens=max_new, cuda_graph=cuda_graph, static_cache=static_cache,
                              autocast_on=active_autocast_dtype(device) is not None,
                              one_prefill=len(groups) == 1, sliding_window=has_sliding_window(backbone))]
    cache = None
    if variant.static_cache:
        from transformers import StaticCache

        cache = StaticCache(config=backbone.config, max_cache_len=prompt_len + max_new)
    last, prefill_cache = prefill(backbone, ids, mask, mm, positions, visual, cache, groups)
    rows = torch.arange(len(prompt_ids), device=device).repeat_interleave(sampling.n)
    decoder = variant.build(DecodeInputs(backbone, prefill_cache, rows, mask[rows], positions[:, rows, -1], max_new,
                                         mm.dtype, shares_prompt(sampling.n, prompt_len)))
    prefill_cache = None  # it now lives in the decoder
    loop = _Loop(head, sampling, step_processors(sampling, suppressed_ids, head.weight.shape[0], device),
                 stop_string_criteria(tokenizer, sampling.stop), torch.tensor(sorted(stop_ids), device=device), pad_id)
    return _sample(loop, decoder, last[rows], ids[rows])


def _sample(loop: _Loop, decoder: Decoder, hidden: torch.Tensor, prompts: torch.Tensor) -> DecodedRows:
    """The per-token loop: sample from `hidden` (each row's last hidden state), feed the tokens to `decoder`."""
    total, prompt_len = prompts.shape
    max_new, device, vocab = loop.sampling.max_new_tokens, prompts.device, loop.head.weight.shape[0]
    # Buffers for every position the group can reach, written in place: the history (prompt + generated
    # ids: what repetition penalty and stop strings look at), and the outputs.
    history = torch.full((total, prompt_len + max_new), loop.pad_id, dtype=prompts.dtype, device=device)
    history[:, :prompt_len] = prompts
    out_ids = torch.full((total, max_new), loop.pad_id, dtype=torch.long, device=device)
    out_logprobs = torch.zeros(total, max_new, dtype=torch.float32, device=device)
    lengths = torch.zeros(total, dtype=torch.long, device=device)
    stopped = torch.zeros(total, dtype=torch.bool, device=device)
    alive = torch.arange(total, device=device)  # original row of each running row
    # NaN/inf logits (diverged weights) are flagged on the device and read once after the loop, not once per step.
    broken = torch.zeros((), dtype=torch.bool, device=device)
    for step in range(max_new):
        seen = history[:, :prompt_len + step]
        scores = loop.head(hidden).float()
        for processor in loop.processors:
            scores = processor(seen, scores)
        if step < loop.sampling.min_new_tokens:  # too early to stop
            scores = scores.index_fill(1, loop.stop_tensor, float("-inf"))
        tokens, token_logprobs, not_finite = next_tokens(scores, loop.sampling.greedy, vocab)
        broken |= not_finite
        history[:, prompt_len + step] = tokens
        out_ids[alive, step] = tokens
        out_logprobs[alive, step] = token_logprobs
        lengths[alive] = step + 1
        finished = torch.isin(tokens, loop.stop_tensor)
        if loop.stop_strings is not None:
            finished |= loop.stop_strings(history[:, :prompt_len + step + 1], scores).to(device)
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


def _decoded_rows(out_ids: torch.Tensor, out_logprobs: torch.Tensor, lengths: torch.Tensor,
                  stopped: torch.Tensor) -> DecodedRows:
    """Each row's ids and logprobs up to its length, and its finish reason: one host copy of each buffer."""
    ids_out, lp_out = out_ids.tolist(), out_logprobs.tolist()
    lengths_out, stopped_out = lengths.tolist(), stopped.tolist()
    return DecodedRows([row[:k] for row, k in zip(ids_out, lengths_out)],
                       [row[:k] for row, k in zip(lp_out, lengths_out)],
                       [FINISH_STOP if s else FINISH_LENGTH for s in stopped_out])
