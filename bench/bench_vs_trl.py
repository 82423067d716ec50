"""vlrft vs TRL's GRPOTrainer: time per optimizer step and peak memory, side by side in one run.

Both frameworks train the same tiny Qwen2-VL (built locally, random weights) on the same synthetic
shapes data (one image per prompt) with GRPO: same group size, completions per optimizer step,
micro-batch size, completion length, learning rate, beta, one policy update per generation batch
(num_iterations / ppo_epochs = 1), float32 on CPU, sampling at temperature 1, no vLLM, and a
reward that varies within every group (`text_hash_reward`), so both train on every row. Each (framework, beta) run is its own subprocess, so its peak RSS
(VmHWM) is its own; the runs are interleaved (vlrft, TRL, vlrft, TRL, ...) so that load from
other processes on the machine hits both alike. A step's time is the wall-clock interval between
two consecutive optimizer-step completions (data, generation, reward, logprobs, backward,
optimizer, the framework's own bookkeeping); warm-up steps are dropped and medians reported.
Each worker uses one torch thread by default: with more threads than free cores, OpenMP threads
spin against other jobs and steps get 10x slower and erratic. The process's CPU time per step is
reported next to the wall clock; on a shared machine it is the steadier measure of work done.

Completions are forced to the full length on both sides (`min_new_tokens = max_new_tokens`, i.e.
EOS is masked during sampling), so both do the same amount of generation and training work
(`--natural-length` turns this off; mean completion lengths are reported either way).

Settings (`--settings`, each its own model/data folder, run one after the other): `default` (one
112 px image, group 4, 64 tokens), `text` (text-only prompts, group 8), `images3` (three images per
prompt), `long` (256-token completions), `natural` (EOS may end completions), `image224` (one
224 px image, group 8), `zerovar` (the default with about half the prompts scoring alike on
every completion: zero-variance groups, which vlrft leaves out of the update). For each, the ratio
vlrft / TRL is printed per interleaved pair (each run's median step) as min/median/max, in wall
clock and CPU time, and so is the FLOP floor: the matmul FLOPs one step cannot avoid, counted from
the model's layer shapes (`step_flops`: each prompt once, every completion token, forward+backward,
a reference forward when beta > 0; attention scores left out), divided by the float32 matmul rate
measured in the same run at the same thread count (before and after the runs, the larger), and each framework's distance to it. Next to it
a memory-aware floor: the same, except that the decode steps' matmuls count at the rate measured
for their shape (`batch_size` rows through every weight, the weights read from memory each step:
`decode_matmul_rate`, the faster of MKL on plain weights and oneDNN on packed ones), which on a
small CPU is well below the matmul rate. And each framework's floor of its own work (TRL processes
each prompt once per completion, in generation and in training): their ratio is what vlrft / TRL
would be if both ran at their floors.

    PYTHONPATH=. python bench/bench_vs_trl.py --out bench_vs_trl.json
    PYTHONPATH=. python bench/bench_vs_trl.py --settings text images3 default long natural --repeats 3 --betas 0
    PYTHONPATH=. python bench/bench_vs_trl.py --steps 8 --repeats 3 --hidden-size 256 --betas 0 0.04
    py-spy record --subprocesses -o vlrft.svg -- python bench/bench_vs_trl.py --only vlrft --repeats 1 --betas 0.04

Needs `pip install 'vlrft[bench]'` (TRL). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

FRAMEWORKS = ("vlrft", "trl")


@dataclass(frozen=True)
class BenchSpec:
    """Everything both frameworks must agree on; passed to each worker subprocess as JSON."""

    workdir: str
    group_size: int = 4
    batch_size: int = 16  # completions per optimizer step
    micro_batch_size: int = 8  # completions per forward/backward pass
    completion_length: int = 64
    natural_length: bool = False  # let EOS end completions (lengths may then differ)
    warmup_steps: int = 2
    steps: int = 8  # measured optimizer steps
    lr: float = 1e-5
    beta: float = 0.0
    threads: int = 1  # torch intra-op threads (1: stable on a shared machine; 0 = torch's default)
    seed: int = 0
    # model
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 1024
    vision_depth: int = 2
    vision_hidden_size: int = 128
    image_size: int = 112  # pixels per side; 112x112 -> 64 patches -> 16 image tokens
    images_per_prompt: int = 1  # 0: text-only prompts; 3: the same image three times per prompt
    constant_share: float = 0.0  # about this share of prompts score alike on every completion (zero-variance groups)

    @property
    def model_dir(self) -> Path:
        return Path(self.workdir) / "model"

    @property
    def data_dir(self) -> Path:
        return Path(self.workdir) / "data"

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps


@dataclass
class RunResult:
    """One framework, one beta, one subprocess."""

    framework: str
    beta: float
    step_times_s: list[float]  # wall clock, measured steps only
    median_step_s: float
    step_cpu_s: list[float]  # this process's CPU time (user + sys) per measured step: robust to other load
    median_step_cpu_s: float
    peak_rss_mib: float  # VmHWM of the worker process (model load and setup included)
    rss_before_training_mib: float
    mean_completion_length: float
    setup_s: float  # process start to first step (imports, model load, trainer construction)
    phases_s: dict[str, float] = field(default_factory=dict)  # vlrft's own per-phase timers, medians


@dataclass
class Comparison:
    beta: float
    vlrft_median_step_s: float
    trl_median_step_s: float
    time_ratio: float  # vlrft / TRL wall clock; the goal is <= 0.67
    vlrft_median_step_cpu_s: float
    trl_median_step_cpu_s: float
    cpu_ratio: float  # vlrft / TRL CPU time per step
    vlrft_peak_rss_mib: float
    trl_peak_rss_mib: float
    rss_ratio: float
    vlrft_mean_completion_length: float
    trl_mean_completion_length: float
    runs: list[RunResult]


# ---------------------------------------------------------------------------------------------- setup


def build_assets(spec: BenchSpec) -> None:
    """Tiny Qwen2-VL and the shapes data, shared by both frameworks."""
    from examples.shapes import ShapesSpec, make_shapes
    from vlrft.models.tiny import TinySpec, build_tiny_vlm

    pixels = spec.image_size * spec.image_size
    build_tiny_vlm(spec.model_dir, TinySpec(
        arch="qwen2_vl", hidden_size=spec.hidden_size, num_layers=spec.num_layers, num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads, intermediate_size=spec.intermediate_size, vision_depth=spec.vision_depth,
        vision_hidden_size=spec.vision_hidden_size, vision_heads=max(1, spec.vision_hidden_size // 32),
        min_pixels=pixels, max_pixels=pixels, seed=spec.seed))
    prompts = spec.total_steps * spec.batch_size // spec.group_size
    make_shapes(spec.data_dir, ShapesSpec(tasks=("color",), image_size=spec.image_size, train_size=max(64, 2 * prompts),
                                          test_size=0, seed=spec.seed))
    if spec.images_per_prompt != 1:  # text-only or several images: the same rows, k image placeholders each
        path, k = spec.data_dir / "train.jsonl", spec.images_per_prompt
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for row in rows:
            text = row["prompt"].replace("<image>", "")
            row["prompt"], row["images"] = "<image>" * k + text, row["images"][:1] * k
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def trl_rows(spec: BenchSpec) -> list[dict]:
    """The native JSONL rows as a TRL conversational dataset with an `image` column."""
    from PIL import Image

    rows = []
    for line in (spec.data_dir / "train.jsonl").read_text().splitlines():
        row = json.loads(line)
        text = row["prompt"].replace("<image>", "")
        images = [Image.open(spec.data_dir / name).convert("RGB") for name in row["images"]]
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        rows.append({"prompt": [{"role": "user", "content": content}], "answer": row["answer"],
                     **({"images": images} if images else {})})
    return rows


def check_same_prompt(spec: BenchSpec) -> int:
    """Both frameworks must feed the model the same prompt token ids; returns the prompt length."""
    from trl.data_utils import prepare_multimodal_messages

    from vlrft.config import DataConfig
    from vlrft.data import PromptEncoder, read_samples
    from vlrft.models.loading import load_processor

    processor = load_processor(str(spec.model_dir))
    sample = read_samples(str(spec.data_dir / "train.jsonl"), "native", None, "error")[0]
    pixels = spec.image_size ** 2
    encoder = PromptEncoder(processor, DataConfig(min_pixels=pixels, max_pixels=pixels))
    ours = encoder.encode([sample]).batch.prompt_ids[0]
    row = trl_rows(spec)[0]
    messages = prepare_multimodal_messages(row["prompt"], images=row.get("images", []))
    theirs = processor.apply_chat_template(conversation=[messages], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"][0]
    if list(ours) != list(theirs):
        raise SystemExit(f"prompt token ids differ between vlrft ({len(ours)}) and TRL ({len(theirs)}); "
                         "the comparison would not be fair")
    return len(ours)


# ---------------------------------------------------------------------------------------------- workers


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _rss_mib() -> float:
    return _status_mib("VmRSS")


def _peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM). Not `ru_maxrss`: Linux carries that across fork and exec, so a
    worker would report the parent's peak whenever the parent had grown larger than the worker."""
    return _status_mib("VmHWM")


def _intervals(ends: list[float], warmup: int) -> list[float]:
    """Durations of steps warmup+1.. from the step-end timestamps (index 0 = start of step 1)."""
    return [b - a for a, b in zip(ends[warmup:], ends[warmup + 1:])]


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _result(framework: str, spec: BenchSpec, clocks: list[tuple[float, float]], rss_before: float,
            mean_length: float, setup: float, phases: dict[str, float] | None = None) -> RunResult:
    wall = _intervals([c[0] for c in clocks], spec.warmup_steps)
    cpu = _intervals([c[1] for c in clocks], spec.warmup_steps)
    return RunResult(framework, spec.beta, wall, statistics.median(wall), cpu, statistics.median(cpu), _peak_rss_mib(),
                     rss_before, mean_length, setup, phases or {})


def text_hash_reward(completions, references=None, constant_share: float = 0.0, **kwargs) -> list[float]:
    """Both frameworks' reward: a deterministic score in [0, 1) from each completion's text.

    It varies within every group, so every row has an advantage and both frameworks train on all of
    them. (An exact-match reward is 0 on every completion of a random model: every group would have
    zero variance, and vlrft would leave all its rows out of the update, `train.skip_zero_advantage_rows`.)
    With `constant_share` > 0 (setting `zerovar`), prompts whose reference answer hashes below it score
    1 on every completion instead, as groups a policy always or never solves do.
    """
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    references = references or [None] * len(texts)
    return [1.0 if zlib.crc32(str(ref).encode()) % 1000 < constant_share * 1000 else zlib.crc32(text.encode()) % 1000 / 1000
            for text, ref in zip(texts, references)]


def run_vlrft(spec: BenchSpec, t_start: float) -> RunResult:
    import yaml

    from vlrft.config import load_config
    from vlrft.trainer import Trainer

    pixels = spec.image_size ** 2
    config = {
        "model": {"path": str(spec.model_dir), "dtype": "float32"},
        "data": {"train_files": [str(spec.data_dir / "train.jsonl")], "format": "native",
                 "min_pixels": pixels, "max_pixels": pixels},
        "rollout": {"engine": "hf", "n": spec.group_size, "global_batch_completions": spec.batch_size,
                    "max_new_tokens": spec.completion_length, "temperature": 1.0,
                    "min_new_tokens": 0 if spec.natural_length else spec.completion_length},
        "reward": {"functions": [{"name": f"{Path(__file__).resolve()}:text_hash_reward",
                                  "kwargs": {"constant_share": spec.constant_share}}]},
        "algorithm": {"advantage": "grpo", "scale_rewards": "group", "loss_agg": "token-mean",
                      "kl_coef": spec.beta, "kl_estimator": "k3", "kl_in": "loss"},
        "train": {"output_dir": str(Path(spec.workdir) / f"vlrft_out_beta{spec.beta}"), "total_steps": spec.total_steps,
                  "seed": spec.seed, "lr": spec.lr, "micro_batch_completions_per_rank": spec.micro_batch_size, "ppo_epochs": 1,
                  "max_grad_norm": 1.0, "lr_scheduler": "constant"},
        "logging": {"tensorboard": False, "progress": False, "completions_every": 0},
    }
    path = Path(spec.workdir) / f"vlrft_beta{spec.beta}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    trainer = Trainer(load_config(path))
    rss_before = _rss_mib()
    clocks = [_clock()]
    setup = clocks[0][0] - t_start
    history = []
    for _ in range(spec.total_steps):  # what Trainer.fit() does per step, minus logging and checkpoints
        history.append(trainer.train_step())
        clocks.append(_clock())
    measured = history[spec.warmup_steps:]
    phases = {k: statistics.median(m[k] for m in measured) for k in measured[0] if k.startswith("time/")}
    phases["zero_std_groups"] = statistics.mean(m["frac_reward_zero_std"] for m in measured)  # share, not seconds
    return _result("vlrft", spec, clocks, rss_before, statistics.mean(m["completions/mean_length"] for m in measured),
                   setup, phases)


def run_trl(spec: BenchSpec, t_start: float) -> RunResult:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepClock(TrainerCallback):
        """Step-end timestamps and each step's mean completion length (TRL clears its metrics when it logs)."""

        def __init__(self):
            self.clocks: list[tuple[float, float]] = []
            self.lengths: list[float] = []
            self.trainer = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.clocks.append(_clock())

        def on_step_end(self, args, state, control, **kwargs):
            self.clocks.append(_clock())
            self.lengths.append(self.trainer._metrics["train"]["completions/mean_length"][-1])

    model = AutoModelForImageTextToText.from_pretrained(str(spec.model_dir), dtype=torch.float32,
                                                        attn_implementation="sdpa")
    processor = AutoProcessor.from_pretrained(str(spec.model_dir))
    dataset = Dataset.from_list(trl_rows(spec))
    accumulation = spec.batch_size // spec.micro_batch_size
    args = GRPOConfig(
        output_dir=str(Path(spec.workdir) / f"trl_out_beta{spec.beta}"), use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, per_device_train_batch_size=spec.micro_batch_size,
        gradient_accumulation_steps=accumulation, steps_per_generation=accumulation,
        num_generations=spec.group_size, max_completion_length=spec.completion_length, beta=spec.beta,
        num_iterations=1, learning_rate=spec.lr, lr_scheduler_type="constant", max_grad_norm=1.0,
        temperature=1.0, top_p=1.0, top_k=0, loss_type="dapo", scale_rewards="group", epsilon=0.2,
        max_steps=spec.total_steps, seed=spec.seed, logging_steps=10**6, report_to="none", save_strategy="no",
        disable_tqdm=True, log_completions=False, dataloader_num_workers=0,
        generation_kwargs=None if spec.natural_length else {"min_new_tokens": spec.completion_length},
    )
    clock = StepClock()
    def text_hash(completions, answer, **kwargs) -> list[float]:  # TRL passes the dataset's answer column
        return text_hash_reward(completions, references=answer, constant_share=spec.constant_share)

    trainer = GRPOTrainer(model=model, reward_funcs=[text_hash], args=args, train_dataset=dataset,
                          processing_class=processor, callbacks=[clock])
    clock.trainer = trainer
    rss_before = _rss_mib()
    setup = time.perf_counter() - t_start
    trainer.train()
    return _result("trl", spec, clock.clocks, rss_before, statistics.mean(clock.lengths[spec.warmup_steps:]), setup)


def worker(framework: str, spec_json: str, out: str) -> None:
    t_start = time.perf_counter()
    spec = BenchSpec(**json.loads(spec_json))
    import torch

    if spec.threads:
        torch.set_num_threads(spec.threads)
    result = (run_vlrft if framework == "vlrft" else run_trl)(spec, t_start)
    Path(out).write_text(json.dumps(asdict(result)))


# ---------------------------------------------------------------------------------------------- driver


def run_one(framework: str, spec: BenchSpec) -> RunResult:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = handle.name
    cmd = [sys.executable, __file__, "--worker", framework, "--spec", json.dumps(asdict(spec)), "--worker-out", out]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error",
               **({"OMP_NUM_THREADS": str(spec.threads)} if spec.threads else {}),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{framework} worker (beta={spec.beta}) failed:\n{proc.stderr[-4000:]}")
    result = RunResult(**json.loads(Path(out).read_text()))
    os.unlink(out)
    return result


def compare(beta: float, runs: list[RunResult]) -> Comparison:
    def pooled(fw: str, key: str) -> float:
        mine = [r for r in runs if r.framework == fw]
        if key == "step":
            return statistics.median(t for r in mine for t in r.step_times_s)
        if key == "cpu":
            return statistics.median(t for r in mine for t in r.step_cpu_s)
        if key == "rss":
            return statistics.median(r.peak_rss_mib for r in mine)
        return statistics.mean(r.mean_completion_length for r in mine)

    ours, theirs = pooled("vlrft", "step"), pooled("trl", "step")
    ours_cpu, theirs_cpu = pooled("vlrft", "cpu"), pooled("trl", "cpu")
    ours_rss, theirs_rss = pooled("vlrft", "rss"), pooled("trl", "rss")
    return Comparison(beta, ours, theirs, ours / theirs, ours_cpu, theirs_cpu, ours_cpu / theirs_cpu,
                      ours_rss, theirs_rss, ours_rss / theirs_rss,
                      pooled("vlrft", "len"), pooled("trl", "len"), runs)


SETTINGS = {  # name -> BenchSpec fields over the command line's
    "default": {},
    "text": {"images_per_prompt": 0, "group_size": 8},
    "images3": {"images_per_prompt": 3},
    "long": {"completion_length": 256},
    "natural": {"natural_length": True},
    "image224": {"image_size": 224, "group_size": 8},
    "zerovar": {"constant_share": 0.5},  # the default, with about half the groups scoring alike (no target)
}


TARGETS = {"text": 0.6, "default": 0.5, "image224": 0.4}  # vlrft / TRL per step the project aims for
FLOOR_TARGET = 1.5  # a default step at most this many times the FLOP floor


def summary_markdown(results: dict) -> str:
    """One markdown row per setting and beta, from `--out`'s JSON: what the README's speed table shows."""
    rows = ["| setting | beta | CPU s/step vlrft | TRL | CPU-time ratio min/median/max | wall ratio min/median/max "
            "| x FLOP floor (CPU) vlrft / TRL | x memory-aware floor vlrft / TRL | ratio of own floors (memory-aware) "
            "| peak RSS ratio | target |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, result in results.items():
        spec, floor = result["spec"], result["floor_s_per_step"]
        memory_floor = result.get("memory_floor_s_per_step", float("nan"))
        own_floors = (f"{floor / result['trl_floor_s_per_step']:.2f} ({memory_floor / result['trl_memory_floor_s_per_step']:.2f})"
                      if "trl_floor_s_per_step" in result else "-")
        images = "text-only" if spec["images_per_prompt"] == 0 else f"{spec['images_per_prompt']} x {spec['image_size']} px"
        what = (f"{name}: {images}, {result['prompt_length']}-token prompt, group {spec['group_size']}, {spec['batch_size']} x "
                f"{spec['completion_length']} tokens{' (natural lengths)' if spec['natural_length'] else ''}")
        for c in result["comparisons"]:
            runs = [RunResult(**r) for r in c["runs"]]
            target = TARGETS.get(name)
            rows.append(f"| {what} | {c['beta']:g} | {c['vlrft_median_step_cpu_s']:.2f} | {c['trl_median_step_cpu_s']:.2f} "
                        f"| {_spread(pair_ratios(runs, 'median_step_cpu_s'))} | {_spread(pair_ratios(runs, 'median_step_s'))} "
                        f"| {c['vlrft_median_step_cpu_s'] / floor:.2f} / {c['trl_median_step_cpu_s'] / floor:.2f} "
                        f"| {c['vlrft_median_step_cpu_s'] / memory_floor:.2f} / "
                        f"{c['trl_median_step_cpu_s'] / memory_floor:.2f} | {own_floors} "
                        f"| {c['rss_ratio']:.2f} | {'-' if target is None else f'<= {target:g}'} |")
    return "\n".join(rows)


def pair_ratios(runs: list[RunResult], key: str) -> list[float]:
    """vlrft / TRL for each interleaved pair (run i of each), from each run's median step."""
    ours = [getattr(r, key) for r in runs if r.framework == "vlrft"]
    theirs = [getattr(r, key) for r in runs if r.framework == "trl"]
    return [a / b for a, b in zip(ours, theirs)]


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}/{statistics.median(values):.2f}/{max(values):.2f}" if values else "-"


def matmul_rate(threads: int, size: int = 512, repeats: int = 10) -> float:
    """Best FLOP/s of a [size, size] x [size, 4 size] float32 matmul on this machine, now (same threads as the runs).

    Timed in this process's CPU time (best of `repeats`): on a shared machine the wall clock also
    counts the time other jobs held the core, which would lower the rate and so the floor.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    a, b = torch.randn(size, size), torch.randn(size, 4 * size)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(5):
            a @ b
        best = min(best, (time.process_time() - start) / 5)
    torch.set_num_threads(previous)
    return 2 * size * size * 4 * size / best


@dataclass(frozen=True)
class TextShape:
    """The text decoder's matmul weights, from the model's config.json."""

    layer_weights: list[tuple[int, int]]  # (out, in) of q, k, v, o, gate, up, down in one layer
    num_layers: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def of(cls, spec: BenchSpec) -> "TextShape":
        config = json.loads((spec.model_dir / "config.json").read_text())
        text = config.get("text_config", config)
        h, inter = text["hidden_size"], text["intermediate_size"]
        kv_width = text["num_key_value_heads"] * (h // text["num_attention_heads"])
        weights = [(h, h), (kv_width, h), (kv_width, h), (h, h), (inter, h), (inter, h), (h, inter)]
        return cls(weights, text["num_hidden_layers"], h, text["vocab_size"])

    @property
    def layer_params(self) -> int:
        return self.num_layers * sum(out * into for out, into in self.layer_weights)

    @property
    def head_params(self) -> int:
        return self.hidden_size * self.vocab_size


def step_flops(spec: BenchSpec, prompt_len: int, completion_length: float | None = None,
               prompt_copies: int = 1) -> float:
    """Matmul FLOPs one GRPO step cannot avoid, from the model's layer shapes (attention scores left out).

    Generation: each prompt (vision tower included) once, then every completion token one forward.
    `completion_length`: the mean measured one with natural lengths (default: the forced length).
    Training: forward + backward (3x a forward) over each prompt once and every completion token; with
    beta > 0 one more forward for the reference model. The LM head only for completion tokens.
    `prompt_copies`: how many times each prompt is processed instead (TRL: once per completion, so the
    group size), for the floor of a framework's own work.
    """
    vision = json.loads((spec.model_dir / "config.json").read_text())["vision_config"]
    shape = TextShape.of(spec)
    text_params, head = shape.layer_params, shape.head_params
    vh = vision.get("embed_dim", vision.get("hidden_size"))
    vmlp = int(vision.get("mlp_ratio", 4) * vh) if "mlp_ratio" in vision else vision.get("intermediate_size", 4 * vh)
    vision_params = vision["depth"] * (4 * vh * vh + 2 * vh * vmlp)
    patches = spec.images_per_prompt * (spec.image_size // 14) ** 2
    prompts = spec.batch_size // spec.group_size * prompt_copies
    completion_tokens = spec.batch_size * (completion_length or spec.completion_length)
    forward = 2 * (text_params * (prompts * prompt_len + completion_tokens) + head * completion_tokens
                   + vision_params * prompts * patches)
    passes = 1 + 3 + (1 if spec.beta > 0 else 0)  # generation, train forward+backward, reference
    return forward * passes


def print_floor(spec: BenchSpec, prompt_len: int, comparisons: list[Comparison], rate: float,
                length: float | None) -> None:
    floor = step_flops(spec, prompt_len, length) / rate
    print(f"FLOP floor: {step_flops(spec, prompt_len, length) / 1e9:.2f} GFLOP/step at {rate / 1e9:.1f} GFLOP/s (matmul, "
          f"measured in this run) = {floor:.3f} s/step")
    for c in comparisons:
        print(f"  beta={c.beta:g}: vlrft {c.vlrft_median_step_s / floor:.2f}x the floor (CPU time "
              f"{c.vlrft_median_step_cpu_s / floor:.2f}x), TRL {c.trl_median_step_s / floor:.2f}x "
              f"(CPU time {c.trl_median_step_cpu_s / floor:.2f}x)")


def decode_matmul_rate(spec: BenchSpec, repeats: int = 5) -> float:
    """FLOP/s of the decode steps' matmuls: `batch_size` rows through the text layers' weights, each used once.

    A decode step multiplies a few rows by every weight of the model once, so its matmuls read
    the weights from memory (they do not stay in cache from one step to the next): on a small
    CPU the step is bound by memory bandwidth, not by the matmul rate `matmul_rate` measures
    (there, 2 flops per weight read serve `batch_size` rows). Timed over 16 copies of the layer
    stack (larger than the caches), in CPU time, best of `repeats`.
    """
    import torch
    import torch.nn.functional as F

    previous = torch.get_num_threads()
    torch.set_num_threads(spec.threads or previous)
    shape = TextShape.of(spec)
    shapes = shape.layer_weights
    weights = [torch.randn(out, into) for _ in range(16 * shape.num_layers) for out, into in shapes]
    x = {into: torch.randn(spec.batch_size, into) for _, into in shapes}
    flops = sum(2 * spec.batch_size * w.shape[0] * w.shape[1] for w in weights)
    kernels = {"mkl": (weights, lambda w: F.linear(x[w.shape[1]], w))}
    if torch.backends.mkldnn.is_available():  # what the lean decode step uses on CPU (vlrft.decoding.lean_weights)
        packed = [(torch.ops.mkldnn._reorder_linear_weight(w, spec.batch_size), w.shape[1]) for w in weights]
        kernels["onednn"] = (packed, lambda p: torch.ops.mkldnn._linear_pointwise(x[p[1]], p[0], None, "none", [], ""))
    best = float("inf")
    for _ in range(repeats):
        for operands, multiply in kernels.values():
            start = time.process_time()
            for operand in operands:
                multiply(operand)
            best = min(best, time.process_time() - start)
    torch.set_num_threads(previous)
    return flops / best


def decode_flops(spec: BenchSpec, completion_length: float | None = None) -> float:
    """The decode steps' matmul FLOPs of one step (every completion token one forward, LM head included)."""
    shape = TextShape.of(spec)
    tokens = spec.batch_size * (completion_length or spec.completion_length)
    return 2 * tokens * (shape.layer_params + shape.head_params)


def print_table(spec: BenchSpec, prompt_len: int, comparisons: list[Comparison]) -> None:
    import trl
    import transformers

    print(f"\nvlrft vs TRL {trl.__version__} (transformers {transformers.__version__}), CPU, "
          f"{spec.threads or 'default'} threads; tiny Qwen2-VL hidden={spec.hidden_size} layers={spec.num_layers}, "
          f"prompt {prompt_len} tokens ({spec.images_per_prompt} x {(spec.image_size // 28) ** 2} image tokens), "
          f"group={spec.group_size}, {'natural lengths' if spec.natural_length else 'forced lengths'}, "
          f"{spec.batch_size} completions/step x {spec.completion_length} tokens, micro-batch {spec.micro_batch_size}; "
          f"median over {spec.steps} steps x runs (after {spec.warmup_steps} warm-up steps per run)")
    header = (f"{'beta':>5} | {'wall s/step vlrft':>17} {'TRL':>6} {'ratio':>6} | {'CPU s/step vlrft':>16} {'TRL':>6} "
              f"{'ratio':>6} | {'peak RSS MiB vlrft':>18} {'TRL':>5} {'ratio':>6} | {'len vlrft/TRL':>13}")
    print(header)
    print("-" * len(header))
    for c in comparisons:
        print(f"{c.beta:>5g} | {c.vlrft_median_step_s:>17.3f} {c.trl_median_step_s:>6.3f} {c.time_ratio:>6.2f} | "
              f"{c.vlrft_median_step_cpu_s:>16.3f} {c.trl_median_step_cpu_s:>6.3f} {c.cpu_ratio:>6.2f} | "
              f"{c.vlrft_peak_rss_mib:>18.0f} {c.trl_peak_rss_mib:>5.0f} {c.rss_ratio:>6.2f} | "
              f"{c.vlrft_mean_completion_length:>6.1f}/{c.trl_mean_completion_length:<6.1f}")
    for c in comparisons:
        for r in c.runs:
            phases = " ".join(f"{k.removeprefix('time/')}={v:.3f}" for k, v in r.phases_s.items())
            print(f"  beta={c.beta:g} {r.framework:>5}: wall [{', '.join(f'{t:.2f}' for t in r.step_times_s)}] "
                  f"cpu [{', '.join(f'{t:.2f}' for t in r.step_cpu_s)}] setup {r.setup_s:.1f}s "
                  f"RSS before/peak {r.rss_before_training_mib:.0f}/{r.peak_rss_mib:.0f} MiB {phases}")
    for c in comparisons:
        print(f"  beta={c.beta:g} per interleaved pair, min/median/max: wall {_spread(pair_ratios(c.runs, 'median_step_s'))}"
              f"  CPU {_spread(pair_ratios(c.runs, 'median_step_cpu_s'))}")
    for name, key in (("wall-clock", "time_ratio"), ("CPU-time", "cpu_ratio")):
        met = all(getattr(c, key) <= 0.67 for c in comparisons)
        print(f"goal vlrft <= 0.67x TRL ({name} per step): {'met' if met else 'NOT met'}")


def parse_args() -> argparse.Namespace:
    d = BenchSpec(workdir="")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--workdir", help="model, data and run outputs (default: a temporary folder)")
    p.add_argument("--steps", type=int, default=d.steps, help="measured optimizer steps per run")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--repeats", type=int, default=3, help="runs per framework and beta, interleaved (pairs)")
    p.add_argument("--betas", type=float, nargs="+", default=[0.0, 0.04])
    p.add_argument("--group-size", type=int, default=d.group_size)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="completions per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size)
    p.add_argument("--completion-length", type=int, default=d.completion_length)
    p.add_argument("--natural-length", action="store_true", help="let EOS end completions early")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--num-layers", type=int, default=d.num_layers)
    p.add_argument("--intermediate-size", type=int, default=d.intermediate_size)
    p.add_argument("--vision-depth", type=int, default=d.vision_depth)
    p.add_argument("--vision-hidden-size", type=int, default=d.vision_hidden_size)
    p.add_argument("--image-size", type=int, default=d.image_size)
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=["default"],
                   help="text: text-only prompts, group 8; images3: 3 images per prompt; long: 256-token "
                        "completions; natural: EOS may end completions; image224: one 224 px image, group 8; "
                        "each over the other options")
    p.add_argument("--images-per-prompt", type=int, default=d.images_per_prompt)
    p.add_argument("--only", choices=FRAMEWORKS, help="run one framework only (e.g. for profiling)")
    p.add_argument("--summarize", metavar="JSON", help="print the markdown summary of an earlier --out file and exit")
    p.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args.worker, args.spec, args.worker_out)
        return
    if args.summarize:
        print(summary_markdown(json.loads(Path(args.summarize).read_text())))
        return
    if args.batch_size % args.group_size or args.batch_size % args.micro_batch_size:
        raise SystemExit("--batch-size must be a multiple of --group-size and of --micro-batch-size")
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench_vs_trl_"))
    if not args.workdir:  # a --workdir is kept for inspection
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    results = {}
    for setting in args.settings:
        results[setting] = run_setting(args, setting, root / setting)
    if not args.only:
        print("\n" + summary_markdown(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
        print(f"wrote {args.out}")


def run_setting(args: argparse.Namespace, setting: str, workdir: Path) -> dict:
    options = dict(group_size=args.group_size, batch_size=args.batch_size,
                   micro_batch_size=args.micro_batch_size, completion_length=args.completion_length,
                   natural_length=args.natural_length, warmup_steps=args.warmup_steps, steps=args.steps, lr=args.lr,
                   threads=args.threads, hidden_size=args.hidden_size, num_layers=args.num_layers,
                   intermediate_size=args.intermediate_size, vision_depth=args.vision_depth,
                   vision_hidden_size=args.vision_hidden_size, image_size=args.image_size,
                   images_per_prompt=args.images_per_prompt)
    options.update(SETTINGS[setting])
    base = BenchSpec(workdir=str(workdir), **options)
    if base.batch_size % base.group_size or base.batch_size % base.micro_batch_size:
        raise SystemExit(f"{setting}: batch size must be a multiple of the group size and of the micro-batch size")
    print(f"\n=== setting {setting}: {SETTINGS[setting] or 'the command line options'}", flush=True)
    build_assets(base)
    # The machine's rates, measured before and after the runs; the larger counts (a disturbance while
    # measuring lowers a rate, which would lower the floor's distance, never raise it).
    rates_before = matmul_rate(base.threads), decode_matmul_rate(base)
    prompt_len = check_same_prompt(base) if not args.only else len(_vlrft_prompt_ids(base))
    frameworks = [args.only] if args.only else list(FRAMEWORKS)
    comparisons, all_runs = [], []
    for beta in args.betas:
        spec = BenchSpec(**{**asdict(base), "beta": beta})
        runs = []
        for repeat in range(args.repeats):
            for framework in frameworks:  # interleaved: vlrft, TRL, vlrft, TRL, ...
                result = run_one(framework, spec)
                print(f"beta={beta:g} run {repeat + 1}/{args.repeats} {framework}: "
                      f"median {result.median_step_s:.3f} s/step, "
                      f"peak RSS {result.peak_rss_mib:.0f} MiB", flush=True)
                runs.append(result)
        all_runs.extend(runs)
        if len(frameworks) == 2:
            comparisons.append(compare(beta, runs))
    rate, decode_rate = max(rates_before[0], matmul_rate(base.threads)), max(rates_before[1], decode_matmul_rate(base))
    length = statistics.mean(r.mean_completion_length for r in all_runs) if base.natural_length else None
    floor = step_flops(base, prompt_len, length) / rate
    decode = decode_flops(base, length)
    memory_floor = floor - decode / rate + decode / decode_rate
    # TRL's own work: the same, with each prompt processed once per completion (generation and training)
    trl_floor = step_flops(base, prompt_len, length, prompt_copies=base.group_size) / rate
    trl_memory_floor = trl_floor - decode / rate + decode / decode_rate
    if comparisons:
        print_table(base, prompt_len, comparisons)
        print_floor(base, prompt_len, comparisons, rate, length)
        print(f"Memory-aware floor: the decode steps' {decode / 1e9:.2f} GFLOP at the rate of {base.batch_size}-row "
              f"products over weights read from memory ({decode_rate / 1e9:.1f} GFLOP/s, measured in this run), the "
              f"rest as above = {memory_floor:.3f} s/step")
        for c in comparisons:
            print(f"  beta={c.beta:g}: vlrft {c.vlrft_median_step_cpu_s / memory_floor:.2f}x it (CPU time), "
                  f"TRL {c.trl_median_step_cpu_s / memory_floor:.2f}x")
        print(f"Floor of each framework's own work (TRL processes each prompt once per completion): vlrft "
              f"{floor:.3f} s, TRL {trl_floor:.3f} s; memory-aware vlrft {memory_floor:.3f} s, TRL "
              f"{trl_memory_floor:.3f} s. vlrft / TRL if both ran at their floors: {floor / trl_floor:.2f} "
              f"(memory-aware {memory_floor / trl_memory_floor:.2f})")
        for c in comparisons:
            print(f"  beta={c.beta:g}: each at x its own memory-aware floor (CPU time): vlrft "
                  f"{c.vlrft_median_step_cpu_s / memory_floor:.2f}, TRL {c.trl_median_step_cpu_s / trl_memory_floor:.2f}")
    else:
        for r in all_runs:
            print(f"{r.framework} beta={r.beta:g}: {r.median_step_s:.3f} s/step = {r.median_step_s / floor:.2f}x the "
                  f"FLOP floor ({floor:.3f} s at {rate / 1e9:.1f} GFLOP/s)")
    return {"spec": asdict(base), "prompt_length": prompt_len, "matmul_flops_per_s": rate,
            "floor_s_per_step": floor, "decode_matmul_flops_per_s": decode_rate,
            "memory_floor_s_per_step": memory_floor, "trl_floor_s_per_step": trl_floor,
            "trl_memory_floor_s_per_step": trl_memory_floor,
            "comparisons": [asdict(c) for c in comparisons], "runs": [asdict(r) for r in all_runs]}


def _vlrft_prompt_ids(spec: BenchSpec) -> list[int]:
    from vlrft.config import DataConfig
    from vlrft.data import PromptEncoder, read_samples
    from vlrft.models.loading import load_processor

    processor = load_processor(str(spec.model_dir))
    sample = read_samples(str(spec.data_dir / "train.jsonl"), "native", None, "error")[0]
    pixels = spec.image_size ** 2
    return list(PromptEncoder(processor, DataConfig(min_pixels=pixels, max_pixels=pixels)).encode([sample]).batch.prompt_ids[0])


if __name__ == "__main__":
    main()
