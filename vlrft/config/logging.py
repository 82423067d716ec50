"""The `logging:` section: where metrics and sample completions go."""

from __future__ import annotations

from dataclasses import dataclass

from vlrft.config.options import option


@dataclass
class LoggingConfig:
    """Where metrics and sample completions go."""

    tensorboard: bool = option(True, "write TensorBoard event files under output_dir")
    wandb: bool = option(False, "log to Weights & Biases (needs the wandb package)")
    wandb_project: str = option("vlrft", "W&B project")
    wandb_run_name: str | None = option(None, "W&B run name; default: W&B's")
    wandb_api_key: str | None = option(None, "W&B API key; prefer the WANDB_API_KEY variable (never saved)",
                                       secret=True)
    log_every: int = option(1, "log metrics every this many steps", minimum=1)
    completions_every: int = option(10, "steps between completion tables; 0 = never", minimum=0)
    completions_rows: int = option(8, "completions shown per table", minimum=1)
    progress: bool = option(True, "show a progress bar on the terminal")

