"""Validation of the algorithm section: messages name the key, the value and what is allowed."""

from __future__ import annotations

import pytest

from vlrft.config import load_config
from vlrft.errors import ConfigError


@pytest.mark.parametrize("override, key", [
    ("algorithm.tis_cap=0", "algorithm.tis_cap"),
    ("algorithm.gamma=1.5", "algorithm.gamma"),
    ("algorithm.cpgd_drift_clip=0", "algorithm.cpgd_drift_clip"),
    ("algorithm.gspo_clip_eps_low=1.0", "algorithm.gspo_clip_eps_low"),
    ("algorithm.advantage=grpoo", "algorithm.advantage"),
    ("algorithm.policy_loss=ppp", "algorithm.policy_loss"),
])
def test_bad_algorithm_values_are_named(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        load_config(None, [override], world_size=1)
    assert "expected" in str(err.value)


def test_new_algorithm_fields_load_from_overrides():
    cfg = load_config(None, ["algorithm.advantage=cpgd", "algorithm.policy_loss=cpgd", "algorithm.cpgd_weight=clip_filter",
                             "algorithm.cpgd_drift_coef=0.001"], world_size=1)
    assert (cfg.algorithm.cpgd_weight, cfg.algorithm.cpgd_drift_coef) == ("clip_filter", 0.001)
