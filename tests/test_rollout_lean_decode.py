"""The lean decode step (vlrft.decoding.lean) computes what transformers' layers compute, per architecture."""

import math

import pytest
import torch

from _rollout_helpers import engine_setup, solid_png
import vlrft.sampling as sampling_module
from vlrft.data import Sample
from vlrft.decoding import graph as graph_module
from vlrft.decoding import lean as lean_module
from vlrft.decoding import prefill, table
from vlrft.decoding.lean import LeanDecoder
from vlrft.decoding.lean_weights import unsupported_reason
from vlrft.decoding.shared_prompt import SharedPrompt
from vlrft.decoding.transformers_layers import TransformersDecoder
from vlrft.models.actor import apply_lora, split_head
from vlrft.rollout.base import FINISH_STOP, SamplingParams
from vlrft.rollout.hf import HFEngine

ARCHS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


@pytest.fixture(scope="module", params=ARCHS)
def setup(request, tiny_vlm_dir, tmp_path_factory):
    red = solid_png(tmp_path_factory.mktemp("imgs"), "red", (220, 30, 30), size=64)
    samples = [Sample(id="a", prompt="<image>What color is the shape?", images=[red]),
               Sample(id="b", prompt="Say something rather longer than the others, please."),
               Sample(id="c", prompt="Hi")]
    return engine_setup(tiny_vlm_dir(request.param), samples, max_pixels=4096)


def _run(setup, sampling, lean: bool, model=None):
    processor, own_model, tokens, batch = setup
    model = model or own_model
    torch.manual_seed(0)
    engine = HFEngine(lambda: model, processor, tokens, share_prompts=True, static_cache=False, lean_decode=lean)
    return engine.generate(batch, sampling)


def _assert_same(a, b, atol=1e-5):
    assert a.completion_ids == b.completion_ids
    assert a.finish_reasons == b.finish_reasons
    for x, y in zip(a.logprobs, b.logprobs):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=atol)


def _prefill(setup):
    """The batch's prompts through the backbone: (text model, prefill output, prompt mask, last prompt positions)."""
    from vlrft.data.processor import left_pad
    from vlrft.models.positions import prompt_positions
    from vlrft.vision import mm_token_type_ids

    _, model, tokens, batch = setup
    backbone, _ = split_head(model)
    ids, mask = left_pad(batch.prompt_ids, tokens.pad_id)
    mm = mm_token_type_ids(ids, tokens.image_token_id, tokens.video_token_id)
    visual = batch.visual.model_inputs()
    positions = prompt_positions(backbone, ids, mask, mm, visual)
    with torch.no_grad():
        out = backbone(input_ids=ids, attention_mask=mask, mm_token_type_ids=mm, position_ids=positions,
                       use_cache=True, **visual)
    return backbone.language_model, out, mask, positions


@pytest.fixture
def lean_steps(monkeypatch):
    """Counts the lean decoder's steps, so a test cannot pass by silently decoding through transformers."""
    calls = []
    step = LeanDecoder.step

    def counted(self, tokens, index):
        calls.append(len(tokens))
        return step(self, tokens, index)

    monkeypatch.setattr(LeanDecoder, "step", counted)
    return calls


def test_every_qwen_vl_text_decoder_is_supported(setup):
    _, model, _, _ = setup
    backbone, _ = split_head(model)
    assert unsupported_reason(backbone.language_model) is None


def test_greedy_ids_and_logprobs_equal_transformers_layers(setup, lean_steps):
    sampling = SamplingParams(n=2, max_new_tokens=12, temperature=0.0)
    lean = _run(setup, sampling, lean=True)
    assert lean_steps, "the lean step was not used"
    _assert_same(lean, _run(setup, sampling, lean=False))


def test_sampling_with_rows_stopping_early_equals_transformers_layers(setup, lean_steps):
    # Many stop ids so that some rows stop early (their rows leave the cache) while others run to the length.
    sampling = SamplingParams(n=4, max_new_tokens=14, temperature=1.0, stop_token_ids=list(range(40, 80)))
    lean = _run(setup, sampling, lean=True)
    _assert_same(lean, _run(setup, sampling, lean=False))
    assert FINISH_STOP in lean.finish_reasons
    assert len(set(lean_steps)) > 1, "no row stopped early, so dropping rows was not exercised"


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers_layers"])
def test_stopped_rows_leave_the_kv_cache_only_once_half_of_its_rows_have_stopped(setup, monkeypatch, lean):
    """Dropping rows copies the whole KV cache. Rows that stop stay in it, computed and not reported, until at most
    half of its rows are still running: a decode call copies it at most log2(rows) times, not once per step in
    which some row stopped. What is sampled is what transformers' layers sample (the test above)."""
    drops: list[tuple[int, int]] = []  # (rows in the cache, rows kept)
    decoder = LeanDecoder if lean else TransformersDecoder
    keep = decoder.keep

    def counted(self, index):
        drops.append((self.position.shape[-1], index.shape[0]))
        return keep(self, index)

    monkeypatch.setattr(decoder, "keep", counted)
    sampling = SamplingParams(n=4, max_new_tokens=14, temperature=1.0, stop_token_ids=list(range(40, 80)))
    out = _run(setup, sampling, lean=lean)
    rows = len(out.completion_ids)
    stop_steps = {len(ids) for ids, reason in zip(out.completion_ids, out.finish_reasons) if reason == FINISH_STOP}
    assert len(stop_steps) > 2, "too few distinct stop steps to show anything"
    assert drops and all(2 * kept <= before for before, kept in drops)
    assert len(drops) <= math.log2(rows)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "in_place"])
def test_lean_hidden_states_equal_the_text_model_at_every_step(setup, packed, monkeypatch):
    """Step by step against the text model with its own KV cache: new tokens' hidden states within 1e-5,
    with the projections packed for oneDNN (CPU float32) and with the weights read in place (as on CUDA)."""

    text_model, out, mask, positions = _prefill(setup)
    with torch.no_grad():
        rows = torch.arange(len(mask))
        if not packed:
            monkeypatch.setattr(lean_module, "packing_applies", lambda weight: False)
        lean = LeanDecoder(text_model, out.past_key_values, rows, mask, positions[0, :, -1], max_new_tokens=5)
        assert (lean.layers[0].qkv.packed is not None) == packed
        cache, attention, position = out.past_key_values, mask.clone(), positions[:, :, -1:].clone()
        generator = torch.Generator().manual_seed(0)
        for step in range(5):
            new = torch.randint(0, text_model.config.vocab_size, (len(mask),), generator=generator)
            attention = torch.cat([attention, torch.ones(len(mask), 1, dtype=attention.dtype)], dim=1)
            position = position + 1
            expected = text_model(input_ids=new[:, None], attention_mask=attention, position_ids=position,
                                  past_key_values=cache, use_cache=True).last_hidden_state[:, -1]
            assert torch.allclose(lean.step(new, step), expected, atol=1e-5), step


def _bf16_autocast():
    """The trainer's mixed precision on GPUs (float32 weights, bf16 matmuls), here on the CPU."""
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _autocast_steps(text_model, lean, caches: dict, mask: torch.Tensor, last_positions: torch.Tensor, steps: int = 5):
    """The same random tokens through `lean` under bf16 autocast and through the text model over each of `caches`
    ("bf16": under that autocast, "fp32": without it); yields (step, lean's hidden states, the text model's by name)."""
    rows = len(mask)
    attention, position = mask.clone(), last_positions.clone()
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        new = torch.randint(0, text_model.config.vocab_size, (rows,), generator=generator)
        attention = torch.cat([attention, torch.ones(rows, 1, dtype=attention.dtype)], dim=1)
        position = position + 1
        expected = {}
        for name, cache in caches.items():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name == "bf16"):
                expected[name] = text_model(input_ids=new[:, None], attention_mask=attention, position_ids=position,
                                            past_key_values=cache, use_cache=True).last_hidden_state[:, -1]
        with _bf16_autocast():
            hidden = lean.step(new, step)
        yield step, hidden, expected


@pytest.mark.slow
def test_lean_steps_under_autocast_compute_what_the_text_model_computes_under_it(setup):
    """Under bf16 autocast (float32 weights) the lean step follows transformers' layers: projections cast once,
    float32 residual and rotary, SDPA; its hidden states are at least 20x closer to the text model's under the same
    autocast than those are to float32's (a rotary table in bf16 instead of float32 measured 0.6-0.9x)."""

    with _bf16_autocast():
        text_model, out, mask, positions = _prefill(setup)
    _, out_fp32, _, _ = _prefill(setup)
    with torch.no_grad():
        with _bf16_autocast():
            lean = LeanDecoder(text_model, out.past_key_values, torch.arange(len(mask)), mask, positions[0, :, -1],
                               max_new_tokens=5)
        assert lean.compute_dtype == torch.bfloat16 and lean.keys[0].dtype == torch.bfloat16
        assert lean.layers[0].qkv.packed is None and lean.layers[0].qkv.views[0][0].dtype == torch.bfloat16
        caches = {"bf16": out.past_key_values, "fp32": out_fp32.past_key_values}
        for step, hidden, expected in _autocast_steps(text_model, lean, caches, mask, positions[:, :, -1:]):
            precision_gap = (expected["fp32"] - expected["bf16"]).abs().max()
            assert precision_gap > 1e-3, "autocast changed nothing: the comparison would prove nothing"
            assert (hidden - expected["bf16"]).abs().max() <= precision_gap / 20, step


@pytest.mark.slow
def test_the_engine_samples_under_the_autocast_it_is_given(setup, lean_steps, fixed_rows_steps):
    """HFEngine(autocast=...) (what the trainer passes: its bf16 autocast on GPUs): lean steps, fixed-shape steps
    and transformers' layers (dynamic cache, or the static one CUDA defaults to, which then decodes on a dynamic one)
    sample the same greedy ids with logprobs within 1e-4 (fixed shapes: within bf16 rounding), and differ from
    float32."""
    processor, model, tokens, batch = setup
    sampling = SamplingParams(n=2, max_new_tokens=10, temperature=0.0)

    def run(lean: bool, graph: bool = False, autocast=_bf16_autocast, static: bool = False):
        engine = HFEngine(lambda: model, processor, tokens, share_prompts=True, static_cache=static, lean_decode=lean,
                          cuda_graph_decode=graph, autocast=autocast)
        return engine.generate(batch, sampling)

    lean = run(lean=True)
    assert lean_steps, "the lean step was not used"
    _assert_same(lean, run(lean=False), atol=1e-4)
    _assert_same(lean, run(lean=False, static=True), atol=1e-4)
    # Fixed shapes attend over every preallocated position (those not reached masked): bf16 SDPA on CPU rounds its
    # output differently for a longer masked row (measured up to 4e-3 in these logprobs on an AVX2 CPU; ids equal).
    # On CUDA a graph and the eager steps of the same fixed shapes are compared (the CUDA tests below).
    _assert_same(lean, fixed := run(lean=True, graph=True), atol=2e-2)
    assert fixed_rows_steps, "the fixed-row decoder was not used"
    def gap(a, b) -> float:
        return max(abs(x - y) for r, q in zip(a.logprobs, b.logprobs) for x, y in zip(r, q))

    assert gap(lean, run(lean=True, autocast=None)) > 1e-4, "the lean steps sampled in float32: autocast not applied"
    assert gap(fixed, run(lean=True, graph=True, autocast=None)) > 1e-4, "the fixed-shape steps ignored autocast"


def _adapted(model, **kwargs):
    """`model` with LoRA adapters on every text projection whose B is not zero (peft starts B at zero: a no-op)."""
    import copy

    adapted = apply_lora(copy.deepcopy(model), rank=4, alpha=8, dropout=0.0, **kwargs)
    for name, parameter in adapted.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.5)
    return adapted.eval()


@pytest.mark.parametrize("layout", ["packed", "in_place"])
@pytest.mark.slow
def test_lora_adapters_decode_through_the_lean_step_as_transformers_does(setup, lean_steps, fixed_rows_steps,
                                                                         monkeypatch, layout):
    """A LoRA-wrapped projection is its base weight plus the adapters' delta: the lean steps (and the fixed-shape
    steps a CUDA graph replays) sample what PEFT's layers sample through transformers, and the adapter matters.
    Packed (CPU float32) or cast (bf16 autocast over float32 weights), the weights are copies with the delta merged;
    read in place (a GPU, FSDP2's bf16 weights), the delta goes through the adapter's two small matrices."""

    if layout == "in_place":
        monkeypatch.setattr(lean_module, "packing_applies", lambda weight: False)
    _, model, _, _ = setup
    adapted = _adapted(model, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    backbone, _ = split_head(adapted)
    assert unsupported_reason(backbone.language_model) is None
    sampling = SamplingParams(n=2, max_new_tokens=8, temperature=0.0)
    lean = _run(setup, sampling, lean=True, model=adapted)
    assert lean_steps, "the lean step was not used for a LoRA model"
    _assert_same(lean, _run(setup, sampling, lean=False, model=adapted), atol=1e-4)
    processor, _, tokens, batch = setup
    fixed = HFEngine(lambda: adapted, processor, tokens, share_prompts=True, cuda_graph_decode=True).generate(batch,
                                                                                                           sampling)
    assert fixed_rows_steps
    _assert_same(lean, fixed, atol=1e-4)
    assert lean.completion_ids != _run(setup, sampling, lean=True).completion_ids  # the adapter changes the samples
    assert not any(getattr(m, "merged", False) for m in adapted.modules())  # the model is untouched (no merge)


def test_a_lora_variant_the_lean_step_cannot_read_as_one_weight_decodes_through_transformers(setup, lean_steps):
    _, model, _, _ = setup
    adapted = _adapted(model, target_modules=["q_proj", "v_proj"])
    backbone, _ = split_head(adapted)
    for module in backbone.language_model.modules():
        if hasattr(module, "use_dora"):
            module.use_dora = {name: True for name in module.lora_A}  # what a DoRA adapter sets
    assert "variant" in unsupported_reason(backbone.language_model)
    _run(setup, SamplingParams(n=2, max_new_tokens=4, temperature=0.0), lean=True, model=adapted)
    assert not lean_steps


@pytest.fixture
def fixed_rows_steps(monkeypatch):
    """Counts the fixed-row decoder's steps (the CUDA graph path's row bookkeeping, eager on CPU)."""
    calls = []
    step = graph_module.FixedRowsDecoder.step

    def counted(self, tokens, index):
        calls.append(len(tokens))
        return step(self, tokens, index)

    monkeypatch.setattr(graph_module.FixedRowsDecoder, "step", counted)
    return calls


@pytest.mark.slow
def test_qwen3_head_norms_apply_to_their_own_heads(setup):
    """Qwen3's q and k head norms (normed as one tensor by the lean step, a weight table of q's heads then k's) with
    weights of their own: ids and logprobs equal transformers' layers (a tiny model's norm weights are all ones)."""
    import copy

    processor, model, tokens, batch = setup
    if model.config.model_type != "qwen3_vl":
        pytest.skip("no head norms")
    varied = copy.deepcopy(model)
    torch.manual_seed(1)
    for layer in varied.model.language_model.layers:
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.weight.data.uniform_(0.2, 2.0)
    sampling = SamplingParams(n=2, max_new_tokens=8)
    setup_varied = (processor, varied, tokens, batch)
    _assert_same(_run(setup_varied, sampling, lean=True), _run(setup_varied, sampling, lean=False))


@pytest.mark.slow
def test_fixed_shape_steps_with_rows_stopping_equal_the_lean_steps(setup, fixed_rows_steps):
    """rollout.cuda_graph_decode's steps (every row, every position; eager off CUDA) sample what the lean steps
    that drop stopped rows sample: same ids, logprobs within 1e-5."""
    processor, model, tokens, batch = setup
    sampling = SamplingParams(n=4, max_new_tokens=14, temperature=1.0, stop_token_ids=list(range(40, 80)))
    torch.manual_seed(0)
    engine = HFEngine(lambda: model, processor, tokens, share_prompts=True, lean_decode=True, cuda_graph_decode=True)
    fixed = engine.generate(batch, sampling)
    assert fixed_rows_steps, "the fixed-row decoder was not used"
    assert len(set(fixed_rows_steps)) > 1, "no row stopped early, so reporting fewer rows was not exercised"
    _assert_same(fixed, _run(setup, sampling, lean=True))


@pytest.mark.slow
def test_off_cuda_the_default_decodes_with_lean_steps_that_drop_stopped_rows(setup, fixed_rows_steps):
    """rollout.cuda_graph_decode left unset means CUDA graphs on a GPU only: on CPU the fixed-shape steps (slower
    there, every row kept) are not taken."""
    processor, model, tokens, batch = setup
    sampling = SamplingParams(n=4, max_new_tokens=14, temperature=1.0, stop_token_ids=list(range(40, 80)))
    torch.manual_seed(0)
    default = HFEngine(lambda: model, processor, tokens, share_prompts=True).generate(batch, sampling)
    assert not fixed_rows_steps
    _assert_same(default, _run(setup, sampling, lean=True))


def test_fixed_shape_lean_steps_restore_and_refuse_to_drop_rows(setup, monkeypatch):
    """What the CUDA graph capture relies on: every step runs on the same shapes, steps after restore() repeat
    the steps before it exactly (the slot, positions and mask advance in place), and a fixed-shape decoder
    cannot change its row count."""

    text_model, out, mask, positions = _prefill(setup)
    with torch.no_grad():
        rows = torch.arange(len(mask))
        fixed = LeanDecoder(text_model, out.past_key_values, rows, mask, positions[0, :, -1], max_new_tokens=4,
                            fixed_shapes=True)
        lean = LeanDecoder(text_model, out.past_key_values, rows, mask, positions[0, :, -1], max_new_tokens=4)
        new = torch.tensor([7, 8, 9])[:len(mask)]
        score_shapes = []
        baddbmm = torch.baddbmm

        def recorded(*args, **kwargs):
            score_shapes.append(tuple(args[0].shape))
            return baddbmm(*args, **kwargs)

        monkeypatch.setattr(torch, "baddbmm", recorded)
        state = fixed.state()
        first = [fixed.step(new + i, i) for i in range(2)]
        fixed.restore(state)
        fixed_shapes, lean_shapes = set(score_shapes), set()
        for i in range(4):
            score_shapes.clear()
            hidden = fixed.step(new + i, i)
            fixed_shapes |= set(score_shapes)
            score_shapes.clear()
            assert torch.allclose(hidden, lean.step(new + i, i), atol=1e-5), i
            lean_shapes |= set(score_shapes)
            if i < 2:
                assert torch.equal(hidden, first[i]), i
        assert len(fixed_shapes) == 1 and len(lean_shapes) == 4  # the lean steps attend over a growing span
        with pytest.raises(RuntimeError, match="keeps every row"):
            fixed.keep(torch.tensor([0]))


@pytest.fixture
def shared_prompt(monkeypatch):
    """Every prompt's KV held once per group (vlrft.sampling.SHARED_PROMPT_TOKENS = 0); counts the shared attention's
    calls, and those made after rows stopped and left the cache (`slots` set)."""
    monkeypatch.setattr(sampling_module, "SHARED_PROMPT_TOKENS", 0)
    calls = {"all": 0, "after_rows_left": 0}
    attend = SharedPrompt.attend

    def counted(self, *args, **kwargs):
        calls["all"] += 1
        calls["after_rows_left"] += self.slots is not None
        return attend(self, *args, **kwargs)

    monkeypatch.setattr(SharedPrompt, "attend", counted)
    return calls


@pytest.mark.slow
def test_a_prompt_held_once_per_group_samples_what_transformers_layers_sample(setup, shared_prompt):
    """Sampled (greedy decodes one row per prompt), with and without rows stopping early (their places in the
    prompt-by-prompt layout left empty): the same ids as transformers' layers over per-row caches, logprobs within
    1e-5."""
    plain = SamplingParams(n=3, max_new_tokens=10, temperature=1.0)
    _assert_same(_run(setup, plain, lean=True), _run(setup, plain, lean=False))
    assert shared_prompt["all"], "the shared prompt cache was not used"
    sampling = SamplingParams(n=4, max_new_tokens=14, temperature=1.0, stop_token_ids=list(range(40, 80)))
    lean = _run(setup, sampling, lean=True)
    _assert_same(lean, _run(setup, sampling, lean=False))
    assert shared_prompt["after_rows_left"], "no row left the cache, so empty places were not exercised"


@pytest.mark.slow
def test_a_shared_prompt_decodes_the_same_in_fixed_shapes(setup, shared_prompt, fixed_rows_steps):
    """The CUDA graph's fixed-shape steps (eager here) over a shared prompt sample what the lean steps sample."""
    processor, model, tokens, batch = setup
    sampling = SamplingParams(n=4, max_new_tokens=14, temperature=1.0, stop_token_ids=list(range(40, 80)))
    torch.manual_seed(0)
    fixed = HFEngine(lambda: model, processor, tokens, share_prompts=True, cuda_graph_decode=True).generate(batch,
                                                                                                         sampling)
    assert fixed_rows_steps and shared_prompt["all"]
    _assert_same(fixed, _run(setup, sampling, lean=True))


def test_a_shared_prompt_under_autocast_is_as_close_to_float32_as_transformers_layers_under_it(setup):
    """Under bf16 autocast the shared prompt's attention is bf16 products over the bf16 cache with a float32 softmax,
    its two halves added in float32 and rounded once, not SDPA: not the same rounding as transformers' layers under
    autocast, so the check is precision. At every step its hidden states (2 rows per prompt, different tokens) are
    about as far from the float32 text model's as transformers' layers under the same autocast are (L2 distance,
    measured 0.99-1.15x on the three architectures; bound 1.5x)."""

    group = 2
    with _bf16_autocast():
        text_model, out, mask, positions = _prefill(setup)
    _, out_fp32, _, _ = _prefill(setup)
    rows = torch.arange(len(mask)).repeat_interleave(group)
    with torch.no_grad():
        with _bf16_autocast():
            lean = LeanDecoder(text_model, out.past_key_values, rows, mask[rows], positions[0, rows, -1],
                               max_new_tokens=5, share_prompt=True)
        assert lean.shared is not None and lean.keys[0].shape[2] == 5  # per row: only the generated positions
        caches = {"bf16": out.past_key_values, "fp32": out_fp32.past_key_values}
        for cache in caches.values():
            cache.batch_repeat_interleave(group)
        for step, hidden, expected in _autocast_steps(text_model, lean, caches, mask[rows], positions[:, rows, -1:]):
            transformers_gap = (expected["fp32"] - expected["bf16"]).norm()
            assert transformers_gap > 1e-3, "autocast changed nothing: the comparison would prove nothing"
            assert (hidden - expected["fp32"]).norm() <= 1.5 * transformers_gap, step


def _held_bytes(decoder, *existing) -> int:
    """Bytes of the storages `decoder` holds that are not those of `existing` tensors (new memory)."""
    seen = {t.untyped_storage().data_ptr() for t in existing}
    held = {}
    tensors = [*decoder.keys, *decoder.values, decoder.mask_bias, decoder.position, decoder.cos, decoder.sin]
    if decoder.shared is not None:
        tensors += [*decoder.shared.keys, *decoder.shared.values, decoder.shared.bias]
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            held[storage.data_ptr()] = storage.nbytes()
    return sum(held.values())


def test_a_shared_prompt_is_not_copied_per_row(setup):
    """What a decode call's KV cache holds beyond the prefill's: per row, every row's copy of its prompt plus its
    generated positions; shared, the generated positions only (the prefill's cache is read in place). 4 rows per
    prompt here."""

    text_model, out, mask, positions = _prefill(setup)
    group, max_new = 4, 6
    rows = torch.arange(len(mask)).repeat_interleave(group)
    cache = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
    held = {}
    with torch.no_grad():
        for share in (False, True):
            decoder = LeanDecoder(text_model, out.past_key_values, rows, mask[rows], positions[0, rows, -1],
                                  max_new_tokens=max_new, share_prompt=share)
            held[share] = _held_bytes(decoder, *cache)
    keys = cache[0]  # [prompts, kv_heads, prompt_len, head_dim]
    per_position = len(cache) * keys.shape[1] * keys.shape[3] * keys.element_size()  # every layer's keys + values
    copies, generated = len(rows) * mask.shape[1] * per_position, len(rows) * max_new * per_position
    assert held[False] >= copies + generated
    assert held[True] < generated + copies / 10  # masks and the rotary table: small here
    with pytest.raises(ValueError, match="each prompt's rows together"):
        LeanDecoder(text_model, out.past_key_values, rows.flip(0), mask[rows], positions[0, rows, -1],
                    max_new_tokens=2, share_prompt=True)


@pytest.mark.parametrize("prompt_offset,n,shared", [(0, 2, True), (1, 2, False), (0, 1, False)],
                         ids=["at_the_threshold", "under_it", "one_row_per_prompt"])
def test_the_default_shares_prompts_from_the_threshold_length_and_groups_of_two(setup, monkeypatch, prompt_offset, n,
                                                                                shared):

    _, _, _, batch = setup
    longest = max(len(ids) for ids in batch.prompt_ids)  # the padded length
    monkeypatch.setattr(sampling_module, "SHARED_PROMPT_TOKENS", longest + prompt_offset)
    made = []
    of = SharedPrompt.of
    monkeypatch.setattr(SharedPrompt, "of", classmethod(lambda cls, *a: made.append(1) or of(*a)))
    _run(setup, SamplingParams(n=n, max_new_tokens=3, temperature=1.0), lean=True)
    assert bool(made) == shared


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers_layers"])
def test_ragged_prompts_prefilled_one_length_at_a_time_sample_what_one_padded_prefill_samples(setup, monkeypatch,
                                                                                             lean):
    """Prompts of different lengths (an image prompt among them) whose padded prefill would need a large attention
    mask are prefilled one length at a time, unpadded, their caches merged: the same ids and logprobs (1e-5) as
    one padded prefill, through the lean steps (shared prompt or not) and transformers' layers alike."""
    _, model, _, batch = setup
    backbone, _ = split_head(model)
    calls = []
    forward = type(backbone).forward

    def counted(self, *args, **kwargs):
        calls.append((kwargs["input_ids"].shape, int(kwargs["attention_mask"].min()), "pixel_values" in kwargs))
        return forward(self, *args, **kwargs)

    sampling = SamplingParams(n=3, max_new_tokens=8, temperature=1.0, stop_token_ids=list(range(40, 80)))
    one_call = _run(setup, sampling, lean=lean)
    monkeypatch.setattr(prefill, "PREFILL_MASK_ELEMENTS", 0)
    monkeypatch.setattr(type(backbone), "forward", counted)
    for shared in (0, 1 << 30):
        monkeypatch.setattr(sampling_module, "SHARED_PROMPT_TOKENS", shared)
        calls.clear()
        _assert_same(_run(setup, sampling, lean=lean), one_call)
        prefills = [call for call in calls if call[0][1] > 1]  # not the decode steps (one token each)
        lengths = sorted({len(ids) for ids in batch.prompt_ids})
        assert sorted(shape[1] for shape, _, _ in prefills) == lengths  # one call per length, none padded
        assert all(unpadded == 1 for _, unpadded, _ in prefills) and sum(image for _, _, image in prefills) == 1
        if not lean:
            break  # the transformers layers never share a prompt


def test_a_call_prefills_its_prompts_a_token_budget_at_a_time(setup, monkeypatch):
    """A decode call takes all the rank's prompts; their prefill holds a layer's activations of every token it runs,
    so above PREFILL_TOKENS padded tokens it runs in groups (longest first, each padded to its own longest), their
    caches merged: the same ids and logprobs as one call, no call over the budget but a prompt longer than it."""
    _, model, _, batch = setup
    backbone, _ = split_head(model)
    calls = []
    forward = type(backbone).forward

    def counted(self, *args, **kwargs):
        calls.append(tuple(kwargs["input_ids"].shape))
        return forward(self, *args, **kwargs)

    sampling = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, stop_token_ids=list(range(40, 80)))
    one_call = _run(setup, sampling, lean=True)
    lengths = sorted(len(ids) for ids in batch.prompt_ids)
    budget = lengths[-1] + lengths[0]  # the longest prompt with the shortest, not with the middle one
    monkeypatch.setattr(prefill, "PREFILL_TOKENS", budget)
    monkeypatch.setattr(type(backbone), "forward", counted)
    _assert_same(_run(setup, sampling, lean=True), one_call)
    prefills = [shape for shape in calls if shape[1] > 1]
    assert len(prefills) > 1 and all(rows * width <= max(budget, lengths[-1]) for rows, width in prefills)
    assert sum(rows for rows, _ in prefills) == len(lengths)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device and none is visible")


@pytest.fixture
def on_gpu(setup, monkeypatch):
    """(processor, the model on the GPU, tokens, batch, captures): captures lists the compute dtype (None: float32)
    of each decoder a CUDA graph was captured for."""
    import copy

    processor, model, tokens, batch = setup
    captures = []
    init = graph_module.CudaGraphDecoder.__init__

    def counted(self, decoder):
        init(self, decoder)
        captures.append(decoder.compute_dtype)

    monkeypatch.setattr(graph_module.CudaGraphDecoder, "__init__", counted)
    return processor, copy.deepcopy(model).cuda().eval(), tokens, batch, captures


@needs_cuda
def test_cuda_graph_decoding_equals_eager_lean_steps_on_cuda(on_gpu):
    """On a GPU: the replayed graph samples what eager lean steps sample (greedy: same ids, logprobs within 1e-4),
    with rows stopping early, and the graph was really captured."""
    processor, gpu_model, tokens, batch, captures = on_gpu
    sampling = SamplingParams(n=3, max_new_tokens=16, temperature=0.0, stop_token_ids=list(range(40, 80)))
    runs = {}
    for graph in (True, False):
        engine = HFEngine(lambda: gpu_model, processor, tokens, share_prompts=True, lean_decode=True,
                          cuda_graph_decode=graph)
        runs[graph] = engine.generate(batch, sampling)
    assert captures, "no CUDA graph was captured"
    _assert_same(runs[True], runs[False], atol=1e-4)
    short = SamplingParams(n=3, max_new_tokens=2, temperature=0.0)  # no room for the capture's warm-up steps
    _assert_same(*(HFEngine(lambda: gpu_model, processor, tokens, share_prompts=True, lean_decode=True,
                            cuda_graph_decode=graph).generate(batch, short) for graph in (True, False)), atol=1e-4)


@needs_cuda
def test_on_cuda_the_default_replays_a_cuda_graph(on_gpu):
    """rollout.cuda_graph_decode left unset: a GPU decodes through a captured CUDA graph (measured 3.8-4.3x the eager
    lean steps' tokens/s on an H100)."""
    processor, gpu_model, tokens, batch, captures = on_gpu
    sampling = SamplingParams(n=3, max_new_tokens=16, temperature=0.0)
    HFEngine(lambda: gpu_model, processor, tokens, share_prompts=True).generate(batch, sampling)
    assert captures, "no CUDA graph was captured by default on a GPU"


@needs_cuda
def test_on_cuda_a_lora_model_decodes_through_a_cuda_graph_as_through_eager_lean_steps(on_gpu):
    processor, gpu_model, tokens, batch, captures = on_gpu
    adapted = _adapted(gpu_model, target_modules=["q_proj", "v_proj", "down_proj"])
    sampling = SamplingParams(n=3, max_new_tokens=16, temperature=0.0)
    runs = {graph: HFEngine(lambda: adapted, processor, tokens, share_prompts=True,
                            cuda_graph_decode=graph).generate(batch, sampling) for graph in (None, False)}
    assert captures, "no CUDA graph was captured for a LoRA model"
    _assert_same(runs[None], runs[False], atol=1e-4)


@needs_cuda
def test_cuda_graph_decoding_under_bf16_autocast_equals_the_same_steps_eager(on_gpu, monkeypatch):
    """On a GPU under the trainer's mixed precision (bf16 autocast over float32 weights): replaying the captured
    graph samples what the same fixed-shape steps sample eagerly (greedy: same ids, logprobs within 1e-3)."""
    processor, gpu_model, tokens, batch, captures = on_gpu
    sampling = SamplingParams(n=3, max_new_tokens=16, temperature=0.0, stop_token_ids=list(range(40, 80)))

    def run():
        engine = HFEngine(lambda: gpu_model, processor, tokens, share_prompts=True, lean_decode=True,
                          cuda_graph_decode=True, autocast=lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        return engine.generate(batch, sampling)

    replayed = run()
    assert captures == [torch.bfloat16], "no CUDA graph was captured under bf16 autocast"
    monkeypatch.setitem(table.VARIANTS, "cuda_graph", table.VARIANTS["fixed_rows"])  # the same steps, eager
    _assert_same(replayed, run(), atol=1e-3)


@needs_cuda
def test_cuda_graph_decoding_of_shared_prompts_under_bf16_autocast_equals_the_same_steps_eager(on_gpu, monkeypatch):
    """On a GPU: prompts held once per group (their attention in float32 from the bf16 cache), replayed as a graph,
    sample what the same fixed-shape steps sample eagerly (greedy per row is not shared: sampled, same seed)."""
    processor, gpu_model, tokens, batch, captures = on_gpu
    monkeypatch.setattr(sampling_module, "SHARED_PROMPT_TOKENS", 0)
    sampling = SamplingParams(n=3, max_new_tokens=16, temperature=1.0, stop_token_ids=list(range(40, 80)))

    def run():
        torch.manual_seed(0)
        engine = HFEngine(lambda: gpu_model, processor, tokens, share_prompts=True, lean_decode=True,
                          cuda_graph_decode=True, autocast=lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        return engine.generate(batch, sampling)

    replayed = run()
    assert captures == [torch.bfloat16]
    monkeypatch.setitem(table.VARIANTS, "cuda_graph", table.VARIANTS["fixed_rows"])
    _assert_same(replayed, run(), atol=1e-3)


def test_lora_weights_read_in_place_are_not_copied_for_decoding(setup):
    """Where the weights are in the compute dtype already (FSDP2 gathers them in bf16) the lean step reads them in
    place, a LoRA layer's too: its delta goes through the adapter's two small matrices, not a merged copy of each
    wrapped weight (2 bytes per parameter: 12 GiB for a 7B model's all-linear LoRA). Measured: what building the
    decoder allocates, with LoRA against without."""
    import copy

    from _live_bytes import LiveBytes


    processor, model, tokens, batch = setup
    made = {}
    for lora in (False, True):
        bf16 = (_adapted(model, target_modules=["all-linear"]) if lora else copy.deepcopy(model)).to(torch.bfloat16)
        text_model, out, mask, positions = _prefill((processor, bf16, tokens, batch))
        rows = torch.arange(len(mask)).repeat_interleave(2)
        with torch.no_grad(), LiveBytes().ignore(*bf16.parameters()) as live:
            decoder = LeanDecoder(text_model, out.past_key_values, rows, mask[rows], positions[0, rows, -1],
                                  max_new_tokens=4)
            made[lora] = live.current
        del decoder
    wrapped = sum(m.base_layer.weight.numel() for name, m in bf16.named_modules()
                  if hasattr(m, "base_layer") and ".language_model." in name)
    assert wrapped > 0 and made[True] - made[False] < 0.05 * 2 * wrapped, (made, 2 * wrapped)


def test_float32_adapters_on_a_bf16_model_decode_in_place_as_peft_does(setup):
    """PEFT keeps a bf16 model's adapters in float32 (autocast_adapter_dtype): read in place, the delta is computed
    in the adapters' dtype and added in the output's, as PEFT's forward does; the lean steps sample what PEFT's
    layers sample through transformers."""
    import copy

    _, model, _, _ = setup
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    adapted = apply_lora(bf16, rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    for name, parameter in adapted.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.5)
    adapted.eval()
    assert {p.dtype for n, p in adapted.named_parameters() if "lora_" in n} == {torch.float32}
    sampling = SamplingParams(n=2, max_new_tokens=6, temperature=0.0)
    lean = _run(setup, sampling, lean=True, model=adapted)
    assert lean.completion_ids == _run(setup, sampling, lean=False, model=adapted).completion_ids
