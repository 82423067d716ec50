"""A video as the frames our processor sampled, with their metadata, in one lossless payload for vLLM's server.

vLLM's server reads a video from a URL or bytes with a video loader of its registry, which samples frames itself
and gives them metadata of its own; its "video/jpeg" frame sequence takes the frame rate and frame indices of the
server's `--media-io-kwargs`, one for every request. Qwen2.5-VL's positions follow each video's sampled frame rate
(`second_per_grid_ts`), so neither can carry one tokenization. vlrft's vLLM plugin (`vlrft.rollout.vllm_plugin`)
registers a loader, `vlrft_frames`, which reads this payload: the frames and the metadata our processor used
(source frame count and rate, the indices taken), exactly what the colocated engine hands vLLM as a `(frames,
metadata)` video. A server started with `--media-io-kwargs '{"video": {"video_backend": "vlrft_frames"}}'`
(`vlrft serve-command`) reads any other video bytes with vLLM's default loader.

The payload is a compressed `.npz` (numpy, no pickle): `frames` [T, H, W, 3] uint8 and `metadata` (JSON).
Nothing here imports vLLM.
"""

from __future__ import annotations

import base64
import io
import json
import zipfile
from typing import Any

import numpy as np

VIDEO_BACKEND = "vlrft_frames"
MEDIA_TYPE = "video/x-vlrft-frames"


class NotFramesPayload(ValueError):
    """Bytes that are no `encode_frames` payload (another client's video file)."""


def encode_frames(frames: np.ndarray, metadata: dict[str, Any]) -> bytes:
    """`frames` [T, H, W, 3] uint8 and their metadata (`vlrft.rollout.requests.video_metadata_dict`) as one payload."""
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"video frames must be [T, H, W, 3] uint8, got {frames.dtype} {list(frames.shape)}")
    buffer = io.BytesIO()
    np.savez_compressed(buffer, frames=frames, metadata=np.array(json.dumps(metadata)))
    return buffer.getvalue()


def decode_frames(data: bytes) -> tuple[np.ndarray, dict[str, Any]]:
    """The frames and metadata of an `encode_frames` payload, as vLLM's video loaders return them: the metadata
    says the frames are sampled already (`do_sample_frames`: False), as the colocated engine's request does."""
    if not data.startswith(b"PK\x03\x04"):  # an .npz is a zip archive
        raise NotFramesPayload(f"not a {VIDEO_BACKEND} payload (no zip archive)")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as payload:
            frames, metadata = payload["frames"], json.loads(str(payload["metadata"]))
    except (zipfile.BadZipFile, ValueError, KeyError, OSError, EOFError) as exc:
        raise NotFramesPayload(f"not a {VIDEO_BACKEND} payload: {exc}") from None
    metadata.setdefault("video_backend", VIDEO_BACKEND)
    metadata["do_sample_frames"] = False
    return frames, metadata


def frames_data_url(frames: np.ndarray, metadata: dict[str, Any]) -> str:
    """A video as the data URL a `vlrft_frames` server reads."""
    return f"data:{MEDIA_TYPE};base64," + base64.b64encode(encode_frames(frames, metadata)).decode("ascii")
