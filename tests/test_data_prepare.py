"""`vlrft data prepare`: each public task's raw release -> checked native splits, its recipe trains, its rewards score.

The raw releases are tiny fixtures written in each dataset's own layout (tests/_prepare_fixtures.py),
each with the traps a real release has: missing images, repeated ids, unanswered test rows, boxes in
the other convention and images whose size differs from the annotation's.
"""

from __future__ import annotations

import codecs
import json
import math
from pathlib import Path

import pytest
import yaml

import _prepare_fixtures as fixtures
from vlrft.cli import main
from vlrft.config import DataConfig, load_config
from vlrft.data.check import check_dataset
from vlrft.data.prepare import Options, prepare
from vlrft.data.prepare.common import TEMPLATES_FILE
from vlrft.data.readers import read_samples
from vlrft.errors import UserError
from vlrft.rewards import RewardSet
from vlrft.rewards.builtin.grounding import iou, resized_size

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = {task: CONFIGS / f"qwen2_5_vl_3b_grpo_{task}.yaml" for task in fixtures.BUILDERS}
TEMPLATES = yaml.safe_load(TEMPLATES_FILE.read_text())

# task -> (rows per split, skipped rows per reason, labels)
EXPECTED = {
    "geometry3k": ({"train": 2, "test": 1},
                   {"missing image": 1, "duplicate id": 1, "answer is not one of the choices": 1}, {"geometry": 3}),
    "clevr": ({"train": 2, "val": 1},
              {"no answer": 1, "not a counting question": 1, "duplicate id": 1, "missing image": 1}, {"count": 3}),
    "mathvista": ({"testmini": 2},
                  {"no answer": 1, "answer is not one of the choices": 1, "missing image": 1, "duplicate id": 1},
                  {"free_form": 1, "multiple_choice": 1}),
    "refcoco": ({"train": 3, "val": 1},
                {"duplicate id": 1, "image size differs from the annotation": 1, "box outside the image or empty": 1,
                 "missing image": 1}, {"grounding": 4}),
    "chartqa": ({"train": 3, "val": 1}, {"missing image": 1, "duplicate id": 1}, {"numeric": 3, "text": 1}),
    "videoqa": ({"train": 4}, {"missing video": 1, "duplicate id": 1, "unreadable video": 2,
                               "chain-of-thought file left out": 1},
                {"free_form": 1, "math": 1, "multiple_choice": 1, "numeric": 1}),
}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """task -> (summary, output folder), every fixture prepared once with its default options."""
    root = tmp_path_factory.mktemp("prepare")
    done = {}
    for task, build in fixtures.BUILDERS.items():
        out = root / "out" / task
        done[task] = (prepare(task, build(root / "raw"), out), out)
    return done


@pytest.mark.parametrize("task", list(fixtures.BUILDERS))
def test_each_task_prepares_its_raw_release_into_splits_that_pass_check(task, prepared):
    summary, out = prepared[task]
    rows, skipped, labels = EXPECTED[task]
    assert summary.rows == rows
    assert summary.skipped == skipped
    assert summary.labels == labels
    assert json.loads((out / "summary.json").read_text())["skipped"] == skipped
    cfg = DataConfig(prompt_suffix=TEMPLATES[task]["prompt_suffix"])
    for split in rows:
        report = check_dataset(str(out / f"{split}.jsonl"), cfg)
        assert report.layout == "native" and report.ok, report.summary()
        assert report.rows == rows[split]


def test_geometry3k_answer_is_the_correct_options_value_with_choices_kept(prepared):
    samples = read_samples(prepared["geometry3k"][1] / "train.jsonl")
    first = samples[0]
    assert first.prompt == "<image>Find x. Problem 0." and first.answer == "4"  # option B of 3, 4, 2\sqrt{3}, 6
    assert first.extra == {"choices": ["3", "4", "2\\sqrt{3}", "6"], "answer_option": "B"}


def test_refcoco_boxes_are_normalized_to_the_annotated_image_and_resized_copies_kept(prepared):
    rows = {s.id: s for s in read_samples(prepared["refcoco"][1] / "train.jsonl")}
    assert set(rows) == {"10-1", "10-2", "11-3"}
    # ref 10: COCO box [16, 12, 32, 24] (x, y, w, h) in a 64x48 image
    assert rows["10-1"].answer == "[0.25, 0.25, 0.75, 0.75]" and rows["10-1"].extra["image_size"] == [64, 48]
    # ref 11: annotated 64x48, the file is a 32x24 copy: same normalized box, the file's size
    assert rows["11-3"].extra["box"] == [0.125, 0.125, 0.375, 0.375] and rows["11-3"].extra["image_size"] == [32, 24]


def test_refcoco_corner_boxes_are_read_with_box_format_xyxy(tmp_path):
    source = fixtures.refcoco(tmp_path / "raw")
    summary = prepare("refcoco", source, tmp_path / "out", options=Options(box_format="xyxy"))
    rows = {s.id: s for s in read_samples(tmp_path / "out" / "train.jsonl")}
    # ref 13's [40, 10, 60, 40] now is corners inside the 64x48 image; ref 10's [16, 12, 32, 24] too
    assert rows["13-5"].extra["box"] == [0.625, 0.2083, 0.9375, 0.8333]
    assert rows["10-1"].extra["box"] == [0.25, 0.25, 0.5, 0.5]
    assert "box outside the image or empty" not in summary.skipped


def test_mathvision_parquet_images_stored_as_bytes_become_files(tmp_path):
    summary = prepare("mathvista", fixtures.mathvision(tmp_path / "raw"), tmp_path / "out")
    assert summary.rows == {"test": 2}
    samples = read_samples(tmp_path / "out" / "test.jsonl")
    assert [s.answer for s in samples] == ["C", "12"] and [s.label for s in samples] == ["multiple_choice", "free_form"]
    assert samples[0].prompt.startswith("<image>Which shape is next?\nChoices:\nA. A")  # <image1> tag removed
    assert all(Path(s.images[0]).is_file() and Path(s.images[0]).is_relative_to(tmp_path / "out" / "media")
               for s in samples)


def test_superclevr_and_msrvtt_qa_layouts(tmp_path):
    summary = prepare("clevr", fixtures.superclevr(tmp_path / "raw"), tmp_path / "clevr")
    assert summary.rows == {"new": 1}  # the release's one split
    assert read_samples(tmp_path / "clevr" / "new.jsonl")[0].answer == "2"  # numbers become text
    summary = prepare("videoqa", fixtures.msrvtt_qa(tmp_path / "raw"), tmp_path / "msrvtt")
    assert summary.rows == {"train": 1, "test": 1} and summary.skipped == {"missing video": 1}
    sample = read_samples(tmp_path / "msrvtt" / "test.jsonl")[0]
    assert sample.prompt.startswith("<video>what color is the car") and sample.label == "free_form"
    assert sample.videos[0].endswith("videos/video7.mp4")


def test_embedded_images_write_self_contained_parquet(tmp_path):
    source = fixtures.geometry3k(tmp_path / "raw")
    summary = prepare("geometry3k", source, tmp_path / "out", embed_images=True)
    assert summary.files["train"].endswith("train.parquet")
    samples = read_samples(tmp_path / "out" / "train.parquet")
    image = samples[0].images[0]
    assert image["bytes"] == (source / "train" / "0" / "img_diagram.png").read_bytes()
    assert check_dataset(summary.files["train"], DataConfig()).ok


def test_templates_override_replaces_the_prompt_and_the_suffix_reported(tmp_path):
    override = tmp_path / "mine.yaml"
    override.write_text(yaml.safe_dump({"clevr": {"prompt": "Count: {question}", "prompt_suffix": " Be brief."}}))
    summary = prepare("clevr", fixtures.clevr(tmp_path / "raw"), tmp_path / "out", templates=override)
    assert read_samples(tmp_path / "out" / "train.jsonl")[0].prompt == "<image>Count: How many cubes are there?"
    assert summary.prompt_suffix == " Be brief."
    override.write_text(yaml.safe_dump({"clevr": {"prompt": "{nope}"}}))
    with pytest.raises(UserError, match=r"cannot be filled .*\{question\}"):
        prepare("clevr", fixtures.clevr(tmp_path / "raw2"), tmp_path / "out2", templates=override)


def test_cli_prepare_prints_the_summary_with_prompt_tokens(tmp_path, tiny_vlm_dir, capsys):
    source = fixtures.chartqa(tmp_path / "raw")
    code = main(["data", "prepare", "chartqa", "--source", str(source), "--out", str(tmp_path / "out"),
                 "--model", str(tiny_vlm_dir("qwen2_vl"))])
    printed = capsys.readouterr().out
    assert code == 0 and "train: 3 rows" in printed and "duplicate id: 1" in printed
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    tokens = summary["prompt_tokens"]["train"]
    assert 0 < tokens["min"] <= tokens["p50"] <= tokens["max"] and summary["image_sizes"] == {"<=256": 4}
    assert main(["data", "prepare", "chartqa", "--source", str(tmp_path / "nowhere"), "--out",
                 str(tmp_path / "o")]) == 2
    # A training config's data settings: its suffix and pixel bounds are measured, its limit reported
    config = tmp_path / "recipe.yaml"
    config.write_text(RECIPES["chartqa"].read_text().replace("max_prompt_length: 2048", "max_prompt_length: 105")
                      .replace("Output the thinking", "Please output the thinking"))
    assert main(["data", "prepare", "chartqa", "--source", str(source), "--out", str(tmp_path / "out2"),
                 "--model", str(tiny_vlm_dir("qwen2_vl")), "--config", str(config)]) == 0
    summary2 = json.loads((tmp_path / "out2" / "summary.json").read_text())
    assert summary2["prompt_suffix"].startswith(" Please output")
    longer = summary2["prompt_tokens"]["train"]
    assert longer["max"] > tokens["max"] and longer["over_105"] == 1  # lengths 104, 105, 106


@pytest.mark.parametrize("task", list(fixtures.BUILDERS))
def test_each_recipe_config_carries_its_templates_prompt_suffix(task):
    cfg = load_config(RECIPES[task], world_size=8)
    assert cfg.data.prompt_suffix == TEMPLATES[task]["prompt_suffix"]


# --- rewards: the recipe scores the reference answer 1 and a wrong answer 0 --------------------------------

def _completion(task: str, answer: str) -> str:
    if task == "geometry3k":
        return f"<think>compute</think> The answer is \\boxed{{{answer}}}."
    return f"<think>look</think><answer>{answer}</answer>"


WRONG = {"geometry3k": "17", "clevr": "9", "chartqa": "nothing", "videoqa": "Z"}


@pytest.mark.parametrize("task", ["geometry3k", "clevr", "mathvista", "chartqa", "videoqa"])
def test_recipe_rewards_the_reference_answer_and_not_a_wrong_one(task, prepared):
    out = prepared[task][1]
    samples = [s for split in EXPECTED[task][0] for s in read_samples(out / f"{split}.jsonl")]
    rewards = RewardSet.from_config(load_config(RECIPES[task], world_size=8).reward)
    for sample in samples:
        wrong = {"multiple_choice": "A" if sample.answer != "A" else "B"}.get(sample.label, WRONG.get(task, "123456"))
        result = rewards.score([_completion(task, sample.answer), _completion(task, wrong)],
                               references=[sample.answer] * 2, labels=[sample.label] * 2, extras=[sample.extra] * 2)
        accuracy = {k: v for k, v in result.per_function.items() if k != "format"}
        values = [float(v[0]) for v in accuracy.values() if not math.isnan(v[0])]
        wrongs = [float(v[1]) for v in accuracy.values() if not math.isnan(v[1])]
        assert values == [1.0] and wrongs == [0.0], (sample.id, sample.label, accuracy)
        assert float(result.total[0]) == pytest.approx(1.0) and float(result.total[1]) == pytest.approx(0.1)


def test_multiple_choice_accepts_the_options_text(prepared):
    sample = read_samples(prepared["mathvista"][1] / "testmini.jsonl")[0]
    rewards = RewardSet.from_config(load_config(RECIPES["mathvista"], world_size=8).reward)
    result = rewards.score(["<answer>145°</answer>", "<answer>160°</answer>"], references=[sample.answer] * 2,
                           labels=[sample.label] * 2, extras=[sample.extra] * 2)
    assert result.per_function["choice"].tolist() == [1.0, 0.0]


def test_grounding_iou_of_a_perturbed_box_in_both_conventions(prepared):
    """The reference [0.25, 0.25, 0.75, 0.75] of a 64x48 image; the answer shifted right by 1/8 of the width.

    Hand-computed: intersection 0.375 x 0.5, union 2 * 0.25 - 0.1875 -> IoU = 0.1875 / 0.3125 = 0.6.
    """
    sample = {s.id: s for s in read_samples(prepared["refcoco"][1] / "train.jsonl")}["10-1"]
    reference, size = sample.answer, sample.extra["image_size"]
    # Qwen2-VL / Qwen3-VL: 0-1000 relative coordinates
    shifted = "<answer>[{\"bbox_2d\": [375, 250, 875, 750], \"label\": \"thing\"}]</answer>"
    exact = "<answer>[250, 250, 750, 750]</answer>"
    for family in ("qwen2_vl", "qwen3_vl"):
        assert iou([exact, shifted], [reference] * 2, coords=family, reference_coords="normalized",
                   image_size=[size] * 2) == pytest.approx([1.0, 0.6])
    # Qwen2.5-VL: pixels of the resized image the model saw (here smart_resize(64x48) -> 56x56)
    seen = resized_size(64, 48, min_pixels=56 * 56, max_pixels=56 * 56)
    assert seen == (56, 56)
    w, h = seen
    exact_px = f"<answer>[{0.25 * w}, {0.25 * h}, {0.75 * w}, {0.75 * h}]</answer>"
    shifted_px = f"<answer>[{0.375 * w}, {0.25 * h}, {0.875 * w}, {0.75 * h}]</answer>"
    original_px = "<answer>[24, 12, 56, 36]</answer>"  # the shifted box in the ORIGINAL 64x48 pixels
    scores = iou([exact_px, shifted_px, original_px], [reference] * 3, coords="qwen2_5_vl",
                 reference_coords="normalized", min_pixels=56 * 56, max_pixels=56 * 56, image_size=[size] * 3)
    assert scores[:2] == pytest.approx([1.0, 0.6])
    assert scores[2] != pytest.approx(0.6)  # original-image pixels are the wrong convention for Qwen2.5-VL
    # During training the images the model saw give the resized size directly
    from PIL import Image

    seen_images = [[Image.new("RGB", seen)]] * 2
    assert iou([exact_px, shifted_px], [reference] * 2, coords="qwen2_5_vl", reference_coords="normalized",
               images=seen_images) == pytest.approx([1.0, 0.6])
    # Original pixels, xywh (COCO) answers
    assert iou(["[24, 12, 32, 24]"], [reference], coords="pixels", reference_coords="normalized",
               box_format="xywh", image_size=[size]) == pytest.approx([0.6])
    with pytest.raises(Exception, match="image_size"):
        iou(["[24, 12, 32, 24]"], [reference], coords="pixels", reference_coords="normalized")


def test_resized_size_is_what_the_qwen2_5_vl_processor_makes_of_the_image(tiny_processor):
    """`coords: qwen2_5_vl` offline relies on resized_size matching the processor's own resize."""
    from _data_helpers import noise_image

    image_processor = tiny_processor("qwen2_5_vl").image_processor
    low, high = image_processor.size["shortest_edge"], image_processor.size["longest_edge"]
    for height, width in ((48, 64), (300, 200), (17, 90)):
        grid = image_processor(images=[noise_image(height, width)], return_tensors="pt")["image_grid_thw"][0]
        patch = image_processor.patch_size
        assert resized_size(width, height, low, high, factor=patch * image_processor.merge_size) == \
            (int(grid[2]) * patch, int(grid[1]) * patch)


def test_training_passes_iou_the_resized_images_a_qwen2_5_vl_model_sees(prepared, tiny_processor):
    """The encoder's images (what the trainer hands rewards) have the size Qwen2.5-VL's pixel boxes refer to."""
    from vlrft.data.processor import PromptEncoder

    sample = {s.id: s for s in read_samples(prepared["refcoco"][1] / "train.jsonl")}["10-1"]  # 64x48 image
    cfg = DataConfig(min_pixels=28 * 28, max_pixels=56 * 56)
    batch = PromptEncoder(tiny_processor("qwen2_5_vl"), cfg).encode([sample]).batch
    seen = batch.images[0][0].size
    assert seen == resized_size(64, 48, 28 * 28, 56 * 56) == (56, 56)
    w, h = seen
    box = f"<answer>[{0.375 * w}, {0.25 * h}, {0.875 * w}, {0.75 * h}]</answer>"  # shifted by 1/8 of the width
    assert iou([box], [sample.answer], coords="qwen2_5_vl", reference_coords="normalized",
               images=batch.images) == pytest.approx([0.6])


# --- each recipe trains two steps on a tiny model ------------------------------------------------------------

TRAIN_SPLIT = {"mathvista": "testmini"}


@pytest.mark.parametrize("task", list(fixtures.BUILDERS))
def test_each_recipe_trains_two_steps_on_its_prepared_data(task, prepared, tiny_vlm_dir, tmp_path):
    from vlrft.logging import read_metrics
    from vlrft.trainer import Trainer

    out = prepared[task][1]
    train = out / f"{TRAIN_SPLIT.get(task, 'train')}.jsonl"
    cfg = load_config(RECIPES[task], [
        f"model.path={tiny_vlm_dir('qwen2_vl')}", "model.dtype=float32", "model.gradient_checkpointing=false",
        f"data.train_files=[{train}]", "data.eval_files=[]", "data.min_pixels=784", "data.max_pixels=3136",
        "data.max_prompt_length=4096", "data.video_max_frames=4",
        "rollout.engine=hf", "rollout.n=2", "rollout.global_batch_completions=4", "rollout.max_new_tokens=4",
        "train.strategy=single", "train.total_steps=2", "train.global_mini_batch_completions=4", "train.micro_batch_completions_per_rank=4",
        "train.eval_every=0", "train.save_every=0", f"train.output_dir={tmp_path / 'run'}",
        "logging.tensorboard=false", "logging.progress=false",
    ])
    Trainer(cfg).fit()
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1, 2]


# --- release quirks: booleans, dict choices, one-split releases, corrupt media, re-runs ------------------------

def test_the_val_split_is_the_same_wherever_the_release_is_unpacked_and_embedded_or_not(tmp_path):
    """The split hashed the rows' absolute media paths: the same release unpacked in another folder (or prepared
    with --embed-images, whose rows carry file names) gave another val split, and at 12 images and 25 % about one
    folder in 30 gave no val split at all."""
    splits = []
    for where, embed in (("a", False), ("b/deeper", False), ("c", True)):
        source = fixtures.superclevr(tmp_path / where / "raw", images=40)
        prepare("clevr", source, tmp_path / where / "out", embed_images=embed,
                options=Options(all_questions=True, val_fraction=0.25))
        val = read_samples(next((tmp_path / where / "out").glob("val.*")))  # jsonl, or parquet when embedded
        splits.append(sorted(s.id for s in val))
    assert splits[0] and splits[0] == splits[1] == splits[2]


def test_superclevr_booleans_become_yes_no_rows_the_recipe_scores_and_one_split_becomes_train_and_val(tmp_path):
    source = fixtures.superclevr(tmp_path / "raw", images=12)
    options = Options(all_questions=True, val_fraction=0.25)
    summary = prepare("clevr", source, tmp_path / "out", options=options)
    assert set(summary.rows) == {"train", "val"} and sum(summary.rows.values()) == 48
    assert summary.labels == {"attribute": 12, "count": 12, "yes_no": 24}
    samples = {split: read_samples(tmp_path / "out" / f"{split}.jsonl") for split in ("train", "val")}
    rows = samples["train"] + samples["val"]
    assert sorted({s.answer for s in rows if s.label == "yes_no"}) == ["no", "yes"]  # not "True" / "False"
    by_image = {split: {s.images[0] for s in split_samples} for split, split_samples in samples.items()}
    assert not by_image["train"] & by_image["val"]  # an image's questions stay on one side
    again = prepare("clevr", source, tmp_path / "again", options=Options(all_questions=True, val_fraction=0.25))
    assert again.rows == summary.rows  # the same split on every run
    rewards = RewardSet.from_config(load_config(RECIPES["clevr"], world_size=8).reward)
    for sample in rows:
        wrong = {"yes": "no", "no": "yes"}.get(sample.answer, "blue" if sample.label == "attribute" else "9")
        result = rewards.score([_completion("clevr", sample.answer), _completion("clevr", wrong)],
                               references=[sample.answer] * 2, labels=[sample.label] * 2, extras=[sample.extra] * 2)
        assert [float(t) for t in result.total] == pytest.approx([1.0, 0.1]), (sample.label, sample.answer)
    with pytest.raises(UserError, match="--val-fraction is for a release with one split"):
        prepare("clevr", fixtures.clevr(tmp_path / "raw2"), tmp_path / "out2", options=Options(val_fraction=0.1))


def test_choices_given_as_a_dict_keyed_by_letters(tmp_path):
    """Geometry3K, MathVista and Video-R1 rows whose choices are {"A": ..., "B": ...}: the values, in letter order."""
    geo = fixtures.geometry3k(tmp_path / "raw")
    data = json.loads((geo / "train" / "0" / "data.json").read_text())
    (geo / "train" / "0" / "data.json").write_text(json.dumps({**data, "choices": {"B": "4", "A": "3", "C": "5"}}))
    summary = prepare("geometry3k", geo, tmp_path / "geo")
    sample = read_samples(tmp_path / "geo" / "train.jsonl")[0]
    assert sample.answer == "4" and sample.extra["choices"] == ["3", "4", "5"] and sample.extra["answer_option"] == "B"
    vista = fixtures.mathvista(tmp_path / "raw")
    rows = json.loads((vista / "data" / "testmini.json").read_text())
    rows["1"].update(choices={"A": "120°", "B": "145°", "C": "160°"}, answer="B")
    (vista / "data" / "testmini.json").write_text(json.dumps(rows))
    prepare("mathvista", vista, tmp_path / "vista")
    sample = next(s for s in read_samples(tmp_path / "vista" / "testmini.jsonl") if s.id == "1")
    assert sample.answer == "B" and sample.extra["choices"] == ["120°", "145°", "160°"] and "B. 145°" in sample.prompt
    video = fixtures.videoqa(tmp_path / "raw")
    rows = json.loads((video / "Video-R1-260k.json").read_text())
    rows[0]["options"] = {"A": "it falls", "B": "it rises", "C": "nothing"}
    rows[2]["options"] = {"x": "y"}  # a free-form row with a form the choices cannot take: left out, named
    (video / "Video-R1-260k.json").write_text(json.dumps(rows))
    summary = prepare("videoqa", video, tmp_path / "video")
    sample = next(s for s in read_samples(tmp_path / "video" / "train.jsonl") if s.id == "1")
    assert sample.extra["choices"] == ["it falls", "it rises", "nothing"] and "B. it rises" in sample.prompt
    assert summary.skipped["choices in an unknown form"] == 1


def test_video_r1_numerical_latex_answers_are_scored_by_value(prepared):
    """`$\\frac{3}{2}$` is labelled math: the recipe's default accuracy (math-verify) takes "1.5" as right."""
    out = prepared["videoqa"][1]
    sample = next(s for s in read_samples(out / "train.jsonl") if s.id == "5")
    assert sample.label == "math" and sample.answer == "$\\frac{3}{2}$"
    rewards = RewardSet.from_config(load_config(RECIPES["videoqa"], world_size=8).reward)
    result = rewards.score([_completion("videoqa", "1.5"), _completion("videoqa", "2")], references=[sample.answer] * 2,
                           labels=[sample.label] * 2, extras=[sample.extra] * 2)
    assert [float(t) for t in result.total] == pytest.approx([1.0, 0.1])
    assert not (out / "Video-R1-260k.jsonl").exists() and not (out / "Video-R1-COT-165k.jsonl").exists()


def test_a_rerun_into_the_same_folder_removes_the_splits_it_no_longer_writes(tmp_path):
    source = fixtures.superclevr(tmp_path / "raw", images=8)
    out = tmp_path / "out"
    prepare("clevr", source, out, options=Options(val_fraction=0.5))
    assert (out / "train.jsonl").is_file() and (out / "val.jsonl").is_file()
    (out / "notes.jsonl").write_text("{}\n")  # not a file prepare wrote: left alone
    summary = prepare("clevr", source, out)
    assert sorted(p.name for p in out.glob("*.jsonl")) == ["new.jsonl", "notes.jsonl"] and summary.rows == {"new": 8}


def test_the_layout_error_points_to_help_that_describes_every_tasks_layout(tmp_path, capsys):
    (tmp_path / "unanswered").mkdir()
    (tmp_path / "unanswered" / "CLEVR_test_questions.json").write_text(json.dumps({"questions": [
        {"question_index": 0, "image_filename": "CLEVR_test_000000.png", "question": "How many?"}]}))
    with pytest.raises(UserError, match=r"no usable rows .* the clevr layout described by `vlrft data prepare --help`"):
        prepare("clevr", tmp_path / "unanswered", tmp_path / "out")
    with pytest.raises(SystemExit):
        main(["data", "prepare", "--help"])
    text = capsys.readouterr().out
    for task, raw_file in (("geometry3k", "data.json"), ("mathvista", "testmini.json"), ("clevr", "_questions.json"),
                           ("refcoco", "refs(unc).p"), ("chartqa", "train_human.json"), ("videoqa", "Video-R1-260k")):
        assert f"  {task}  " in text and raw_file in text, task


def test_without_pyav_preparing_videos_is_one_error_naming_the_extra(tmp_path, monkeypatch):
    import sys

    from vlrft.errors import MissingDependencyError

    source = fixtures.videoqa(tmp_path / "raw")
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    with pytest.raises(MissingDependencyError, match=r"vlrft\[video\]"):
        prepare("videoqa", source, tmp_path / "out")


# --- answer formats the rows must state, and the grading that follows them (issue 40) --------------------------

def test_mathvista_free_form_rows_carry_the_published_answer_format_and_grading_uses_precision(tmp_path):
    """MathVista's query.json tells the model the answer's form (a Python list, one decimal place, ...); the rows
    dropped it, so for "[2, 5]" or "1.5" the model was never told the format, and `precision` was stored but unused:
    "1.52" for 1.5 at precision 1 scored 0."""
    prepare("mathvista", fixtures.mathvista_formats(tmp_path / "raw"), tmp_path / "out")
    rows = {s.id: s for s in read_samples(tmp_path / "out" / "testmini.jsonl")}
    hints = fixtures.MATHVISTA_HINTS
    assert rows["11"].prompt == f"<image>Question 11?\nHint: {hints['list']}"
    assert rows["12"].prompt == f"<image>Question 12?\nHint: {hints['float1']}"
    assert rows["13"].prompt == f"<image>Question 13? (unit: cm)\nHint: {hints['integer']}"
    assert rows["14"].prompt == f"<image>Question 14?\nHint: {hints['float2']}"  # built: query.json lacks pid 14
    assert rows["12"].extra["precision"] == 1.0 and rows["11"].label == "free_form"
    rewards = RewardSet.from_config(load_config(RECIPES["mathvista"], world_size=8).reward)

    def accuracy(sample, answers):
        result = rewards.score([f"<think>.</think><answer>{a}</answer>" for a in answers],
                               references=[sample.answer] * len(answers), labels=[sample.label] * len(answers),
                               extras=[sample.extra] * len(answers))
        return result.per_function["math_accuracy"].tolist()

    # MathVista's grading: the answer rounded to `precision` places equals the reference
    assert accuracy(rows["12"], ["1.52", "1.5", "1.46", "1.56", "1.4"]) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert accuracy(rows["14"], ["0.254", "0.25", "0.26"]) == [1.0, 1.0, 0.0]
    assert accuracy(rows["11"], ["[2, 5]", "[2, 6]"]) == [1.0, 0.0]


def test_video_r1_numerical_answer_with_words_is_graded_as_a_number(tmp_path):
    """A Video-R1 numerical answer "3 objects" was labelled math: math-verify scored "3" wrong (total 0.1)."""
    source = fixtures.videoqa(tmp_path / "raw")
    rows = json.loads((source / "Video-R1-260k.json").read_text())
    rows.append({"problem_id": 8, "problem": "How many objects are on the table?", "data_type": "video",
                 "problem_type": "numerical", "options": [], "solution": "<answer>3 objects</answer>",
                 "path": "./clips/a.mp4", "data_source": "demo"})
    (source / "Video-R1-260k.json").write_text(json.dumps(rows))
    prepare("videoqa", source, tmp_path / "out")
    samples = {s.id: s for s in read_samples(tmp_path / "out" / "train.jsonl")}
    sample = samples["8"]
    assert sample.label == "numeric" and sample.prompt.endswith("\nAnswer with a number.")
    assert samples["5"].label == "math"  # $\frac{3}{2}$ stays with math-verify
    rewards = RewardSet.from_config(load_config(RECIPES["videoqa"], world_size=8).reward)
    result = rewards.score([_completion("videoqa", "3"), _completion("videoqa", "4")], references=[sample.answer] * 2,
                           labels=[sample.label] * 2, extras=[sample.extra] * 2)
    assert [float(t) for t in result.total] == pytest.approx([1.0, 0.1])


def test_clevr_all_questions_rows_ask_for_their_own_answer_kind(tmp_path):
    """With --all-questions the suffix asked for "final answer (number)" on yes/no and attribute rows too: each row
    now carries the suffix of its answer kind and the summary reports no data.prompt_suffix; counting-only rows are
    unchanged (no suffix in the row, R1-V's suffix reported)."""
    source = fixtures.superclevr(tmp_path / "raw", images=1)
    summary = prepare("clevr", source, tmp_path / "all", options=Options(all_questions=True))
    rows = {s.label: s for s in read_samples(tmp_path / "all" / "new.jsonl")}
    suffix = TEMPLATES["clevr"]["prompt_suffix"]
    assert summary.prompt_suffix is None
    assert rows["count"].prompt == "<image>How many cars are there?" + suffix
    assert rows["yes_no"].prompt.endswith("final answer (yes or no) in <answer> </answer> tags.")
    assert rows["attribute"].prompt == ("<image>What color is the car? Output the thinking process in <think> </think>"
                                        " and final answer (a single word) in <answer> </answer> tags.")
    assert not any("(number)" in s.prompt for s in rows.values() if s.label != "count")
    counting = prepare("clevr", source, tmp_path / "count")
    assert counting.prompt_suffix == suffix
    assert read_samples(tmp_path / "count" / "new.jsonl")[0].prompt == "<image>How many cars are there?"


def test_a_clevr_questions_file_with_a_byte_order_mark_reads(tmp_path):
    source = fixtures.clevr(tmp_path / "raw")
    path = source / "questions" / "CLEVR_train_questions.json"
    path.write_bytes(codecs.BOM_UTF8 + path.read_bytes())
    summary = prepare("clevr", source, tmp_path / "out")
    assert summary.rows == EXPECTED["clevr"][0]
