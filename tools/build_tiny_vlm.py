#!/usr/bin/env python
"""Build a tiny random-weight Qwen-VL model + processor folder: `python tools/build_tiny_vlm.py OUT --arch qwen2_5_vl`.

Same as `vlrft tiny OUT ...`; importable as `vlrft.models.tiny.build_tiny_vlm`.
"""

import sys

from vlrft.cli import main

if __name__ == "__main__":
    sys.exit(main(["tiny", *sys.argv[1:]]))
