"""The families beyond the dense Qwen ones (Qwen3-VL-MoE, Gemma 3, GLM-4.1V, InternVL 3, LLaVA-OneVision, SmolVLM)
under `torchrun`: two CPU ranks (gloo), train.strategy=fsdp2, `vlrft train` as a user runs it. tests/test_models.py
checks their FSDP2 units (and for the first three a sharded forward in one process); here the whole step runs sharded:
rollouts with the weights gathered, the training forward
and backward over shards, the optimizer step, and the checkpoint gathered to rank 0."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from _torchrun import start_vlrft
from vlrft.logging import read_metrics

REWARDS = Path(__file__).parent / "data" / "trainer_rewards.py"


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from examples.shapes import ShapesSpec, make_shapes

    return make_shapes(tmp_path_factory.mktemp("shapes"), ShapesSpec(train_size=24, test_size=8))


@pytest.mark.distributed
@pytest.mark.parametrize("arch,lora", [("qwen3_vl_moe", False), ("qwen3_vl_moe", True), ("gemma3", False),
                                       ("glm4v", False), ("internvl", False), ("llava_onevision", False),
                                       ("smolvlm", False)],
                         ids=["qwen3_vl_moe", "qwen3_vl_moe-lora-experts", "gemma3", "glm4v", "internvl",
                              "llava_onevision", "smolvlm"])
def test_two_fsdp2_ranks_train_two_grpo_steps(arch, lora, tmp_path, tiny_vlm_dir, shapes):
    from transformers import AutoModelForImageTextToText

    folder = tiny_vlm_dir(arch)
    out = tmp_path / "run"
    overrides = [f"model.path={folder}", "model.dtype=float32", f"data.train_files=[{shapes['train']}]",
                 "data.min_pixels=784", "data.max_pixels=3136", "algorithm.advantage=grpo", "rollout.n=4",
                 "rollout.global_batch_completions=16", "rollout.max_new_tokens=5",
                 f"reward.functions=[{{name: '{REWARDS}:text_hash'}}]", f"train.output_dir={out}",
                 "train.total_steps=2", "train.lr=1e-2", "train.micro_batch_completions_per_rank=4",
                 "train.eval_every=0", "train.save_every=2", "train.strategy=fsdp2", "logging.progress=false"]
    if lora:  # adapters on the attention and on every expert (PEFT's target_parameters), sharded with their layer
        overrides += ["model.lora.rank=4",
                      "model.lora.target_modules=[q_proj,v_proj,experts.gate_up_proj,experts.down_proj]"]
    config = tmp_path / "run.yaml"
    config.write_text("{}\n")
    log = tmp_path / "log.txt"
    proc = start_vlrft("train", str(config), *overrides, nproc=2, log=log)
    assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
    metrics = [m for m in read_metrics(out) if "reward/mean" in m]
    assert [m["step"] for m in metrics] == [1, 2] and all(math.isfinite(m["entropy"]) for m in metrics)
    saved = out / "checkpoints" / "step_2" / "model"
    if lora:
        from safetensors.torch import load_file

        adapter = load_file(str(saved / "adapter_model.safetensors"))
        assert any(".mlp.experts." in k for k in adapter) and any("q_proj" in k for k in adapter)
        return
    trained, start = AutoModelForImageTextToText.from_pretrained(saved), AutoModelForImageTextToText.from_pretrained(folder)
    assert type(trained).__name__ == type(start).__name__
    moved = [k for k, v in start.state_dict().items() if not torch.equal(v, trained.state_dict()[k])]
    assert any("language_model.layers" in k or "text_model.layers" in k for k in moved), moved  # SmolVLM: the latter
