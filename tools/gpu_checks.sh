#!/usr/bin/env bash
# Every check that needs a GPU, in one prepared run with a time limit each (a lent GPU machine has minutes, not
# hours): about 9 minutes on one H100 with a 0.5B model (BUDGET=540 keeps it there). Run from the repository root:
#
#     bash tools/gpu_checks.sh              # logs under $OUT (default runs/gpu_checks)
#     OUT=/tmp/out SIZE=1.5b EAGER=1 BUDGET=500 bash tools/gpu_checks.sh   # a larger model; eager decoding too; 500 s in all
#
# In this order (the newest and most needed first, so that a BUDGET cuts the oldest): 1. imports and the GPU, then
# `vlrft env`; 2. the CUDA tests (CUDA-graph decoding, also under bf16 autocast and with shared prompts; the tower's
# batched attention; no autocast weight copies held by a checkpointed forward; the engine GPU tests skip without
# vLLM/SGLang); 3. training MFU, rollout tokens/s and peak memory
# beside the plan for a random Qwen2.5-VL of $SIZE (default 0.5b), one process (tools/gpu_bench.py); 4. FSDP2
# cpu_offload's weight sync gathering on the GPU, and the reward model's offload; 5. decode rates with ~1.4k-token
# prompts, each prompt's KV cache held once per group vs copied per row; 6. the vision tower's attention per segment
# vs per segment length (bench/bench_vision_attention.py); 7. the hf engine's decode rates on a 0.5B-shaped random
# model, float32 weights under bf16 autocast as the trainer samples (bench/bench_decode.py); 8. the training bench
# under FSDP2 on one GPU (NCCL, weight sync to the engine); 9. with EAGER=1 the training bench again with
# rollout.cuda_graph_decode=false (eager decode steps). A step that fails or runs out of time is reported and the next
# one runs; with BUDGET (seconds) a step gets at most the time left, and is skipped under 20 s.
# CHECKS="cuda_tests train_bench ..." runs only the steps it names, in this order; MICRO_BATCH sets the training
# benches' micro-batch (default 4); TRAIN_SECONDS the training bench's limit (default 200; a 3b model needs more).
set -u
OUT=${OUT:-runs/gpu_checks}
STEPS=${STEPS:-3}
SIZE=${SIZE:-0.5b}
BUDGET=${BUDGET:-0}
CHECKS=${CHECKS:-}
MICRO_BATCH=${MICRO_BATCH:-4}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME SECONDS COMMAND...: run it, keep its log, print its exit status and last lines
    local name=$1 seconds=$2
    shift 2
    if [ -n "$CHECKS" ] && [[ " $CHECKS " != *" $name "* ]]; then
        return
    fi
    if [ "$BUDGET" -gt 0 ] && [ $((SECONDS + seconds)) -gt "$BUDGET" ]; then
        seconds=$((BUDGET - SECONDS))
        if [ "$seconds" -lt 20 ]; then
            echo "== $name: skipped (${seconds} s of BUDGET=$BUDGET left)"
            return
        fi
    fi
    local start=$SECONDS
    timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc ($((SECONDS - start)) s)$([ $rc = 124 ] && echo ', timed out')"
    tail -n 25 "$OUT/$name.log"
}

step environment 45 "$PYTHON" -c '
import importlib.util, torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
missing = [m for m in ("vlrft", "yaml", "safetensors", "tokenizers", "PIL", "tensorboard", "pytest")
           if importlib.util.find_spec(m) is None]
print("missing modules:", missing or "none")
import vlrft.trainer  # the package imports with this machine torch and transformers
'
step stack 45 "$PYTHON" -m vlrft env  # versions, GPUs, NCCL, and any requirement the installed versions break
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "no CUDA device visible: nothing more to check here"
    exit 1
fi
step cuda_tests 120 "$PYTHON" -m pytest -m "" -q -x -p no:cacheprovider tests/test_rollout_lean_decode.py \
    tests/test_rollout_engines_gpu.py tests/test_vision_attention.py tests/test_actor.py -k "cuda or gpu"
step train_bench "${TRAIN_SECONDS:-200}" "$PYTHON" tools/gpu_bench.py --size "$SIZE" --strategies single --steps "$STEPS" \
    --micro-batch "$MICRO_BATCH" --out "$OUT/bench" --json "$OUT/gpu_bench.json"
step offload_sync 100 "$PYTHON" -m pytest -m "" -q -x -p no:cacheprovider \
    tests/test_fsdp2.py::test_an_offloaded_fsdp2_policy_is_gathered_on_the_gpu_for_weight_sync \
    tests/test_rewards_model.py::test_on_a_gpu_the_reward_model_takes_memory_only_while_it_scores
step long_prompt_decode 100 "$PYTHON" bench/bench_decode.py --device cuda --autocast bfloat16 --hidden 896 \
    --layers 24 --tokens 128 --regimes 1 --repeats 2 --prompt-repeat 80  # ~1.4k-token prompts: shared vs per row
step vision_attention 90 "$PYTHON" bench/bench_vision_attention.py --device cuda --dtype bfloat16 --width 1280 \
    --depth 32 --images 8 --repeats 5
step decode_rates 120 "$PYTHON" bench/bench_decode.py --device cuda --autocast bfloat16 --hidden 896 --layers 24 \
    --tokens 128 --regimes 1,3 --repeats 2  # 3 repeats of both regimes took over 120 s on an H100
step fsdp2_bench 150 "$PYTHON" tools/gpu_bench.py --size "$SIZE" --strategies fsdp2 --gpus 1 --steps "$STEPS" \
    --micro-batch "$MICRO_BATCH" --out "$OUT/bench" --json "$OUT/gpu_bench_fsdp2.json"  # FSDP2 over NCCL (one rank), weight sync to the engine
if [ "${EAGER:-0}" = 1 ]; then
    step train_bench_eager 150 "$PYTHON" tools/gpu_bench.py --size "$SIZE" --strategies single --steps "$STEPS" \
        --micro-batch "$MICRO_BATCH" --eager-decode --out "$OUT/bench" --json "$OUT/gpu_bench_eager.json"
fi
