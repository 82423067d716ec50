"""Load images and videos from the references a dataset holds, refusing what would hurt training.

Image references: a path, `file://` URL, raw bytes, `data:` base64 URI, PIL image, numpy HxWx3
array, `{"image": ...}`, `{"url": ...}` or Hugging Face's `{"bytes": ..., "path": ...}`. Images
are converted to RGB (transparency over white, so line drawings stay visible), EXIF-rotated and
checked against decompression bombs and absurd aspect ratios before their pixels are decoded.
`fit_image` resizes to the bounds of a patch-based processor so the processor's own resize is a
no-op and every rollout engine sees exactly the pixels training sees.

Videos: a file (decoded with PyAV through transformers' `load_video`, sampled at an fps with a
frame cap) or a list of frame references.
"""

from __future__ import annotations

import base64
import binascii
import io
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

_EXIF_ORIENTATION = 0x0112
# `warnings.catch_warnings` edits process-wide filters and restores them on exit; two threads inside it at once
# (the media check runs in a thread pool) restore each other's filters and turn a warning into an error at random.
# The only filter this module ever edits is taken under this lock, around `Image.open` alone (the header read;
# decoding runs outside it, in parallel).
_WARNING_FILTERS = threading.Lock()


class MediaError(Exception):
    """A media reference that cannot be used; the message says why (the caller adds sample and field)."""


@dataclass(frozen=True)
class MediaLimits:
    """Refusal thresholds checked before decoding."""

    max_source_pixels: int = 89_478_485  # PIL's default decompression-bomb threshold (width * height)
    max_aspect_ratio: float = 200.0  # Qwen-VL's smart_resize refuses anything longer than 200:1


@dataclass(frozen=True)
class PixelBounds:
    """Target size rule: sides multiples of `factor` (patch_size * merge_size), area in [min, max] pixels."""

    factor: int
    min_pixels: int
    max_pixels: int


def _describe(ref: Any) -> str:
    if isinstance(ref, (bytes, bytearray)):
        return f"<{len(ref)} bytes>"
    if isinstance(ref, Image.Image):  # its file when opened from one; its repr would show a memory address
        return _describe(ref.filename) if isinstance(getattr(ref, "filename", None), str) and ref.filename \
            else f"({ref.mode} PIL image)"
    text = str(ref)
    return text if len(text) <= 80 else text[:60] + "..."


def local_path(ref: str) -> Path:
    """The filesystem path of a plain path or `file://` URL."""
    if ref.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(ref).path))
    return Path(ref).expanduser()


def open_image_source(ref: Any) -> Image.Image:
    """Open (lazily: header only) the image a reference points to."""
    if isinstance(ref, Image.Image):
        return ref
    if isinstance(ref, np.ndarray):
        if ref.ndim not in (2, 3) or ref.dtype != np.uint8:
            raise MediaError(f"a numpy image must be uint8 HxW or HxWxC, got {ref.dtype} of shape {ref.shape}")
        return Image.fromarray(ref)
    if isinstance(ref, dict):
        for key in ("image", "url", "bytes", "path"):
            if ref.get(key) is not None:
                return open_image_source(ref[key])
        raise MediaError(f"an image dict needs an 'image', 'url', 'bytes' or 'path' entry, got keys {sorted(ref)}")
    if isinstance(ref, (bytes, bytearray, memoryview)):
        return _open_bytes(bytes(ref), "image bytes")
    if isinstance(ref, Path):
        ref = str(ref)
    if not isinstance(ref, str):
        raise MediaError(f"unsupported image reference of type {type(ref).__name__}; use a path, bytes, "
                         "a data URI or a PIL image")
    if ref.startswith("data:"):
        header, _, payload = ref.partition(",")
        if ";base64" not in header:
            raise MediaError("a data URI image must be base64 encoded (data:image/png;base64,...)")
        try:
            return _open_bytes(base64.b64decode(payload, validate=True), "data URI")
        except binascii.Error as exc:
            raise MediaError(f"the data URI is not valid base64 ({exc})") from None
    if ref.startswith(("http://", "https://")):
        raise MediaError(f"remote image '{_describe(ref)}' is not downloaded during training; download the images "
                         "and reference local files")
    path = local_path(ref)
    if not path.is_file():
        raise MediaError(not_a_file_reason(path, "image"))
    return _pil_open(path, f"'{path}' is not an image file PIL can read")


def not_a_file_reason(path: Path, kind: str) -> str:
    """Why the `kind` ("image"/"video") path `path` cannot be read as a file: a folder, something else, or missing."""
    if path.is_dir():
        frames = ", or give the video's frames as a list of image files" if kind == "video" else ""
        return f"{kind} path '{path}' is a directory, not a file; reference one {kind} file in it{frames}"
    if path.exists():
        return f"{kind} path '{path}' is not a regular file (a device, socket or pipe); reference a {kind} file"
    return (f"{kind} file not found: '{path}' (relative paths resolve against data.image_root, or the data file's "
            "folder when it is unset)")


def _open_bytes(data: bytes, what: str) -> Image.Image:
    return _pil_open(io.BytesIO(data), f"the {what} ({len(data)} bytes) are not an image PIL can read")


def _pil_open(source: Any, unreadable: str) -> Image.Image:
    """`Image.open` (header only) with PIL's errors turned into `MediaError`; size limits are ours to check."""
    try:
        with _WARNING_FILTERS, warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(source)
    except Image.DecompressionBombError as exc:  # over twice PIL's limit: refused while reading the header
        raise MediaError(f"refused as a decompression bomb: {exc}") from None
    except UnidentifiedImageError:
        raise MediaError(unreadable) from None
    except OSError as exc:
        raise MediaError(f"cannot read image: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any decoder error on a hostile file is this file's problem
        raise MediaError(_decoder_error("cannot read image", exc)) from None


def _decoder_error(what: str, exc: BaseException) -> str:
    """One line for an error a decoder raised on a file, e.g. Pillow's ValueError for a PNG whose ICC profile
    inflates past its limit ('Decompressed data too large'), a struct.error, or an IndexError on a hostile header."""
    text = " ".join(str(exc).split())[:200]
    return f"{what}: {type(exc).__name__}: {text}" if text else f"{what}: {type(exc).__name__}"


_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
_HIGH_DEPTH = (*_SIXTEEN_BIT, "I", "F")


def scale_to_8bit(values: np.ndarray, mode: str) -> np.ndarray:
    """Map a 16/32-bit integer or float single-channel image onto 0..255 (PIL's convert would clip it).

    16-bit modes use their full range (65535 -> 255). Mode "I" (32-bit int) and "F" (float) carry no
    range of their own, so it is read from the values: [0, 1] floats and [0, 255] values are taken as
    they are, [0, 65535] integers as 16-bit, anything else is stretched min..max. NaN/inf become 0.
    """
    x = values.astype(np.float64)
    x[~np.isfinite(x)] = 0.0
    lo, hi = float(x.min()), float(x.max())
    if mode in _SIXTEEN_BIT:
        scaled = x / 257.0
    elif mode == "F" and lo >= 0 and hi <= 1:
        scaled = x * 255.0
    elif lo >= 0 and hi <= 255:
        scaled = x
    elif mode == "I" and lo >= 0 and hi <= 65535:
        scaled = x / 257.0
    else:
        scaled = (x - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(x)
    return np.clip(np.rint(scaled), 0, 255).astype(np.uint8)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB pixels of any PIL mode: high bit depths scaled (not clipped), transparency composited over white.

    Palette, 1-bit, CMYK, YCbCr, LAB and HSV images go through PIL's own conversions, which are right for them.
    """
    if image.mode in _HIGH_DEPTH:
        image = Image.fromarray(scale_to_8bit(np.asarray(image), image.mode))
    elif image.mode == "La":  # premultiplied alpha: PIL converts it only to LA
        image = image.convert("LA")
    if image.mode in ("RGBA", "RGBa", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image if image.mode == "RGB" else image.convert("RGB")


def _check_size(ref: Any, width: int, height: int, limits: MediaLimits) -> None:
    if width < 1 or height < 1:
        raise MediaError(f"image {_describe(ref)} has an empty size {width}x{height}")
    if width * height > limits.max_source_pixels:
        raise MediaError(f"image {_describe(ref)} is {width}x{height} = {width * height} pixels, over the "
                         f"{limits.max_source_pixels}-pixel limit (a decompression bomb or a huge scan); downscale it "
                         "or raise data.max_source_pixels")
    ratio = max(width, height) / min(width, height)
    if ratio > limits.max_aspect_ratio:
        raise MediaError(f"image {_describe(ref)} is {width}x{height}, an aspect ratio of {ratio:.0f}:1 over the "
                         f"limit {limits.max_aspect_ratio:g}:1; crop or pad it")


def load_image(ref: Any, limits: MediaLimits = MediaLimits()) -> Image.Image:
    """Decode an image reference to an RGB PIL image; raises `MediaError` saying why it cannot.

    Every error Pillow raises on the file (opening, decoding, reading its EXIF, converting) becomes a `MediaError`:
    its callers name the sample and field and turn it into one line, never a traceback."""
    source = open_image_source(ref)
    width, height = source.size
    _check_size(ref, width, height, limits)
    try:
        source.load()
    # The warning only where the process made warnings errors (e.g. `python -W error`); PIL warns while decoding TIFF.
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise MediaError(f"image {_describe(ref)} was refused as a decompression bomb ({exc})") from None
    except OSError as exc:
        raise MediaError(f"image {_describe(ref)} is truncated or corrupt ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - a decoder error on a hostile file is this file's problem
        raise MediaError(_decoder_error(f"image {_describe(ref)} cannot be decoded", exc)) from None
    if source.size != (width, height):  # formats whose size can change on load
        _check_size(ref, *source.size, limits)
    try:
        if source.getexif().get(_EXIF_ORIENTATION, 1) != 1:
            source = ImageOps.exif_transpose(source)
        return to_rgb(source)
    except Exception as exc:  # noqa: BLE001 - a malformed EXIF block or an unconvertible mode
        raise MediaError(_decoder_error(f"image {_describe(ref)} cannot be converted to RGB", exc)) from None


def target_size(width: int, height: int, bounds: PixelBounds) -> tuple[int, int]:
    """(width, height) after Qwen-VL's smart resize: sides multiples of the factor, area within bounds."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize  # no torchvision needed

    h, w = smart_resize(height, width, factor=bounds.factor, min_pixels=bounds.min_pixels,
                        max_pixels=bounds.max_pixels)
    return w, h


def fit_image(image: Image.Image, bounds: PixelBounds | None) -> Image.Image:
    """Resize (bicubic) to `bounds`; returns `image` itself when it already fits. A size the resize rule refuses
    (Qwen-VL's smart_resize raises ValueError) is a `MediaError`."""
    if bounds is None:
        return image
    try:
        size = target_size(*image.size, bounds)
    except ValueError as exc:
        raise MediaError(_decoder_error(f"image of size {image.size[0]}x{image.size[1]} cannot be resized", exc)) \
            from None
    return image if size == image.size else image.resize(size, Image.Resampling.BICUBIC)


# ---------------------------------------------------------------------------------------------- video


@dataclass
class LoadedVideo:
    """Sampled RGB frames `[T, H, W, 3]` uint8 and the metadata processors need (source fps, frame indices)."""

    frames: np.ndarray
    metadata: Any  # transformers.video_utils.VideoMetadata

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])


def frame_indices(total: int, source_fps: float, fps: float, max_frames: int, frame_factor: int = 1) -> np.ndarray:
    """Indices of `fps` frames per second, at most `max_frames`, a multiple of `frame_factor` when possible."""
    wanted = int(total / source_fps * fps) if source_fps > 0 else max_frames
    n = min(max(wanted, frame_factor, 1), max_frames, total)
    if n >= frame_factor:
        n -= n % frame_factor
    return np.linspace(0, total - 1, n).round().astype(int)


def uniform_frames(video: LoadedVideo, count: int) -> LoadedVideo:
    """`video` as exactly `count` frames spread evenly over its sampled ones (a shorter video repeats frames), as
    LLaVA-OneVision's own frame sampling does; the metadata keeps the source frame index of each."""
    from dataclasses import replace as replace_fields

    keep = np.linspace(0, video.num_frames - 1, count).round().astype(int)
    indices = list(getattr(video.metadata, "frames_indices", None) or range(video.num_frames))
    return LoadedVideo(video.frames[keep], replace_fields(video.metadata, frames_indices=[indices[i] for i in keep]))


def check_video_file(path: Path, limits: MediaLimits = MediaLimits()) -> None:
    """Raise `MediaError` unless `path` opens as a video with a frame count whose first frame decodes within
    `limits`: what `load_video` needs, found at start without decoding the whole file."""
    try:
        import av
    except ImportError:
        raise MediaError("decoding video files needs PyAV; install it with: pip install 'vlrft[video]'") from None
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise MediaError(f"'{path}' has no video stream")
            stream = container.streams.video[0]
            if not stream.frames:
                raise MediaError(f"'{path}' reports no frame count; re-encode it (e.g. ffmpeg -i in.webm out.mp4)")
            frame = next(container.decode(stream), None)
    except MediaError:
        raise
    except Exception as exc:  # PyAV raises its own error types for corrupt or unsupported files
        raise MediaError(f"cannot decode video '{path}': {type(exc).__name__}: {exc}") from None
    if frame is None:
        raise MediaError(f"cannot decode video '{path}': no frame decodes")
    if frame.width * frame.height > limits.max_source_pixels:
        raise MediaError(f"video '{path}' frames are {frame.width}x{frame.height}, over the "
                         f"{limits.max_source_pixels}-pixel limit")


def load_video(ref: Any, fps: float, max_frames: int, frame_factor: int = 1, bounds: PixelBounds | None = None,
               limits: MediaLimits = MediaLimits()) -> LoadedVideo:
    """Decode a video file (PyAV) or a list of frame references, sample frames and fit them to `bounds`."""
    from transformers.video_utils import VideoMetadata

    if isinstance(ref, (list, tuple)):
        if not ref:
            raise MediaError("a video given as frames needs at least one frame")
        images = [load_image(frame, limits) for frame in ref]
        sizes = {im.size for im in images}
        if len(sizes) > 1:
            raise MediaError(f"the video's frames differ in size ({sorted(sizes)}); all frames must have one size")
        keep = frame_indices(len(images), fps, fps, max_frames, frame_factor)  # frames are taken as sampled at fps
        frames = np.stack([np.asarray(fit_image(images[i], bounds)) for i in keep])
        metadata = VideoMetadata(total_num_frames=len(images), fps=float(fps), frames_indices=keep.tolist(),
                                 width=frames.shape[2], height=frames.shape[1])
        return LoadedVideo(frames, metadata)
    if isinstance(ref, dict) and ref.get("video") is not None:
        return load_video(ref["video"], fps, max_frames, frame_factor, bounds, limits)
    if isinstance(ref, Path):
        ref = str(ref)
    if not isinstance(ref, str):
        raise MediaError(f"unsupported video reference of type {type(ref).__name__}; use a file path or a list of frames")
    if ref.startswith(("http://", "https://")):
        raise MediaError(f"remote video '{_describe(ref)}' is not downloaded during training; reference a local file")
    path = local_path(ref)
    if not path.is_file():
        raise MediaError(not_a_file_reason(path, "video"))
    try:
        import av  # noqa: F401  (PyAV decodes the file; it is in the [video] extra)
    except ImportError:
        raise MediaError("decoding video files needs PyAV; install it with: pip install 'vlrft[video]'") from None
    from transformers.video_utils import load_video as hf_load_video

    def sample(metadata, **_):
        if metadata.total_num_frames <= 0:
            raise MediaError(f"'{path}' reports no frame count; re-encode it (e.g. ffmpeg -i in.webm out.mp4)")
        return frame_indices(metadata.total_num_frames, metadata.fps or 0.0, fps, max_frames, frame_factor)

    try:
        frames, metadata = hf_load_video(str(path), backend="pyav", sample_indices_fn=sample)
    except MediaError:
        raise
    except Exception as exc:  # PyAV raises its own error types for corrupt or unsupported files
        raise MediaError(f"cannot decode video '{path}': {type(exc).__name__}: {exc}") from None
    height, width = frames.shape[1:3]
    if width * height > limits.max_source_pixels:
        raise MediaError(f"video '{path}' frames are {width}x{height}, over the {limits.max_source_pixels}-pixel limit")
    if bounds is not None and target_size(width, height, bounds) != (width, height):
        frames = np.stack([np.asarray(fit_image(Image.fromarray(f), bounds)) for f in frames])
    if isinstance(metadata.frames_indices, np.ndarray):
        metadata.frames_indices = metadata.frames_indices.tolist()
    metadata.width, metadata.height = frames.shape[2], frames.shape[1]
    return LoadedVideo(frames, metadata)


def encode_image_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    """PNG (or `fmt`) bytes of a PIL image, e.g. to write converted datasets."""
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()
