"""README: every ```python block runs as written, in order, in one namespace.

A block whose first line is ``# requires: NAME ...`` runs only where each NAME is available:
``gpu`` (CuPy sees a CUDA device), ``torch``, ``transformers`` (importable), ``hub`` (network
access to the Hugging Face Hub: only with ``CUPAGED_README_HUB=1``). Elsewhere the tour runs
on the NumPy backend.
"""
from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
REQUIRES = re.compile(r"^# requires:(.*)$")


def python_blocks(text):
    """The README's python blocks, in order: (first line number, source)."""
    return [(text[:m.start()].count("\n") + 2, m.group(1)) for m in BLOCK.finditer(text)]


def requirements(source):
    first = source.splitlines()[0] if source.strip() else ""
    m = REQUIRES.match(first)
    return m.group(1).split() if m else []


def missing(names):
    """The first requirement this machine lacks, or None."""
    for name in names:
        if name == "gpu":
            import cupaged
            if not cupaged.gpu_available():
                return name
        elif name == "hub":
            if os.environ.get("CUPAGED_README_HUB") != "1":
                return name
        elif importlib.util.find_spec(name) is None:
            return name
    return None


BLOCKS = python_blocks(README.read_text())
NAMESPACE = {"__name__": "readme"}


def test_readme_has_python_blocks():
    assert BLOCKS, "README.md has no python block"
    assert not requirements(BLOCKS[0][1]), "the first block (the tour) must run everywhere"


@pytest.mark.parametrize("line, source", BLOCKS, ids=[f"line{n}" for n, _ in BLOCKS])
def test_readme_block(line, source):
    lack = missing(requirements(source))
    if lack:
        pytest.skip(f"README block at line {line} requires {lack}")
    code = compile(source, f"README.md:{line}", "exec")
    exec(code, NAMESPACE)
