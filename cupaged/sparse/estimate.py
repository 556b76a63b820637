"""Vertical+slash pattern estimate of one sequence (docs/design.md, MInference contract).

The last ``last_q`` (<= 64) queries attend causally to every key; the column sums of their
softmax rank keys (vertical) and the diagonal sums rank diagonals ``d = p - j`` (slash).
On CuPy two passes of one tensor-core kernel (``kernels_cu/sparse_estimate.cu``) compute
the row statistics and then the sums without storing the scores (memory O(Hq * kv_len),
fine at 1M tokens); the top-k is a CuPy sort.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core import abi
from ..core.arrays import FLOAT_DTYPES, accepts_dlpack, array_module, check_array
from ..core.checks import (INT32_MAX, check_block_tables, check_gqa, check_int, check_options,
    check_query)
from ..core.launch import ptr
from ..core.layouts import CacheGeometry, resolve_layout
from ..reference import attention as ref_attention
from ..reference import sparse as ref
from . import launch as kernels


class EstimatePlan(NamedTuple):
    q_len: int
    kv_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    n: int              # queries used (min(last_q, q_len))
    nv: int             # vertical indices kept
    ns: int             # slash indices kept
    sm_scale: float
    num_sink_tokens: int
    num_recent_diags: int


def plan_estimate(q, kv_len, num_kv_heads, xp, *, vertical_size, slash_size, last_q,
                  num_sink_tokens, num_recent_diags, adaptive_budget, sm_scale):
    """Validate the estimate's query and options against ``kv_len`` keys; return the plan."""
    q_len, hq, d = check_query("q", q, xp)
    check_gqa(hq, num_kv_heads)
    if q_len < 1 or kv_len < q_len:
        raise ValueError(f"q: expected 1 <= q_len <= kv_len ({kv_len}) queries, got {q_len}")
    check_int("vertical_size", vertical_size)
    check_int("slash_size", slash_size)
    last_q = check_int("last_q", last_q, 1, kernels.ROWS)
    sinks = check_int("num_sink_tokens", num_sink_tokens, minimum=0)
    recent = check_int("num_recent_diags", num_recent_diags, minimum=0)
    if adaptive_budget is not None and (not isinstance(adaptive_budget, (int, float, np.floating))
                                        or not 0 < adaptive_budget <= 1):
        raise ValueError(f"adaptive_budget: expected None or a float in (0, 1], got {adaptive_budget!r}")
    scale = check_options(xp, hq, d, sm_scale=sm_scale).sm_scale
    nv, ns = ref.pattern_sizes(kv_len, vertical_size, slash_size, sinks, recent, adaptive_budget)
    return EstimatePlan(q_len, kv_len, hq, num_kv_heads, d, min(last_q, q_len), nv, ns, scale,
                        sinks, recent)


def _check_kernel_dtype(q):
    if q.dtype not in kernels.KERNEL_DTYPES:
        raise TypeError(f"q: the CUDA kernels take float16 or bfloat16, got {q.dtype}")


@accepts_dlpack
def estimate_vertical_slash(q, k, *, vertical_size, slash_size, last_q=64, num_sink_tokens=30,
                            num_recent_diags=100, adaptive_budget=None, sm_scale=None):
    """Estimate one sequence's vertical+slash pattern from its last queries (the MInference
    contract of docs/design.md).

    Parameters
    ----------
    q : array
        ``[q_len, Hq, D]`` float16/bfloat16 (float32 on NumPy).
    k : array
        ``[kv_len, Hk, D]``, ``kv_len >= q_len``, ``Hq % Hk == 0``; query ``i`` sits at
        position ``kv_len - q_len + i``.
    vertical_size, slash_size : int
        Indices to keep (each capped at ``kv_len``), unless ``adaptive_budget`` is set.
    last_q : int
        Queries used, 1..64 (the last ones).
    num_sink_tokens, num_recent_diags : int
        Keys ``j < num_sink_tokens`` and diagonals ``d < num_recent_diags`` always kept.
    adaptive_budget : float, optional
        ``budget = int(kv_len * adaptive_budget)``; keeps
        ``max(num_sink_tokens + 1, int(0.2 budget))`` verticals and
        ``max(num_recent_diags + 1, int(0.8 budget))`` slashes.
    sm_scale : float, optional
        Score scale, default ``D ** -0.5``.

    Returns
    -------
    v_idx : array
        int32 ``[Hq, nv]`` key positions, ascending.
    s_idx : array
        int32 ``[Hq, ns]`` diagonal offsets, ascending.
    """
    xp = array_module(q, k)
    check_query("q", q, xp)
    check_array("k", k, ndim=3, dtypes=FLOAT_DTYPES, xp=xp)
    if k.dtype != q.dtype or k.shape[2] != q.shape[-1]:
        raise TypeError(f"k: expected dtype {q.dtype} and head size {q.shape[-1]} like q, "
                        f"got {k.dtype} and {k.shape[2]}")
    plan = plan_estimate(q, k.shape[0], k.shape[1], xp, vertical_size=vertical_size,
                         slash_size=slash_size, last_q=last_q, num_sink_tokens=num_sink_tokens,
                         num_recent_diags=num_recent_diags, adaptive_budget=adaptive_budget,
                         sm_scale=sm_scale)
    if xp is np:
        return _estimate_reference(q, k, plan)
    _check_kernel_dtype(q)
    return _estimate_gpu(q, kernels.dense_kv(k, None), plan)


@accepts_dlpack
def paged_estimate_vertical_slash(q, k_cache, block_table, seq_len, *, vertical_size, slash_size,
                                  layout=None, last_q=64, num_sink_tokens=30,
                                  num_recent_diags=100, adaptive_budget=None, sm_scale=None):
    """:func:`estimate_vertical_slash` with the keys in a paged cache (chunked prefill).

    Parameters
    ----------
    q : array
        ``[q_len, Hq, D]``: the chunk's queries, the last ``q_len`` of ``seq_len`` positions.
    k_cache : array
        ``"NHD"`` ``[num_blocks, block_size, Hk, D]`` or ``"HND"``
        ``[num_blocks, Hk, block_size, D]`` key cache holding the sequence's keys.
    block_table : array
        int32 ``[max_blocks]`` the sequence's blocks.
    seq_len : int
        Keys of the sequence in the cache, ``>= q_len``.
    layout : {"NHD", "HND"}, optional
        Default "NHD", refused (ValueError) when k_cache's shape also reads validly as HND
        (``cupaged.core.layouts.resolve_layout``).
    vertical_size, slash_size, last_q, num_sink_tokens, num_recent_diags, adaptive_budget, sm_scale
        As in :func:`estimate_vertical_slash`.

    Returns
    -------
    v_idx, s_idx : array
        int32 ``[Hq, nv]`` and ``[Hq, ns]``, ascending.
    """
    layout = resolve_layout(layout, k_cache, q)
    xp = array_module(q, k_cache, block_table)
    check_query("q", q, xp)
    geo = _check_key_cache(k_cache, layout, q, xp)
    seq_len = check_int("seq_len", seq_len, 1, INT32_MAX)
    check_array("block_table", block_table, ndim=1, dtypes=np.int32, xp=xp)
    check_block_tables(block_table[None], xp.asarray([seq_len], dtype=np.int32), geo, xp)
    plan = plan_estimate(q, seq_len, geo.num_kv_heads, xp, vertical_size=vertical_size,
                         slash_size=slash_size, last_q=last_q, num_sink_tokens=num_sink_tokens,
                         num_recent_diags=num_recent_diags, adaptive_budget=adaptive_budget,
                         sm_scale=sm_scale)
    if xp is np:
        k, _ = ref_attention.gather_kv(k_cache, k_cache, block_table, seq_len, layout)
        return _estimate_reference(q, k, plan)
    _check_kernel_dtype(q)
    return _estimate_gpu(q, kernels.paged_kv(k_cache, None, block_table, layout), plan)


def _check_key_cache(k_cache, layout, q, xp):
    if layout not in ("NHD", "HND"):
        raise ValueError(f"layout: expected 'NHD' or 'HND', got {layout!r}")
    check_array("k_cache", k_cache, ndim=4, dtypes=q.dtype, xp=xp)
    nb, a, b, d = (int(s) for s in k_cache.shape)
    bs, hk = (a, b) if layout == "NHD" else (b, a)
    if d != q.shape[-1]:
        raise ValueError(f"k_cache: expected head size {q.shape[-1]} like q, got {d}")
    return CacheGeometry(nb, bs, hk, d)


def _estimate_reference(q, k, plan):
    return ref.estimate_vertical_slash(
        q, k, vertical_size=plan.nv, slash_size=plan.ns, last_q=plan.n,
        num_sink_tokens=plan.num_sink_tokens, num_recent_diags=plan.num_recent_diags,
        sm_scale=plan.sm_scale)


def estimate_tiles_per_cta(kv_len, num_q_heads):
    """Key tiles per CTA: up to 16, fewer when that leaves under ~1024 CTAs."""
    tiles = -(-kv_len // kernels.KEYS)
    return max(1, min(kernels.EST_MAX_TILES, tiles * num_q_heads // 1024))


def _estimate_gpu(q, kv, plan):
    import cupy
    tpc = estimate_tiles_per_cta(plan.kv_len, plan.num_q_heads)
    chunks = -(-plan.kv_len // (tpc * kernels.KEYS))
    smem = kernels.estimate_smem(plan.head_dim)
    kern = kernels.kernel("sparse_estimate", kernels.estimate_expr(q.dtype, plan.head_dim),
                          abi.VS_ESTIMATE, smem)
    common = dict(q=ptr(q), q_row0=plan.q_len - plan.n, n=plan.n, num_q_heads=plan.num_q_heads,
                  k=ptr(kv.k), block_table=ptr(kv.table), page_size=kv.page_size,
                  page_stride=kv.page_stride, tok_stride=kv.tok_stride,
                  head_stride=kv.head_stride, group=plan.num_q_heads // plan.num_kv_heads,
                  kv_len=plan.kv_len, tiles_per_cta=tpc,
                  scale_log2=plan.sm_scale * abi.LOG2E)
    grid = (plan.num_q_heads, chunks)
    part_max = cupy.empty((plan.num_q_heads, chunks, kernels.ROWS), np.float32)
    part_sum = cupy.empty_like(part_max)
    kern(grid, kernels.THREADS, smem, phase=0, row_max=ptr(part_max), row_sum=ptr(part_sum),
         **common)
    # -- combine the chunks: row max M (log2 units) and 1 / L --
    row_max = part_max.max(axis=1)
    row_inv = 1.0 / (part_sum * cupy.exp2(part_max - row_max[:, None, :])).sum(axis=1)
    vertical = cupy.empty((plan.num_q_heads, plan.kv_len), np.float32)
    slash = cupy.zeros_like(vertical)
    row_inv = row_inv.astype(np.float32)
    kern(grid, kernels.THREADS, smem, phase=1, row_max=ptr(row_max), row_sum=ptr(row_inv),
         vertical=ptr(vertical), slash=ptr(slash), **common)
    vertical[:, :plan.num_sink_tokens] = np.inf
    slash[:, :plan.num_recent_diags] = np.inf
    return top_sorted(vertical, plan.nv), top_sorted(slash, plan.ns)


def top_sorted(scores, k):
    """int32 positions of the ``k <= width`` largest entries of each row of float32
    ``scores`` ``[rows, width]``, ascending, ties to the earlier position (the reference's
    stable order): ``vs_top_kernel``, a CTA a row (CuPy)."""
    import cupy
    rows, width = scores.shape
    out = cupy.empty((rows, k), np.int32)
    kern = kernels.kernel("sparse_estimate", kernels.TOP_EXPR, abi.VS_TOP)
    kern(rows, kernels.PREP_THREADS, 0, scores=ptr(scores), out=ptr(out), width=width, k=k)
    return out
