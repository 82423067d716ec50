"""Typed run configuration: dataclass sections loaded from YAML with dotted command-line overrides.

    cfg = load_config("configs/demo.yaml", ["train.lr=1e-6", "rollout.n=8"])

OmegaConf parses and merges the YAML file and the overrides (so `${...}` interpolation works);
`build_dataclass` then turns the merged tree into these dataclasses, rejecting unknown keys and
wrong types, and `Config.validate` checks values against each other and that every advantage,
policy-loss and reward name resolves (vlrft.registry), so a bad setting fails at load time, before
any model or data is read. Every error is one `ConfigError` line naming the key, the value given
and what is allowed. Every field carries its help text (`option(default, "help")`), which
`vlrft config --explain KEY` and docs/config.md show; old key names load through DEPRECATED_KEYS.

Where things are: a key's first part names the module that defines it (`rollout.n` in
`vlrft/config/rollout.py`, `train.fsdp.cpu_offload` in `train.py`); `root.py` holds `Config` and the checks
across sections, `checks.py` the value checks, `options.py` the `option` field, `coercion.py` dict ->
dataclasses, `deprecated.py` the old key names, `loading.py` the YAML file, the overrides and saving.
"""

from vlrft.config.algorithm import AlgorithmConfig
from vlrft.config.checks import (_NUMBER_RANGES, _fail, _non_finite_numbers, _positive, declared_ranges, range_text,
                                 validate_numbers)
from vlrft.config.coercion import _coerce, _coerce_or_fail, _Mismatch, _type_name, build_dataclass, to_dict
from vlrft.config.data import DataConfig
from vlrft.config.deprecated import DEPRECATED_KEYS, _help_of, _warned, rename_deprecated
from vlrft.config.loading import (_cycle_in, _default_at, _DuplicateKey, _merged, _override_key, _parse_value,
                                  _read_yaml, _strict_loader, apply_overrides, load_config, save_config)
from vlrft.config.logging import LoggingConfig
from vlrft.config.model import LoraConfig, ModelConfig
from vlrft.config.options import SECRET, option
from vlrft.config.reward import RewardConfig, RewardFunctionConfig
from vlrft.config.rollout import RolloutConfig, ToolConfig
from vlrft.config.root import Config
from vlrft.config.train import DeepSpeedConfig, FSDPConfig, TrainConfig
from vlrft.errors import ConfigError
from vlrft.registry import ADVANTAGES, POLICY_LOSSES, REWARDS

__all__ = ["DEPRECATED_KEYS", "SECRET", "AlgorithmConfig", "Config", "ConfigError", "DataConfig", "DeepSpeedConfig",
           "FSDPConfig", "LoggingConfig", "LoraConfig", "ModelConfig", "RewardConfig", "RewardFunctionConfig",
           "RolloutConfig", "ToolConfig", "TrainConfig", "apply_overrides", "build_dataclass", "declared_ranges",
           "load_config", "option", "range_text", "rename_deprecated", "save_config", "to_dict", "validate_numbers"]
