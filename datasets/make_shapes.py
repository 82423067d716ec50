#!/usr/bin/env python
"""Generate the synthetic shapes task: `python datasets/make_shapes.py OUT [--tasks color,count ...]`.

Same as `vlrft data synth OUT ...`; importable as `vlrft.data.synthetic.make_shapes`. (No
`datasets/__init__.py` on purpose: a package named `datasets` here would shadow Hugging Face datasets.)
"""

import sys

from vlrft.cli import main

if __name__ == "__main__":
    sys.exit(main(["data", "synth", *sys.argv[1:]]))
