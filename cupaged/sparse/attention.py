"""Vertical+slash sparse attention (dense, packed batches, paged caches); BSR is in ``bsr.py``.

Every op validates its arguments, then runs the NumPy reference (``cupaged.reference.sparse``)
or, on CuPy, the tensor-core kernel of ``kernels_cu/sparse_attention.cu``: each CTA computes
two 64-row query tiles of one head over a tile list built on the device (``tiles.py``): the
union of the two tiles' key blocks as contiguous 64-key tiles, then their vertical columns
gathered 64 at a time, with an online softmax across all of them.

On CuPy nothing is read back to the host (strict mode aside): ``bsr_prepare`` checks the
device lengths and places the CTAs, ``vs_prepare`` checks the index rows and decides the
rows that run dense, ``vs_plan_kernel`` writes the lists into slots sized from shapes, and
the attention kernel runs each head group's lists. Bad device entries go to the error word
(``cupaged.check_errors``) and their rows come out as zeros.

Dense fallback. A tile costs the kernel about the same whatever it holds: a dense tile
serves both 64-row halves, a pattern's tile often one (random patterns: adjacent halves'
ranges of one slash are adjacent, not shared), or is cut short where ranges meet. A
pattern keeping a fraction ``f`` of its causal blocks therefore costs between ``f`` and
about ``2 f`` of the dense tile sequence; above :data:`DENSE_THRESHOLD` = 1/2 the dense
sequence is no dearer, so such a (sequence, head) runs every causal tile (full causal
attention, its pattern's superset) on the same loop: the tile core and per-tile cost of
the mma.sync dense prefill kernel (the wgmma kernel of sm_90 is faster still).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core.arrays import FLOAT_DTYPES, accepts_dlpack, array_module, check_array, check_choice
from ..core.checks import (check_block_tables, check_cu_seqlens, check_gqa, check_options,
    check_out, check_query, table_stride)
from ..core.errors import strict
from ..core.launch import ptr
from ..core.layouts import cache_geometry, resolve_layout
from ..reference import sparse as ref
from . import launch as kernels, tiles
from .index import check_block_size, check_pattern_indices, prepare

DENSE_THRESHOLD = 0.5        # kept fraction of causal blocks above which a head runs dense


class Batch(NamedTuple):
    """Validated shapes of a sparse attention call, and its host lengths where the host has
    them (NumPy inputs, strict mode; else None)."""
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    size: int              # B
    max_kv: int            # keys of the longest sequence, or a bound from shapes
    q_lens: object = None  # int64 [B] or None
    kv_lens: object = None # int64 [B] or None


# ----------------------------------------------------------------------------- checks
def _check_kv(k, v, q, xp, names=("k", "v")):
    for name, x in zip(names, (k, v)):
        check_array(name, x, ndim=3, dtypes=FLOAT_DTYPES, xp=xp)
        if x.dtype != q.dtype or x.shape[2] != q.shape[2]:
            raise TypeError(f"{name}: expected dtype {q.dtype} and head size {q.shape[2]} like q, "
                            f"got {x.dtype} and {x.shape[2]}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected shape {tuple(k.shape)} like k, got {tuple(v.shape)}")
    check_gqa(q.shape[1], k.shape[1])


def _check_not_longer(q_lens, kv_lens):
    bad = kv_lens < q_lens
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"sequence {i}: expected q_len <= kv_len (queries are the last "
                         f"positions), got q_len {int(q_lens[i])} > kv_len {int(kv_lens[i])}")


def _check_vs_indices(v_idx, s_idx, batch, xp, batched, contents):
    shape = (batch.size, batch.num_q_heads, None) if batched else (batch.num_q_heads, None)
    check_pattern_indices("v_idx", v_idx, xp, shape, contents)
    check_pattern_indices("s_idx", s_idx, xp, shape, contents)


def check_dense_threshold(value):
    """``dense_threshold``: a float in ``[0, 1]``, or None (the pattern always)."""
    if value is None:
        return None
    if not isinstance(value, (int, float, np.floating)) or isinstance(value, bool) or \
            not 0 <= value <= 1:
        raise ValueError(f"dense_threshold: expected a float in [0, 1] or None, got {value!r}")
    return float(value)


def _check_gpu(q, block_m, what="block_m"):
    if q.dtype not in kernels.KERNEL_DTYPES:
        raise TypeError(f"q: the CUDA kernels take float16 or bfloat16, got {q.dtype}")
    if block_m % kernels.ROWS:
        raise ValueError(f"{what}: the CUDA kernel needs a multiple of {kernels.ROWS}, got {block_m}")


def _outputs(q, out, return_lse, xp):
    out = xp.empty(q.shape, q.dtype) if out is None else check_out(out, q.shape, q.dtype, xp)
    lse = xp.empty(q.shape[:2], np.float32) if return_lse else None
    return out, lse


def _settings(xp, q, block_m, block_n, dense_threshold, out, return_lse, backend, **score):
    """The checked block sizes, dense threshold, backend and score options of a vertical-slash
    call, and its outputs: ``(block_m, block_n, threshold, opts, out, lse)``."""
    _, hq, d = q.shape
    check_choice("backend", backend, kernels.BACKENDS)
    block_m, block_n = check_block_size("block_m", block_m), check_block_size("block_n", block_n)
    threshold = check_dense_threshold(dense_threshold)
    opts = check_options(xp, hq, d, **score)
    return (block_m, block_n, threshold, opts) + tuple(_outputs(q, out, return_lse, xp))


def reference_options(opts):
    """The reference's keywords of checked options (``core.checks.AttentionOptions``)."""
    return dict(sm_scale=opts.sm_scale, window_left=opts.window_left,
                alibi_slopes=opts.alibi_slopes, sinks=opts.sinks,
                logits_soft_cap=opts.logits_soft_cap)


def _finish_reference(result, out, lse):
    o, l_ = result
    out[...] = o.astype(out.dtype)
    if lse is None:
        return out
    lse[...] = l_.astype(np.float32)
    return out, lse


# ----------------------------------------------------------------------------- launch
def launch(q, kv, out, lse, cu_q, meta, batch, cta_bound, lists, opts, attn):
    """One attention launch ``attn`` (``launch.AttentionLaunch``) over the heads of
    ``lists`` (``tiles.TileLists``), its CTAs placed by ``meta`` (``bsr_prepare``'s schedule
    of ``cta_bound`` entries)."""
    attn((lists.heads, cta_bound), kv, cu_q=ptr(cu_q), bsr_meta=ptr(meta), batch=batch.size,
         cta_bound=cta_bound, **kernels.common_fields(q, out, lse, kv, batch.num_kv_heads, opts,
                                                      True), **lists.fields())


def run_vertical_slash(q, kv, v_idx, s_idx, cu_q, seq_lens, total_k, batch, opts, out, lse,
                       block_m, block_n, dense_threshold, list_budget=None, wgmma=False):
    """The CuPy path, no host read: ``launch.schedule``, index rows prepared and the
    dense rows decided (``index.prepare``), then per head group (``tiles.vs_lists``, at most
    ``list_budget`` bytes of lists) its lists and its attention launch (``wgmma``: the sm_90a
    kernel).

    ``kv``: ``launch.KVSource``; ``seq_lens``: the paged key counts, or None (dense rows of
    ``kv.cu_k``, ``total_k`` of them); ``v_idx``, ``s_idx``: ``[B, Hq, n]``.
    """
    if q.shape[0] == 0:
        return
    meta, cta_bound, err = kernels.schedule(q, out, lse, cu_q, kv, seq_lens, total_k,
                                            kernels.CTA_ROWS)
    # meta[4 b + 1] keys and meta[4 b + 3] queries of sequence b, as checked
    prep = prepare(v_idx, s_idx, meta[1:], block_m, q_lens=meta[3:], len_stride=4,
                   block_n=block_n, dense_threshold=dense_threshold, err=err)
    attn = kernels.attention_launch(q.dtype, batch.head_dim, general=kernels.general_scores(opts),
                                    wgmma=wgmma, ragged=kv.table is None)
    for lists in tiles.vs_lists(prep, prep.dense, meta, batch.size, cta_bound, batch.max_kv,
                                block_n, attn.tile_n, list_budget):
        launch(q, kv, out, lse, cu_q, meta, batch, cta_bound, lists, opts, attn)
# ----------------------------------------------------------------------------- public ops
@accepts_dlpack
def vertical_slash_attention(q, k, v, v_idx, s_idx, *, cu_seqlens_q=None, cu_seqlens_k=None,
                             sm_scale=None, window_left=-1, alibi_slopes=None, sinks=None,
                             logits_soft_cap=0.0, block_m=64, block_n=64, return_lse=False,
                             out=None, dense_threshold=DENSE_THRESHOLD, validate=None,
                             backend="auto"):
    """Causal attention restricted to a vertical+slash pattern (MInference's kernel).

    The pattern of each query block is given by :func:`vertical_slash_index` on
    ``(v_idx, s_idx)``; see ``cupaged.reference.sparse`` for the exact rule. A (sequence,
    head) whose pattern keeps more than ``dense_threshold`` of its causal blocks gets full
    causal attention instead (``reference.sparse.dense_heads``; module docstring: why).

    Parameters
    ----------
    q : array
        ``[q_len, Hq, D]``, or ``[total_q, Hq, D]`` with ``cu_seqlens_q``.
    k, v : array
        ``[kv_len, Hk, D]`` (``kv_len >= q_len``; query ``i`` at ``kv_len - q_len + i``), or
        ``[total_k, Hk, D]`` with ``cu_seqlens_k``.
    v_idx, s_idx : array
        int32 ``[Hq, nv]``/``[Hq, ns]`` key positions and diagonal offsets, or
        ``[B, Hq, n]`` for a batch (pad short rows with :data:`PAD`). Any order.
    cu_seqlens_q, cu_seqlens_k : array, optional
        int32 ``[B + 1]`` row offsets of a packed batch (both or neither).
    sm_scale : float, optional
        Default ``D ** -0.5``.
    window_left : int
        ``w >= 0``: query ``p`` also sees only keys ``j >= p - w`` (on top of the pattern);
        -1: no window (docs/design.md, as the dense ops).
    alibi_slopes : array, optional
        float32 ``[Hq]``: ALiBi adds ``slope_h * (j - p)`` to each score.
    sinks : array, optional
        float32 ``[Hq]`` sink logits (one extra softmax denominator term).
    logits_soft_cap : float
        ``cap > 0``: scores become ``cap * tanh(s / cap)`` (before ALiBi); 0: off.
    block_m, block_n : int
        Pattern tile (the CUDA kernel needs ``block_m`` a multiple of 64).
    return_lse : bool
        Also return the float32 ``[tokens, Hq]`` natural-log LSE.
    out : array, optional
        ``[tokens, Hq, D]`` buffer for the output.
    dense_threshold : float or None
        Kept fraction of causal blocks above which a (sequence, head) runs dense (default
        :data:`DENSE_THRESHOLD`); None: the pattern always.
    validate : bool, optional
        Check device lengths and indices on the host first (default: ``CUPAGED_STRICT``);
        else the kernels check them (``cupaged.check_errors``; rows of bad entries are
        zeros, and on CuPy query rows past ``cu_seqlens_q[-1]`` are zeroed padding).
    backend : {"auto", "mma", "wgmma"}
        The CUDA kernel: "auto" takes the wgmma kernel on sm_90 (Hopper) for K/V rows of head
        size 64 or 128 (not a paged cache: ``sparse.launch.use_wgmma``), else the mma.sync
        one; "wgmma" needs sm_90. NumPy inputs run the reference whatever it says.

    Returns
    -------
    out : array
        ``[tokens, Hq, D]`` in q's dtype; ``(out, lse)`` with ``return_lse``.
    """
    xp = array_module(q, k, v, v_idx, s_idx, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks,
                      out)
    _, hq, d = check_query("q", q, xp)
    _check_kv(k, v, q, xp)
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q, cu_seqlens_k: expected both or neither, got one")
    batched = cu_seqlens_q is not None
    hosted = xp is np or strict(validate)
    if batched:
        cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, xp, total=q.shape[0],
                                contents=hosted, padding=False)
        cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, xp, total=k.shape[0],
                                contents=hosted, padding=False)
        if cu_seqlens_k.shape != cu_seqlens_q.shape:
            raise ValueError(f"cu_seqlens_k: expected {cu_seqlens_q.shape[0]} entries like "
                             f"cu_seqlens_q, got {cu_seqlens_k.shape[0]}")
        lengths = (np.diff(cu_q.astype(np.int64)), np.diff(cu_k.astype(np.int64))) if hosted \
            else (None, None)
    else:
        lengths = np.array([q.shape[0]]), np.array([k.shape[0]])
    if lengths[0] is not None:
        _check_not_longer(*lengths)
    size = cu_seqlens_q.shape[0] - 1 if batched else 1
    batch = Batch(hq, k.shape[1], d, size, k.shape[0], *lengths)
    _check_vs_indices(v_idx, s_idx, batch, xp, batched, hosted)
    block_m, block_n, threshold, opts, out, lse = _settings(
        xp, q, block_m, block_n, dense_threshold, out, return_lse, backend, sm_scale=sm_scale,
        window_left=window_left, alibi_slopes=alibi_slopes, sinks=sinks,
        logits_soft_cap=logits_soft_cap)
    if xp is np:
        kw = dict(block_m=block_m, block_n=block_n, dense_threshold=threshold,
                  **reference_options(opts))
        if batched:
            result = ref.varlen_vertical_slash_attention(q, k, v, v_idx, s_idx, cu_q, cu_k, **kw)
        else:
            result = ref.vertical_slash_attention(q, k, v, v_idx, s_idx, **kw)
        return _finish_reference(result, out, lse)
    _check_gpu(q, block_m)
    if batched:
        cu_q_d, cu_k_d = cu_seqlens_q, cu_seqlens_k
    else:
        # [0, n] computed on the device: no upload
        cu_q_d, cu_k_d = (xp.arange(2, dtype=np.int32) * np.int32(n)
                          for n in (q.shape[0], k.shape[0]))
        v_idx, s_idx = v_idx[None], s_idx[None]
    run_vertical_slash(q, kernels.dense_kv(k, v, cu_k_d), v_idx, s_idx, cu_q_d, None, k.shape[0],
                       batch, opts, out, lse, block_m, block_n, threshold,
                       wgmma=kernels.use_wgmma(backend, "sparse_attention", d, True))
    return out if lse is None else (out, lse)


@accepts_dlpack
def paged_vertical_slash_attention(q, k_cache, v_cache, v_idx, s_idx, cu_seqlens_q, block_tables,
                                   seq_lens, *, layout=None, sm_scale=None, window_left=-1,
                                   alibi_slopes=None, sinks=None, logits_soft_cap=0.0,
                                   block_m=64, block_n=64, return_lse=False, out=None,
                                   dense_threshold=DENSE_THRESHOLD, validate=None,
                                   backend="auto"):
    """Vertical+slash attention of new queries against a paged KV cache (chunked prefill).

    Parameters
    ----------
    q : array
        ``[total_q, Hq, D]``; sequence ``b``'s queries are the last ``q_len_b`` of its
        ``seq_lens[b]`` cached positions.
    k_cache, v_cache : array
        Paged caches in ``layout`` already holding the new keys and values: ``"NHD"``
        ``[num_blocks, block_size, Hk, D]`` or ``"HND"`` ``[num_blocks, Hk, block_size, D]``
        (NumPy also takes ``"vllm"``).
    v_idx, s_idx : array
        int32 ``[B, Hq, n]`` per-sequence indices (padding :data:`PAD`).
    cu_seqlens_q : array
        int32 ``[B + 1]``.
    block_tables : array
        int32 ``[B, max_blocks]``, -1 padded.
    seq_lens : array
        int32 ``[B]`` keys per sequence, ``>= q_len_b``.
    layout : {"NHD", "HND"}, optional
        Default "NHD", refused (ValueError) when k_cache's shape also reads validly as HND.
    sm_scale, window_left, alibi_slopes, sinks, logits_soft_cap, block_m, block_n,
    return_lse, out, dense_threshold, validate, backend
        As in :func:`vertical_slash_attention`.

    Returns
    -------
    out : array
        ``[total_q, Hq, D]``; ``(out, lse)`` with ``return_lse``.
    """
    layout = resolve_layout(layout, k_cache, q)
    xp = array_module(q, k_cache, v_cache, v_idx, s_idx, cu_seqlens_q, block_tables, seq_lens,
                      alibi_slopes, sinks, out)
    _, hq, d = check_query("q", q, xp)
    geo = cache_geometry(k_cache, v_cache, layout)
    if k_cache.dtype != q.dtype or geo.head_dim != d:
        raise TypeError(f"k_cache: expected dtype {q.dtype} and head size {d} like q, "
                        f"got {k_cache.dtype} and {geo.head_dim}")
    check_gqa(hq, geo.num_kv_heads, "k_cache")
    hosted = xp is np or strict(validate)
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, xp, total=q.shape[0], contents=hosted,
                            padding=False)
    _, kv_host = check_block_tables(block_tables, seq_lens, geo, xp,
                                    batch=cu_seqlens_q.shape[0] - 1, contents=hosted)
    lengths = (np.diff(cu_q.astype(np.int64)), kv_host.astype(np.int64)) if hosted else (None, None)
    if hosted:
        _check_not_longer(*lengths)
    batch = Batch(hq, geo.num_kv_heads, d, cu_seqlens_q.shape[0] - 1,
                  block_tables.shape[1] * geo.block_size, *lengths)
    _check_vs_indices(v_idx, s_idx, batch, xp, True, hosted)
    block_m, block_n, threshold, opts, out, lse = _settings(
        xp, q, block_m, block_n, dense_threshold, out, return_lse, backend, sm_scale=sm_scale,
        window_left=window_left, alibi_slopes=alibi_slopes, sinks=sinks,
        logits_soft_cap=logits_soft_cap)
    if xp is np:
        result = ref.paged_vertical_slash_attention(
            q, k_cache, v_cache, v_idx, s_idx, cu_q, block_tables, kv_host, layout,
            block_m=block_m, block_n=block_n, dense_threshold=threshold,
            **reference_options(opts))
        return _finish_reference(result, out, lse)
    _check_gpu(q, block_m)
    if layout not in ("NHD", "HND"):
        raise ValueError(f"layout: the CUDA kernel reads 'NHD' or 'HND' caches, got {layout!r}")
    kv = kernels.paged_kv(k_cache, v_cache, block_tables, layout)
    if kv.page_stride >= 2 ** 32:
        raise ValueError(f"k_cache: the CUDA kernel needs a cache block under 2^32 elements, got "
                         f"{kv.page_stride}")
    kv = kv._replace(table_stride=table_stride(block_tables))
    run_vertical_slash(q, kv, v_idx, s_idx, cu_seqlens_q, seq_lens, 0, batch, opts, out, lse,
                       block_m, block_n, threshold,
                       wgmma=kernels.use_wgmma(backend, "sparse_attention", d, False))
    return out if lse is None else (out, lse)
