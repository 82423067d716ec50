"""A synthetic task that needs zooming: a small coloured mark in a large white image.

The prompt's image (392 px, white with faint colour blotches) is downscaled to the demo's prompt budget
(56 px), where the 32 px mark shrinks to a 4-5 px speck among the blotches; the built-in `zoom` tool cuts
the centre cell of the 3 x 3 grid from the original and shows it at the tool-image budget (112 px,
`rollout.tool_image_max_pixels`), where the mark is a 27 px square. The mark is always in the centre
cell (jittered), so "zoom into the centre" is the one useful call. Answers are balanced across colours
and every prompt has the same text: without reading the mark the best is chance. Measured with the
demo's tiny model, supervised on 400 x 16 examples: 0.96 held-out accuracy after zooming, 0.25 from the
prompt's image (docs/multiturn.md). Seeded: the same arguments write the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from examples.shapes import COLORS, _balanced

MARK_COLORS = ("red", "green", "blue", "yellow")
QUESTION = "What color is the small mark? Answer with one word."


def render_mark(color: str | None, rng: np.random.Generator, size: int = 392, mark: int = 32) -> Image.Image:
    """A `size` px image with a `mark` px square of `color` in the centre cell (None: no mark).

    The background is white with faint smooth colour blotches, so a colour cast alone does not give the
    answer away at the prompt's resolution; after zooming the mark stands far above them.
    """
    blotches = rng.uniform(0, 24, size=(6, 6, 3)).astype(np.float32)
    field = np.stack([np.asarray(Image.fromarray(blotches[:, :, c]).resize((size, size), Image.Resampling.BICUBIC))
                      for c in range(3)], axis=2)
    image = Image.fromarray(np.clip(255 - field, 0, 255).astype(np.uint8), "RGB")
    if color is not None:
        cell = size / 3
        x, y = (cell + rng.uniform(cell * 0.2, cell * 0.8 - mark) for _ in range(2))
        image.paste(COLORS[color], (int(x), int(y), int(x) + mark, int(y) + mark))
    return image


def make_zoom_marks(out_dir: str | Path, split: str, count: int, seed: int = 0, blank: bool = False,
                    closeup: bool = False) -> Path:
    """Write `count` samples (images under images/<split>/) and return the JSONL path. `blank`: no mark;
    `closeup`: the image is the centre cell only (what the zoom tool returns), for a colour-naming warm start."""
    out = Path(out_dir)
    (out / "images" / split).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, {"train": 0, "test": 1}.get(split, 2)])
    rows = []
    for i, answer in enumerate(_balanced(rng, list(MARK_COLORS), count)):
        name = f"images/{split}/{i:06d}.png"
        image = render_mark(None if blank else answer, rng)
        if closeup:
            cell = image.size[0] / 3
            image = image.crop((round(cell), round(cell), round(2 * cell), round(2 * cell)))
        image.save(out / name, format="PNG")
        rows.append({"id": f"marks-{split}-{i:06d}", "prompt": "<image>" + QUESTION, "images": [name],
                     "answer": answer, "label": "color", "choices": list(MARK_COLORS)})
    path = out / f"{split}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path
