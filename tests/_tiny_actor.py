"""A random tiny model in training mode and its ActorVL, for the tests that measure a training forward's memory."""

from __future__ import annotations

from vlrft.models.actor import ActorVL
from vlrft.models.tiny import TinySpec, build_tiny_model, build_tokenizer


def training_actor(spec: TinySpec, checkpointing: bool = True):
    """(a random model of `spec` in training mode, no KV cache, with gradient checkpointing if asked; its ActorVL;
    its tokenizer)."""
    tokenizer = build_tokenizer(spec.vocab_size)
    model = build_tiny_model(spec, tokenizer)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    return model, ActorVL(model, model.config.image_token_id, model.config.video_token_id), tokenizer
