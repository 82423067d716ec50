"""The memory plan: exact parameter counts from config.json, per-GPU bytes by strategy, the `vlrft plan` command."""

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from vlrft.config import load_config
from vlrft.errors import UserError
from vlrft.plan import (GiB, Hardware, StrategyChoice, check_fits, check_fits_at_load, host_memory_warning,
                        load_model_shape, node_memory_bytes, plan_memory, shape_from_config)
from vlrft.plan.architecture import shipped_config_path

REPO = Path(__file__).resolve().parents[1]
CONFIG_7B = REPO / "configs" / "qwen2_5_vl_7b_grpo_geometry3k.yaml"


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "gemma3", "internvl",
                                  "llava_onevision", "smolvlm"])
@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_from_config_json_equals_the_instantiated_model(arch, tied, tiny_vlm_dir):
    from vlrft.models.loading import load_policy

    folder = tiny_vlm_dir(arch, tie_word_embeddings=tied)
    model = load_policy(folder)
    shape = load_model_shape(str(folder))
    assert shape.num_parameters == sum(p.numel() for p in model.parameters())
    tower = [model.model.visual] if hasattr(model.model, "visual") else \
        [model.model.vision_model, model.model.connector] if arch == "smolvlm" else \
        [model.model.vision_tower, model.model.multi_modal_projector]  # Gemma 3, InternVL, LLaVA-OneVision
    newline = [model.model.image_newline] if arch == "llava_onevision" else []
    assert shape.count("vision") == sum(p.numel() for part in tower for p in part.parameters()) + \
        sum(p.numel() for p in newline)
    assert shape.tower_count() == sum(p.numel() for p in tower[0].parameters())  # what freeze_vision_tower freezes
    names = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert {t.name: t.shape for t in shape.tensors()} == names  # every tensor, by name and shape


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "gemma3", "internvl",
                                  "llava_onevision", "smolvlm"])
def test_lora_parameter_count_equals_peft(arch, tiny_vlm_dir):
    """Also with model.freeze_vision_tower: no adapter in the vision tower, its merger or Qwen3-VL's deepstack
    mergers ("all-linear" reaches them all otherwise, and the frozen tower would train through its adapters)."""
    pytest.importorskip("peft")
    from vlrft.models.actor import apply_lora
    from vlrft.models.loading import load_policy

    folder = tiny_vlm_dir(arch)
    shape = load_model_shape(str(folder))
    experts = [["q_proj", "experts.gate_up_proj", "experts.down_proj"], ["all-linear", "experts.gate_up_proj"]]
    for targets in [["all-linear"], ["q_proj", "v_proj"]] + (experts if arch == "qwen3_vl_moe" else []):
        for frozen in (False, True):
            model = apply_lora(load_policy(folder), 4, 8, 0.0, targets, exclude_vision=frozen)
            trained = [name for name, p in model.named_parameters() if p.requires_grad]
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            assert shape.lora_parameters(4, targets, exclude_vision=frozen) == trainable, (targets, frozen)
            in_vision = [name for name in trained if any(f".{v}." in name for v in ("visual", "vision_tower",
                                                                                     "vision_model"))]
            assert (not in_vision) if frozen else (bool(in_vision) or targets != ["all-linear"]), (targets, frozen)


@pytest.mark.parametrize("name,published,within", [
    ("Qwen/Qwen2.5-VL-3B-Instruct", 3.75e9, 0.006e9), ("Qwen/Qwen2.5-VL-7B-Instruct", 8.29e9, 0.006e9),
    ("Qwen/Qwen2.5-VL-32B-Instruct", 33.45e9, 0.006e9), ("Qwen/Qwen3-VL-4B-Instruct", 4.44e9, 0.006e9),
    ("Qwen/Qwen2.5-VL-72B-Instruct", 73.4e9, 0.05e9),  # the 72B model card rounds to 0.1 B
    # released safetensors: 31,070,754,032 parameters (model card: 31.1 B; 3 B of them active per token)
    ("Qwen/Qwen3-VL-30B-A3B-Instruct", 31_070_754_032, 1),
    # model card: 10.3 B; counted 10,292,777,472 (language model 9,400,279,040 with its LM head, vision 892,498,432)
    ("THUDM/GLM-4.1V-9B-Thinking", 10.3e9, 0.05e9),
    # model card: 4.3 B; counted 4,300,079,472 (language model 3,880,263,168, tied; SigLIP and projector 419,816,304)
    ("google/gemma-3-4b-it", 4.3e9, 0.05e9),
    # model card: 7.94 B; counted 7,944,373,760 (Qwen2.5-7B language model 7,612,820,992 with its LM head, InternViT
    # 304,012,288, projector 27,540,480)
    ("OpenGVLab/InternVL3-8B-hf", 7.94e9, 0.005e9),
    # model card: 8.03 B; counted 8,030,807,584 (Qwen2-7B language model 7,616,075,264 with its LM head, SigLIP
    # 397,747,744, projector and image_newline 16,984,576)
    ("llava-hf/llava-onevision-qwen2-7b-ov-hf", 8.03e9, 0.005e9),
    # model card: 2.2 B (2.25 B in the Hub's count); counted 2,246,784,880 (Llama 1,812,563,968 with its LM head,
    # SigLIP 412,987,248, connector 21,233,664)
    ("HuggingFaceTB/SmolVLM2-2.2B-Instruct", 2.25e9, 0.01e9)])
def test_shipped_model_configs_give_the_published_sizes_and_match_transformers(name, published, within):
    from transformers import AutoConfig, AutoModelForImageTextToText

    shape = load_model_shape(name)
    assert abs(shape.num_parameters - published) < within
    with torch.device("meta"):  # the real transformers model, without memory
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(str(shipped_config_path(name))))
    assert shape.num_parameters == sum(p.numel() for p in model.parameters())


def test_qwen3_vl_moe_counts_every_expert_and_the_active_share_as_released():
    """Qwen3-VL-30B-A3B: 128 experts of 768 in each of its 48 layers, 8 picked per token. The count is every expert
    (what the memory plan holds: weights, gradients, optimizer state); `active_parameters` counts the picked 8 of
    128, 3.35 B in the language model (the model card's "A3B", 3.3 B activated) plus the vision tower."""
    shape = load_model_shape("Qwen/Qwen3-VL-30B-A3B-Instruct")
    t = shape.text
    assert (len(t.sparse_layers), t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size) == (48, 128, 8, 768)
    h, v = 2048, 151936
    attention = h * 32 * 128 * 2 + h * 4 * 128 * 2 + 2 * 128  # q, o; k, v; q/k head norms
    experts = 128 * 3 * 768 * h
    layer = attention + experts + 128 * h + 2 * h  # router, two norms
    assert shape.count("text") + shape.count("head") == 48 * layer + 2 * v * h + h == 30_532_122_624  # Qwen3-30B-A3B
    assert shape.count("vision") == 538_631_408
    active_text = 48 * (layer - experts + experts * 8 // 128) + 2 * v * h + h
    assert active_text == 3_353_032_704
    assert shape.active_parameters == active_text + 538_631_408
    assert t.intermediate_size == 8 * 768 == 6144  # per token: the picked experts' width, as the activations count it
    dense = load_model_shape("Qwen/Qwen3-VL-4B-Instruct")
    assert dense.active_parameters == dense.num_parameters and dense.text.intermediate_size == 9728


def test_glm4v_9b_count_by_hand():
    """GLM-4.1V-9B-Thinking, its parts counted from the released config by hand: GLM-4's decoder (q/k/v biases, fused
    gate_up_proj, four norms a layer) and its tower (MLP as wide as out_hidden_size, a 2x2 downsampling convolution,
    a merger with a gated MLP of vision_config.intermediate_size, a 24 x 24 position table)."""
    shape = load_model_shape("THUDM/GLM-4.1V-9B-Thinking")
    h, v, inter, kv = 4096, 151552, 13696, 2 * 128
    layer = (h * h + h) + 2 * (kv * h + kv) + h * h + 3 * inter * h + 4 * h
    assert shape.count("text") + shape.count("head") == 40 * layer + 2 * v * h + h == 9_400_279_040
    vh, depth = 1536, 24
    block = 2 * vh + 3 * vh * vh + vh * vh + 3 * h * vh
    merger = h * h + 2 * h + 3 * inter * h
    tower = 576 * vh + (vh * 3 * 2 * 14 * 14 + vh) + depth * block + merger + 2 * vh + (h * vh * 4 + h)
    assert shape.count("vision") == tower == 892_498_432
    assert shape.num_parameters == 10_292_777_472 and shape.checkpoint_bytes == 2
    assert shape.text.head_dim == 128 and shape.text.kv_dim == 256 and shape.active_parameters == shape.num_parameters


def test_dense_and_sparse_layers_of_a_moe_config_follow_transformers():
    """mlp_only_layers and decoder_sparse_step choose which layers get experts, as transformers builds them."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = json.loads(shipped_config_path("Qwen/Qwen3-VL-30B-A3B-Instruct").read_text())
    config["text_config"].update(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3], num_experts=4,
                                 hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 intermediate_size=96, moe_intermediate_size=16, num_experts_per_tok=2, vocab_size=100)
    config["vision_config"].update(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                   deepstack_visual_indexes=[0], num_position_embeddings=16)
    shape = shape_from_config(config)
    assert shape.text.sparse_layers == (1, 5)  # layers 2, 4, 6 by the step; the 4th one (index 3) is dense
    assert shape.text.intermediate_size == 96  # the dense layers' MLP is wider than 2 experts of 16
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**config))
    assert {t.name: t.shape for t in shape.tensors()} == {n: tuple(p.shape) for n, p in model.named_parameters()}
    experts = 2 * 4 * 3 * 16 * 64
    assert shape.active_parameters == shape.num_parameters - experts // 2


def _tiny_shape():
    return shape_from_config({"model_type": "qwen2_5_vl", "hidden_size": 64, "intermediate_size": 128,
                              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "vocab_size": 100, "tie_word_embeddings": False,
                              "vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 32,
                                                "out_hidden_size": 64, "patch_size": 14}})


def test_hand_computed_count_of_a_tiny_architecture():
    shape = _tiny_shape()
    h, i, v, kv = 64, 128, 100, 32
    layer = (h * h + h) + 2 * (kv * h + kv) + h * h + 3 * h * i + 2 * h  # q, k, v (+bias), o, MLP, 2 norms
    text = v * h + 2 * layer + h + v * h  # embeddings, layers, final norm, untied LM head
    vh, vi, m = 16, 32, 16 * 4
    block = 2 * vh + (3 * vh * vh + 3 * vh) + (vh * vh + vh) + 2 * (vi * vh + vi) + (vh * vi + vh)
    vision = vh * 3 * 2 * 14 * 14 + block + vh + (m * m + m) + (h * m + h)  # patch conv, block, merger
    assert shape.num_parameters == text + vision


def test_per_gpu_bytes_follow_the_strategy():
    shape = _tiny_shape()
    cfg = load_config(CONFIG_7B, ["algorithm.kl_coef=0.1"], validate=False)
    n, hw = shape.num_parameters, Hardware(gpus_per_node=8, gpu_memory=80 * GiB)
    ddp = plan_memory(cfg, shape, hw, StrategyChoice("ddp"))
    assert (ddp.component("parameters"), ddp.component("gradients"), ddp.component("optimizer")) == (4 * n, 4 * n, 8 * n)
    assert ddp.component("buffers") == 4 * n and ddp.component("reference") == 2 * n
    fsdp = plan_memory(cfg, shape, hw, StrategyChoice("fsdp2"))
    assert fsdp.component("parameters") + fsdp.component("gradients") + fsdp.component("optimizer") == 16 * n // 8
    assert fsdp.component("reference") == 2 * n // 8
    # DeepSpeed runs with float32 weights and gradients (its bf16 mode off, bf16 autocast on GPUs, as DDP)
    zero2 = plan_memory(cfg, shape, hw, StrategyChoice("deepspeed", zero_stage=2))
    assert (zero2.component("parameters"), zero2.component("gradients"), zero2.component("optimizer")) == \
        (4 * n, 4 * n // 8, 12 * n // 8)
    zero3 = plan_memory(cfg, shape, hw, StrategyChoice("deepspeed", zero_stage=3, offload_optimizer=True))
    assert (zero3.component("parameters"), zero3.component("optimizer")) == (4 * n // 8, 0)
    frozen = plan_memory(replace(cfg, model=replace(cfg.model, freeze_vision_tower=True)), shape, hw,
                         StrategyChoice("ddp"))
    assert frozen.component("optimizer") == 8 * (n - shape.count("vision"))


def test_the_hf_engine_counts_the_whole_weights_it_samples_from():
    """While the hf engine samples, the policy's weights are whole on every rank (FSDP2 and ZeRO-3 gather them for
    each generate call) and, as float32 weights under bf16 autocast, also in a bf16 copy; vLLM holds its own copy."""
    shape = _tiny_shape()
    n, hw = shape.num_parameters, Hardware(gpus_per_node=8, gpu_memory=80 * GiB)
    cfg = load_config(CONFIG_7B, ["rollout.engine=hf"], validate=False)
    whole = {name: plan_memory(cfg, shape, hw, choice).component("engine_weights") for name, choice in [
        ("ddp", StrategyChoice("ddp")), ("fsdp2", StrategyChoice("fsdp2")),
        ("fsdp2 float32", StrategyChoice("fsdp2", mixed_precision=False)),
        ("zero2", StrategyChoice("deepspeed", zero_stage=2)), ("zero3", StrategyChoice("deepspeed", zero_stage=3)),
        ("ddp float32", StrategyChoice("ddp", mixed_precision=False))]}
    assert whole == {"ddp": 2 * n, "fsdp2": 2 * n, "fsdp2 float32": 4 * n, "zero2": 2 * n, "zero3": 6 * n,
                     "ddp float32": 0}
    [held] = [c for c in plan_memory(cfg, shape, hw, StrategyChoice("fsdp2")).components if c.name == "engine_weights"]
    assert held.phases == ("rollout",)  # given back before training


def test_the_hf_engine_kv_cache_is_bf16_with_lean_decoding_under_mixed_precision_and_holds_a_prompt_once():
    """The lean step (plain LoRA included) keeps a bf16 cache under bf16 autocast, and from the engine's
    SHARED_PROMPT_TOKENS on each prompt's keys and values once for its group (not with tools: later turns decode
    each row alone); transformers' layers keep float32 keys, bf16 values and every row's copy of its prompt."""
    from vlrft.config import ToolConfig
    from vlrft.sampling import SHARED_PROMPT_TOKENS  # the decoder's and the plan's one constant
    shape = load_model_shape("Qwen/Qwen2.5-VL-7B-Instruct")
    hw, cfg = Hardware(), load_config(CONFIG_7B, ["rollout.engine=hf"], validate=False)
    prompts = cfg.prompts_per_step // hw.world_size
    rows = prompts * cfg.rollout.n
    assert cfg.rollout.n > 1 and cfg.data.max_prompt_length >= SHARED_PROMPT_TOKENS
    shared = prompts * cfg.data.max_prompt_length + rows * cfg.rollout.max_new_tokens
    per_row = rows * (cfg.data.max_prompt_length + cfg.rollout.max_new_tokens)
    per_token = 2 * shape.text.num_layers * shape.text.kv_dim
    lean = plan_memory(cfg, shape, hw, StrategyChoice("fsdp2")).component("engine_kv_cache")
    layers = plan_memory(replace(cfg, rollout=replace(cfg.rollout, lean_decode=False)), shape, hw,
                         StrategyChoice("fsdp2")).component("engine_kv_cache")
    float32 = plan_memory(cfg, shape, hw, StrategyChoice("fsdp2", mixed_precision=False)).component("engine_kv_cache")
    lora = plan_memory(replace(cfg, model=replace(cfg.model, lora=replace(cfg.model.lora, rank=8))), shape, hw,
                       StrategyChoice("fsdp2")).component("engine_kv_cache")
    short = replace(cfg, data=replace(cfg.data, max_prompt_length=SHARED_PROMPT_TOKENS - 1))
    copied = rows * (SHARED_PROMPT_TOKENS - 1 + cfg.rollout.max_new_tokens)
    # with tools the turns after the first decode each row alone (n = 1): every row's prompt and trajectory
    tools = replace(cfg.rollout, tools=[ToolConfig(name="zoom")])
    trajectories = rows * (cfg.data.max_prompt_length + tools.tokens_after_prompt)
    assert plan_memory(replace(cfg, rollout=tools), shape, hw,
                       StrategyChoice("fsdp2")).component("engine_kv_cache") == 2 * per_token * trajectories
    # transformers' layers: float32 keys, bf16 values (per_token counts keys and values)
    assert (lean, layers, float32, lora) == (2 * per_token * shared, (4 + 2) * per_token // 2 * per_row,
                                             4 * per_token * shared, 2 * per_token * shared)
    assert plan_memory(short, shape, hw, StrategyChoice("fsdp2")).component("engine_kv_cache") == 2 * per_token * copied


def test_checkpointing_micro_batch_and_engine_fraction_move_the_figures():
    shape = load_model_shape("Qwen/Qwen2.5-VL-7B-Instruct")
    cfg = load_config(CONFIG_7B, validate=False)
    hw, fsdp = Hardware(), StrategyChoice("fsdp2")
    base = plan_memory(cfg, shape, hw, fsdp)
    no_ckpt = plan_memory(replace(cfg, model=replace(cfg.model, gradient_checkpointing=False)), shape, hw, fsdp)
    assert no_ckpt.component("activations") > 5 * base.component("activations")
    double = plan_memory(replace(cfg, train=replace(cfg.train, micro_batch_completions_per_rank=4)), shape, hw, fsdp)
    assert double.component("activations") > base.component("activations")
    engine = plan_memory(replace(cfg, rollout=replace(cfg.rollout, gpu_memory_utilization=0.8)), shape, hw, fsdp)
    assert engine.phase_total("rollout") - base.phase_total("rollout") == pytest.approx(0.3 * 80 * GiB, abs=1)


def test_without_checkpointing_the_bf16_copies_autocast_keeps_for_the_backward_are_counted():
    """Float32 weights under bf16 autocast: each matmul's bf16 copy of its weight is saved for the backward (the whole
    model's, ZeRO-3's gathered layers too); under gradient checkpointing one layer's at a time, and FSDP2 gathers
    bf16 weights (no copies). A frozen vision tower passes no gradient: its copies are not kept."""
    shape = load_model_shape("Qwen/Qwen2.5-VL-7B-Instruct")
    cfg = load_config(CONFIG_7B, validate=False)
    no_ckpt = replace(cfg, model=replace(cfg.model, gradient_checkpointing=False))
    n = shape.num_parameters - 2 * shape.text.vocab_size * shape.text.hidden_size  # 7B: untied embeddings and head
    for choice in (StrategyChoice("ddp"), StrategyChoice("deepspeed", zero_stage=3)):
        assert plan_memory(no_ckpt, shape, Hardware(), choice).component("weight_casts") == 2 * n
        assert plan_memory(cfg, shape, Hardware(), choice).component("weight_casts") == 0
    assert plan_memory(no_ckpt, shape, Hardware(), StrategyChoice("fsdp2")).component("weight_casts") == 0
    assert plan_memory(no_ckpt, shape, Hardware(), StrategyChoice("ddp", mixed_precision=False)
                       ).component("weight_casts") == 0
    frozen = replace(no_ckpt, model=replace(no_ckpt.model, freeze_vision_tower=True))
    assert plan_memory(frozen, shape, Hardware(), StrategyChoice("ddp")).component("weight_casts") == \
        2 * (n - shape.count("vision"))


def test_with_tools_the_plan_counts_a_whole_trajectory_after_the_prompt():
    """Multi-turn rows hold the prompt plus up to rollout.max_trajectory_tokens: the training activations and the
    engine's longest sequence are counted at that length, not at prompt + max_new_tokens."""
    from vlrft.config import ToolConfig

    shape = load_model_shape("Qwen/Qwen2.5-VL-7B-Instruct")
    cfg = load_config(CONFIG_7B, validate=False)
    hw, fsdp = Hardware(), StrategyChoice("fsdp2")
    base = plan_memory(cfg, shape, hw, fsdp)
    tools = replace(cfg.rollout, engine="vllm", tools=[ToolConfig(name="zoom")],
                    max_trajectory_tokens=4 * cfg.rollout.max_new_tokens)
    plan = plan_memory(replace(cfg, rollout=tools), shape, hw, fsdp)
    assert plan.component("activations") > base.component("activations")
    vllm = plan_memory(replace(cfg, rollout=replace(cfg.rollout, engine="vllm")), shape, hw, fsdp)
    longer = cfg.data.max_prompt_length + tools.max_trajectory_tokens + cfg.rollout.max_new_tokens
    shorter = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    assert plan.engine_kv_needed * shorter == vllm.engine_kv_needed * longer


def test_a_token_budget_bounds_the_activations_by_tokens_not_rows():
    shape = load_model_shape("Qwen/Qwen2.5-VL-7B-Instruct")
    cfg = load_config(CONFIG_7B, validate=False)
    hw, fsdp = Hardware(), StrategyChoice("fsdp2")
    seq_len = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    def budget(tokens, images_per_prompt=1):
        return plan_memory(replace(cfg, train=replace(cfg.train, max_tokens_per_micro_batch=tokens)), shape, hw, fsdp,
                           images_per_prompt=images_per_prompt)

    # text: as many tokens as the row-count micro-batch's shared forward at its longest cover it, however they split
    # between prompts and completions (a budget's rows: up to all of the rank's, each with its copy of its prompt's
    # keys and values)
    rows_per_mb = cfg.train.micro_batch_completions_per_rank
    prompts = min(rows_per_mb, -(-rows_per_mb // cfg.rollout.n) + 1)
    full = prompts * cfg.data.max_prompt_length + rows_per_mb * cfg.rollout.max_new_tokens
    from vlrft.plan.activations import completion_replay_bytes

    def micro_batch(plan):  # activations and the gradients waiting beside them, read at the same moment
        return plan.component("activations") + plan.component("pending_grads")

    rows = plan_memory(cfg, shape, hw, fsdp, images_per_prompt=0)
    prompt_len, new = cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
    rank_rows = cfg.prompts_per_step // hw.world_size * cfg.rollout.n
    assert micro_batch(budget(full, 0)) >= micro_batch(rows)
    def by_tokens(tokens):  # the part that grows with the budget (the rows' key/value copies are the rank's rows')
        return budget(tokens, 0).component("activations") - completion_replay_bytes(
            shape, rank_rows, prompt_len, tokens, new, 2, 2)

    assert by_tokens(4 * seq_len) > 1.9 * by_tokens(2 * seq_len)
    # with images, the budget admits more prompts' images than the rows did (short completions of many prompts)
    assert budget(full).component("activations") >= plan_memory(cfg, shape, hw, fsdp).component("activations")
    # a budget under one row: that row runs alone, so one full row is the least the plan can assume
    assert budget(1).component("activations") == budget(seq_len).component("activations")
    assert "token budget" in next(c.note for c in budget(seq_len).components if c.name == "activations")
    # too much: the suggestion lowers the budget (the row count does not bound such a forward)
    big = plan_memory(replace(cfg, train=replace(cfg.train, max_tokens_per_micro_batch=65536)), shape, hw,
                      StrategyChoice("ddp"))
    assert any("lower train.max_tokens_per_micro_batch" in line for line in big.suggestions)
    assert not any("micro_batch_completions_per_rank" in line for line in big.suggestions)


def test_ddp_7b_does_not_fit_and_the_suggestions_say_what_would():
    cfg = load_config(CONFIG_7B, ["train.strategy=ddp"], validate=False)
    plan = plan_memory(cfg, load_model_shape(cfg.model.path), Hardware(), StrategyChoice("ddp"))
    assert not plan.fits and plan.total > 130 * GiB  # 16+ bytes per parameter replicated: the finding
    assert plan.suggestions and "fsdp2" in plan.suggestions[0] and plan.suggestions[0].endswith("fits)")
    with pytest.raises(UserError) as err:
        check_fits(cfg, Hardware())
    assert "\n" not in str(err.value) and "fsdp2" in str(err.value)


def test_the_load_time_check_does_nothing_on_cpu():
    cfg = load_config(CONFIG_7B, ["train.strategy=ddp"], validate=False)  # would not fit on a GPU
    assert not torch.cuda.is_available()
    assert check_fits_at_load(cfg, 8) is None


class Ran:
    def __init__(self, returncode, out):
        self.returncode, self.stdout, self.stderr = returncode, out.out, out.err


def test_host_memory_of_the_first_node_follows_the_strategy():
    """Rank 0's checkpoint read at start-up and the state offloaded to the CPU, per node."""
    shape = load_model_shape("Qwen/Qwen2.5-VL-72B-Instruct")
    assert shape.checkpoint_bytes == 2  # the release's config.json says bfloat16
    assert _tiny_shape().checkpoint_bytes == 4  # no dtype in config.json: transformers reads float32
    cfg = load_config(CONFIG_7B, validate=False)
    n, hw = shape.num_parameters, Hardware(gpus_per_node=8, nodes=4, gpu_memory=80 * GiB)
    fsdp = plan_memory(cfg, shape, hw, StrategyChoice("fsdp2"), suggest=False)
    assert fsdp.host_total("load") == 2 * n  # rank 0 reads the bf16 checkpoint in bf16 (vlrft.parallel.fsdp2)
    assert fsdp.host_total("rollout") == int((4 * n + 8 * n) / 4)  # vLLM: shards and moments offloaded
    assert fsdp.host_total("train") == 0
    offload = plan_memory(cfg, shape, hw, StrategyChoice("fsdp2", offload_optimizer=True, offload_params=True),
                          suggest=False)
    # a quarter of the float32 state on each of 4 nodes: shards from the load, moments from the first step on
    assert offload.host_total("train") == int(4 * n / 4) + int(8 * n / 4) + int(4 * n / 4)
    assert offload.host_total("rollout") == int(4 * n / 4) + int(8 * n / 4)
    assert offload.host_total("load") == 2 * n + int(4 * n / 4)
    ddp = plan_memory(cfg, shape, Hardware(gpus_per_node=8), StrategyChoice("ddp"), suggest=False)
    assert ddp.host_total("load") == 8 * 4 * n  # every rank loads the policy in float32
    zero = plan_memory(cfg, shape, hw, StrategyChoice("deepspeed", zero_stage=3, offload_optimizer=True),
                       suggest=False)
    # float32 master weights, gradients and AdamW moments (DeepSpeed keeps the gradient partitions with them)
    assert zero.host_total("train") == int(16 * n / 4) and zero.host_total("load") == 2 * n + int(16 * n / 4)
    with_reference = plan_memory(replace(cfg, algorithm=replace(cfg.algorithm, kl_coef=0.04)), shape, hw,
                                 StrategyChoice("fsdp2"), suggest=False)
    assert with_reference.host_total("rollout") == int((4 * n + 8 * n + 2 * n) / 4)  # its bf16 shards go too
    figures = fsdp.to_json()
    assert figures["per_node_host_bytes"]["checkpoint_read"] == 2 * n and figures["host_phases"]["load"] == 2 * n


def test_a_node_with_too_little_host_memory_is_warned_of_with_the_phase_and_the_largest_part():
    """72B on 4 nodes with FSDP2 cpu_offload: 273.5 GiB per node in training (the config's comment)."""
    shape = load_model_shape("Qwen/Qwen2.5-VL-72B-Instruct")
    cfg = load_config(CONFIG_7B, validate=False)
    hw = Hardware(gpus_per_node=8, nodes=4, gpu_memory=80 * GiB)
    plan = plan_memory(cfg, shape, hw, StrategyChoice("fsdp2", offload_optimizer=True, offload_params=True),
                       suggest=False)
    need = plan.host_total("train")
    assert need == max(plan.host_total(p) for p in ("load", "rollout", "train"))
    assert host_memory_warning(plan, need) is None  # exactly enough
    warning = host_memory_warning(plan, 256 * GiB)
    assert warning is not None and "\n" not in warning
    assert f"{need / GiB:.1f} GiB of host memory (train phase" in warning and "has 256.0 GiB" in warning
    assert "offloaded_moments" in warning  # the largest part of the train phase: what to offload less
    no_offload = plan_memory(cfg, shape, hw, StrategyChoice("fsdp2"), suggest=False)
    assert host_memory_warning(no_offload, 256 * GiB) is None  # 72B's bf16 read (136 GiB) and the rollout offload fit


def test_node_memory_is_the_lowest_limit_of_the_process_cgroups_or_the_machines_ram(tmp_path):
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert node_memory_bytes(tmp_path, tmp_path / "no-such-file") == machine

    def limits(own: str, files: dict[str, str]) -> int:
        (tmp_path / "self").write_text(own)
        for name, text in files.items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(text + "\n")
        return node_memory_bytes(tmp_path, tmp_path / "self")

    # cgroup v2 inside a container (its own namespace): the limit is at the root
    assert limits("0::/\n", {"memory.max": "max"}) == machine
    assert limits("0::/\n", {"memory.max": str(machine // 4)}) == machine // 4
    # v2 without a namespace (a Slurm step): the job's limit sits above the process's own cgroup, which has none
    job = "system.slice/slurmstepd.scope/job_7"
    assert limits(f"0::/{job}/step_0/user/task_0\n",
                  {"memory.max": "max", f"{job}/memory.max": str(GiB),
                   f"{job}/step_0/user/task_0/memory.max": "max"}) == GiB
    # v1: the memory controller's own hierarchy; 2**63 - 4096 is v1's "no limit"
    for name in list(tmp_path.rglob("memory.max")):
        name.unlink()
    assert limits("4:memory:/pod\n1:cpu:/pod\n", {"memory/memory.limit_in_bytes": str(2**63 - 4096),
                                                    "memory/pod/memory.limit_in_bytes": str(2**63 - 4096)}) == machine
    assert limits("4:memory:/pod\n", {"memory/pod/memory.limit_in_bytes": str(3 * GiB)}) == 3 * GiB
    # hybrid (v1 controllers beside an empty v2 hierarchy), combined controllers, and lines it cannot read
    assert limits("\ngarbage\n2:cpu,cpuacct:/pod\n4:memory:/pod\n0::/\n", {}) == 3 * GiB


@pytest.fixture
def vlrft(capsys):
    """Run `vlrft ARGS` in this process (the same `main` as the console script); returns code, stdout, stderr."""
    from vlrft.cli import main

    def run(*args):
        capsys.readouterr()
        code = main([str(a) for a in args])
        return Ran(code, capsys.readouterr())

    return run


def test_plan_command_exit_status_and_json(vlrft):
    fits = vlrft("plan", CONFIG_7B, "--gpus", "8", "--gpu-memory", "80GiB", "--json")
    assert fits.returncode == 0, fits.stderr
    figures = json.loads(fits.stdout)
    assert figures["fits"] is True and figures["capacity"] == 80 * GiB and figures["world_size"] == 8
    assert figures["total"] == max(p["total"] for p in figures["phases"].values()) <= figures["capacity"]
    assert {"parameters", "gradients", "optimizer", "activations", "logits", "engine_weights",
            "engine_kv_cache"} <= set(figures["per_gpu_bytes"])
    assert figures["parameters"] == load_model_shape("Qwen/Qwen2.5-VL-7B-Instruct").num_parameters
    too_small = vlrft("plan", CONFIG_7B, "--gpus", "8", "--gpu-memory", "80GiB", "--strategy", "ddp")
    assert too_small.returncode == 1
    assert "DOES NOT FIT" in too_small.stdout and "set train.strategy: fsdp2" in too_small.stdout
    video = json.loads(vlrft("plan", CONFIG_7B, "--gpus", "8", "--gpu-memory", "80GiB", "--videos-per-prompt", "1",
                             "--json").stdout)
    assert video["per_gpu_bytes"]["activations"] > figures["per_gpu_bytes"]["activations"]
    zero3 = vlrft("plan", CONFIG_7B, "--strategy", "deepspeed", "--zero-stage", "3", "--json")
    assert zero3.returncode == 0 and json.loads(zero3.stdout)["strategy"] == "deepspeed (ZeRO-3)"
    bad = vlrft("plan", CONFIG_7B, "--gpu-memory", "lots")
    assert bad.returncode == 2 and "--gpu-memory" in bad.stderr


def test_plan_command_says_how_many_of_a_moe_models_parameters_a_token_runs_through(vlrft):
    """Qwen3-VL-30B-A3B: the plan holds all 31.07 B parameters (every expert is a weight, a gradient and AdamW
    state); the JSON and the table also give the 3.89 B one token's forward runs through."""
    moe = ["model.path=Qwen/Qwen3-VL-30B-A3B-Instruct", "rollout.engine=hf", "--gpus", "8"]
    figures = json.loads(vlrft("plan", CONFIG_7B, *moe, "--json").stdout)
    assert figures["parameters"] == 31_070_754_032 and figures["active_parameters"] == 3_891_664_112
    table = vlrft("plan", CONFIG_7B, *moe).stdout
    assert "3.892 B of the 31.071 B parameters active per token (8 of 128 experts in 48 layers)" in table
    dense = json.loads(vlrft("plan", CONFIG_7B, "--json").stdout)
    assert dense["active_parameters"] == dense["parameters"]
    assert "active per token" not in vlrft("plan", CONFIG_7B).stdout


def test_plan_command_refuses_an_engine_group_that_would_span_nodes(vlrft, monkeypatch):
    """The plan checks rollout.tensor_parallel_size against the GPUs per node it is given, as torchrun will (not
    against the whole job, which a plan run outside torchrun would otherwise take for one node)."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    one_node = vlrft("plan", CONFIG_7B, "rollout.tensor_parallel_size=4", "--gpus", "4", "--nodes", "2")
    assert one_node.returncode == 0, one_node.stdout + one_node.stderr
    spanning = vlrft("plan", CONFIG_7B, "rollout.tensor_parallel_size=4", "--gpus", "2", "--nodes", "2")
    assert spanning.returncode != 0
    assert "rollout.tensor_parallel_size=4" in spanning.stderr and "processes per node (2)" in spanning.stderr


def test_plan_command_checks_the_nodes_host_memory_when_given(vlrft):
    roomy = vlrft("plan", CONFIG_7B, "--gpus", "8", "--host-memory", "2TiB")
    assert roomy.returncode == 0, roomy.stdout
    assert "host memory: the first node's largest phase fits in 2048.0 GiB" in roomy.stdout
    small = vlrft("plan", CONFIG_7B, "--gpus", "8", "--host-memory", "8GiB", "--json")
    figures = json.loads(small.stdout)
    assert small.returncode == 1 and figures["fits"] is True  # the GPUs fit; the node's RAM does not
    assert figures["host_fits"] is False and figures["host_memory"] == 8 * GiB
    assert max(figures["host_phases"].values()) > 8 * GiB
    text = vlrft("plan", CONFIG_7B, "--gpus", "8", "--host-memory", "8GiB")
    assert text.returncode == 1 and "memory plan: the first node needs about" in text.stdout
    assert "host_memory" not in json.loads(vlrft("plan", CONFIG_7B, "--json").stdout)  # only when asked
    bad = vlrft("plan", CONFIG_7B, "--host-memory", "plenty")
    assert bad.returncode == 2 and "--host-memory" in bad.stderr


def test_plan_command_reads_any_model_folder(tiny_vlm_dir, tmp_path, vlrft):
    folder = tiny_vlm_dir("qwen3_vl")
    config = tmp_path / "tiny.yaml"
    config.write_text(f"model: {{path: {folder}}}\ntrain: {{strategy: ddp}}\n")
    out = vlrft("plan", config, "--gpus", "2", "--gpu-memory", "24GB", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["parameters"] == load_model_shape(str(folder)).num_parameters
    missing = vlrft("plan", config, "--model-config", tmp_path / "nope.json")
    assert missing.returncode == 2 and "--model-config" in missing.stderr


def test_trainer_stops_at_load_with_one_line_when_the_plan_does_not_fit(monkeypatch, tmp_path):
    """The trainer's load-time check, with a fake 80 GiB CUDA device (a stand-in: no GPU here)."""
    from types import SimpleNamespace

    from vlrft.parallel.strategy import Strategy
    from vlrft.trainer.trainer import Trainer

    strategy = Strategy()  # built on the CPU before CUDA is faked
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(total_memory=80 * GiB))
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt": "What is 2 + 2?", "answer": "4"}) + "\n")
    cfg = load_config(CONFIG_7B, ["train.strategy=single", f"data.train_files=[{data}]", "data.eval_files=[]",
                                  "data.format=native"], validate=False)  # 7B on one 80 GiB GPU
    with pytest.raises(UserError) as err:
        Trainer(cfg, strategy)
    message = str(err.value)
    assert "\n" not in message and message.startswith("memory plan:") and "80.0 GiB" in message
    monkeypatch.setenv("VLRFT_SKIP_MEMORY_PLAN", "1")
    assert check_fits_at_load(cfg, 1) is None


def test_the_completion_passs_gradients_waiting_for_the_prompt_pass_are_counted_beside_the_gradients():
    """Where the shared-prompt backward is one graph (ddp, DeepSpeed), autograd runs the whole completion pass's
    backward before the prompt pass's, so every trained language-model parameter's gradient from the completion pass
    waits for the prompt pass's (measured: tests/test_plan_terms.py). Under ddp it comes beside `.grad` from a step's
    second micro-batch on: float32, the whole language model's, or its LoRA adapters', at the moment of the peak; none
    with one micro-batch a step; none where no forward shares a prompt (one row a micro-batch, and no forward forced
    onto the shared path). Under DeepSpeed the whole float32 gradients, in every micro-batch. Under single and fsdp2
    the backward runs one backbone call at a time (`vlrft.models.staged_backward`): none wait. Before: fsdp2's
    unsharded gradients in the compute dtype waited (2 B per language-model parameter, in every micro-batch; 59.6 GiB
    per GPU for the 32B config with rows left out), and single's float32 ones as ddp's."""
    from vlrft.plan.activations import shared_gradients

    shape = load_model_shape("Qwen/Qwen2.5-VL-7B-Instruct")
    cfg = load_config(CONFIG_7B, validate=False)
    hw, ddp = Hardware(), StrategyChoice("ddp")
    rank_rows = cfg.prompts_per_step // hw.world_size * cfg.rollout.n
    assert rank_rows > cfg.train.micro_batch_completions_per_rank
    plan = plan_memory(cfg, shape, hw, ddp)
    assert plan.component("pending_grads") == 4 * shape.count("text")
    one = replace(cfg, train=replace(cfg.train, micro_batch_completions_per_rank=rank_rows))
    assert plan_memory(one, shape, hw, ddp).component("pending_grads") == 0
    alone = replace(cfg, train=replace(cfg.train, micro_batch_completions_per_rank=1))
    unforced = replace(alone, train=replace(alone.train, skip_zero_advantage_rows=False))
    assert plan_memory(unforced, shape, hw, ddp).component("pending_grads") == 0
    fsdp2 = StrategyChoice("fsdp2")
    for staged in (fsdp2, StrategyChoice("single")):
        for c in (cfg, one, alone, unforced):
            assert plan_memory(c, shape, hw, staged).component("pending_grads") == 0
    # the 32B config with rows left out: under fsdp2 no gradient waits, so no suggestion to keep forwards off the
    # shared-prompt path
    big = load_config(CONFIG_32B, ["train.skip_zero_advantage_rows=true"], validate=False)
    hw32 = Hardware(gpus_per_node=8, nodes=2, gpu_memory=80 * 10 ** 9)
    plan32 = plan_memory(big, load_model_shape("Qwen/Qwen2.5-VL-32B-Instruct"), hw32, fsdp2)
    assert plan32.component("pending_grads") == 0
    assert not any(line.startswith("set train.skip_zero_advantage_rows: false") for line in plan32.suggestions)
    # under ZeRO-3 they wait, too much: the suggestion keeps every forward off the shared-prompt path
    zero32 = plan_memory(big, load_model_shape("Qwen/Qwen2.5-VL-32B-Instruct"), hw32,
                         StrategyChoice("deepspeed", zero_stage=3))
    assert not zero32.fits and zero32.component("pending_grads") > 50 * 2 ** 30
    assert any(line.startswith("set train.skip_zero_advantage_rows: false") for line in zero32.suggestions)
    # DeepSpeed (ZeRO-2 and 3): whole float32 gradients, in every micro-batch (measured: tests/test_plan_terms.py)
    for stage in (2, 3):
        zero = StrategyChoice("deepspeed", zero_stage=stage)
        assert plan_memory(alone, shape, hw, zero).component("pending_grads") == 4 * shape.count("text")
        # all the rank's rows at once: the peak is the top completion layer's replay before its backward (its rows'
        # key/value copies over prompt and completion), when no gradient has been made yet, as under ddp
        whole = plan_memory(one, shape, hw, zero)
        assert whole.component("pending_grads") == 0
        assert whole.component("activations") == plan_memory(one, shape, hw, ddp).component("activations")
    lora = replace(cfg, model=replace(cfg.model, lora=replace(cfg.model.lora, rank=16, target_modules=["q_proj"])))
    t = shape.text
    per_layer = 16 * (t.hidden_size + t.num_heads * t.head_dim)
    assert shared_gradients(shape, 4, 2, 16, ("q_proj",)).per_layer == 4 * per_layer
    # the adapters' are small: the peak is then the top completion layer's replay, before any of them is made
    assert plan_memory(lora, shape, hw, ddp).component("pending_grads") == 0


@pytest.mark.parametrize("autocast_bf16", [True, False])
def test_activation_estimate_matches_the_tensors_saved_for_backward(autocast_bf16):
    """The per-token, per-layer activation model against what autograd really keeps (counted with saved-tensor
    hooks on a text-only forward; bf16 autocast on the CPU stands in for the GPU's mixed precision)."""
    from vlrft.models.tiny import TinySpec, build_tiny_model, build_tokenizer
    from vlrft.plan.activations import activation_bytes

    spec = TinySpec(arch="qwen2_5_vl", hidden_size=256, intermediate_size=704, num_layers=4, num_heads=4,
                    num_kv_heads=2)
    model = build_tiny_model(spec, build_tokenizer(512)).train()
    shape = shape_from_config(model.config.to_dict())
    ids = torch.randint(20, 500, (2, 300))
    saved: dict = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
        model.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    planned = activation_bytes(shape, tokens=2 * 300, patches=0, checkpointing=False,
                               compute_bytes=2 if autocast_bf16 else 4)
    assert planned == pytest.approx(sum(saved.values()), rel=0.1)


def _reward_model_folder(folder: Path, **sizes) -> Path:
    """A Qwen2 sequence classifier's config.json alone (the plan reads nothing else)."""
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForSequenceClassification"], "num_labels": 1,
              "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 300, "tie_word_embeddings": False, **sizes}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_reward_model_is_counted_from_its_config(tmp_path):
    from vlrft.config import RewardConfig, RewardFunctionConfig
    from vlrft.plan.reward_models import reward_model_shapes

    folder = _reward_model_folder(tmp_path / "rm")
    functions = [RewardFunctionConfig("accuracy"),
                 RewardFunctionConfig("reward_model", kwargs={"path": str(folder), "batch_size": 4, "max_length": 512}),
                 RewardFunctionConfig("reward_model", alias="on_cpu", kwargs={"path": str(folder), "device": "cpu"}),
                 RewardFunctionConfig("reward_model", alias="hub", kwargs={"path": "org/not-here-rm"})]
    recipes = {"charts": [RewardFunctionConfig("reward_model", kwargs={"path": str(folder), "batch_size": 4,
                                                                        "max_length": 512})]}  # the same key: one model
    [rm], not_counted = reward_model_shapes(RewardConfig(functions=functions, recipes=recipes))
    h, i, v, kv, layers = 64, 160, 300, 32, 3
    layer = (h * h + h) + 2 * (kv * h + kv) + h * h + 3 * h * i + 2 * h  # q, k, v (+bias), o, MLP, 2 norms
    assert rm.parameters == v * h + layers * layer + h + h * 1  # embeddings, layers, final norm, the score head
    assert (rm.key, rm.dtype_bytes, rm.offload) == ("reward_model", 2, True)  # bfloat16 and offloaded on a GPU
    assert rm.activation_bytes == 4 * 512 * (4 * h + 3 * i) * 2
    assert len(not_counted) == 1 and "'hub'" in not_counted[0] and "org/not-here-rm" in not_counted[0]


def test_an_offloaded_reward_model_takes_the_gpu_only_while_it_scores(tmp_path):
    from vlrft.plan import format_plan
    from vlrft.plan.reward_models import reward_model_shape

    cfg = load_config(CONFIG_7B, [], validate=False)
    shape, hw = load_model_shape(cfg.model.path), Hardware(gpus_per_node=8, gpu_memory=80 * GiB)
    folder = _reward_model_folder(tmp_path / "rm7b", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                  num_attention_heads=28, num_key_value_heads=4, vocab_size=152064)
    offloaded = reward_model_shape("rm", {"path": str(folder)})
    resident = replace(offloaded, offload=False)
    assert 7.0e9 < offloaded.parameters < 7.1e9  # Qwen2-7B's backbone with a one-label head
    fsdp = StrategyChoice("fsdp2")
    base = plan_memory(cfg, shape, hw, fsdp)
    off = plan_memory(cfg, shape, hw, fsdp, reward_models=[offloaded])
    on = plan_memory(cfg, shape, hw, fsdp, reward_models=[resident])
    weights, acts = offloaded.weight_bytes, offloaded.activation_bytes
    assert off.phase_total("rollout") == base.phase_total("rollout") + weights + acts
    assert off.phase_total("train") == base.phase_total("train")  # in host memory while the policy trains
    assert off.host_total("train") == base.host_total("train") + 8 * weights  # pinned, on each of the 8 ranks
    assert on.phase_total("train") == base.phase_total("train") + weights
    assert on.phase_total("rollout") == off.phase_total("rollout") and on.host_total("train") == base.host_total("train")
    assert "reward_model:rm" in format_plan(off)
    small_engine = load_config(CONFIG_7B, ["rollout.gpu_memory_utilization=0.4"], validate=False)
    tight = Hardware(gpus_per_node=8, gpu_memory=plan_memory(small_engine, shape, hw, fsdp, reward_models=[resident])
                     .phase_total("train") - 1)
    plan = plan_memory(small_engine, shape, tight, fsdp, reward_models=[resident])
    assert plan.peak_phase == "train" and not plan.fits
    [offload] = [s for s in plan.suggestions if s.startswith("set offload: true in the kwargs of reward model(s) rm")]
    assert offload.endswith(", fits)")


def test_lora_under_zero3_loads_partitioned_like_zero3_without_lora():
    """LoRA under ZeRO-3 builds the policy inside zero.Init, as without LoRA (the adapters come after): a 32B model
    with LoRA fits 2 x 8 x 80 GB GPUs, and rank 0's host reads the checkpoint in its own dtype once, not every rank
    the whole float32 policy (tests/test_deepspeed.py checks the partitioned load itself)."""
    cfg = load_config(REPO / "configs" / "qwen2_5_vl_32b_grpo_geometry3k.yaml", ["model.lora.rank=64"], validate=False)
    shape, hw = load_model_shape(cfg.model.path), Hardware(gpus_per_node=8, nodes=2, gpu_memory=80 * 10 ** 9)
    plan = plan_memory(cfg, shape, hw, StrategyChoice("deepspeed", zero_stage=3))
    assert plan.fits and plan.phase_total("load") == 2 * GiB  # the reserve only
    read = next(c for c in plan.host if c.name == "checkpoint_read")
    assert read.bytes == shape.checkpoint_bytes * shape.num_parameters < 4 * shape.num_parameters
    fsdp2 = plan_memory(cfg, shape, hw, StrategyChoice("fsdp2"))
    assert fsdp2.fits and fsdp2.phase_total("load") == 2 * GiB
    assert next(c for c in fsdp2.host if c.name == "checkpoint_read").bytes == 4 * shape.num_parameters  # rank 0


def test_the_rows_of_a_group_share_their_prompt_and_videos_count_their_frames():
    """The training forward runs each distinct prompt once: a micro-batch of a group's 8 rows holds one long prompt
    (two, when it starts inside a group), not 8. Videos count data.video_max_frames frames at data.max_pixels, within
    data.max_prompt_length tokens; the trainer's load-time check counts the data's most images and videos."""
    from vlrft.plan.activations import prompt_patches

    shape = load_model_shape("Qwen/Qwen2.5-VL-7B-Instruct")
    long_video = ["data.max_prompt_length=16384", "rollout.max_new_tokens=1024", "rollout.n=8",
                  "train.micro_batch_completions_per_rank=8", "data.max_pixels=200704", "data.video_max_frames=32"]
    cfg = load_config(CONFIG_7B, long_video, validate=False)
    hw, fsdp = Hardware(gpus_per_node=8, gpu_memory=80 * GiB), StrategyChoice("fsdp2")
    shared = plan_memory(cfg, shape, hw, fsdp, images_per_prompt=0)
    note = next(c.note for c in shared.components if c.name == "activations")
    assert "2 prompt(s) of 16384 tokens, once each, and 8 x 1024 after them" in note
    one_row = plan_memory(replace(cfg, train=replace(cfg.train, micro_batch_completions_per_rank=1)), shape, hw, fsdp,
                          images_per_prompt=0)
    assert shared.component("activations") < 4 * one_row.component("activations")  # not 8 prompts' worth
    per_frame = 200704 // 14 ** 2  # 1024 patches per temporal patch
    assert prompt_patches(cfg, shape, 0, 1) == 16 * per_frame  # 32 frames, 2 per temporal patch
    assert prompt_patches(cfg, shape, 2, 0) == 2 * per_frame
    assert prompt_patches(cfg, shape, 0, 8) == 16384 * 4  # no more than the prompt's tokens of 2x2 patches each
    video = plan_memory(cfg, shape, hw, fsdp, images_per_prompt=0, videos_per_prompt=1)
    image = plan_memory(cfg, shape, hw, fsdp, images_per_prompt=1)
    assert video.component("activations") > image.component("activations") > shared.component("activations")
    assert "0 image(s) and 1 video(s) per prompt: 32768 vision patches" in next(
        c.note for c in video.components if c.name == "activations")


@pytest.mark.slow
def test_the_shared_prompt_forwards_keys_values_and_their_gradients_are_counted_per_prompt_token():
    """Under gradient checkpointing the shared-prompt forward keeps every layer's prompt keys and values (the
    completion pass reads them) and, through the completion pass's backward, their gradients. Measured as the
    growth of the peak of forward + backward with the prompt's length: for a model whose keys and values are as
    wide as its hidden states the layer-input and replay terms alone fall short; with `prompt_kv` the plan covers it."""
    from _live_bytes import LiveBytes

    from vlrft.batch import build_sequences
    from _tiny_actor import training_actor

    from vlrft.models.tiny import TinySpec
    from vlrft.plan.activations import activation_bytes, prompt_kv_bytes
    from vlrft.vision import VisualBatch

    spec = TinySpec(arch="qwen2_vl", hidden_size=128, num_layers=12, num_heads=8, num_kv_heads=8,
                    intermediate_size=512, vocab_size=512)
    model, actor, tokenizer = training_actor(spec)
    shape = shape_from_config(model.config.to_dict())
    generator = torch.Generator().manual_seed(0)
    peaks = {}
    for length in (256, 1024):
        prompt = torch.randint(20, 400, (length,), generator=generator).tolist()
        completions = [torch.randint(20, 400, (4,), generator=generator).tolist() for _ in range(2)]
        seqs = build_sequences([prompt], VisualBatch.empty(1, 2), completions, [0, 0], tokenizer.pad_token_id)
        with LiveBytes() as live:
            actor.logprobs(seqs).logprobs.sum().backward()
        peaks[length] = live.peak
        model.zero_grad(set_to_none=True)
    measured = peaks[1024] - peaks[256]
    layers = activation_bytes(shape, 1024, 0, True, 4) - activation_bytes(shape, 256, 0, True, 4)
    kv = prompt_kv_bytes(shape, 1024, 4, 4) - prompt_kv_bytes(shape, 256, 4, 4)
    assert layers < measured <= layers + kv, (layers, measured, kv)


def test_a_generate_call_of_the_hf_engine_stays_within_the_plans_rollout_figures(tiny_vlm_dir, monkeypatch):
    """What a decode call allocates beyond the weights (the prefill of all the rank's prompts in one call, a layer's
    activations at a time; the KV cache; the decode steps), measured on a tiny model, against the plan's hf-engine
    components for the same numbers: the KV cache alone falls short of it (the prefill's activations are most of
    it), the KV cache and the prefill cover it. The weights are read in place, as on a GPU (no CPU packing)."""
    from _live_bytes import LiveBytes
    from _rollout_helpers import engine_setup

    from vlrft.data import Sample
    from vlrft.decoding import lean
    from vlrft.rollout import SamplingParams
    from vlrft.rollout.hf import HFEngine

    monkeypatch.setattr(lean, "packing_applies", lambda weight: False)
    samples = [Sample(id=str(i), prompt=f"Question {i}: describe the shape. " * 24) for i in range(4)]
    processor, model, tokens, batch = engine_setup(tiny_vlm_dir("qwen2_vl"), samples)
    longest, group, new = max(len(ids) for ids in batch.prompt_ids), 4, 16
    engine = HFEngine(lambda: model, processor, tokens, max_batch_prompts=len(samples))
    with torch.no_grad(), LiveBytes().ignore(*model.parameters()) as live:
        engine.generate(batch, SamplingParams(n=group, max_new_tokens=new, min_new_tokens=new, temperature=1.0))
    cfg = load_config(CONFIG_7B, ["rollout.engine=hf", f"rollout.n={group}", f"rollout.max_new_tokens={new}",
                                  f"rollout.global_batch_completions={group * len(samples)}",
                                  f"data.max_prompt_length={longest}"], validate=False)
    plan = plan_memory(cfg, shape_from_config(model.config.to_dict()), Hardware(gpus_per_node=1),
                       StrategyChoice("single", mixed_precision=False), images_per_prompt=0)
    kv, prefill = plan.component("engine_kv_cache"), plan.component("engine_prefill")
    assert kv < live.peak <= kv + prefill, (kv, prefill, live.peak)


@pytest.mark.slow
def test_without_checkpointing_the_completion_passs_repeated_keys_and_values_are_counted_per_row():
    """Without gradient checkpointing each completion row's pass keeps, in every layer, its copy of the prompt's keys
    and values and transformers' SDPA path's repeat of them to every query head (a GQA model under a mask), and
    the attention mask. Measured as the growth of the peak of forward + backward with the rows (a long prompt,
    short completions): the layer activations and plain copies fall short by far; the completion-pass term covers
    it. Under checkpointing one layer's worth (the plan stays above the measured growth)."""
    from _live_bytes import LiveBytes

    from vlrft.batch import build_sequences
    from _tiny_actor import training_actor

    from vlrft.models.tiny import TinySpec
    from vlrft.plan.activations import activation_bytes, completion_pass_bytes
    from vlrft.vision import VisualBatch

    spec = TinySpec(arch="qwen2_vl", hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=2,
                    intermediate_size=512, vocab_size=512)
    model, actor, tokenizer = training_actor(spec, checkpointing=False)
    shape = shape_from_config(model.config.to_dict())
    generator = torch.Generator().manual_seed(0)
    prompt_len, completion_len = 1024, 4
    prompt = torch.randint(20, 400, (prompt_len,), generator=generator).tolist()
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        peaks = {}
        for rows in (2, 8):
            completions = [torch.randint(20, 400, (completion_len,), generator=generator).tolist()
                           for _ in range(rows)]
            seqs = build_sequences([prompt], VisualBatch.empty(1, 2), completions, [0] * rows,
                                   tokenizer.pad_token_id)
            with LiveBytes().ignore(*model.parameters()) as live:
                actor.logprobs(seqs).logprobs.sum().backward()
            peaks[rows] = live.peak
            model.zero_grad(set_to_none=True)

        def planned(rows, repeated=True):
            layers = activation_bytes(shape, rows * completion_len, 0, checkpointing, 4)
            if not repeated:  # the plan before: the plain copies alone
                return layers + rows * prompt_len * shape.text.kv_dim * 8 * (1 if checkpointing else 4)
            return layers + completion_pass_bytes(shape, rows, prompt_len, rows * completion_len, completion_len,
                                                  checkpointing, 4)

        measured = peaks[8] - peaks[2]
        assert measured <= planned(8) - planned(2), (checkpointing, measured)
        if not checkpointing:
            assert measured > 2 * (planned(8, repeated=False) - planned(2, repeated=False))


CONFIG_32B = REPO / "configs" / "qwen2_5_vl_32b_grpo_geometry3k.yaml"


def test_zero3_keeps_its_gradient_partition_and_one_bucket_while_the_engine_samples(vlrft):
    """DeepSpeed ZeRO-3 allocates its flat float32 gradient partition and one reduce bucket of 5e8 elements when the
    engine is built and never frees them (stage3.py), so the rollout phase holds them beside vLLM: the 32B config
    under ZeRO-3 on 2 x 8 x 80 GiB is then 82.8 GiB in rollout, which does not fit."""
    cfg = load_config(CONFIG_32B, validate=False)
    shape, hw = load_model_shape(cfg.model.path), Hardware(gpus_per_node=8, nodes=2, gpu_memory=80 * GiB)
    n, world = shape.num_parameters, 16
    plan = plan_memory(cfg, shape, hw, StrategyChoice("deepspeed", zero_stage=3))
    # by hand: float32 parameter, gradient and master partitions, AdamW moments, one float32 bucket, the engine's
    # gpu_memory_utilization of the GPU and the CUDA reserve
    by_hand = 4 * n // world + 4 * n // world + (4 + 8) * n // world + 4 * 5 * 10 ** 8 \
        + int(cfg.rollout.gpu_memory_utilization * 80 * GiB) + 2 * GiB
    assert plan.phase_total("rollout") == pytest.approx(by_hand, abs=16)
    assert 82.7 * GiB < plan.phase_total("rollout") < 82.9 * GiB and not plan.fits
    ran = vlrft("plan", CONFIG_32B, "--gpus", "8", "--nodes", "2", "--strategy", "deepspeed", "--zero-stage", "3")
    assert ran.returncode == 1 and "DOES NOT FIT: peak 82.8 GiB (rollout)" in ran.stdout
    # ZeRO-2 frees its gradient partition after each step, and its one reduce bucket after each backward
    # (stage_1_and_2.py: setup_buckets / _release_ipg_buffers): training only
    zero2 = plan_memory(cfg, shape, hw, StrategyChoice("deepspeed", zero_stage=2))
    assert "rollout" not in next(c for c in zero2.components if c.name == "gradients").phases
    buffers = next(c for c in zero2.components if c.name == "buffers")
    assert buffers.bytes == 4 * 5 * 10 ** 8 and buffers.phases == ("train",)


def test_model_dtype_changes_the_plan(vlrft):
    """model.dtype=float32: no autocast, a float32 reference, and the engine given float32 weights (4 B each)."""
    shape = load_model_shape("Qwen/Qwen2.5-VL-7B-Instruct")
    n, hw = shape.num_parameters, Hardware(gpus_per_node=8, gpu_memory=80 * GiB)
    from vlrft.plan import plan_for_config

    plans = {dtype: plan_for_config(load_config(CONFIG_7B, [f"model.dtype={dtype}", "algorithm.kl_coef=0.1"],
                                                validate=False), hw) for dtype in ("bfloat16", "float32")}
    low, full = plans["bfloat16"], plans["float32"]
    assert low.component("engine_weights") == 2 * n and full.component("engine_weights") == 4 * n
    assert low.component("reference") == 2 * n // 8 and full.component("reference") == 4 * n // 8
    assert full.component("activations") > low.component("activations")
    assert full.phase_total("train") > low.phase_total("train") + 5 * GiB
    # overrides after the options, as after the config
    after = vlrft("plan", CONFIG_7B, "--gpus", "8", "model.dtype=float32", "algorithm.kl_coef=0.1", "--json")
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout)["per_gpu_bytes"]["engine_weights"] == 4 * n
    with pytest.raises(SystemExit) as refused:  # an unknown option is still argparse's error
        vlrft("plan", CONFIG_7B, "--gpus", "8", "--no-such-option")
    assert refused.value.code == 2


def test_deepspeed_reference_is_sharded_and_offload_takes_the_gradients_off_the_gpu():
    """The reference is an inference ZeRO-3 engine under either stage (`DeepSpeedStrategy.ds_config`); with
    offload_optimizer DeepSpeed keeps the float32 gradient partitions on the CPU with the master weights and moments."""
    cfg = load_config(CONFIG_7B, ["algorithm.kl_coef=0.1"], validate=False)
    shape = load_model_shape(cfg.model.path)
    n, hw = shape.num_parameters, Hardware(gpus_per_node=8, gpu_memory=80 * GiB)
    for stage in (2, 3):
        plan = plan_memory(cfg, shape, hw, StrategyChoice("deepspeed", zero_stage=stage))
        assert plan.component("reference") == 2 * n // 8, stage  # bf16, 1/8 (was 2 n, replicated, at stage 2)
        assert plan.component("gradients") == 4 * n // 8
        off = plan_memory(cfg, shape, hw, StrategyChoice("deepspeed", zero_stage=stage, offload_optimizer=True))
        assert off.component("gradients") == 0 and off.component("optimizer") == 0, stage
        host = next(c for c in off.host if c.name == "offloaded_state")
        assert host.bytes == (4 + 4 + 8) * n  # the node's 8 ranks: float32 master, gradients, AdamW moments


def _hand_kv_per_token(shipped: str) -> int:
    """Keys and values of one token in every layer, in elements, from transformers' reading of a shipped config.json
    (not vlrft's): layers x kv heads x head_dim x 2."""
    from transformers import AutoConfig

    raw = json.loads(shipped_config_path(shipped).read_text())
    text = AutoConfig.for_model(raw.pop("model_type"), **raw).get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim


@pytest.mark.parametrize("recipe, shipped, lean", [
    ("gemma3_4b_grpo_geometry3k.yaml", "google/gemma-3-4b-it", False),
    ("internvl3_8b_grpo_geometry3k.yaml", "OpenGVLab/InternVL3-8B-hf", True),
    ("smolvlm2_2b_grpo_geometry3k.yaml", "HuggingFaceTB/SmolVLM2-2.2B-Instruct", True),
    ("internvl3_8b_grpo_geometry3k.yaml", "llava-hf/llava-onevision-qwen2-7b-ov-hf", True)])
def test_the_one_d_families_are_counted_with_the_group_decoder_that_samples_them(recipe, shipped, lean):
    """Gemma 3, InternVL 3, LLaVA-OneVision and SmolVLM sample through the group decoder at 1-D positions (vlrft.
    sampling.hf_decoder): InternVL 3, LLaVA-OneVision and SmolVLM through the lean step, each prompt's KV held once
    for its group (bf16 under bf16 autocast); Gemma 3 (sliding-window layers), and any family with
    rollout.lean_decode=false, through transformers' layers, every row its prompt's copy (float32 keys, bf16 values
    under autocast). Each prompt is prefilled once either way: no `generate` score tensors, no prompt repeated n
    times."""
    cfg = load_config(REPO / "configs" / recipe, [f"model.path={shipped}"], validate=False)
    hw = Hardware(gpus_per_node=8, gpu_memory=80 * GiB)
    shape = load_model_shape(shipped)
    prompts = cfg.prompts_per_step // hw.world_size
    rows, prompt, new = prompts * cfg.rollout.n, cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
    per_token = _hand_kv_per_token(shipped) // 2  # keys (or values) of one token
    for lean_decode in (True, False):
        run = replace(cfg, rollout=replace(cfg.rollout, lean_decode=lean_decode))
        mixed = plan_memory(run, shape, hw, StrategyChoice("fsdp2"))
        float32 = plan_memory(run, shape, hw, StrategyChoice("fsdp2", mixed_precision=False))
        [kv] = [c for c in mixed.components if c.name == "engine_kv_cache"]
        if lean and lean_decode:
            shared = (prompts * prompt + rows * new) * per_token
            assert (mixed.component("engine_kv_cache"), float32.component("engine_kv_cache")) == \
                (shared * (2 + 2), shared * (4 + 4))
            assert "lean group decoder" in kv.note
        else:
            every_row = rows * (prompt + new) * per_token
            assert (mixed.component("engine_kv_cache"), float32.component("engine_kv_cache")) == \
                (every_row * (4 + 2), every_row * (4 + 4))
            assert "transformers' layers" in kv.note
        assert mixed.component("engine_scores") == 0
        [prefill] = [c for c in mixed.components if c.name == "engine_prefill"]
        assert "repeated" not in prefill.note


def test_a_qwen_family_keeps_the_grouped_kv_figure_and_glm_decodes_through_transformers_layers():
    """The families the group decoder takes: Qwen2/2.5/3-VL with the lean step hold each prompt once (bf16 under
    autocast); GLM-4.1V and Qwen3-VL-MoE decode through transformers' layers (every row its prompt, float32 keys)."""
    hw = Hardware(gpus_per_node=8, gpu_memory=80 * GiB)
    for shipped, grouped in [("Qwen/Qwen2.5-VL-7B-Instruct", True), ("Qwen/Qwen3-VL-4B-Instruct", True),
                             ("Qwen/Qwen3-VL-30B-A3B-Instruct", False), ("THUDM/GLM-4.1V-9B-Thinking", False)]:
        cfg = load_config(CONFIG_7B, ["rollout.engine=hf", f"model.path={shipped}"], validate=False)
        prompts = cfg.prompts_per_step // hw.world_size
        rows, prompt, new = prompts * cfg.rollout.n, cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
        per_token = _hand_kv_per_token(shipped) // 2
        plan = plan_memory(cfg, load_model_shape(shipped), hw, StrategyChoice("fsdp2"))
        expected = (prompts * prompt + rows * new) * per_token * (2 + 2) if grouped else \
            rows * (prompt + new) * per_token * (4 + 2)
        assert plan.component("engine_kv_cache") == expected, shipped
        assert plan.component("engine_scores") == 0


def test_every_family_decodes_the_way_the_plan_counts(tiny_vlm_dir):
    """vlrft.sampling.hf_decoder is the one table the engine and the plan read: every supported family samples
    through the group decoder (by its M-RoPE rule, or at 1-D positions where it has none), the lean step for exactly
    those whose text decoder it takes."""
    from vlrft.decoding.lean_weights import unsupported_reason
    from vlrft.decoding.transformers_layers import text_model_of
    from vlrft.models.actor import split_head
    from vlrft.models.loading import load_policy
    from vlrft.models.positions import has_rope_index
    from vlrft.plan.architecture import SUPPORTED
    from vlrft.sampling import ONE_D_POSITION_FAMILIES, hf_decoder

    for arch in SUPPORTED:
        model = load_policy(tiny_vlm_dir(arch))
        backbone = split_head(model)[0]
        decoder = hf_decoder(model.config.model_type)
        assert model.config.model_type == arch
        assert decoder != "generate", arch
        assert (arch in ONE_D_POSITION_FAMILIES) == (not has_rope_index(backbone)), arch
        text = text_model_of(backbone)
        takes_lean = text is not None and unsupported_reason(text) is None
        assert (decoder == "lean") == takes_lean, (arch, unsupported_reason(text) if text is not None else None)


@pytest.mark.parametrize("mixed_precision", [False, True])
def test_the_cache_the_group_decoder_holds_for_a_tiny_smolvlm_is_the_plans_kv_figure(tiny_vlm_dir, mixed_precision):
    """Measured: the hf engine samples a tiny SmolVLM (1-D positions, a Llama text decoder) through the lean group
    decoder, each prompt's keys and values held once for its group (prompts of SHARED_PROMPT_TOKENS and more) and
    every row's generated positions; their bytes are the plan's engine_kv_cache for the same numbers (bf16 under
    bf16 autocast, float32 without)."""
    from _rollout_helpers import engine_setup

    from vlrft.data import Sample
    from vlrft.decoding.lean import LeanDecoder
    from vlrft.rollout import SamplingParams
    from vlrft.rollout.hf import HFEngine
    from vlrft.sampling import SHARED_PROMPT_TOKENS

    samples = [Sample(id=str(i), prompt=f"Question {i}: describe the shape. " * (16 + i)) for i in range(3)]
    processor, model, tokens, batch = engine_setup(tiny_vlm_dir("smolvlm"), samples)
    longest, group, new = max(len(ids) for ids in batch.prompt_ids), 4, 6
    assert longest >= SHARED_PROMPT_TOKENS
    held = {}
    init = LeanDecoder.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        tensors = [*self.keys, *self.values, *self.shared.keys, *self.shared.values]
        held["bytes"] = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
        held["dtypes"] = {t.dtype for t in tensors}

    LeanDecoder.__init__ = recording
    try:
        autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if mixed_precision else None
        engine = HFEngine(lambda: model, processor, tokens, max_batch_prompts=len(samples), autocast=autocast)
        engine.generate(batch, SamplingParams(n=group, max_new_tokens=new, min_new_tokens=new, temperature=1.0))
    finally:
        LeanDecoder.__init__ = init
    assert held["dtypes"] == {torch.bfloat16 if mixed_precision else torch.float32}
    rows = len(samples) * group
    cfg = load_config(CONFIG_7B, ["rollout.engine=hf", f"rollout.n={group}", f"rollout.max_new_tokens={new}",
                                  f"rollout.global_batch_completions={rows}", f"data.max_prompt_length={longest}"],
                      validate=False)
    shape = shape_from_config(model.config.to_dict())
    plan = plan_memory(cfg, shape, Hardware(gpus_per_node=1), StrategyChoice("single", mixed_precision=mixed_precision),
                       images_per_prompt=0)
    per_token = shape.text.num_layers * shape.text.kv_dim * (2 + 2 if mixed_precision else 4 + 4)
    assert plan.component("engine_kv_cache") == (len(samples) * longest + rows * new) * per_token == held["bytes"]
