"""`vlrft data prepare TASK --source RAW --out DIR`: public visual-RL datasets from their raw release files.

One module per task reads the dataset as its own release lays it out (nothing is downloaded) and
yields rows; `vlrft.data.prepare.common` validates and writes them in the native layout. Each
task's module docstring lists the raw files it expects; `templates.yaml` holds the prompt formats.

    summary = prepare("clevr", "raw/CLEVR_v1.0", "data/clevr")   # data/clevr/train.jsonl, val.jsonl, summary.json
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from vlrft.data.prepare.common import Item, Options, Skipped, Summary, load_templates, measure_prompts, \
    prepare_items, write_summary
from vlrft.errors import UserError

# task -> module (imported only when used)
TASKS: dict[str, str] = {
    "geometry3k": "vlrft.data.prepare.geometry3k",
    "mathvista": "vlrft.data.prepare.mathvista",
    "clevr": "vlrft.data.prepare.clevr",
    "refcoco": "vlrft.data.prepare.refcoco",
    "chartqa": "vlrft.data.prepare.chartqa",
    "videoqa": "vlrft.data.prepare.videoqa",
}


def task_module(task: str):
    if task not in TASKS:
        raise UserError(f"unknown task {task!r}; use one of {', '.join(TASKS)}")
    return importlib.import_module(TASKS[task])


def prepare(task: str, source: str | Path, out: str | Path, embed_images: bool = False,
            options: Options | None = None, templates: str | Path | None = None,
            processor: Any = None, model: str | None = None, data: Any = None) -> Summary:
    """Prepare `task` from the raw release in `source` into `out` and write `out/summary.json`.

    With a `processor` (loaded from `model`), the summary has prompt lengths in tokens per split,
    measured with the settings of `data` (a training config's `DataConfig`) when given.
    """
    module = task_module(task)
    source = Path(source).expanduser()
    if not source.is_dir():
        raise UserError(f"--source '{source}' is not a folder; point it at the unpacked {task} release")
    entry = load_templates(task, templates)
    options = options or Options()
    if not 0 <= options.val_fraction < 1:
        raise UserError(f"--val-fraction {options.val_fraction}: give a share between 0 and 1, e.g. 0.05")
    if options.media_dir is None:
        options.media_dir = Path(out) / "media"
    summary = prepare_items(task, module.items(source, options), Path(out), entry,
                            embed_images=embed_images, source=str(source), val_fraction=options.val_fraction)
    if hasattr(module, "summary_prompt_suffix"):  # a task whose rows may carry their own suffix (clevr)
        summary.prompt_suffix = module.summary_prompt_suffix(options, summary.prompt_suffix)
    if not summary.rows:
        raise UserError(f"no usable rows found in '{source}' for {task}: {summary.skipped or 'nothing matched'}; "
                        f"expected the {task} layout described by `vlrft data prepare --help` (docs/prepare.md)")
    if processor is not None:
        measure_prompts(summary, processor, model or "", data)
    write_summary(summary)
    return summary


__all__ = ["Item", "Options", "Skipped", "Summary", "TASKS", "prepare", "task_module"]
