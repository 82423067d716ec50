"""Config loading: YAML + dotted overrides, strict types, cross-field validation, saved without secrets."""

import re
import textwrap

import pytest
import yaml

from vlrft.config import Config, load_config, save_config
from vlrft.errors import ConfigError


def write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_yaml_and_overrides_merge_with_types(tmp_path):
    path = write(tmp_path, """
        model: {path: /models/tiny}
        rollout: {n: 4, global_batch_completions: 16}
        train: {lr: 1.0e-5}
    """)
    cfg = load_config(path, ["train.lr=1e-6", "rollout.n=8", "algorithm.dual_clip=3", "data.train_files=[a.jsonl,b.jsonl]"])
    assert cfg.model.path == "/models/tiny"
    assert cfg.train.lr == pytest.approx(1e-6) and isinstance(cfg.train.lr, float)
    assert cfg.rollout.n == 8 and cfg.rollout.global_batch_completions == 16
    assert cfg.algorithm.dual_clip == 3.0 and isinstance(cfg.algorithm.dual_clip, float)
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"]
    assert cfg.prompts_per_step == 2
    # untouched sections keep their defaults
    assert cfg.algorithm.advantage == Config().algorithm.advantage


def test_nested_reward_functions_and_interpolation(tmp_path):
    path = write(tmp_path, """
        train: {output_dir: runs/x, total_steps: 7}
        logging: {wandb_run_name: "run-${train.total_steps}"}
        reward:
          functions: [{name: accuracy, weight: 2}, {name: format, weight: 0.5}]
          recipes: {geometry: [{name: math_accuracy}]}
    """)
    cfg = load_config(path)
    assert [(f.name, f.weight) for f in cfg.reward.functions] == [("accuracy", 2.0), ("format", 0.5)]
    assert cfg.reward.recipes["geometry"][0].name == "math_accuracy"
    assert cfg.logging.wandb_run_name == "run-7"


@pytest.mark.parametrize("overrides, message", [
    (["train.lrr=1"], "config: unknown key 'train.lrr' (did you mean 'train.lr'?); allowed keys in 'train': output_dir,"),
    (["trian.lr=1"], "config: unknown key 'trian' (did you mean 'train'?); allowed keys in the top level: model, data,"),
    (["train.lr=abc"], "config: train.lr='abc' is invalid; expected a number"),
    (["train.total_steps=1.5"], "config: train.total_steps=1.5 is invalid; expected an integer"),
    (["model.freeze_vision_tower=maybe"], "config: model.freeze_vision_tower='maybe' is invalid; expected true/false"),
    (["algorithm.advantage=ppo2"], "config: algorithm.advantage='ppo2': advantage estimator 'ppo2' is not registered; "
                                   "expected one of: grpo, drgrpo, rloo"),
    (["algorithm.policy_loss=nope"], "config: algorithm.policy_loss='nope': policy loss 'nope' is not registered"),
    (["reward.timeout_s=0"], "config: reward.timeout_s=0.0 is not allowed; expected a number of seconds > 0"),
    (["reward.grader_timeout_s=-1"], "config: reward.grader_timeout_s=-1.0 is not allowed; expected a number of seconds > 0"),
    (["reward.functions=[{name: nosuchfn}]"], "config: reward.functions[0].name='nosuchfn': reward function 'nosuchfn' "
                                              "is not registered; expected one of: accuracy"),
    (["reward.recipes={geo: [{name: accuracy}, {name: 'no_such_module_xyz:f'}]}"],
     "config: reward.recipes.geo[1].name='no_such_module_xyz:f': cannot import module 'no_such_module_xyz'"),
    (["algorithm.kl_k3_clamp=0"], "config: algorithm.kl_k3_clamp=0.0 is not allowed; expected a number > 0"),
    (["reward.functions=[{nam: acc}]"], "config: unknown key 'reward.functions[0].nam' (did you mean 'reward.functions[0].name'?)"),
    (["rollout.n=3"], "config: rollout.global_batch_completions=64 is not allowed; expected a multiple of rollout.n=3"),
    (["rollout.n=0"], "config: rollout.n=0 is not allowed; expected a positive integer"),
    (["train.global_mini_batch_completions=48"], "config: train.global_mini_batch_completions=48 is not allowed; "
                                                "expected a divisor of rollout.global_batch_completions=64"),
    (["algorithm.clip_eps_low=1.5"], "config: algorithm.clip_eps_low=1.5 is not allowed; expected a number in [0, 1)"),
    (["algorithm.dual_clip=0.5"], "config: algorithm.dual_clip=0.5 is not allowed; expected a number > 1"),
    (["algorithm.advantage=rloo", "rollout.n=1", "rollout.global_batch_completions=8"], "config: rollout.n=1 is not allowed; expected at least 2"),
    (["train.resume=/no/such/ckpt"], "config: train.resume='/no/such/ckpt' is not allowed; expected 'none', 'auto' or the path"),
    (["lr"], "config: override 'lr' is not of the form section.key=value"),
])
def test_bad_values_fail_with_one_clear_message(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_batch_must_split_into_whole_groups_per_rank():
    # 64 completions / n=8 -> 8 prompts; 3 ranks cannot each get whole groups
    with pytest.raises(ConfigError, match=r"rollout.global_batch_completions=64 .* multiple of rollout.n \* world_size = 24"):
        load_config(None, ["train.strategy=ddp"], world_size=3)
    assert load_config(None, ["train.strategy=ddp"], world_size=4).prompts_per_step == 8
    with pytest.raises(ConfigError, match="train.strategy='single' is not allowed; expected 'ddp', 'fsdp2' or 'deepspeed' when running 2 processes"):
        load_config(None, [], world_size=2)


@pytest.mark.parametrize("overrides, message", [
    (["rollout.n=" + str(10**30), "rollout.global_batch_completions=" + str(10**30)],
     f"config: rollout.n={10**30} is not allowed; expected at most 4096 completions per prompt"),
    (["rollout.n=100000000", "rollout.global_batch_completions=100000000"],
     "config: rollout.n=100000000 is not allowed; expected at most 4096 completions per prompt"),
    (["rollout.n=4096", "rollout.global_batch_completions=4096000"],
     "config: rollout.global_batch_completions=4096000 is not allowed; expected at most 1,073,741,824 tokens per rank "
     "per step; 4,096,000 completions per rank (over 1 rank(s)) * 1,536 tokens (data.max_prompt_length + "
     "rollout.max_new_tokens) = 6,291,456,000"),
])
def test_what_one_rank_must_hold_is_bounded_at_load(overrides, message):
    """A huge group or batch is refused with the limit and its reason before anything is allocated (n=10**30
    overflowed in decoding, n=10**8 asked the allocator for 28 GB)."""
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)
    # the same batch over enough ranks fits; the largest group passes
    assert load_config(None, ["rollout.n=4096", "rollout.global_batch_completions=4096000", "train.strategy=ddp"],
                       world_size=1000).rollout.n == 4096


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file '.*nope.yaml' not found; pass the path of a YAML file"):
        load_config(tmp_path / "nope.yaml")
    bad = write(tmp_path, "train:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML at line \d+, column \d+"):
        load_config(bad)
    scalar = write(tmp_path, "just a string\n", name="s.yaml")
    with pytest.raises(ConfigError, match="must hold a mapping of sections"):
        load_config(scalar)


def test_saved_config_round_trips_and_drops_secrets(tmp_path):
    cfg = load_config(None, ["logging.wandb_api_key=sk-SECRET", "reward.remote_api_key=rk-SECRET", "train.lr=3e-6"])
    saved = save_config(cfg, tmp_path / "run")
    text = saved.read_text()
    assert "SECRET" not in text
    data = yaml.safe_load(text)
    assert data["logging"]["wandb_api_key"] is None and data["reward"]["remote_api_key"] is None
    again = load_config(saved)
    assert again.train.lr == pytest.approx(3e-6)
    assert again.rollout == cfg.rollout and again.algorithm == cfg.algorithm


def test_old_batch_size_names_still_load_and_say_what_to_use(tmp_path, capsys):
    import vlrft.config as config

    config._warned.clear()
    path = write(tmp_path, """
        rollout: {n: 4, batch_size: 16}
        train: {micro_batch_size: 2, mini_batch_size: 8, eval_batch_size: 5}
    """)
    cfg = load_config(path)
    assert cfg.rollout.global_batch_completions == 16 and cfg.train.micro_batch_completions_per_rank == 2
    assert cfg.train.global_mini_batch_completions == 8 and cfg.train.eval_batch_prompts == 5
    assert cfg.rollout.batch_size == 16 and cfg.train.micro_batch_size == 2  # code reading the old names works
    err = capsys.readouterr().err
    assert "config key 'rollout.batch_size' is deprecated; use 'rollout.global_batch_completions' " \
           "(completions per step over all ranks" in err
    assert "'train.micro_batch_size' is deprecated; use 'train.micro_batch_completions_per_rank'" in err
    assert "'train.eval_batch_size' is deprecated; use 'train.eval_batch_prompts'" in err
    # an old-name override overrides the file's new-name key; both names in one place is an error
    new = write(tmp_path, "rollout: {n: 4, global_batch_completions: 16}\n", name="new.yaml")
    assert load_config(new, ["rollout.batch_size=8"]).rollout.global_batch_completions == 8
    with pytest.raises(ConfigError, match="both 'rollout.batch_size' and 'rollout.global_batch_completions' are set"):
        load_config(None, ["rollout.batch_size=8", "rollout.global_batch_completions=8"])


@pytest.mark.parametrize("override,key", [
    ("train.lr=nan", "train.lr"), ("train.lr=inf", "train.lr"), ("train.lr=-inf", "train.lr"),
    ("rollout.temperature=-0.5", "rollout.temperature"), ("rollout.temperature=nan", "rollout.temperature"),
    ("rollout.top_p=1.5", "rollout.top_p"), ("rollout.top_p=0", "rollout.top_p"), ("rollout.top_k=-2", "rollout.top_k"),
    ("rollout.min_p=2", "rollout.min_p"), ("rollout.repetition_penalty=0", "rollout.repetition_penalty"),
    ("train.weight_decay=-1", "train.weight_decay"), ("train.max_grad_norm=inf", "train.max_grad_norm"),
    ("train.adam_betas=[0.9,1.5]", "train.adam_betas[1]"), ("train.eval_temperature=-1", "train.eval_temperature"),
    ("algorithm.entropy_coef=nan", "algorithm.entropy_coef"), ("algorithm.clip_eps_high=inf", "algorithm.clip_eps_high"),
    ("model.lora.dropout=1.0", "model.lora.dropout"), ("reward.timeout_s=0", "reward.timeout_s"),
    ("reward.functions=[{name: accuracy, weight: .nan}]", "reward.functions[0].weight"),
    ("train.save_every=-1", "train.save_every"), ("train.keep_last=-2", "train.keep_last"),
])
def test_float_options_must_be_finite_and_in_range(override, key):
    with pytest.raises(ConfigError, match=re.escape(f"config: {key}=")):
        load_config(None, [override])


def test_off_values_of_sampling_options_are_accepted():
    cfg = load_config(None, ["rollout.top_k=-1", "rollout.top_p=1.0", "rollout.temperature=0"])
    assert cfg.rollout.top_k == -1


def test_an_engines_tensor_parallel_group_must_stay_on_one_node(monkeypatch):
    """torchrun numbers a node's ranks consecutively: a group size that does not divide the processes per node
    would put one engine's ranks on two nodes (SGLang would look for GPUs the node does not have)."""
    from vlrft.config import ConfigError, load_config

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    common = ["train.strategy=fsdp2", "rollout.engine=vllm", "rollout.n=4", "rollout.global_batch_completions=96"]
    for tp in (1, 2, 4, 8):
        load_config(None, [*common, f"rollout.tensor_parallel_size={tp}"], world_size=24)
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size=3 .*processes per node \(8\)"):
        load_config(None, [*common, "rollout.tensor_parallel_size=3"], world_size=24)


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path):
    """PyYAML keeps the last of two equal keys: a second `train:` block silently replaced the first (another
    output folder, another lr)."""
    path = write(tmp_path, "train:\n  lr: 1.0e-6\n  output_dir: runs/a\nmodel:\n  path: x\ntrain:\n  lr: 1.0\n")
    with pytest.raises(ConfigError, match=r"cfg.yaml': key 'train' is given twice in one mapping \(lines 1 and 6\)"):
        load_config(path)
    nested = write(tmp_path, "reward:\n  functions:\n  - {name: accuracy, weight: 1, weight: 2}\n", name="n.yaml")
    with pytest.raises(ConfigError, match=r"key 'weight' is given twice in one mapping \(lines 3 and 3\)"):
        load_config(nested)
    merged = write(tmp_path, "base: &b {lr: 1.0e-6, seed: 3}\ntrain:\n  <<: *b\n  lr: 2.0e-6\n", name="m.yaml")
    data = yaml.safe_load(merged.read_text())  # a merge key's values overridden below it: not a duplicate
    del data["base"]
    cfg = load_config(write(tmp_path, yaml.safe_dump(data), name="m2.yaml"))
    assert cfg.train.lr == pytest.approx(2e-6) and cfg.train.seed == 3
    from vlrft.config import _read_yaml

    assert _read_yaml(merged, "m.yaml")["train"] == {"lr": 2e-6, "seed": 3}


def test_unreadable_config_files_are_one_line(tmp_path):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"train:\n  output_dir: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"latin.yaml' is not UTF-8 text \(byte 0xe9 at line 2\)"):
        load_config(latin)
    for text in ("a: &x [1, *x]\n", "train: &t\n  inner: *t\n"):
        with pytest.raises(ConfigError, match=r"refers to a value that contains it \(a YAML anchor"):
            load_config(write(tmp_path, text, name="loop.yaml"))
    with pytest.raises(ConfigError, match=r"interpolation"):
        load_config(None, ["train.output_dir=${train.output_dir}"])


def test_overrides_index_into_lists(tmp_path):
    path = write(tmp_path, """
        data: {train_files: [a.jsonl, b.jsonl]}
        reward: {functions: [{name: accuracy}, {name: format, weight: 0.5}]}
    """)
    cfg = load_config(path, ["reward.functions.1.weight=2", "data.train_files.0=x.jsonl", "reward.functions[0].alias=acc"])
    assert [(f.name, f.weight, f.alias) for f in cfg.reward.functions] == [("accuracy", 1.0, "acc"), ("format", 2.0, None)]
    assert cfg.data.train_files == ["x.jsonl", "b.jsonl"]
    for override, message in (
        ("reward.functions.2.weight=2", "'reward.functions' has 2 entries (0 to 1), so there is no entry 2; give the "
                                        "whole list (reward.functions=[...])"),
        ("reward.functions.first.weight=2", "'reward.functions' is a list; index it by number "
                                            "(reward.functions.0.first.weight=...) or give the whole list"),
        ("data.train_files.0.x=1", "'data.train_files.0' is 'a.jsonl', not a mapping or list"),
    ):
        with pytest.raises(ConfigError, match=re.escape(f"config: override '{override}': {message}")):
            load_config(path, [override])
    with pytest.raises(ConfigError, match=r"'data.train_files' has 0 entries"):
        load_config(None, ["data.train_files.0=x"])


@pytest.mark.parametrize("override,message", [
    ("train.eval_batch_prompts=0", "train.eval_batch_prompts=0 is not allowed; expected a positive integer"),
    ("train.eval_batch_prompts=-1", "train.eval_batch_prompts=-1 is not allowed; expected a positive integer"),
    ("train.total_steps=-1", "train.total_steps=-1 is not allowed; expected an integer >= 0"),
    ("train.eval_every=-2", "train.eval_every=-2 is not allowed; expected an integer >= 0"),
    ("logging.log_every=-1", "logging.log_every=-1 is not allowed; expected a positive integer"),
    ("logging.log_every=0", "logging.log_every=0 is not allowed; expected a positive integer"),
    ("train.deepspeed.zero_stage=1", "train.deepspeed.zero_stage=1 is not allowed; expected an integer in [2, 3]"),
    ("train.seed=-1", "train.seed=-1 is not allowed; expected an integer in [0, 2147483647]"),
    ("rollout.stop_token_ids=[3,-1]", "rollout.stop_token_ids[1]=-1 is not allowed; expected an integer >= 0"),
    ("data.max_train_samples=0", "data.max_train_samples=0 is not allowed; expected a positive integer"),
])
def test_integer_options_are_checked_against_their_declared_range(override, message):
    with pytest.raises(ConfigError, match=re.escape(f"config: {message}")):
        load_config(None, [override])


def test_every_integer_option_declares_its_range():
    """Every int field (int, int | None, list[int]) is declared with `minimum` (and maybe `maximum`), and the range
    shows in docs/config.md's type column."""
    import dataclasses
    import typing

    from vlrft.config_help import iter_keys

    def ints(cls, prefix=""):
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            key = f"{prefix}.{f.name}" if prefix else f.name
            if dataclasses.is_dataclass(tp):
                yield from ints(tp, key)
            elif int in (tp, *typing.get_args(tp)) and bool not in (tp, *typing.get_args(tp)):
                yield key, f

    found = dict(ints(Config))
    assert len(found) >= 40
    assert [key for key, f in found.items() if "range" not in f.metadata] == []
    types = {k.key: k.type_name for k in iter_keys()}
    assert types["train.eval_batch_prompts"] == "a positive integer"
    assert types["train.global_mini_batch_completions"] == "a positive integer or null"
    assert types["rollout.top_k"] == "an integer >= -1"
