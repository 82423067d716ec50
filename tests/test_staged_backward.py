"""The shared-prompt forward's backward one backbone call at a time (`vlrft.models.staged_backward`): no parameter's
gradient from the completion calls waits in autograd's buffers for the prompt pass's, and the gradients are those of
the one-graph backward."""

from __future__ import annotations

import pytest
import torch
from _tiny_actor import three_prompt_rows
from _prompt_pass_watch import layer_gradients_when_the_prompt_pass_starts
from _torchrun import torchrun

from vlrft.models.actor import ActorVL, CriticVL
from vlrft.models.loading import load_policy
from vlrft.parallel.strategy import DDPStrategy, Strategy


@pytest.fixture(scope="module")
def moe_rows(tiny_vlm_dir, tmp_path_factory):
    """A tiny Qwen3-VL-MoE's folder and 6 rows over 3 prompts (an image, text, two images), completions of different
    lengths (so the completion pass runs in classes of similar length)."""
    folder = tiny_vlm_dir("qwen3_vl_moe")
    completions = [[t + 100 for t in c] for c in [[11, 12, 13], [14], [15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25],
                                                   [26, 27], [28, 29, 30], [31]]]
    tokens, seqs = three_prompt_rows(folder, tmp_path_factory.mktemp("staged_images"), completions,
                                     load_policy(folder).config)
    return folder, tokens, seqs


def _actor(folder, tokens, checkpointing: bool) -> ActorVL:
    model = load_policy(folder).to(torch.float64)
    model.set_experts_implementation("eager")  # torch's grouped matmul takes no float64
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    model.train()
    return ActorVL(model, tokens.image_token_id, tokens.video_token_id, router_aux_loss=True)


def _loss(actor: ActorVL, seqs) -> torch.Tensor:
    out = actor.logprobs(seqs)
    return out.logprobs.sum() + 0.1 * out.entropy.sum() + out.router_aux_loss


def _layer_gradients_when_the_prompt_pass_starts(actor: ActorVL, seqs) -> dict[str, bool]:
    return layer_gradients_when_the_prompt_pass_starts(actor.model, lambda: _loss(actor, seqs).backward())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_under_single_no_completion_gradient_waits_for_the_prompt_pass(moe_rows, checkpointing):
    """With the trainer's `single` strategy, each decoder-layer parameter's gradient from the completion calls is in
    `.grad` when the prompt pass's backward starts (not waiting in its accumulator's buffer), and the gradients equal
    the one-graph backward's (DDP's path) exactly. Before: autograd ran the whole completion pass's backward first
    and every layer's gradient waited (no `.grad` at that point), a float32 copy of the language model's
    gradients (26.3 GiB for 7B)."""
    folder, tokens, seqs = moe_rows
    staged, plain = _actor(folder, tokens, checkpointing), _actor(folder, tokens, checkpointing)
    Strategy().prepare_trainable(staged, lambda params: torch.optim.SGD(params, lr=0.0))
    plain.backward_in_stages = DDPStrategy.stages_backward  # DDP's path: one graph
    assert staged.backward_in_stages and not plain.backward_in_stages
    assert all(_layer_gradients_when_the_prompt_pass_starts(staged, seqs).values())
    assert not any(_layer_gradients_when_the_prompt_pass_starts(plain, seqs).values())
    for (name, p), (_, q) in zip(staged.model.named_parameters(), plain.model.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), (name, (p.grad - q.grad).abs().max())
    assert any("visual" in name and p.grad is not None for name, p in staged.model.named_parameters())
    assert any("router" in name or "gate" in name for name, p in staged.model.named_parameters()
               if p.grad is not None and p.grad.any())


def test_a_second_micro_batch_accumulates_as_the_one_graph_does(moe_rows):
    """Two backwards in a row (a step's micro-batches) and the critic's forward: the gradients of the staged backward
    equal the one graph's within float64 rounding (the completion calls' part reaches `.grad` before the prompt
    pass's, where one graph adds their sum)."""
    folder, tokens, seqs = moe_rows
    models = []
    for stages in (True, False):
        actor = _actor(folder, tokens, checkpointing=True)
        critic = CriticVL(actor.model, tokens.image_token_id, tokens.video_token_id).double()
        for module in (actor, critic.actor_like):
            module.backward_in_stages = stages
        actor.model.zero_grad(set_to_none=True)
        for _ in range(2):
            _loss(actor, seqs).backward()
            critic(seqs).square().sum().backward()
        models.append(critic)
    for (name, p), (_, q) in zip(models[0].named_parameters(), models[1].named_parameters()):
        if q.grad is not None:
            assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-12), name


def test_without_gradients_nothing_is_staged(moe_rows):
    folder, tokens, seqs = moe_rows
    actor = _actor(folder, tokens, checkpointing=False)
    actor.backward_in_stages = True
    with torch.no_grad():
        out = actor.logprobs(seqs)
    assert out.logprobs.grad_fn is None


@pytest.mark.distributed
def test_under_fsdp2_each_layers_gradient_is_reduced_before_the_prompt_pass(tiny_vlm_dir, tmp_path):
    """FSDP2 on 2 gloo ranks: when the prompt pass's backward starts, every decoder layer's sharded gradient already
    holds the completion pass's part (its post-backward reduced it; none waits unsharded), and after the backward the
    gradients equal those of the one-graph backward. Before: no layer had one (each gathered layer's unsharded
    gradient waited: 13.2 GiB/GPU for 7B)."""
    out = tmp_path / "out.pt"
    proc = torchrun("staged_backward_worker.py", str(tiny_vlm_dir("qwen2_5_vl")), str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = torch.load(out)
    assert result["layers"] and all(result["reduced_at_prompt_start"]["staged"].values())
    assert not any(result["reduced_at_prompt_start"]["plain"].values())
    for name, (staged, plain) in result["grads"].items():
        assert torch.allclose(staged, plain, rtol=1e-5, atol=1e-7), (name, (staged - plain).abs().max())


def test_the_plan_counts_no_waiting_gradients_exactly_where_the_strategies_stage_the_backward():
    from vlrft.parallel.deepspeed import DeepSpeedStrategy
    from vlrft.parallel.fsdp2 import FSDP2Strategy
    from vlrft.plan.memory import STAGED_BACKWARD

    staging = {cls.name for cls in (Strategy, DDPStrategy, FSDP2Strategy, DeepSpeedStrategy) if cls.stages_backward}
    assert staging == set(STAGED_BACKWARD) == {"single", "fsdp2"}


def test_the_plan_counts_waiting_gradients_where_the_strategies_keep_one_graph():
    """`vlrft plan` leaves `pending_grads` out for exactly the strategies that run the backward in stages: its list
    (`STAGED_BACKWARD`) and the strategies' own `stages_backward` are two statements of one fact."""
    from vlrft.parallel.deepspeed import DeepSpeedStrategy
    from vlrft.parallel.fsdp2 import FSDP2Strategy
    from vlrft.plan.memory import STAGED_BACKWARD
    from vlrft.plan.memory_plan import STRATEGIES

    classes = {"single": Strategy, "ddp": DDPStrategy, "fsdp2": FSDP2Strategy, "deepspeed": DeepSpeedStrategy}
    assert set(classes) == set(STRATEGIES)
    assert set(STAGED_BACKWARD) == {name for name, cls in classes.items() if cls.stages_backward}
