"""Multi-turn rollouts with tools: the model writes, calls a tool, reads its text/images, and goes on.

One tokenization across turns. A trajectory's ids are the prompt's ids, then each model turn's ids
exactly as the engine sampled them, then each observation's ids, appended as they come. The
conversation is never re-templated: an observation is templated on its own (the chat template
renders it as the next user turn, `<tool_response>`-wrapped, after a fixed dummy history, and the
part after that history is cut out), run through the same processor (so its images get their
placeholders expanded and their pixels/grids), and appended. The next turn is sampled from that
exact id sequence (the engine receives it as a prompt together with all the trajectory's images,
in order), so the ids and images the trainer sees are those the engine sampled from.

`sampled_mask` marks model-sampled tokens (1) and everything else (0: observation text, templates,
image placeholders); only sampled tokens get a loss, an entropy and a KL term
(`vlrft.trainer.experience`). Images added mid-trajectory join the row's visual tensors after the
prompt's; positions come from the model's own M-RoPE rule over the full sequence.

Training forward: the shared-prompt forward stays (each group's prompt runs once); the tool images
ride along per row (`SequenceBatch.completion_visual`), are encoded in the continuation pass and
placed on their placeholders, with positions from the model's M-RoPE rule over the whole row.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from vlrft.batch import join_samples
from vlrft.rollout.base import FINISH_LENGTH, FINISH_STOP, Rollouts, SamplingParams, engine_state, load_engine_state
from vlrft.tools.parsing import TOOL_CALL_CLOSE, MalformedCall, parse_qwen_tool_call
from vlrft.tools.toolset import ERROR_PREFIX, ToolSet
from vlrft.tools.types import ToolCall, ToolContext, ToolOutput, ToolStats
from vlrft.vision import VisualBatch, crop_rows

if TYPE_CHECKING:
    from vlrft.data import PromptBatch
    from vlrft.tokens import TokenSpec

_SENTINEL = "\uE000vlrft-turn\uE001"
# The last turn allowed (rollout.max_turns) wrote a tool call that no tool answers: the trajectory ends there, its call
# text is what rewards read (not truncated: mask_truncated keeps it; rewards usually score it 0, which teaches the model
# to answer within max_turns), counted in tools/unanswered_calls.
FINISH_MAX_TURNS = "max_turns"
TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a json "
    "object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class ObservationTemplate:
    """Observation ids (and visual tensors) for a tool output, templated on their own by the chat template."""

    def __init__(self, processor, image_bounds=None, role: str = "user", media_limits=None):
        """`media_limits`: a tool image's refusal thresholds (`MediaLimits`; None: the defaults)."""
        from vlrft.data.media import MediaLimits

        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.image_bounds = image_bounds
        self.media_limits = media_limits or MediaLimits()
        self.role = role
        history = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                   {"role": "assistant", "content": _SENTINEL}]
        before = self._render(history, generation=False)
        self.closing = before[before.index(_SENTINEL) + len(_SENTINEL):]  # e.g. "<|im_end|>\n"
        self._history = history
        self._before = before

    def _render(self, messages: list[dict], generation: bool) -> str:
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

    def text(self, output: ToolOutput, turn_ids: list[int]) -> str:
        """The text appended after a model turn ending in `turn_ids`: the turn's close, the observation, the next
        assistant header."""
        content: list[dict] = [{"type": "image"} for _ in output.images]
        content.append({"type": "text", "text": f"<tool_response>\n{output.text}\n</tool_response>"})
        rendered = self._render([*self._history, {"role": self.role, "content": content}], generation=True)
        if not rendered.startswith(self._before):
            raise ValueError("the chat template renders an earlier turn differently once a later turn follows; "
                             "observations cannot be templated on their own with it")
        closing = self.closing
        last = self.tokenizer.decode(turn_ids[-1:]) if turn_ids else ""
        if last and closing.startswith(last):  # the turn already ends with the template's end-of-turn token
            closing = closing[len(last):]
        return closing + rendered[len(self._before):]

    def encode(self, output: ToolOutput, turn_ids: list[int], merge_size: int) -> tuple[list[int], VisualBatch, list]:
        """(ids, visual tensors of its images as one sample, the images as processed). An image checked and
        converted as a dataset's are (`load_image`): one it refuses is a `MediaError` saying why."""
        from vlrft.data.media import fit_image, load_image

        images = [fit_image(load_image(im, self.media_limits), self.image_bounds) for im in output.images]
        out = self.processor(text=[self.text(output, turn_ids)], images=images or None, return_tensors=None)
        ids = [int(i) for i in out["input_ids"][0]]
        visual = VisualBatch.from_processor_output(crop_rows(self.processor, out, [len(images)]), [len(images)], [0],
                                                   merge_size, int(getattr(self.processor, "image_seq_len", 0) or 0))
        return ids, visual, images


def refusal(exc: Exception) -> str:
    """Why a tool's output could not become an observation, on one line (the model reads it after `Error: `): an
    image refused (`MediaError`: unreadable, too large, an aspect ratio over the limit) says so and why."""
    from vlrft.data.media import MediaError

    text = " ".join(str(exc).split())[:300]
    if isinstance(exc, MediaError):
        return f"image refused: {text}"
    return f"the tool's output could not be processed ({type(exc).__name__}" + (f": {text})" if text else ")")


# A multi-turn engine's rollouts: completions are whole trajectories (model turns + observations), with the multi-turn
# fields of `Rollouts` filled (`sampled_mask`, tool images, turns, tool rewards and counters, transcripts).
Trajectories = Rollouts


@dataclass
class _Row:
    """A trajectory under construction."""

    prompt: int
    id: str = ""  # ToolContext.trajectory_id
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    visual: list[VisualBatch] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)  # the prompt's, then the tools'
    tool_images: list[Any] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # each model turn, decoded without special tokens
    transcript: list[dict] = field(default_factory=list)  # `Rollouts.transcripts`
    turns: int = 0
    reward: float = 0.0
    stats: ToolStats = field(default_factory=ToolStats)
    done: bool = False
    reason: str = FINISH_STOP
    weight_version: int | None = None  # rollout servers: the oldest weight version among the row's turns


class MultiTurnEngine:
    """Wraps a rollout engine: n trajectories per prompt, tools between turns (see the module docstring)."""

    def __init__(self, engine, processor, tokens: "TokenSpec", tools: ToolSet, *, max_turns: int,
                 max_trajectory_tokens: int, image_bounds=None, merge_size: int = 2,
                 parse_call: Callable[[str], ToolCall | MalformedCall | None] = parse_qwen_tool_call,
                 any_rank_going: Callable[[bool], bool] | None = None, max_output_tokens: int = 0, media_limits=None):
        self.engine = engine
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.tokens = tokens
        self.tools = tools
        self.max_turns = max_turns
        self.max_trajectory_tokens = max_trajectory_tokens
        self.merge_size = merge_size
        self.parse_call = parse_call
        self.observations = ObservationTemplate(processor, image_bounds, media_limits=media_limits)
        # Several ranks: whether any rank still has a trajectory going (an all-reduce). Every rank then calls the
        # engine for each turn, on an empty batch when its own trajectories are done: ranks sharing an engine
        # (tensor-parallel vLLM/SGLang groups) run each call together. None: this rank decides alone.
        self.any_rank_going = any_rank_going
        self.rollouts = 0  # rollouts generated by this process: trajectory ids are "<rollout>:<row>"
        self.max_output_tokens = max_output_tokens  # a tool's text past this many tokens is cut; 0: no cap

    @classmethod
    def from_deps(cls, cfg, deps, engine) -> "MultiTurnEngine":
        """Around `engine`; the prompt encoder describes the tools in every prompt (`rollout.describe_tools`)."""
        from vlrft.data.media import MediaLimits
        from vlrft.registry import load_reference

        tools = ToolSet.from_config(cfg.rollout)
        if cfg.rollout.describe_tools:
            install_tool_prompt(deps.encoder, tools.schemas)
        parser = cfg.rollout.tool_parser
        parse_call = parse_qwen_tool_call if parser == "qwen" else load_reference(parser, f"rollout.tool_parser={parser!r}")
        return cls(engine, deps.processor, deps.tokens, tools, max_turns=cfg.rollout.max_turns,
                   max_trajectory_tokens=cfg.rollout.max_trajectory_tokens,
                   image_bounds=deps.encoder.image_bounds(cfg.rollout.tool_image_max_pixels),
                   merge_size=deps.encoder.merge_size, parse_call=parse_call,
                   any_rank_going=_any_rank_going(deps.strategy),
                   max_output_tokens=cfg.rollout.tool_max_output_tokens,
                   media_limits=MediaLimits(cfg.data.max_source_pixels, cfg.data.max_aspect_ratio))

    # engine protocol: weights and memory belong to the wrapped engine
    def update_weights(self, model) -> None:
        self.engine.update_weights(model)

    @property
    def version(self) -> int | None:
        """Rollout servers: the weight version the wrapped engine samples with (what the async producer checks)."""
        return getattr(self.engine, "version", None)

    @property
    def last_sync(self):
        """Rollout servers: the wrapped engine's last weight sync (`time/weight_sync_paused`)."""
        return getattr(self.engine, "last_sync", None)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def state_dict(self) -> dict:
        return engine_state(self.engine)

    def load_state_dict(self, state: dict) -> None:
        load_engine_state(self.engine, state)

    def turn_sampling(self, sampling: SamplingParams) -> SamplingParams:
        """Turns also end right after a closed tool call."""
        stop = sampling.stop if TOOL_CALL_CLOSE in sampling.stop else (*sampling.stop, TOOL_CALL_CLOSE)
        return dataclasses.replace(sampling, stop=stop, max_new_tokens=min(sampling.max_new_tokens,
                                                                           self.max_trajectory_tokens))

    def generate(self, batch: "PromptBatch", sampling: SamplingParams) -> Trajectories:
        # Engines whose weights are made whole per call (the hf engine on a sharded policy: a collective) keep them
        # whole for every turn: ranks whose trajectories end sooner call the engine fewer times.
        holding = getattr(self.engine, "holding_weights", None)
        with holding() if holding is not None else contextlib.nullcontext():
            return self._generate(batch, sampling)

    def _generate(self, batch: "PromptBatch", sampling: SamplingParams) -> Trajectories:
        turn_sampling = self.turn_sampling(sampling)
        self.rollouts += 1
        rows = [_Row(prompt=i // sampling.n, id=f"{self.rollouts}:{i}") for i in range(len(batch) * sampling.n)]
        for row in rows:
            row.images = list(batch.images[row.prompt])
        first = self.engine.generate(batch, turn_sampling)
        self._take_turn(rows, list(range(len(rows))), first)
        for _ in range(self.max_turns - 1):
            pending = self._run_tools(rows, batch)
            going = bool(pending) if self.any_rank_going is None else self.any_rank_going(bool(pending))
            if not going:
                break
            later = dataclasses.replace(turn_sampling, n=1)
            if not pending:  # another rank's trajectories go on: call the engine with it, on nothing
                self.engine.generate(batch.select([]), later)
                continue
            budget = max(self.max_trajectory_tokens - len(rows[r].ids) for r in pending)
            context = self._context_batch(batch, rows, pending)
            out = self.engine.generate(context, dataclasses.replace(later, max_new_tokens=min(later.max_new_tokens,
                                                                                              budget)))
            self._take_turn(rows, pending, out)
        self._close_pending(rows)
        return self._finish(rows, sampling.n)

    def _take_turn(self, rows: list[_Row], which: list[int], out: Rollouts) -> None:
        """Append each row's sampled turn (cut to its token budget)."""
        for k, r in enumerate(which):
            row = rows[r]
            ids = list(out.completion_ids[k])
            reason = out.finish_reasons[k]
            room = self.max_trajectory_tokens - len(row.ids)
            if len(ids) >= room:
                ids, reason = ids[:room], (FINISH_LENGTH if len(ids) > room or reason == FINISH_LENGTH else reason)
            lps = list(out.logprobs[k][:len(ids)]) if out.logprobs is not None else [0.0] * len(ids)
            row.ids += ids
            row.mask += [1] * len(ids)
            row.logprobs += lps
            row.turns += 1
            if out.weight_versions is not None:
                version = out.weight_versions[k]
                row.weight_version = version if row.weight_version is None else min(row.weight_version, version)
            row.texts.append(self.tokenizer.decode(ids, skip_special_tokens=True))  # what the call parser reads
            row.transcript.append({"role": "assistant", "text": row.texts[-1], "finish": reason})
            if reason == FINISH_LENGTH:  # a cut turn is never run, even when it holds a call: count those
                row.done, row.reason = True, FINISH_LENGTH
                self._count_unrun(row, self._parse(row), "cut_calls", "cut")

    def _close_pending(self, rows: list[_Row]) -> None:
        """After the last turn allowed: a live row's last turn is not parsed yet. Its call, if any, goes unanswered."""
        for row in rows:
            if row.done:
                continue
            row.done = True
            call = self._parse(row)
            if self._count_unrun(row, call, "unanswered_calls", "unanswered"):
                row.reason = FINISH_MAX_TURNS

    @staticmethod
    def _count_unrun(row: _Row, call: ToolCall | MalformedCall | None, counter: str, status: str) -> bool:
        """Count a call that will not run (the parser's own failures as such); whether the turn held a call."""
        if isinstance(call, MalformedCall) and call.kind == "parser_errors":
            row.stats.parser_errors += 1
            return False
        if call is None:
            return False
        setattr(row.stats, counter, getattr(row.stats, counter) + 1)
        row.transcript.append(_tool_step(call, status, ToolOutput(), 0, shown=False))
        return True

    def _run_tools(self, rows: list[_Row], batch: "PromptBatch") -> list[int]:
        """Run the calls of every live row's last turn at once; returns the rows that go on to another turn."""
        calls, contexts, which = [], [], []
        for r, row in enumerate(rows):
            if row.done:
                continue
            call = self._parse(row)
            if call is None:
                row.done = True
                continue
            calls.append(call)
            contexts.append(ToolContext(images=list(row.images), sample=batch.samples[row.prompt], turn=row.turns,
                                        trajectory_id=row.id))
            which.append(r)
        if not calls:
            return []
        outputs, kinds = self.tools.run(calls, contexts)
        going = []
        for r, call, output, kind in zip(which, calls, outputs, kinds):
            row = rows[r]
            if output.reward is not None:
                row.reward += float(output.reward)
            if output.done:
                row.stats.count(kind, output)
                row.transcript.append(_tool_step(call, kind, output, 0, shown=False))
                row.done = True
                continue
            output, cut = self._cut_text(output)
            try:
                ids, visual, images = self.observations.encode(output, row.ids, self.merge_size)
            except Exception as exc:  # an image the processor refuses: the model reads why
                kind, cut = "bad_outputs", False
                why = refusal(exc)
                self.tools.report(("processor", type(exc).__name__), f"the processor refused a tool's output "
                                  f"({why}); the model reads an Error: observation", "tools/bad_outputs")
                output = ToolOutput(text=f"{ERROR_PREFIX}{why}")
                ids, visual, images = self.observations.encode(output, row.ids, self.merge_size)
            row.stats.count(kind, output)
            row.stats.truncated_outputs += cut
            if len(row.ids) + len(ids) >= self.max_trajectory_tokens:  # no room for the observation and a reply
                row.transcript.append(_tool_step(call, kind, output, 0, shown=False))
                row.done, row.reason = True, FINISH_LENGTH
                continue
            row.transcript.append(_tool_step(call, kind, output, len(images), shown=True))
            row.stats.images_returned += len(images)  # only images the processor accepted and the model sees
            row.ids += ids
            row.mask += [0] * len(ids)
            row.logprobs += [0.0] * len(ids)
            if images:
                row.visual.append(visual)
                row.images += images
                row.tool_images += images
            going.append(r)
        return going

    def _cut_text(self, output: ToolOutput) -> tuple[ToolOutput, bool]:
        """The output with its text cut to `max_output_tokens` tokens and a note of how many more there were."""
        if not self.max_output_tokens or not output.text:
            return output, False
        ids = self.tokenizer.encode(output.text, add_special_tokens=False)
        if len(ids) <= self.max_output_tokens:
            return output, False
        text = self.tokenizer.decode(ids[:self.max_output_tokens], skip_special_tokens=True)
        note = f"\n... ({len(ids) - self.max_output_tokens} more tokens cut)"
        return dataclasses.replace(output, text=text + note), True

    def _parse(self, row: _Row) -> ToolCall | MalformedCall | None:
        """The call in the row's last turn (`rollout.tool_parser`). A parser that raises or returns something else is
        counted in `tools/parser_errors` and logged once per cause; the model reads an Error: observation."""
        text = row.texts[-1]
        try:
            call = self.parse_call(text)
        except Exception as exc:  # user code: the run goes on
            problem, cause = f"raised {type(exc).__name__}: {' '.join(str(exc).split())[:200]}", type(exc).__name__
        else:
            if call is None or isinstance(call, MalformedCall) or (
                    isinstance(call, ToolCall) and isinstance(call.name, str) and isinstance(call.arguments, dict)):
                return call
            if isinstance(call, ToolCall):
                problem, cause = (f"returned ToolCall(name={call.name!r}, arguments={call.arguments!r}); the name must "
                                  "be a str and the arguments a dict", "ToolCall")
            else:
                problem, cause = (f"returned a {type(call).__name__}, not a vlrft.tools.ToolCall, MalformedCall or "
                                  "None", type(call).__name__)
        name = getattr(self.parse_call, "__qualname__", repr(self.parse_call))
        self.tools.report(("parser_errors", cause), f"rollout.tool_parser ({name}) {problem} on the turn {text[:80]!r}; "
                          "the model reads an Error: observation", "tools/parser_errors")
        return MalformedCall(f"the tool call could not be read (the parser {problem})", kind="parser_errors")

    def _context_batch(self, batch: "PromptBatch", rows: list[_Row], which: list[int]) -> "PromptBatch":
        """The live trajectories as prompts: prompt + everything so far, with all their images in order."""
        from vlrft.data import PromptBatch

        prompts = [rows[r].prompt for r in which]
        base = batch.select(prompts)
        visual = [self._row_visual(batch, rows[r]) for r in which]
        return PromptBatch(samples=base.samples,
                           prompt_ids=[batch.prompt_ids[rows[r].prompt] + rows[r].ids for r in which],
                           prompt_texts=base.prompt_texts, images=[rows[r].images for r in which],
                           videos=base.videos, visual=VisualBatch.concat(visual))

    def _row_visual(self, batch: "PromptBatch", row: _Row) -> VisualBatch:
        own = batch.visual.select([row.prompt])
        return join_samples([own, *row.visual]) if row.visual else own

    def _finish(self, rows: list[_Row], n: int) -> Trajectories:
        # What rewards read: the model's last turn (its final answer); the whole trajectory is in completion_ids.
        texts = [row.texts[-1] if row.texts else "" for row in rows]
        return Trajectories(
            n=n, completion_ids=[row.ids for row in rows], finish_reasons=[row.reason for row in rows],
            logprobs=[row.logprobs for row in rows], texts=texts, sampled_mask=[row.mask for row in rows],
            observation_visual=[join_samples(row.visual) if row.visual else None for row in rows],
            observation_images=[row.tool_images for row in rows],
            turns=[row.turns for row in rows], tool_rewards=[row.reward for row in rows],
            tool_stats=[row.stats for row in rows], transcripts=[row.transcript for row in rows],
            weight_versions=[row.weight_version for row in rows] if all(r.weight_version is not None for r in rows)
            else None)


def _tool_step(call: ToolCall | MalformedCall, status: str, output: ToolOutput, images: int, shown: bool) -> dict:
    """A tool call's entry in a transcript (`Rollouts.transcripts`); JSON-ready for completions.jsonl."""
    import json

    arguments = call.arguments if isinstance(call, ToolCall) else None
    try:
        json.dumps(arguments)
    except (TypeError, ValueError):  # a parser's ToolCall with values JSON cannot hold: shown as text
        arguments = repr(arguments)
    return {"role": "tool", "call": {"name": call.name, "arguments": arguments} if isinstance(call, ToolCall)
            else None, "status": status, "text": output.text, "images": images, "reward": output.reward,
            "shown": shown}


def _any_rank_going(strategy) -> Callable[[bool], bool] | None:
    """With several ranks: whether any rank's trajectories go on (a max all-reduce); None for one process."""
    if strategy is None or strategy.world_size <= 1:
        return None

    def any_rank_going(going: bool) -> bool:
        return strategy.all_reduce(torch.tensor([float(going)]), "max").item() > 0

    return any_rank_going


def install_tool_prompt(encoder, schemas: list[dict]) -> None:
    """Describe the tools in every prompt: through the chat template's `tools` when it renders them, else as a
    Qwen-style system text."""
    import json

    probe = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    render = encoder.processor.apply_chat_template
    with_tools = render(probe, tokenize=False, add_generation_prompt=True, tools=schemas)
    if with_tools != render(probe, tokenize=False, add_generation_prompt=True):
        encoder.tools = schemas
    else:
        encoder.tool_prompt = TOOL_PROMPT.format(tools="\n".join(json.dumps(s) for s in schemas))
