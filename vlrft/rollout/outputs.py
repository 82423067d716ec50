"""Engine outputs -> `Rollouts`: completion ids cut at the first stop token, finish reasons, sampled-token logprobs.

Pure Python over the engines' documented output shapes, so it is unit-tested on CPU:

* vLLM: `LLM.generate` returns one `RequestOutput` per prompt with `prompt_token_ids` (the prompt the
  engine ran, placeholders expanded) and `outputs: list[CompletionOutput]` (`index`, `token_ids`,
  `finish_reason` in {"stop", "length", "abort"}, `logprobs`: per position a mapping token id ->
  `Logprob(logprob=...)`, holding at least the sampled token when `SamplingParams.logprobs=0`).
* SGLang: `Engine.generate` returns one dict per completion, prompt-major when `n > 1`, with
  `meta_info["finish_reason"] = {"type": "stop" | "length" | "abort", ...}`,
  `meta_info["output_token_logprobs"] = [(logprob, token_id, text), ...]` when `return_logprob=True`,
  and `meta_info["prompt_tokens"]`. The ids are read from `output_token_logprobs`: `output_ids`
  has carried prompt tokens in some versions (sgl-project/sglang issue #17240).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vlrft.errors import UserError
from vlrft.rollout.base import FINISH_LENGTH, FINISH_STOP, Rollouts, cut_at_stop
from vlrft.rollout.requests import PromptRequest


class EngineError(RuntimeError):
    """The engine did something a rollout cannot be built from (an aborted request, a missing output)."""


class PromptMismatchError(UserError):
    """The engine ran a prompt that differs from our prompt ids: training would score a prompt never sampled."""


@dataclass(frozen=True)
class EngineSample:
    """One completion as the engine reported it, before our stop and finish rules."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str  # the engine's own word


def to_rollouts(samples: Sequence[EngineSample], n: int, stop_ids: set[int], max_new_tokens: int,
                decode: Callable[[list[list[int]]], list[str]], names: Sequence[str]) -> Rollouts:
    """`Rollouts` from prompt-major engine samples (`n` per prompt); `names[p]` names prompt p in errors.

    Ids are cut after the first stop id (the engine may return tokens past a stop id it was not
    told about). A completion is "length" when the engine hit a token limit (max_new_tokens or the
    model length) without a stop id, "stop" when a stop id or a stop string ended it.
    """
    completions: list[list[int]] = []
    reasons: list[str] = []
    logprobs: list[list[float]] = []
    for row, sample in enumerate(samples):
        where = f"{names[row // n]}, completion {row % n}"
        if sample.finish_reason not in (FINISH_STOP, FINISH_LENGTH):
            raise EngineError(f"{where}: the engine finished it with reason {sample.finish_reason!r}; only 'stop' and "
                              "'length' make a usable rollout (an 'abort' means the engine dropped the request: look "
                              "for engine errors above, e.g. out of memory or a prompt longer than max_model_len)")
        if sample.logprobs is not None and len(sample.logprobs) != len(sample.token_ids):
            raise EngineError(f"{where}: {len(sample.token_ids)} tokens but {len(sample.logprobs)} logprobs")
        ids, reason = cut_at_stop(list(sample.token_ids), stop_ids, max_new_tokens)
        if not (reason == FINISH_STOP and ids and ids[-1] in stop_ids):
            # No stop id: a stop string ended it ("stop"), or a token limit did ("length"; that includes the
            # model length, reached before max_new_tokens).
            reason = FINISH_STOP if sample.finish_reason == FINISH_STOP else FINISH_LENGTH
        completions.append(ids)
        reasons.append(reason)
        if sample.logprobs is not None:
            logprobs.append([float(v) for v in sample.logprobs[: len(ids)]])
    has_logprobs = all(s.logprobs is not None for s in samples)
    return Rollouts(n=n, completion_ids=completions, finish_reasons=reasons,
                    logprobs=logprobs if has_logprobs else None, texts=decode(completions))


def check_prompt(engine_ids: Sequence[int] | None, request: PromptRequest) -> None:
    """Raise `PromptMismatchError` unless the engine ran exactly our prompt ids (None: not reported, not checked)."""
    if engine_ids is None:
        return
    engine_ids = list(engine_ids)
    if engine_ids == request.prompt_ids:
        return
    first = next((i for i, (a, b) in enumerate(zip(engine_ids, request.prompt_ids)) if a != b),
                 min(len(engine_ids), len(request.prompt_ids)))
    raise PromptMismatchError(
        f"{request.name}: the engine ran a prompt of {len(engine_ids)} tokens but ours has {len(request.prompt_ids)}; "
        f"they first differ at position {first} (engine {engine_ids[first:first + 3]}, ours "
        f"{request.prompt_ids[first:first + 3]}). The engine's multimodal processor expanded the vision placeholders "
        "differently from ours (another image size, frame count or processor config in the model folder); use the "
        "same processor config for both, or rollout.engine=hf")


def _logprob_value(entry: Any) -> float:
    return float(getattr(entry, "logprob", entry))


def vllm_token_logprobs(step_logprobs: Sequence[Mapping[int, Any]] | None, token_ids: Sequence[int]) -> list[float] | None:
    """The logprob of each sampled token from vLLM's per-position {token id: Logprob} mappings."""
    if step_logprobs is None:
        return None
    if len(step_logprobs) != len(token_ids):
        raise EngineError(f"vLLM returned {len(step_logprobs)} logprob positions for {len(token_ids)} tokens")
    out = []
    for position, token in enumerate(token_ids):
        entry = step_logprobs[position]
        if token not in entry:
            raise EngineError(f"vLLM's logprobs at position {position} lack the sampled token {token}")
        out.append(_logprob_value(entry[token]))
    return out


def vllm_samples(outputs: Sequence[Any], requests: Sequence[PromptRequest], n: int) -> list[EngineSample]:
    """Prompt-major samples from vLLM `RequestOutput`s (one per request, in request order)."""
    if len(outputs) != len(requests):
        raise EngineError(f"vLLM returned {len(outputs)} outputs for {len(requests)} prompts")
    samples = []
    for output, request in zip(outputs, requests):
        check_prompt(getattr(output, "prompt_token_ids", None), request)
        completions = sorted(output.outputs, key=lambda c: c.index)
        if len(completions) != n:
            raise EngineError(f"{request.name}: vLLM returned {len(completions)} completions, expected n={n}")
        for completion in completions:
            ids = [int(t) for t in completion.token_ids]
            samples.append(EngineSample(ids, vllm_token_logprobs(completion.logprobs, ids),
                                        str(completion.finish_reason)))
    return samples


def _sglang_reason(meta: Mapping[str, Any]) -> str:
    reason = meta.get("finish_reason")
    if isinstance(reason, Mapping):
        return str(reason.get("type"))
    return str(reason)


def sglang_samples(outputs: Sequence[Mapping[str, Any]] | Mapping[str, Any], requests: Sequence[PromptRequest],
                   n: int) -> list[EngineSample]:
    """Prompt-major samples from SGLang's output dicts (`n` consecutive dicts per request)."""
    if isinstance(outputs, Mapping):
        outputs = [outputs]
    if len(outputs) != len(requests) * n:
        raise EngineError(f"SGLang returned {len(outputs)} outputs for {len(requests)} prompts x n={n}")
    samples = []
    for row, output in enumerate(outputs):
        request = requests[row // n]
        meta = output.get("meta_info", {})
        prompt_tokens = meta.get("prompt_tokens")
        if prompt_tokens is not None and int(prompt_tokens) != len(request.prompt_ids):
            raise PromptMismatchError(f"{request.name}: SGLang ran a prompt of {prompt_tokens} tokens but ours has "
                                      f"{len(request.prompt_ids)}; it must receive our ids verbatim")
        triples = meta.get("output_token_logprobs")
        if triples is not None:
            ids = [int(t[1]) for t in triples]
            logprobs: list[float] | None = [float(t[0]) for t in triples]
        else:
            ids, logprobs = [int(t) for t in output["output_ids"]], None
        completion_tokens = meta.get("completion_tokens")
        if completion_tokens is not None and int(completion_tokens) != len(ids):
            raise EngineError(f"{request.name}: SGLang reports {completion_tokens} completion tokens but returned "
                              f"{len(ids)} ids")
        samples.append(EngineSample(ids, logprobs, _sglang_reason(meta)))
    return samples
