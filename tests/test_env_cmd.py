"""`vlrft env`: the installed stack, and every version requirement among its packages that it breaks."""

import json

import torch
import transformers
from packaging.version import Version

from vlrft.cli import main
from vlrft.commands import env_cmd


def test_env_reports_this_stack_and_finds_it_coherent(capsys):
    code = main(["env", "--json"])
    report = json.loads(capsys.readouterr().out)
    versions = {p["name"]: p["version"] for p in report["packages"]}
    assert Version(versions["torch"]).public == Version(torch.__version__).public  # with or without +cpu / +cu13x
    assert Version(versions["transformers"]) == Version(transformers.__version__)
    assert report["torch"]["cuda_available"] == torch.cuda.is_available()
    # the tested model families, each with what is tested and what is refused with why: the family table's
    from vlrft.families import MODEL_TYPES

    assert list(report["families"]) == list(MODEL_TYPES)
    assert report["families"]["qwen3_vl_moe"].startswith("Qwen3-VL-MoE: images as a grid of 16 px patches")
    assert "; engines hf, vllm (no videos, as Qwen3-VL; weight sync swaps the fused experts" in \
        report["families"]["qwen3_vl_moe"]
    assert "vllm_server (no videos, as Qwen3-VL; the experts synced as on vllm)" in report["families"]["qwen3_vl_moe"]
    assert "; engines hf, vllm, vllm_server; no videos;" in report["families"]["smolvlm"]
    assert "; refused vllm, vllm_server, sglang: its image placeholders expand" in report["families"]["gemma3"]
    assert "; engines hf, vllm, vllm_server; no videos;" in report["families"]["glm4v"]
    assert "each row in full in training" in report["families"]["gemma3"]
    assert "hf engine: lean group decoder" in report["families"]["internvl"]
    assert "each prompt once for its group in training" in report["families"]["smolvlm"]
    # CI installs a coherent stack (constraints.txt): no requirement among the installed packages is broken.
    assert report["problems"] == [] and code == 0, report["problems"]


def test_a_requirement_the_installed_versions_break_is_named_with_both_versions():
    requirements = ["torch==2.14.0", "transformers>=5.19", "xformers==0.0.30; platform_system == 'Linux'",
                    "pytest>=8; extra == 'test'"]
    installed = {"torch": "2.13.0+cpu", "transformers": "5.23.0", "pytest": "7.0", "xformers": None}
    assert env_cmd.unmet_requirements("vllm", requirements, installed) == [
        "vllm needs torch==2.14.0, but torch 2.13.0+cpu is installed"]
    assert env_cmd.unmet_requirements("vllm", requirements, installed, extras=("test",))[1:] == [
        "vllm needs pytest>=8, but pytest 7.0 is installed"]


def test_an_installed_package_that_does_not_import_is_a_problem_with_its_error(tmp_path, monkeypatch, capsys):
    # A real (tiny) installed distribution whose import fails as vLLM's does over a CPU-only torch.
    (tmp_path / "vlrft_env_probe").mkdir()
    (tmp_path / "vlrft_env_probe" / "__init__.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n")
    info = tmp_path / "vlrft_env_probe-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vlrft-env-probe\nVersion: 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(env_cmd.PACKAGES, "vlrft-env-probe", "vlrft_env_probe")
    assert main(["env"]) == 1
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert "vlrft-env-probe 1.0 IMPORT FAILS: RuntimeError: operator torchvision::nms does not exist" in flat
    assert "1 problem(s):" in out and "vlrft-env-probe 1.0 is installed but does not import" in out


def test_env_prints_the_family_table_as_the_readme_has_it_and_each_refusal_with_why(capsys):
    from vlrft.families_markdown import markdown_table

    assert main(["env", "--families-markdown"]) == 0
    assert capsys.readouterr().out == markdown_table()
    main(["env"])
    lines = capsys.readouterr().out.splitlines()
    gemma = lines.index(next(line for line in lines if line.startswith("  gemma3 ")))
    assert lines[gemma + 1].strip() == ("✘ vllm, vllm_server, sglang: its image placeholders expand to text around "
                                        "the image tokens, which vlrft's prompt folding does not invert")
    assert lines[gemma + 2].strip() == "✘ videos: its processor takes no videos"
