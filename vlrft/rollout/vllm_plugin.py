"""vlrft's vLLM plugin: the `vllm.general_plugins` entry point (setup.py), which vLLM loads in each of its processes.

It registers what a vLLM server started for vlrft (`vlrft serve-command`) needs: vlrft's weight-transfer engines
("vlrft_shm", "vlrft_gloo": `vlrft.rollout.weight_transfer`) and the video loader "vlrft_frames", which reads a video
as the frames and metadata vlrft's processor sampled (`vlrft.rollout.video_frames`). Training processes never import
this module.
"""

from __future__ import annotations

from vlrft.rollout.video_frames import VIDEO_BACKEND, NotFramesPayload, decode_frames


def register() -> None:
    """Register everything, once per process (vLLM may load plugins more than once in one)."""
    from vlrft.rollout.weight_transfer import register as register_weight_transfer

    register_weight_transfer()
    register_video_loader()


def register_video_loader() -> None:
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY, VideoLoader

    if VIDEO_BACKEND in VIDEO_LOADER_REGISTRY.name2class:
        return

    class VlrftFramesLoader(VideoLoader):
        """vlrft's payload as sent (`decode_frames`); any other bytes through vLLM's default loader (opencv)."""

        @classmethod
        def load_bytes(cls, data: bytes, **kwargs):
            try:
                return decode_frames(data)
            except NotFramesPayload:
                return VIDEO_LOADER_REGISTRY.load("opencv").load_bytes(data, **kwargs)

    VIDEO_LOADER_REGISTRY.register(VIDEO_BACKEND)(VlrftFramesLoader)
