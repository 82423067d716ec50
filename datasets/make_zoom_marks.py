#!/usr/bin/env python
"""Generate the zoom demo's data: `python datasets/make_zoom_marks.py [OUT]` (default datasets/zoom_demo).

A small coloured mark in a large image with faint colour blotches: unreadable at the prompt's
resolution, readable after zooming (examples/zoom_marks.py). 1024 train / 200 test images, a few
seconds; not shipped (about 40 MB of PNG).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `examples`

from examples.zoom_marks import make_zoom_marks  # noqa: E402

if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "zoom_demo")
    for split, count in (("train", 1024), ("test", 200)):
        print(make_zoom_marks(out, split, count))
