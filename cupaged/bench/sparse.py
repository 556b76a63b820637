"""Benchmark of vertical+slash sparse prefill (MInference) against dense causal prefill.

One row per (S, budget): S 32K, 128K, 512K (``--quick``: 32K), Hq 32, Hk 8, d 128, bf16;
budget ``adaptive 0.3`` (the ``MInferencePolicy`` defaults) and ``fixed 1000/6096`` (the
seed's vertical/slash sizes). Inputs are random with a RoPE-like positional part, so that
scores fall with distance, plus four sink keys: attention concentrates the way it does in
a language model, which random data alone would not show.

Columns: ``est_ms`` (pattern estimate), ``index_ms`` and ``kernel_ms`` (index conversion
and sparse kernel, timed apart), ``sparse_ms`` (all three), ``dense_ms`` (our
``varlen_prefill``, causal; None if missing) and ``vs_dense`` (its time over
``sparse_ms``; goal >= 5 at 128K), ``cudnn_ms`` / ``vs_cudnn`` (torch SDPA cuDNN, GQA),
``density`` (computed (query, key) pairs over causal pairs, heads 0-3), ``mass`` (share
of the causal softmax mass the pattern keeps, last 64 queries of heads 0-3), ``checked``
(those rows against a float64 recomputation). Run: ``python -m cupaged.bench.sparse``.
"""
from __future__ import annotations

import sys

import numpy as np

from .._arrays import bfloat16
from ..reference import sparse as ref
from .timing import format_table, time_gpu, torch_or_none

HQ, HK, D = 32, 8, 128
BUDGETS = {"adaptive 0.3": dict(vertical_size=1000, slash_size=6096, adaptive_budget=0.3),
           "fixed 1000/6096": dict(vertical_size=1000, slash_size=6096, adaptive_budget=None)}
PROBE_HEADS = 4


def _inputs(seqlen, seed=0):
    """bf16 q [S, HQ, D], k and v [S, HK, D]: noise, a RoPE-like part, four sink keys."""
    import cupy
    rs = cupy.random.RandomState(seed)
    pos = cupy.arange(seqlen, dtype=cupy.float32)[:, None]
    freqs = 10000.0 ** (-cupy.arange(16, dtype=cupy.float32) / 16)
    angle = pos * freqs[None, :]
    rope = cupy.stack([cupy.cos(angle), cupy.sin(angle)], axis=-1).reshape(seqlen, 1, 32) * 2.0

    def make(heads, sink):
        x = rs.standard_normal((seqlen, heads, D), dtype=cupy.float32)
        x[:, :, :32] = rope
        x[:, :, 32] = sink
        return x.astype(bfloat16)
    q = make(HQ, 2.0)
    sink_k = cupy.zeros((seqlen, 1), cupy.float32)
    sink_k[:4] = 12.0
    k = make(HK, sink_k)
    v = rs.standard_normal((seqlen, HK, D), dtype=cupy.float32).astype(bfloat16)
    return q, k, v


def _split_times(q, k, v, v_idx, s_idx, reps=3):
    """Median (index seconds, kernel seconds, computed pairs of heads 0-3) of the op's loop."""
    import cupy
    from .._checks import check_options
    from ..sparse import attention as sa, kernels
    n = q.shape[0]
    batch = sa.Batch(HQ, HK, D, np.array([n]), np.array([n]))
    cu = cupy.asarray([0, n], dtype=np.int32)
    kv_lens = cupy.asarray([n], dtype=np.int32)
    kv, opts, out = kernels.dense_kv(k, v, cu), check_options(cupy, HQ, D), cupy.empty_like(q)
    runs = []
    for _ in range(reps):
        t_index = t_kernel = 0.0
        pairs = 0
        groups = sa.index_groups(cu, kv_lens, v_idx[None], s_idx[None], batch, 64, 64)
        while True:
            a, b, c = cupy.cuda.Event(), cupy.cuda.Event(), cupy.cuda.Event()
            a.record()
            try:
                h0, heads, pattern = next(groups)
            except StopIteration:
                break
            b.record()
            sa.launch(q, kv, out, None, cu, kv_lens, batch, pattern, opts, h0, heads)
            c.record()
            c.synchronize()
            t_index += cupy.cuda.get_elapsed_time(a, b) * 1e-3
            t_kernel += cupy.cuda.get_elapsed_time(b, c) * 1e-3
            if h0 == 0:
                probe = slice(0, min(PROBE_HEADS, heads))
                pairs = int(pattern.blk_count[:, probe].sum()) * 64 * 64 \
                    + int(pattern.col_count[:, probe].sum()) * 64
        runs.append((t_index, t_kernel))
    t_index, t_kernel = (float(np.median([r[i] for r in runs])) for i in range(2))
    return t_index, t_kernel, pairs, out


def _probe(q, k, v, out, v_idx, s_idx):
    """(mass kept, output close) on the last query block of heads 0-3."""
    import cupy
    n = q.shape[0]
    end = -(-n // 64) * 64                      # the last query block is rows [end - 64, n)
    rows = cupy.arange(end - 64, n)
    masses, ok = [], True
    for h in range(PROBE_HEADS):
        blocks = ref.slash_blocks(s_idx[h].get(), end, n, 64, 64)
        cols = ref.vertical_columns(v_idx[h].get(), blocks, end, n, 64)
        covered = cupy.zeros(n + 64, bool)
        for st in blocks:
            covered[st:st + 64] = True
        covered[cupy.asarray(cols, dtype=np.int64)] = True
        kh = k[:, h // (HQ // HK)].astype(cupy.float32)
        s = (q[rows, h].astype(cupy.float32) @ kh.T) * D ** -0.5          # [64, n]
        causal = cupy.arange(n)[None, :] <= rows[:, None]
        p = cupy.exp(s - s.max(axis=1, keepdims=True)) * causal
        keep = p * covered[None, :n]
        masses.append(float((keep.sum(axis=1) / p.sum(axis=1)).mean()))
        want = keep @ v[:, h // (HQ // HK)].astype(cupy.float32) / keep.sum(axis=1, keepdims=True)
        got = out[rows, h].astype(cupy.float32)
        ok &= float(cupy.linalg.norm(got - want) / cupy.linalg.norm(want)) < 2e-2
    return float(np.mean(masses)), bool(ok)


def _dense_seconds(q, k, v, reps):
    try:
        import cupaged
        import cupy
        cu = cupy.asarray([0, q.shape[0]], dtype=np.int32)
        return time_gpu(lambda: cupaged.varlen_prefill(q, k, v, cu, cu, causal=True),
                        warmup=1, reps=reps)
    except (ImportError, AttributeError):
        return None


def _cudnn_seconds(q, k, v, reps):
    torch = torch_or_none()
    if torch is None:
        return None
    try:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        tq, tk, tv = (torch.from_dlpack(x).permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return time_gpu(lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=True,
                                                                   enable_gqa=True),
                            warmup=1, reps=reps)
    except Exception:
        return None


def bench_length(seqlen, budgets, reps):
    """Rows of one sequence length, one per budget."""
    from .. import sparse
    q, k, v = _inputs(seqlen)
    dense = _dense_seconds(q, k, v, reps)
    cudnn = _cudnn_seconds(q, k, v, reps)
    rows = []
    for label in budgets:
        opts = BUDGETS[label]
        est = time_gpu(lambda: sparse.estimate_vertical_slash(q, k, **opts), warmup=1, reps=reps)
        v_idx, s_idx = sparse.estimate_vertical_slash(q, k, **opts)
        t_index, t_kernel, pairs, out = _split_times(q, k, v, v_idx, s_idx, reps)
        mass, ok = _probe(q, k, v, out, v_idx, s_idx)
        total = est + t_index + t_kernel
        causal_pairs = PROBE_HEADS * seqlen * (seqlen + 1) // 2
        rows.append(dict(
            S=seqlen, budget=label, nv=v_idx.shape[1], ns=s_idx.shape[1], est_ms=est * 1e3,
            index_ms=t_index * 1e3, kernel_ms=t_kernel * 1e3, sparse_ms=total * 1e3,
            dense_ms=None if dense is None else dense * 1e3,
            vs_dense=None if dense is None else dense / total,
            cudnn_ms=None if cudnn is None else cudnn * 1e3,
            vs_cudnn=None if cudnn is None else cudnn / total,
            density=pairs / causal_pairs, mass=mass, checked=ok))
    return rows


def run(quick=False):
    """Rows for S 32K (quick) or 32K, 128K, 512K, each budget."""
    rows = []
    for seqlen in ((32768,) if quick else (32768, 131072, 524288)):
        rows += bench_length(seqlen, list(BUDGETS), reps=3 if seqlen <= 131072 else 1)
    return rows


COLUMNS = ["S", "budget", "nv", "ns", "est_ms", "index_ms", "kernel_ms", "sparse_ms", "dense_ms",
           "vs_dense", "cudnn_ms", "vs_cudnn", "density", "mass", "checked"]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    print(format_table(run(quick="--quick" in argv), COLUMNS))


if __name__ == "__main__":
    main()
