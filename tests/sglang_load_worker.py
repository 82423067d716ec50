"""Run where SGLang is installed: SGLang's own model classes load what vlrft's weight sync sends them.

`python tests/sglang_load_worker.py OUT MODEL_DIR...`: for each tiny model folder, builds the model class SGLang
picks for it, on CPU (SGLang's `ServerArgs` published as the process config, its model-parallel state over a
one-process gloo group), sets every parameter to NaN, then streams vlrft's `PolicyWeights` buckets through the
model's own `load_weights`, where `SGLangEngine`'s `update_weights_from_tensor` ends on a GPU; once for the plain
policy and once for a LoRA-wrapped one (merged on the way). OUT gets, per folder and variant: the parameters SGLang
has, those written, those still holding a NaN, and the sums of what was sent and of what SGLang holds. SGLang's
Qwen-VL `load_weights` return None (vLLM's return the names they loaded): "loaded" is then the parameters that no
longer hold only NaN, i.e. that at least one sent tensor was written into; one written only in part is in "loaded"
and in "still_nan". A separate process: SGLang's process group and published config must not leak into the other
tests.
"""

import importlib.util
import json
import sys
import types

import torch
from _weight_load import fill_with_nan, free_port, policy_buckets, report


def placeholder_for_missing_kernels() -> None:
    """On a machine without a GPU, SGLang's `RotaryEmbedding` (built by every Qwen-VL attention layer) finds no
    platform it has a rotary kernel for, and imports vLLM's `vllm._custom_ops.rotary_embedding` when it is built; it
    runs it only in forward, which nothing here calls. SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`) would skip that
    import, but needs sgl_kernel's CPU build, which the registry's CUDA wheel is not. Where vLLM is not installed, a
    placeholder module whose `rotary_embedding` refuses to run is put in its place."""
    if importlib.util.find_spec("vllm") is not None:
        return

    def refuse(*args, **kwargs):
        raise RuntimeError("placeholder for vLLM's rotary_embedding kernel (tests/sglang_load_worker.py): not a kernel")

    custom_ops = types.ModuleType("vllm._custom_ops")
    custom_ops.rotary_embedding = refuse
    package = types.ModuleType("vllm")
    package.__path__ = []
    package._custom_ops = custom_ops
    sys.modules.update({"vllm": package, "vllm._custom_ops": custom_ops})


def load_into_sglang(model_dir: str, lora: bool) -> dict:
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import (init_distributed_environment, initialize_model_parallel,
                                                       model_parallel_is_initialized)
    from sglang.srt.model_loader import get_model
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    from vlrft.rollout.sglang import config_overrides

    # What `SGLangEngine` passes too (Qwen2-VL folders saved by transformers 5 lack the `in_chans` SGLang reads).
    server_args = ServerArgs(model_path=model_dir, device="cpu", dtype="float32",
                             json_model_override_args=json.dumps(config_overrides(model_dir)))
    # As SGLang's scheduler process does before it builds its ModelRunner; a later publish replaces the config and
    # keeps the process groups below.
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    if not model_parallel_is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        initialize_model_parallel(backend="gloo")  # the widths (all 1) come from the published config
    engine_model = get_model(model_config=ModelConfig.from_server_args(server_args),
                             load_config=LoadConfig(load_format="dummy"), device_config=DeviceConfig("cpu"))
    fill_with_nan(engine_model)
    base_sum, sent = policy_buckets(model_dir, lora)
    return report(engine_model, engine_model.load_weights(iter(sent)), base_sum, sent)


def main() -> None:
    out, model_dirs = sys.argv[1], sys.argv[2:]
    placeholder_for_missing_kernels()
    results = {f"{d}|{'lora' if lora else 'full'}": load_into_sglang(d, lora) for d in model_dirs for lora in (False, True)}
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
