"""Tiny raw releases of the public datasets, written in each release's own layout, traps included.

Every builder writes a handful of rows and small PNG/MP4 files under `root` and returns the folder to
pass as `--source`. Each includes the traps `vlrft data prepare` must handle: a missing image, a
duplicate question id, and task-specific ones (boxes in the other convention, images whose size
differs from the annotation's, unanswered test rows, answers that are not among the choices).
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from _data_helpers import noise_image, write_mp4, write_png


def _json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")


def geometry3k(root: Path) -> Path:
    """Inter-GPS layout: <split>/<id>/data.json + img_diagram.png. Expect train 2, test 1 rows;
    skipped: missing image 1, duplicate id 1, answer not among the choices 1."""
    src = root / "geometry3k"
    problems = [  # (split, folder, id, answer letter, write the image?)
        ("train", "0", 0, "B", True), ("train", "1", 1, "D", True),
        ("train", "2", 2, "A", False),  # missing img_diagram.png
        ("train", "3", 0, "C", True),   # data.json repeats id 0
        ("test", "2401", 2401, "C", True), ("test", "2402", 2402, "F", True),  # F: only 4 choices
    ]
    for k, (split, folder, pid, letter, image) in enumerate(problems):
        _json(src / split / folder / "data.json", {
            "id": pid, "problem_text": f"Find x. Problem {pid}.", "choices": ["3", "4", "2\\sqrt{3}", "6"],
            "answer": letter, "diagram_logic_form": [], "problem_type_goal": ["Length"]})
        if image:
            write_png(src / split / folder / "img_diagram.png", noise_image(24 + 4 * k, 32, seed=k))
    return src


def clevr(root: Path) -> Path:
    """CLEVR layout: questions/CLEVR_<split>_questions.json + images/<split>/. Expect train 2, val 1 rows
    (counting only); skipped: not a counting question 1, duplicate id 1, missing image 1, no answer 1."""
    src = root / "CLEVR_v1.0"
    for split, n in (("train", 3), ("val", 1), ("test", 1)):
        for i in range(n):
            write_png(src / "images" / split / f"CLEVR_{split}_{i:06d}.png", noise_image(30, 40, seed=i))
    train = [
        {"question_index": 0, "image_index": 0, "image_filename": "CLEVR_train_000000.png", "split": "train",
         "question": "How many cubes are there?", "answer": "3"},
        {"question_index": 1, "image_index": 1, "image_filename": "CLEVR_train_000001.png", "split": "train",
         "question": "Is there a red sphere?", "answer": "yes"},
        {"question_index": 2, "image_index": 2, "image_filename": "CLEVR_train_000002.png", "split": "train",
         "question": "How many spheres are there?", "answer": "2"},
        {"question_index": 2, "image_index": 1, "image_filename": "CLEVR_train_000001.png", "split": "train",
         "question": "How many cylinders?", "answer": "1"},  # duplicate question_index
        {"question_index": 4, "image_index": 9, "image_filename": "CLEVR_train_000009.png", "split": "train",
         "question": "How many things?", "answer": "5"},  # missing image
    ]
    _json(src / "questions" / "CLEVR_train_questions.json", {"info": {"split": "train"}, "questions": train})
    _json(src / "questions" / "CLEVR_val_questions.json", {"info": {"split": "val"}, "questions": [
        {"question_index": 0, "image_index": 0, "image_filename": "CLEVR_val_000000.png", "split": "val",
         "question": "How many balls are there?", "answer": "4"}]})
    _json(src / "questions" / "CLEVR_test_questions.json", {"info": {"split": "test"}, "questions": [
        {"question_index": 0, "image_index": 0, "image_filename": "CLEVR_test_000000.png", "split": "test",
         "question": "How many balls are there?"}]})  # test questions carry no answer
    return src


def mathvista(root: Path) -> Path:
    """MathVista GitHub layout: data/testmini.json (pid -> row) + data/images/, and beside them the clone's
    data/query.json and data/source.json (pid -> text, not rows). Expect testmini 2 rows
    (1 multiple_choice answered 'B', 1 free_form '5'); skipped: answer not among the choices 1,
    missing image 1, duplicate id 1; test: no answer 1."""
    src = root / "MathVista"
    for i in (1, 2, 5):
        write_png(src / "data" / "images" / f"{i}.png", noise_image(20, 20 + 4 * i, seed=i))

    def row(pid, **kw):
        base = {"pid": pid, "question": f"Question {pid}?", "image": f"images/{pid}.png", "choices": None,
                "unit": None, "precision": None, "answer": "", "question_type": "free_form",
                "answer_type": "integer", "metadata": {"split": "testmini"}}
        return {**base, **kw}

    testmini = {
        "1": row("1", choices=["120°", "145°", "160°"], answer="145°", question_type="multi_choice",
                 answer_type="text"),
        "2": row("2", answer="5"),
        "3": row("3", image="images/2.png", choices=["a", "b"], answer="c", question_type="multi_choice"),
        "4": row("4", image="images/404.png", answer="7"),  # missing image
        "5": row("2", image="images/5.png", answer="9"),  # pid repeated
    }
    _json(src / "data" / "testmini.json", testmini)
    _json(src / "data" / "test.json", {"6": row("6", image="images/5.png")})  # unanswered test split
    _json(src / "data" / "query.json", {pid: f"Hint: {MATHVISTA_HINTS[r['answer_type']]}\nQuestion: {r['question']}"
                                        for pid, r in testmini.items()})
    _json(src / "data" / "source.json", {pid: "FigureQA" for pid in testmini})
    return src


# The answer-format sentences of MathVista's published queries (data/query.json, the parquet's `query` column)
MATHVISTA_HINTS = {
    "text": "Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end.",
    "integer": "Please answer the question requiring an integer answer and provide the final value, e.g., 1, 2, 3, at "
               "the end.",
    "float1": "Please answer the question requiring a floating-point number with one decimal place and provide the "
              "final value, e.g., 1.2, 1.3, 1.4, at the end.",
    "float2": "Please answer the question requiring a floating-point number with two decimal places and provide the "
              "final value, e.g., 1.23, 1.34, 1.45, at the end.",
    "list": "Please answer the question requiring a Python list as an answer and provide the final list, e.g., "
            "[1, 2, 3], [1.2, 1.3, 1.4], at the end.",
}


def mathvista_formats(root: Path) -> Path:
    """MathVista GitHub layout with the free-form answer formats: a list ("[2, 5]"), a 1-decimal float ("1.5",
    precision 1), an integer with a unit, all with their published query in data/query.json, and a 2-decimal float
    ("0.25", precision 2) that query.json lacks (its hint is built from answer_type / precision). Expect testmini 4
    free_form rows."""
    src = root / "MathVista-formats"
    rows = {"11": ("list", None, "[2, 5]", None), "12": ("float", 1.0, "1.5", None),
            "13": ("integer", None, "7", "cm"), "14": ("float", 2.0, "0.25", None)}
    testmini = {}
    for pid, (kind, precision, answer, unit) in rows.items():
        write_png(src / "data" / "images" / f"{pid}.png", noise_image(20, 24, seed=int(pid)))
        testmini[pid] = {"pid": pid, "question": f"Question {pid}?", "image": f"images/{pid}.png", "choices": None,
                         "unit": unit, "precision": precision, "answer": answer, "question_type": "free_form",
                         "answer_type": kind, "metadata": {"split": "testmini"}}
    _json(src / "data" / "testmini.json", testmini)
    hints = {"11": "list", "12": "float1", "13": "integer"}  # 14: not in query.json
    _json(src / "data" / "query.json", {
        pid: f"Hint: {MATHVISTA_HINTS[hint]}\nQuestion: Question {pid}?" + (" (Unit: cm)" if pid == "13" else "")
        for pid, hint in hints.items()})
    return src


def mathvision(root: Path) -> Path:
    """MathVision Hub layout: data/test-00000-of-00001.parquet with the image only as bytes.
    Expect test 2 rows (multiple_choice 'C', free_form '12')."""
    src = root / "MathVision"
    src.mkdir(parents=True)

    def png(seed):
        buffer = io.BytesIO()
        noise_image(16, 16, seed=seed).save(buffer, format="PNG")
        return {"bytes": buffer.getvalue(), "path": f"images/{seed}.png"}

    rows = [
        {"id": "1", "question": "<image1>Which shape is next?", "options": ["A", "B", "C", "D", "E"],
         "image": "images/1.png", "decoded_image": png(1), "answer": "C", "level": 2, "subject": "logic"},
        {"id": "2", "question": "How long is the side?", "options": [], "image": "images/2.png",
         "decoded_image": png(2), "answer": "12", "level": 1, "subject": "metric geometry"},
    ]
    (src / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), src / "data" / "test-00000-of-00001.parquet")
    return src


# RefCOCO: image id -> (file size written, annotated size)
REFCOCO_IMAGES = {1: ((64, 48), (64, 48)), 2: ((32, 24), (64, 48)), 3: ((48, 48), (64, 48)), 4: (None, (64, 48))}


def refcoco(root: Path) -> Path:
    """refer layout: refs(unc).p + instances.json, COCO images in ../train2014. Expect train 3 rows (ref 10's
    two sentences on a full-size image, ref 11 on a half-size copy), val 1 row (ref 15); skipped: box
    outside the image 1 (ref 13, written as corners), image size differs 1 (ref 12), missing image 1
    (ref 14), duplicate id 1 (ref 10's repeated sentence id)."""
    src = root / "refer" / "refcoco"
    images_dir = root / "refer" / "train2014"
    images, annotations = [], []
    for image_id, (written, (w, h)) in REFCOCO_IMAGES.items():
        name = f"COCO_train2014_{image_id:012d}.jpg"
        if written:
            images_dir.mkdir(parents=True, exist_ok=True)
            noise_image(written[1], written[0], seed=image_id).save(images_dir / name, format="JPEG")
        images.append({"id": image_id, "file_name": name, "width": w, "height": h})
    boxes = {100: (1, [16, 12, 32, 24]), 101: (2, [8, 6, 16, 12]), 102: (3, [0, 0, 10, 10]),
             103: (1, [40, 10, 60, 40]),  # corners: as xywh it reaches x=100 > 64
             104: (4, [1, 1, 5, 5]), 105: (1, [0, 0, 32, 48])}
    for ann_id, (image_id, bbox) in boxes.items():
        annotations.append({"id": ann_id, "image_id": image_id, "bbox": bbox, "category_id": 1, "area": 1.0,
                            "iscrowd": 0, "segmentation": []})
    refs = [
        {"ref_id": 10, "ann_id": 100, "image_id": 1, "split": "train", "category_id": 1,
         "file_name": "COCO_train2014_000000000001_100.jpg",
         "sentences": [{"sent_id": 1, "sent": "the middle thing", "raw": "The middle thing"},
                       {"sent_id": 2, "sent": "center object", "raw": "center object"},
                       {"sent_id": 2, "sent": "center object again", "raw": "center object again"}]},
        *({"ref_id": ref_id, "ann_id": ann_id, "image_id": image_id, "split": split,
           "sentences": [{"sent_id": sent_id, "sent": sent}]}
          for ref_id, ann_id, image_id, split, sent_id, sent in (
              (11, 101, 2, "train", 3, "small one"), (12, 102, 3, "train", 4, "corner"),
              (13, 103, 1, "train", 5, "right"), (14, 104, 4, "testA", 6, "gone"), (15, 105, 1, "val", 7, "left half"))),
    ]
    src.mkdir(parents=True, exist_ok=True)
    with (src / "refs(unc).p").open("wb") as handle:
        pickle.dump(refs, handle)
    _json(src / "instances.json", {"images": images, "annotations": annotations,
                                   "categories": [{"id": 1, "name": "thing"}]})
    return src


def chartqa(root: Path) -> Path:
    """ChartQA layout: <split>/<split>_{human,augmented}.json + <split>/png/. Expect train 3 rows
    (numeric 2, text 1), val 1; skipped: duplicate id 1 (a question repeated in the augmented file),
    missing image 1."""
    src = root / "ChartQA Dataset"
    for split, names in (("train", ["a.png", "b.png"]), ("val", ["c.png"])):
        for k, name in enumerate(names):
            write_png(src / split / "png" / name, noise_image(40, 60, seed=k))
    _json(src / "train" / "train_human.json", [
        {"imgname": "a.png", "query": "What is the highest value?", "label": "45"},
        {"imgname": "b.png", "query": "Which country is largest?", "label": "Brazil"},
        {"imgname": "missing.png", "query": "How many bars?", "label": "4"},
    ])
    _json(src / "train" / "train_augmented.json", [
        {"imgname": "a.png", "query": "What is the highest value?", "label": "45"},  # repeats the human question
        {"imgname": "b.png", "query": "What is the share of Peru?", "label": "12.5%"},
    ])
    _json(src / "val" / "val_human.json", [{"imgname": "c.png", "query": "What is the lowest value?", "label": "3"}])
    return src


def videoqa(root: Path) -> Path:
    """Video-R1 layout: Video-R1-260k.json with relative media paths, and beside it Video-R1-COT-165k.json (the
    same questions with reasoning, for SFT). Expect train 4 rows (a multiple-choice video 'B', a numerical video
    '3', an image free-form 'cat', a numerical '$\\frac{3}{2}$' labelled math); skipped: missing video 1,
    duplicate id 1, unreadable video 2 (an empty and a garbage mp4), the chain-of-thought file 1."""
    src = root / "Video-R1-data"
    write_mp4(src / "clips" / "a.mp4", num_frames=4, fps=2, size=32)
    write_png(src / "frames" / "b.png", noise_image(28, 28))
    (src / "clips" / "empty.mp4").write_bytes(b"")
    (src / "clips" / "garbage.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 4)
    rows = [
        {"problem_id": 1, "problem": "What happens first?", "data_type": "video", "problem_type": "multiple choice",
         "options": ["A. it falls", "B. it rises", "C. nothing"], "solution": "<answer>B</answer>",
         "path": "./clips/a.mp4", "data_source": "demo"},
        {"problem_id": 2, "problem": "How many objects move?", "data_type": "video", "problem_type": "numerical",
         "options": [], "solution": "<answer>3</answer>", "path": "./clips/a.mp4", "data_source": "demo"},
        {"problem_id": 3, "problem": "Which animal is shown?", "data_type": "image", "problem_type": "free-form",
         "options": [], "solution": "<answer>cat</answer>", "path": "./frames/b.png", "data_source": "demo"},
        {"problem_id": 4, "problem": "Where?", "data_type": "video", "problem_type": "free-form", "options": [],
         "solution": "<answer>park</answer>", "path": "./clips/missing.mp4", "data_source": "demo"},
        {"problem_id": 2, "problem": "Repeated id", "data_type": "video", "problem_type": "numerical", "options": [],
         "solution": "<answer>1</answer>", "path": "./clips/a.mp4", "data_source": "demo"},
        {"problem_id": 5, "problem": "What is the ratio of the two speeds?", "data_type": "video",
         "problem_type": "numerical", "options": [], "solution": "<answer>$\\frac{3}{2}$</answer>",
         "path": "./clips/a.mp4", "data_source": "demo"},
        {"problem_id": 6, "problem": "How many frames?", "data_type": "video", "problem_type": "numerical",
         "options": [], "solution": "<answer>4</answer>", "path": "./clips/empty.mp4", "data_source": "demo"},
        {"problem_id": 7, "problem": "What moves?", "data_type": "video", "problem_type": "free-form",
         "options": [], "solution": "<answer>ball</answer>", "path": "./clips/garbage.mp4", "data_source": "demo"},
    ]
    _json(src / "Video-R1-260k.json", rows)
    _json(src / "Video-R1-COT-165k.json", [{**r, "process": "<think>Let me look.</think>"} for r in rows[:3]])
    return src


BUILDERS = {"geometry3k": geometry3k, "clevr": clevr, "mathvista": mathvista, "refcoco": refcoco,
            "chartqa": chartqa, "videoqa": videoqa}


def superclevr(root: Path, images: int = 1) -> Path:
    """SuperCLEVR layout: superCLEVR_questions_30k.json at the top + images/; every question has split "new",
    counts are JSON numbers and yes/no answers JSON booleans. Per image: a count (2), a true and a false question,
    an attribute ('red'). Expect new: `images` rows (counting only), 4 x `images` with --all-questions."""
    src = root / "super-CLEVR"
    questions = []
    for i in range(images):
        name = f"superCLEVR_new_{i:06d}.png"
        write_png(src / "images" / name, noise_image(24, 32, seed=i))
        for k, (question, answer) in enumerate((("How many cars are there?", 2), ("Is there a red bus?", True),
                                                ("Is there a green bike?", False), ("What color is the car?", "red"))):
            questions.append({"question_index": 4 * i + k, "image_index": i, "image_filename": name,
                              "split": "new", "question": question, "answer": answer})
    _json(src / "superCLEVR_questions_30k.json", {"info": {}, "questions": questions})
    return src


def msrvtt_qa(root: Path) -> Path:
    """MSRVTT-QA layout: train_qa.json / test_qa.json + videos/video<id>.mp4. Expect train 1, test 1 rows;
    skipped: missing video 1."""
    src = root / "MSRVTT-QA"
    write_mp4(src / "videos" / "video7.mp4", num_frames=2, fps=2, size=32)
    _json(src / "train_qa.json", [{"id": 0, "question": "what is a man doing", "answer": "singing", "video_id": 7},
                                  {"id": 1, "question": "who talks", "answer": "woman", "video_id": 8}])
    _json(src / "test_qa.json", [{"id": 5, "question": "what color is the car", "answer": "red", "video_id": 7}])
    return src
