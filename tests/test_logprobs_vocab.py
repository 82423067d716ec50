"""Chunked LM-head logprobs with large vocabularies: same values and gradients, no whole [tokens, vocab] tensor."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vlrft.models.logprobs import chunk_tokens_for, token_logprobs


class _LargestTensor(TorchDispatchMode):
    """Records the most elements any op's output had (forward, recompute and backward alike)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _full(hidden, head, targets, temperature, suppressed=()):
    logits = head(hidden).float() / temperature
    if suppressed:
        logits = logits.index_fill(-1, torch.tensor(suppressed), float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)
    probs = logp.exp()
    entropy = -(probs * logp.masked_fill(probs == 0, 0.0)).sum(-1)
    return logp.gather(1, targets[:, None]).squeeze(1), entropy


def _case(tokens=300, vocab=3000, width=32, bias=False):
    torch.manual_seed(0)
    head = torch.nn.Linear(width, vocab, bias=bias)
    hidden = torch.randn(tokens, width, requires_grad=True)
    targets = torch.randint(0, vocab - 2, (tokens,))
    return head, hidden, targets


def test_budgeted_chunks_equal_the_full_log_softmax_in_values_and_gradients():
    head, hidden, targets = _case(bias=True)
    budget = 64 * 3000  # 64 tokens per chunk, recomputed in backward (300 x 3000 logits exceed one chunk)
    lp, ent = token_logprobs(hidden, head, targets, temperature=0.7, suppressed_ids=(2998, 2999),
                             max_chunk_elements=budget)
    ref_lp, ref_ent = _full(hidden, head, targets, 0.7, (2998, 2999))
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-4)
    weights = torch.randn(len(targets))
    loss, ref_loss = (lp * weights).sum() + ent.mean(), (ref_lp * weights).sum() + ref_ent.mean()
    grads = torch.autograd.grad(loss, (hidden, head.weight, head.bias))
    expected = torch.autograd.grad(ref_loss, (hidden, head.weight, head.bias))
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want, atol=1e-5)


def test_no_op_makes_a_tokens_by_vocab_tensor_in_forward_or_backward():
    head, hidden, targets = _case(tokens=400, vocab=5000)
    budget = 50 * 5000
    with _LargestTensor() as probe:
        lp, ent = token_logprobs(hidden, head, targets, max_chunk_elements=budget)
        (lp.sum() + ent.sum()).backward()
    assert probe.largest <= max(budget, head.weight.numel())  # one chunk of logits, or the head's own gradient
    assert probe.largest < 400 * 5000 // 4


def test_chunk_size_shrinks_with_the_vocabulary_so_logits_per_chunk_stay_bounded():
    assert chunk_tokens_for(1024) == 1024  # small heads keep the old 1024-token chunks
    for vocab in (32_000, 152_064, 262_144):
        assert chunk_tokens_for(vocab) * vocab <= 1 << 24
        assert chunk_tokens_for(vocab) * vocab > (1 << 24) // 2
    assert chunk_tokens_for(10**9) == 1


def test_without_gradients_the_lean_path_gives_the_same_values():
    head, hidden, targets = _case(bias=True)
    with torch.no_grad():
        lp, ent = token_logprobs(hidden, head, targets, temperature=1.3, suppressed_ids=(2999,), max_chunk_elements=70 * 3000)
        ref_lp, ref_ent = _full(hidden, head, targets, 1.3, (2999,))
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-4)


def test_under_autocast_recomputed_chunks_give_autograds_gradients(monkeypatch):
    """The trainer's mixed precision on GPUs (bf16 autocast over float32 weights), here on the CPU: backward runs
    after the autocast region is left, so the recomputed chunks re-enter it. Gradients within 0.5 % of autograd
    through the same bf16 head (measured: 0 for the hidden states, 0.15 % for the head, summed over chunks in
    float32); recomputing in float32 against the bf16 forward's log-normaliser measured 3.7 %."""
    from vlrft.models import logprobs

    monkeypatch.setattr(logprobs, "HEAD_GRAD_BLOCK_ROWS", 1024)  # the head's gradient in 3 blocks of rows
    head, hidden, targets = _case(tokens=200, vocab=3000, width=64)
    with torch.no_grad():
        head.weight.mul_(16.0)  # confident tokens (large logits), where bf16 rounding of the normaliser shows
    weights = torch.randn(len(targets))
    results = []
    for budget in (64 * 3000, 10**9):  # recomputed in backward (_ChunkedHead), and kept for autograd
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, ent = token_logprobs(hidden, head, targets, max_chunk_elements=budget)
        loss = (lp * weights).sum() + ent.mean()
        results.append(torch.autograd.grad(loss, (hidden, head.weight)))
    for got, want in zip(*results):
        assert got.dtype == want.dtype == torch.float32
        assert (got - want).norm() <= 0.005 * want.norm()


@pytest.mark.slow
def test_under_autocast_without_its_cast_cache_the_head_is_cast_once_per_pass():
    """Under gradient checkpointing the trainer's autocast caches no weight cast (`precision.forward_autocast`), so a
    matmul per chunk would cast the whole [vocab, hidden] head again for every chunk of ~110 tokens (152k rows):
    token_logprobs casts it once for the forward and once for the recomputing backward, whatever the chunk count.
    Values and gradients equal those under autocast's own cached casts."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HeadCasts(TorchDispatchMode):
        def __init__(self, shape):
            super().__init__()
            self.shape, self.count = shape, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == self.shape:
                self.count += 1
            return func(*args, **(kwargs or {}))

    head, hidden, targets = _case(tokens=200, vocab=3000, width=64)
    results = []
    for cache in (False, True):
        for budget in (16 * 3000, 10**9):  # 13 chunks recomputed in backward (_ChunkedHead); kept for autograd
            with HeadCasts(tuple(head.weight.shape)) as casts:
                with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
                    lp, ent = token_logprobs(hidden, head, targets, max_chunk_elements=budget, chunk_tokens=16)
                grads = torch.autograd.grad(lp.sum() + ent.mean(), (hidden, head.weight))
            assert casts.count <= 2, (cache, budget, casts.count)
            results.append((lp, ent, *grads))
    for uncached, cached in zip(results[:2], results[2:]):
        assert all(torch.equal(a, b) for a, b in zip(uncached, cached))


@pytest.mark.slow
def test_the_heads_backward_allocates_what_the_plan_counts_for_it():
    """The chunked head's backward allocates a float32 [vocab, hidden] gradient (accumulated over the chunks before it
    reaches .grad) and, under bf16 autocast over float32 weights, the head cast once: `vlrft plan`'s head_backward.
    Measured (bytes made during the backward, beyond the hidden states' gradient) against it, with the head's .grad
    already there as from a second micro-batch: at least the planned bytes, and not more than those plus two chunks of
    logits."""
    from _live_bytes import LiveBytes

    from vlrft.plan.activations import LOGITS_CHUNK_BYTES, LOGITS_CHUNK_ELEMENTS, head_backward_bytes

    head, hidden, targets = _case(tokens=200, vocab=3000, width=64)
    budget = 16 * 3000  # 13 chunks, recomputed in backward
    shape = SimpleNamespace(text=SimpleNamespace(vocab_size=3000, hidden_size=64))  # what the plan reads of a model
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            lp, ent = token_logprobs(hidden, head, targets, max_chunk_elements=budget, chunk_tokens=16)
        (lp.sum() + ent.mean()).backward(retain_graph=True)  # .grad exists, as after a first micro-batch
        with LiveBytes().ignore(head.weight, head.weight.grad, hidden, hidden.grad) as live:
            (lp.sum() + ent.mean()).backward()
        # as the plan counts a micro-batch above one chunk's budget (this one's budget is made small)
        planned = head_backward_bytes(shape, trained=True, float32_weights=autocast,
                                      completion_tokens=LOGITS_CHUNK_ELEMENTS)
        chunk = 2 * 16 * 3000 * LOGITS_CHUNK_BYTES  # two chunks of 16 tokens, as the plan counts one
        assert planned <= live.peak <= planned + chunk, (autocast, planned, live.peak)
        head.weight.grad = hidden.grad = None


def test_entropy_and_its_gradient_at_a_152k_vocabulary_match_float64():
    """A Qwen2.5-VL-sized vocabulary (151,936) with logits of the spread and offset of a trained head: entropy and
    its gradient within 1e-5 relative of float64, in every path (kept for autograd, recomputed chunk by chunk in
    backward, no gradients). The head and states are float64 so that the float32 logits' arithmetic is all that
    differs from the reference (float32 matmuls summing 152k vocabulary rows into the states' gradient would add
    their own ~4e-5, as they do for the logprobs' gradient). Measured before the fix: entropy 7e-4 relative,
    its gradient 1.1e-3 (recomputed chunks) and 7e-5 (autograd); after: 1e-6 and 4e-6."""
    vocab, width, tokens = 151_936, 8, 6
    torch.manual_seed(0)
    hidden = torch.randn(tokens, width, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(vocab, width, dtype=torch.float64) * 1.5).requires_grad_()
    bias = torch.full((vocab,), 30.0, dtype=torch.float64)  # logits around 30, as a trained LM head's often are
    bias[:50] += 8.0  # a few likely tokens
    bias = bias.requires_grad_()
    head = SimpleNamespace(weight=weight, bias=bias)
    targets = torch.randint(0, vocab, (tokens,))
    log_p = torch.log_softmax(torch.nn.functional.linear(hidden, weight, bias), dim=-1)  # float64 throughout
    ref_lp, ref_ent = log_p.gather(1, targets[:, None]).squeeze(1), -(log_p.exp() * log_p).sum(-1)
    mix = torch.randn(tokens, dtype=torch.float64)
    ref_grads = torch.autograd.grad((ref_ent * mix).sum(), (hidden, weight, bias))
    with torch.no_grad():
        _, lean_ent = token_logprobs(hidden, head, targets)
    assert ((lean_ent.double() - ref_ent).abs() / ref_ent).max() < 1e-5
    for budget in (10**9, 2 * vocab):  # kept for autograd (one chunk), recomputed in backward (3 chunks of 2)
        lp, ent = token_logprobs(hidden, head, targets, max_chunk_elements=budget)
        assert ((ent.double() - ref_ent).abs() / ref_ent).max() < 1e-5, budget
        assert (lp.double() - ref_lp.detach()).abs().max() < 1e-5
        grads = torch.autograd.grad((ent * mix).sum(), (hidden, weight, bias))
        for got, want in zip(grads, ref_grads):
            assert (got.double() - want).norm() <= 1e-5 * want.norm(), budget


def test_kept_mass_of_top_k_and_top_p_in_every_path_matches_a_hand_count():
    """The log of the mass top-k then top-p keep: the k largest probabilities, renormalised, then the smallest set
    of them holding p, counted by hand; the same kept for autograd, recomputed in backward, and without gradients."""
    from vlrft.models.logprobs import SamplingTruncation

    head, hidden, targets = _case(tokens=40, vocab=3000)
    with torch.no_grad():
        head.weight.mul_(8.0)  # peaked distributions, so the filters cut
    truncation = SamplingTruncation(top_k=50, top_p=0.7)
    probs = torch.softmax(head(hidden).double() / 0.9, dim=-1)
    expected = []
    for row in probs:
        top = row.sort(descending=True).values[:50]
        within = top / top.sum()
        count = int((within.cumsum(0) < 0.7).sum()) + 1  # the smallest prefix reaching 0.7
        expected.append(top[:count].sum().log())
    expected = torch.stack(expected)
    with torch.no_grad():
        *_, lean = token_logprobs(hidden, head, targets, temperature=0.9, truncation=truncation)
    for budget in (10**9, 8 * 3000):
        lp, ent, kept = token_logprobs(hidden, head, targets, temperature=0.9, truncation=truncation,
                                       max_chunk_elements=budget)
        assert not kept.requires_grad and torch.allclose(kept.double(), expected, atol=1e-5), budget
        (lp.sum() + ent.sum()).backward()  # the third output does not get in the way of the backward
    assert torch.allclose(lean.double(), expected, atol=1e-5) and (expected < -0.01).any()


def _reference_kept_mass(probs: list[float], steps: list[tuple[str, float]]) -> float:
    """Written apart from vlrft and transformers: apply the filters in `steps` one after the other, each on the
    renormalised distribution the previous ones left, and return the original mass of what is left (float64)."""
    kept = {i: p for i, p in enumerate(probs)}
    for name, value in steps:
        total = sum(kept.values())
        ranked = sorted(kept.items(), key=lambda item: -item[1])
        if name == "top_k":  # the k most likely (ties with the k-th stay)
            threshold = ranked[min(int(value), len(ranked)) - 1][1]
            kept = {i: p for i, p in ranked if p >= threshold}
        elif name == "top_p":  # the most likely tokens until their renormalised mass reaches p (at least one)
            new, before = {}, 0.0
            for i, p in ranked:
                if new and before >= value:
                    break
                new[i] = p
                before += p / total
            kept = new
        elif name == "min_p":  # at least min_p times the most likely token's probability
            kept = {i: p for i, p in ranked if p >= value * ranked[0][1]}
    return math.log(sum(kept.values()))


def test_kept_mass_follows_the_filter_order_of_the_engine_that_sampled():
    """vLLM runs min-p before top-k / top-p, transformers (the hf engine) and SGLang after: at T = 0.5, top-p 0.8,
    min-p 0.3 the mass kept differs. Each engine's truncation equals a hand-written reference of its own order
    on random logits, on rows where the two orders disagree."""
    from vlrft.models.logprobs import SamplingTruncation, kept_log_mass

    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 50, generator=generator, dtype=torch.float64) * 1.5 / 0.5  # T = 0.5
    log_p = torch.log_softmax(logits, dim=-1)
    orders = {"hf": ("top_k", "top_p", "min_p"), "sglang": ("top_k", "top_p", "min_p"),
              "vllm": ("min_p", "top_k", "top_p"), "vllm_server": ("min_p", "top_k", "top_p")}
    for filters in ({"top_p": 0.8, "min_p": 0.3}, {"top_k": 6, "top_p": 0.8, "min_p": 0.3}):
        expected = {}
        for engine, order in orders.items():
            steps = [(name, filters[name]) for name in order if name in filters]
            expected[engine] = torch.tensor([_reference_kept_mass(row.exp().tolist(), steps) for row in log_p],
                                            dtype=torch.float64)
            got = kept_log_mass(log_p, SamplingTruncation(**filters, engine=engine))
            assert torch.allclose(got, expected[engine], atol=1e-9), (engine, filters)
        differ = (expected["hf"] - expected["vllm"]).abs() > 1e-3
        assert differ.sum() >= 5, filters  # the orders do differ on these logits
        assert (expected["vllm"] - expected["hf"])[differ].abs().max() > 0.05
    with pytest.raises(ValueError, match="filter order"):
        SamplingTruncation(top_p=0.9, engine="other")


def test_the_trainer_asks_for_the_rollout_engines_filter_order():
    from vlrft.trainer.trainer import Trainer

    for engine in ("hf", "vllm"):
        cfg = SimpleNamespace(rollout=SimpleNamespace(top_k=0, top_p=0.8, min_p=0.3, engine=engine),
                              algorithm=SimpleNamespace(tis_cap=2.0))
        truncation = Trainer._sampling_truncation(SimpleNamespace(cfg=cfg))
        assert truncation.engine == engine and (truncation.top_p, truncation.min_p) == (0.8, 0.3)
