"""Remote rewards over HTTP: the `remote` reward function (client) and the JSON protocol it speaks.

Request, `POST <url>` with JSON (and `Authorization: Bearer <key>` when a key is set):

    {"completions": [str], "prompts": [str], "references": [str|null], "labels": [str|null],
     "extras": [{column: value}], "step": int,
     "images": [base64 PNG],          # each distinct image once
     "image_index": [[int]]}          # per completion: its images, as indices into "images"

Response: `{"rewards": [float|null]}`, one per completion (null = not applicable). `vlrft reward-server`
(`vlrft.rewards.server`) is a reference implementation.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import random
import time
from typing import Any

from vlrft.errors import ConfigError
from vlrft.rewards.registry import reward
from vlrft.rewards.types import RewardError

API_KEY_ENV = "VLRFT_REWARD_API_KEY"


class RemoteRewardError(RewardError):
    """The reward server could not be reached, refused the request or answered garbage."""


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays and scalars, tensors
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def _png_base64(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def encode_request(
    completions: list[str],
    prompts: list[str],
    references: list[str | None],
    labels: list[str | None],
    images: list[list[Any]],
    columns: dict[str, list[Any]],
    step: int,
) -> bytes:
    """The JSON body of a scoring request; images shared by a group of completions are encoded once."""
    encoded: list[str] = []
    seen: dict[int, int] = {}
    image_index: list[list[int]] = []
    for i, sample_images in enumerate(images):
        row = []
        for image in sample_images or []:
            if not hasattr(image, "save"):
                raise TypeError(f"remote reward: images[{i}] holds a {type(image).__name__}; expected PIL images")
            if id(image) not in seen:
                seen[id(image)] = len(encoded)
                encoded.append(_png_base64(image))
            row.append(seen[id(image)])
        image_index.append(row)
    extras = [{name: values[i] for name, values in columns.items()} for i in range(len(completions))]
    body = {
        "completions": list(completions), "prompts": list(prompts), "references": list(references),
        "labels": list(labels), "extras": extras, "step": int(step), "images": encoded, "image_index": image_index,
    }
    return json.dumps(body, default=_json_default, allow_nan=False).encode("utf-8")


def decode_request(payload: Any) -> dict[str, Any]:
    """Keyword arguments for `RewardSet.ascore` from a request body; ValueError naming the bad field."""
    from PIL import Image

    if not isinstance(payload, dict):
        raise ValueError("request body must be a JSON object")
    completions = payload.get("completions")
    if not isinstance(completions, list) or not all(isinstance(c, str) for c in completions):
        raise ValueError("'completions' must be a list of strings")
    n = len(completions)

    def column(name: str, default: Any) -> list[Any]:
        value = payload.get(name)
        if value is None:
            return [default() if callable(default) else default for _ in range(n)]
        if not isinstance(value, list) or len(value) != n:
            raise ValueError(f"'{name}' must be a list with one entry per completion ({n})")
        return value

    for name, allowed, what in (("prompts", (str,), "a string"), ("references", (str, type(None)), "a string or null"),
                                ("labels", (str, type(None)), "a string or null")):
        for i, value in enumerate(column(name, None) if name in payload else []):
            if not isinstance(value, allowed):
                raise ValueError(f"'{name}[{i}]' must be {what}, got {type(value).__name__}")
    raw_images = payload.get("images") or []
    if not isinstance(raw_images, list) or not all(isinstance(d, str) for d in raw_images):
        raise ValueError("'images' must be a list of base64-encoded image strings")
    pictures = []
    for k, data in enumerate(raw_images):
        try:
            pictures.append(Image.open(io.BytesIO(base64.b64decode(data, validate=True))))
        except Exception as exc:
            raise ValueError(f"'images[{k}]' is not a base64-encoded image ({type(exc).__name__})") from None
    images = []
    for i, row in enumerate(column("image_index", list)):
        if not isinstance(row, list) or not all(isinstance(k, int) and 0 <= k < len(pictures) for k in row):
            raise ValueError(f"'image_index[{i}]' must list indices into 'images' (0..{len(pictures) - 1})")
        images.append([pictures[k] for k in row])
    extras = column("extras", dict)
    if not all(isinstance(e, dict) for e in extras):
        raise ValueError("'extras' must be a list of objects")
    step = payload.get("step", 0)
    if not isinstance(step, int):
        raise ValueError("'step' must be an integer")
    return {
        "completions": completions, "prompts": column("prompts", ""), "references": column("references", None),
        "labels": column("labels", None), "images": images, "extras": extras, "step": step,
    }


MAX_BACKOFF_S = 5.0  # the longest random wait between two attempts
MIN_BACKOFF_S = 0.05  # the shortest


@reward("remote")
class RemoteReward:
    """Callable async reward that POSTs the batch to a reward server and returns its `rewards`.

    Connection errors, timeouts, HTTP 429 and 5xx are retried until the call's budget (reward.timeout_s,
    a little less so that this error, not the caller's timeout, names the URL) runs out, or after `retries`
    retries when given. Each attempt waits at most `timeout_s` (default: a third of the budget, so a server
    that hangs is tried three times). Between attempts a random backoff of up to `backoff_s * 2**attempt`
    (at most `MAX_BACKOFF_S`; a server's Retry-After is honoured): every rank sends its batch at the same
    moment, and retrying in lock-step would hit a recovering server all at once. Then a `RemoteRewardError`
    names the URL. The API key (kwargs.api_key, reward.remote_api_key or $VLRFT_REWARD_API_KEY) is sent as
    a bearer token and never printed.
    """

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        timeout_s: float | None = None,
        retries: int | None = None,
        backoff_s: float = 0.25,
        reward_config: Any = None,
    ):
        self.url = url or getattr(reward_config, "remote_url", None)
        if not self.url:
            raise ConfigError("reward function 'remote' needs a URL: set reward.remote_url or its kwargs.url (e.g. http://127.0.0.1:8000/score)")
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"reward function 'remote': url {self.url!r} must start with http:// or https://")
        if (retries is not None and retries < 0) or backoff_s < 0:
            raise ConfigError(f"reward function 'remote': retries={retries} and backoff_s={backoff_s} must be >= 0")
        self._api_key = api_key or getattr(reward_config, "remote_api_key", None) or os.environ.get(API_KEY_ENV) or None
        self.retries = retries
        self.backoff_s = backoff_s
        budget = float(getattr(reward_config, "timeout_s", 30.0))
        self.budget_s = max(0.1, budget - min(1.0, 0.05 * budget))  # ends before the caller's own timeout
        self.timeout_s = float(timeout_s) if timeout_s is not None else max(0.1, self.budget_s / 3)

    def __repr__(self) -> str:  # never shows the key
        return f"RemoteReward(url={self.url!r}, timeout_s={self.timeout_s:g}, retries={self.retries})"

    async def __call__(
        self,
        completions: list[str],
        prompts: list[str],
        images: list[list[Any]],
        references: list[str | None],
        labels: list[str | None],
        step: int = 0,
        completion_ids: Any = None,  # not sent: the server works on text
        **columns: Any,
    ) -> list[float | None]:
        start = time.monotonic()  # the budget counts from here: encoding many images takes part of it
        body = await asyncio.to_thread(encode_request, completions, prompts, references, labels, images, columns, step)
        answer = await self._post(body, start)
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(rewards, list):
            raise RemoteRewardError(f"remote reward at {self.url} answered without a 'rewards' list; check the server implements the protocol")
        return rewards

    async def _post(self, body: bytes, start: float) -> Any:
        import aiohttp

        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        last = ""
        deadline = start + self.budget_s
        attempts, wait = 0, 0.0
        async with aiohttp.ClientSession() as session:
            while True:
                remaining = deadline - time.monotonic()
                if attempts and (remaining <= wait or (self.retries is not None and attempts > self.retries)):
                    break
                await asyncio.sleep(wait)
                attempts += 1
                limit = max(0.05, min(self.timeout_s, deadline - time.monotonic()))
                # at least MIN_BACKOFF_S: with backoff_s=0 a refused connection would be retried in a busy loop
                wait = max(MIN_BACKOFF_S, random.uniform(0.0, min(MAX_BACKOFF_S, self.backoff_s * 2 ** (attempts - 1))))
                try:
                    async with session.post(self.url, data=body, headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=limit)) as response:
                        text = await response.text()
                        status = response.status
                        retry_after = response.headers.get("Retry-After", "")
                except asyncio.TimeoutError:
                    last = f"no answer within {limit:g} s"
                    continue
                except aiohttp.ClientError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                    continue
                if status == 200:
                    try:
                        return json.loads(text)
                    except ValueError:
                        raise RemoteRewardError(f"remote reward at {self.url} answered with invalid JSON: {text[:200]!r}") from None
                if status in (401, 403):
                    raise RemoteRewardError(
                        f"remote reward at {self.url} rejected the request (HTTP {status}); set reward.remote_api_key "
                        f"or ${API_KEY_ENV} to the server's key"
                    )
                if status != 429 and status < 500:
                    raise RemoteRewardError(f"remote reward at {self.url} refused the request (HTTP {status}): {text[:300]}")
                last = f"HTTP {status}: {text[:200]}"
                if retry_after.strip().isdigit():  # the server says when to come back (seconds)
                    wait = max(wait, float(retry_after))
        ended_by = "kwargs.retries" if self.retries is not None and attempts > self.retries else "reward.timeout_s"
        raise RemoteRewardError(
            f"remote reward at {self.url} failed {attempts} time(s) in {time.monotonic() - start:.1f} s, last: {last}; "
            f"check that the server is running and reachable (e.g. `vlrft reward-server --port 8000`), or raise "
            f"{ended_by}"
        )
