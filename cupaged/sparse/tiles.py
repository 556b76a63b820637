"""Tile lists of the sparse attention kernel, built on the device.

Each CTA of ``kernels_cu/sparse_attention.cu`` computes two 64-row query tiles (halves) of one
head over a list of K/V tiles: contiguous keys of the union of the halves' key blocks, then
the halves' vertical columns gathered from the head's vertical row, each tile flagged with
the halves whose pattern holds it (encoding in ``sparse_plan.cuh``). ``sparse_index.cu``
builds the lists: a counting launch over every head, a prefix sum, and a writing launch per
group of heads whose lists fit ``LIST_BUDGET`` bytes. Nothing here syncs with the device
except reading the list sizes.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core.launch import ptr as address
from . import launch as kernels

LIST_BUDGET = 1 << 30        # bytes of tile lists per launch group
TILE_BYTES = 8               # int2 per tile
TILE_A, TILE_B, TILE_GATHER, TILE_WIDTH = 1 << 8, 2 << 8, 4 << 8, 0xFF


class TileLists(NamedTuple):
    """Kernel arguments of one attention launch's tile lists (see ``sparse_attention.cu``)."""
    ptr: object          # int64 [plans + 1] list offsets into tiles
    tiles: object        # int32 [total, 2]
    head0: int           # first query head of the launch
    heads: int           # query heads of the launch
    plan_heads: int      # lists per (sequence, CTA row): heads, or 1 when shared by every head
    num_c: int           # CTA rows per sequence: ceil(max q_len / 128)
    cols: object         # int32 [B, H, nv] unique vertical rows
    cols_heads: int
    cols_width: int

    def fields(self):
        """Their ``abi.SPARSE`` fields."""
        return dict(head0=self.head0, plan_heads=self.plan_heads, num_c=self.num_c,
                    plan_ptr=address(self.ptr), tiles=address(self.tiles), cols=address(self.cols),
                    cols_heads=self.cols_heads, cols_width=self.cols_width)


def num_ctas(max_q):
    """CTA rows per sequence: 128 query rows each."""
    return -(-int(max_q) // kernels.CTA_ROWS)


def _offsets(counts):
    """int64 ``[n + 1]`` exclusive prefix sums of ``counts`` (device) and their total (host)."""
    import cupy
    ptr = cupy.zeros(counts.size + 1, np.int64)
    if counts.size == 0:
        return ptr, 0
    cupy.cumsum(counts.ravel(), out=ptr[1:])
    return ptr, int(ptr[-1])


def head_groups(per_head, budget=LIST_BUDGET):
    """Split heads into consecutive groups whose tile lists fit ``budget`` bytes each.

    ``per_head``: host int tile counts per head. Returns ``[(head0, heads), ...]``.
    """
    groups, h0, size = [], 0, 0
    for h, n in enumerate(per_head):
        n = int(n) * TILE_BYTES
        if h > h0 and size + n > budget:
            groups.append((h0, h - h0))
            h0, size = h, 0
        size += n
    if len(per_head):
        groups.append((h0, len(per_head) - h0))
    return groups


def vs_lists(prep, cu_q, kv_lens, batch, max_q, block_n, tile_n):
    """Yield the vertical+slash tile lists of ``prep`` (``index.Prepared``) per head group.

    ``cu_q``, ``kv_lens``: device int32 ``[B + 1]`` and ``[B]``; ``block_m`` is
    ``prep.block_m`` (a multiple of 64); ``tile_n``: keys per K/V tile of the kernel.
    """
    import cupy
    heads, nc = prep.s.shape[1], num_ctas(max_q)
    kern = kernels.kernel("sparse_index", kernels.VS_PLAN_EXPR)

    def run(h0, hs, ptr, tiles):
        n = batch * hs * nc
        if n:
            kern((-(-n // 4),), (128,),
                 (cu_q, kv_lens, prep.s, prep.run_first, np.int32(prep.s.shape[2]), prep.v,
                  prep.v_count, np.int32(prep.v.shape[2]), np.int32(batch), np.int32(heads),
                  np.int32(h0), np.int32(hs), np.int32(nc), np.int32(prep.block_m),
                  np.int32(block_n), np.int32(tile_n), ptr, tiles))

    counts = cupy.zeros((batch, heads, nc), np.int64)
    run(0, heads, counts, kernels.NULL)
    for h0, hs in head_groups(counts.sum(axis=(0, 2)).get()):
        ptr, total = _offsets(counts[:, h0:h0 + hs])
        tiles = cupy.empty((max(total, 1), 2), np.int32)
        run(h0, hs, ptr, tiles)
        yield TileLists(ptr, tiles, h0, hs, hs, nc, prep.v, heads, prep.v.shape[2])


def computed_pairs(lists):
    """(query, key) pairs the kernel computes over a launch's lists: per tile, its width
    times 64 rows per half it is flagged for (whole tiles, the masked part of diagonal tiles
    included). Benchmarks only (syncs)."""
    wf = lists.tiles[:int(lists.ptr[-1]), 1]
    halves = ((wf & TILE_A) != 0).astype(np.int64) + ((wf & TILE_B) != 0)
    per_plan = int(((wf & TILE_WIDTH) * halves).sum()) * 64
    return per_plan * (lists.heads if lists.plan_heads == 1 else 1)
