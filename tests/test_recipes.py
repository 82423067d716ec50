"""`model.build_recipe`: a function named by reference builds model.path once, whole or not at all."""

from __future__ import annotations

import pytest

from vlrft.errors import UserError
from vlrft.models.recipes import ensure_model


def test_a_recipe_file_builds_the_folder_once_and_a_failed_build_leaves_nothing(tmp_path):
    recipe = tmp_path / "my_recipe.py"
    recipe.write_text(
        "import json\n"
        "CALLS = []\n"
        "def build(out):\n"
        "    CALLS.append(out)\n"
        "    (out / 'config.json').write_text(json.dumps({'built_in': out.name}))\n"
        "def broken(out):\n"
        "    (out / 'half.bin').write_bytes(b'x')\n"
        "    raise RuntimeError('disk on fire')\n")
    target = tmp_path / "model"
    ensure_model(str(target), f"{recipe}:build")
    assert (target / "config.json").read_text() == '{"built_in": "model.building"}'  # built aside, then renamed
    ensure_model(str(target), f"{recipe}:build")  # exists: not rebuilt
    import sys

    module = next(m for name, m in sys.modules.items() if name.startswith("vlrft_user_my_recipe_"))
    assert len(module.CALLS) == 1
    with pytest.raises(RuntimeError, match="disk on fire"):
        ensure_model(str(tmp_path / "other"), f"{recipe}:broken")
    assert not (tmp_path / "other").exists()


def test_a_recipe_that_is_not_a_reference_is_refused_in_one_line(tmp_path):
    with pytest.raises(UserError, match=r"model.build_recipe='shapes-demo' is not a reference; give 'module:function' "
                                        r"or 'path/to/file.py:function'"):
        ensure_model(str(tmp_path / "m"), "shapes-demo")
    ensure_model(str(tmp_path / "m"), None)  # no recipe: nothing to build, nothing checked
    assert not (tmp_path / "m").exists()


def test_the_shipped_demo_configs_name_recipes_that_exist():
    from pathlib import Path

    from vlrft.config import load_config
    from vlrft.registry import load_reference

    configs = Path(__file__).resolve().parents[1] / "configs"
    for name in ("demo.yaml", "zoom_demo.yaml"):
        recipe = load_config(configs / name, validate=False).model.build_recipe
        assert callable(load_reference(recipe, f"{name}: model.build_recipe"))
