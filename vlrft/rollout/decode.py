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
from vlrft.models.actor import split_head
from vlrft.models.positions import prompt_positions
from vlrft.rollout.base import FINISH_LENGTH, FINISH_STOP, SamplingParams
from vlrft.vision import mm_token_type_ids


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


@torch.no_grad()
def decode_groups(model, prompt_ids: list[list[int]], visual_inputs: dict, sampling: SamplingParams, *,
                  pad_id: int, stop_ids: set[int], image_token_id: int, video_token_id: int,
                  suppressed_ids: tuple[int, ...] = (), tokenizer=None) -> DecodedRows:
    """Sample `sampling.n` completions for each prompt; rows are ordered prompt by prompt."""
    backbone, head = split_head(model)
    device = head.weight.device
    ids, mask = (t.to(device) for t in left_pad(prompt_ids, pad_id))
    mm = mm_token_type_ids(ids, image_token_id, video_token_id)
    positions = prompt_positions(backbone, ids, mask, mm, visual_inputs)
    out = backbone(input_ids=ids, attention_mask=mask, mm_token_type_ids=mm, position_ids=positions, use_cache=True,
                   **visual_inputs)
    n = sampling.n
    rows = torch.arange(len(prompt_ids), device=device).repeat_interleave(n)
    cache = out.past_key_values
    cache.batch_select_indices(rows)
    hidden = out.last_hidden_state[rows, -1]
    position = positions[:, rows, -1]  # [3, rows]: the last prompt position; each new token adds 1 on all axes
    attention = mask[rows]
    history = ids[rows]  # prompt + generated ids: what repetition penalty and stop strings look at
    processors = sampling_processors(sampling, suppressed_ids, device)
    stop_strings = None
    if sampling.stop:
        from transformers import StopStringCriteria

        stop_strings = StopStringCriteria(tokenizer, list(sampling.stop))
    stop_tensor = torch.tensor(sorted(stop_ids), device=device)

    total = len(rows)
    generated: list[list[int]] = [[] for _ in range(total)]
    logprobs: list[list[float]] = [[] for _ in range(total)]
    reasons = [FINISH_LENGTH] * total
    alive = torch.arange(total, device=device)  # original row of each running row
    for step in range(sampling.max_new_tokens):
        scores = processors(history, head(hidden).float())
        if step < sampling.min_new_tokens:  # too early to stop
            scores = scores.index_fill(1, stop_tensor, float("-inf"))
        if sampling.greedy:
            tokens = scores.argmax(dim=-1)
        else:
            tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        token_logprobs = torch.log_softmax(scores, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        history = torch.cat([history, tokens[:, None]], dim=1)
        finished = torch.isin(tokens, stop_tensor)
        if stop_strings is not None:
            finished |= stop_strings(history, scores).to(device)
        for row, token, lp in zip(alive.tolist(), tokens.tolist(), token_logprobs.tolist()):
            generated[row].append(token)
            logprobs[row].append(lp)
        for row in alive[finished].tolist():
            reasons[row] = FINISH_STOP
        keep = ~finished
        if step == sampling.max_new_tokens - 1 or not bool(keep.any()):
            break
        if not bool(keep.all()):  # drop the rows that stopped from every later step
            index = keep.nonzero().squeeze(1)
            alive, tokens, position, history = alive[index], tokens[index], position[:, index], history[index]
            attention = attention[index]
            cache.batch_select_indices(index)
        position = position + 1  # as vlrft.models.positions.positions_after places them
        attention = torch.cat([attention, attention.new_ones(len(alive), 1)], dim=1)
        out = backbone(input_ids=tokens[:, None], attention_mask=attention, position_ids=position[:, :, None],
                       past_key_values=cache, use_cache=True, mm_token_type_ids=torch.zeros_like(tokens[:, None]))
        hidden = out.last_hidden_state[:, -1]
    return DecodedRows(generated, logprobs, reasons)
