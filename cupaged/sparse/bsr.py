"""Block-sparse-row (BSR) attention: whole batches over ragged or paged K/V, and one sequence.

The pattern is FlashInfer's ``indptr``/``indices`` form, one CSR matrix for the batch with a
row per (sequence, pattern head, block row); ``cupaged.reference.bsr`` defines it and the
semantics, and NumPy inputs run that reference. On CuPy two launches run and nothing is
read back to the host: ``bsr_prepare`` (``kernels_cu/sparse_index.cu``, one CTA) checks the
device lengths and block tables and places every 128-row CTA of the batch, then
``bsr_attention`` (``kernels_cu/sparse_attention.cu``, the vertical+slash kernel's loop with
another tile source) walks each CSR row's block ids in place. The grid is bounded from
``q``'s shape; bad device index entries are never followed, their rows come out as zeros and
the first one goes to the device error word (``cupaged.check_errors``). Strict mode
(``validate=True`` or ``CUPAGED_STRICT=1``) checks device patterns on the host first.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core.arrays import accepts_dlpack, array_module, check_array, check_choice
from ..core.checks import (check_block_tables, check_cu_seqlens, check_gqa, check_options,
    check_query, table_stride)
from ..core.errors import strict
from ..core.fp8 import check_kv_scales, resolve_kv_dtype
from ..core.launch import ptr
from ..core.layouts import cache_geometry, resolve_layout
from ..reference import bsr as ref
from . import launch as kernels
from .attention import _check_kv, _finish_reference, _outputs, reference_options
from .index import check_block_size, check_bsr_batch

class Pattern(NamedTuple):
    """A checked BSR pattern and block shape."""
    indptr: object
    indices: object
    block_m: int
    block_n: int
    heads: int           # H_p


def _check_pattern(indptr, indices, block_m, block_n, pattern_heads, hq, hk, lengths, xp):
    """Shapes always; contents when ``lengths`` (host ``(q_lens, kv_lens)``) are given."""
    block_m, block_n = check_block_size("block_m", block_m), check_block_size("block_n", block_n)
    q_lens, kv_lens = (None, None) if lengths is None else lengths
    check_bsr_batch(indptr, indices, q_lens, kv_lens, block_m, block_n, pattern_heads, hq, hk, xp)
    return Pattern(indptr, indices, block_m, block_n, int(pattern_heads))


def _check_gpu(q, pattern):
    """What the CUDA kernel does not take (the reference does)."""
    if q.dtype not in kernels.KERNEL_DTYPES:
        raise TypeError(f"q: the CUDA kernel takes float16 or bfloat16, got {q.dtype}")
    if pattern.block_m % kernels.ROWS:
        raise ValueError(f"block_m: the CUDA kernel needs a multiple of {kernels.ROWS}, got "
                         f"{pattern.block_m}")


# ----------------------------------------------------------------------------- launch
def cta_rows(block_m):
    """Query rows per CTA of ``bsr_attention``: 128 (two 64-row halves sharing every K/V tile
    load) when both halves lie in one block row, else 64 (a CTA's halves would be adjacent
    block rows keeping other blocks, each half idle while the other computes its tiles)."""
    return kernels.CTA_ROWS if block_m % kernels.CTA_ROWS == 0 else kernels.ROWS


def _launch(q, kv, num_kv_heads, cu_q, seq_lens, total_k, pattern, opts, causal, out, lse,
            rows=None, wgmma=False):
    """``bsr_prepare`` then ``bsr_attention`` over the batch (CuPy arrays; no host read).

    ``kv``: ``launch.KVSource`` (dense rows with ``cu_k``, or pages); ``seq_lens``: the paged
    key counts, or None; ``total_k``: rows of dense keys; ``rows``: query rows per CTA of the
    mma.sync kernel, 64 or 128 (default :func:`cta_rows`; both are right for any
    ``block_m``); ``wgmma``: the sm_90a kernel instead (128 rows: its two halves compute
    apart, each only its own blocks).
    """
    batch, (total_q, hq, d) = cu_q.shape[0] - 1, q.shape
    if batch < 1 or total_q == 0:
        out.fill(0)
        if lse is not None:
            lse.fill(-np.inf)
        return
    rows = kernels.CTA_ROWS if wgmma else rows or cta_rows(pattern.block_m)
    nnz = pattern.indices.shape[0]
    sched = kernels.schedule(q, out, lse, cu_q, kv, seq_lens, total_k, rows, pattern.indptr, nnz,
                             pattern.block_m, pattern.heads)
    attn = kernels.attention_launch(q.dtype, d, "bsr_attention", rows, kernels.general_scores(opts),
                                    wgmma, kv.table is None)
    attn((hq, sched.cta_bound), kv, cu_q=ptr(cu_q), indptr=ptr(pattern.indptr),
         indices=ptr(pattern.indices), bsr_meta=ptr(sched.meta), err=ptr(sched.err),
         pattern_group=hq // pattern.heads, block_n=pattern.block_n, batch=batch,
         indptr_len=pattern.indptr.shape[0], nnz=nnz, block_m=pattern.block_m,
         cta_bound=sched.cta_bound, **kernels.common_fields(q, out, lse, kv, num_kv_heads, opts,
                                                            causal))


# ----------------------------------------------------------------------------- public ops
@accepts_dlpack
def varlen_block_sparse_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, indptr, indices,
                                  block_m, block_n, *, pattern_heads, causal=True,
                                  sm_scale=None, window_left=-1, alibi_slopes=None,
                                  sinks=None, logits_soft_cap=0.0, return_lse=False, out=None,
                                  validate=None, backend="auto"):
    """Block-sparse attention of a ragged batch under one BSR pattern (``reference.bsr``).

    Parameters
    ----------
    q : array
        ``[total_q, Hq, D]``; rows past ``cu_seqlens_q[-1]`` are padding (zeros).
    k, v : array
        ``[total_k, Hk, D]``, ``Hq % Hk == 0``, q's dtype.
    cu_seqlens_q, cu_seqlens_k : array
        int32 ``[B + 1]``: sequence ``b`` owns query rows ``[cu_seqlens_q[b],
        cu_seqlens_q[b + 1])`` and key rows likewise; its queries are its last positions
        (``p = kv_len - q_len + i``). Lengths may be 0.
    indptr : array
        int32 ``[H_p * sum_b ceil(q_len_b / block_m) + 1]``: CSR row pointer over (sequence,
        pattern head, block row).
    indices : array
        int32 ``[nnz]`` kept key block ids of each row, in ``[0, ceil(kv_len_b / block_n))``,
        strictly increasing within a row.
    block_m, block_n : int
        Query rows and keys per block (the CUDA kernel: ``block_m`` a multiple of 64).
    pattern_heads : int
        ``H_p`` in ``{Hq, Hk, 1}``: query head ``h`` reads pattern head ``h // (Hq / H_p)``.
    causal, sm_scale, window_left, alibi_slopes, sinks, logits_soft_cap
        docs/design.md's options, applied inside the kept blocks, with the dense ops' names
        and meaning (``alibi_slopes``, ``sinks``: float32 ``[Hq]``; ``window_left`` -1: no
        window; ``logits_soft_cap`` 0: off).
    return_lse : bool
        Also return the float32 ``[total_q, Hq]`` natural-log LSE.
    out : array, optional
        ``[total_q, Hq, D]`` output buffer.
    validate : bool, optional
        Check device lengths and the pattern on the host first (default: ``CUPAGED_STRICT``).
    backend : {"auto", "mma", "wgmma"}
        The CUDA kernel: "auto" takes the wgmma kernel on sm_90 for K/V rows of head size 64
        or 128 (not a paged cache: ``sparse.launch.use_wgmma``), else the mma.sync one;
        "wgmma" needs sm_90.
        NumPy inputs run the reference whatever it says.

    Returns
    -------
    out : array
        ``[total_q, Hq, D]`` in q's dtype, zeros for rows with no key; ``(out, lse)`` with
        ``return_lse`` (``-inf``, or the sink, for rows with no key).
    """
    xp = array_module(q, k, v, cu_seqlens_q, cu_seqlens_k, indptr, indices, alibi_slopes,
                      sinks, out)
    _, hq, d = check_query("q", q, xp)
    _check_kv(k, v, q, xp)
    hosted = xp is np or strict(validate)
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, xp, total=q.shape[0], contents=hosted)
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, xp, total=k.shape[0], contents=hosted)
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k: expected shape {tuple(cu_seqlens_q.shape)} like "
                         f"cu_seqlens_q, got {tuple(cu_seqlens_k.shape)}")
    lengths = (np.diff(cu_q), np.diff(cu_k)) if hosted else None
    pattern = _check_pattern(indptr, indices, block_m, block_n, pattern_heads, hq, k.shape[1],
                             lengths, xp)
    opts = check_options(xp, hq, d, sm_scale=sm_scale, window_left=window_left,
                         alibi_slopes=alibi_slopes, sinks=sinks, logits_soft_cap=logits_soft_cap)
    check_choice("backend", backend, kernels.BACKENDS)
    out, lse = _outputs(q, out, return_lse, xp)
    if xp is np:
        return _finish_reference(ref.varlen_block_sparse_attention(
            q, k, v, cu_q, cu_k, indptr, indices, pattern.block_m, pattern.block_n,
            pattern_heads=pattern.heads, causal=bool(causal), **reference_options(opts)),
            out, lse)
    _check_gpu(q, pattern)
    _launch(q, kernels.dense_kv(k, v, cu_seqlens_k), k.shape[1], cu_seqlens_q, None, k.shape[0],
            pattern, opts, causal, out, lse,
            wgmma=kernels.use_wgmma(backend, "bsr_attention", d, True))
    return out if lse is None else (out, lse)


@accepts_dlpack
def paged_block_sparse_attention(q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens,
                                 indptr, indices, block_m, block_n, *, pattern_heads,
                                 causal=True, sm_scale=None, window_left=-1, alibi_slopes=None,
                                 sinks=None, logits_soft_cap=0.0, layout=None, kv_dtype=None,
                                 k_scale=None, v_scale=None, return_lse=False, out=None,
                                 validate=None, backend="auto"):
    """:func:`varlen_block_sparse_attention` with keys and values in a paged cache.

    Parameters
    ----------
    q : array
        ``[total_q, Hq, D]``; sequence ``b``'s queries are the last ``q_len_b`` of its
        ``seq_lens[b]`` cached positions.
    k_cache, v_cache : array
        Paged caches in ``layout`` already holding the keys (the CUDA kernel: ``"NHD"``
        ``[num_blocks, page, Hk, D]`` or ``"HND"`` ``[num_blocks, Hk, page, D]`` in q's dtype;
        NumPy also ``"vllm"`` and fp8 caches).
    cu_seqlens_q : array
        int32 ``[B + 1]``.
    block_tables : array
        int32 ``[B, max_blocks]``, -1 padded.
    seq_lens : array
        int32 ``[B]`` keys per sequence: ``kv_len_b``, which sizes its block columns. The page
        size and ``block_n`` are independent.
    indptr, indices, block_m, block_n, pattern_heads, causal, sm_scale, window_left,
    alibi_slopes, sinks, logits_soft_cap, return_lse, out, validate, backend
        As in :func:`varlen_block_sparse_attention`.
    layout : {"NHD", "HND", "vllm"}, optional
        Default "NHD" (``cupaged.core.layouts.resolve_layout``).
    kv_dtype, k_scale, v_scale
        fp8 caches (docs/design.md), NumPy only.

    Returns
    -------
    out : array
        ``[total_q, Hq, D]``; ``(out, lse)`` with ``return_lse``.
    """
    layout = resolve_layout(layout, k_cache, q)
    xp = array_module(q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, indptr,
                      indices, alibi_slopes, sinks, out)
    _, hq, d = check_query("q", q, xp)
    geo = cache_geometry(k_cache, v_cache, layout)
    fmt = resolve_kv_dtype(kv_dtype, k_cache, v_cache)
    scales = check_kv_scales(fmt, k_scale, v_scale, geo.num_kv_heads)
    if (fmt is None and k_cache.dtype != q.dtype) or geo.head_dim != d:
        raise TypeError(f"k_cache: expected dtype {q.dtype} and head size {d} like q, "
                        f"got {k_cache.dtype} and {geo.head_dim}")
    check_gqa(hq, geo.num_kv_heads, "k_cache")
    hosted = xp is np or strict(validate)
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, xp, total=q.shape[0], contents=hosted)
    _, kv_lens = check_block_tables(block_tables, seq_lens, geo, xp,
                                    batch=cu_seqlens_q.shape[0] - 1, contents=hosted)
    lengths = (np.diff(cu_q), kv_lens) if hosted else None
    pattern = _check_pattern(indptr, indices, block_m, block_n, pattern_heads, hq,
                             geo.num_kv_heads, lengths, xp)
    opts = check_options(xp, hq, d, sm_scale=sm_scale, window_left=window_left,
                         alibi_slopes=alibi_slopes, sinks=sinks, logits_soft_cap=logits_soft_cap)
    check_choice("backend", backend, kernels.BACKENDS)
    out, lse = _outputs(q, out, return_lse, xp)
    if xp is np:
        return _finish_reference(ref.paged_block_sparse_attention(
            q, k_cache, v_cache, cu_q, block_tables, kv_lens, indptr, indices, pattern.block_m,
            pattern.block_n, pattern_heads=pattern.heads, causal=bool(causal), layout=layout,
            kv_dtype=None if fmt is None else fmt.name, k_scale=scales[0], v_scale=scales[1],
            **reference_options(opts)), out, lse)
    _check_gpu(q, pattern)
    if fmt is not None or layout not in ("NHD", "HND"):
        raise ValueError(f"k_cache: the CUDA kernel reads 'NHD' or 'HND' caches of q's dtype, got "
                         f"layout {layout!r} and kv_dtype {None if fmt is None else fmt.name!r}")
    kv = kernels.paged_kv(k_cache, v_cache, block_tables, layout)
    if kv.page_stride >= 2 ** 32:
        raise ValueError(f"k_cache: the CUDA kernel needs a cache block under 2^32 elements, got "
                         f"{kv.page_stride}")
    kv = kv._replace(table_stride=table_stride(block_tables))
    _launch(q, kv, geo.num_kv_heads, cu_seqlens_q, seq_lens, 0, pattern, opts, causal, out, lse,
            wgmma=kernels.use_wgmma(backend, "bsr_attention", d, False))
    return out if lse is None else (out, lse)


@accepts_dlpack
def block_sparse_attention(q, k, v, indptr, indices, block_m, block_n, *, causal=True,
                           sm_scale=None, window_left=-1, alibi_slopes=None, sinks=None,
                           logits_soft_cap=0.0, return_lse=False, out=None, backend="auto"):
    """Attention of one sequence under a BSR pattern shared by all heads: the batch of one
    of :func:`varlen_block_sparse_attention` (``pattern_heads=1``).

    Parameters
    ----------
    q : array
        ``[q_len, Hq, D]``.
    k, v : array
        ``[kv_len, Hk, D]``; query ``i`` at position ``kv_len - q_len + i``.
    indptr : array
        int32 ``[ceil(q_len / block_m) + 1]``: row block ``r`` (queries
        ``[r block_m, (r + 1) block_m)``) owns ``indices[indptr[r]:indptr[r + 1]]``.
    indices : array
        int32 ``[nnz]`` key block ids (keys ``[c block_n, (c + 1) block_n)``), strictly
        increasing within a row.
    block_m, block_n : int
        Block shape (the CUDA kernel needs ``block_m`` a multiple of 64).
    causal, sm_scale, window_left, alibi_slopes, sinks, logits_soft_cap, return_lse, out, backend
        As in :func:`varlen_block_sparse_attention`.

    Returns
    -------
    out : array
        ``[q_len, Hq, D]``; ``(out, lse)`` with ``return_lse``.
    """
    xp = array_module(q, k, v, indptr, indices, alibi_slopes, sinks, out)
    check_query("q", q, xp)
    check_array("k", k, ndim=3, xp=xp)
    block_m = check_block_size("block_m", block_m)
    rows = -(-q.shape[0] // block_m)
    check_array("indptr", indptr, ndim=1, dtypes=np.int32, xp=xp)
    if indptr.shape[0] != rows + 1:
        raise ValueError(f"indptr: expected shape [{rows + 1}] (ceil(q_len / block_m) + 1), "
                         f"got {tuple(indptr.shape)}")
    cu_q = xp.asarray([0, q.shape[0]], dtype=np.int32)
    cu_k = xp.asarray([0, k.shape[0]], dtype=np.int32)
    return varlen_block_sparse_attention(q, k, v, cu_q, cu_k, indptr, indices, block_m, block_n,
                                         pattern_heads=1, causal=causal, sm_scale=sm_scale,
                                         window_left=window_left, alibi_slopes=alibi_slopes,
                                         sinks=sinks, logits_soft_cap=logits_soft_cap,
                                         return_lse=return_lse, out=out, backend=backend)
