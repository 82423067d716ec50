"""Micro-batches of a rank's rows: by a row count, or by a token budget (`train.max_tokens_per_micro_batch`).

With natural completion lengths (stop at EOS), a micro-batch formed by a row count is padded to its
widest completion, so a long row makes every short row in its micro-batch cost as much as itself.
A token budget instead keeps a prompt's rows together (its prompt then runs once) and micro-batches
within the budget (`by_token_budget`). A row over the budget on its own still forms its own
micro-batch.

What the budget counts (`forward_tokens`) is what a training forward processes: with prompt sharing
(`vlrft.models.actor.ActorVL`), each distinct prompt once at the micro-batch's widest prompt, plus
the completions, each class of similar length at its own widest (`vlrft.batch.width_classes`; with
`split_widths` off, as under sharding strategies, every row at the widest completion); without
sharing, every row at widest prompt + widest completion. Vision-encoder work is not counted.
`build_sequences` trims each micro-batch to its own widest prompt and completion, so this is the
forward's real size.

The loss stays exact whatever the partition: its denominators cover the whole mini-batch over all
ranks (`vlrft.algo.losses`), and micro-batch losses are summed by backward.

Ranks may form different numbers of micro-batches, but every forward/backward under FSDP2, ZeRO
and the vision-call balancing is a collective: the ranks agree on the largest count, and a rank
with fewer splits its largest micro-batches, or, when nothing is left to split, runs a *filler*
(one of its rows again, with a zero loss weight and its outputs discarded).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vlrft.batch import cheapest_runs, width_classes

# A run of rows joins an open micro-batch when that adds at most this share of its own forward's tokens in
# padding (fewer, fuller micro-batches for a little padding).
PADDING_TOLERANCE = 0.05


@dataclass(frozen=True)
class MicroBatch:
    """Rows of one forward; a `filler` runs only so every rank runs as many forwards (zero weight, output unused)."""

    rows: list[int]
    filler: bool = False


@dataclass(frozen=True)
class RowLengths:
    """Per-row lengths of this rank's rows (indexed by row): its prompt's id, its prompt and completion lengths."""

    prompt: Sequence[int]  # row -> its prompt's index (rows with the same index share a prompt)
    prompt_length: Sequence[int]  # row -> tokens of its prompt
    completion_length: Sequence[int]  # row -> tokens of its completion

    @classmethod
    def of(cls, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
           row_prompt: Sequence[int]) -> "RowLengths":
        return cls(list(row_prompt), [len(prompt_ids[p]) for p in row_prompt],
                   [max(1, len(c)) for c in completion_ids])


def forward_tokens(lengths: RowLengths, rows: Sequence[int], share_prompts: bool = True,
                   split_widths: bool = True) -> int:
    """Token positions a training forward over `rows` processes, padding included (see the module docstring).

    `split_widths`: the completions run in classes of similar length (`vlrft.batch.width_classes`),
    each padded to its own widest, as `ActorVL` does outside sharding strategies.
    """
    if not rows:
        return 0
    width_p = max(lengths.prompt_length[r] for r in rows)
    if not share_prompts:
        return len(rows) * (width_p + max(lengths.completion_length[r] for r in rows))
    completion = [lengths.completion_length[r] for r in rows]
    if split_widths:
        completion_tokens = sum(len(c) * max(completion[i] for i in c) for c in width_classes(completion))
    else:
        completion_tokens = len(rows) * max(completion)
    return len({lengths.prompt[r] for r in rows}) * width_p + completion_tokens


def real_tokens(lengths: RowLengths, rows: Sequence[int]) -> int:
    """The least any forward over `rows` processes: each distinct prompt once, every completion, no padding."""
    prompts = {lengths.prompt[r]: lengths.prompt_length[r] for r in rows}
    return sum(prompts.values()) + sum(lengths.completion_length[r] for r in rows)


def by_row_count(rows: Sequence[int], size: int) -> list[list[int]]:
    """Consecutive runs of `size` rows (`train.micro_batch_completions_per_rank`)."""
    rows = list(rows)
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def by_token_budget(lengths: RowLengths, rows: Sequence[int], max_tokens: int, share_prompts: bool = True,
                    on_oversized: Callable[[int, int], None] | None = None,
                    split_widths: bool = True) -> list[list[int]]:
    """Rows grouped so each micro-batch's `forward_tokens` stays within `max_tokens`.

    Two stages. Each prompt's rows, longest first, are cut into runs: with `split_widths` only where
    the budget ends, else also where padding them together costs more tokens than running the
    prompt once more (`_cut_group`). The runs, longest first, then each join the micro-batch where they add the
    fewest tokens beyond their own forward (none if they share its prompt and width), if that stays
    within the budget and within `PADDING_TOLERANCE` of their own size; else they start a new one.
    `on_oversized(row, tokens)` is called for a row whose own forward exceeds the budget (it still
    forms its own micro-batch).
    """
    groups: dict[int, list[int]] = {}
    for r in rows:
        groups.setdefault(lengths.prompt[r], []).append(r)
    runs = []
    for group in groups.values():
        group.sort(key=lambda r: (-lengths.completion_length[r], r))
        runs += _cut_group(lengths, group, max_tokens, share_prompts, split_widths)
    runs.sort(key=lambda run: (-lengths.completion_length[run[0]], -len(run), run[0]))
    bins: list[list[int]] = []
    costs: list[int] = []
    for run in runs:
        alone = forward_tokens(lengths, run, share_prompts, split_widths)
        if alone > max_tokens and on_oversized is not None:
            on_oversized(run[0], alone)
        best, best_waste = None, None
        for i, rows_in in enumerate(bins):
            cost = forward_tokens(lengths, rows_in + run, share_prompts, split_widths)
            waste = cost - costs[i] - alone
            if cost <= max_tokens and (best_waste is None or waste < best_waste):
                best, best_waste = i, waste
        if best is not None and best_waste <= PADDING_TOLERANCE * alone:
            bins[best] += run
            costs[best] = forward_tokens(lengths, bins[best], share_prompts, split_widths)
        else:
            bins.append(list(run))
            costs.append(alone)
    return [sorted(b) for b in bins]


def _cut_group(lengths: RowLengths, group: list[int], max_tokens: int, share_prompts: bool,
               split_widths: bool) -> list[list[int]]:
    """One prompt's rows (longest first) cut into consecutive runs of the fewest forward tokens in all, each
    within the budget (a single row always forms a run): a dynamic programme over the cut points. With
    `split_widths` a run pads nothing worth cutting for, so runs are only cut where the budget ends."""
    if split_widths and share_prompts:
        runs: list[list[int]] = []
        for r in group:
            if runs and forward_tokens(lengths, runs[-1] + [r], share_prompts, split_widths) <= max_tokens:
                runs[-1].append(r)
            else:
                runs.append([r])
        return runs

    def cost(i: int, j: int) -> int | None:
        tokens = forward_tokens(lengths, group[i:j], share_prompts, split_widths)
        return None if tokens > max_tokens and j - i > 1 else tokens  # longer runs ending at j only grow

    return [group[i:j] for i, j in cheapest_runs(len(group), cost)]


def padded_to_count(micro: list[list[int]], count: int, lengths: RowLengths | None,
                    share_prompts: bool = True, split_widths: bool = True,
                    spare: list[int] | None = None) -> list[MicroBatch]:
    """`micro` grown to `count` micro-batches: the largest ones split in two, then fillers (module docstring).

    A filler repeats this rank's cheapest row; with no rows of its own to train, the cheapest of `spare`
    (rows it holds but leaves out, e.g. rows whose loss is 0)."""
    micro = [list(m) for m in micro if m]
    if count > len(micro) and not micro and not spare:
        raise RuntimeError("a rank with no rows cannot take part in the other ranks' micro-batches")
    cost = (lambda m: forward_tokens(lengths, m, share_prompts, split_widths)) if lengths is not None else len
    while len(micro) < count:
        splittable = [i for i, m in enumerate(micro) if len(m) > 1]
        if not splittable:
            break
        i = max(splittable, key=lambda j: cost(micro[j]))
        rows = micro.pop(i)
        if lengths is not None:  # keep rows of similar length together
            rows = sorted(rows, key=lambda r: (-lengths.completion_length[r], lengths.prompt[r], r))
        half = len(rows) // 2
        micro[i:i] = [sorted(rows[:half]), sorted(rows[half:])]
    out = [MicroBatch(m) for m in micro]
    if len(out) < count:
        all_rows = [r for m in micro for r in m] or list(spare)
        cheapest = min(all_rows, key=lambda r: cost([r]))
        out += [MicroBatch([cheapest], filler=True)] * (count - len(out))
    return out


def share_every_forward(models) -> None:
    """Make the ActorVLs inside `models` take the shared-prompt path in every forward (`ActorVL.share_every_forward`).

    Under sharding strategies every rank must call the sharded blocks equally often; with token-budget
    micro-batches one rank's micro-batch may repeat a prompt (two backbone calls) while another's does
    not (one call), so all take the two-call path, which gives the same values.
    """
    for model in models:
        for module in model.modules() if model is not None else ():
            if hasattr(module, "share_every_forward"):
                module.share_every_forward = True
