"""Step time and staleness of synchronous and asynchronous training, simulated from measured times.

    python bench/simulate_async.py check --generate 2.1 --train 1.3 [--sync 0.1]      # against a 2-core bench run
    python bench/simulate_async.py scale --request-times times.json --train-gpu-s 40 --requests 128 \\
        --server-gpus 2 --server-concurrency 64 [--gpus 8,16,64,256] [--sync 2]

The protocol simulated is vlrft's (`vlrft/trainer/producer.py`, `vlrft/rollout/weight_transfer.py`): the producer
starts step j once the trainer has synced j - k times (k = rollout.max_staleness); the trainer trains step j once it
is generated and step j - 1 is trained and synced; a sync waits for the generation in flight (vLLM's pause mode
"wait") and then pauses the servers for `--sync` seconds (bench_async's P). k = 0 is the synchronous step
(G + T + sync). `--train` is the trainer's time per step without P (bench_async's T - P).

`check` takes the per-step generation time G, training time and sync of one setting (bench/bench_async.py's G,
T - P and P medians) and prints the predicted step time at k = 0, 1, 2 next to max(G, T), to hold against the measured async
step. `scale` splits N GPUs between servers (groups of --server-gpus, each a tensor-parallel server) and trainers:
a step's requests (a group each) go to the least-loaded server; a server runs up to --server-concurrency requests at
once, each taking its measured time (drawn with replacement from --request-times, seconds, their long tail kept)
while the batch is not throughput-bound, and at least sum(times) / concurrency when it is; training takes
--train-gpu-s GPU-seconds per step spread over the trainer GPUs (ideal data parallelism). It prints, per N, the best
split for k = 0 and k = 1 and the simulated staleness. A model of the protocol, not of any engine's kernels.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
from collections.abc import Callable, Sequence


def simulate(generate: Callable[[int], float], train: Callable[[int], float], k: int, sync_s: float,
             steps: int = 60) -> tuple[float, float]:
    """(seconds per step in the steady state, mean staleness in syncs) of the producer/trainer protocol.

    One producer collects steps in order, one at a time: step j starts once step j - 1 is generated and j - k syncs
    are done (k = 0: after sync j - 1). The trainer trains step j (`train(j)` seconds, the trainer's side of its sync
    included) once it is generated and step j - 1 is synced, then syncs: the pause (vLLM's mode "wait") lets a
    generation in flight finish first, and the servers then load for `sync_s` seconds, generating nothing; a
    generation that would start meanwhile starts at the resume."""
    gen_start, gen_end, sync_start, sync_end = [0.0], [generate(0)], [], []
    for j in range(steps):
        train_done = max(gen_end[j], sync_end[j - 1] if j else 0.0) + train(j)
        if k >= 1:  # the producer's next step may already run: it needs step j generated and j + 1 - k syncs
            start = max(gen_end[j], sync_end[j - k] if j - k >= 0 else 0.0)
            if j and sync_start[j - 1] <= start < sync_end[j - 1]:
                start = sync_end[j - 1]
            in_flight = start <= train_done
            sync_start.append(max(train_done, start + generate(j + 1)) if in_flight else train_done)
            sync_end.append(sync_start[j] + sync_s)
            if not in_flight:
                start = max(start, sync_end[j]) if start < sync_end[j] else start
        else:
            sync_start.append(train_done)
            sync_end.append(train_done + sync_s)
            start = sync_end[j]
        gen_start.append(start)
        gen_end.append(start + generate(j + 1))
    tail = steps // 3
    step_s = (sync_end[-1] - sync_end[tail]) / (steps - 1 - tail)
    staleness = [sum(1 for t in sync_end[:j] if t > gen_start[j]) for j in range(tail, steps)]
    return step_s, statistics.fmean(staleness)


def generation_time(request_times: Sequence[float], requests: int, servers: int, concurrency: int,
                    rng: random.Random) -> float:
    """One step's generation on `servers` servers: each request to the least-loaded one (fewest outstanding)."""
    load: list[tuple[int, int]] = [(0, s) for s in range(servers)]
    per_server: list[list[float]] = [[] for _ in range(servers)]
    for _ in range(requests):
        count, s = heapq.heappop(load)
        per_server[s].append(rng.choice(request_times))
        heapq.heappush(load, (count + 1, s))
    return max((max(times, default=0.0) if len(times) <= concurrency else max(max(times), sum(times) / concurrency))
               for times in per_server)


def check(args) -> None:
    print(f"G = {args.generate:.2f} s, train = {args.train:.2f} s, sync = {args.sync:.2f} s; "
          f"max(G, train + sync) = {max(args.generate, args.train + args.sync):.2f} s")
    for k in (0, 1, 2):
        step, stale = simulate(lambda j: args.generate, lambda j: args.train, k, args.sync)
        print(f"max_staleness={k}: {step:.2f} s/step, staleness {stale:.2f}")


def scale(args) -> None:
    times = json.loads(open(args.request_times).read())
    rng = random.Random(0)
    print(f"{len(times)} request times: median {statistics.median(times):.2f} s, max {max(times):.2f} s; "
          f"{args.requests} requests per step, {args.train_gpu_s:.0f} train GPU-s per step, sync {args.sync} s")
    print(f"{'GPUs':>5} {'k':>2} {'servers':>8} {'trainers':>8} {'s/step':>8} {'staleness':>9}")
    for gpus in [int(g) for g in args.gpus.split(",")]:
        for k in (0, 1):
            best = None
            for servers in range(1, gpus // args.server_gpus):
                trainers = gpus - servers * args.server_gpus
                step, stale = simulate(
                    lambda j, s=servers: generation_time(times, args.requests, s, args.server_concurrency, rng),
                    lambda j, n=trainers: args.train_gpu_s / n, k, args.sync)
                if best is None or step < best[0]:
                    best = (step, servers, trainers, stale)
            print(f"{gpus:>5} {k:>2} {best[1]:>8} {best[2]:>8} {best[0]:>8.2f} {best[3]:>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check")
    c.add_argument("--generate", type=float, required=True)
    c.add_argument("--train", type=float, required=True)
    c.add_argument("--sync", type=float, default=0.0)
    s = sub.add_parser("scale")
    s.add_argument("--request-times", required=True, help="JSON list of per-request generation seconds")
    s.add_argument("--requests", type=int, required=True, help="requests (groups) per step")
    s.add_argument("--train-gpu-s", type=float, required=True, help="GPU-seconds of training per step")
    s.add_argument("--server-gpus", type=int, default=1)
    s.add_argument("--server-concurrency", type=int, default=64)
    s.add_argument("--gpus", default="8,16,32,64,128,256")
    s.add_argument("--sync", type=float, default=0.0)
    args = parser.parse_args()
    check(args) if args.command == "check" else scale(args)


if __name__ == "__main__":
    main()
