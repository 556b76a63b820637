"""Vertical+slash index conversion (MInference) and the checks of index arguments
(vertical/slash indices, BSR patterns of one sequence or a batch).

``vertical_slash_index`` turns per-head vertical/slash indices into, for every 64-row (or
``block_m``-row) query block, its list of key blocks and its list of extra key columns;
the rule is written out in ``cupaged.reference.sparse``. On CuPy the rows are sorted, then
``vs_prepare`` (``kernels_cu/sparse_index.cu``) deduplicates the verticals and finds the
runs of the slash rows (slashes at most ``block_m`` apart always merge), and one warp per
(sequence, head, query block) walks the runs (``sparse_plan.cuh``): the walk costs the
number of runs and ranges, not the number of slashes.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core.arrays import accepts_dlpack, array_module, check_array, check_range, host
from ..core import abi, errors
from ..core.checks import check_cu_seqlens, check_int
from ..core.errors import strict
from ..core.launch import ptr
from ..reference import sparse as ref
from ..reference.bsr import bsr_row_offsets
from . import launch as kernels

PAD = ref.PAD


class IndexPlan(NamedTuple):
    """Validated sizes of an index conversion."""
    batch: int
    heads: int
    num_m: int          # query blocks per sequence row of the outputs
    block_m: int
    block_n: int
    w_s: int            # block_offset row width
    w_v: int            # column_index row width
    max_q: int          # the bounds the widths hold: queries and keys per sequence
    max_kv: int


def check_block_size(name, value, multiple=1):
    value = check_int(name, value)
    if value % multiple:
        raise ValueError(f"{name}: expected a multiple of {multiple}, got {value!r}")
    return value


def check_pattern_indices(name, idx, xp, shape, contents=True):
    """int32 vertical or slash indices of ``shape`` (None: any), all ``>= 0``; host copy
    (None with ``contents=False``: shape and dtype only, ``vs_prepare`` checks the entries)."""
    check_array(name, idx, shape=shape, dtypes=np.int32, xp=xp)
    if not contents:
        return None
    h = host(idx)
    check_range(name, h, 0, 2 ** 31)
    return h


def check_bsr_rows(indptr, indices, num_cols, xp, where=None):
    """Check a BSR pattern's ``indptr``/``indices`` against the block columns of its rows.

    ``num_cols``: int ``[rows]`` block columns of each CSR row (``len(indptr) - 1`` rows,
    checked by the caller). ``indptr`` starts at 0, never decreases and ends at
    ``len(indices)``; ``indices`` is int32, row ``t``'s entries lie in ``[0, num_cols[t])``
    and strictly increase. ``where(t)`` names CSR row ``t`` in messages. Returns the host
    copies ``(indptr, indices)``.
    """
    ptr = check_cu_seqlens("indptr", indptr, xp)
    check_array("indices", indices, ndim=1, dtypes=np.int32, xp=xp)
    if int(ptr[-1]) != indices.shape[0]:
        raise ValueError(f"indptr: expected last entry {indices.shape[0]} (len(indices)), "
                         f"got {int(ptr[-1])}")
    idx = host(indices).astype(np.int64)
    row_of = np.repeat(np.arange(len(ptr) - 1), np.diff(ptr))
    limit = np.asarray(num_cols, np.int64)[row_of]
    bad = (idx < 0) | (idx >= limit)
    if bad.any():
        i = int(np.argmax(bad))
        at = "" if where is None else f" ({where(int(row_of[i]))})"
        raise ValueError(f"indices: expected entries in [0, {int(limit[i])}), got {int(idx[i])} "
                         f"at index {i}{at}")
    bad = (row_of[1:] == row_of[:-1]) & (np.diff(idx) <= 0)
    if bad.any():
        i = int(np.argmax(bad))
        at = "" if where is None else f" ({where(int(row_of[i]))})"
        raise ValueError(f"indices: expected strictly increasing block ids within each row, "
                         f"got {int(idx[i])} then {int(idx[i + 1])} at index {i}{at}")
    return ptr, host(indices)


def check_bsr_batch(indptr, indices, q_lens, kv_lens, block_m, block_n, pattern_heads,
                    num_q_heads, num_kv_heads, xp):
    """Check a batched BSR pattern (``cupaged.reference.bsr``); return the row offsets.

    Parameters
    ----------
    indptr, indices : array
        int32 ``[row_offsets[B] + 1]`` and ``[nnz]``.
    q_lens, kv_lens : numpy.ndarray or None
        int ``[B]`` host query and key counts per sequence; None (the lengths live on the
        device): only the block shape, ``pattern_heads`` and the arrays' dtypes are checked,
        and None is returned.
    block_m, block_n : int
        Block shape, ``>= 1``.
    pattern_heads : int
        ``H_p`` in ``{num_q_heads, num_kv_heads, 1}``.

    Returns
    -------
    numpy.ndarray
        int32 ``[B + 1]`` ``row_offsets`` (``reference.bsr.bsr_row_offsets``).
    """
    block_m = check_block_size("block_m", block_m)
    block_n = check_block_size("block_n", block_n)
    heads = check_int("pattern_heads", pattern_heads)
    if heads not in (num_q_heads, num_kv_heads, 1):
        raise ValueError(f"pattern_heads: expected {sorted({num_q_heads, num_kv_heads, 1})} "
                         f"(per query head, per kv head or shared), got {heads}")
    check_array("indptr", indptr, ndim=1, dtypes=np.int32, xp=xp)
    if q_lens is None:
        check_array("indices", indices, ndim=1, dtypes=np.int32, xp=xp)
        return None
    q_lens, kv_lens = np.asarray(q_lens, np.int64), np.asarray(kv_lens, np.int64)
    offsets = bsr_row_offsets(q_lens, block_m, heads).astype(np.int64)
    if indptr.shape[0] != offsets[-1] + 1:
        raise ValueError(f"indptr: expected shape [{offsets[-1] + 1}] (pattern_heads * "
                         f"sum(ceil(q_len / block_m)) + 1), got {tuple(indptr.shape)}")
    rows = -(-q_lens // block_m)
    seq_of = np.repeat(np.arange(len(rows)), rows * heads)
    num_cols = (-(-kv_lens // block_n))[seq_of]

    def where(t):
        b = int(seq_of[t])
        g, r = divmod(t - int(offsets[b]), int(rows[b]))
        return f"sequence {b}, pattern head {g}, block row {r}"

    check_bsr_rows(indptr, indices, num_cols, xp, where)
    return offsets.astype(np.int32)


def plan_index(seqlens, v_idx, s_idx, context_size, block_m, block_n, kv_seqlens, xp, hosted,
               max_kv_len=None):
    """Validate :func:`vertical_slash_index`'s arguments; return the plan and the host
    lengths (``hosted``: read and checked on the host; else None, checked by the kernel)."""
    check_array("seqlens", seqlens, ndim=1, dtypes=np.int32, xp=xp)
    batch = seqlens.shape[0]
    check_pattern_indices("v_idx", v_idx, xp, (batch, None, None), hosted)
    heads = v_idx.shape[1]
    check_pattern_indices("s_idx", s_idx, xp, (batch, heads, None), hosted)
    block_m = check_block_size("block_m", block_m)
    block_n = check_block_size("block_n", block_n)
    if not isinstance(context_size, (int, np.integer)) or context_size < 1:
        raise ValueError(f"context_size: expected an int >= 1, got {context_size!r}")
    if kv_seqlens is not None:
        check_array("kv_seqlens", kv_seqlens, shape=(batch,), dtypes=np.int32, xp=xp)
    if max_kv_len is not None:
        max_kv_len = check_int("max_kv_len", max_kv_len)
        if kv_seqlens is None:
            raise ValueError("max_kv_len: expected None without kv_seqlens (the keys are the "
                             f"queries, bounded by context_size), got {max_kv_len}")
    q_lens = kv_lens = None
    if hosted or (kv_seqlens is not None and max_kv_len is None):
        q_lens = host(seqlens).astype(np.int64)
        check_range("seqlens", q_lens, 0, 2 ** 31)
        kv_lens = q_lens if kv_seqlens is None else host(kv_seqlens).astype(np.int64)
        short = kv_lens < q_lens
        if short.any():
            i = int(np.argmax(short))
            raise ValueError(f"kv_seqlens: expected >= seqlens (queries are the last positions), "
                             f"got {int(kv_lens[i])} < {int(q_lens[i])} at index {i}")
        max_q = int(q_lens.max(initial=0))
        if context_size < max_q:
            raise ValueError(f"context_size: expected an int >= the longest sequence "
                             f"({max_q}), got {context_size!r}")
        longest = int(kv_lens.max(initial=0))
        if max_kv_len is not None and longest > max_kv_len:
            raise ValueError(f"max_kv_len: expected >= the longest kv_seqlens ({longest}), "
                             f"got {max_kv_len}")
    if kv_seqlens is None:
        max_kv = int(context_size)
    else:
        max_kv = max_kv_len if max_kv_len is not None else int(kv_lens.max(initial=0))
    w_s, w_v = ref.index_widths(v_idx.shape[2], s_idx.shape[2], max_kv, block_m, block_n)
    num_m = -(-int(context_size) // block_m)
    plan = IndexPlan(batch, heads, num_m, block_m, block_n, w_s, w_v, int(context_size), max_kv)
    return plan, q_lens, kv_lens


class Prepared(NamedTuple):
    """Device index rows ready for the walks (``vs_prepare``); CuPy int32 arrays."""
    s: object            # [B, H, ns] slashes, ascending (a row with a negative index: PAD)
    run_first: object    # [B, H, ns] first index of each slash's run
    v: object            # [B, H, nv] unique verticals < kv_len first, then unspecified
    v_count: object      # [B, H] number of unique verticals
    block_m: int         # the runs' merge distance
    dense: object        # [B, H] 1 where the row runs dense, or None (not decided)


def prepare(v_idx, s_idx, kv_lens, block_m, *, q_lens=None, len_stride=1, block_n=64,
            dense_threshold=None, err=None):
    """Sort ``[B, H, n]`` vertical/slash rows and prepare them for the walks (CuPy).

    Parameters
    ----------
    v_idx, s_idx : cupy.ndarray
        int32 ``[B, H, nv]`` and ``[B, H, ns]``.
    kv_lens : cupy.ndarray
        int32 device key counts, sequence ``b``'s at ``kv_lens[b * len_stride]``
        (verticals at or past it are padding).
    block_m : int
        Pattern block rows.
    q_lens : cupy.ndarray, optional
        int32 device query counts, strided alike; needed with ``dense_threshold``.
    block_n : int
        Pattern key block (the dense decision counts blocks of it).
    dense_threshold : float, optional
        Decide the rows that run dense (``Prepared.dense``): those whose pattern keeps more
        than this fraction of their causal blocks (``reference.sparse.dense_heads``).
    err : cupy.ndarray, optional
        The device error word: rows holding a negative index are reported there (and
        emptied).
    """
    import cupy
    v_sorted, s_sorted = cupy.sort(v_idx, axis=-1), cupy.sort(s_idx, axis=-1)
    batch, heads, nv = v_sorted.shape
    v_unique = cupy.empty_like(v_sorted)
    run_first = cupy.empty_like(s_sorted)
    v_count = cupy.zeros((batch, heads), np.int32)
    dense = None if dense_threshold is None else cupy.zeros((batch, heads), np.int32)
    if batch * heads:
        kernels.kernel("sparse_index", kernels.PREPARE_EXPR, abi.VS_PREPARE)(
            batch * heads, kernels.PREP_THREADS, v_sorted=ptr(v_sorted), nv=nv,
            s_sorted=ptr(s_sorted), ns=s_sorted.shape[2], kv_lens=ptr(kv_lens),
            q_lens=ptr(q_lens), len_stride=len_stride, heads=heads, bm=block_m, bn=block_n,
            dense_threshold=0.0 if dense_threshold is None else dense_threshold,
            v_unique=ptr(v_unique), v_count=ptr(v_count), run_first=ptr(run_first),
            dense=ptr(dense), err=ptr(err))
    return Prepared(s_sorted, run_first, v_unique, v_count, block_m, dense)


def build_index(plan, seqlens, kv_seqlens, prep):
    """MInference lists of every query block on the device (``vs_index_kernel``).

    Returns ``(block_count, block_offset, column_count, column_index)`` shaped
    ``[B, H, M]`` and ``[B, H, M, W]``; list entries past the counts are 0.
    """
    import cupy
    rows = (plan.batch, plan.heads, plan.num_m)
    bc, cc = cupy.zeros(rows, np.int32), cupy.zeros(rows, np.int32)
    bo = cupy.zeros(rows + (plan.w_s,), np.int32)
    ci = cupy.zeros(rows + (plan.w_v,), np.int32)
    warps = plan.batch * plan.heads * plan.num_m
    if warps:
        kernels.kernel("sparse_index", kernels.INDEX_EXPR, abi.VS_INDEX)(
            -(-warps // (kernels.THREADS // 32)), kernels.THREADS, seqlens=ptr(seqlens),
            kv_seqlens=ptr(kv_seqlens), s_sorted=ptr(prep.s), run_first=ptr(prep.run_first),
            ns=prep.s.shape[2], v_unique=ptr(prep.v), v_count=ptr(prep.v_count),
            nv=prep.v.shape[2], batch=plan.batch, heads=plan.heads, num_m=plan.num_m,
            bm=plan.block_m, bn=plan.block_n, block_count=ptr(bc), block_offset=ptr(bo),
            w_s=plan.w_s, column_count=ptr(cc), column_index=ptr(ci), w_v=plan.w_v,
            max_q=plan.max_q, max_kv=plan.max_kv, err=ptr(errors.error_word()))
    return bc, bo, cc, ci


@accepts_dlpack
def vertical_slash_index(seqlens, v_idx, s_idx, context_size, block_m=64, block_n=64, *,
                         kv_seqlens=None, max_kv_len=None, validate=None):
    """MInference's index conversion: vertical+slash indices to block and column lists.

    On CuPy nothing is read back to the host (strict mode aside) when the keys per sequence
    have a host bound: ``context_size`` without ``kv_seqlens``, else ``max_kv_len``
    (without it the longest ``kv_seqlens`` is read back). The kernels then check the
    lengths and indices: a bad entry goes to the device error word (``cupaged.check_errors``)
    and its sequence or row gets empty lists.

    Parameters
    ----------
    seqlens : array
        int32 ``[B]`` queries per sequence.
    v_idx : array
        int32 ``[B, H, NNZ_V]`` vertical indices (key positions); entries ``>= kv_len`` are
        padding (see :data:`PAD`). Any order; sorted internally.
    s_idx : array
        int32 ``[B, H, NNZ_S]`` slash indices (diagonal offsets ``d = p - j``), likewise.
    context_size : int
        Padded query length, ``>= max(seqlens)``: ``M = ceil(context_size / block_m)``.
    block_m, block_n : int
        Query rows per block and keys per key block.
    kv_seqlens : array, optional
        int32 ``[B]`` keys per sequence, ``>= seqlens`` (default ``seqlens``): the queries
        are the last ``seqlens[b]`` positions (chunked prefill).
    max_kv_len : int, optional
        With ``kv_seqlens``: a bound on them (as flash-attn's ``max_seqlen_k``), which sizes
        the lists (``reference.sparse.index_widths``).
    validate : bool, optional
        Strict mode for this call (default: ``CUPAGED_STRICT``): the lengths and indices
        checked on the host before any launch.

    Returns
    -------
    block_count : array
        int32 ``[B, H, M]`` key blocks per query block.
    block_offset : array
        int32 ``[B, H, M, W_s]`` first key of each key block, ascending; 0 past the count.
    column_count : array
        int32 ``[B, H, M]`` extra columns per query block.
    column_index : array
        int32 ``[B, H, M, W_v]`` their key positions, ascending; 0 past the count.

    Raises
    ------
    ValueError, TypeError
        On wrong shapes, dtypes, or (NumPy, strict mode) negative indices or lengths that
        do not fit.
    """
    xp = array_module(seqlens, v_idx, s_idx, kv_seqlens)
    plan, q_lens, kv_lens = plan_index(seqlens, v_idx, s_idx, context_size, block_m, block_n,
                                       kv_seqlens, xp, xp is np or strict(validate), max_kv_len)
    if xp is np:
        return ref.vertical_slash_index(q_lens, v_idx, s_idx, context_size, plan.block_m,
                                        plan.block_n, kv_seqlens=kv_seqlens,
                                        max_kv_len=plan.max_kv)
    kv_d = seqlens if kv_seqlens is None else kv_seqlens
    err = errors.error_word()
    return build_index(plan, seqlens, kv_d, prepare(v_idx, s_idx, kv_d, plan.block_m, err=err))


def pad_indices(rows, xp=None):
    """Stack per-sequence ``[H, n_b]`` index arrays into int32 ``[B, H, max n_b]``.

    Short rows are padded with :data:`PAD`, which every consumer ignores.
    """
    if not rows:
        raise ValueError("rows: expected at least one [H, n] index array, got none")
    xp = xp or array_module(*rows)
    heads = rows[0].shape[0]
    width = max(max(r.shape[1] for r in rows), 1)
    out = xp.full((len(rows), heads, width), PAD, dtype=np.int32)
    for b, r in enumerate(rows):
        if r.ndim != 2 or r.shape[0] != heads:
            raise ValueError(f"rows[{b}]: expected shape [{heads}, *], got {tuple(r.shape)}")
        out[b, :, :r.shape[1]] = r
    return out
