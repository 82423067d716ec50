"""Small media builders shared by the data-layer tests (real files: PNGs, an MPEG-4 video, a PNG bomb header)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image


def noise_image(height: int, width: int, seed: int = 0) -> Image.Image:
    """A random RGB image (every pixel matters, so any slicing mistake shows)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def write_png(path: Path, image: Image.Image) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG")
    return path


def write_mp4(path: Path, num_frames: int, fps: int, size: int = 56) -> Path:
    """An MPEG-4 file of `num_frames` frames at `fps`, each frame a different solid grey level."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(num_frames):
            frame = np.full((size, size, 3), 10 * i, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_png_bomb(path: Path, width: int, height: int) -> Path:
    """A tiny PNG whose header claims `width` x `height` (a decompression bomb's signature), with a valid CRC."""
    import io

    buffer = io.BytesIO()
    Image.new("L", (1, 1)).save(buffer, format="PNG")
    data = bytearray(buffer.getvalue())
    data[16:24] = struct.pack(">II", width, height)  # IHDR width, height
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))  # CRC over "IHDR" + its 13 data bytes
    path.write_bytes(bytes(data))
    return path


def png_with_huge_icc_profile(inflated: int = 64 << 20) -> bytes:
    """A small valid PNG (28x28 grey) with an iCCP chunk that inflates to `inflated` bytes, past Pillow's limit for
    a text/profile chunk (ImageFile.SAFEBLOCK, 1 MB): Pillow raises ValueError('Decompressed data too large')
    while reading the header. 64 MB of zeros compress to about 64 KB."""
    import io

    buffer = io.BytesIO()
    Image.new("RGB", (28, 28), (90, 90, 90)).save(buffer, format="PNG")
    data = buffer.getvalue()
    body = b"icc\x00\x00" + zlib.compress(bytes(inflated), 9)  # profile name, NUL, compression method 0
    chunk = struct.pack(">I", len(body)) + b"iCCP" + body + struct.pack(">I", zlib.crc32(b"iCCP" + body))
    return data[:33] + chunk + data[33:]  # right after IHDR (8-byte signature + 25-byte IHDR chunk)


def mixed_prompts(folder: Path) -> Path:
    """`folder/mixed.jsonl`: image prompts (from `folder/data/train.jsonl`) and text-only prompts in the order
    I I T T  I T T I. With 4 prompts per step over 2 ranks (contiguous shares, no shuffling):

    step 1: rank 0 gets two image prompts, rank 1 two text-only prompts;
    step 2: each rank one image and one text-only prompt, in opposite order.
    """
    import json

    rows = [json.loads(r) for r in (folder / "data" / "train.jsonl").read_text().splitlines()]
    image = iter({**r, "images": [str(folder / "data" / r["images"][0])]} for r in rows)
    text = iter({"id": f"text-{i}", "prompt": "Name a color.", "answer": "red"} for i in range(8))
    path = folder / "mixed.jsonl"
    path.write_text("".join(json.dumps(next(image if kind == "I" else text)) + "\n" for kind in "IITTITTI"))
    return path
