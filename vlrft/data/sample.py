"""The one sample schema every reader produces, and turning a sample's prompt into chat messages.

A prompt is plain text with `<image>` / `<video>` placeholders, or chat messages whose content is a
string (placeholders allowed) or a list of parts `{"type": "text"|"image"|"video", ...}`. Media
references embedded in parts are moved into `Sample.images` / `Sample.videos` by
`normalize_prompt`, so after reading, parts are bare and the i-th image part is `images[i]`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vlrft.errors import UserError

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
_PLACEHOLDER_RE = re.compile(r"(<image>|<video>)")
_ROLES = ("system", "user", "assistant")


@dataclass
class Sample:
    """One prompt of a dataset, with references to its media (loaded only when encoded).

    `source` locates the row for error messages: "train.jsonl line 12" (1-based line) for JSONL,
    "train.parquet row 11" (0-based, as pandas and `datasets` index it) for parquet and Arrow.
    """

    id: str
    prompt: str | list[dict]
    images: list[Any] = field(default_factory=list)
    videos: list[Any] = field(default_factory=list)
    answer: str | None = None
    label: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    source: str = "<memory>"

    def __post_init__(self) -> None:
        # Canonical form: media references embedded in message parts move into images/videos.
        self.prompt, self.images, self.videos = normalize_prompt(self.prompt, self.images, self.videos, self.source,
                                                                 self.id)


class BadSampleError(UserError):
    """A sample that cannot be used; the message names where it is, the field and the fix."""

    def __init__(self, source: str, sample_id: str | None, field_name: str, reason: str):
        self.source, self.sample_id, self.field, self.reason = source, sample_id, field_name, reason
        ident = f" (id {sample_id!r})" if sample_id is not None else ""
        super().__init__(f"{source}{ident}, field '{field_name}': {reason}")


@dataclass(frozen=True)
class SkippedSample:
    """A sample left out because `data.on_bad_sample=skip`, with the reason it would have failed."""

    sample: Sample | None  # None when the row could not even be read into a Sample
    source: str
    field: str
    reason: str

    @classmethod
    def from_error(cls, error: BadSampleError, sample: Sample | None = None) -> "SkippedSample":
        return cls(sample, error.source, error.field, error.reason)

    def __str__(self) -> str:
        ident = f" (id {self.sample.id!r})" if self.sample is not None else ""
        return f"{self.source}{ident}, field '{self.field}': {self.reason}"


def _split_placeholders(text: str) -> list[dict]:
    """"<image>What is x?" -> [{"type": "image"}, {"type": "text", "text": "What is x?"}]."""
    parts = []
    for piece in _PLACEHOLDER_RE.split(text):
        if piece == IMAGE_PLACEHOLDER:
            parts.append({"type": "image"})
        elif piece == VIDEO_PLACEHOLDER:
            parts.append({"type": "video"})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _part_kind(part: dict) -> str | None:
    kind = part.get("type")
    if kind in ("image", "image_url", "video", "text"):
        return "image" if kind == "image_url" else kind
    for key in ("image", "image_url", "video", "text"):  # parts without "type", as some datasets write them
        if key in part:
            return "image" if key == "image_url" else key
    return None


def _embedded_ref(part: dict, kind: str) -> Any:
    """The media reference a part carries, or None for a bare part."""
    if kind == "image":
        ref = part.get("image", part.get("image_url"))
        if isinstance(ref, dict) and "url" in ref:  # OpenAI style {"image_url": {"url": ...}}
            ref = ref["url"]
        return ref
    return part.get("video")


def normalize_prompt(prompt: Any, images: list, videos: list, source: str, sample_id: str | None,
                     images_first: bool = False) -> tuple[str | list[dict], list, list]:
    """Validate a prompt and move media references embedded in message parts into the media lists.

    With `images_first` (TRL's convention), a prompt without any image placeholder or part gets its
    images inserted at the start of the first user message.
    """
    if isinstance(prompt, str):
        if images_first and images and IMAGE_PLACEHOLDER not in prompt:
            prompt = IMAGE_PLACEHOLDER * len(images) + prompt
        return prompt, list(images), list(videos)
    if not isinstance(prompt, list) or not prompt:
        raise BadSampleError(source, sample_id, "prompt", f"expected text or a non-empty list of chat messages, "
                             f"got {type(prompt).__name__} {str(prompt)[:60]!r}")
    messages = copy.deepcopy(prompt)
    found_images, found_videos = [], []
    has_image_part = False
    for m, message in enumerate(messages):
        where = f"prompt[{m}]"
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise BadSampleError(source, sample_id, where, "each chat message needs 'role' and 'content' keys, e.g. "
                                 "{\"role\": \"user\", \"content\": \"<image>What is shown?\"}")
        if message["role"] not in _ROLES:
            raise BadSampleError(source, sample_id, f"{where}.role", f"role {message['role']!r} is not one of {_ROLES}")
        content = message["content"]
        if isinstance(content, str):
            has_image_part |= IMAGE_PLACEHOLDER in content
            continue
        if not isinstance(content, list):
            raise BadSampleError(source, sample_id, f"{where}.content", "content must be text or a list of parts")
        new_parts = []
        for p, part in enumerate(content):
            kind = _part_kind(part) if isinstance(part, dict) else None
            if kind is None:
                raise BadSampleError(source, sample_id, f"{where}.content[{p}]",
                                     "a content part must be {\"type\": \"text\", \"text\": ...}, "
                                     "{\"type\": \"image\"} or {\"type\": \"video\"}")
            if kind == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise BadSampleError(source, sample_id, f"{where}.content[{p}].text", "text part without a string")
                has_image_part |= IMAGE_PLACEHOLDER in text
                new_parts.append({"type": "text", "text": text})
                continue
            has_image_part |= kind == "image"
            ref = _embedded_ref(part, kind)
            if ref is not None:
                (found_images if kind == "image" else found_videos).append(ref)
            new_parts.append({"type": kind})
        message["content"] = new_parts
    if found_images and images:
        raise BadSampleError(source, sample_id, "images", "images are given both inside the prompt's message parts "
                             "and in the images column; keep one of them")
    if found_videos and videos:
        raise BadSampleError(source, sample_id, "videos", "videos are given both inside the prompt's message parts "
                             "and in the videos column; keep one of them")
    images = found_images or list(images)
    videos = found_videos or list(videos)
    if images_first and images and not has_image_part:
        for message in messages:
            if message["role"] == "user":
                content = message["content"]
                parts = _split_placeholders(content) if isinstance(content, str) else content
                message["content"] = [{"type": "image"} for _ in images] + parts
                break
    return messages, images, videos


def build_messages(sample: Sample, system_prompt: str | None = None, prompt_suffix: str | None = None) -> list[dict]:
    """Chat messages with typed parts for `sample`, checked against its media counts.

    Adds `system_prompt` when the prompt has no system message and appends `prompt_suffix`
    (verbatim) to the last user message. Raises `BadSampleError` for an empty prompt or when the
    number of image/video placeholders differs from the number of images/videos, or for text no tokenizer can
    encode (a lone surrogate).
    """
    _refuse_surrogates(sample)
    raw = [{"role": "user", "content": sample.prompt}] if isinstance(sample.prompt, str) else sample.prompt
    messages = []
    for message in raw:
        content = message["content"]
        parts: list[dict] = []
        for part in ([{"type": "text", "text": content}] if isinstance(content, str) else content):
            parts.extend(_split_placeholders(part["text"]) if part["type"] == "text" else [dict(part)])
        messages.append({"role": message["role"], "content": parts})
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": [{"type": "text", "text": system_prompt}]})
    users = [m for m in messages if m["role"] == "user"]
    if not users:
        raise BadSampleError(sample.source, sample.id, "prompt", "the chat has no user message")
    if prompt_suffix:
        users[-1]["content"].append({"type": "text", "text": prompt_suffix})
    user_text = "".join(p["text"] for m in users for p in m["content"] if p["type"] == "text")
    if not user_text.strip():
        raise BadSampleError(sample.source, sample.id, "prompt", "the prompt is empty (no text besides placeholders); "
                             "add the question or set data.prompt_suffix")
    for kind, refs in (("image", sample.images), ("video", sample.videos)):
        slots = sum(1 for m in messages for p in m["content"] if p["type"] == kind)
        if slots != len(refs):
            raise BadSampleError(sample.source, sample.id, "prompt",
                                 f"the prompt has {slots} <{kind}> placeholder(s) but the sample has {len(refs)} "
                                 f"{kind}(s); put exactly one <{kind}> (or {{\"type\": \"{kind}\"}} part) per {kind} "
                                 "where it belongs in the prompt")
    return messages


def reserved_tokens_in(messages: list[dict], reserved: Sequence[str]) -> list[str]:
    """The reserved special tokens (e.g. '<|image_pad|>') written literally in the messages' text."""
    text = "".join(p["text"] for m in messages for p in m["content"] if p["type"] == "text")
    return [tok for tok in reserved if tok and tok in text]


# Chat control tokens of common templates, for checks made without a tokenizer (`vlrft data check` without --model,
# the pre-training check): Qwen/InternVL/GLM/Llama-3/Phi-style <|...|> and Gemma's turn markers. With a tokenizer,
# its own special tokens are the list (`vlrft.data.processor.PromptEncoder`).
CHAT_TOKEN_RE = re.compile(r"<\|[A-Za-z0-9_.:-]{1,40}\|>|<(?:start|end)_of_turn>|<(?:bos|eos)>")
ESCAPE_MARK = "\u200b"  # zero-width space: `<|im_end|>` becomes `<\u200b|im_end|>`, read as plain text


def sample_texts(sample: Sample) -> list[tuple[str, str]]:
    """(field, text) of every text in the sample's prompt, fields named as errors name them."""
    if isinstance(sample.prompt, str):
        return [("prompt", sample.prompt)]
    texts = []
    for m, message in enumerate(sample.prompt):
        content = message["content"]
        if isinstance(content, str):
            texts.append((f"prompt[{m}].content", content))
            continue
        texts += [(f"prompt[{m}].content[{p}].text", part["text"]) for p, part in enumerate(content)
                  if part.get("type") == "text"]
    return texts


def special_tokens_in(sample: Sample, tokens: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """(field, token) of each special token written literally in the sample's own text (not data.system_prompt /
    prompt_suffix): of `tokens`, or the common chat control tokens (CHAT_TOKEN_RE) when none are given."""
    found = []
    for where, text in sample_texts(sample):
        text = _PLACEHOLDER_RE.sub("\0", text)  # <image> / <video> are placeholders here, never text
        if tokens is None:
            hits = CHAT_TOKEN_RE.findall(text)
        else:  # in the order they stand in the text
            hits = sorted((t for t in tokens if t and t in text), key=text.index)
        found += [(where, tok) for tok in dict.fromkeys(hits)]
    return found


def special_token_error(sample: Sample, found: list[tuple[str, str]]) -> BadSampleError:
    """The refusal of a sample whose text holds chat special tokens (data.special_tokens_in_text=refuse)."""
    where, token = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return BadSampleError(sample.source, sample.id, where,
                          f"the text contains the chat special token {token!r}{more}, which the chat template would "
                          "read as markup (e.g. ending the user turn and starting a forged one); remove it, or set "
                          "data.special_tokens_in_text=escape to keep it as plain text")


def escape_special_tokens(messages: list[dict], tokens: Sequence[str]) -> list[dict]:
    """`messages` with each of `tokens` in their text broken by a zero-width space after its first character, so the
    tokenizer reads it as plain text (data.special_tokens_in_text=escape)."""
    def escape(text: str) -> str:
        for tok in tokens:
            text = text.replace(tok, tok[0] + ESCAPE_MARK + tok[1:])
        return text

    return [{**m, "content": [{**p, "text": escape(p["text"])} if p["type"] == "text" else p for p in m["content"]]}
            for m in messages]


_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def _refuse_surrogates(sample: Sample) -> None:
    """A lone surrogate (an unpaired UTF-16 half, e.g. from a JSON "\\ud800" escape) is valid in a Python str but not
    in UTF-8: every tokenizer fails on it, and before this check only when the row was drawn in training."""
    for where, text in sample_texts(sample):
        found = _SURROGATE_RE.search(text)
        if found:
            raise BadSampleError(sample.source, sample.id, where,
                                 f"the text holds a lone surrogate {found.group()!r} at character {found.start()} "
                                 "(half of a UTF-16 pair, e.g. a JSON \\ud800 escape without its partner), which no "
                                 "tokenizer can encode; fix the row's text (write the whole character, or drop it)")
