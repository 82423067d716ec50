"""A synthetic visual task whose answers need the image: coloured shapes on a plain background.

`make_shapes(out_dir, ShapesSpec(...))` (or `python datasets/make_shapes.py OUT [--tasks color,count ...]`) writes
PNG files and native-layout JSONL splits
(`train.jsonl`, `test.jsonl`). Task types (the sample's `label`):

- color: "What color is the shape?" -> one of the spec's colours (one shape)
- shape: "Which shape is in the image?" -> one of the spec's shape kinds (one shape)
- count: "How many shapes are there?" -> "1" .. str(max_count)
- position: "Where is the shape?" -> left / right / top / bottom / center

Within a task every prompt has the same text and the answers are balanced (each class equally
often, in a seeded shuffled order), so text alone scores exactly chance (`chance_accuracy`).
`blank_images=True` writes the same questions and answers over empty images, to verify that a
trained model falls back to chance without the picture. Everything is seeded: the same spec
writes byte-identical files.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from vlrft.errors import UserError

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 70, 220), "yellow": (230, 200, 20),
    "purple": (140, 50, 170), "orange": (245, 130, 20), "black": (20, 20, 20), "gray": (128, 128, 128),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "diamond")
POSITIONS: dict[str, tuple[float, float]] = {  # region centre as a fraction of (width, height)
    "left": (0.2, 0.5), "right": (0.8, 0.5), "top": (0.5, 0.2), "bottom": (0.5, 0.8), "center": (0.5, 0.5),
}
TASKS: tuple[str, ...] = ("color", "shape", "count", "position")
QUESTIONS: dict[str, str] = {
    "color": "What color is the shape? Answer with one word.",
    "shape": "Which shape is in the image? Answer with one word.",
    "count": "How many shapes are there? Answer with a number.",
    "position": "Where is the shape? Answer with one word.",
}
BACKGROUND = (255, 255, 255)


@dataclass(frozen=True)
class ShapesSpec:
    """Parameters of the shapes task; the defaults are the CPU demo's small configuration."""

    tasks: tuple[str, ...] = ("color",)
    num_colors: int = 4  # the first N of COLORS
    num_shapes: int = 3  # the first N of SHAPES
    max_count: int = 4  # count task: 1..max_count shapes (at most 9)
    image_size: int = 56
    train_size: int = 256
    test_size: int = 64
    seed: int = 0
    blank_images: bool = False

    def validate(self) -> "ShapesSpec":
        unknown = [t for t in self.tasks if t not in TASKS]
        if not self.tasks or unknown:
            raise UserError(f"shapes: tasks {list(self.tasks)} must be a non-empty subset of {list(TASKS)}")
        if not 2 <= self.num_colors <= len(COLORS):
            raise UserError(f"shapes: num_colors={self.num_colors} must be in [2, {len(COLORS)}]")
        if not 2 <= self.num_shapes <= len(SHAPES):
            raise UserError(f"shapes: num_shapes={self.num_shapes} must be in [2, {len(SHAPES)}]")
        if not 2 <= self.max_count <= 9:
            raise UserError(f"shapes: max_count={self.max_count} must be in [2, 9]")
        if self.image_size < 28:
            raise UserError(f"shapes: image_size={self.image_size} must be at least 28 pixels")
        if self.train_size < 0 or self.test_size < 0:
            raise UserError("shapes: train_size and test_size must be >= 0")
        return self

    @property
    def colors(self) -> list[str]:
        return list(COLORS)[: self.num_colors]

    @property
    def shapes(self) -> list[str]:
        return list(SHAPES[: self.num_shapes])

    def answers(self, task: str) -> list[str]:
        """Every possible answer of `task`, in a fixed order."""
        return {"color": self.colors, "shape": self.shapes, "position": list(POSITIONS),
                "count": [str(k) for k in range(1, self.max_count + 1)]}[task]


def chance_accuracy(spec: ShapesSpec, task: str) -> float:
    """Accuracy of a guess that ignores the image (answers are balanced): 1 / number of answers."""
    return 1.0 / len(spec.answers(task))


def _polygon(kind: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if kind == "square":
        s = r * 0.85
        return [(cx - s, cy - s), (cx + s, cy - s), (cx + s, cy + s), (cx - s, cy + s)]
    if kind == "diamond":
        return [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)]
    if kind == "triangle":
        return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)]
    if kind == "star":
        points = []
        for i in range(10):
            radius = r if i % 2 == 0 else r * 0.45
            angle = -math.pi / 2 + i * math.pi / 5
            points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
        return points
    raise ValueError(f"unknown shape {kind}")


def draw_shape(draw: ImageDraw.ImageDraw, kind: str, color: str, cx: float, cy: float, r: float) -> None:
    """Draw one filled shape of radius `r` centred on (cx, cy)."""
    fill = COLORS[color]
    if kind == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        draw.polygon(_polygon(kind, cx, cy, r), fill=fill)


def _balanced(rng: np.random.Generator, classes: list[str], n: int) -> list[str]:
    """`n` answers with every class equally often (+-1), in a shuffled order."""
    labels = [classes[i % len(classes)] for i in range(n)]
    return [labels[i] for i in rng.permutation(n)]


def render(spec: ShapesSpec, task: str, answer: str, rng: np.random.Generator) -> Image.Image:
    """One image whose correct answer to `task` is `answer`."""
    size = spec.image_size
    image = Image.new("RGB", (size, size), BACKGROUND)
    if spec.blank_images:
        return image
    draw = ImageDraw.Draw(image)
    color = lambda: spec.colors[rng.integers(spec.num_colors)]  # noqa: E731
    kind = lambda: spec.shapes[rng.integers(spec.num_shapes)]  # noqa: E731
    if task in ("color", "shape"):
        r = size * rng.uniform(0.18, 0.3)
        cx, cy = rng.uniform(r + 1, size - r - 1, size=2)
        draw_shape(draw, kind() if task == "color" else answer, answer if task == "color" else color(), cx, cy, r)
    elif task == "position":
        fx, fy = POSITIONS[answer]
        r = size * rng.uniform(0.1, 0.14)
        jitter = size * 0.04
        cx, cy = fx * size + rng.uniform(-jitter, jitter), fy * size + rng.uniform(-jitter, jitter)
        draw_shape(draw, kind(), color(), cx, cy, r)
    else:  # count: shapes in distinct cells of a 3x3 grid, so they never touch
        cell = size / 3
        for c in rng.choice(9, size=int(answer), replace=False):
            r = cell * rng.uniform(0.28, 0.38)
            jitter = cell / 2 - r - 1
            cx = (c % 3 + 0.5) * cell + rng.uniform(-jitter, jitter)
            cy = (c // 3 + 0.5) * cell + rng.uniform(-jitter, jitter)
            draw_shape(draw, kind(), color(), cx, cy, r)
    return image


def make_split(out_dir: str | Path, spec: ShapesSpec, split: str, size: int) -> Path:
    """Write `size` samples of `split` (images under images/<split>/) and return the JSONL path."""
    out = Path(out_dir)
    image_dir = out / "images" / split
    image_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([spec.seed, {"train": 0, "test": 1}.get(split, 2)])
    tasks = [spec.tasks[i % len(spec.tasks)] for i in range(size)]
    answers: dict[str, list[str]] = {t: _balanced(rng, spec.answers(t), tasks.count(t)) for t in spec.tasks}
    rows = []
    for i, task in enumerate(tasks):
        answer = answers[task].pop()
        name = f"images/{split}/{i:06d}.png"
        render(spec, task, answer, rng).save(out / name, format="PNG")
        rows.append({"id": f"shapes-{split}-{i:06d}", "prompt": "<image>" + QUESTIONS[task], "images": [name],
                     "answer": answer, "label": task, "choices": spec.answers(task)})
    path = out / f"{split}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def make_shapes(out_dir: str | Path, spec: ShapesSpec = ShapesSpec()) -> dict[str, Path]:
    """Write the train and test splits of the shapes task; returns {"train": path, "test": path}."""
    spec.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {split: make_split(out, spec, split, n) for split, n in (("train", spec.train_size),
                                                                      ("test", spec.test_size))}
    (out / "spec.json").write_text(json.dumps(asdict(spec), indent=2) + "\n", encoding="utf-8")
    return paths


def embed_as_parquet(jsonl: str | Path, parquet: str | Path) -> Path:
    """Rewrite a native JSONL split as one parquet file with its images embedded as {"bytes", "path"}.

    One self-contained file is easy to ship (the CPU demo's data lives in the repository this way).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = Path(jsonl)
    rows = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    for row in rows:
        row["images"] = [{"bytes": (source.parent / name).read_bytes(), "path": Path(name).name}
                         for name in row.get("images", [])]
    target = Path(parquet)
    target.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), target, compression="zstd")
    return target


def main(argv: list[str] | None = None) -> int:
    """`python datasets/make_shapes.py OUT [options]`: write the shapes task (PNG files + train/test JSONL)."""
    import argparse
    import shutil
    import tempfile

    parser = argparse.ArgumentParser(prog="make_shapes.py", description=main.__doc__)
    parser.add_argument("out_dir", metavar="OUT")
    parser.add_argument("--tasks", help="comma-separated subset of color,shape,count,position (default: color)")
    for name in ("num_colors", "num_shapes", "max_count", "image_size", "train_size", "test_size", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int)
    parser.add_argument("--blank-images", action="store_true", help="same questions and answers over empty images")
    parser.add_argument("--parquet", action="store_true",
                        help="write train.parquet/test.parquet with the images embedded instead of JSONL + PNG files")
    args = parser.parse_args(argv)
    fields = {name: getattr(args, name) for name in ("num_colors", "num_shapes", "max_count", "image_size",
                                                     "train_size", "test_size", "seed")}
    fields = {k: v for k, v in fields.items() if v is not None}
    if args.tasks:
        fields["tasks"] = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    spec = ShapesSpec(**fields, blank_images=args.blank_images)
    if args.parquet:
        with tempfile.TemporaryDirectory() as tmp:
            made = make_shapes(tmp, spec)
            paths = {split: embed_as_parquet(made[split], Path(args.out_dir) / f"{split}.parquet") for split in made}
            shutil.copy(Path(tmp) / "spec.json", Path(args.out_dir) / "spec.json")
    else:
        paths = make_shapes(args.out_dir, spec)
    print(f"wrote {spec.train_size} train and {spec.test_size} test samples ({', '.join(spec.tasks)}) to "
          f"{paths['train']} and {paths['test']}")
    return 0
