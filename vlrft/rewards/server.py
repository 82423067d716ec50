"""Reference reward server: `POST /score` runs a `RewardSet` on the request (protocol in `vlrft.rewards.remote`).

Start it with `vlrft reward-server --port 8000 --functions accuracy,format=0.1`; `GET /health` answers
when it is up. Use it to test the remote path locally or as a template for your own server.
"""

from __future__ import annotations

import hmac
import json
import math
from typing import Any

from vlrft.rewards.remote import decode_request
from vlrft.rewards.reward_set import RewardSet
from vlrft.rewards.types import RewardError


def _floats(values: Any) -> list[float | None]:
    return [None if math.isnan(v) else v for v in values.tolist()]


def build_app(reward_set: RewardSet, api_key: str | None = None, max_request_mb: int = 256):
    """An aiohttp application serving `reward_set`; requests must carry `Authorization: Bearer <api_key>` if one is set."""
    from aiohttp import web

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "rewards": repr(reward_set)})

    async def score(request: web.Request) -> web.Response:
        if api_key is not None:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return web.json_response({"error": "missing or wrong API key (Authorization: Bearer <key>)"}, status=401)
        if request.content_type != "application/json":
            return web.json_response({"error": f"unsupported Content-Type {request.content_type!r}; send the request "
                                               "as application/json"}, status=415)
        try:
            payload = json.loads(await request.read())
        except RecursionError:
            return web.json_response({"error": "bad request: the JSON is nested too deeply"}, status=400)
        except ValueError as exc:  # also invalid UTF-8
            return web.json_response({"error": f"bad request: the body is not valid JSON ({exc})"}, status=400)
        try:
            kwargs = decode_request(payload)
        except (ValueError, TypeError, RecursionError) as exc:
            return web.json_response({"error": f"bad request: {exc}"}, status=400)
        try:
            result = await reward_set.ascore(kwargs.pop("completions"), **kwargs)
        except RewardError as exc:
            return web.json_response({"error": str(exc)}, status=422)
        return web.json_response({
            "rewards": _floats(result.total),
            "per_function": {key: _floats(values) for key, values in result.per_function.items()},
            "metrics": result.metrics,
        })

    app = web.Application(client_max_size=max_request_mb * 2**20)
    app.router.add_get("/health", health)
    app.router.add_post("/score", score)
    return app


def serve(reward_set: RewardSet, host: str, port: int, api_key: str | None = None, max_request_mb: int = 256) -> None:
    """Run the server until interrupted."""
    import torch  # noqa: F401  (results are tensors: import now so the first request does not pay for it)
    from aiohttp import web

    print(f"vlrft reward server: {reward_set!r}\nlistening on http://{host}:{port}/score", flush=True)
    web.run_app(build_app(reward_set, api_key, max_request_mb), host=host, port=port, print=None)
