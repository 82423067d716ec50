"""ActorVL: completion-only logprobs, chunked LM head, vision features shared by a group's rows."""

import pytest
import torch
import transformers
from _tiny_actor import training_actor

from vlrft.config import DataConfig
from vlrft.data import PromptEncoder, Sample
from vlrft.families import family
from vlrft.models.actor import ActorVL, freeze_vision, split_head
from vlrft.models.loading import load_policy, load_processor
from vlrft.models.logprobs import token_logprobs
from vlrft.tokens import TokenSpec
from vlrft.batch import build_sequences


def test_chunked_logprobs_equal_a_full_log_softmax():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(37, 16, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    full = torch.log_softmax(head(hidden) / 0.7, dim=-1)
    expected_lp = full.gather(1, targets[:, None]).squeeze(1)
    expected_ent = -(full.exp() * full).sum(-1)
    lp, ent = token_logprobs(hidden, head, targets, temperature=0.7, chunk_tokens=8)
    assert torch.allclose(lp, expected_lp, atol=1e-6) and torch.allclose(ent, expected_ent, atol=1e-5)
    (g_chunked,) = torch.autograd.grad(lp.sum(), hidden)
    (g_full,) = torch.autograd.grad(expected_lp.sum(), hidden)
    assert torch.allclose(g_chunked, g_full, atol=1e-6)


def test_suppressed_tokens_get_zero_probability():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 6, bias=False)
    hidden = torch.randn(4, 8)
    targets = torch.tensor([0, 1, 2, 3])
    lp, _ = token_logprobs(hidden, head, targets, suppressed_ids=(4, 5))
    logits = head(hidden)
    expected = torch.log_softmax(logits[:, :4], dim=-1).gather(1, targets[:, None]).squeeze(1)
    assert torch.allclose(lp, expected, atol=1e-6)


@pytest.fixture(scope="module")
def group_batch(tiny_vlm_dir, tmp_path_factory):
    from PIL import Image

    folder = tiny_vlm_dir("qwen2_5_vl")
    processor = load_processor(folder)
    root = tmp_path_factory.mktemp("img")
    Image.new("RGB", (56, 84), (200, 40, 40)).save(root / "a.png")
    Image.new("RGB", (84, 56), (40, 40, 200)).save(root / "b.png")
    samples = [Sample(id="two", prompt="<image><image>Same?", images=[str(root / "a.png"), str(root / "b.png")]),
               Sample(id="text", prompt="Hello"),
               Sample(id="one", prompt="<image>Color?", images=[str(root / "b.png")])]
    batch = PromptEncoder(processor, DataConfig(min_pixels=784, max_pixels=6272)).encode(samples).batch
    # a group of 3 completions per prompt, of different lengths
    completions = [[11, 12, 13], [14], [15, 16], [17, 18, 19, 20], [21], [22, 23], [24], [25, 26, 27], [28, 29]]
    return folder, batch, completions


@pytest.mark.slow
def test_shared_vision_features_equal_repeated_pixels_in_values_and_gradients(group_batch):
    folder, batch, completions = group_batch
    model = load_policy(folder)
    tokens = TokenSpec.from_model(load_processor(folder), model.config)
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id)
    if not actor._vision.shared:  # e.g. transformers 5.17 (the GPU machines' image): pixels are repeated per row
        pytest.skip(f"transformers {transformers.__version__} has no mm_encoder_outputs on {type(model).__name__}: "
                    "no shared vision features to compare")
    rows = [0, 1, 2, 3, 6, 7, 8]  # a micro-batch with partial groups and a text-only prompt
    seqs = build_sequences(batch.prompt_ids, batch.visual, completions, [i // 3 for i in range(9)], tokens.pad_id,
                           rows)
    assert seqs.visual.num_samples == 3 and seqs.row_prompt == (0, 0, 0, 1, 2, 2, 2)

    def run(shared: bool):
        actor._vision.shared = shared
        model.zero_grad()
        out = actor.logprobs(seqs)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    shared_out, shared_grads = run(True)
    repeated_out, repeated_grads = run(False)
    assert torch.allclose(shared_out.logprobs, repeated_out.logprobs, atol=1e-5)
    assert shared_grads.keys() == repeated_grads.keys()
    assert any(name.startswith("model.visual") for name in shared_grads)  # the vision tower gets its gradient
    for name in shared_grads:
        assert torch.allclose(shared_grads[name], repeated_grads[name], atol=1e-4, rtol=1e-3), name
    # padding positions carry nothing
    assert torch.all(shared_out.logprobs[seqs.completion_mask == 0] == 0)


def test_frozen_vision_tower_gets_no_gradient(group_batch):
    folder, batch, completions = group_batch
    model = load_policy(folder)
    frozen = freeze_vision(model)
    assert frozen == sum(p.numel() for p in model.model.visual.parameters())
    tokens = TokenSpec.from_model(load_processor(folder), model.config)
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id)
    seqs = build_sequences(batch.prompt_ids, batch.visual, completions, [i // 3 for i in range(9)], tokens.pad_id)
    actor.logprobs(seqs).logprobs.sum().backward()
    assert all(p.grad is None for p in model.model.visual.parameters())
    assert model.lm_head.weight.grad is not None


def _plain_transformers_logprobs(model, processor, prompts, completions, row_prompt):
    """The independent reference: for each row alone, the processor on its prompt, the completion appended, one
    plain `model(...)` forward and a log-softmax of its logits; returns the rows' logprobs and the gradients of
    their sum."""
    model.zero_grad()
    rows = []
    for r, completion in enumerate(completions):
        messages, images = prompts[row_prompt[r]]
        text = processor.apply_chat_template([messages], tokenize=False, add_generation_prompt=True)
        nested = type(processor).__name__ == "LlavaOnevisionProcessor"  # its images one list per prompt
        inputs = processor(text=text, images=([images] if nested else images) if images else None, return_tensors="pt")
        prompt_length = inputs["input_ids"].shape[1]
        ids = torch.cat([inputs["input_ids"], torch.tensor([completion])], dim=1)
        extra = {key: torch.cat([inputs[key], torch.zeros(1, len(completion), dtype=torch.long)], 1)
                 for key in ("mm_token_type_ids", "token_type_ids") if key in inputs}  # Gemma 3: the latter; SmolVLM: none
        if images:
            extra.update({k: inputs[k] for k in ("pixel_values", "image_grid_thw", "image_sizes", "batch_num_images",
                                                 "pixel_attention_mask") if k in inputs})
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[0]
        logprobs = torch.log_softmax(logits[prompt_length - 1:-1].float(), dim=-1)
        rows.append(logprobs.gather(1, torch.tensor(completion)[:, None]).squeeze(1))
    sum(row.sum() for row in rows).backward()
    return [row.detach() for row in rows], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_equals_reference(actor: ActorVL, seqs, share: bool, reference: list, reference_grads: dict,
                            per_magnitude: bool = False) -> dict:
    """ActorVL's logprobs (prompt shared or not) equal each row's `reference` within 1e-5, and the gradients of their
    sum equal `reference_grads` within 1e-5 (absolute and relative; or, `per_magnitude`, absolute to each tensor's
    largest magnitude). Returns the gradients by name."""
    actor.share_prompts = share
    actor.model.zero_grad()
    out = actor.logprobs(seqs)
    out.logprobs.sum().backward()
    for r, expected in enumerate(reference):
        got = out.logprobs[r, :len(expected)].detach()
        assert torch.allclose(got, expected.detach(), atol=1e-5), (share, r, (got - expected).abs().max())
    grads = {n: p.grad for n, p in actor.model.named_parameters() if p.grad is not None}
    assert grads.keys() == reference_grads.keys()
    for name, expected in reference_grads.items():
        scale = max(1.0, float(expected.abs().max())) if per_magnitude else 1.0
        assert torch.allclose(grads[name], expected, atol=1e-5 * scale, rtol=0 if per_magnitude else 1e-5), (
            share, name, (grads[name] - expected).abs().max())
    return grads


def plain_per_row_reference(model, batch, completions: list, row_prompt: list, extra_inputs=None) -> tuple[list, dict]:
    """The independent reference on the data layer's ids and visual tensors: for each row alone, its prompt's ids with
    the completion appended and the prompt's own visual inputs (none for a text prompt), one plain `model(...)`
    forward and a log-softmax of its logits; `extra_inputs(ids)`: more keyword inputs of that forward. Returns the
    rows' logprobs and the gradients of their sum, by parameter name."""
    model.zero_grad()
    reference = []
    for r, completion in enumerate(completions):
        prompt = batch.prompt_ids[row_prompt[r]]
        ids = torch.tensor([list(prompt) + completion])
        visual = batch.visual.select([row_prompt[r]]).model_inputs()
        extra = extra_inputs(ids) if extra_inputs is not None else {}
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra, **visual).logits[0]
        logprobs = torch.log_softmax(logits[len(prompt) - 1:-1].float(), -1)
        reference.append(logprobs.gather(1, torch.tensor(completion)[:, None]).squeeze(1))
    sum(row.sum() for row in reference).backward()
    return reference, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "gemma3", "internvl",
                                  "llava_onevision", "smolvlm"])
def test_logprobs_and_gradients_equal_a_plain_per_sample_transformers_forward(arch, tiny_vlm_dir, tmp_path):
    """ActorVL, with the prompt shared by its group's rows and without, against each row run alone through the
    family's own processor and a plain transformers forward: logprobs and every parameter's gradient within 1e-5."""
    from PIL import Image

    folder = tiny_vlm_dir(arch)
    processor = load_processor(folder)
    grid = 32 if arch.startswith("qwen3_vl") else 28  # images on the patch grid: the data layer leaves them as they are
    red, blue = Image.new("RGB", (2 * grid, 3 * grid), (200, 40, 40)), Image.new("RGB", (3 * grid, 2 * grid), (40, 40, 200))
    red.save(tmp_path / "red.png")
    blue.save(tmp_path / "blue.png")
    samples = [Sample(id="two", prompt="<image><image>Same?", images=[str(tmp_path / "red.png"), str(tmp_path / "blue.png")]),
               Sample(id="text", prompt="A longer text-only prompt here"),
               Sample(id="one", prompt="<image>Color?", images=[str(tmp_path / "blue.png")])]
    prompts = [([{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Same?"}]}],
                [red, blue]),
               ([{"role": "user", "content": [{"type": "text", "text": "A longer text-only prompt here"}]}], []),
               ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]}], [blue])]
    batch = PromptEncoder(processor, DataConfig(min_pixels=784, max_pixels=8192)).encode(samples).batch
    completions = [[t + 100 for t in c] for c in [[11, 12, 13], [14], [15, 16, 17, 18], [19, 20], [21, 22, 23], [24]]]
    row_prompt = [0, 0, 1, 1, 2, 2]
    reference, reference_grads = _plain_transformers_logprobs(load_policy(folder), processor, prompts, completions,
                                                              row_prompt)
    model = load_policy(folder)
    tokens = TokenSpec.from_model(processor, model.config)
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id)
    seqs = build_sequences(batch.prompt_ids, batch.visual, completions, row_prompt, tokens.pad_id)
    # Gemma 3 falls back to full rows by itself, as the family table says (sliding-window layers, bidirectional image attention: see
    # vlrft.models.actor.supports_prompt_sharing); every other family shares (InternVL 3, LLaVA-OneVision and SmolVLM
    # at 1-D positions) and is checked both ways. SmolVLM's rows hold 10 tiles (two images), none and 5
    assert actor.share_prompts == (arch != "gemma3") == family(arch).training_shares_prompt.supported
    for share in (True, False) if actor.share_prompts else (False,):
        # Gemma 3's random tiny model has gradients up to ~2e3 (embeddings scaled by sqrt(hidden), (1 + w) norms),
        # where float32 itself resolves ~1e-4: within 1e-5 of each tensor's largest magnitude there
        grads = assert_equals_reference(actor, seqs, share, reference, reference_grads, per_magnitude=arch == "gemma3")
        assert any(f".{tower}." in name for name in grads for tower in ("visual", "vision_tower", "vision_model"))


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v"])
def test_prompt_computed_once_per_group_equals_the_full_forward(arch, tiny_vlm_dir, tmp_path):
    from PIL import Image

    folder = tiny_vlm_dir(arch)
    processor = load_processor(folder)
    Image.new("RGB", (56, 84), (200, 40, 40)).save(tmp_path / "a.png")
    samples = [Sample(id="img", prompt="<image>Color?", images=[str(tmp_path / "a.png")]),
               Sample(id="text", prompt="A longer text-only prompt here"),
               Sample(id="two", prompt="<image><image>Same?", images=[str(tmp_path / "a.png")] * 2)]
    batch = PromptEncoder(processor, DataConfig(min_pixels=784, max_pixels=6272)).encode(samples).batch
    # ordinary text ids, past every family's special tokens (GLM-4.1V's <|image|> is id 11 of the tiny tokenizer)
    completions = [[t + 100 for t in c] for c in [[11, 12, 13], [14], [15, 16], [17, 18, 19, 20], [21], [22, 23]]]
    model = load_policy(folder)
    tokens = TokenSpec.from_model(processor, model.config)
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id)
    seqs = build_sequences(batch.prompt_ids, batch.visual, completions, [0, 0, 1, 1, 2, 2], tokens.pad_id)

    def run(share: bool):
        actor.share_prompts = share
        model.zero_grad()
        out = actor.logprobs(seqs)
        out.logprobs.sum().backward()
        return out.logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    shared, shared_grads = run(True)
    full, full_grads = run(False)
    assert torch.allclose(shared, full, atol=1e-5)
    assert shared_grads.keys() == full_grads.keys()
    for name in full_grads:
        assert torch.allclose(shared_grads[name], full_grads[name], atol=1e-4, rtol=1e-3), name


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_vl_moe"])
def test_qwen3_vl_video_rows_equal_a_plain_per_row_forward(arch, tiny_vlm_dir):
    """Qwen3-VL and Qwen3-VL-MoE with a video (Qwen3-VL's processor: timestamped frames, each its own vision block):
    ActorVL's logprobs and gradients, prompt shared and not, equal each row's plain transformers forward on the data
    layer's ids and video tensors within 1e-5."""
    import numpy as np
    from PIL import Image

    pytest.importorskip("torchvision")
    rng = np.random.default_rng(0)
    video = [Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)) for _ in range(4)]
    folder = tiny_vlm_dir(arch)
    processor = load_processor(folder)
    samples = [Sample(id="video", prompt="<video>What happens?", videos=[video]), Sample(id="text", prompt="Hi there")]
    batch = PromptEncoder(processor, DataConfig(min_pixels=784, max_pixels=4096, video_fps=2.0)).encode(samples).batch
    assert batch.visual.model_inputs()["video_grid_thw"].shape[0] == 1
    completions = [[t + 100 for t in c] for c in [[11, 12, 13], [14, 15], [16], [17, 18, 19]]]
    row_prompt = [0, 0, 1, 1]
    model = load_policy(folder)
    reference, reference_grads = plain_per_row_reference(model, batch, completions, row_prompt, lambda ids: {
        "mm_token_type_ids": torch.tensor(processor.create_mm_token_type_ids(ids.tolist()))})
    assert any(".visual." in n for n in reference_grads)
    tokens = TokenSpec.from_model(processor, model.config)
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id)
    seqs = build_sequences(batch.prompt_ids, batch.visual, completions, row_prompt, tokens.pad_id)
    for share in (True, False):
        assert_equals_reference(actor, seqs, share, reference, reference_grads)


def test_llava_onevision_video_rows_equal_a_plain_per_row_forward(tiny_vlm_dir):
    """LLaVA-OneVision with a video (every video data.video_max_frames frames, pooled, one `<video>` newline token
    after them) beside an image prompt: ActorVL's logprobs and gradients, prompt shared and not, equal each row's plain
    transformers forward on the data layer's ids and tensors within 1e-5."""
    import numpy as np
    from PIL import Image

    pytest.importorskip("torchvision")
    rng = np.random.default_rng(0)
    video = [Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)) for _ in range(3)]
    image = Image.fromarray(rng.integers(0, 256, (48, 32, 3), dtype=np.uint8))
    folder = tiny_vlm_dir("llava_onevision")
    processor = load_processor(folder)
    samples = [Sample(id="video", prompt="<video>What happens?", videos=[video]),
               Sample(id="image", prompt="<image>Color?", images=[image])]
    batch = PromptEncoder(processor, DataConfig(video_max_frames=4, video_fps=2.0)).encode(samples).batch
    assert tuple(batch.visual.pixel_values_videos.shape[:2]) == (1, 4)
    completions = [[t + 100 for t in c] for c in [[11, 12, 13], [14, 15], [16], [17, 18, 19]]]
    row_prompt = [0, 0, 1, 1]
    model = load_policy(folder)
    reference, reference_grads = plain_per_row_reference(model, batch, completions, row_prompt)
    assert any(".vision_tower." in n for n in reference_grads)
    tokens = TokenSpec.from_model(processor, model.config)
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id)
    seqs = build_sequences(batch.prompt_ids, batch.visual, completions, row_prompt, tokens.pad_id)
    for share in (True, False):
        assert_equals_reference(actor, seqs, share, reference, reference_grads)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "internvl",
                                  "llava_onevision"])
def test_prompt_sharing_under_gradient_checkpointing_equals_the_full_forward(arch, tiny_vlm_dir, tmp_path,
                                                                              monkeypatch):
    """Real configs enable gradient checkpointing; the shared-prompt forward must still be taken and be exact."""
    from PIL import Image

    folder = tiny_vlm_dir(arch)
    processor = load_processor(folder)
    Image.new("RGB", (56, 84), (200, 40, 40)).save(tmp_path / "a.png")
    samples = [Sample(id="img", prompt="<image>Color?", images=[str(tmp_path / "a.png")]),
               Sample(id="text", prompt="A longer text-only prompt here")]
    batch = PromptEncoder(processor, DataConfig(min_pixels=784, max_pixels=6272)).encode(samples).batch
    completions = [[t + 100 for t in c] for c in [[11, 12, 13], [14], [15, 16, 17], [18, 19], [20], [21, 22, 23, 24]]]
    model = load_policy(folder)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    tokens = TokenSpec.from_model(processor, model.config)
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id)
    seqs = build_sequences(batch.prompt_ids, batch.visual, completions, [0, 0, 0, 1, 1, 1], tokens.pad_id)
    shared_calls = []
    original = actor._predicting_states_shared
    monkeypatch.setattr(actor, "_predicting_states_shared",
                        lambda b, *rest: shared_calls.append(1) or original(b, *rest))

    def run(share: bool):
        actor.share_prompts = share
        model.zero_grad()
        out = actor.logprobs(seqs)
        (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
        return out.logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    shared, shared_grads = run(True)
    assert shared_calls == [1]  # checkpointing no longer forces the per-row forward
    full, full_grads = run(False)
    assert torch.allclose(shared, full, atol=1e-5)
    assert shared_grads.keys() == full_grads.keys()
    assert any(name.startswith(("model.visual", "model.vision_tower")) for name in full_grads)
    for name in full_grads:
        assert torch.allclose(shared_grads[name], full_grads[name], atol=1e-4, rtol=1e-3), name
    # and the checkpointed shared forward equals the same forward without checkpointing
    model.gradient_checkpointing_disable()
    actor.share_prompts = True
    plain = actor.logprobs(seqs).logprobs.detach()
    assert torch.allclose(shared, plain, atol=1e-5)


def _critic_of(group_batch):
    """(the tiny policy, a critic around it with a non-zero value head, the group batch's sequences)."""
    from vlrft.models.actor import CriticVL

    folder, batch, completions = group_batch
    model = load_policy(folder)
    tokens = TokenSpec.from_model(load_processor(folder), model.config)
    critic = CriticVL(model, tokens.image_token_id, tokens.video_token_id)
    torch.nn.init.normal_(critic.value_head.weight, std=1.0)  # a fresh head is zero
    seqs = build_sequences(batch.prompt_ids, batch.visual, completions, [i // 3 for i in range(9)], tokens.pad_id)
    return model, critic, seqs


def test_critic_values_are_float32_under_the_trainers_autocast(group_batch):
    """On GPUs the critic's forward runs under bf16 autocast; its value head still computes in float32 (the
    backbone's states as they come, no bf16 matmul): values equal the head applied to those states outside it."""
    _, critic, seqs = _critic_of(group_batch)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        values = critic(seqs)
        states = critic.actor_like.predicting_states(seqs)
    expected = critic.value_head(states.float()).squeeze(-1) * seqs.completion_mask
    assert values.dtype == torch.float32
    assert torch.allclose(values, expected, atol=1e-5)


@pytest.mark.slow
def test_under_gradient_checkpointing_the_rows_copies_of_a_shared_prompt_live_one_layer_at_a_time():
    """Each completion row attends to its prompt's keys/values through a per-row copy. Made inside each layer's call
    (under gradient checkpointing, made again by its replay), the copies of all layers are not held through the whole
    forward and backward: for 8 rows of a 16k-token video prompt of a 7B model that was about 10 GiB, and as much
    again for their gradients. Here: memory after the forward and at peak grows far less with the rows than the
    copies would weigh."""
    from _live_bytes import LiveBytes

    from vlrft.models.tiny import TinySpec
    from vlrft.vision import VisualBatch

    spec = TinySpec(arch="qwen2_vl", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
                    vocab_size=512)
    model, actor, tokenizer = training_actor(spec)
    prompt_length, head_dim = 1024, 64 // 4
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(20, 400, (prompt_length,), generator=generator).tolist()
    after_forward, peak = {}, {}
    for rows in (2, 8):
        completions = [torch.randint(20, 400, (4,), generator=generator).tolist() for _ in range(rows)]
        seqs = build_sequences([prompt], VisualBatch.empty(1, 2), completions, [0] * rows, tokenizer.pad_token_id)
        with LiveBytes() as live:
            out = actor.logprobs(seqs)
            after_forward[rows] = live.current
            out.logprobs.sum().backward()
        peak[rows] = live.peak
    copies_per_row = spec.num_layers * 2 * spec.num_kv_heads * head_dim * prompt_length * 4  # keys and values, fp32
    assert after_forward[8] - after_forward[2] < 0.25 * 6 * copies_per_row  # was 1.05 x: every layer's copies
    assert peak[8] - peak[2] < 1.0 * 6 * copies_per_row  # was 2.75 x: the copies and their gradients


def test_the_critic_runs_each_prompt_once_and_gives_the_values_of_the_full_forward(group_batch):
    """PPO's value model shares each prompt among its group's rows, as the policy does: a group of 8 rows of a long
    video prompt costs one prompt pass, not 8. Values and gradients equal the per-row forward."""
    model, critic, seqs = _critic_of(group_batch)
    backbone, _ = split_head(model)
    positions = []
    backbone.register_forward_pre_hook(lambda module, args, kwargs: positions.append(kwargs["input_ids"].numel()),
                                       with_kwargs=True)

    def run(share: bool):
        critic.actor_like.share_prompts = share
        critic.zero_grad()
        positions.clear()
        values = critic(seqs)
        values.sum().backward()
        return values.detach(), {n: p.grad.clone() for n, p in critic.named_parameters() if p.grad is not None}, \
            sum(positions)

    shared, shared_grads, shared_positions = run(True)
    full, full_grads, full_positions = run(False)
    p, c = seqs.prompt_width, seqs.completion_width
    assert full_positions == 9 * (p + c) and shared_positions <= 3 * p + 9 * c  # 3 prompts once, not 9 times
    assert torch.allclose(shared, full, atol=1e-5)
    assert shared_grads.keys() == full_grads.keys()
    for name in full_grads:
        assert torch.allclose(shared_grads[name], full_grads[name], atol=1e-4, rtol=1e-3), name
    # under gradient checkpointing (the trainer checkpoints the critic as it does the policy): the same
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    critic.train()
    checkpointed, checkpointed_grads, _ = run(True)
    assert torch.allclose(checkpointed, full, atol=1e-5)
    for name in full_grads:
        assert torch.allclose(checkpointed_grads[name], full_grads[name], atol=1e-4, rtol=1e-3), name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the CUDA variant needs a CUDA device and none is visible"))])
@pytest.mark.slow
def test_under_gradient_checkpointing_the_forward_holds_no_low_precision_copy_of_every_weight(monkeypatch, device):
    """On GPUs the trainer's forwards run under bf16 autocast over float32 weights. torch's autocast keeps the bf16
    copy of each weight it casts until its region ends: at the end of a forward, a copy of the whole model (7 GiB for
    a 3.75 B model; under ZeRO-3 every GPU's copy of every gathered layer). Under gradient checkpointing nothing
    needs them (the backward recomputes each layer and casts again): the scoring and training forwards' autocast
    (`precision.forward_autocast`) caches no cast, so each copy lives with its layer. Here on the CPU (the GPUs'
    mixed-precision path): what the forward leaves alive, beside the copies' weight; values and gradients unchanged."""
    from _live_bytes import LiveBytes

    from vlrft.models import precision
    from vlrft.models.tiny import TinySpec
    from vlrft.vision import VisualBatch

    monkeypatch.setenv(precision.CPU_MIXED_PRECISION_ENV, "1")
    spec = TinySpec(arch="qwen2_vl", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                    intermediate_size=1024, vocab_size=512)
    model, actor, tokenizer = training_actor(spec)
    model.to(device)
    copies = 2 * sum(p.numel() for p in split_head(model)[0].language_model.layers.parameters())  # bf16 bytes
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(20, 400, (24,), generator=generator).tolist()
    completions = [torch.randint(20, 400, (8,), generator=generator).tolist() for _ in range(4)]
    seqs = build_sequences([prompt], VisualBatch.empty(1, 2), completions, [0] * 4, tokenizer.pad_token_id).to(device)

    def forward(autocast, grad: bool):
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grad), LiveBytes() as live:
            with autocast:
                out = actor.logprobs(seqs)
                held = live.current  # the forward's end, still inside the autocast region
            if grad:
                out.logprobs.sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return held, out.logprobs.detach(), grads

    device = torch.device(device)
    for grad in (True, False):
        held, logprobs, grads = forward(precision.forward_autocast(device, "bfloat16", gradient_checkpointing=True),
                                        grad)
        cached_held, cached_logprobs, cached_grads = forward(precision.autocast(device, "bfloat16"), grad)
        assert cached_held > 0.95 * copies  # what the measure sees with the cache: every layer's copy (norms aside)
        assert held < 0.2 * copies, (grad, held, copies)
        assert torch.equal(logprobs, cached_logprobs)
        assert len(grads) == len(cached_grads) and (len(grads) > 0) == grad
        # one cast per use (the prompt and completion passes) sums their gradients in float32, the cached cast in
        # bf16 first: the same gradients up to bf16 rounding
        assert all(torch.allclose(a, b, rtol=1e-2, atol=1e-2 * b.abs().max().item()) for a, b in zip(grads, cached_grads))
    # without checkpointing autograd keeps each copy for the backward: the cache stays (one copy per weight)
    assert torch.is_autocast_cache_enabled()
    with precision.forward_autocast(device, "bfloat16", gradient_checkpointing=False):
        assert torch.is_autocast_cache_enabled()
    with precision.forward_autocast(device, "bfloat16", gradient_checkpointing=True):
        assert not torch.is_autocast_cache_enabled()
