"""The MoE routers' load-balancing loss (algorithm.router_aux_loss_coef) against transformers' own `aux_loss`."""

import math
from pathlib import Path

import pytest
import torch
from _tiny_actor import three_prompt_rows

from vlrft.algo import Stats
from vlrft.algo.losses import LossOutput
from vlrft.errors import UserError
from vlrft.models.actor import ActorVL
from vlrft.models.loading import load_policy
from vlrft.models.router_loss import check_router_loss


@pytest.fixture(scope="module")
def moe_batch(tiny_vlm_dir, tmp_path_factory):
    """A tiny Qwen3-VL-MoE in float64, and 6 rows over 3 prompts of different lengths (left padding) with
    completions of different lengths (right padding)."""
    folder = tiny_vlm_dir("qwen3_vl_moe")
    completions = [[t + 100 for t in c] for c in [[11, 12, 13], [14], [15, 16, 17, 18, 19, 20, 21], [22, 23],
                                                   [24, 25, 26], [27]]]
    row_prompt = [0, 0, 1, 1, 2, 2]
    model = load_policy(folder).to(torch.float64)
    model.set_experts_implementation("eager")  # torch's grouped matmul takes no float64
    tokens, seqs = three_prompt_rows(folder, tmp_path_factory.mktemp("moe_images"), completions, model.config)
    return model, tokens, seqs, row_prompt


def _transformers_forward(model, tokens, seqs, row_prompt):
    """transformers' forward of every row in full, with its router logits and `aux_loss`."""
    visual = seqs.visual.select(list(row_prompt)).model_inputs()
    image_tokens = (seqs.input_ids == tokens.image_token_id).long()  # the processor's mm_token_type_ids
    with torch.no_grad():
        return model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask, output_router_logits=True,
                     use_cache=False, mm_token_type_ids=image_tokens, **visual)


@pytest.mark.parametrize("path", ["shared-classes", "shared-one-call", "full-rows"])
def test_router_loss_equals_transformers_aux_loss_with_padding_and_reaches_the_routers(moe_batch, path):
    """The padded batch's prompt and completion tokens, through each of ActorVL's forward paths (the prompt once per
    group, completions in one call or in classes of similar length; every row in full): the loss equals transformers'
    `aux_loss` of the same rows within 1e-6 in float64, and its gradient reaches every layer's router."""
    model, tokens, seqs, row_prompt = moe_batch
    assert seqs.attention_mask.min() == 0  # the batch has padding, which the loss must leave out
    expected = _transformers_forward(model, tokens, seqs, row_prompt).aux_loss
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id, router_aux_loss=True)
    actor.share_prompts = path != "full-rows"
    actor.split_completion_widths = path == "shared-classes"
    if path == "shared-classes":  # completions (lengths 3, 1, 7, 2, 3, 1) in three calls, each padded to its longest
        actor._width_classes = lambda batch: [([2], 7), ([0, 4], 3), ([1, 3, 5], 2)]
    model.zero_grad()
    out = actor.logprobs(seqs)
    assert abs(out.router_aux_loss.item() - expected.item()) < 1e-6, (out.router_aux_loss.item(), expected.item())
    out.router_aux_loss.backward()
    routers = {n: p.grad for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}
    assert len(routers) == 2 and all(g is not None and g.abs().sum() > 0 for g in routers.values())


def test_router_loss_is_not_computed_without_gradients_or_when_off(moe_batch):
    model, tokens, seqs, _ = moe_batch
    on = ActorVL(model, tokens.image_token_id, tokens.video_token_id, router_aux_loss=True)
    off = ActorVL(model, tokens.image_token_id, tokens.video_token_id)
    assert off.logprobs(seqs).router_aux_loss is None
    with torch.no_grad():  # old-policy and reference passes
        assert on.logprobs(seqs).router_aux_loss is None


def test_padding_changes_transformers_aux_loss(moe_batch):
    """The reference itself leaves padding out: the same rows with the mask all ones give another number."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

    model, tokens, seqs, row_prompt = moe_batch
    out = _transformers_forward(model, tokens, seqs, row_prompt)
    unmasked = load_balancing_loss_func(out.router_logits, 4, 2, None)
    assert abs(out.aux_loss.item() - unmasked.item()) > 1e-4


def test_router_loss_is_refused_under_lora_and_for_a_dense_model(tiny_vlm_dir):
    """LoRA leaves the routers frozen (the choice documented in the option's help), and a dense model has none: a
    coefficient > 0 is refused in one line naming the option and the fix; 0 passes everywhere."""
    moe, dense = load_policy(tiny_vlm_dir("qwen3_vl_moe")), load_policy(tiny_vlm_dir("qwen2_vl"))
    check_router_loss(moe, 0.001, lora=False)
    check_router_loss(moe, 0.0, lora=True)
    check_router_loss(dense, 0.0, lora=False)
    with pytest.raises(UserError, match=r"router_aux_loss_coef is 0.001 with model.lora.rank > 0.*routers frozen"):
        check_router_loss(moe, 0.001, lora=True)
    with pytest.raises(UserError, match=r"router_aux_loss_coef is 0.001 but Qwen2VLForConditionalGeneration has no "
                                        r"MoE routers; set it to 0"):
        check_router_loss(dense, 0.001, lora=False)


def test_update_adds_the_weighted_router_loss_and_logs_it():
    """Each micro-batch adds coef x its router loss x (its rows / the mini-batch's rows on all ranks) x world size
    (undoing the ranks' gradient average, as the policy loss does), and logs the loss as a mean over rows."""
    from types import SimpleNamespace

    from vlrft.trainer.update import _with_router_loss

    aux = torch.tensor(2.5, requires_grad=True)
    base = LossOutput(loss=torch.tensor(1.0), stats=Stats())
    result = _with_router_loss(base, SimpleNamespace(router_aux_loss=aux), 0.01, rows=3, all_rows=12.0, world=2)
    assert math.isclose(result.loss.item(), 1.0 + 0.01 * 2.5 * 3 * 2 / 12, rel_tol=1e-6)
    assert math.isclose(result.stats.sums["actor/router_aux_loss"].item() / result.stats.counts[
        "actor/router_aux_loss"].item(), 2.5)
    off = _with_router_loss(LossOutput(loss=torch.tensor(1.0), stats=Stats()), SimpleNamespace(router_aux_loss=None),
                            0.01, rows=3, all_rows=12.0, world=1)
    assert off.loss.item() == 1.0 and "actor/router_aux_loss" not in off.stats.sums


REWARDS = Path(__file__).parent / "data" / "trainer_rewards.py"


def _train_overrides(folder, shapes_dir, out, *extra) -> list[str]:
    return [f"model.path={folder}", "model.dtype=float32", f"data.train_files=[{shapes_dir['train']}]",
            "data.min_pixels=784", "data.max_pixels=3136", "rollout.n=4", "rollout.global_batch_completions=8",
            "rollout.max_new_tokens=4", f"reward.functions=[{{name: '{REWARDS}:text_hash'}}]",
            f"train.output_dir={out}", "train.total_steps=1", "train.lr=1e-3", "train.micro_batch_completions_per_rank=4",
            "train.eval_every=0", "train.save_every=0", "logging.progress=false", *extra]


@pytest.fixture(scope="module")
def shapes_data(tmp_path_factory):
    from examples.shapes import ShapesSpec, make_shapes

    return make_shapes(tmp_path_factory.mktemp("shapes"), ShapesSpec(train_size=8, test_size=4))


@pytest.mark.slow
def test_vlrft_train_logs_the_router_loss_and_refuses_it_under_lora(tmp_path, tiny_vlm_dir, shapes_data, capsys):
    """`vlrft train` on a tiny Qwen3-VL-MoE with algorithm.router_aux_loss_coef=0.001: one GRPO step (two
    micro-batches) logs actor/router_aux_loss, a row mean of transformers' loss (between top_k = 2 for perfectly
    balanced routing and num_experts = 4); with LoRA the run stops before any rollout with the one-line refusal."""
    from vlrft.cli import main
    from vlrft.logging import read_metrics

    folder = tiny_vlm_dir("qwen3_vl_moe")
    config_file = tmp_path / "moe.yaml"
    config_file.write_text("{}\n")
    assert main(["train", str(config_file), *_train_overrides(folder, shapes_data, tmp_path / "run",
                                                              "algorithm.router_aux_loss_coef=0.001")]) == 0
    logged = [m["actor/router_aux_loss"] for m in read_metrics(tmp_path / "run") if "actor/router_aux_loss" in m]
    assert len(logged) == 1 and 2.0 <= logged[0] <= 4.0, logged
    capsys.readouterr()
    assert main(["train", str(config_file), *_train_overrides(folder, shapes_data, tmp_path / "lora",
                                                              "algorithm.router_aux_loss_coef=0.001",
                                                              "model.lora.rank=4")]) != 0
    err = capsys.readouterr().err
    assert "router_aux_loss_coef is 0.001 with model.lora.rank > 0" in err and "Traceback" not in err
