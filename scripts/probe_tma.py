"""The TMA-fed warp-specialised prefill (``plan.tma_tile``) beside the cp.async one on an
sm_90 device: a few correctness checks against the float64 reference, then TFLOP/s of
cp.async-ws, TMA-ws (2 and 3 stages) and, when torch is present, cuDNN SDPA, on B2 x S8K
H32 bf16 (d128 causal and full, d64 causal), printed as a table.

Run: ``PYTHONPATH=. python3 scripts/probe_tma.py``.
"""
from __future__ import annotations

import sys

import numpy as np

from cupaged.bench import prefill as bench
from cupaged.core.arrays import bfloat16
from cupaged.prefill import plan as plan_
from cupaged.reference import attention as aref


def errors(cp, lens, head_dim, causal, tiles, hq=8, hk=2, seed=0):
    """Relative error of each of ``tiles``' outputs against the reference on one ragged bf16
    batch of ``lens`` (queries = keys per sequence), GQA ``hq / hk``."""
    from cupaged.core.checks import check_options
    from cupaged.core.layouts import layout_strides
    from cupaged.prefill import launch as prefill
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v = (rng.standard_normal((int(cu[-1]), h, head_dim)).astype(bfloat16)
               for h in (hq, hk, hk))
    opts = check_options(np, hq, head_dim)
    want = aref.varlen_prefill(q, k, v, cu, cu, causal=causal)
    cu_d, strides = cp.asarray(cu), layout_strides("ragged", 1, hk, head_dim, q.itemsize)
    out = []
    for tile in tiles:
        work = prefill.host_work(np.diff(cu), np.diff(cu), q.dtype, hq, hk, head_dim, False,
                                 causal, opts, tile)
        got = cp.full(q.shape, np.nan, bfloat16)
        prefill._launch(*(cp.asarray(a) for a in (q, k, v)), got, None, cp.asarray(work), cu_d,
                        cu_d, None, 1, strides, opts, causal, False, hk, tile=tile,
                        backend="wgmma")
        got = np.asarray(got.get(), np.float64)
        out.append(float(np.linalg.norm(got - want) / np.linalg.norm(want))
                   if np.isfinite(got).all() else float("inf"))
    return out


def main():
    import cupy as cp
    if cp.cuda.Device().compute_capability != "90":
        sys.exit("probe_tma: needs an sm_90 device")
    ws = {d: plan_.wgmma_tile(d) for d in plan_.TMA_HEAD_DIMS}
    tiles = lambda d: [("cp.async ws", ws[d]), ("tma ws s2", plan_.tma_tile(d, 2)),
                       ("tma ws s3", plan_.tma_tile(d, 3))]
    print("correctness (relative error vs float64, bf16 tolerance 1e-2)")
    for d in plan_.TMA_HEAD_DIMS:
        for causal in (True, False):
            for lens in ([1, 63, 64, 65, 1000], [4097, 0, 130]):
                names, ts = zip(*tiles(d))
                errs = errors(cp, lens, d, causal, ts)
                print(f"  d{d} {'causal' if causal else 'full'} {lens}: "
                      + ", ".join(f"{n} {e:.2e}" for n, e in zip(names, errs)))
    print("\nB2 x S8192 H32 bf16 TFLOP/s (same run)")
    print(f"{'shape':<28}" + "".join(f"{n:>14}" for n, _ in tiles(128)) + f"{'cuDNN':>10}")
    for d, causal in ((128, True), (128, False), (64, True)):
        q_lens = [8192, 8192]
        q, k, v, cu_host, cu_dev = bench._ragged_inputs(q_lens, d)
        flops = bench._flops(q_lens, q_lens, d, causal)
        cells = []
        for _, tile in tiles(d):
            launch, _ = bench._ragged_launcher(q, k, v, cu_host, cu_dev, causal, tile, "wgmma")
            cells.append(flops / bench.time_gpu(launch) / 1e12)
        t = bench._sdpa(2, 8192, d, causal, "CUDNN_ATTENTION")
        cudnn = "-" if t is None else f"{flops / t / 1e12:.0f}"
        shape = f"d{d} {'causal' if causal else 'full'}"
        print(f"{shape:<28}" + "".join(f"{c:>14.0f}" for c in cells) + f"{cudnn:>10}")


if __name__ == "__main__":
    main()
