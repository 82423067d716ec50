"""Grader worker process: math-verify (sympy) equivalence checks, one JSON request per line on stdin.

Started by `vlrft.rewards.grading` as `python -m vlrft.rewards.math_worker --memory-mb M --op-timeout S`.
It prints `ready`, then answers each `[answer, answer_is_extracted, reference]` line with `true` or
`false`. Running here, in a process's main thread, lets math-verify's signal alarm bound each step,
and the address-space limit turns memory bombs into a MemoryError here instead of in the trainer.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import resource
import sys

import math_verify

# math-verify logs the whole input on a timeout; a 1 MB adversarial completion must not reach the logs.
logging.getLogger("math_verify").setLevel(logging.CRITICAL)


def limit_memory(memory_mb: int) -> None:
    """Cap this process's address space so a memory bomb raises MemoryError instead of exhausting the machine."""
    if memory_mb > 0:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = memory_mb * 2**20 if hard == resource.RLIM_INFINITY else min(memory_mb * 2**20, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


@functools.lru_cache(maxsize=4096)
def _parse_reference(reference: str, op_timeout: int) -> list:
    # The reference is a bare answer ("\frac{1}{2}", "42"); boxing it anchors math-verify's LaTeX extraction.
    text = reference if ("\\boxed" in reference or "$" in reference) else f"\\boxed{{{reference}}}"
    return math_verify.parse(text, parsing_timeout=op_timeout)


def grade(answer: str, answer_is_extracted: bool, reference: str, op_timeout: int) -> bool:
    """True when `answer` is mathematically equivalent to `reference`.

    An answer taken from `<answer>`/`\\boxed{}` is boxed again so plain LaTeX parses; free text is left
    to math-verify's own extraction (its last LaTeX or expression). Each parse and comparison is bounded
    by math-verify's alarm of `op_timeout` seconds; the parent kills the process as a last resort.
    """
    gold = _parse_reference(reference, op_timeout)
    if not gold:
        return False
    text = f"\\boxed{{{answer}}}" if answer_is_extracted and "\\boxed" not in answer else answer
    pred = math_verify.parse(text, parsing_timeout=op_timeout)
    if not pred and answer_is_extracted:
        pred = math_verify.parse(answer, parsing_timeout=op_timeout)
    return bool(pred) and bool(math_verify.verify(gold, pred, timeout_seconds=op_timeout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-mb", type=int, default=2048)
    parser.add_argument("--op-timeout", type=int, default=1)
    args = parser.parse_args()
    # Answers go to the original stdout only; anything a library prints goes to stderr.
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr
    limit_memory(args.memory_mb)
    protocol.write("ready\n")
    for line in sys.stdin:
        try:
            answer, extracted, reference = json.loads(line)
            ok = grade(str(answer), bool(extracted), str(reference), args.op_timeout)
        except BaseException:  # MemoryError, RecursionError, a sympy bug: the answer is not gradable, so wrong
            ok = False
        protocol.write("true\n" if ok else "false\n")


if __name__ == "__main__":
    main()
