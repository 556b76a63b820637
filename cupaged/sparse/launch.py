"""Kernel specialisations of the sparse ops and the launch details they share.

Sources: ``kernels_cu/sparse_estimate.cu`` (pattern estimate), ``sparse_index.cu`` (index
preparation, MInference's index conversion and the attention kernel's tile lists, walks in
``sparse_plan.cuh``), ``sparse_attention.cu`` (block-sparse attention on the mma.sync tile
core of ``attn_tile.cuh``, shared with the dense prefill kernel), ``sparse_sm90.cu`` (the
same on sm_90a: the warp-specialised wgmma loop of ``prefill_sm90.cu``), both walking the
tile sources of ``sparse_source.cuh``; ``sparse_tile.cuh`` holds the estimate's K tile gather
and Q.K^T tile. Kernels take fp16 or bf16 and every head size of ``HEAD_DIMS``.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from ..core import abi, tma
from ..core.arrays import HEAD_DIMS, bfloat16, float16
from ..core.layouts import key_geometry, layout_strides
from ..core.compile import Spec, ctype, launcher
from ..core.errors import error_word
from ..core.launch import ptr
from ..prefill import plan as prefill_plan
from ..prefill.plan import TileShape

KERNEL_DTYPES = (float16, bfloat16)
# the sparse kernels' geometry (the generated abi.cuh: cpp())
ROWS = KEYS = 64             # estimate: query rows and keys per tile; pattern halves of 64 rows
CTA_ROWS = 128               # attention: query rows per CTA (two 64-row halves)
MAX_CTA_ROWS = 65535         # grid.y of the attention kernels
THREADS = 128                # the estimate's and the index kernels' block (4 warps)
PREP_THREADS = 256           # vs_prepare's and bsr_prepare's block
EST_MAX_TILES = 16           # key tiles per estimate CTA
PREPARE_EXPR = "cupaged::vs_prepare"
INDEX_EXPR = "cupaged::vs_index_kernel"
VS_PLAN_EXPR = "cupaged::vs_plan_kernel"
BSR_PREPARE_EXPR = "cupaged::bsr_prepare"
INDEX_EXPRS = (PREPARE_EXPR, INDEX_EXPR, VS_PLAN_EXPR, BSR_PREPARE_EXPR)
TOP_EXPR = f"cupaged::vs_top_kernel<{PREP_THREADS}>"   # the estimate's top k (sparse_estimate.cu)


def cpp() -> str:
    """C++ of the sparse kernels' constants for the generated ``abi.cuh``."""
    return abi.constants(None, dict(SP_THREADS=THREADS, SP_ROWS=ROWS, SP_KEYS=KEYS,
                                    HALF_ROWS=ROWS, PREP_THREADS=PREP_THREADS,
                                    EST_MAX_TILES=EST_MAX_TILES))


def attention_tile(head_dim, rows=CTA_ROWS):
    """Tile of ``sparse_attention``: the dense kernel's 4 warps x 32 rows, 64-key tiles, two
    stages, 2 CTAs per SM up to d128; 8 warps x 16 rows and 32-key tiles at d256 (two stages
    within an A100's shared memory). ``rows`` 64 (``bsr_attention`` only): one 64-row half,
    4 warps x 16 rows."""
    if rows == ROWS:
        return TileShape(4, 1, 32 if head_dim == 256 else 64, 2, False, 2)
    if head_dim == 256:
        return TileShape(8, 1, 32, 2, False, 1)
    return TileShape(4, 2, 64, 2, False, 2)


def attention_expr(dtype, head_dim, kernel="sparse_attention", rows=CTA_ROWS, general=False,
                   wgmma=False, use_tma=False):
    """``kernel``: ``"sparse_attention"`` (tile lists) or ``"bsr_attention"`` (batched BSR);
    ``general``: scores through the score epilogue (:func:`general_scores`); ``wgmma``: the
    sm_90a kernel of ``sparse_sm90.cu`` (128 rows a CTA), ``use_tma`` its TMA form."""
    flag = "true" if general else "false"
    if wgmma:
        name = (WS_TMA_KERNELS if use_tma else WS_KERNELS)[kernel]
        return (f"cupaged::{name}<{ctype(dtype)}, {head_dim}, {ws_tile_n(head_dim, kernel)}, "
                f"{ws_stages(head_dim)}, {flag}, {prefill_plan.ws_producer_regs(head_dim)}>")
    tile = attention_tile(head_dim, rows)
    return f"cupaged::{kernel}<{ctype(dtype)}, {head_dim}, {tile.cpp()}, {flag}>"


BACKENDS = prefill_plan.BACKENDS   # the attention ops' kernel choice, as the dense prefill's
# the wgmma kernels (sparse_sm90.cu): CTAs of CTA_ROWS rows, a producer and two consumer
# warpgroups (prefill.plan.WS_THREADS; the producer's registers as the dense kernel's),
# tiles of ws_tile_n keys, three K/V stages (two at d256: shared memory)
WS_KERNELS = {"sparse_attention": "sparse_ws_kernel", "bsr_attention": "bsr_ws_kernel"}
# over dense rows of these head sizes, whole tiles of contiguous keys by TMA (core.tma)
WS_TMA_KERNELS = {"sparse_attention": "sparse_ws_tma_kernel", "bsr_attention": "bsr_ws_tma_kernel"}
WS_TMA_HEAD_DIMS = tma.HEAD_DIMS


def ws_stages(head_dim):
    return 2 if head_dim > 128 else 3


def ws_tile_n(head_dim, kind="sparse_attention"):
    """Keys a tile of the wgmma kernels of ``kind``: 128 up to d128 for vertical+slash (the
    dense kernel's), 64 at d256 and for BSR (a block of 64 keys a whole tile: one TMA box
    over dense rows, every key computed, where 128-key tiles of scattered blocks are half
    empty and copied by cp.async)."""
    return 64 if head_dim > 128 or kind == "bsr_attention" else 128


def ws_smem(head_dim, kind="sparse_attention"):
    """Dynamic shared memory of the wgmma kernels of ``kind``: Q ``[128][D]``, the stages'
    K and V tiles ``[tile_n][D]`` (16-bit), the mbarriers (Q, per stage K and V full and
    empty), per stage an 8-byte descriptor slot and its tile's keys (an int a row), and 1024
    bytes to align the swizzled tiles."""
    stages, tile_n = ws_stages(head_dim), ws_tile_n(head_dim, kind)
    barriers = 8 * (1 + 4 * stages)
    return (2 * (CTA_ROWS + 2 * stages * tile_n) * head_dim + barriers + stages * (8 + 4 * tile_n)
            + 1024)


def use_wgmma(backend, kind, head_dim, ragged):
    """Whether a CuPy call of ``kind`` asking for ``backend`` (``"auto"``, ``"mma"``,
    ``"wgmma"``) runs the wgmma kernels ("wgmma" off sm_90 is refused). "auto" takes them on
    an sm_90 device where they measured faster than the mma.sync kernel (benchmarks/NOTES.md):
    vertical+slash and BSR over dense K/V rows of :data:`WS_TMA_HEAD_DIMS` (whole tiles by
    TMA; BSR on 64-key tiles). Not paged caches or other head sizes (every tile by cp.async,
    whose issue rate, not the tensor cores, sets the pace)."""
    import cupy
    arch = cupy.cuda.Device().compute_capability
    if prefill_plan.resolve_backend(backend, None, arch) != "wgmma":
        return False
    return backend == "wgmma" or (ragged and head_dim in WS_TMA_HEAD_DIMS)


class AttentionLaunch(NamedTuple):
    """An attention kernel with its block and dynamic shared memory; ``tma``: it takes the
    tensor maps of the call's dense K/V rows (:data:`WS_TMA_KERNELS`)."""
    kernel: object
    threads: int
    smem: int
    tile_n: int           # keys a tile (the tile lists' tile_n)
    tma: bool = False

    def __call__(self, grid, kv, **fields):
        """Launch over ``kv`` (:class:`KVSource`, its ``fields()`` given in ``fields``)."""
        if self.tma:
            maps = _dense_maps(kv.k.shape, kv.k.itemsize, self.tile_n)
            fields["k_map"], fields["v_map"] = maps(ptr(kv.k), ptr(kv.v))
        self.kernel(grid, self.threads, self.smem, **fields)


@functools.lru_cache(maxsize=64)
def _dense_maps(shape, itemsize, tile_n):
    """The :class:`cupaged.core.tma.KVMaps` of packed ``[total_k, Hk, D]`` K/V rows (one
    per call shape: the maps themselves are cached per address by ``tma.encode``)."""
    total_k, hk, d = shape
    return tma.KVMaps(hk, d, layout_strides("ragged", 1, hk, d, itemsize), tile_n, total_k)


def attention_launch(dtype, head_dim, kind="sparse_attention", rows=CTA_ROWS, general=False,
                     wgmma=False, ragged=False):
    """The :class:`AttentionLaunch` of ``kind`` (``"sparse_attention"``: tile lists,
    ``"bsr_attention"``: batched BSR) on the mma.sync kernel (``rows`` 128 or 64 query rows
    a CTA) or, with ``wgmma``, on the sm_90a kernel (128 rows; over ``ragged`` K/V rows of
    :data:`WS_TMA_HEAD_DIMS`, its TMA form)."""
    if wgmma:
        use_tma = ragged and head_dim in WS_TMA_HEAD_DIMS
        expr = attention_expr(dtype, head_dim, kind, CTA_ROWS, general, True, use_tma)
        record = abi.SPARSE_TMA if use_tma else abi.SPARSE
        smem = ws_smem(head_dim, kind)
        return AttentionLaunch(launcher("sparse_sm90", expr, record, hopper=True, smem=smem),
                               prefill_plan.WS_THREADS, smem, ws_tile_n(head_dim, kind), use_tma)
    tile = attention_tile(head_dim, rows)
    return AttentionLaunch(attention_kernel(dtype, head_dim, kind, rows, general), tile.threads,
                           attention_smem(head_dim, rows), tile.block_n)


def general_scores(opts):
    """Whether a call needs the attention kernels' general path: ``window_left``, or scores
    through ``score.cuh``'s epilogue (soft-cap, ALiBi, a scale that is not positive). The
    plain path masks causally and folds the scale into the exponential."""
    return (not opts.sm_scale > 0 or opts.logits_soft_cap > 0 or opts.alibi_slopes is not None
            or opts.window_left >= 0)


def estimate_expr(dtype, head_dim):
    return f"cupaged::vs_estimate<{ctype(dtype)}, {head_dim}>"


def attention_smem(head_dim, rows=CTA_ROWS):
    """Dynamic shared memory of ``sparse_attention``: Q [rows][D + 8], two K and two V
    stages [block_n][D + 8] (16-bit elements), bytes."""
    ld = head_dim + 8
    return 2 * (rows * ld + 4 * attention_tile(head_dim, rows).block_n * ld)


def estimate_smem(head_dim):
    """Dynamic shared memory of ``vs_estimate``: Q tile and two K tiles, bytes."""
    return (ROWS + 2 * KEYS) * (head_dim + 8) * 2


class KVSource(NamedTuple):
    """Kernel arguments locating keys and values: dense packed rows or a paged cache."""
    k: object
    v: object
    cu_k: object          # int32 [B + 1] dense row starts, or None
    table: object         # int32 block tables, or None
    table_stride: int
    page_size: int
    page_stride: int      # elements
    tok_stride: int
    head_stride: int

    def fields(self):
        """Their ``abi.SPARSE`` fields."""
        return dict(k=ptr(self.k), v=ptr(self.v), cu_k=ptr(self.cu_k),
                    block_tables=ptr(self.table), table_stride=self.table_stride,
                    page_size=self.page_size, page_stride=self.page_stride,
                    tok_stride=self.tok_stride, head_stride=self.head_stride)


def dense_kv(k, v, cu_k=None):
    """Source of packed ``[tokens, Hk, D]`` keys and values."""
    _, hk, d = k.shape
    s = layout_strides("ragged", 1, hk, d, k.itemsize)
    return KVSource(k, v, cu_k, None, 0, 1, 0, s.k_tok, s.k_head)


def paged_kv(k_cache, v_cache, block_tables, layout):
    """Source of an ``"NHD"`` or ``"HND"`` paged cache (dense blocks; K and V of the same
    strides); ``block_tables`` 1-D or 2-D."""
    geo = key_geometry(k_cache, layout)
    s = layout_strides(layout, *geo[1:], k_cache.itemsize)
    stride = block_tables.shape[-1] if block_tables.ndim == 2 else 0
    return KVSource(k_cache, v_cache, None, block_tables, stride, geo.block_size, s.k_block,
                    s.k_tok, s.k_head)


def kernel_specializations():
    """Every sparse kernel the library can launch: the index kernels, estimate and
    attention per dtype (fp16, bf16) and head size, and Quest's (``sparse.quest``)."""
    from . import quest
    specs = ([Spec("sparse_index", e) for e in INDEX_EXPRS] + [Spec("sparse_estimate", TOP_EXPR)]
             + quest.kernel_specializations())
    for dtype in KERNEL_DTYPES:
        for d in HEAD_DIMS:
            specs.append(Spec("sparse_estimate", estimate_expr(dtype, d)))
            for general in (False, True):
                specs.append(Spec("sparse_attention", attention_expr(dtype, d, general=general)))
                for rows in (CTA_ROWS, ROWS):
                    specs.append(Spec("sparse_attention", attention_expr(
                        dtype, d, "bsr_attention", rows, general)))
                specs += [Spec("sparse_sm90", attention_expr(dtype, d, kind, CTA_ROWS, general,
                                                             True, use_tma), hopper=True)
                          for kind in WS_KERNELS
                          for use_tma in (False, True)[:1 + (d in WS_TMA_HEAD_DIMS)]]
    return specs


def common_fields(q, out, lse, kv, num_kv_heads, opts, causal):
    """The ``abi.SPARSE`` fields every attention launch sets: arrays, K/V source, scale."""
    from ..core.checks import token_stride
    return dict(q=ptr(q), out=ptr(out), lse=ptr(lse), q_tok=token_stride("q", q),
                num_q_heads=q.shape[1], group=q.shape[1] // num_kv_heads, causal=int(causal),
                scale_log2=opts.sm_scale * abi.LOG2E, sm_scale=opts.sm_scale,
                window_left=opts.window_left, soft_cap=opts.logits_soft_cap,
                alibi=ptr(opts.alibi_slopes), sinks=ptr(opts.sinks), **kv.fields())


class Schedule(NamedTuple):
    """``bsr_prepare``'s output: the device schedule ``meta`` of ``cta_bound`` CTA map
    entries, and the error word it reports to."""
    meta: object
    cta_bound: int
    err: object


def schedule(q, out, lse, cu_q, kv, seq_lens, total_k, rows, indptr=None, nnz=0, block_m=None,
             pattern_heads=1):
    """``bsr_prepare`` (``abi.BSR_PREPARE``) of a batched attention launch: device lengths
    and block tables checked, a CTA map entry per ``rows`` query rows (at most
    ``ceil(total_q / rows) + B``, the grid bound), padding rows zeroed; with a BSR
    ``indptr`` (``block_m``-row CSR rows of ``pattern_heads`` heads) also its frame. No host
    read.

    ``kv``: :class:`KVSource`; ``seq_lens``: the paged key counts, or None (dense rows of
    ``kv.cu_k``, ``total_k`` of them).
    """
    import cupy
    batch, (total_q, hq, d) = cu_q.shape[0] - 1, q.shape
    cta_bound = -(-total_q // rows) + batch
    if cta_bound > MAX_CTA_ROWS:
        raise ValueError(f"q: the CUDA kernel takes at most {MAX_CTA_ROWS} CTA rows "
                         f"(ceil(total_q / {rows}) + batch), got {cta_bound}")
    meta = cupy.empty(bsr_meta_size(batch, cta_bound), np.int32)
    err = error_word()
    paged = kv.table is not None
    prep = launcher("sparse_index", BSR_PREPARE_EXPR, abi.BSR_PREPARE)
    prep(1, PREP_THREADS, cu_q=ptr(cu_q), cu_k=ptr(kv.cu_k), seq_lens=ptr(seq_lens),
         block_tables=ptr(kv.table), indptr=ptr(indptr), meta=ptr(meta), err=ptr(err),
         out=ptr(out), lse=ptr(lse), row_bytes=hq * d * q.itemsize, batch=batch,
         total_q=total_q, total_k=total_k, table_stride=kv.table_stride,
         page_size=kv.page_size, table_width=kv.table.shape[1] if paged else 0,
         num_blocks=kv.k.shape[0] if paged else 0, num_q_heads=hq, cta_rows=rows,
         pattern_heads=pattern_heads, block_m=block_m or rows,
         indptr_len=0 if indptr is None else indptr.shape[0], nnz=nnz, cta_bound=cta_bound)
    return Schedule(meta, cta_bound, err)


def bsr_meta_size(batch, cta_bound):
    """int32 words of ``bsr_prepare``'s schedule: int4 per sequence and one for the pattern,
    then the CTA map (``abi.BSR_PREPARE``)."""
    return 4 * (batch + 1) + cta_bound


def attention_kernel(dtype, head_dim, kind="sparse_attention", rows=CTA_ROWS, general=False):
    """The :class:`cupaged.core.launch.Kernel` of ``sparse_attention.cu`` (``kind``: tile
    lists or ``"bsr_attention"``; ``rows`` query rows per CTA; ``general``: the score
    epilogue's path), its shared memory reserved; arguments ``abi.SPARSE``."""
    return launcher("sparse_attention", attention_expr(dtype, head_dim, kind, rows, general),
                    abi.SPARSE, smem=attention_smem(head_dim, rows), carveout=True)


def kernel(stem, expr, record, smem=0):
    """The :class:`cupaged.core.launch.Kernel` of ``expr`` (arguments: ``record``), allowed
    ``smem`` bytes of dynamic shared memory (carveout at its maximum: two CTAs per SM where
    they fit)."""
    return launcher(stem, expr, record, smem=smem, carveout=True)
