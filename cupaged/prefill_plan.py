"""Host-side planning for the prefill kernels: argument checks, tile work lists, strides.

Nothing here launches a kernel. The work list is what one launch of
``kernels_cu/prefill.cu`` computes: one item per (sequence, kv head, tile of ``BLOCK_M``
packed rows), where packed row ``r`` of a sequence is query ``r // group`` of query head
``kv_head * group + r % group`` (``group = num_q_heads // num_kv_heads``), sorted by
estimated cost, longest first, so the tail of a launch is made of short items.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._arrays import check_array, check_choice, float32, is_cupy
from ._checks import check_cu_seqlens, check_gqa, check_query
from .layouts import LAYOUTS

BLOCK_M = 128  # packed rows per work item: MmaConfig<D, MT>::BLOCK_M in kernels_cu/prefill.cu
INT32_MAX = np.iinfo(np.int32).max


def m_tiles(head_dim):
    """Default 16-row m-tiles per warp of the tensor-core kernel (template MT): 2 (each K/V
    fragment feeds two m-tiles, 4 warps, 2 CTAs per SM) up to head size 128, else 1."""
    return 2 if head_dim <= 128 else 1


def threads(dtype, head_dim, mt):
    """Block size of a launch: 8 warps of 16 rows for MT 1 and fp32, 4 warps for MT 2."""
    return 256 if np.dtype(dtype) == float32 else 256 // mt


def block_n(head_dim, mt):
    """Keys per K/V tile of the tensor-core kernel (MmaConfig<D, MT>::BLOCK_N)."""
    return 32 if (mt == 2 and head_dim > 64) or head_dim > 128 else 64


def smem_bytes(dtype, head_dim, v_transposed, mt):
    """Dynamic shared memory of one CTA: Q and K tiles ``[rows][D + 8]``, the V tile
    ``[BLOCK_N][D + 8]`` or, transposed (vllm values), ``[D][BLOCK_N + 8]``; 0 for fp32."""
    if np.dtype(dtype) == float32:
        return 0
    bn, ld = block_n(head_dim, mt), head_dim + 8
    v_elems = head_dim * (bn + 8) if v_transposed else bn * ld
    return 2 * ((BLOCK_M + bn) * ld + v_elems)


# ----------------------------------------------------------------------------- work list
def work_list(q_lens, kv_lens, *, group, num_kv_heads, head_dim, causal, window_left):
    """Tile work items of a batch, longest first.

    Parameters
    ----------
    q_lens, kv_lens : numpy.ndarray
        int ``[B]`` query and key counts per sequence (0 allowed).
    group : int
        Query heads per kv head.
    num_kv_heads, head_dim : int
    causal : bool
    window_left : int
        ``-1`` for no window.

    Returns
    -------
    numpy.ndarray
        int32 ``[num_items, 4]``: (sequence, kv head, first packed row, 0).
    """
    q_lens = np.asarray(q_lens, dtype=np.int64)
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    rows = q_lens * group
    tiles = -(-rows // BLOCK_M)
    seq = np.repeat(np.arange(len(q_lens)), tiles)
    first_tile = np.cumsum(tiles) - tiles
    row0 = (np.arange(len(seq)) - first_tile[seq]) * BLOCK_M
    row_last = np.minimum(row0 + BLOCK_M, rows[seq]) - 1
    shift = kv_lens[seq] - q_lens[seq]
    p_first, p_last = shift + row0 // group, shift + row_last // group
    j_begin = np.maximum(0, p_first - window_left) if window_left >= 0 else np.zeros_like(p_first)
    j_end = np.minimum(kv_lens[seq], p_last + 1) if causal else kv_lens[seq]
    bn = block_n(head_dim, m_tiles(head_dim))
    n_tiles = np.where(j_end > j_begin, (j_end - 1) // bn - j_begin // bn + 1, 0)
    order = np.argsort(-(n_tiles + 1), kind="stable")
    items = np.zeros((len(order) * num_kv_heads, 4), dtype=np.int32)
    items[:, 0] = np.repeat(seq[order], num_kv_heads)
    items[:, 1] = np.tile(np.arange(num_kv_heads), len(order))
    items[:, 2] = np.repeat(row0[order], num_kv_heads)
    return items


# ----------------------------------------------------------------------------- strides
class KVStrides(NamedTuple):
    """Element strides locating K/V elements for the kernel (see kernels_cu/prefill.cu)."""
    k_block: int
    k_head: int
    k_chunk: int
    k_tok: int
    v_block: int
    v_head: int
    v_dim: int
    v_tok: int


def kv_strides(layout, block_size, num_kv_heads, head_dim, dtype):
    """Strides for ``layout`` in ``("ragged",) + LAYOUTS`` (ragged: ``[tokens, Hk, D]``)."""
    x = 16 // np.dtype(dtype).itemsize
    hd = num_kv_heads * head_dim
    if layout == "ragged":
        return KVStrides(0, head_dim, x, hd, 0, head_dim, 1, hd)
    if layout == "NHD":
        return KVStrides(block_size * hd, head_dim, x, hd, block_size * hd, head_dim, 1, hd)
    if layout == "HND":
        s = (block_size * hd, block_size * head_dim)
        return KVStrides(*s, x, head_dim, *s, 1, head_dim)
    s = (block_size * hd, block_size * head_dim)  # vllm
    return KVStrides(*s, block_size * x, x, *s, block_size, 1)


# ----------------------------------------------------------------------------- checks
def check_flag(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {value!r}")
    return bool(value)


def check_max_seqlen(name, value, lengths):
    """``max_seqlen_q/k`` are optional hints; when given they must bound the lengths."""
    if value is None:
        return
    actual = int(lengths.max()) if len(lengths) else 0
    if not isinstance(value, (int, np.integer)) or value < actual:
        raise ValueError(f"{name}: expected an int >= the longest sequence ({actual}), got {value!r}")


def check_aligned(**arrays):
    """Device arrays are read with 16-byte vector loads: their base must be 16-byte aligned."""
    for name, a in arrays.items():
        if a is not None and is_cupy(a) and a.size and a.data.ptr % 16:
            raise ValueError(f"{name}: expected a 16-byte aligned device pointer, "
                             f"got address {a.data.ptr:#x}")


def check_ragged(q, k, v, cu_seqlens_q, cu_seqlens_k, xp):
    """Validate varlen_prefill's arrays; return host (cu_q, cu_k) copies."""
    _, num_q_heads, head_dim = check_query("q", q, xp)
    check_array("k", k, shape=(None, None, head_dim), dtypes=q.dtype, xp=xp)
    check_array("v", v, shape=tuple(k.shape), dtypes=q.dtype, xp=xp)
    check_gqa(num_q_heads, k.shape[1], "k")
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, xp, total=q.shape[0])
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, xp, total=k.shape[0])
    if cu_k.shape != cu_q.shape:
        raise ValueError(f"cu_seqlens_k: expected shape {tuple(cu_q.shape)} like cu_seqlens_q "
                         f"(one entry per sequence + 1), got {tuple(cu_k.shape)}")
    return cu_q, cu_k


def check_paged_query(q, geometry, cache_dtype, xp):
    """q against a cache: same dtype, same head size, GQA group."""
    _, num_q_heads, head_dim = check_query("q", q, xp)
    if q.dtype != cache_dtype:
        raise TypeError(f"k_cache: expected dtype {q.dtype} like q, got {cache_dtype}")
    if geometry.head_dim != head_dim:
        raise ValueError(f"k_cache: expected head size {head_dim} like q, got {geometry.head_dim}")
    check_gqa(num_q_heads, geometry.num_kv_heads, "k_cache")


def check_layout(layout):
    check_choice("layout", layout, LAYOUTS)
    return layout
