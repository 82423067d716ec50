"""Bad media are found before training starts (not at the step that samples them), and checked once."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlrft.config import load_config
from vlrft.data.media import MediaLimits
from vlrft.data.readers import read_samples
from vlrft.errors import UserError
from vlrft.trainer import Trainer

REWARDS = Path(__file__).parent / "data" / "trainer_rewards.py"


def make_data(folder: Path, n: int = 8, bad: dict[int, bytes] | None = None) -> Path:
    rows = []
    for i in range(n):
        name = f"{i}.png"
        if bad and i in bad:
            (folder / name).write_bytes(bad[i])
        else:
            Image.fromarray(np.full((28, 28, 3), 30 * i, np.uint8)).save(folder / name)
        rows.append({"prompt": "<image>What colour?", "images": [name], "answer": str(i)})
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(tmp_path, model, data, *overrides):
    return load_config(None, [
        f"model.path={model}", "model.dtype=float32", f"data.train_files=[{data}]", "data.min_pixels=784",
        "data.max_pixels=3136", "rollout.n=2", "rollout.global_batch_completions=4", "rollout.max_new_tokens=3",
        f"reward.functions=[{{name: '{REWARDS}:text_hash'}}]", f"train.output_dir={tmp_path / 'run'}",
        "train.total_steps=1", "train.micro_batch_completions_per_rank=4", "logging.progress=false", "logging.completions_every=0",
        *overrides])


def test_a_bad_image_stops_the_run_before_any_model_loads(tmp_path, tiny_vlm_dir, monkeypatch):
    data = make_data(tmp_path, bad={5: b"\x89PNG\r\n\x1a\n not really"})
    from vlrft.trainer import trainer as trainer_module

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the data was checked")

    monkeypatch.setattr(trainer_module, "load_processor", no_model)
    with pytest.raises(UserError, match=r"data.train_files: 1 of 8 samples are unusable, first: "
                                        r"train.jsonl line 6, field 'images\[0\]': .*not an image file"):
        Trainer(config(tmp_path, tiny_vlm_dir(), data))
    assert not (tmp_path / "run").exists()


def test_with_skip_bad_media_are_left_out_and_training_runs(tmp_path, tiny_vlm_dir, capsys):
    data = make_data(tmp_path, bad={1: b"", 6: b"GIF89a"})
    trainer = Trainer(config(tmp_path, tiny_vlm_dir(), data, "data.on_bad_sample=skip"))
    assert sorted(s.answer for s in trainer.train_samples) == ["0", "2", "3", "4", "5", "7"]
    assert "left out 2 of 8 unusable samples" in capsys.readouterr().out
    trainer.fit()


@pytest.mark.distributed
def test_every_rank_checks_its_share_of_the_images_and_all_leave_out_the_same_samples(tmp_path, tiny_vlm_dir,
                                                                                      monkeypatch):
    """On many ranks and millions of images one rank checking everything would keep the others waiting past the
    collective timeout: each rank decodes its share, and every rank leaves out the same bad samples."""
    from _torchrun import failure_output, torchrun

    monkeypatch.setenv("VLRFT_CACHE_DIR", str(tmp_path / "cache"))  # nothing known yet: every image is decoded
    data = make_data(tmp_path, n=9, bad={4: b"GIF89a", 7: b""})
    overrides = [f"model.path={tiny_vlm_dir()}", "model.dtype=float32", f"data.train_files=[{data}]",
                 "data.on_bad_sample=skip", "rollout.n=2", "rollout.global_batch_completions=4",
                 f"reward.functions=[{{name: '{REWARDS}:text_hash'}}]", f"train.output_dir={tmp_path / 'run'}",
                 "train.strategy=ddp", "logging.progress=false"]
    out = tmp_path / "reports.json"
    proc = torchrun("validation_worker.py", str(out), *overrides)
    assert proc.returncode == 0, failure_output(proc)
    reports = sorted(json.loads(out.read_text()), key=lambda r: r["rank"])
    decoded = [sorted(Path(ref).name for ref in r["decoded"]) for r in reports]
    assert decoded == [["0.png", "2.png", "4.png", "6.png", "8.png"], ["1.png", "3.png", "5.png", "7.png"]]
    assert reports[0]["kept"] == reports[1]["kept"] == ["0", "1", "2", "3", "5", "6", "8"]
    # one cache file per rank: one writer each, also where the folder is on a file system every node mounts
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["media_ok.rank0.sqlite", "media_ok.rank1.sqlite"]


def test_images_that_passed_are_not_decoded_again_until_they_change(tmp_path, monkeypatch):
    from vlrft.data import validate

    monkeypatch.setenv("VLRFT_CACHE_DIR", str(tmp_path / "cache"))
    samples = read_samples(make_data(tmp_path, bad={3: b"broken"}))
    calls = []
    real = validate.load_image
    monkeypatch.setattr(validate, "load_image", lambda ref, limits: calls.append(ref) or real(ref, limits))
    first = validate.find_bad_media(samples, MediaLimits())
    assert [(p.index, p.field) for p in first] == [(3, "images[0]")] and len(calls) == 8
    calls.clear()
    assert validate.find_bad_media(samples, MediaLimits()) == first and len(calls) == 1  # only the bad one again
    calls.clear()
    Image.fromarray(np.zeros((28, 28, 3), np.uint8)).save(tmp_path / "0.png")
    os.utime(tmp_path / "0.png", ns=(1, 1))
    validate.find_bad_media(samples, MediaLimits())
    assert sorted(Path(c).name for c in calls) == ["0.png", "3.png"]  # the changed file is checked again
    calls.clear()
    assert len(validate.find_bad_media(samples, MediaLimits(max_source_pixels=100))) == 8  # new limits: new check


def test_a_placeholder_count_mismatch_is_found_before_training(tmp_path, tiny_vlm_dir):
    data = make_data(tmp_path)
    lines = data.read_text().splitlines()
    lines[2] = lines[2].replace("<image>What", "<image><image>What")
    data.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"1 of 8 samples are unusable, first: train.jsonl line 3, field 'prompt': the prompt has 2 <image>"):
        Trainer(config(tmp_path, tiny_vlm_dir(), data))


def test_a_corrupt_or_frameless_video_is_found_at_start_and_a_good_one_is_opened_once(tmp_path, monkeypatch):
    """A corrupt video used to pass the start-up check (only its existence was checked) and fail the step that
    drew it, on one rank, mid-run."""
    pytest.importorskip("av")
    from _data_helpers import write_mp4
    from vlrft.data import Sample, validate

    monkeypatch.setenv("VLRFT_CACHE_DIR", str(tmp_path / "cache"))
    write_mp4(tmp_path / "good.mp4", num_frames=4, fps=2)
    (tmp_path / "bad.mp4").write_bytes(b"\x00" * 100)
    samples = [Sample(id=name, prompt="<video>What happens?", videos=[str(tmp_path / name)])
               for name in ("good.mp4", "bad.mp4")]
    opened = []
    real = validate.check_video_file
    monkeypatch.setattr(validate, "check_video_file", lambda path, limits: opened.append(path.name) or real(path, limits))
    problems = validate.find_bad_media(samples, MediaLimits())
    assert [(p.index, p.field) for p in problems] == [(1, "videos[0]")]
    assert "cannot decode video" in problems[0].reason
    assert sorted(opened) == ["bad.mp4", "good.mp4"]
    opened.clear()
    assert validate.find_bad_media(samples, MediaLimits()) == problems and opened == ["bad.mp4"]  # good: cached
    assert validate.find_bad_media(samples, MediaLimits(max_source_pixels=100))[0].index == 0  # 56x56 frames



def _pair_data(folder: Path) -> Path:
    """Three prompts: one image, two images (row 2, id 'pair'), one image."""
    for i in range(2):
        Image.fromarray(np.full((28, 28, 3), 90 * i, np.uint8)).save(folder / f"{i}.png")
    rows = [{"id": "one", "prompt": "<image>What colour?", "images": ["0.png"], "answer": "0"},
            {"id": "pair", "prompt": "<image><image>Same colour?", "images": ["0.png", "1.png"], "answer": "no"},
            {"id": "other", "prompt": "<image>What colour?", "images": ["1.png"], "answer": "1"}]
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


PAIR_REFUSED = (r"data.train_files: 1 of 3 samples are refused by rollout.engine=vllm, first: train.jsonl line 2 "
                r"\(id 'pair'\), field 'images': 2 images in one prompt: LLaVA-OneVision encodes each "
                r"image of a multi-image prompt as one crop, .*; give each prompt one image or set rollout.engine=hf; "
                r"or set data.on_bad_sample=skip to leave them out$")


def test_a_llava_onevision_prompt_with_several_images_is_refused_for_vllm_when_the_data_is_read(tmp_path, tiny_vlm_dir,
                                                                                               monkeypatch):
    """vLLM's processor crops each of a multi-image LLaVA-OneVision prompt's images as if alone: the prompt was
    refused only when a step drew it (after trained steps). Now the data is refused before any model or engine."""
    from vlrft.trainer import trainer as trainer_module

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the data was checked")

    monkeypatch.setattr(trainer_module, "load_processor", no_model)
    monkeypatch.setattr(trainer_module, "make_engine", no_model)
    data = _pair_data(tmp_path)
    with pytest.raises(UserError, match=PAIR_REFUSED):
        Trainer(config(tmp_path, tiny_vlm_dir("llava_onevision"), data, "rollout.engine=vllm"))
    assert not (tmp_path / "run").exists()


def test_several_images_are_left_out_with_skip_and_kept_where_the_engine_takes_them(tmp_path):
    """The check itself, on a stand-in model folder (only its config.json is read)."""
    from vlrft.trainer.training_data import without_engine_refusals

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llava_onevision"}))
    samples = read_samples(_pair_data(tmp_path))
    messages = []

    def kept(*overrides):
        cfg = load_config(None, [f"model.path={model}", *overrides], validate=False)
        return [s.id for s in without_engine_refusals(samples, "data.train_files", cfg, messages.append)]

    with pytest.raises(UserError, match=PAIR_REFUSED):
        kept("rollout.engine=vllm")
    assert kept("rollout.engine=vllm", "data.on_bad_sample=skip") == ["one", "other"]
    assert messages == ["data.train_files: left out 1 of 3 samples rollout.engine=vllm cannot take "
                        "(data.on_bad_sample=skip), first: train.jsonl line 2 (id 'pair'), field 'images': 2 images "
                        "in one prompt: LLaVA-OneVision encodes each image of a "
                        "multi-image prompt as one crop, but vLLM's processor crops every image as if alone (anyres), "
                        "so the prompt cannot keep one tokenization; give each prompt one image or set "
                        "rollout.engine=hf"]
    assert kept("rollout.engine=vllm_server", "data.on_bad_sample=skip") == ["one", "other"]
    assert kept("rollout.engine=hf") == ["one", "pair", "other"]  # the hf engine encodes as the processor does
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    assert kept("rollout.engine=vllm") == ["one", "pair", "other"]


def test_videos_a_family_is_not_trained_with_are_refused_when_the_data_is_read(tmp_path):
    """A family whose video cell the family table refuses (SmolVLM, GLM-4.1V, ...): a sample with a video is refused in
    one line when the data is read, naming the row, the field and the table's reason, or left out and counted with
    data.on_bad_sample=skip; a family trained with videos keeps it. Only the stand-in model folder's config.json is
    read, so no model loads."""
    from vlrft.families import family
    from vlrft.trainer.training_data import without_videos_the_model_refuses

    model = tmp_path / "model"
    model.mkdir()
    Image.fromarray(np.zeros((28, 28, 3), np.uint8)).save(tmp_path / "0.png")
    rows = [{"id": "still", "prompt": "<image>What colour?", "images": ["0.png"], "answer": "0"},
            {"id": "clip", "prompt": "<video>What moves?", "videos": ["clip.mp4"], "answer": "a ball"}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = read_samples(path)
    messages = []

    def kept(model_type, *overrides):
        (model / "config.json").write_text(json.dumps({"model_type": model_type}))
        cfg = load_config(None, [f"model.path={model}", *overrides], validate=False)
        return [s.id for s in without_videos_the_model_refuses(samples, "data.train_files", cfg, messages.append)]

    reason = family("smolvlm").video.refused
    with pytest.raises(UserError) as refused:
        kept("smolvlm")
    assert str(refused.value).startswith("data.train_files: 1 of 2 samples have videos, which SmolVLM is not trained "
                                         "with, first: train.jsonl line 2 (id 'clip'), field 'videos': SmolVLM "
                                         f"(smolvlm) takes no videos in vlrft yet: {reason}; use images")
    assert kept("glm4v", "data.on_bad_sample=skip") == ["still"]
    assert len(messages) == 1 and "left out 1 of 2 samples with videos GLM-4.1V refuses" in messages[0]
    assert kept("qwen2_vl") == ["still", "clip"]
