#!/usr/bin/env python
"""Logprob/entropy memory and time with realistic vocabularies: vlrft's chunked LM head vs a full fp32 log-softmax.

    python bench/bench_vocab.py [--vocabs 32768,65536,152064] [--tokens 512] [--hidden 1024] [--repeats 1]

A random mid-size Qwen2 text backbone (`--hidden`, 2 layers) runs forward on `--tokens` completion
tokens; their hidden states go through an LM head of each vocabulary size, then logprobs and
entropy are computed (a) by `vlrft.models.logprobs.token_logprobs` (chunked, checkpointed) and (b)
by materialising the whole [tokens, vocab] float32 log-softmax, and a GRPO-like loss
(logprob x advantage + entropy) is back-propagated. Each (method, vocabulary) runs in a fresh
subprocess; the peak is the process's peak RSS (VmHWM, reset through /proc/self/clear_refs after the
model is built) minus its RSS at that point, so it counts only what the step itself allocates.
The backbone's own activations are in both columns alike; the head's weight gradient
([vocab, hidden] float32, which any method must hold) is printed apart and subtracted in "beyond
grad". Asserted (exit code 1 otherwise): the chunked peak beyond the head gradient grows by less
than 25 % from the smallest to the largest vocabulary.

Timings on a shared, loaded machine are indicative only; memory figures are deterministic enough.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MIB = 1 << 20


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def full_logprobs(hidden, head, targets):
    """The naive reference: one [tokens, vocab] float32 log-softmax, kept whole for backward."""
    import torch

    logp = torch.log_softmax(head(hidden).float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, targets[:, None]).squeeze(1), entropy


def worker(method: str, vocab: int, tokens: int, hidden_size: int, repeats: int) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2Model

    from vlrft.models.logprobs import chunk_tokens_for, token_logprobs

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=1024, hidden_size=hidden_size, intermediate_size=hidden_size * 11 // 4,
                         num_hidden_layers=2, num_attention_heads=hidden_size // 64, num_key_value_heads=2)
    backbone = Qwen2Model(config)  # the input embedding's size does not matter here: a small one
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    ids = torch.randint(0, 1024, (tokens // 128, 128))
    targets = torch.randint(0, vocab, (ids.numel(),))
    advantages = torch.randn(ids.numel())
    compute = token_logprobs if method == "chunked" else full_logprobs
    times = []
    rss_before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    for _ in range(repeats):
        start = time.perf_counter()
        states = backbone(input_ids=ids).last_hidden_state.reshape(-1, hidden_size)
        logprobs, entropy = compute(states, head, targets)
        ((logprobs * advantages).mean() + 0.01 * entropy.mean()).backward()
        times.append(time.perf_counter() - start)
        backbone.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)
    peak = (_status_kib("VmHWM") - rss_before) * 1024
    return dict(method=method, vocab=vocab, tokens=ids.numel(), peak_mib=peak / MIB, seconds=min(times),
                chunk_tokens=chunk_tokens_for(vocab) if method == "chunked" else ids.numel(),
                full_logits_mib=ids.numel() * vocab * 4 / MIB, head_grad_mib=vocab * hidden_size * 4 / MIB)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocabs", default="32768,65536,152064")
    parser.add_argument("--tokens", type=int, default=512, help="completion tokens (multiple of 128)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=1, help="steps per subprocess; the fastest is reported")
    parser.add_argument("--methods", default="chunked,full")
    parser.add_argument("--rounds", type=int, default=1,
                        help="interleaved rounds (chunked, full, chunked, full, ...); times as min/median/max")
    parser.add_argument("--json")
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "VOCAB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.tokens, args.hidden, args.repeats)))
        return
    rows = []
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for vocab in [int(v) for v in args.vocabs.split(",")]:
        runs: dict[str, list[dict]] = {m: [] for m in args.methods.split(",")}
        for _ in range(args.rounds):
            for method in runs:
                out = subprocess.run([sys.executable, __file__, "--worker", method, str(vocab), "--tokens",
                                      str(args.tokens), "--hidden", str(args.hidden), "--repeats", str(args.repeats)],
                                     capture_output=True, text=True, env=env, check=True)
                runs[method].append(json.loads(out.stdout.strip().splitlines()[-1]))
        for method, results in runs.items():
            r = dict(results[0], peak_mib=max(x["peak_mib"] for x in results),
                     seconds_all=[x["seconds"] for x in results])
            rows.append(r)
            times = sorted(r["seconds_all"])
            print(f"vocab {r['vocab']:>7}  {r['method']:<8} chunk {r['chunk_tokens']:>5} tok  "
                  f"peak {r['peak_mib']:6.0f} MiB, beyond head grad ({r['head_grad_mib']:4.0f}) "
                  f"{r['peak_mib'] - r['head_grad_mib']:6.0f} MiB  (whole fp32 logits {r['full_logits_mib']:5.0f} MiB)  "
                  f"step {times[0]:6.2f}/{statistics.median(times):6.2f}/{times[-1]:6.2f} s (min/median/max)",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    chunked = [r for r in rows if r["method"] == "chunked"]
    if len(chunked) >= 2:
        beyond = [r["peak_mib"] - r["head_grad_mib"] for r in (chunked[0], chunked[-1])]
        growth = beyond[1] / max(beyond[0], 1.0)
        print(f"chunked peak beyond the head gradient, largest / smallest vocabulary: {growth:.2f}x")
        if growth > 1.25:
            sys.exit("chunked peak memory grows with the vocabulary")


if __name__ == "__main__":
    main()
