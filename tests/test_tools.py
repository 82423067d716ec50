"""The tool API: loading from config, the built-in zoom/crop, and failures that become counted observations."""

import asyncio
import time

import pytest
from PIL import Image

from vlrft.config import RolloutConfig, ToolConfig, load_config
from vlrft.errors import ConfigError
from vlrft.tools import MalformedCall, Tool, ToolCall, ToolContext, ToolOutput, ToolSet, load_tool, parse_qwen_tool_call
from vlrft.tools.builtin import region_box, zoom

SCHEMA = {"type": "object", "properties": {}}


def _ctx(images=(), sample=None):
    return ToolContext(images=list(images), sample=sample, turn=1)


def test_qwen_tool_calls_parse_and_bad_ones_say_why():
    assert parse_qwen_tool_call("no call here") is None
    call = parse_qwen_tool_call('look <tool_call>\n{"name": "zoom", "arguments": {"region": "top"}}\n</tool_call>')
    assert call == ToolCall("zoom", {"region": "top"})
    assert parse_qwen_tool_call('<tool_call>{"name": "zoom", "arguments": "{\\"bbox\\": [1, 2, 3, 4]}"}</tool_call>') \
        == ToolCall("zoom", {"bbox": [1, 2, 3, 4]})
    for text, why in (("<tool_call>{\"name\": \"zoom\"", "not closed"), ("<tool_call>{zoom}</tool_call>", "not valid JSON"),
                      ('<tool_call>["zoom"]</tool_call>', "JSON object"),
                      ('<tool_call>{"name": "z", "arguments": 3}</tool_call>', "arguments")):
        result = parse_qwen_tool_call(text)
        assert isinstance(result, MalformedCall) and why in result.reason, (text, result)


def test_raising_hanging_garbage_and_malformed_calls_are_counted_and_the_batch_goes_on():
    def ok(call, ctx):
        return f"got {call.arguments['x']}"

    def raises(call, ctx):
        raise RuntimeError("boom")

    def hangs(call, ctx):
        time.sleep(3)
        return "late"

    async def hangs_async(call, ctx):
        await asyncio.sleep(30)

    def garbage(call, ctx):
        return {"not": "an observation"}

    tools = ToolSet([Tool(fn.__name__, fn, "d", SCHEMA) for fn in (ok, raises, hangs, hangs_async, garbage)],
                    timeout_s=0.3, max_concurrency=4)
    calls = [ToolCall("ok", {"x": 1}), ToolCall("raises", {}), ToolCall("hangs", {}), ToolCall("hangs_async", {}),
             ToolCall("garbage", {}), ToolCall("missing", {}), MalformedCall("the tool call is not valid JSON")]
    start = time.perf_counter()
    outputs, kinds = tools.run(calls, [_ctx() for _ in calls])
    assert time.perf_counter() - start < 2.5  # the hung tools cost one timeout, concurrently, not their run time
    assert kinds == ["ok", "errors", "timeouts", "timeouts", "bad_outputs", "malformed_calls", "malformed_calls"]
    assert outputs[0].text == "got 1"
    assert outputs[1].text == "Error: RuntimeError: boom"
    assert "timed out after 0.3 s" in outputs[2].text and "timed out" in outputs[3].text
    assert "returned dict" in outputs[4].text
    assert "unknown tool 'missing'" in outputs[5].text and "ok, raises" in outputs[5].text
    assert outputs[6].text == "Error: the tool call is not valid JSON"
    # the next turn's calls run normally
    outputs, kinds = tools.run([ToolCall("ok", {"x": 2})], [_ctx()])
    assert kinds == ["ok"] and outputs[0].text == "got 2"
    tools.close()


def test_a_tool_that_exits_is_an_error_observation_and_the_batch_goes_on(caplog):
    """A tool calling sys.exit(4) (a script's habit), or raising KeyboardInterrupt in its own thread, ended the run
    with tracebacks; docs/multiturn.md promises an `Error:` observation for a tool's exception."""
    import sys

    def exits(call, ctx):
        sys.exit(4)

    async def exits_async(call, ctx):
        raise SystemExit("bye")

    def interrupts(call, ctx):
        raise KeyboardInterrupt

    def ok(call, ctx):
        return "fine"

    tools = ToolSet([Tool(fn.__name__, fn, "d", SCHEMA) for fn in (exits, exits_async, interrupts, ok)])
    calls = [ToolCall(name, {}) for name in ("exits", "exits_async", "interrupts", "ok")]
    outputs, kinds = tools.run(calls, [_ctx() for _ in calls])
    assert kinds == ["errors", "errors", "errors", "ok"]
    assert [o.text for o in outputs] == ["Error: SystemExit: 4", "Error: SystemExit: bye", "Error: KeyboardInterrupt",
                                         "fine"]
    assert "tool 'exits' raised SystemExit: 4" in caplog.text and "counted in tools/errors" in caplog.text
    tools.close()


def test_tools_return_text_images_lists_or_tool_outputs():
    image = Image.new("RGB", (8, 8))
    returns = {"text": "hello", "image": image, "both": [image, "a", "b"],
               "full": ToolOutput(text="t", images=[image], reward=0.5, done=True)}
    tools = ToolSet([Tool(name, (lambda v: lambda call, ctx: v)(value), "d", SCHEMA) for name, value in returns.items()])
    outputs, kinds = tools.run([ToolCall(name, {}) for name in returns], [_ctx() for _ in returns])
    assert kinds == ["ok"] * 4
    assert outputs[0] == ToolOutput(text="hello")
    assert outputs[1].images == [image] and outputs[1].text == ""
    assert outputs[2].images == [image] and outputs[2].text == "a\nb"
    assert outputs[3].reward == 0.5 and outputs[3].done


def test_zoom_cuts_the_original_image_by_box_or_region_at_higher_resolution(tmp_path):
    from vlrft.data import Sample

    original = Image.new("RGB", (300, 300), (255, 255, 255))
    original.paste((255, 0, 0), (200, 200, 300, 300))  # a red bottom-right corner
    original.save(tmp_path / "big.png")
    shown = original.resize((60, 60))  # what the model saw
    sample = Sample(id="s", prompt="<image>q", images=[str(tmp_path / "big.png")])
    ctx = ToolContext(images=[shown], sample=sample, turn=1, kwargs={"max_side": 120})
    region, text = zoom(ToolCall("zoom", {"region": "bottom-right"}), ctx)
    assert region.size == (120, 120) and region.getpixel((60, 60)) == (255, 0, 0)
    assert text == "Zoomed into [40, 40, 60, 60]."
    box, _ = zoom(ToolCall("zoom", {"bbox": [0, 0, 0.5, 0.25]}), ctx)  # relative coordinates
    assert box.size == (120, 60)
    assert region_box({"bbox": [50, 50, 10, 10]}, 60, 60) == (10.0, 10.0, 50.0, 50.0)  # corners in any order
    for bad, why in (({"bbox": [1, 2]}, "four numbers"), ({"region": "middle-ish"}, "unknown region"), ({}, "give bbox"),
                     ({"bbox": [70, 70, 90, 90]}, "empty")):
        with pytest.raises(ValueError, match=why):
            region_box(bad, 60, 60)


def test_tools_load_from_config_with_their_schema_and_bad_names_fail_at_load(tmp_path):
    cfg = load_config(None, ["rollout.tools=[{name: zoom}, {name: crop, alias: look, kwargs: {max_side: 64}}]",
                             "rollout.max_turns=3"])
    tools = ToolSet.from_config(cfg.rollout)
    assert list(tools.tools) == ["zoom", "look"] and tools.tools["look"].kwargs == {"max_side": 64}
    schema = tools.schemas[0]["function"]
    assert schema["name"] == "zoom" and "region" in schema["parameters"]["properties"] and schema["description"]
    user = tmp_path / "my_tools.py"
    user.write_text('def count(call, context):\n    """Count the shapes."""\n    return "3"\n')
    spec = load_tool(ToolConfig(name=f"{user}:count"), 0)
    assert spec.name == "count" and spec.description == "Count the shapes."
    with pytest.raises(ConfigError, match=r"rollout.tools\[0\].name"):
        load_config(None, ["rollout.tools=[{name: no_such_tool}]"])
    with pytest.raises(ConfigError, match="rollout.max_turns"):
        load_config(None, ["rollout.tools=[{name: zoom}]", "rollout.max_turns=0"])
    with pytest.raises(Exception, match="JSON schema object"):
        load_tool(ToolConfig(name="zoom", parameters={"type": "string"}), 0)
    assert RolloutConfig().tools == []  # no tools: single-turn rollouts as before


def test_the_zoom_demo_mark_is_a_speck_at_prompt_resolution_and_plain_after_zooming():
    """configs/zoom_demo.yaml: the prompt's image at 56 px, tool images at 112 px. The mark covers under 1 % of
    the prompt's image and 6 % of the zoomed view; the background blotches never stand out as a mark does."""
    import numpy as np

    from vlrft.data.media import PixelBounds, fit_image
    from examples.zoom_marks import render_mark

    prompt_bounds = PixelBounds(factor=28, min_pixels=3136, max_pixels=3136)
    tool_bounds = PixelBounds(factor=28, min_pixels=3136, max_pixels=12544)
    standing_out = lambda im: int((np.abs(np.asarray(im, dtype=int) - 255).max(axis=2) > 60).sum())  # noqa: E731
    rng = np.random.default_rng(0)
    for color in ("red", "green", "blue", "yellow", None):
        image = render_mark(color, rng)
        shown = fit_image(image, prompt_bounds)
        # the tool cuts from the sample's original file; without a sample it cuts the image it is given
        region, _ = zoom(ToolCall("zoom", {"region": "center"}), ToolContext(images=[image], sample=None, turn=1))
        zoomed = fit_image(region, tool_bounds)
        assert shown.size == (56, 56) and zoomed.size == (112, 112)
        if color is None:
            assert standing_out(shown) == standing_out(zoomed) == 0
        else:
            assert 0 < standing_out(shown) < 0.01 * 56 * 56, color
            assert standing_out(zoomed) > 0.05 * 112 * 112, color


def test_the_zoom_word_parser_calls_zoom_and_leaves_answers_alone():
    from vlrft.tools.builtin import parse_zoom_word

    assert parse_zoom_word("zoom") == ToolCall("zoom", {"region": "center"})
    assert parse_zoom_word(" Zoom top left") == ToolCall("zoom", {"region": "top-left"})
    assert parse_zoom_word("red") is None and parse_zoom_word("") is None


def test_bad_rewards_and_bad_outputs_are_counted_with_what_is_wrong_and_one_log_line(caplog):
    """A reward that is not a finite number is left out (the tool's text still reaches the model) and counted; a
    ToolOutput whose text is not a str names its text, not 'returned ToolOutput'. Each kind logs one line."""
    image = Image.new("RGB", (8, 8))
    returns = {"high": ToolOutput(text="ok", reward="high"), "nan": ToolOutput(text="t", reward=float("nan")),
               "inf": ToolOutput(reward=float("inf")), "number": ToolOutput(text="n", images=[image], reward=2),
               "text42": ToolOutput(text=42), "pixels": ToolOutput(text="p", images=["not an image"]),
               "listed": ["a", 3]}
    tools = ToolSet([Tool(name, (lambda v: lambda call, ctx: v)(value), "d", SCHEMA) for name, value in returns.items()])
    calls = [ToolCall(name, {}) for name in returns] + [ToolCall("high", {})]
    with caplog.at_level("WARNING", logger="vlrft.tools"):
        outputs, kinds = tools.run(calls, [_ctx() for _ in calls])
    assert kinds == ["bad_rewards"] * 3 + ["ok"] + ["bad_outputs"] * 3 + ["bad_rewards"]
    assert outputs[0].text == "ok" and outputs[0].reward is None and outputs[1].reward is None
    assert outputs[3].reward == 2.0 and outputs[3].images == [image]
    assert "text" in outputs[4].text and "int" in outputs[4].text and outputs[4].text.startswith("Error: ")
    assert "images" in outputs[5].text and "str" in outputs[5].text
    assert "int" in outputs[6].text
    warnings = [r.getMessage() for r in caplog.records if r.name == "vlrft.tools"]
    assert len(warnings) == 6, warnings  # the second "high" is only counted
    assert any("'high'" in w and "tools/bad_rewards" in w for w in warnings)
    tools.close()


def test_async_tools_that_block_are_timed_out_concurrently_and_hung_threads_are_capped():
    """An async tool that blocks its event loop (time.sleep) is still timed out, its calls side by side; a tool's
    own TimeoutError is an error, not a timeout; hung calls keep at most max_concurrency threads per tool."""
    import threading

    async def blocks(call, ctx):
        time.sleep(10)
        return "late"

    def own_timeout(call, ctx):
        raise TimeoutError("the server did not answer")

    def stuck(call, ctx):  # not "hangs": threads of another test's tool of that name may still run
        time.sleep(10)

    tools = ToolSet([Tool(fn.__name__, fn, "d", SCHEMA) for fn in (blocks, own_timeout, stuck)], timeout_s=0.3,
                    max_concurrency=4)
    calls = [ToolCall("blocks", {}) for _ in range(4)] + [ToolCall("own_timeout", {})]
    start = time.perf_counter()
    outputs, kinds = tools.run(calls, [_ctx() for _ in calls])
    assert time.perf_counter() - start < 5  # one timeout, not 4 x 10 s one after another
    assert kinds == ["timeouts"] * 4 + ["errors"] and "TimeoutError: the server" in outputs[4].text
    hung = lambda: sum(t.name == "vlrft-tool-stuck" and t.is_alive() for t in threading.enumerate())  # noqa: E731
    counts = []
    for _ in range(3):
        outputs, kinds = tools.run([ToolCall("stuck", {})] * 3, [_ctx() for _ in range(3)])
        assert kinds == ["timeouts"] * 3
        counts.append(hung())
    assert counts == [3, 6, 6]  # once max_concurrency calls hang, the next ones do not start another thread
    assert "is not answering (6 earlier calls are still running past 0.3 s)" in outputs[0].text
    tools.close()


def test_a_sync_tool_that_hangs_does_not_delay_the_process_exit(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "hang.py"
    script.write_text(
        "import time\n"
        "from vlrft.tools import Tool, ToolCall, ToolContext, ToolSet\n"
        "def hangs(call, ctx):\n    time.sleep(120)\n"
        "tools = ToolSet([Tool('hangs', hangs, 'd', {'type': 'object', 'properties': {}})], timeout_s=0.2)\n"
        "print(tools.run([ToolCall('hangs', {})], [ToolContext(images=[], sample=None, turn=1)])[1], flush=True)\n"
        "print(time.time(), flush=True)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100)
    end = time.time()
    lines = proc.stdout.split("\n")
    assert proc.returncode == 0 and lines[0] == "['timeouts']", proc.stderr
    assert end - float(lines[1]) < 10  # the interpreter did not wait for the hung thread


def test_a_tool_needs_no_description_when_the_tools_are_not_described(tmp_path):
    """`rollout.describe_tools: false` (the prompts say how to call): a function without docstring or description
    loads; with the tools described in every prompt it still must say what it does."""
    user = tmp_path / "bare_tools.py"
    user.write_text("def count(call, context):\n    return '3'\n")
    spec = f"rollout.tools=[{{name: '{user}:count'}}]"
    tools = ToolSet.from_config(load_config(None, [spec, "rollout.describe_tools=false"]).rollout)
    assert list(tools.tools) == ["count"] and tools.tools["count"].description == ""
    with pytest.raises(Exception, match="no description"):
        ToolSet.from_config(load_config(None, [spec]).rollout)


TYPED_TOOLS = '''
from __future__ import annotations

import asyncio
from typing import Literal, Optional

from vlrft.tools import tool


@tool("count_typed", typed=True, override=True)
def count(color: Literal["red", "blue"], min_size: int = 0, boxes: Optional[list[float]] = None, exact=False, *,
          context) -> str:
    """Count the objects of one colour
    in the image.

    Args:
        color: the colour to count
        min_size (int): smallest size counted,
            in pixels
        boxes: where to look

    Returns:
        the count
    """
    return f"{color} {min_size} {boxes} {context.turn}"


@tool("scale_typed", typed=True, override=True)
async def scale(factor: float, name: str = "x") -> str:
    """Scale it."""
    await asyncio.sleep(0)
    return f"{name} * {factor}"
'''


def test_a_typed_tool_gets_its_schema_from_its_signature_and_docstring_and_its_arguments_as_parameters(tmp_path):
    """`@tool(typed=True)`: the function takes the call's arguments as parameters (and `context` if it names it); its
    JSON schema comes from the annotations and defaults, its description from the docstring (Args: per argument).
    Arguments that do not fit the signature are an error the model reads."""
    path = tmp_path / "typed_tools.py"
    path.write_text(TYPED_TOOLS)
    count = load_tool(ToolConfig(name=f"{path}:count"), 0)
    assert count.name == "count_typed" and count.description == "Count the objects of one colour in the image."
    assert count.parameters == {
        "type": "object",
        "properties": {
            "color": {"type": "string", "enum": ["red", "blue"], "description": "the colour to count"},
            "min_size": {"type": "integer", "default": 0, "description": "smallest size counted, in pixels"},
            "boxes": {"type": "array", "items": {"type": "number"}, "default": None, "description": "where to look"},
            "exact": {"default": False}},
        "required": ["color"]}
    scale = load_tool(ToolConfig(name=f"{path}:scale"), 1)
    assert scale.parameters["properties"] == {"factor": {"type": "number"}, "name": {"type": "string", "default": "x"}}
    tools = ToolSet([count, scale])
    calls = [ToolCall("count_typed", {"color": "red"}), ToolCall("count_typed", {"color": "blue", "min_size": 3}),
             ToolCall("count_typed", {"colour": "red"}), ToolCall("scale_typed", {"factor": 2})]
    outputs, kinds = tools.run(calls, [_ctx() for _ in calls])
    assert kinds == ["ok", "ok", "errors", "ok"]
    assert [o.text for o in outputs[:2]] == ["red 0 None 1", "blue 3 None 1"] and outputs[3].text == "x * 2"
    assert "colour" in outputs[2].text and "color, min_size, boxes, exact" in outputs[2].text


def test_typed_tool_docstrings_in_sphinx_style_and_signatures_the_model_cannot_fill():
    from vlrft.tools import tool
    from vlrft.tools.signature import schema_from_signature

    def look(region: str, zoom: float = 2.0):
        """Look closer.

        :param region: which part
            of the image
        :param zoom: how much
        :returns: the crop
        """

    assert schema_from_signature(look) == ("Look closer.", {
        "type": "object", "required": ["region"],
        "properties": {"region": {"type": "string", "description": "which part of the image"},
                       "zoom": {"type": "number", "default": 2.0, "description": "how much"}}})
    with pytest.raises(TypeError, match="named ones"):
        tool("bad_typed", typed=True, override=True)(lambda *args, context: "")
