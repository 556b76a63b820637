#!/usr/bin/env python3
"""Quest's score and select kernels under other launch constants, on the GPU: for each
variant (``NAME=VALUE`` settings of ``cupaged.sparse.quest``'s module constants, e.g.
``SELECT_THREADS=1024`` or ``SCORE_PAGES=256 SCORE_BYTES_IN_FLIGHT=2048``), the queued
time of ``page_scores`` and of ``select_pages`` at B8 x L128K (Hq32/Hk8 d128, pages of 16,
top 256) with bf16, float32 and e4m3 bounds, and whether its selection equals the default
constants' (run first). Each variant runs in its own process (the constants are read when
a launch is first set up).

    python3 scripts/quest_variants.py "SELECT_THREADS=1024" "SCORE_PAGES=256"
"""
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # a checkout


def measure(settings, reference):
    """One variant in this process: a line of times (microseconds a call); its selections
    saved to ``reference`` (the default's run) or compared with what is there."""
    import cupy
    from cupaged.bench.timing import back_to_back_us
    from cupaged.core.arrays import bfloat16
    from cupaged.sparse import quest
    for setting in settings:
        name, value = setting.split("=")
        setattr(quest, name, int(value))
    batch, length, hq, hk, d, page, top_k = 8, 131072, 32, 8, 128, 16, 256
    pages = length // page
    nb = batch * pages
    rs = cupy.random.RandomState(1)
    q = rs.standard_normal((batch, hq, d), dtype=cupy.float32).astype(bfloat16)
    tables = rs.permutation(nb).astype(np.int32).reshape(batch, pages)
    lens = cupy.full(batch, length, np.int32)

    parts, kept = [], {}
    saved = dict(np.load(reference)) if os.path.exists(reference) else None
    for bounds in (bfloat16, np.float32, quest.E4M3):
        k_min = rs.standard_normal((nb, hk, d), dtype=cupy.float32)
        k_max = k_min + 1
        if bounds == quest.E4M3:  # its codes (CuPy has no float8 dtype), made on the host
            k_min, k_max = (cupy.asarray(a.get().astype(bounds).view(np.uint8))
                            for a in (k_min, k_max))
        else:
            k_min, k_max = k_min.astype(bounds), k_max.astype(bounds)
        first = quest.select_pages(q, k_min, k_max, tables, lens, page, top_k)
        sel = quest.Selection(*(cupy.empty_like(a) for a in first))
        scores = back_to_back_us(lambda: quest.page_scores(q, k_min, k_max, tables, lens, page))
        select = back_to_back_us(lambda: quest.select_pages(q, k_min, k_max, tables, lens,
                                                            page, top_k, out=sel))
        name = np.dtype(bounds).name
        kept[name] = sel.positions.get()
        same = ("" if saved is None else
                f", same selection {bool((saved[name] == kept[name]).all())}")
        parts.append(f"{name}: scores {scores:.1f}, select {select:.1f} "
                     f"(top k {select - scores:.1f}){same}")
    if saved is None:
        np.savez(reference, **kept)
    return f"{' '.join(settings) or 'default'} | " + " | ".join(parts)


def main(argv):
    from cupaged.core.arrays import gpu_available
    if not gpu_available():
        print("quest_variants: needs a CUDA GPU", file=sys.stderr)
        return 1
    if argv and argv[0] == "--one":
        print(measure(argv[2:], argv[1]), flush=True)
        return 0
    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        reference = os.path.join(tmp, "default.npz")
        for variant in [""] + [v for v in argv if v]:
            res = subprocess.run([sys.executable, __file__, "--one", reference,
                                  *variant.split()], timeout=120)
            status |= res.returncode
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
