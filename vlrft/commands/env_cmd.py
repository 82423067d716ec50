"""Print this machine's stack (torch, CUDA and GPUs, transformers, engines) and what in it does not fit together.

It also names the model families vlrft is tested with, what is tested for each and what is refused, with why
(`vlrft.families`; any other family is refused at load); `--families-markdown` prints that table as the README has it.

For bug reports and before a GPU run: every package vlrft uses, its version, whether it imports, and
every version requirement among them that the installed versions break (vlrft's own, and those of
vLLM, SGLang, DeepSpeed, torchvision and PEFT on torch and transformers), each with the fix. Exit
status 0 when nothing is wrong, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata as metadata
import json
import platform
import sys
from dataclasses import asdict, dataclass, field

from packaging.requirements import InvalidRequirement, Requirement

# Distribution name -> module name, in the order they are printed. The first group is vlrft's core.
PACKAGES = {
    "torch": "torch", "transformers": "transformers", "tokenizers": "tokenizers", "safetensors": "safetensors",
    "datasets": "datasets", "torchvision": "torchvision", "av": "av", "qwen-vl-utils": "qwen_vl_utils",
    "peft": "peft", "deepspeed": "deepspeed", "vllm": "vllm", "sglang": "sglang", "flash-attn": "flash_attn",
    "wandb": "wandb", "trl": "trl",
}
# Whose requirements on the others are checked (an engine pins its own torch and transformers).
DEPENDENTS = ("vlrft", "torchvision", "peft", "deepspeed", "vllm", "sglang", "flash-attn", "trl")
ENGINE_FIX = ("install it in a virtual environment of its own with the tested pins: pip install -c "
              "constraints/{name}.txt -e '.[{name},video,peft]' (README, Install)")


@dataclass
class Package:
    name: str
    version: str | None  # None: not installed
    import_error: str | None = None  # first line of the error `import` raised, if it did


@dataclass
class Report:
    python: str
    platform: str
    vlrft: str
    packages: list[Package]
    torch: dict = field(default_factory=dict)  # CUDA build, GPUs, bf16, NCCL
    problems: list[str] = field(default_factory=list)
    families: dict = field(default_factory=dict)  # model_type -> "Name: what is tested; refused what, why"


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def import_error(module: str) -> str | None:
    """The first line of the error importing `module` raises, or None when it imports."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken install fails in many ways (ImportError, RuntimeError, OSError, ...)
        text = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {text[0] if text else ''}"
    return None


def unmet_requirements(dependent: str, requirements: list[str], versions: dict[str, str | None],
                       extras: tuple[str, ...] = ()) -> list[str]:
    """The requirements of `dependent` (metadata strings) on packages in `versions` that the installed versions
    break; a requirement only of an extra counts when that extra is in `extras` (for vlrft: all of them, since
    an installed optional package must still be a version vlrft works with), one on a missing package never."""
    problems = []
    for text in requirements:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            continue
        name = requirement.name.lower().replace("_", "-")
        if name not in versions or versions[name] is None:
            continue
        marker = requirement.marker
        if marker is not None and not any(marker.evaluate({"extra": extra}) for extra in ("", *extras)):
            continue
        if not requirement.specifier.contains(versions[name], prereleases=True):
            problems.append(f"{dependent} needs {name}{requirement.specifier}, but {name} "
                            f"{versions[name]} is installed")
    return problems


def torch_facts() -> dict:
    import torch

    facts: dict = {"cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                   "cpu_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        facts["gpus"] = [f"{torch.cuda.get_device_name(i)}, "
                         f"{torch.cuda.get_device_properties(i).total_memory / 2**30:.1f} GiB"
                         for i in range(torch.cuda.device_count())]
        facts["bf16"] = torch.cuda.is_bf16_supported()
        try:
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):  # a build without NCCL
            facts["nccl"] = None
    return facts


def collect_report() -> Report:
    from vlrft import __version__

    versions = {name: installed_version(name) for name in PACKAGES}
    packages = [Package(name, version, import_error(PACKAGES[name]) if version else None)
                for name, version in versions.items()]
    problems = [f"{p.name} {p.version} is installed but does not import ({p.import_error}); "
                + (ENGINE_FIX.format(name=p.name) if p.name in ("vllm", "sglang") else
                   "reinstall it for this torch") for p in packages if p.import_error]
    for dependent in DEPENDENTS:
        version = __version__ if dependent == "vlrft" else versions.get(dependent)
        requirements = metadata.requires(dependent) if installed_version(dependent) else None
        if not version or not requirements:
            continue
        extras = tuple(metadata.metadata(dependent).get_all("Provides-Extra") or ()) if dependent == "vlrft" else ()
        for problem in unmet_requirements(dependent, requirements, versions, extras):
            fix = ENGINE_FIX.format(name=dependent) if dependent in ("vllm", "sglang") else \
                "install the versions in constraints.txt (pip install -c constraints.txt ...)"
            problems.append(f"{problem}; {fix}")
    facts = torch_facts() if versions["torch"] and not next(p for p in packages if p.name == "torch").import_error \
        else {}
    from vlrft.families_markdown import env_lines

    return Report(sys.version.split()[0], platform.platform(), __version__, packages, facts, problems, env_lines())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--families-markdown", action="store_true",
                        help="print only the model families table as Markdown (the README's)")


def run(args: argparse.Namespace) -> int:
    if args.families_markdown:
        from vlrft.families_markdown import markdown_table

        print(markdown_table(), end="")
        return 0
    with contextlib.redirect_stdout(sys.stderr):  # what packages print on import (DeepSpeed's accelerator notice)
        report = collect_report()
    if args.json:
        print(json.dumps(asdict(report), indent=1))
        return 1 if report.problems else 0
    print(f"vlrft {report.vlrft}, Python {report.python}, {report.platform}")
    for p in report.packages:
        state = "not installed" if p.version is None else p.version + (f"  IMPORT FAILS: {p.import_error}"
                                                                       if p.import_error else "")
        print(f"  {p.name:<14} {state}")
    for key, value in report.torch.items():
        print(f"  torch.{key:<13} {value}")
    print("model families (vlrft/families.py; each tested end to end; any other is refused at load):")
    from vlrft.families_markdown import env_text

    print("\n".join(env_text()))
    if report.problems:
        print(f"{len(report.problems)} problem(s):")
        for problem in report.problems:
            print(f"  - {problem}")
        return 1
    print("no problems found")
    return 0
