"""A forward without images that runs the vision tower on a dummy (for sharded ranks) changes nothing.

Under FSDP2/ZeRO a rank without images must still run the vision blocks (their weight all-gathers
are collectives); `vlrft.models.vision_balance` does so and adds `0 * output`. These tests check,
in one process, that the tower really runs and that values and gradients are exactly those of the
forward that skipped it (the tower's own gradient is zero, so summing it with other ranks' is exact).
"""

import pytest
import torch

from vlrft.batch import build_sequences
from vlrft.config import DataConfig
from vlrft.data import PromptEncoder, Sample
from vlrft.models.actor import ActorVL, vision_module
from vlrft.models.loading import load_policy, load_processor
from vlrft.models.vision_balance import VisualKinds
from vlrft.tokens import TokenSpec


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "gemma3",
                                        *(pytest.param(a, marks=pytest.mark.slow)  # the fast tier's time budget
                                          for a in ("internvl", "llava_onevision")), "smolvlm"])
def mixed_batch(request, tiny_vlm_dir, tmp_path_factory):
    from PIL import Image

    folder = tiny_vlm_dir(request.param)
    processor = load_processor(folder)
    root = tmp_path_factory.mktemp("img")
    Image.new("RGB", (56, 84), (200, 40, 40)).save(root / "a.png")
    samples = [Sample(id="image", prompt="<image>Color?", images=[str(root / "a.png")]), Sample(id="text", prompt="Hi")]
    batch = PromptEncoder(processor, DataConfig(min_pixels=784, max_pixels=6272)).encode(samples).batch
    # two completions per prompt; ordinary text ids past every family's special tokens (GLM-4.1V's <|image|> is 11)
    completions = [[111, 112, 113], [114, 115], [116], [117, 118]]
    return folder, batch, completions


def run(actor: ActorVL, seqs, agree):
    """(logprobs, gradients by name, how many times the vision tower ran) of one forward/backward."""
    calls = []
    hook = vision_module(actor.model).register_forward_hook(lambda *args: calls.append(1))
    actor.agree_on_visual_kinds = agree
    actor.model.zero_grad(set_to_none=True)
    out = actor.logprobs(seqs)
    (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
    hook.remove()
    grads = {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}
    return out.logprobs.detach(), grads, len(calls)


@pytest.mark.parametrize("rows", [[2], [2, 3], [0, 2, 3]], ids=["text-row", "text-group-shared", "image-and-text"])
@pytest.mark.slow
def test_dummy_vision_calls_run_the_tower_and_change_no_value_or_gradient(mixed_batch, rows):
    folder, batch, completions = mixed_batch
    model = load_policy(folder)
    tokens = TokenSpec.from_model(load_processor(folder), model.config)
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id)
    seqs = build_sequences(batch.prompt_ids, batch.visual, completions, [0, 0, 1, 1], tokens.pad_id, rows)
    has_images = seqs.visual.num_images > 0

    plain_lp, plain_grads, plain_calls = run(actor, seqs, None)
    # another rank encodes images and videos in this forward: this one runs the tower for what it lacks
    lp, grads, calls = run(actor, seqs, lambda ours: VisualKinds(images=True, videos=True))

    takes_videos = hasattr(model, "get_video_features")  # Gemma 3 has no video path: no rank encodes a video
    assert plain_calls == int(has_images) and calls == 1 + takes_videos  # image (real or dummy) + video (dummy)
    assert torch.equal(lp, plain_lp)
    # what a real image reaches through get_image_features: the tower, and the projector outside it (Gemma 3,
    # InternVL, LLaVA-OneVision; SmolVLM's connector; Qwen's merger is inside) and LLaVA-OneVision's image_newline,
    # not the tower's layers after the feature layer (LLaVA-OneVision's post_layernorm)
    model.zero_grad(set_to_none=True)
    real = model.get_image_features(**batch.visual.select([0]).model_inputs(), return_dict=True)
    deepstack = getattr(real, "deepstack_features", None) or []  # Qwen3-VL's features for early decoder layers
    sum(t.sum() for t in [*real.pooler_output, *(t for layer in deepstack for t in layer)]).backward()
    tower = {n for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name
    # a tower that only ran the dummy got exactly zero gradients (others ranks' real ones add to them)
    dummy_only = set(grads) - set(plain_grads)
    assert dummy_only == (set() if has_images else {n for n in tower if model.get_parameter(n).requires_grad})
    assert all(not grads[n].any() for n in dummy_only)


def test_no_balancing_when_no_rank_has_images(mixed_batch):
    folder, batch, completions = mixed_batch
    model = load_policy(folder)
    tokens = TokenSpec.from_model(load_processor(folder), model.config)
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id)
    seqs = build_sequences(batch.prompt_ids, batch.visual, completions, [0, 0, 1, 1], tokens.pad_id, [2, 3])
    seen = []
    _, grads, calls = run(actor, seqs, lambda ours: seen.append(ours) or ours)
    assert seen == [VisualKinds(False, False)] and calls == 0  # asked once, nobody has images: the tower is skipped
    assert not any(".visual." in f".{n}" for n in grads)


def _multiturn_rows(folder, batch, rows: list[int], tool_image_rows: set[int]):
    """Training rows whose completions are trajectories: a turn, an observation (with a tool image for the rows in
    `tool_image_rows`, text only for the others), another turn (as `Trajectories.sequences` builds them)."""
    import dataclasses

    from PIL import Image

    from vlrft.rollout.multiturn import ObservationTemplate
    from vlrft.tools import ToolOutput
    from vlrft.vision import VisualBatch

    processor = load_processor(folder)
    observations = ObservationTemplate(processor)
    merge = batch.visual.merge_size
    completions, visuals = [], []
    for r in range(4):
        turn = [111 + r, 112]  # text ids past every family's special tokens
        images = [Image.new("RGB", (56, 56), (30, 160, 60 + 40 * r))] if r in tool_image_rows else []
        ids, visual, _ = observations.encode(ToolOutput(text="seen", images=images), turn, merge)
        completions.append(turn + ids + [113, 114 + r])
        visuals.append(visual if images else VisualBatch.empty(1, merge))
    seqs = build_sequences(batch.prompt_ids, batch.visual, completions, [0, 0, 1, 1],
                           TokenSpec.from_model(processor, load_policy(folder).config).pad_id, rows)
    extra = VisualBatch.concat([visuals[r] for r in rows])
    return dataclasses.replace(seqs, completion_visual=extra if extra.num_images else None)


@pytest.mark.parametrize("rows,tool_rows", [([0, 1], set()), ([2, 3], set()), ([0, 1], {1}), ([0, 1, 2, 3], {0, 3}),
                                           ([1, 2], {2}), ([1, 2], set())],
                         ids=["image-prompt-no-tool-image", "text-only", "tool-image", "mixed", "one-pass-tool-image",
                              "one-pass-no-tool-image"])
def test_dummy_calls_for_tool_images_change_no_value_or_gradient(mixed_batch, rows, tool_rows):
    """Multi-turn: another rank's rows got tool images (the continuation pass encodes them); this rank's rows got
    none or some. The tower runs once per pass whatever this rank has; values and gradients stay bitwise."""
    folder, batch, _ = mixed_batch
    model = load_policy(folder)
    tokens = TokenSpec.from_model(load_processor(folder), model.config)
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id)
    seqs = _multiturn_rows(folder, batch, rows, tool_rows)
    plain_lp, plain_grads, plain_calls = run(actor, seqs, None)
    seen = []
    everyone = VisualKinds(images=True, later_images=True)
    lp, grads, calls = run(actor, seqs, lambda ours: seen.append(ours) or everyone)
    assert len(seen) == 1 and seen[0].later_images == bool(tool_rows)  # one agreement per forward, both passes
    if seqs.visual.num_samples < len(seqs) and actor.share_prompts:  # a prompt pass, then a continuation pass
        assert plain_calls == int(seqs.visual.num_images > 0) + int(bool(tool_rows)) and calls == 2
    else:  # one row per prompt, or no sharing (Gemma 3): one pass encodes every image of a row, on every rank
        assert plain_calls == int(seqs.visual.num_images > 0 or bool(tool_rows)) and calls == 1
    assert torch.equal(lp, plain_lp)
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name
    assert all(not grads[n].any() for n in set(grads) - set(plain_grads))
