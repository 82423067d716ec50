#!/usr/bin/env python
"""Generate the synthetic shapes task: `python datasets/make_shapes.py OUT [--tasks color,count ...]`.

The generator is examples/shapes.py (`make_shapes`, `ShapesSpec`). (No `datasets/__init__.py` on purpose:
a package named `datasets` here would shadow Hugging Face datasets.)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `examples`

from examples.shapes import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
