"""Token ids every rollout engine, the trainer and the model recipes agree on (`TokenSpec`).

It lives at the package root, below the models and the engines, because both read it: the engines
to stop and suppress, the policy (`ActorVL`) to give suppressed tokens zero probability, so the
trainer's distribution is the one the rollouts were sampled from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class TokenSpec:
    """Token ids every engine and the trainer agree on, read from the processor and the model config."""

    pad_id: int
    eos_ids: tuple[int, ...]
    image_token_id: int
    video_token_id: int
    # Vision placeholder tokens a completion must never contain: the model would try to place image
    # features there ("image tokens != image features"), so every engine suppresses them.
    suppressed_ids: tuple[int, ...] = ()

    @classmethod
    def from_model(cls, processor, model_config, generation_config=None, extra_stop_ids=()) -> "TokenSpec":
        tok = processor.tokenizer
        eos: list[int] = []
        for source in (getattr(generation_config, "eos_token_id", None), tok.eos_token_id,
                       getattr(getattr(model_config, "text_config", model_config), "eos_token_id", None)):
            for value in (source if isinstance(source, (list, tuple)) else [source]):
                if value is not None and value not in eos:
                    eos.append(int(value))
        eos.extend(int(i) for i in extra_stop_ids if int(i) not in eos)
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
        image_id = int(getattr(model_config, "image_token_id", -1) or -1)
        video_id = int(getattr(model_config, "video_token_id", -1) or -1)
        return cls(pad_id=int(pad), eos_ids=tuple(eos), image_token_id=image_id, video_token_id=video_id,
                   suppressed_ids=vision_special_ids(processor, model_config))


# Vision special tokens by name: Qwen-VL's <|vision_start|>, <|vision_end|>, <|vision_pad|>, <|image_pad|>,
# <|video_pad|> (and any other <|vision_*|>, <|image_*|>, <|video_*|> a processor's tokenizer defines); GLM-4.1V's
# <|image|>, <|video|>, <|begin_of_image|>, <|end_of_image|>, <|begin_of_video|>, <|end_of_video|>; Gemma 3's
# <start_of_image>, <end_of_image>, <image_soft_token>; SmolVLM's <image>, <fake_token_around_image>, <global-img> and
# its tiles' <row_r_col_c>.
_VISION_TOKEN = re.compile(r"^(<\|((vision|image|video)_[a-z_]+|image|video|(begin|end)_of_(image|video))\|>"
                           r"|<(start_of_image|end_of_image|image_soft_token)>"  # Gemma 3's
                           r"|<(image|fake_token_around_image|global-img|row_\d+_col_\d+)>)$")  # SmolVLM's
_VISION_ID_NAMES = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                    "image_start_token_id", "image_end_token_id", "video_start_token_id", "video_end_token_id",
                    "boi_token_index", "eoi_token_index", "image_token_index")


def vision_special_ids(processor, model_config) -> tuple[int, ...]:
    """Every vision special token id the model config, the processor and its tokenizer define, sorted.

    Reading only the config's ids misses `<|vision_pad|>`, which no config names but the tokenizer
    defines and an untrained model does sample.
    """
    ids: set[int] = set()
    for source in (model_config, processor):
        for name in _VISION_ID_NAMES:
            value = getattr(source, name, None)
            if isinstance(value, int) and value >= 0:
                ids.add(value)
    tokenizer = getattr(processor, "tokenizer", processor)
    for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if _VISION_TOKEN.match(str(getattr(token, "content", token))):
            ids.add(int(token_id))
    return tuple(sorted(ids))
