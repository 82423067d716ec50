"""vlrft: reinforcement-learning fine-tuning for vision-language models."""

__version__ = "0.1.0"
