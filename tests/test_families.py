"""The model families table (`vlrft/families.py`): every ✔ names tests that exist, the README shows its rendering, and
the shipped configs and their comments agree with it."""

from __future__ import annotations

import ast
import functools
import json
import re
from pathlib import Path

import pytest
import yaml

from vlrft.families import FAMILIES, MODEL_TYPES, Cell, family
from vlrft.families_markdown import README_END, README_START, markdown_table

REPO = Path(__file__).resolve().parents[1]
SERVER_ENGINES = ("vllm", "vllm_server", "sglang")


def named_tests() -> list[tuple[str, str]]:
    """(where in the table, node id) of every test the table names."""
    out = []
    for fam in FAMILIES:
        out += [(f"{fam.model_type}.{name}", node) for name, cell in fam.features().items() for node in cell.tests]
        out += [(f"{fam.model_type}: {claim.text}", node) for claim in fam.claims for node in claim.tests]
    return out


@functools.cache
def file_facts(path: str) -> tuple[frozenset[str], frozenset[str]]:
    """(test function names, the string and number constants written in the file) of tests/FILE.py."""
    tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
    functions = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    constants = {str(n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and
                 isinstance(n.value, (str, int, float)) and not isinstance(n.value, bool)}
    return frozenset(functions), frozenset(constants)


def written_as_ids(param: str, constants: frozenset[str]) -> bool:
    """Whether `param` (a parametrised test's id) is constants of the file joined by '-', as pytest joins them."""
    @functools.cache
    def from_(start: int) -> bool:
        return start == len(param) or any(
            param.startswith(c, start) and (start + len(c) == len(param) or
                                            (param[start + len(c)] == "-" and from_(start + len(c) + 1)))
            for c in constants if c)
    return from_(0)


def missing_test(node: str) -> str | None:
    """Why node id `node` names no test (None: it does): its file, its function, its parameters written there."""
    match = re.fullmatch(r"(tests/[\w/]+\.py)::(\w+)(?:\[(.+)\])?", node)
    if match is None:
        return "not a node id of the form tests/FILE.py::test_name[param-id]"
    path, name, param = match.groups()
    if not (REPO / path).is_file():
        return f"{path} does not exist"
    functions, constants = file_facts(path)
    if name not in functions:
        return f"{path} has no function {name}"
    if param is not None and not written_as_ids(param, constants):
        return f"[{param}] is not made of parameters written in {path}"
    return None


def test_every_test_the_table_names_exists():
    missing = [f"{where}: {node}: {why}" for where, node in named_tests() for why in [missing_test(node)] if why]
    assert missing == [], "\n".join(missing)


def test_the_check_finds_a_renamed_test_a_missing_file_and_a_parameter_never_written():
    assert missing_test("tests/test_actor.py::test_prompt_computed_once_per_group_equals_the_full_forward[glm4v]") \
        is None
    assert missing_test("tests/test_rollout_hf.py::test_stop_string_cuts_right_after_it[gemma3-group-decoder]") is None
    assert "no function" in missing_test("tests/test_actor.py::test_prompt_computed_once_per_group[glm4v]")
    assert "does not exist" in missing_test("tests/test_gone.py::test_x")
    assert "not made of parameters" in missing_test(
        "tests/test_actor.py::test_prompt_computed_once_per_group_equals_the_full_forward[llama]")


def test_every_cell_is_supported_with_tests_or_refused_with_a_one_line_reason():
    for fam in FAMILIES:
        for name, cell in fam.features().items():
            assert cell.supported != bool(cell.refused), (fam.model_type, name)
            assert "\n" not in cell.refused + cell.note, (fam.model_type, name)
    with pytest.raises(ValueError, match="either supported with tests or refused"):
        Cell()
    with pytest.raises(ValueError, match="either supported with tests or refused"):
        Cell(("tests/test_x.py::test_y",), refused="why")


def test_the_table_holds_every_family_vlrft_builds_a_tiny_model_of_and_every_engine_the_config_takes():
    from typing import get_args, get_type_hints

    from vlrft.config import RolloutConfig
    from vlrft.families import ENGINES
    from vlrft.models.tiny import ARCHES

    assert MODEL_TYPES == ARCHES
    assert family("llava") is None and family("qwen2_vl").name == "Qwen2-VL"
    assert get_args(get_type_hints(RolloutConfig)["engine"]) == ENGINES


@pytest.mark.parametrize("document", ["README.md", "docs/engines.md"])
def test_the_documents_show_the_family_tables_rendering(document):
    """The README's table and docs/engines.md's (where each engine's refusals are looked up, with their reasons)."""
    text = (REPO / document).read_text(encoding="utf-8")
    assert text.count(README_START) == 1 and text.count(README_END) == 1, f"{document} lost its table markers"
    shown = text.split(README_START + "\n", 1)[1].split(README_END, 1)[0]
    assert shown == markdown_table(), (f"{document}'s model families table is not vlrft/families.py's; regenerate "
                                       "it: `vlrft env --families-markdown` and paste it between the markers")


# ---------------------------------------------------------------------------------------------- shipped configs


def config_family(path: Path) -> str:
    """The model_type a shipped config trains: its Hub model's config.json as vlrft ships it (vlrft/plan), or for
    the demos, whose model a recipe builds, the recipe's TinySpec arch."""
    cfg = yaml.safe_load(path.read_text(encoding="utf-8"))["model"]
    shipped = REPO / "vlrft" / "plan" / "model_configs" / (cfg["path"].replace("/", "--") + ".json")
    if shipped.is_file():
        return json.loads(shipped.read_text())["model_type"]
    module, function = cfg["build_recipe"].split(":")
    source = (REPO / module).read_text(encoding="utf-8")
    body = source.split(f"def {function}(", 1)[1].split("\ndef ", 1)[0]
    return re.search(r'TinySpec\(arch="(\w+)"', body).group(1)


def test_every_shipped_config_is_listed_under_the_family_it_trains_with_an_engine_that_takes_it():
    listed = {name: fam for fam in FAMILIES for name in fam.configs}
    shipped = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
    assert sorted(listed) == shipped, "list each configs/*.yaml in its family's `configs` in vlrft/families.py"
    for name, fam in listed.items():
        path = REPO / "configs" / name
        assert config_family(path) == fam.model_type, name
        engine = (yaml.safe_load(path.read_text())["rollout"] or {}).get("engine", "hf")
        assert fam.engine(engine).supported, (name, engine)


ENGINE_WORDS = {"vllm": r"\bvllm\b(?!_server)", "vllm_server": r"\bvllm_server\b", "sglang": r"\bsglang\b"}


def comment_contradictions(comments: str, fam) -> list[str]:
    """What `comments` (a config's comment text) says of `fam`'s engines against the table: a clause (split at ; ( )
    and a sentence's full stop)
    that calls engines refused names only refused ones, one that says an engine runs or takes the model names only
    supported ones, and 'tested with the hf engine only' holds only where every other engine is refused."""
    wrong = []
    for clause in re.split(r"[;()]|\.(?=\s|$)", comments):
        named = [e for e, pattern in ENGINE_WORDS.items() if re.search(pattern, clause, flags=re.I)]
        if "refused" in clause:
            wrong += [f"'{clause.strip()}': the table runs {e}" for e in named if fam.engine(e).supported]
        elif re.search(r"\b(runs|takes)\b", clause):
            wrong += [f"'{clause.strip()}': the table refuses {e}" for e in named if not fam.engine(e).supported]
        if re.search(r"hf engine only", clause):
            wrong += [f"'{clause.strip()}': the table runs {e}" for e in SERVER_ENGINES if fam.engine(e).supported]
    return wrong


def test_config_comments_do_not_contradict_the_table():
    wrong = []
    for fam in FAMILIES:
        for name in fam.configs:
            text = (REPO / "configs" / name).read_text(encoding="utf-8")
            comments = " ".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
            wrong += [f"configs/{name}: {w}" for w in comment_contradictions(comments, fam)]
    assert wrong == [], "\n".join(wrong)


def test_the_comment_check_sees_a_refusal_the_table_does_not_make():
    glm, gemma = family("glm4v"), family("gemma3")
    assert comment_contradictions("GLM-4.1V samples with the hf engine (vLLM/SGLang are refused for it).", glm) == \
        ["'vLLM/SGLang are refused for it': the table runs vllm"]
    assert comment_contradictions("rollout.engine=vllm runs it too", gemma) == \
        ["'rollout.engine=vllm runs it too': the table refuses vllm"]
    assert comment_contradictions("Qwen2.5-VL is tested with the hf engine only", family("qwen2_5_vl")) != []
    assert comment_contradictions("Gemma 3 samples with the hf engine (vLLM/SGLang are refused for it)", gemma) == []
