"""What a step reports: its metrics (reduced over ranks) and its completion table rows (with thumbnails)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from vlrft.algo.stats import Stats
from vlrft.errors import write_failed
from vlrft.logging import CompletionRow
from vlrft.rollout.base import Rollouts
from vlrft.trainer.collect import Collected
from vlrft.trainer.experience import Experience


def step_metrics(collected: Collected, rewards: torch.Tensor, exp: Experience, loss_stats: Stats, skipped: int,
                 sum_reduce: Callable, max_reduce: Callable) -> dict[str, float]:
    """A step's metrics, reduced over ranks (sums and counts, maxima): rewards, lengths, refills, tools, losses."""
    stats = Stats()
    valid = ~torch.isnan(rewards)
    stats.add("reward/mean", torch.where(valid, rewards, torch.zeros(())).sum(), valid.sum())
    stats.add("reward/frac_not_applicable", (~valid).float().sum(), rewards.numel())
    for name, values in collected.per_function.items():
        ok = ~torch.isnan(values)
        stats.add(f"reward/{name}/mean", torch.where(ok, values, torch.zeros(())).sum(), ok.sum())
    lengths = torch.tensor([len(c) for c in collected.rollouts.completion_ids], dtype=torch.float32)
    truncated = torch.tensor(collected.rollouts.truncated, dtype=torch.float32)
    stats.add("completions/mean_length", lengths.sum(), lengths.numel())
    stats.add("completions/clipped_ratio", truncated.sum(), truncated.numel())
    stats.add_max("completions/max_length", lengths)
    stats.add("frac_reward_zero_std", float(collected.zero_std_groups), float(collected.groups_seen))
    stats.add("dynamic_sampling/filled_zero_std", float(collected.filled_zero_std))
    stats.add("data/skipped_prompts", float(collected.skipped_prompts))
    stats.add("rollout/rounds", float(collected.rounds))
    stats.add("optimizer/skipped_steps", float(skipped))
    for name, (total, count) in collected.rollouts.metrics().items():  # multi-turn: tools (none without them)
        stats.add(name, total, count)
    error_keys = [f"reward/{name}/errors" for name in collected.reward_errors]  # failures under on_error=none
    for key, count in zip(error_keys, collected.reward_errors.values()):
        stats.add(key, float(count))
    stats = stats.merge(loss_stats).merge(exp.advantage_stats)
    reduced = stats.reduce(sum_reduce, max_reduce)
    metrics = reduced.means()
    for name in ("data/skipped_prompts", "optimizer/skipped_steps", "dynamic_sampling/filled_zero_std",
                 *error_keys):
        metrics[name] = float(reduced.sums[name])
    # headline names
    for alias, source in (("kl", "actor/kl_ref"), ("entropy", "actor/entropy"), ("clip_ratio/region", "actor/clipfrac")):
        if source in metrics:
            metrics[alias] = metrics[source]
    return metrics


def completion_rows(collected: Collected, exp: Experience, step: int, output_dir: Path,
                    max_rows: int) -> list[CompletionRow]:
    """The first `max_rows` completions of a step as table rows; their images as thumbnails under `output_dir`."""
    rows = []
    image_dir = output_dir / "completions" / f"step_{step}"
    for r in range(min(max_rows, len(collected.rollouts))):
        p = collected.rollouts.prompt_index[r]
        image_ref = None
        if collected.prompts.images[p]:
            image_ref = str((image_dir / f"{r}.png").relative_to(output_dir))
            save_thumbnail(collected.prompts.images[p][0], output_dir / image_ref)
        extra = {"reward": _float_or_none(collected.rewards[r]),
                 "finish_reason": collected.rollouts.finish_reasons[r],
                 "answer": collected.prompts.samples[p].answer}
        versions = getattr(collected.rollouts, "weight_versions", None)
        if versions is not None:  # rollout servers: the weight version that sampled the row
            extra["weight_version"] = versions[r]
        if collected.rollouts.transcripts:  # multi-turn: the whole trajectory, turn by turn
            extra.update(trajectory_record(collected.rollouts, r, image_dir, output_dir))
        rows.append(CompletionRow(
            prompt=_readable_prompt(collected.prompts.prompt_texts[p]),
            completion=collected.rollouts.texts[r],
            rewards={name: _float_or_none(v[r]) for name, v in collected.per_function.items()},
            advantage=exp.row_advantage(r),
            image=image_ref,
            extra=extra))
    return rows


def save_thumbnail(image, path: Path) -> None:
    """A 128-pixel copy of `image` at `path`; a failed write (a full disk) is one line naming the file."""
    thumb = image.copy()
    thumb.thumbnail((128, 128))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        thumb.save(path)
    except OSError as exc:
        raise write_failed(path, exc) from exc


def trajectory_record(rollouts: Rollouts, r: int, image_dir: Path, output_dir: Path) -> dict:
    """Row `r`'s turns, tool calls and observations; the tool images the model saw as thumbnails next to the
    table (each tool step's `image_files`)."""
    images = iter(rollouts.observation_images[r])
    steps = []
    for step in rollouts.transcripts[r]:
        step = dict(step)
        if step["role"] == "tool" and step.get("shown") and step.get("images"):
            step["image_files"] = []
            for _ in range(step["images"]):
                path = image_dir / f"{r}_tool{len(steps)}_{len(step['image_files'])}.png"
                save_thumbnail(next(images), path)
                step["image_files"].append(str(path.relative_to(output_dir)))
        steps.append(step)
    return {"turns": rollouts.turns[r], "tool_images": len(rollouts.observation_images[r]), "trajectory": steps}


def _readable_prompt(text: str) -> str:
    """The templated prompt with each run of vision pad tokens shown once."""
    import re

    return re.sub(r"(<\|(?:image|video)_pad\|>)+", lambda m: m.group(1), text)


def _float_or_none(value) -> float | None:
    value = float(value)
    return None if value != value else value
