"""Every PIL mode and container decodes to the right RGB pixels (16-bit grayscale must not turn white)."""

import io
import json

import numpy as np
import pytest
from PIL import Image

from vlrft.data.media import load_image

H, W = 6, 8
GRAY = (np.arange(H * W).reshape(H, W) * 5 + 10).astype(np.uint8)  # 10..245
RGB = np.stack([GRAY, 255 - GRAY, (GRAY.astype(np.int64) * 3) % 256], axis=-1).astype(np.uint8)
ALPHA = (np.arange(H * W).reshape(H, W) * 5).astype(np.uint8)


def gray3(g):
    return np.repeat(g[..., None], 3, axis=-1)


def over_white(rgb, alpha):
    a = alpha[..., None].astype(np.float64) / 255
    return rgb * a + 255 * (1 - a)


def palette_image():
    colors = np.array([[200, 10, 10], [10, 200, 10], [10, 10, 200], [90, 90, 90]], dtype=np.uint8)
    index = (np.arange(H * W).reshape(H, W) % 4).astype(np.uint8)
    image = Image.frombytes("P", (W, H), index.tobytes())
    image.putpalette(colors.flatten().tolist())
    return image, colors[index], index


def cases():
    """(name, PIL image, expected RGB uint8 array, tolerance)."""
    p_image, p_rgb, p_index = palette_image()
    p_transparent = p_image.copy()
    p_transparent.info["transparency"] = 0
    p_transparent_rgb = np.where((p_index == 0)[..., None], 255, p_rgb)
    pa = p_image.convert("PA")
    pa.putalpha(Image.fromarray(ALPHA))
    sixteen = GRAY.astype(np.uint16) * 257
    rgba = Image.fromarray(np.dstack([RGB, ALPHA]))
    la = Image.fromarray(np.dstack([GRAY, ALPHA]))
    one_bit = Image.fromarray(GRAY > 128).convert("1")
    return [
        ("RGB", Image.fromarray(RGB), RGB, 0),
        ("L", Image.fromarray(GRAY), gray3(GRAY), 0),
        ("I;16", Image.fromarray(sixteen), gray3(GRAY), 0),
        ("I;16B", Image.frombytes("I;16B", (W, H), sixteen.astype(">u2").tobytes()), gray3(GRAY), 0),
        ("I (16-bit values)", Image.fromarray(sixteen.astype(np.int32)), gray3(GRAY), 0),
        ("I (8-bit values)", Image.fromarray(GRAY.astype(np.int32)), gray3(GRAY), 0),
        ("F (0..1)", Image.fromarray(GRAY.astype(np.float32) / 255), gray3(GRAY), 0),
        ("1", one_bit, gray3(np.where(GRAY > 128, 255, 0).astype(np.uint8)), 0),
        ("P", p_image, p_rgb, 0),
        ("P + transparency", p_transparent, p_transparent_rgb, 0),
        ("PA", pa, over_white(p_rgb, ALPHA), 1),
        ("LA", la, over_white(gray3(GRAY), ALPHA), 1),
        ("RGBA", rgba, over_white(RGB, ALPHA), 1),
        ("CMYK", Image.fromarray(RGB).convert("CMYK"), RGB, 0),
        ("YCbCr", Image.fromarray(RGB).convert("YCbCr"), RGB, 3),
    ]


def _bytes(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def _assert_pixels(decoded: Image.Image, expected: np.ndarray, tolerance: float, name: str):
    assert decoded.mode == "RGB" and decoded.size == (W, H), name
    diff = np.abs(np.asarray(decoded, dtype=np.float64) - np.asarray(expected, dtype=np.float64))
    assert diff.max() <= tolerance, f"{name}: pixels off by up to {diff.max()}"


@pytest.mark.parametrize("name", [c[0] for c in cases()])
def test_every_pil_mode_decodes_to_the_reference_pixels(name):
    _, image, expected, tolerance = next(c for c in cases() if c[0] == name)
    _assert_pixels(load_image(image), expected, tolerance, name)


@pytest.mark.parametrize("fmt,mode,lossy", [
    ("PNG", "I;16", 0), ("TIFF", "I;16", 0), ("TIFF", "F", 0), ("TIFF", "I", 0), ("PNG", "LA", 1), ("PNG", "P", 0),
    ("PNG", "1", 0), ("TIFF", "CMYK", 0), ("JPEG", "CMYK", 12), ("JPEG", "L", 4), ("BMP", "RGB", 0),
    ("GIF", "P", 0), ("WEBP", "RGBA", 1), ("PNG", "RGBA", 1), ("TIFF", "YCbCr", 3),
])
def test_files_in_every_container_decode_to_the_reference_pixels(fmt, mode, lossy):
    name, image, expected, tolerance = next(c for c in cases() if c[1].mode == mode)
    options = {"lossless": True} if fmt == "WEBP" else {"quality": 100} if fmt == "JPEG" else {}
    data = _bytes(image if fmt != "TIFF" or mode != "YCbCr" else image.convert("RGB"), fmt, **options)
    _assert_pixels(load_image(data), expected, max(tolerance, lossy), f"{name} as {fmt}")


@pytest.mark.parametrize("orientation,stored_by", [(3, Image.Transpose.ROTATE_180), (6, Image.Transpose.ROTATE_90),
                                                   (8, Image.Transpose.ROTATE_270),
                                                   (2, Image.Transpose.FLIP_LEFT_RIGHT)])
def test_exif_orientation_is_applied(orientation, stored_by):
    for base, expected in ((Image.fromarray(RGB), RGB), (Image.fromarray(GRAY.astype(np.uint16) * 257), gray3(GRAY))):
        stored = base.transpose(stored_by)
        exif = Image.Exif()
        exif[0x0112] = orientation
        _assert_pixels(load_image(_bytes(stored, "PNG", exif=exif.tobytes())), expected, 0,
                       f"{base.mode} orientation {orientation}")


def test_data_check_reports_image_modes_and_passes_16_bit_rows(tmp_path, capsys):
    from vlrft.cli import main

    Image.fromarray(GRAY.astype(np.uint16) * 257).save(tmp_path / "depth.png")
    Image.fromarray(RGB).save(tmp_path / "photo.png")
    rows = [{"prompt": "<image>What is shown?", "images": ["depth.png"], "answer": "a"},
            {"prompt": "<image>What is shown?", "images": ["photo.png"], "answer": "b"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["data", "check", str(tmp_path / "d.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "2 good, 0 bad" in out and "I;16: 1 (16-bit, scaled to 8 bits)" in out and "RGB: 1" in out
