"""The shapes task: deterministic files, balanced answers (text alone = chance), answers visible in the image."""

import json
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from examples.shapes import COLORS, POSITIONS, ShapesSpec, chance_accuracy, make_shapes
from vlrft.errors import UserError

SPEC = ShapesSpec(tasks=("color", "shape", "count", "position"), num_colors=4, num_shapes=3, max_count=4,
                  image_size=56, train_size=48, test_size=16, seed=5)


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def foreground(path) -> np.ndarray:
    """Boolean mask of non-white pixels."""
    return (np.asarray(Image.open(path).convert("RGB")) != 255).any(-1)


def components(mask: np.ndarray) -> int:
    """Number of 4-connected foreground blobs (a small flood fill, fine for 56x56)."""
    seen = np.zeros_like(mask)
    count = 0
    for y, x in zip(*np.nonzero(mask)):
        if seen[y, x]:
            continue
        count += 1
        stack = [(y, x)]
        seen[y, x] = True
        while stack:
            cy, cx = stack.pop()
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return count


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes")
    return out, make_shapes(out, SPEC)


def test_same_spec_writes_identical_files(shapes, tmp_path):
    out, paths = shapes
    again = make_shapes(tmp_path, SPEC)
    assert again["train"].read_bytes() == paths["train"].read_bytes()
    first = rows(paths["train"])[0]["images"][0]
    assert (tmp_path / first).read_bytes() == (out / first).read_bytes()


def test_answers_are_balanced_and_prompts_identical_within_a_task(shapes):
    _, paths = shapes
    train = rows(paths["train"])
    assert len(train) == 48 and len(rows(paths["test"])) == 16
    for task in SPEC.tasks:
        task_rows = [r for r in train if r["label"] == task]
        assert len(task_rows) == 12
        assert len({r["prompt"] for r in task_rows}) == 1  # text alone cannot tell the answers apart
        counts = Counter(r["answer"] for r in task_rows)
        assert set(counts) <= set(SPEC.answers(task))
        assert max(counts.values()) - min(counts.values()) <= 1  # 12 over 3, 4 or 5 classes: as even as possible
    assert chance_accuracy(SPEC, "color") == 1 / 4 and chance_accuracy(SPEC, "position") == 1 / 5


def test_the_image_holds_the_answer(shapes):
    out, paths = shapes
    for row in rows(paths["train"]):
        image_path = out / row["images"][0]
        mask = foreground(image_path)
        if row["label"] == "color":
            pixels = np.asarray(Image.open(image_path).convert("RGB"))[mask]
            assert {tuple(p) for p in pixels} == {COLORS[row["answer"]]}
        elif row["label"] == "count":
            assert components(mask) == int(row["answer"])
        elif row["label"] == "position":
            ys, xs = np.nonzero(mask)
            fx, fy = POSITIONS[row["answer"]]
            assert abs(xs.mean() / 56 - fx) < 0.12 and abs(ys.mean() / 56 - fy) < 0.12
        else:  # shape: one blob whose fill of its bounding box is pi/4 (circle), 1 (square) or 1/2 (triangle)
            assert components(mask) == 1
            ys, xs = np.nonzero(mask)
            fill = mask.sum() / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
            assert abs(fill - {"circle": np.pi / 4, "square": 1.0, "triangle": 0.5}[row["answer"]]) < 0.1


def test_blank_images_keep_questions_and_answers(tmp_path):
    spec = ShapesSpec(train_size=8, test_size=0, blank_images=True)
    paths = make_shapes(tmp_path, spec)
    normal = make_shapes(tmp_path / "normal", ShapesSpec(train_size=8, test_size=0))
    blank_rows, normal_rows = rows(paths["train"]), rows(normal["train"])
    assert [(r["prompt"], r["answer"]) for r in blank_rows] == [(r["prompt"], r["answer"]) for r in normal_rows]
    assert not any(foreground(tmp_path / r["images"][0]).any() for r in blank_rows)


def test_invalid_spec():
    with pytest.raises(UserError, match=r"tasks \['size'\] must be a non-empty subset"):
        make_shapes("/nonexistent", ShapesSpec(tasks=("size",)))


def test_the_make_shapes_script_writes_the_task_as_jsonl_or_parquet(tmp_path):
    """`python datasets/make_shapes.py OUT ...` from any working directory (it finds examples/ itself)."""
    import subprocess
    import sys
    from pathlib import Path

    from vlrft.data import read_samples

    script = Path(__file__).resolve().parents[1] / "datasets" / "make_shapes.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "jsonl"), "--tasks", "color,count",
                           "--train-size", "4", "--test-size", "2", "--image-size", "56"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "wrote 4 train and 2 test samples (color, count)" in done.stdout
    train = read_samples(tmp_path / "jsonl" / "train.jsonl")
    assert [s.label for s in train] == ["color", "count", "color", "count"]
    assert np.asarray(Image.open(train[0].images[0])).shape == (56, 56, 3)
    # --parquet: the same samples, images embedded (as the shipped datasets/shapes_demo)
    for name, extra in (("plain", []), ("pq", ["--parquet"])):
        done = subprocess.run([sys.executable, str(script), str(tmp_path / name), "--train-size", "4", "--test-size",
                               "2", *extra], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    plain, embedded = read_samples(tmp_path / "plain" / "train.jsonl"), read_samples(tmp_path / "pq" / "train.parquet")
    assert [s.answer for s in embedded] == [s.answer for s in plain] and len(plain) == 4
    from vlrft.data.media import load_image

    for a, b in zip(plain, embedded):
        assert np.array_equal(np.asarray(load_image(a.images[0])), np.asarray(load_image(b.images[0])))
