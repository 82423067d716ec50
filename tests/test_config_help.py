"""Every config key explains itself: help text on each field, `vlrft config --explain`, docs/config.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlrft.cli import main
from vlrft.config_help import explain, iter_keys, markdown, missing_help

REPO = Path(__file__).resolve().parents[1]


def test_every_config_field_has_help_text():
    assert missing_help() == [], "add metadata help (vlrft.config.option(default, 'help')) to these fields"


def test_docs_config_md_is_generated_from_the_code():
    committed = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    assert committed == markdown(), "regenerate it: vlrft config --markdown > docs/config.md"


def test_explain_works_for_every_key():
    for key in iter_keys():
        text = explain(key.key)
        assert key.key in text and key.help in text


def test_explain_on_the_command_line_with_type_default_and_value(capsys, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("rollout: {n: 4, global_batch_completions: 16}\n")
    assert main(["config", str(config), "--explain", "rollout.n"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rollout.n  (a positive integer; default 8); here: 4\n") and "group size" in out
    assert main(["config", "--explain", "train.micro_batch_size"]) == 0  # an old name points to the new one
    out = capsys.readouterr().out
    assert "deprecated name of 'train.micro_batch_completions_per_rank'" in out and "on each rank" in out
    assert main(["config", "--explain", "rollout.nn"]) == 2
    assert "no key 'rollout.nn' (did you mean 'rollout.n'" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["rollout.global_batch_completions", "train.micro_batch_completions_per_rank",
                                 "train.global_mini_batch_completions", "train.eval_batch_prompts"])
def test_batch_size_names_carry_their_unit_and_scope(key):
    text = explain(key)
    assert ("completions" in text or "prompts" in text) and ("all ranks" in text or "each rank" in text or
                                                             "prompts per" in text)
