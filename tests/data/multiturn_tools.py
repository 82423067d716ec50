"""Tools and a call parser for the multi-turn tests (loaded by path, as a user's would be)."""

from vlrft.tools import ToolCall, ToolOutput
from vlrft.tools.builtin import zoom


def always_call(text):
    """Every turn calls `look` (the tiny test model never writes a real <tool_call>)."""
    return ToolCall("look", {"region": "center"})


def look(call, context):
    """Zoom for samples with an image, text for the others; one sample's tool fails, one ends the trajectory."""
    if context.images and context.turn == 1:
        return zoom(ToolCall("zoom", call.arguments), context)
    if context.turn == 2 and int(context.sample.id) % 3 == 0:
        raise RuntimeError("a flaky tool")
    if context.turn == 2 and int(context.sample.id) % 3 == 1:
        return ToolOutput(text="enough", reward=1.0, done=True)
    return "nothing more to see"


def zoom_for_zoom_ids(call, context):
    """Sharded-training tests: samples whose id starts with "zoom" get the zoomed image on their first call and a text
    answer after; the others end their trajectory at once (one turn, no tool image)."""
    if not str(context.sample.id).startswith("zoom"):
        return ToolOutput(text="", done=True)
    if context.turn == 1:
        return zoom(ToolCall("zoom", {"region": "center"}), context)
    return "nothing more to see"
