#!/usr/bin/env python
"""The memory plan's activation-like terms against the tensors the code really keeps alive, counted on the CPU.

    python bench/bench_plan_terms.py [--quick]

Each term of `vlrft plan` that is not a parameter count (`vlrft.plan.activations`) is checked against the code path
it models, run on a random tiny model (`vlrft.models.tiny`), by counting live tensor storages: every storage an op
makes inside a `TorchDispatchMode` is tracked until it is freed (a weakref finalizer), so the counts are the CPU
stand-in for the CUDA allocator's. Parameters and their (pre-allocated) gradients are not counted: they are the
plan's `parameters` and `gradients`.

- `activations`, `prompt_kv`, `weight_casts`: `ActorVL.predicting_states` (the shared-prompt forward) and the
  backward of a loss on its states, under bf16 autocast over float32 weights (the GPUs' mixed precision, with the
  trainer's `forward_autocast`: no cast cache under checkpointing) or in float32. At the peak of forward + backward
  the live storages are split into the prompt pass's key/value records and their gradients (`prompt_kv`, taken as
  the most of them alive at once), the first gradient each parameter's accumulator receives (`pending_grads`: the
  completion pass's, waiting for the prompt pass's), bf16 copies of parameters (`weight_casts`) and the rest
  (`activations`). Each case runs the backward as one graph (`ddp`, DeepSpeed) or, marked `staged`, one backbone
  call at a time (`single`, `fsdp2`: `vlrft.models.staged_backward`), where no gradient waits.
- `logits`: `vlrft.models.logprobs.token_logprobs` and its backward on [tokens, hidden] states: the peak less the
  head's float32 gradient buffer and its bf16 copy (`head_backward`, measured beside it).

Prints one row per case and term (measured, planned, their ratio) and a summary (min-max of measured / planned per
term), which docs/memory_plan.md quotes. `tests/test_plan_terms.py` checks each term on a smaller grid.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vlrft.models.staged_backward import Stage, StagedBackward  # noqa: E402


def _has_storage(tensor: torch.Tensor) -> bool:
    """Whether `tensor` has a storage of its own (not a wrapper subclass such as DTensor, whose local tensor does)."""
    try:
        tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return True


class LiveStorages(TorchDispatchMode):
    """Every storage made by an op inside the mode, from its creation to its release, as a timeline; tensors can be
    tagged (after they are made) and the timeline replayed for the tagged bytes alive at the overall peak, or the
    most of a set of tags alive at once. Storages of `ignored` tensors are never counted."""

    def __init__(self, ignored=(), casts_of=()):
        super().__init__()
        self._live: dict[int, tuple[int, int]] = {}  # data_ptr -> (id, bytes)
        self._ids = itertools.count()
        self.events: list[tuple[int, int]] = []  # (id, +bytes made / -bytes freed)
        self.tags: dict[int, str] = {}
        self._casts_of = {t.untyped_storage().data_ptr() for t in casts_of}
        for t in ignored:
            self._live.setdefault(t.untyped_storage().data_ptr(), (-1, 0))
        self.context: str | None = None  # the tag of every storage made while it is set (`_track`)
        self._excluded: set[int] = set()  # storages (`_cdata`) counted by `made` / `released` instead
        self._resized: dict[int, tuple[int, int]] = {}  # key -> (id, bytes) of storages counted by `made`

    def exclude(self, storage) -> None:
        """Never count `storage` as an op's output: a storage that is resized in place (FSDP2's gathered parameters,
        whose bytes come and go without a new storage) is counted by `made` and `released`."""
        self._excluded.add(storage._cdata)

    def made(self, key: int, size: int, tag: str) -> None:
        """`size` bytes under `key` (not an op's output storage) allocated now, tagged `tag`."""
        if key not in self._resized and size:
            ident = next(self._ids)
            self._resized[key] = (ident, size)
            self.tags[ident] = tag
            self.events.append((ident, size))

    def released(self, key: int) -> None:
        ident, size = self._resized.pop(key, (-1, 0))
        if ident >= 0:
            self.events.append((ident, -size))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # autocast's bf16 copy of a float32 parameter
        cast = (func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor)
                and args[0].untyped_storage().data_ptr() in self._casts_of)
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta and _has_storage(tensor):
                self._track(tensor.untyped_storage(), "weight_casts" if cast else self.context)
        return out

    def _track(self, storage, tag: str | None) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if key in self._live or size == 0 or storage._cdata in self._excluded:
            return
        ident = next(self._ids)
        self._live[key] = (ident, size)
        if tag:
            self.tags[ident] = tag
        self.events.append((ident, size))
        weakref.finalize(storage, self._gone, key)

    def _gone(self, key: int) -> None:
        ident, size = self._live.pop(key, (-1, 0))
        if ident >= 0:
            self.events.append((ident, -size))

    def tag(self, tensor: torch.Tensor, name: str) -> None:
        """Tag the storage of `tensor` (made inside the mode and alive now)."""
        ident, _ = self._live.get(tensor.untyped_storage().data_ptr(), (-1, 0))
        if ident >= 0:
            self.tags.setdefault(ident, name)

    def peak_breakdown(self) -> tuple[int, dict[str, int]]:
        """(peak bytes, bytes per tag at the peak; untagged under 'activations')."""
        alive: dict[int, int] = {}
        current = peak = 0
        at_peak: dict[int, int] = {}
        for ident, delta in self.events:
            current += delta
            if delta > 0:
                alive[ident] = delta
            else:
                alive.pop(ident, None)
            if current > peak:
                peak, at_peak = current, dict(alive)
        split: dict[str, int] = {}
        for ident, size in at_peak.items():
            name = self.tags.get(ident, "activations")
            split[name] = split.get(name, 0) + size
        return peak, split

    def most_alive(self, names: set[str]) -> int:
        """The most bytes of storages tagged with one of `names` alive at once."""
        current = most = 0
        for ident, delta in self.events:
            if self.tags.get(ident) in names:
                current += delta
                most = max(most, current)
        return most


@dataclass(frozen=True)
class Case:
    """One training micro-batch of the grid."""

    hidden: int = 128
    layers: int = 4
    vocab: int = 512
    heads: int = 4
    kv_heads: int = 2
    prompts: int = 1
    rows_per_prompt: int = 4
    prompt_len: int = 256
    completion_len: int = 32
    image_grid: int = 0  # an image of image_grid x image_grid patches per prompt (0: text only)
    checkpointing: bool = True
    mixed: bool = True  # bf16 autocast over float32 weights
    # the backward one backbone call at a time (`ActorVL.backward_in_stages`: strategies single and fsdp2); False:
    # one graph, as under ddp and deepspeed
    stages: bool = False

    def describe(self) -> str:
        return (f"h{self.hidden} L{self.layers} V{self.vocab} kv{self.kv_heads}/{self.heads} "
                f"{self.prompts}x{self.rows_per_prompt} rows P{self.prompt_len} C{self.completion_len} "
                f"img{self.image_grid ** 2} ckpt{int(self.checkpointing)} {'bf16' if self.mixed else 'fp32'} "
                f"{'staged' if self.stages else 'one-graph'}")


def _model(case: Case):
    from vlrft.models.actor import ActorVL
    from vlrft.models.tiny import TinySpec, build_tiny_model, build_tokenizer

    spec = TinySpec(arch="qwen2_5_vl", hidden_size=case.hidden, num_layers=case.layers, num_heads=case.heads,
                    num_kv_heads=case.kv_heads, intermediate_size=int(case.hidden * 2.75), vocab_size=case.vocab)
    tokenizer = build_tokenizer(spec.vocab_size)
    model = build_tiny_model(spec, tokenizer)
    if case.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    actor = ActorVL(model, model.config.image_token_id, model.config.video_token_id)
    actor.backward_in_stages = case.stages
    return model, actor, tokenizer


def _batch(case: Case, model, tokenizer):
    """The case's rows: each prompt (its image's placeholders first, then random text) continued by its rows."""
    from vlrft.batch import build_sequences
    from vlrft.vision import VisualBatch

    g = torch.Generator().manual_seed(0)
    cfg = model.config
    image = []
    if case.image_grid:
        tokens = case.image_grid ** 2 // 4  # 2 x 2 patches per token
        image = [cfg.vision_start_token_id] + [cfg.image_token_id] * tokens + [cfg.vision_end_token_id]
    text = case.prompt_len - len(image)
    prompts = [image + torch.randint(20, case.vocab - 20, (text,), generator=g).tolist() for _ in range(case.prompts)]
    rows = case.prompts * case.rows_per_prompt
    completions = [torch.randint(20, case.vocab - 20, (case.completion_len,), generator=g).tolist()
                   for _ in range(rows)]
    if case.image_grid:
        v = cfg.vision_config
        width = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
        visual = VisualBatch(torch.randn(case.prompts * case.image_grid ** 2, width, generator=g),
                             torch.tensor([[1, case.image_grid, case.image_grid]] * case.prompts), None, None,
                             (1,) * case.prompts, (0,) * case.prompts, v.spatial_merge_size)
    else:
        visual = VisualBatch.empty(case.prompts, 2)
    return build_sequences(prompts, visual, completions, [r // case.rows_per_prompt for r in range(rows)],
                           tokenizer.pad_token_id)


@contextlib.contextmanager
def tagged_prompt_kv(meter: LiveStorages):
    """Inside the block, `ActorVL`'s shared forward records its prompt pass's keys and values as usual; `tag()` (the
    callable yielded) tags every record made so far as `prompt_kv` and returns them. The actor module's cache
    factory is restored after."""
    import vlrft.models.actor as actor_module

    recorded = []
    making = actor_module.recording_cache

    def recording():
        cache = making()
        recorded.append(cache)
        return cache

    def tag() -> list[torch.Tensor]:
        records = [record for cache in recorded for layer in cache.layers for record in (layer.keys, layer.values)]
        for record in records:
            meter.tag(record, "prompt_kv")
        del recorded[:]
        return records

    actor_module.recording_cache = recording
    try:
        yield tag
    finally:
        actor_module.recording_cache = making


def _tag_gradients(meter: LiveStorages, output: torch.Tensor, records: list[torch.Tensor],
                   others: str | None = None) -> None:
    """Tag, as the backward makes them, the gradients that wait in autograd's buffers: the first sent to each
    parameter's accumulator (`pending_grads`: the completion pass's, which wait there for the prompt pass's) and every
    one sent to a key/value record, and their sum (`prompt_kv`), by hooks on the graph's nodes. With `others`, only
    the first sent to an accumulator that receives two or more in one backward (a parameter both passes use) is
    `pending_grads`, and every other gradient sent to an accumulator is tagged `others` (under FSDP2 they become the
    unsharded `.grad`). A backward in stages (`vlrft.models.staged_backward`) is followed into each stage's own
    backward; the gradients a hand-off keeps for the records are `prompt_kv`."""
    record_nodes = {record.grad_fn for record in records if record.grad_fn is not None}
    arrived: set = set()

    def tagging(slots: list[tuple[int, object]], senders: dict):
        def hook(grad_inputs, grad_outputs):
            for index, target in slots:
                if not isinstance(grad_inputs[index], torch.Tensor):
                    continue
                if target in record_nodes:
                    meter.tag(grad_inputs[index], "prompt_kv")
                elif target not in arrived and (others is None or senders[target] > 1):
                    arrived.add(target)  # a later one is added to it at once
                    meter.tag(grad_inputs[index], "pending_grads")
                elif others is not None:
                    meter.tag(grad_inputs[index], others)
        return hook

    for roots in _backwards(output):
        seen, stack, senders, hooked = set(), list(roots), {}, []
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if node in record_nodes:  # the sum of the contributions
                node.register_prehook(lambda grads: tagging([(0, next(iter(record_nodes)))], {})(grads, None))
            if _tap_owner(node, Stage) is not None:  # a staged forward's hand-off
                _tag_handoff(meter, node, records)
            slots = [(i, n) for i, (n, _) in enumerate(node.next_functions)
                     if n is not None and (type(n).__name__ == "AccumulateGrad" or n in record_nodes)]
            for _, target in slots:
                senders[target] = senders.get(target, 0) + 1
            if slots:
                hooked.append((node, slots))
            stack += [n for n, _ in node.next_functions]
        for node, slots in hooked:
            node.register_hook(tagging(slots, senders))


def _tag_handoff(meter: LiveStorages, node, records: list[torch.Tensor]) -> None:
    """Tag as `prompt_kv` the gradients a staged forward's hand-off (a `_Tap` node) receives and keeps for `records`."""
    from torch.autograd.graph import get_gradient_edge

    if getattr(node, "_tagged", False):
        return
    node._tagged = True
    wanted = {(get_gradient_edge(r).node, get_gradient_edge(r).output_nr) for r in records if r.requires_grad}
    stage = _tap_owner(node, Stage)
    indices = [i for i, e in enumerate(stage.edges) if e is not None and (e.node, e.output_nr) in wanted]

    def tag(grads):
        for i in indices:
            for grad in (grads[i] if i < len(grads) else None, stage.grads[i]):
                if isinstance(grad, torch.Tensor):
                    meter.tag(grad, "prompt_kv")

    node.register_prehook(lambda grads: tag(grads))
    node.register_hook(lambda grad_inputs, grad_outputs: tag(()))


def _tap_owner(node, kind: type):
    """The `Stage` (a hand-off) or `StagedBackward` (the exits) whose method a staged forward's tap node calls in its
    backward (`vlrft.models.staged_backward._Tap`), if `node` is such a node of `kind`."""
    owner = getattr(getattr(node, "receive", None), "__self__", None)
    return owner if isinstance(owner, kind) else None


def _staged(output: torch.Tensor) -> list:
    """The `StagedBackward`s whose exits `output` is made from (none when the forward was one graph)."""
    found, seen, stack = [], set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if _tap_owner(node, StagedBackward) is not None:
            found.append(_tap_owner(node, StagedBackward))
        stack += [n for n, _ in node.next_functions]
    return found


def _backwards(output: torch.Tensor) -> list[list]:
    """The top nodes of each backward `output`'s backward runs: its own, and each stage's of a staged one."""
    runs = [[output.grad_fn]]
    for staged in _staged(output):
        runs.append([e.node for e in staged.exits if e is not None])
        runs += [[e.node for e in stage.edges if e is not None] for stage in staged.stages]
    return runs


def measure_micro_batch(case: Case) -> tuple[dict[str, int], dict[str, int]]:
    """(measured, planned) bytes of `activations`, `prompt_kv` and `weight_casts` for one micro-batch."""
    from vlrft.plan import shape_from_config
    from vlrft.plan.activations import MicroBatchSize, SharedGradients, micro_batch_terms, shared_gradients

    model, actor, tokenizer = _model(case)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)  # as from an earlier micro-batch: the plan's `gradients`
    seqs = _batch(case, model, tokenizer)
    meter = LiveStorages(ignored=params + [p.grad for p in params], casts_of=params)
    with meter, tagged_prompt_kv(meter) as tag_prompt_kv:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.mixed, cache_enabled=not case.checkpointing):
            states = actor.predicting_states(seqs)
        records = tag_prompt_kv()
        _tag_gradients(meter, states, records)
        del records
        states.float().square().mean().backward()
        del states
    _, split = meter.peak_breakdown()
    measured = {"activations": split.get("activations", 0), "prompt_kv": meter.most_alive({"prompt_kv"}),
                "weight_casts": split.get("weight_casts", 0), "pending_grads": split.get("pending_grads", 0)}
    shape = shape_from_config(model.config.to_dict())
    rows = case.prompts * case.rows_per_prompt
    batch = MicroBatchSize(case.prompts * case.prompt_len + rows * case.completion_len,
                           case.prompts * case.image_grid ** 2, rows, case.prompts * case.prompt_len,
                           rows * case.completion_len, "")
    planned = micro_batch_terms(shape, batch, case.prompt_len, case.completion_len, case.checkpointing,
                                2 if case.mixed else 4, float32_weights=case.mixed,
                                # float32, all trained; none wait in a staged backward
                                shared=SharedGradients() if case.stages else shared_gradients(shape, 4,
                                                                                              2 if case.mixed else 4))
    return measured, planned


def measure_logits(vocab: int, hidden: int, tokens: int, mixed: bool) -> tuple[dict[str, int], dict[str, int]]:
    """(measured, planned) `logits` and `head_backward` of `token_logprobs` over `tokens` states and its backward."""
    from types import SimpleNamespace

    from vlrft.models.logprobs import token_logprobs
    from vlrft.plan.activations import head_backward_bytes, logits_bytes

    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    head.weight.grad = torch.zeros_like(head.weight)
    states = torch.randn(tokens, hidden, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    meter = LiveStorages(ignored=[head.weight, head.weight.grad, states, targets], casts_of=[head.weight])
    with meter:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed, cache_enabled=False):
            logprobs, entropy = token_logprobs(states, head, targets)
        (logprobs.sum() + entropy.mean()).backward()
        del logprobs, entropy
    # the head's own: its float32 gradient buffer (made in the backward) and its bf16 copy
    for ident, size in list(meter.events):
        if size == 4 * vocab * hidden and ident not in meter.tags:
            meter.tags[ident] = "head_backward"
    peak, split = meter.peak_breakdown()
    head_part = split.get("head_backward", 0) + split.get("weight_casts", 0)
    shape = SimpleNamespace(text=SimpleNamespace(vocab_size=vocab, hidden_size=hidden))
    return ({"logits": peak - head_part, "head_backward": head_part},
            {"logits": logits_bytes(shape, tokens), "head_backward": head_backward_bytes(shape, True, mixed, tokens)})


def micro_batch_grid(quick: bool) -> list[Case]:
    base = [Case()]
    if not quick:
        base += [Case(hidden=256, heads=8, kv_heads=2), Case(layers=8), Case(kv_heads=4),
                 Case(prompts=2, rows_per_prompt=2), Case(prompt_len=512, completion_len=16),
                 Case(prompt_len=128, completion_len=128), Case(image_grid=16)]
    return [Case(**{**c.__dict__, "checkpointing": ckpt, "mixed": mixed, "stages": stages})
            for c in base for ckpt in (True, False) for mixed in (True, False)
            for stages in ((False, True) if c == base[0] else (False,))]


LOGITS_GRID = [(512, 64, 600), (4096, 64, 600), (4096, 64, 2048), (32768, 64, 1500), (4096, 128, 300),
               (65536, 32, 300)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one micro-batch shape (4 cases) and three head cases")
    args = parser.parse_args()
    ratios: dict[str, list[float]] = {}
    print(f"{'case':68s} {'term':14s} {'measured MiB':>12s} {'planned MiB':>12s} {'ratio':>6s}")

    def report(label, measured, planned):
        for term, value in measured.items():
            if planned.get(term):
                ratio = value / planned[term]
                ratios.setdefault(term, []).append(ratio)
                print(f"{label:68s} {term:14s} {value / 2 ** 20:12.2f} {planned[term] / 2 ** 20:12.2f} {ratio:6.2f}",
                      flush=True)
            elif term == "pending_grads":  # a staged backward: none planned
                print(f"{label:68s} {term:14s} {value / 2 ** 20:12.2f} {0:12.2f}", flush=True)

    for vocab, hidden, tokens in LOGITS_GRID[:3] if args.quick else LOGITS_GRID:
        for mixed in (True, False):
            report(f"head V{vocab} h{hidden} N{tokens} {'bf16' if mixed else 'fp32'}",
                   *measure_logits(vocab, hidden, tokens, mixed))
    for case in micro_batch_grid(args.quick):
        report(case.describe(), *measure_micro_batch(case))
    print("\nterm            measured / planned (min - max over the grid)")
    for term, values in ratios.items():
        print(f"{term:15s} {min(values):.2f} - {max(values):.2f} ({len(values)} cases)")


if __name__ == "__main__":
    main()
