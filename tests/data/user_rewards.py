"""Reward functions written the way a user would, loaded by tests as 'tests/data/user_rewards.py:NAME'."""

import time


def length_bonus(completions, **kwargs):
    """Longer answers up to 10 characters score more: min(len, 10) / 10."""
    return [min(len(c), 10) / 10 for c in completions]


def sleepy(completions, **kwargs):
    """Takes 2 s to answer (a slow reward server's function)."""
    time.sleep(2)
    return [1.0 for _ in completions]


def first_image_width(completions, images, **kwargs):
    """Width of each completion's first image (None without one): shows images arrive intact."""
    return [float(imgs[0].size[0]) if imgs else None for imgs in images]


def difficulty_weighted(completions, references, difficulty, **kwargs):
    """Exact answer times the sample's 'difficulty' dataset column."""
    return [float(c.strip() == r) * d for c, r, d in zip(completions, references, difficulty)]
