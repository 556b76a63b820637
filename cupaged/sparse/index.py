"""Vertical+slash index conversion (MInference) and the checks of index arguments.

``vertical_slash_index`` turns per-head vertical/slash indices into, for every 64-row (or
``block_m``-row) query block, its list of key blocks and its list of extra key columns;
the rule is written out in ``cupaged.reference.sparse``. On CuPy one thread per (sequence,
head, query block) builds them (``kernels_cu/sparse_index.cu``).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._arrays import accepts_dlpack, array_module, check_array, check_range, host
from ..reference import sparse as ref
from . import kernels

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


def check_block_size(name, value, multiple=1):
    if not isinstance(value, (int, np.integer)) or value < 1 or value % multiple:
        want = f"a positive multiple of {multiple}" if multiple > 1 else "a positive int"
        raise ValueError(f"{name}: expected {want}, got {value!r}")
    return int(value)


def check_pattern_indices(name, idx, xp, shape):
    """int32 vertical or slash indices of ``shape`` (None: any), all ``>= 0``; host copy."""
    check_array(name, idx, shape=shape, dtypes=np.int32, xp=xp)
    h = host(idx)
    check_range(name, h, 0, 2 ** 31)
    return h


def plan_index(seqlens, v_idx, s_idx, context_size, block_m, block_n, kv_seqlens, xp):
    """Validate :func:`vertical_slash_index`'s arguments; return the plan and host lengths."""
    check_array("seqlens", seqlens, ndim=1, dtypes=np.int32, xp=xp)
    batch = seqlens.shape[0]
    check_pattern_indices("v_idx", v_idx, xp, (batch, None, None))
    heads = v_idx.shape[1]
    check_pattern_indices("s_idx", s_idx, xp, (batch, heads, None))
    block_m = check_block_size("block_m", block_m)
    block_n = check_block_size("block_n", block_n)
    q_lens = host(seqlens).astype(np.int64)
    check_range("seqlens", q_lens, 0, 2 ** 31)
    if kv_seqlens is None:
        kv_lens = q_lens
    else:
        check_array("kv_seqlens", kv_seqlens, shape=(batch,), dtypes=np.int32, xp=xp)
        kv_lens = host(kv_seqlens).astype(np.int64)
        short = kv_lens < q_lens
        if short.any():
            i = int(np.argmax(short))
            raise ValueError(f"kv_seqlens: expected >= seqlens (queries are the last positions), "
                             f"got {int(kv_lens[i])} < {int(q_lens[i])} at index {i}")
    max_q = int(q_lens.max(initial=0))
    if not isinstance(context_size, (int, np.integer)) or context_size < max(max_q, 1):
        raise ValueError(f"context_size: expected an int >= the longest sequence "
                         f"({max(max_q, 1)}), got {context_size!r}")
    w_s, w_v = ref.index_widths(v_idx.shape[2], s_idx.shape[2], int(kv_lens.max(initial=0)),
                                block_m, block_n)
    num_m = -(-int(context_size) // block_m)
    return IndexPlan(batch, heads, num_m, block_m, block_n, w_s, w_v), q_lens, kv_lens


def build_index(plan, seqlens, kv_seqlens, v_sorted, s_sorted, head0=0, heads=None,
                zero_fill=True):
    """Launch the index kernel for heads ``[head0, head0 + heads)`` (CuPy arrays).

    ``v_sorted``/``s_sorted`` are int32 ``[B, H, n]`` with ascending rows. Returns
    ``(block_count, block_offset, column_count, column_index)`` shaped ``[B, heads, M]`` and
    ``[B, heads, M, W]``; list entries past the counts are 0 with ``zero_fill``, else unset.
    """
    import cupy
    heads = plan.heads if heads is None else heads
    alloc = cupy.zeros if zero_fill else cupy.empty
    rows = (plan.batch, heads, plan.num_m)
    bc, cc = cupy.empty(rows, np.int32), cupy.empty(rows, np.int32)
    bo = alloc(rows + (plan.w_s,), np.int32)
    ci = alloc(rows + (plan.w_v,), np.int32)
    total = plan.batch * heads * plan.num_m
    if total == 0:
        return bc, bo, cc, ci
    nv, ns = v_sorted.shape[2], s_sorted.shape[2]
    kern = kernels.kernel("sparse_index", kernels.INDEX_EXPR)
    kern((-(-total // 128),), (128,),
         (seqlens, kv_seqlens, v_sorted, np.int64(plan.heads * nv), np.int32(nv), s_sorted,
          np.int64(plan.heads * ns), np.int32(ns), np.int32(head0), np.int32(plan.batch),
          np.int32(heads), np.int32(plan.num_m), np.int32(plan.block_m), np.int32(plan.block_n),
          bc, bo, np.int32(plan.w_s), cc, ci, np.int32(plan.w_v)))
    return bc, bo, cc, ci


@accepts_dlpack
def vertical_slash_index(seqlens, v_idx, s_idx, context_size, block_m=64, block_n=64, *,
                         kv_seqlens=None):
    """MInference's index conversion: vertical+slash indices to block and column lists.

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
        On wrong shapes, dtypes, negative indices, or lengths that do not fit.
    """
    xp = array_module(seqlens, v_idx, s_idx, kv_seqlens)
    plan, q_lens, kv_lens = plan_index(seqlens, v_idx, s_idx, context_size, block_m, block_n,
                                       kv_seqlens, xp)
    if xp is np:
        bc, bo, cc, ci = ref.vertical_slash_index(q_lens, v_idx, s_idx, context_size, plan.block_m,
                                                  plan.block_n, kv_seqlens=kv_lens)
        return bc, bo, cc, ci
    kv_d = seqlens if kv_seqlens is None else kv_seqlens
    return build_index(plan, seqlens, kv_d, xp.sort(v_idx, axis=-1), xp.sort(s_idx, axis=-1))


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
