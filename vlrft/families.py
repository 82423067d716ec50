"""The model families vlrft trains, and what each supports: the one table every other place reads.

A `Family` says, by the `model_type` of a checkpoint's config.json, which rollout engines take it, whether its videos
train, whether its prompts are shared by their group in the training forward and in the hf engine's sampling, which
decoder the hf engine samples it with, and the shipped configs (configs/*.yaml) that use it. Each `Cell` is either
supported, naming the pytest node ids that execute it (tests/test_families.py checks they exist), or refused, with
the one-line reason vlrft gives when asked for it. Loading (`vlrft.models.loading`), the engines' refusals
(`vlrft.rollout`), the data layer's video refusal (`vlrft.data.processor`), the hf decoder's choice
(`vlrft.sampling.hf_decoder`), the memory plan, `vlrft env` and the README's table
(`vlrft.families_markdown`) all read it.

A new family: a `Family` here (each ✔ with the tests that run it), a tiny builder in `vlrft.models.tiny`, a shape rule
in `vlrft.plan.architecture`; then paste `vlrft env --families-markdown` into the README. Pure data (no vlrft import):
every layer can read it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Rollout engines (`rollout.engine`), in the order config errors list them.
ENGINES = ("hf", "vllm", "sglang", "vllm_server")
# How the hf engine samples a family by default (vlrft.sampling.hf_decoder; docs/decoding.md): the lean group decoder,
# the group decoder through transformers' layers, or transformers' `generate`.
HF_DECODERS = ("lean", "transformers_layers", "generate")


@dataclass(frozen=True)
class Cell:
    """One (family, feature) cell: supported, with the tests that execute it, or refused, with why.

    `note`: a one-line caveat of a supported cell (a part of it refused, with why; or how it is done)."""

    tests: tuple[str, ...] = ()  # pytest node ids (tests/FILE.py::test_name[param-id]) that execute it
    refused: str = ""  # why vlrft refuses it, one line, as the refusal says it
    note: str = ""

    def __post_init__(self):
        if bool(self.tests) == bool(self.refused):
            raise ValueError(f"a Cell is either supported with tests or refused with a reason: {self}")
        if self.note and self.refused:
            raise ValueError(f"a refused Cell takes no note: {self}")

    @property
    def supported(self) -> bool:
        return bool(self.tests)


@dataclass(frozen=True)
class Claim:
    """A further fact about a family (`vlrft env` prints it), with the tests that execute it."""

    text: str
    tests: tuple[str, ...]


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type
    name: str  # as the user knows it
    processor: str  # its transformers processor class
    images: str  # how its processor encodes an image, in a few words
    hf: Cell
    vllm: Cell
    vllm_server: Cell
    sglang: Cell
    video: Cell  # videos in the data: trained, and sampled by the hf engine
    training_shares_prompt: Cell  # a group's prompt computed once in the training forward
    sampling_shares_prompt: Cell  # the hf engine prefills each prompt once for its group (the group decoder)
    hf_decoder: str  # one of HF_DECODERS: the hf engine's decoder with rollout.lean_decode on and SDPA attention
    lean_text_model: str = ""  # the text decoder class the lean decode step takes (hf_decoder == "lean")
    configs: tuple[str, ...] = ()  # shipped configs of this family (configs/NAME)
    claims: tuple[Claim, ...] = ()

    def __post_init__(self):
        if self.hf_decoder not in HF_DECODERS:
            raise ValueError(f"{self.model_type}: hf_decoder {self.hf_decoder!r} is not one of {HF_DECODERS}")
        if (self.hf_decoder == "lean") != bool(self.lean_text_model):
            raise ValueError(f"{self.model_type}: a lean text model is named exactly for the lean decoder")
        if self.sampling_shares_prompt.supported != (self.hf_decoder != "generate"):
            raise ValueError(f"{self.model_type}: only the group decoder shares a prompt in sampling")
        if not self.hf.supported:
            raise ValueError(f"{self.model_type}: every family samples with the hf engine")

    def engine(self, name: str) -> Cell:
        if name not in ENGINES:
            raise ValueError(f"unknown rollout engine {name!r}; expected one of {', '.join(ENGINES)}")
        return getattr(self, name)

    def features(self) -> dict[str, Cell]:
        """Every cell by the name the table gives its column."""
        return {"hf": self.hf, "vllm": self.vllm, "vllm_server": self.vllm_server, "sglang": self.sglang,
                "video": self.video, "training_shares_prompt": self.training_shares_prompt,
                "sampling_shares_prompt": self.sampling_shares_prompt}

    def supported_engines(self) -> tuple[str, ...]:
        return tuple(name for name in ENGINES if self.engine(name).supported)


def _ids(file: str, *names: str) -> tuple[str, ...]:
    return tuple(f"tests/{file}::{name}" for name in names)


# ---------------------------------------------------------------------------------------------- tests of many families


def _hf_engine(arch: str, decoder: str) -> tuple[str, ...]:
    """The hf engine sampling `arch` (tests/test_rollout_hf.py runs these families with both settings of
    share_prompts; the group decoder only where it applies)."""
    return _ids("test_rollout_hf.py", f"test_groups_are_contiguous_and_logprobs_match_the_trainer[{arch}-{decoder}]",
                f"test_min_new_tokens_holds_back_the_stop_tokens[{arch}-{decoder}]")


def _one_d_group_decoder(arch: str) -> tuple[str, ...]:
    """The group decoder at 1-D positions (tests/test_decoding_one_d.py): greedy ids equal `generate`'s, sampled
    logprobs a float64 forward's."""
    return _ids("test_decoding_one_d.py", f"test_greedy_groups_equal_generate_on_each_prompt_alone[{arch}-lean]",
                f"test_sampled_logprobs_equal_a_float64_forward[{arch}]")


def _lean(arch: str) -> tuple[str, ...]:
    return _ids("test_rollout_lean_decode.py", f"test_greedy_ids_and_logprobs_equal_transformers_layers[{arch}]",
                f"test_every_qwen_vl_text_decoder_is_supported[{arch}]")


def _train_steps(arch: str, model_class: str) -> tuple[str, ...]:
    return _ids("test_trainer.py", f"test_vlrft_train_runs_three_grpo_steps[{arch}-{model_class}]")


def _image_tools(arch: str) -> tuple[str, ...]:
    """Multi-turn with an image tool on the hf engine: what it samples is what the trainer scores."""
    return _ids("test_multiturn.py",
                f"test_image_tools_in_a_batch_of_image_prompts_sample_what_the_trainer_scores[{arch}]")


def _vllm(arch: str) -> tuple[str, ...]:
    """vLLM executed on its CPU build (tests/test_vllm_executed.py): sampling, logprobs, weight sync, LoRA, tools."""
    return _ids("test_vllm_executed.py",
                f"test_generates_groups_for_a_mixed_batch_and_repeats_them_under_the_same_seed[{arch}]",
                f"test_engine_logprobs_are_the_sampling_distributions[{arch}-T1]",
                f"test_after_a_sync_the_engine_samples_the_new_weights[{arch}-one-bucket]",
                f"test_lora_policy_is_sent_merged[{arch}]",
                f"test_multi_turn_with_an_image_tool_samples_what_transformers_samples[{arch}]")


def _sglang(arch: str) -> tuple[str, ...]:
    """SGLang does not run on CPU: its own model classes load what our weight sync sends, and our requests are our
    ids and tensors; tests/test_rollout_engines_gpu.py generates with it on a GPU (Qwen2-VL)."""
    return (*_ids("test_rollout_engines.py", f"test_sglang_requests_are_our_ids_and_our_tensors[{arch}]"),
            *_ids("test_engine_contracts.py", "test_sglang_model_classes_load_every_weight_our_sync_sends"))


def _training_shares(arch: str, m_rope: bool) -> tuple[str, ...]:
    tests = _ids("test_actor.py", f"test_logprobs_and_gradients_equal_a_plain_per_sample_transformers_forward[{arch}]")
    if m_rope:
        tests += _ids("test_actor.py", f"test_prompt_computed_once_per_group_equals_the_full_forward[{arch}]")
    return tests


def _fsdp2(arch: str) -> Claim:
    return Claim("FSDP2 on two ranks", _ids("test_families_distributed.py",
                                            f"test_two_fsdp2_ranks_train_two_grpo_steps[{arch}]"))


NO_SGLANG = ("SGLang's own model classes were never checked against this family's weight names and requests "
             "(the tests check the Qwen-VL families)")
EXPANDED_PLACEHOLDERS = ("its image placeholders expand to text around the image tokens, which vlrft's prompt folding "
                         "does not invert")
SERVER_VIDEO_TEST = _ids("test_rollout_server.py", "test_a_video_goes_as_its_sampled_frames_and_metadata_losslessly",
                         "test_a_server_reading_videos_with_its_own_loader_is_named_before_any_video_is_sent")
QWEN3_VIDEOS = ("no videos: timestamp text between a video's frame groups, which vLLM expands itself, cannot keep one "
                "tokenization (rollout.engine=sglang or hf take them)")
MOE_SYNC = ("no videos, as Qwen3-VL; weight sync swaps the fused experts to the released layout, which vLLM's loader "
            "takes (vlrft.models.weights.checkpoint_transposes)")
LLAVA_ONE_IMAGE = ("one image a prompt: its processor gives each image of several one crop, vLLM's crops every image "
                   "as if alone (rollout.engine=hf takes several)")


def _server(arch: str) -> tuple[str, ...]:
    """A real vLLM server (tests/test_vllm_server_families.py): our prompt ids run, float64-reference logprobs, a
    weight sync with a stale control, the colocated engine's per-prompt refusals."""
    return _ids("test_vllm_server_families.py", "test_the_server_runs_our_prompts_with_the_policys_logprobs_and_syncs"
                                                f"_to_new_weights[{arch}]") + SERVER_VIDEO_TEST


FAMILIES: tuple[Family, ...] = (
    Family(
        "qwen2_vl", "Qwen2-VL", "Qwen2VLProcessor", "a grid of 14 px patches, 2 x 2 merged",
        hf=Cell(_hf_engine("qwen2_vl", "group-decoder") + _lean("qwen2_vl") + _ids(
            "test_trainer.py", "test_a_run_leaves_metrics_tensorboard_completions_checkpoints_and_config")),
        vllm=Cell(_vllm("qwen2_vl") + _ids("test_vllm_executed.py",
                                           "test_three_steps_of_vlrft_train_with_vllm_from_the_demo_config")),
        vllm_server=Cell(_ids("test_vllm_server_engine.py",
                              "test_the_server_samples_our_prompts_and_after_a_sync_the_new_weights",
                              "test_three_steps_of_vlrft_train_through_the_server[0]",
                              "test_multi_turn_with_an_image_tool_through_the_server",
                              "test_a_video_through_the_server_runs_our_frames_with_the_policys_logprobs")
                         + SERVER_VIDEO_TEST),
        sglang=Cell(_sglang("qwen2_vl") + _ids("test_rollout_engines_gpu.py",
                                               "test_generate_samples_groups_from_our_prompts[sglang]")),
        video=Cell(_ids("test_data_model_inputs.py", "test_batched_forward_matches_each_prompt_alone[qwen2_vl]")
                   + _ids("test_positions.py", "test_text_after_a_long_video_starts_past_the_videos_largest_position"
                                               "[qwen2-vl-longer-in-time-than-space]")
                   + _ids("test_vllm_executed.py", "test_trainers_logprobs_equal_the_engines_at_temperature_one"
                                                   "[qwen2_vl]")),
        training_shares_prompt=Cell(_training_shares("qwen2_vl", m_rope=True)),
        sampling_shares_prompt=Cell(_ids("test_rollout_hf.py", "test_group_decoder_and_transformers_generate_agree"
                                                              "[qwen2_vl]") + _ids(
            "test_rollout_lean_decode.py", "test_a_prompt_held_once_per_group_samples_what_transformers_layers_sample"
                                           "[qwen2_vl]")),
        hf_decoder="lean", lean_text_model="Qwen2VLTextModel",
        configs=("demo.yaml", "zoom_demo.yaml"),
        claims=(Claim("FSDP2 and DeepSpeed ZeRO-3 on two ranks under torchrun, equal to one process", _ids(
                    "test_fsdp2.py", "test_fsdp2_weights_equal_the_single_process_run_after_1_and_3_steps") + _ids(
                    "test_deepspeed.py", "test_zero_weights_equal_the_single_process_run_after_1_and_3_steps[Z3]")),
                Claim("rollouts ahead of training on vLLM servers (rollout.max_staleness=1)", _ids(
                    "test_vllm_server_engine.py", "test_three_steps_of_vlrft_train_through_the_server[1]"))),
    ),
    Family(
        "qwen2_5_vl", "Qwen2.5-VL", "Qwen2_5_VLProcessor", "a grid of 14 px patches, 2 x 2 merged",
        hf=Cell(_lean("qwen2_5_vl")),
        vllm=Cell(_vllm("qwen2_5_vl")),
        vllm_server=Cell(_ids("test_vllm_server.py", "test_synced_server_computes_with_the_trainers_weights",
                              "test_a_sync_reaches_the_vision_tower_past_the_servers_encoder_cache")
                         + _server("qwen2_5_vl")),
        sglang=Cell(_sglang("qwen2_5_vl")),
        video=Cell(_ids("test_data_model_inputs.py", "test_batched_forward_matches_each_prompt_alone[qwen2_5_vl]")
                   + _ids("test_positions.py", "test_text_after_a_long_video_starts_past_the_videos_largest_position"
                                               "[qwen2.5-vl-4-temporal-patches]")
                   + _ids("test_vllm_executed.py", "test_trainers_logprobs_equal_the_engines_at_temperature_one"
                                                   "[qwen2_5_vl]")),
        training_shares_prompt=Cell(_training_shares("qwen2_5_vl", m_rope=True)),
        sampling_shares_prompt=Cell(_ids(
            "test_rollout_lean_decode.py", "test_a_prompt_held_once_per_group_samples_what_transformers_layers_sample"
                                           "[qwen2_5_vl]")),
        hf_decoder="lean", lean_text_model="Qwen2_5_VLTextModel",
        configs=("qwen2_5_vl_3b_grpo_chartqa.yaml", "qwen2_5_vl_3b_grpo_clevr.yaml",
                 "qwen2_5_vl_3b_grpo_geometry3k.yaml", "qwen2_5_vl_3b_grpo_mathvista.yaml",
                 "qwen2_5_vl_3b_grpo_refcoco.yaml", "qwen2_5_vl_3b_grpo_videoqa.yaml",
                 "qwen2_5_vl_3b_ppo_geometry3k.yaml", "qwen2_5_vl_3b_rloo_geometry3k.yaml",
                 "qwen2_5_vl_7b_grpo_geometry3k.yaml", "qwen2_5_vl_7b_grpo_geometry3k_servers.yaml",
                 "qwen2_5_vl_32b_grpo_geometry3k.yaml", "qwen2_5_vl_72b_grpo_geometry3k.yaml"),
        claims=(Claim("weight sync to vLLM servers on any node (rollout.weight_transfer=gloo), a 3-step vlrft train "
                      "included", _ids("test_vllm_server_gloo.py",
                                       "test_a_gloo_sync_makes_the_server_compute_with_the_trainers_weights",
                                       "test_three_steps_of_vlrft_train_sync_the_server_over_gloo")),),
    ),
    Family(
        "qwen3_vl", "Qwen3-VL", "Qwen3VLProcessor", "a grid of 16 px patches, 2 x 2 merged",
        hf=Cell(_lean("qwen3_vl")),
        vllm=Cell(_vllm("qwen3_vl") + _ids("test_rollout_engines.py",
                                           "test_vllm_refuses_qwen3_vl_video_naming_the_sample"), note=QWEN3_VIDEOS),
        vllm_server=Cell(_server("qwen3_vl"), note=QWEN3_VIDEOS),
        sglang=Cell(_sglang("qwen3_vl")),
        video=Cell(_ids("test_actor.py", "test_qwen3_vl_video_rows_equal_a_plain_per_row_forward[qwen3_vl]")
                   + _ids("test_data_processor.py", "test_mixed_batch_matches_processing_each_sample_alone[qwen3_vl]")),
        training_shares_prompt=Cell(_training_shares("qwen3_vl", m_rope=True)),
        sampling_shares_prompt=Cell(_ids(
            "test_rollout_lean_decode.py", "test_a_prompt_held_once_per_group_samples_what_transformers_layers_sample"
                                           "[qwen3_vl]")),
        hf_decoder="lean", lean_text_model="Qwen3VLTextModel",
        configs=("qwen3_vl_4b_reinforce_pp_geometry3k.yaml",),
    ),
    Family(
        "qwen3_vl_moe", "Qwen3-VL-MoE", "Qwen3VLProcessor", "a grid of 16 px patches, 2 x 2 merged",
        hf=Cell(_hf_engine("qwen3_vl_moe", "group-decoder")
                + _train_steps("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration")),
        vllm=Cell(_ids("test_vllm_executed_moe.py", "test_qwen3_vl_moe_sync_sends_every_expert_in_the_released_layout")
                  + _ids("test_rollout_engines.py", "test_fused_moe_experts_are_sent_in_the_released_layout"),
                  note=MOE_SYNC),
        vllm_server=Cell(_server("qwen3_vl_moe"), note="no videos, as Qwen3-VL; the experts synced as on vllm"),
        sglang=Cell(refused=NO_SGLANG),
        video=Cell(_ids("test_actor.py", "test_qwen3_vl_video_rows_equal_a_plain_per_row_forward[qwen3_vl_moe]")),
        training_shares_prompt=Cell(_training_shares("qwen3_vl_moe", m_rope=True)),
        sampling_shares_prompt=Cell(_ids("test_rollout_hf.py", "test_group_decoder_and_transformers_generate_agree"
                                                              "[qwen3_vl_moe]")),
        hf_decoder="transformers_layers",
        claims=(_fsdp2("qwen3_vl_moe"),
                Claim("LoRA on attention, the vision tower and, when named (experts.gate_up_proj, "
                      "experts.down_proj), every expert; routers by full fine-tuning only, with the router "
                      "load-balancing loss (algorithm.router_aux_loss_coef, equal to transformers' aux_loss; refused "
                      "under LoRA)",
                      _ids("test_models.py", "test_qwen3_vl_moe_lora_wraps_attention_and_its_experts_when_named")
                      + _ids("test_router_loss.py", *(
                          "test_router_loss_equals_transformers_aux_loss_with_padding_and_reaches_the_routers"
                          f"[{path}]" for path in ("shared-classes", "shared-one-call", "full-rows")),
                          "test_router_loss_is_refused_under_lora_and_for_a_dense_model",
                          "test_vlrft_train_logs_the_router_loss_and_refuses_it_under_lora")
                      + _ids("test_trainer.py", "test_vlrft_train_with_lora_on_qwen3_vl_moe_experts")
                      + _ids("test_families_distributed.py",
                             "test_two_fsdp2_ranks_train_two_grpo_steps[qwen3_vl_moe-lora-experts]"))),
    ),
    Family(
        "glm4v", "GLM-4.1V", "Glm4vProcessor", "a grid of 14 px patches, 2 x 2 merged",
        hf=Cell(_hf_engine("glm4v", "group-decoder") + _train_steps("glm4v", "Glm4vForConditionalGeneration")),
        vllm=Cell(_vllm("glm4v")),
        vllm_server=Cell(_server("glm4v")),
        sglang=Cell(refused=NO_SGLANG),
        video=Cell(refused="its frames are <|image|> tokens between <|begin_of_video|> and <|end_of_video|> with "
                           "timestamps between them, which vlrft's token types and position rule do not follow yet"),
        training_shares_prompt=Cell(_training_shares("glm4v", m_rope=True)),
        sampling_shares_prompt=Cell(_ids("test_rollout_hf.py", "test_group_decoder_and_transformers_generate_agree"
                                                              "[glm4v]")),
        hf_decoder="transformers_layers",
        configs=("glm4_1v_9b_grpo_geometry3k.yaml",),
        claims=(_fsdp2("glm4v"),),
    ),
    Family(
        "gemma3", "Gemma 3", "Gemma3Processor", "one 896 px image, 256 tokens",
        hf=Cell(_hf_engine("gemma3", "group-decoder")
                + _train_steps("gemma3", "Gemma3ForConditionalGeneration")
                + _image_tools("gemma3")),
        vllm=Cell(refused=EXPANDED_PLACEHOLDERS),
        vllm_server=Cell(refused=EXPANDED_PLACEHOLDERS),
        sglang=Cell(refused=EXPANDED_PLACEHOLDERS),
        video=Cell(refused="its processor takes no videos"),
        training_shares_prompt=Cell(refused="1-D positions, sliding-window layers and bidirectional attention over "
                                            "each image, which the shared forward's prompt caches do not follow: "
                                            "each row runs in full"),
        sampling_shares_prompt=Cell(_one_d_group_decoder("gemma3")),
        hf_decoder="transformers_layers",
        configs=("gemma3_4b_grpo_geometry3k.yaml",),
        claims=(_fsdp2("gemma3"),),
    ),
    Family(
        "internvl", "InternVL 3", "InternVLProcessor", "448 px tiles, as many as its aspect ratio asks",
        hf=Cell(_hf_engine("internvl", "group-decoder")
                + _train_steps("internvl", "InternVLForConditionalGeneration")
                + _image_tools("internvl")),
        vllm=Cell(_vllm("internvl")),
        vllm_server=Cell(_server("internvl")),
        sglang=Cell(refused=NO_SGLANG),
        video=Cell(refused="its frames are images (<img> tiles) merged into pixel_values in text order, which "
                           "vlrft's visual layout does not follow yet"),
        training_shares_prompt=Cell(_training_shares("internvl", m_rope=False) + _ids(
            "test_actor.py", "test_prompt_sharing_under_gradient_checkpointing_equals_the_full_forward[internvl]")),
        sampling_shares_prompt=Cell(_one_d_group_decoder("internvl")),
        hf_decoder="lean", lean_text_model="Qwen2Model",
        configs=("internvl3_8b_grpo_geometry3k.yaml",),
        claims=(_fsdp2("internvl"),),
    ),
    Family(
        "llava_onevision", "LLaVA-OneVision", "LlavaOnevisionProcessor", "anyres crops with image_sizes",
        hf=Cell(_hf_engine("llava_onevision", "group-decoder")
                + _train_steps("llava_onevision", "LlavaOnevisionForConditionalGeneration")),
        vllm=Cell(_vllm("llava_onevision") + _ids(
            "test_rollout_engines.py",
            "test_vllm_requests_of_llava_onevision_fold_images_alone_and_refuse_images_encoded_together"),
            note=LLAVA_ONE_IMAGE),
        vllm_server=Cell(_server("llava_onevision") + _ids(
            "test_rollout_engines.py",
            "test_vllm_requests_of_llava_onevision_fold_images_alone_and_refuse_images_encoded_together"),
            note=LLAVA_ONE_IMAGE),
        sglang=Cell(refused=NO_SGLANG),
        video=Cell(_ids("test_actor.py", "test_llava_onevision_video_rows_equal_a_plain_per_row_forward")
                   + _ids("test_rollout_hf.py", "test_llava_onevision_samples_after_a_video_with_the_trainers_logprobs")
                   + _ids("test_vllm_executed.py", "test_trainers_logprobs_equal_the_engines_at_temperature_one"
                                                   "[llava_onevision]"),
                   note="each video data.video_max_frames frames: its forward takes one frame count per batch"),
        training_shares_prompt=Cell(_training_shares("llava_onevision", m_rope=False) + _ids(
            "test_actor.py", "test_prompt_sharing_under_gradient_checkpointing_equals_the_full_forward"
                             "[llava_onevision]")),
        sampling_shares_prompt=Cell(_one_d_group_decoder("llava_onevision")),
        hf_decoder="lean", lean_text_model="Qwen2Model",
        claims=(_fsdp2("llava_onevision"),),
    ),
    Family(
        "smolvlm", "SmolVLM", "SmolVLMProcessor", "384 px tiles plus the whole image",
        hf=Cell(_hf_engine("smolvlm", "group-decoder")
                + _train_steps("smolvlm", "SmolVLMForConditionalGeneration")
                + _image_tools("smolvlm")),
        vllm=Cell(_vllm("smolvlm") + _ids("test_rollout_engines.py",
                                          "test_vllm_requests_of_smolvlm_are_one_image_token_an_image_without_its_tiles")),
        vllm_server=Cell(_server("smolvlm")),
        sglang=Cell(refused=NO_SGLANG),
        video=Cell(refused="its processor writes a video as timestamped frames of <image> tokens and returns them as "
                           "image pixels, which vlrft's video batches and token types do not follow yet"),
        training_shares_prompt=Cell(_training_shares("smolvlm", m_rope=False)),
        sampling_shares_prompt=Cell(_one_d_group_decoder("smolvlm")),
        hf_decoder="lean", lean_text_model="LlamaModel",
        configs=("smolvlm2_2b_grpo_geometry3k.yaml",),
        claims=(_fsdp2("smolvlm"),),
    ),
)
BY_MODEL_TYPE: dict[str, Family] = {f.model_type: f for f in FAMILIES}
MODEL_TYPES: tuple[str, ...] = tuple(BY_MODEL_TYPE)


def family(model_type: str) -> Family | None:
    """The family of a config.json `model_type`, None for one vlrft does not train."""
    return BY_MODEL_TYPE.get(model_type)


def supported_families() -> str:
    """'Qwen2-VL (qwen2_vl), ...': the families as an error message names them."""
    return ", ".join(f"{f.name} ({f.model_type})" for f in FAMILIES)
