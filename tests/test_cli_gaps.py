"""What users expect of the commands: LoRA checkpoints in eval/generate/export, eval on eval data only,
one-line errors for bad `generate --image` files and for `strategy=ddp` without torchrun."""

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from vlrft.cli import main

REWARDS = Path(__file__).parent / "data" / "trainer_rewards.py"


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from examples.shapes import ShapesSpec, make_shapes

    return make_shapes(tmp_path_factory.mktemp("shapes"), ShapesSpec(train_size=8, test_size=4))


def write_config(path, **sections):
    path.write_text(yaml.safe_dump(sections))
    return path


def base_sections(model, shapes, out):
    return dict(model={"path": str(model), "dtype": "float32"},
                data={"train_files": [str(shapes["train"])], "eval_files": [str(shapes["test"])],
                      "min_pixels": 784, "max_pixels": 3136},
                rollout={"n": 2, "global_batch_completions": 4, "max_new_tokens": 3},
                reward={"functions": [{"name": f"{REWARDS}:text_hash"}]},
                train={"output_dir": str(out), "total_steps": 1, "lr": 1e-2, "micro_batch_completions_per_rank": 4,
                       "eval_before_training": False},
                logging={"progress": False, "completions_every": 0, "tensorboard": False})


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory, tiny_vlm_dir, shapes):
    root = tmp_path_factory.mktemp("lora")
    sections = base_sections(tiny_vlm_dir(), shapes, root / "run")
    sections["model"]["lora"] = {"rank": 4, "alpha": 64}
    assert main(["train", str(write_config(root / "c.yaml", **sections))]) == 0
    model = root / "run" / "checkpoints" / "step_1" / "model"
    assert (model / "adapter_config.json").is_file() and not (model / "config.json").exists()
    return model


@pytest.mark.slow
def test_generate_and_export_load_a_lora_checkpoint_merged_into_its_base(tmp_path, lora_checkpoint, tiny_vlm_dir,
                                                                         capsys):
    Image.fromarray(np.full((56, 56, 3), 120, np.uint8)).save(tmp_path / "a.png")
    ask = ["Which colour?", "--image", str(tmp_path / "a.png"), "--max-new-tokens", "6"]
    assert main(["generate", str(lora_checkpoint), *ask]) == 0
    from_adapter = capsys.readouterr().out
    assert main(["export", str(lora_checkpoint), str(tmp_path / "merged")]) == 0
    capsys.readouterr()
    assert (tmp_path / "merged" / "config.json").is_file()
    assert main(["generate", str(tmp_path / "merged"), *ask]) == 0
    assert capsys.readouterr().out == from_adapter

    from safetensors.torch import load_file

    merged = load_file(tmp_path / "merged" / "model.safetensors")
    base = load_file(Path(tiny_vlm_dir()) / "model.safetensors")
    assert merged.keys() == base.keys() and any(not (merged[k] == base[k]).all() for k in base)  # LoRA folded in
    assert main(["export", str(tiny_vlm_dir()), str(tmp_path / "again")]) == 2  # a full model is no adapter


def test_eval_scores_a_lora_checkpoint_with_only_eval_data(tmp_path, lora_checkpoint, shapes, capsys):
    sections = base_sections(lora_checkpoint, shapes, tmp_path / "elsewhere")
    sections["data"]["train_files"] = [str(tmp_path / "not_here.jsonl")]  # eval needs no training data
    assert main(["eval", str(write_config(tmp_path / "e.yaml", **sections))]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert 0 <= metrics["eval/accuracy"] <= 1
    assert not (tmp_path / "elsewhere").exists()  # eval writes nothing into train.output_dir


def _png_with_size(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (with a valid CRC) but holds no such pixels."""
    import io

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, "PNG")
    data = bytearray(buffer.getvalue())
    ihdr = data[12:29]
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(data)


@pytest.mark.parametrize("content,fragment", [
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "not an image file PIL can read"),
    (b"just some text", "not an image file PIL can read"),
    ("truncated", "truncated or corrupt"),
    (_png_with_size(10000, 10000), "over the 89478485-pixel limit"),
    (_png_with_size(20000, 20000), "decompression bomb"),
    (_png_with_size(10000, 4), "aspect ratio of 2500:1"),
])
def test_generate_refuses_a_bad_image_in_one_line(tmp_path, tiny_vlm_dir, capsys, content, fragment):
    if content == "truncated":
        Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(tmp_path / "t.png")
        content = (tmp_path / "t.png").read_bytes()[:300]
    (tmp_path / "bad.png").write_bytes(content)
    assert main(["generate", str(tiny_vlm_dir()), "hi", "--image", str(tmp_path / "bad.png")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--image" in err and fragment in err and "Traceback" not in err


def test_ddp_without_torchrun_says_how_to_launch(tmp_path, tiny_vlm_dir, shapes, capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    sections = base_sections(tiny_vlm_dir(), shapes, tmp_path / "run")
    sections["train"]["strategy"] = "ddp"
    assert main(["train", str(write_config(tmp_path / "c.yaml", **sections))]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "torchrun --nproc_per_node" in err


def test_export_writes_the_merged_model_in_its_base_models_dtype_unless_told(tmp_path, lora_checkpoint, tiny_vlm_dir):
    """A bfloat16 release stays bfloat16 (half of float32's size: 146 GB rather than 288 GB for 72B)."""
    import json
    import shutil

    from safetensors.torch import load_file

    from vlrft.models.loading import load_policy, load_processor

    base = tmp_path / "base_bf16"
    load_policy(tiny_vlm_dir(), dtype="bfloat16").save_pretrained(base, safe_serialization=True)
    load_processor(tiny_vlm_dir()).save_pretrained(base)
    adapter = tmp_path / "adapter"
    shutil.copytree(lora_checkpoint, adapter)
    settings = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**settings, "base_model_name_or_path": str(base)}))
    assert main(["export", str(adapter), str(tmp_path / "auto")]) == 0
    assert {t.dtype for t in load_file(tmp_path / "auto" / "model.safetensors").values()} == {torch.bfloat16}
    assert main(["export", str(adapter), str(tmp_path / "wide"), "--dtype", "float32"]) == 0
    assert {t.dtype for t in load_file(tmp_path / "wide" / "model.safetensors").values()} == {torch.float32}
