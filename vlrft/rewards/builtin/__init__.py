"""Built-in rule rewards, registered by name: accuracy, math_accuracy, exact_match, choice, numeric, format, iou."""

from vlrft.rewards.builtin import answers, formats, grounding  # noqa: F401  (registers them)
