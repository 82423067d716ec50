"""One registry type for advantages, policy losses and rewards: one duplicate-name rule, three ways to name."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch

from vlrft.algo import compute_advantages, policy_loss, register_advantage, register_policy_loss
from vlrft.config import AlgorithmConfig, Config, load_config
from vlrft.errors import ConfigError
from vlrft.registry import ADVANTAGES, POLICY_LOSSES, REWARDS
from vlrft.rewards import reward

DECORATORS = {"advantage": (register_advantage, ADVANTAGES), "loss": (register_policy_loss, POLICY_LOSSES),
              "reward": (reward, REWARDS)}


@pytest.mark.parametrize("kind", sorted(DECORATORS))
def test_one_rule_for_duplicate_names(kind):
    register, registry = DECORATORS[kind]
    name = f"test_dup_{kind}"

    def first(*args, **kwargs):
        return None

    def second(*args, **kwargs):
        return None

    try:
        register(name)(first)
        register(name)(first)  # the same function again (a module imported twice): fine
        with pytest.raises(ValueError, match=f"a .* named '{name}' is already registered .*override=True"):
            register(name)(second)
        register(name, override=True)(second)
        assert registry.entries[name] is second
    finally:
        registry.entries.pop(name, None)


@pytest.mark.parametrize("registry", [ADVANTAGES, POLICY_LOSSES, REWARDS], ids=lambda r: r.kind)
def test_the_builtin_names_the_config_checks_without_imports_are_exactly_the_registered_ones(registry):
    registry.load_builtins()
    assert set(registry.builtins) <= set(registry.entries)
    assert not {n for n in registry.entries if not n.startswith("test")} - set(registry.builtins)


def test_advantage_and_policy_loss_from_a_file_work_from_the_command_line(tmp_path, monkeypatch):
    plugin = tmp_path / "my_algo.py"
    plugin.write_text(textwrap.dedent("""
        import torch
        from vlrft.algo.advantages import EstimatorOutput, broadcast_to_tokens, sequence_scores
        from vlrft.algo.losses import Surrogate

        def sign(inp):
            return EstimatorOutput(advantages=broadcast_to_tokens(torch.sign(sequence_scores(inp)), inp.mask))

        def plain_pg(cfg, logprobs, old_logprobs, advantages, mask):
            none = torch.zeros_like(mask)
            return Surrogate(per_token=-advantages * logprobs, clipped_low=none, clipped_high=none)
    """))
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["algorithm.advantage=my_algo.py:sign", "algorithm.policy_loss=my_algo.py:plain_pg"])
    rewards, mask = torch.tensor([2.0, -3.0]), torch.ones(2, 2, dtype=torch.bool)
    adv = compute_advantages(cfg.algorithm, rewards, mask, group_size=2).advantages
    assert adv[:, 0].tolist() == [1.0, -1.0]
    logprobs = torch.full((2, 2), -1.0)
    out = policy_loss(cfg.algorithm, logprobs, logprobs, adv, mask)
    assert out.loss.item() == pytest.approx(0.0)  # token-mean of -A * logp = mean(1, 1, -1, -1)
    # module:function works the same way (the file is importable once its folder is on the path)
    monkeypatch.syspath_prepend(str(tmp_path))
    algo = dataclasses.replace(AlgorithmConfig(), advantage="my_algo:sign")
    Config(algorithm=algo).validate(world_size=1)
    with pytest.raises(ConfigError, match="'my_algo' has no attribute 'nope'"):
        Config(algorithm=dataclasses.replace(algo, policy_loss="my_algo:nope")).validate(world_size=1)
