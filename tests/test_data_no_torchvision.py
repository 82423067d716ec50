"""Without torchvision, images still encode (PIL image processor) and video raises a clear MissingDependencyError."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vlrft.config import DataConfig
from vlrft.data import PromptEncoder, Sample

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import sys
sys.modules["torchvision"] = None  # before anything imports it: behaves as if torchvision were not installed
import numpy as np, torch
from PIL import Image
from vlrft.vision_stack import has_torchvision
from vlrft.models.tiny import TinySpec, build_processor
from vlrft.config import DataConfig
from vlrft.data import PromptEncoder, Sample
from vlrft.errors import MissingDependencyError

assert not has_torchvision()
encoder = PromptEncoder(build_processor(TinySpec(arch="qwen2_vl")), DataConfig())
image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8))
batch = encoder.encode([Sample("i", "<image>What color is the shape?", images=[image])]).batch
print("IMAGE_TOKENS", batch.visual.image_tokens_per_sample())
torch.save({"pixel_values": batch.visual.pixel_values, "ids": batch.prompt_ids[0]}, sys.argv[1])
try:
    encoder.encode([Sample("v", "<video>What happens?", videos=[[image, image]])])
    print("VIDEO_ENCODED")
except MissingDependencyError as exc:
    print("VIDEO_ERROR", exc)
"""


@pytest.mark.slow
def test_images_work_and_video_fails_clearly_without_torchvision(tmp_path, tiny_processor):
    out = tmp_path / "pixels.pt"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                               "TOKENIZERS_PARALLELISM": "false"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "IMAGE_TOKENS [4]" in proc.stdout  # 56x56 -> 4x4 patches -> 4 merged tokens
    assert "VIDEO_ERROR a sample with a video needs the package 'torchvision'" in proc.stdout
    assert "pip install torchvision" in proc.stdout
    # The PIL image path gives the same ids, and the same pixels up to float rounding, as the torchvision path.
    saved = torch.load(out)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8))
    batch = PromptEncoder(tiny_processor("qwen2_vl"), DataConfig()).encode(
        [Sample("i", "<image>What color is the shape?", images=[image])]).batch
    assert saved["ids"] == batch.prompt_ids[0]
    assert torch.allclose(saved["pixel_values"], batch.visual.pixel_values, atol=1e-5)
