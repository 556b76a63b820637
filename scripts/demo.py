#!/usr/bin/env python3
"""Continuous-batching demo over the paged KV cache; the same as ``cupaged demo``.

    python3 scripts/demo.py --device gpu --requests 200 --check
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from cupaged.cli import demo  # noqa: E402

if __name__ == "__main__":
    demo(prog_name="scripts/demo.py")
