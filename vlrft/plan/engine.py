"""The rollout engine's memory: the hf engine's KV cache, weights and prefill, or vLLM/SGLang's share of the GPU."""

from __future__ import annotations

from vlrft.plan.activations import per_token_layer_bytes
from vlrft.plan.architecture import ModelShape
from vlrft.plan.memory_plan import GiB, Component, Hardware, StrategyChoice
from vlrft.sampling import PREFILL_TOKENS, hf_decoder, shares_prompt  # the hf decoder's, not copies


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    return 2 * shape.text.num_layers * shape.text.kv_dim * dtype_bytes


GENERATE_SCORE_COPIES = 4  # float32 [rows, vocabulary] tensors alive in a `generate` step (see engine_components)


def generate_scores_bytes(shape: ModelShape, rows: int) -> int:
    """The score tensors of one `generate` sampling step over `rows` rows."""
    return GENERATE_SCORE_COPIES * rows * shape.text.vocab_size * 4


def hf_engine_weights(params: int, s: StrategyChoice) -> tuple[int, str]:
    """(bytes, note) the hf engine holds beside the trainer's state while it samples: the policy's whole weights
    where they are sharded (gathered for every `generate` call), and their copy in the compute dtype where the
    weights are float32 under bf16 autocast (the lean decoder's concatenated casts, or autocast's cast cache)."""
    cast = 2 * params if s.mixed_precision else 0
    if s.name == "fsdp2":  # every unit gathered, in FSDP2's parameter dtype: bf16 with mixed precision, no copy
        gathered = (2 if s.mixed_precision else 4) * params
        return gathered, "hf engine: the policy gathered whole for generation (FSDP2 parameter dtype)"
    if s.name == "deepspeed" and s.zero_stage >= 3:
        return 4 * params + cast, ("hf engine: the policy gathered whole for generation (float32)"
                                   + (" and cast to bf16 under autocast" if cast else ""))
    return cast, "hf engine: bf16 copy of the float32 weights, made under autocast for each generate call"


def hf_kv_cache(cfg, shape: ModelShape, hi: int, prompts: int, seq_len: int) -> tuple[str, Component]:
    """The hf engine's decoder for this family and the KV cache it holds for the rank's `prompts` x rollout.n rows."""
    m, r, d = cfg.model, cfg.rollout, cfg.data
    rows = prompts * r.n
    # How the engine samples this family (vlrft.sampling.hf_decoder, which the engine reads too): the lean group
    # decoder (SDPA/eager attention; Qwen2/2.5/3-VL, and InternVL 3, LLaVA-OneVision, SmolVLM at 1-D positions;
    # plain LoRA it reads), the group decoder through transformers' layers (GLM-4.1V, Qwen3-VL-MoE, Gemma 3), or
    # transformers' `generate` (a family the group decoder does not list). Gemma 3's sliding-window layers keep
    # their window only; the figure counts every layer in full (an upper bound).
    decoder = hf_decoder(shape.model_type, r.lean_decode, m.attn_implementation)
    lean = decoder == "lean"
    # Under bf16 autocast over float32 weights the lean decode step keeps its KV cache in bf16; transformers'
    # layers (and `generate`) keep the keys in float32 (rotated by the float32 residual stream's cos/sin) and the
    # values in bf16.
    if hi == 2:
        kv_dtype = ("bf16", 2, 2) if lean else ("float32-key, bf16-value", 4, 2)
    else:
        kv_dtype = ("float32", 4, 4)
    per_token = shape.text.num_layers * shape.text.kv_dim * (kv_dtype[1] + kv_dtype[2])
    # each prompt held once for its group; with tools, turns after the first decode each row alone (n = 1)
    if lean and shares_prompt(r.n, d.max_prompt_length) and not r.tools:
        kv = (prompts * d.max_prompt_length + rows * r.tokens_after_prompt) * per_token
        what = (f"the rank's {prompts} prompts x {d.max_prompt_length} tokens once, {rows} rollouts x "
                f"{r.tokens_after_prompt} tokens each")
    else:
        kv = rows * seq_len * per_token
        what = f"the rank's {rows} rollouts x {seq_len} tokens, each row its own prompt"
    how = {"lean": "lean group decoder", "transformers_layers": "group decoder through transformers' layers",
           "generate": "transformers' generate"}[decoder]
    note = f"hf engine ({how}): {kv_dtype[0]} KV cache of {what}"
    return decoder, Component("engine_kv_cache", kv, ("rollout",), note)


def engine_components(cfg, shape: ModelShape, hardware: Hardware, strategy: StrategyChoice, hi: int, patches: int,
                      seq_len: int) -> tuple[list[Component], int | None, int | None]:
    """The rollout engine's memory (its KV cache, weights, prefill), and for vLLM/SGLang the KV bytes it has and
    needs for one sequence (None for the hf engine). `hi`: bytes of the compute dtype; `patches`: vision patches per
    prompt; `seq_len`: a trajectory's tokens."""
    m, r, d = cfg.model, cfg.rollout, cfg.data
    world, params = hardware.world_size, shape.num_parameters
    rollout, train = ("rollout",), ("train",)
    kv_avail = kv_needed = None
    comps: list[Component] = []
    if r.engine == "hf":
        prompts = cfg.prompts_per_step // world
        rows = prompts * r.n
        decoder, kv_cache = hf_kv_cache(cfg, shape, hi, prompts, seq_len)
        comps.append(kv_cache)
        whole, note = hf_engine_weights(params, strategy)
        if whole:
            comps.append(Component("engine_weights", whole, rollout, note))
        text_layer, vision_layer = per_token_layer_bytes(shape, hi)
        if decoder == "generate":
            # `generate` gets all the rank's prompts in one call (max_batch_prompts), encodes their images once, then
            # repeats every prompt n times and prefills the rows together: a layer's activations of every row's
            # prompt; its first logits are of the last position only (logits_to_keep=1), and each step keeps a few
            # [rows, vocabulary] float32 score tensors (logits, processed scores, the recorder's log-softmax, probs)
            prefill = max(rows * d.max_prompt_length * text_layer, prompts * patches * vision_layer)
            comps.append(Component("engine_prefill", prefill, rollout,
                                   f"hf engine (transformers' generate): the prefill of the rank's {prompts} prompts "
                                   f"repeated {r.n} times ({rows} rows of {d.max_prompt_length} tokens at once), a "
                                   "layer at a time"))
            comps.append(Component("engine_scores", generate_scores_bytes(shape, rows), rollout,
                                   f"hf engine (transformers' generate): {GENERATE_SCORE_COPIES} float32 score "
                                   f"tensors of {rows} rows x {shape.text.vocab_size} vocabulary per step"))
        else:
            # the prefill of the rank's prompts, PREFILL_TOKENS at a time: one layer's activations at a time, of the
            # vision tower's patches or of the text layers' tokens
            at_once = max(1, min(prompts, PREFILL_TOKENS // max(1, d.max_prompt_length)))  # prompts per prefill call
            prefill = at_once * max(d.max_prompt_length * text_layer, patches * vision_layer)
            comps.append(Component("engine_prefill", prefill, rollout,
                                   f"hf engine: the prefill of {at_once} of the rank's {prompts} prompts at once "
                                   f"(rollout prefills {PREFILL_TOKENS} tokens at a time), a layer at a time"))
    elif r.engine == "vllm_server":
        pass  # the servers have GPUs of their own: these GPUs hold the training side only
    else:
        budget = int(r.gpu_memory_utilization * hardware.gpu_memory)
        engine_bytes = 4 if m.dtype == "float32" else 2  # the engine is given model.dtype (weights and KV cache)
        weights = engine_bytes * params // r.tensor_parallel_size
        kv_avail = budget - weights - 1 * GiB  # vLLM keeps about 1 GiB for its own activations
        max_len = r.engine_max_len(d.max_prompt_length)
        kv_needed = max_len * kv_bytes_per_token(shape, engine_bytes) // r.tensor_parallel_size
        comps.append(Component("engine_weights", weights, rollout,
                               f"{r.engine}: {m.dtype} weights / tensor_parallel_size {r.tensor_parallel_size}"))
        comps.append(Component("engine_kv_cache", budget - weights, rollout,
                               f"{r.engine}: the rest of gpu_memory_utilization={r.gpu_memory_utilization} "
                               "(KV cache and engine activations)"))
        if not r.sleep_between_steps:
            comps.append(Component("engine_awake_in_training", budget, train,
                                   "rollout.sleep_between_steps=false: the engine keeps its memory while training"))
    return comps, kv_avail, kv_needed

