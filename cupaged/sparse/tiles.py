"""Tile lists of the vertical+slash attention kernel, built on the device, sized on the host.

Each CTA of ``kernels_cu/sparse_attention.cu`` computes two 64-row query tiles (halves) of one
head over a list of K/V tiles: contiguous keys of the union of the halves' key blocks, then
the halves' vertical columns gathered from the head's vertical row, each tile flagged with
the halves whose pattern holds it (encoding in ``sparse_plan.cuh``). ``vs_plan_kernel``
(``sparse_index.cu``) writes every CTA's list into a slot of :func:`list_bound` tiles and
its length beside it; the CTAs are those of ``bsr_prepare``'s schedule (a CTA map entry per
128 query rows, ``ceil(total_q / 128) + B`` entries at most). Nothing is read back: the slot
length and the head groups (consecutive query heads whose slots fit ``LIST_BUDGET`` bytes,
one list launch and one attention launch each, the buffers reused) follow from shapes.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core import abi
from ..core.launch import ptr as address
from . import launch as kernels

LIST_BUDGET = 1 << 30        # bytes of tile-list slots per head group
TILE_BYTES = 8               # int2 per tile
TILE_A, TILE_B, TILE_GATHER, TILE_WIDTH = 1 << 8, 2 << 8, 4 << 8, 0xFF  # a tile's flags (cpp())


def cpp() -> str:
    """C++ of the tile-list flags for the generated ``abi.cuh`` (``sparse_plan.cuh``)."""
    return abi.constants(None, dict(TILE_A=TILE_A, TILE_B=TILE_B, TILE_GATHER=TILE_GATHER,
                                    TILE_WIDTH=TILE_WIDTH))


def list_bound(max_kv, nv, ns, block_m, tile_n):
    """Most tiles in one CTA's list (``vs_cta_tiles``), from shapes alone.

    Each half's merged key ranges lie in ``[0, max_kv)``, are disjoint and apart, and all
    but the last hold at least ``block_m`` keys; a slash opens at most one: ``R <= min(ns,
    ceil(max_kv / (block_m + 1)))`` ranges a half. The sweep of the two halves cuts their
    union at the ``<= 4R`` range ends into ``P < 4R`` pieces; a piece of ``n`` keys is
    ``ceil(n / tile_n)`` tiles, so the key tiles number at most ``ceil(max_kv / tile_n) +
    4R``, which also holds a dense row's ``ceil(clip / tile_n)`` tiles.
    Likewise the halves' gaps (``<= R + 1`` each) cut the ``<= nv`` unique verticals into
    ``<= 4R + 3`` pieces: at most ``min(nv, nv // tile_n + 4R + 3)`` column tiles.

    Parameters
    ----------
    max_kv : int
        Keys of the longest sequence, or a bound of it (the packed keys, a block table's
        width times its page size).
    nv, ns : int
        Widths of the vertical and slash rows (padding included).
    block_m, tile_n : int
        Pattern block rows (a multiple of 64) and keys per K/V tile of the kernel.

    Returns
    -------
    int
        Tiles per list slot, ``>= 1``.
    """
    ranges = min(ns, (max_kv + block_m) // (block_m + 1))
    keys = -(-max_kv // tile_n) + 4 * ranges
    return max(1, keys + min(nv, nv // tile_n + 4 * ranges + 3))


def head_groups(heads, slot_bytes, budget):
    """Consecutive groups of ``heads`` query heads, ``(head0, count)`` each: as many heads a
    group as ``budget`` bytes of ``slot_bytes`` each hold, at least one."""
    per = max(1, int(budget) // max(int(slot_bytes), 1))
    return [(h0, min(per, heads - h0)) for h0 in range(0, heads, per)]


class TileLists(NamedTuple):
    """Kernel arguments of one head group's tile lists (see ``sparse_attention.cu``)."""
    counts: object       # int32 [heads * cta_bound] tiles of each list
    tiles: object        # int2 (int32 [.., 2]) [heads * cta_bound * cap]
    head0: int           # first query head of the group
    heads: int           # query heads of the group
    cap: int             # tiles per list slot (list_bound)
    cols: object         # int32 [B, Hq, nv] unique vertical rows
    cols_heads: int
    cols_width: int

    def fields(self):
        """Their ``abi.SPARSE`` fields."""
        return dict(head0=self.head0, list_counts=address(self.counts), list_cap=self.cap,
                    tiles=address(self.tiles),
                    cols=address(self.cols), cols_heads=self.cols_heads,
                    cols_width=self.cols_width)


def vs_lists(prep, dense, meta, batch, cta_bound, max_kv, block_n, tile_n, budget=None):
    """Yield the vertical+slash tile lists of ``prep`` (``index.Prepared``) per head group.

    Parameters
    ----------
    prep : index.Prepared
        Device rows ``[B, Hq, n]`` (``block_m`` is ``prep.block_m``, a multiple of 64).
    dense : cupy.ndarray or None
        int32 ``[B, Hq]`` rows that run dense (``index.prepare``'s decision): their lists
        are the dense kernel's tile sequence.
    meta : cupy.ndarray
        int32 schedule of ``bsr_prepare`` (``launch.bsr_meta_size(batch, cta_bound)``).
    batch, cta_bound, max_kv : int
        Sequences, CTA map entries and the host bound of keys (:func:`list_bound`).
    block_n, tile_n : int
        Pattern key block, keys per K/V tile of the kernel.
    budget : int, optional
        Bytes of list slots a group (default :data:`LIST_BUDGET`).

    Yields
    ------
    TileLists
        One group's lists, written on the device before the next group's overwrite them
        (one stream: a group's attention launch runs before the next list launch).
    """
    import cupy
    heads = prep.s.shape[1]
    nv, ns = prep.v.shape[2], prep.s.shape[2]
    cap = list_bound(max_kv, nv, ns, prep.block_m, tile_n)
    groups = head_groups(heads, cta_bound * cap * TILE_BYTES,
                         LIST_BUDGET if budget is None else budget)
    slots = groups[0][1] * cta_bound if groups else 0
    counts = cupy.empty(max(slots, 1), np.int32)
    tiles = cupy.empty((max(slots * cap, 1), 2), np.int32)
    kern = kernels.kernel("sparse_index", kernels.VS_PLAN_EXPR, abi.VS_PLAN)
    for h0, hs in groups:
        n = hs * cta_bound
        kern(-(-n // (kernels.THREADS // 32)), kernels.THREADS, meta=address(meta),
             s_sorted=address(prep.s), run_first=address(prep.run_first), ns=ns,
             v_unique=address(prep.v), v_count=address(prep.v_count), nv=nv,
             dense=address(dense), batch=batch, total_heads=heads, head0=h0, heads=hs,
             cta_bound=cta_bound, bm=prep.block_m, bn=block_n, tile_n=tile_n, cap=cap,
             counts=address(counts), tiles=address(tiles))
        yield TileLists(counts, tiles, h0, hs, cap, prep.v, heads, nv)


def computed_pairs(lists, cta_bound):
    """(query, key) pairs the kernel computes over a group's lists: per tile, its width
    times 64 rows per half it is flagged for (whole tiles, the masked part of diagonal tiles
    included). Benchmarks only (syncs)."""
    n = lists.counts.get()[:lists.heads * cta_bound]
    t = lists.tiles.get().reshape(-1, lists.cap, 2)[:len(n), :, 1]
    held = np.arange(lists.cap)[None, :] < n[:, None]
    wf = t[held]
    halves = ((wf & TILE_A) != 0).astype(np.int64) + ((wf & TILE_B) != 0)
    return int(((wf & TILE_WIDTH) * halves).sum()) * 64
