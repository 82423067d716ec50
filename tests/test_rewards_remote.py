"""Remote rewards over real HTTP on 127.0.0.1 against the shipped `vlrft reward-server`."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import requests
from PIL import Image

from vlrft.config import RewardConfig
from vlrft.config import RewardFunctionConfig as F
from vlrft.errors import UserError
from vlrft.rewards import RewardError, RewardSet
from vlrft.rewards.remote import RemoteRewardError, encode_request

REPO = Path(__file__).resolve().parents[1]
USER_REWARDS = REPO / "tests" / "data" / "user_rewards.py"
KEY = "test-key-5f3a"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log: Path, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), SERVER_KEY=KEY)
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vlrft", "reward-server", "--host", "127.0.0.1", "--port", str(port), *args],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"reward server exited: {log.read_text()}")
        try:
            if requests.get(f"{base}/health", timeout=1).ok:
                return proc, f"{base}/score"
        except requests.ConnectionError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("reward server did not come up within 60 s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`--functions accuracy,format=0.5`, requiring the API key."""
    proc, url = start_server(tmp_path_factory.mktemp("server") / "log.txt", "--functions", "accuracy,format=0.5", "--api-key-env", "SERVER_KEY")
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def recipe_server(tmp_path_factory):
    """`--config` with per-label recipes, one of them slow; no API key."""
    config = tmp_path_factory.mktemp("server") / "rewards.yaml"
    config.write_text(textwrap.dedent(f"""
        reward:
          functions: [{{name: exact_match}}]
          recipes:
            slow: [{{name: "{USER_REWARDS}:sleepy"}}]
            image: [{{name: "{USER_REWARDS}:first_image_width"}}]
            difficulty: [{{name: "{USER_REWARDS}:difficulty_weighted"}}]
            choice: [{{name: choice}}]
    """))
    proc, url = start_server(config.parent / "log.txt", "--config", str(config))
    yield url
    stop(proc)


def remote_set(url: str, **kwargs) -> RewardSet:
    options = {k: kwargs.pop(k) for k in ("on_error", "remote_api_key") if k in kwargs}
    return RewardSet.from_config(RewardConfig(functions=[F("remote", kwargs=kwargs)], remote_url=url, **options))


def as_list(t) -> list:
    return [None if math.isnan(v) else v for v in t.tolist()]


COMPLETIONS = ["<think>It is red.</think><answer>red</answer>", "Red.", "blue", "<think>x</think><answer>blue</answer>"]
REFERENCES = ["red", "red", "red", None]


@pytest.mark.slow
def test_remote_rewards_equal_the_same_functions_run_locally(server):
    result = remote_set(server, remote_api_key=KEY).score(COMPLETIONS, references=REFERENCES, prompts=["What color?"] * 4)
    # accuracy + 0.5 * format; the last sample has no reference, so only its format counts
    assert as_list(result.total) == [1.5, 1.0, 0.0, 0.5]
    local = RewardSet.from_config(RewardConfig(functions=[F("accuracy"), F("format", weight=0.5)]))
    assert result.total.tolist() == local.score(COMPLETIONS, references=REFERENCES).total.tolist()


def test_api_key_from_environment_variable(server, monkeypatch):
    monkeypatch.setenv("VLRFT_REWARD_API_KEY", KEY)
    assert as_list(remote_set(server).score(["red"], references=["red"]).total) == [1.0]


def test_wrong_api_key_fails_at_once_without_showing_the_key(server):
    rs = remote_set(server, remote_api_key="wrong-key-123")
    start = time.perf_counter()
    with pytest.raises(RewardError, match=rf"remote reward at {server} rejected the request \(HTTP 401\)") as info:
        rs.score(["red"], references=["red"])
    assert time.perf_counter() - start < 5
    assert "wrong-key-123" not in str(info.value) and "wrong-key-123" not in repr(rs.callables["remote"].fn)


@pytest.mark.slow
def test_images_reach_the_server_intact_and_are_sent_once_per_group(recipe_server):
    small, large = Image.new("RGB", (28, 14), "red"), Image.new("RGB", (56, 28), "blue")
    images = [[small], [small], [large], []]
    result = remote_set(recipe_server).score(["a", "b", "c", "d"], images=images, labels=["image"] * 4)
    assert as_list(result.total) == [28.0, 28.0, 56.0, None]
    body = json.loads(encode_request(["a", "b", "c", "d"], [""] * 4, [None] * 4, ["image"] * 4, images, {}, 0))
    assert len(body["images"]) == 2 and body["image_index"] == [[0], [0], [1], []]


def test_dataset_columns_reach_the_server(recipe_server):
    result = remote_set(recipe_server).score(
        ["red", "red"], references=["red", "blue"], labels=["difficulty"] * 2, extras=[{"difficulty": 3.0}, {"difficulty": 2.0}]
    )
    assert as_list(result.total) == [3.0, 0.0]


def test_reward_errors_on_the_server_come_back_without_retries(recipe_server):
    with pytest.raises(RewardError, match=r"refused the request \(HTTP 422\).*'choice' failed on sample 1.*'42' is not an option letter"):
        remote_set(recipe_server).score(["B", "B"], references=["B", "42"], labels=["choice"] * 2)


def test_slow_server_times_out_with_the_url_in_the_error(recipe_server):
    rs = remote_set(recipe_server, timeout_s=0.5, retries=1)
    start = time.perf_counter()
    with pytest.raises(RewardError, match=rf"remote reward at {recipe_server} failed 2 time\(s\) in [\d.]+ s, last: no answer "
                                          r"within 0.5 s"):
        rs.score(["a"], labels=["slow"])
    assert time.perf_counter() - start < 10


def test_server_down_fails_in_bounded_time_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}/score"  # nothing listens there
    rs = remote_set(url, retries=2)
    start = time.perf_counter()
    with pytest.raises(RewardError, match=rf"remote reward at {url} failed 3 time\(s\) in [\d.]+ s, last: "
                                          r"ClientConnectorError.*vlrft reward-server"):
        rs.score(["a"])
    assert time.perf_counter() - start < 10


@pytest.mark.slow
def test_a_server_down_for_a_moment_is_reached_by_retries_within_the_budget():
    """A reward server restarting for a few seconds (nothing listening yet) must not fail the run: a refused
    connection fails at once, so a fixed number of quick retries would give up within a second; retries go on
    for the call's budget (reward.timeout_s), with random waits."""
    import http.server
    import threading

    port = free_port()

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["completions"])
            body = json.dumps({"rewards": [0.5] * n}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    servers = []

    def start_late():
        time.sleep(2.0)
        servers.append(http.server.HTTPServer(("127.0.0.1", port), Answer))
        servers[0].serve_forever()

    threading.Thread(target=start_late, daemon=True).start()
    start = time.perf_counter()
    try:
        result = RewardSet.from_config(RewardConfig(functions=[F("remote")], remote_url=f"http://127.0.0.1:{port}/score",
                                                    timeout_s=20)).score(["a", "b"])
    finally:
        if servers:
            servers[0].shutdown()
    assert as_list(result.total) == [0.5, 0.5]
    assert 2.0 <= time.perf_counter() - start < 20


def test_server_down_with_on_error_none_counts_not_applicable():
    result = remote_set(f"http://127.0.0.1:{free_port()}/score", on_error="none", retries=0).score(["a", "b"])
    assert as_list(result.total) == [None, None]
    assert result.metrics["reward/remote/errors"] == 2


def test_server_rejects_malformed_requests_with_a_reason(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    response = requests.post(server, json={"completions": ["a", "b"], "references": ["a"]}, headers=headers, timeout=10)
    assert response.status_code == 400
    assert "'references' must be a list with one entry per completion (2)" in response.json()["error"]
    response = requests.post(server, json={"completions": "a"}, headers=headers, timeout=10)
    assert response.status_code == 400 and "'completions' must be a list of strings" in response.json()["error"]


@pytest.mark.parametrize("body,content_type,status,reason", [
    ({"completions": ["a"], "labels": [["x"]]}, "application/json", 400, "'labels[0]' must be a string or null"),
    ({"completions": ["a"], "references": [{"a": 1}]}, "application/json", 400, "'references[0]' must be a string"),
    ({"completions": ["a"], "images": [1]}, "application/json", 400, "'images' must be a list of base64"),
    ("[" * 100_000 + "]" * 100_000, "application/json", 400, "nested too deeply"),
    ("{\"completions\": [\"a\"", "application/json", 400, "not valid JSON"),
    (b'{"completions": ["\xff"]}', "application/json", 400, "not valid JSON"),
    ({"completions": ["a"]}, "text/plain", 415, "send the request as application/json"),
])
def test_server_answers_malformed_requests_with_400_or_415_and_a_reason(server, body, content_type, status, reason):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": content_type}
    data = json.dumps(body) if isinstance(body, dict) else body
    response = requests.post(server, data=data, headers=headers, timeout=30)
    assert response.status_code == status and reason in response.json()["error"]
    assert requests.post(server, json={"completions": ["a"]}, headers={"Authorization": f"Bearer {KEY}"},
                         timeout=10).status_code == 200  # still serving


def test_remote_needs_a_url():
    with pytest.raises(UserError, match="needs a URL: set reward.remote_url"):
        RewardSet.from_config(RewardConfig(functions=[F("remote")]))


def test_reward_server_functions_option():
    from vlrft.commands.reward_server_cmd import parse_functions

    parsed = parse_functions(f"accuracy, format=0.1,{USER_REWARDS}:length_bonus=2")
    assert [(f.name, f.weight) for f in parsed] == [("accuracy", 1.0), ("format", 0.1), (f"{USER_REWARDS}:length_bonus", 2.0)]
    with pytest.raises(UserError, match="has weight 'x', not a number"):
        parse_functions("accuracy=x")


def test_remote_error_type():
    assert issubclass(RemoteRewardError, RewardError)
