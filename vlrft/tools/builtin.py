"""Built-in tools. `zoom` (alias `crop`): a region of the prompt's image, returned at a higher resolution.

The region is a bounding box `[x1, y1, x2, y2]` in the pixel coordinates of the image the model was
shown (fractions in [0, 1] are read as relative coordinates) or a region name ("top-left", "center",
"bottom", ... : the 3 x 3 grid of the image, rows and columns by name). The crop is cut from the
sample's original image when it can be read (so zooming recovers detail the prompt's downscaled
image lost), and resized so its longer side is `max_side` pixels (tool kwarg, default 448).
"""

from __future__ import annotations

from typing import Any

from vlrft.tools.toolset import tool
from vlrft.tools.types import ToolCall, ToolContext

REGIONS = {
    "top-left": (0, 0, 1, 1), "top": (1, 0, 2, 1), "top-right": (2, 0, 3, 1),
    "left": (0, 1, 1, 2), "center": (1, 1, 2, 2), "right": (2, 1, 3, 2),
    "bottom-left": (0, 2, 1, 3), "bottom": (1, 2, 2, 3), "bottom-right": (2, 2, 3, 3),
    "top-half": (0, 0, 3, 1.5), "bottom-half": (0, 1.5, 3, 3), "left-half": (0, 0, 1.5, 3), "right-half": (1.5, 0, 3, 3),
}

ZOOM_PARAMETERS = {
    "type": "object",
    "properties": {
        "bbox": {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4,
                 "description": "[x1, y1, x2, y2] in pixels of the image you see (or fractions of it in [0, 1])"},
        "region": {"type": "string", "enum": sorted(REGIONS),
                   "description": "a named region, instead of bbox"},
        "image": {"type": "integer", "description": "which image, 0 = the first (default)"},
    },
}


def region_box(arguments: dict[str, Any], width: int, height: int) -> tuple[float, float, float, float]:
    """The (x1, y1, x2, y2) box in pixels of a `width` x `height` image; ValueError says what is wrong."""
    if "bbox" in arguments:
        box = arguments["bbox"]
        if not isinstance(box, (list, tuple)) or len(box) != 4 or not all(isinstance(v, (int, float)) for v in box):
            raise ValueError("bbox must be four numbers [x1, y1, x2, y2]")
        x1, y1, x2, y2 = (float(v) for v in box)
        if max(x1, y1, x2, y2) <= 1.0:  # relative coordinates
            x1, x2, y1, y2 = x1 * width, x2 * width, y1 * height, y2 * height
    elif "region" in arguments:
        name = str(arguments["region"]).strip().lower().replace(" ", "-").replace("_", "-")
        if name not in REGIONS:
            raise ValueError(f"unknown region {arguments['region']!r}; use one of {', '.join(sorted(REGIONS))}")
        c1, r1, c2, r2 = REGIONS[name]
        x1, y1, x2, y2 = c1 * width / 3, r1 * height / 3, c2 * width / 3, r2 * height / 3
    else:
        raise ValueError("give bbox [x1, y1, x2, y2] or region (e.g. 'top-left')")
    x1, x2 = sorted((max(0.0, min(x1, width)), max(0.0, min(x2, width))))
    y1, y2 = sorted((max(0.0, min(y1, height)), max(0.0, min(y2, height))))
    if x2 - x1 < 1 or y2 - y1 < 1:
        raise ValueError(f"the box {[round(v, 1) for v in (x1, y1, x2, y2)]} is empty inside the {width}x{height} image")
    return x1, y1, x2, y2


def _original(context: ToolContext, index: int):
    """The sample's original image `index` at full resolution, or None when it cannot be read again."""
    refs = getattr(context.sample, "images", None) or []
    if index >= len(refs):
        return None
    try:
        from vlrft.data.media import load_image

        return load_image(refs[index])
    except Exception:  # an unreadable source: fall back to the image the model saw
        return None


@tool("zoom", description="Zoom into a region of the image: returns that region at a higher resolution.",
      parameters=ZOOM_PARAMETERS)
def zoom(call: ToolCall, context: ToolContext):
    index = int(call.arguments.get("image", 0))
    if not 0 <= index < len(context.images):
        raise ValueError(f"image {index} does not exist; this conversation has {len(context.images)} image(s)")
    shown = context.images[index]
    x1, y1, x2, y2 = region_box(call.arguments, *shown.size)
    source = _original(context, index) or shown
    sx, sy = source.size[0] / shown.size[0], source.size[1] / shown.size[1]
    crop = source.crop((round(x1 * sx), round(y1 * sy), round(x2 * sx), round(y2 * sy)))
    max_side = int(context.kwargs.get("max_side", 448))
    scale = max_side / max(crop.size)
    from PIL import Image

    crop = crop.resize((max(1, round(crop.size[0] * scale)), max(1, round(crop.size[1] * scale))),
                       Image.Resampling.BICUBIC)
    return [crop, f"Zoomed into [{round(x1)}, {round(y1)}, {round(x2)}, {round(y2)}]."]


@tool("crop", description="Crop a region of the image and show it at a higher resolution.",
      parameters=ZOOM_PARAMETERS)
def crop(call: ToolCall, context: ToolContext):
    """The same as `zoom`, under the name some prompts use."""
    return zoom(call, context)


def parse_zoom_word(text: str) -> ToolCall | None:
    """A minimal call syntax for tiny models (the CPU zoom demo): a turn that starts with the word "zoom",
    optionally followed by a region name, calls `zoom` (default region: the centre); anything else is an answer."""
    words = text.strip().split()
    if not words or words[0].lower() != "zoom":
        return None
    region = "-".join(words[1:3]).lower() if len(words) > 1 else "center"
    return ToolCall("zoom", {"region": region if region in REGIONS else "center"})
