"""Host-side planning for the prefill kernels: argument checks, tile shapes, work lists, strides.

Nothing here launches a kernel. The work list is what one launch of
``kernels_cu/prefill.cu`` computes: one item per (sequence, kv head, tile of ``block_m``
packed rows), where packed row ``r`` of a sequence is query ``r // group`` of query head
``kv_head * group + r % group`` (``group = num_q_heads // num_kv_heads``), sorted by
estimated cost, longest first, so the tail of a launch is made of short items.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core.arrays import check_array, check_choice, float32
from ..core.checks import (INT32_MAX, check_block_elements, check_cu_seqlens, check_gqa,
    check_query, token_stride)
from ..core import abi, tma
from ..core.device import SM90_SMEM_PER_CTA
from ..core.fp8 import KV_DTYPES
from ..core.layouts import LAYOUTS



class TileShape(NamedTuple):
    """Tile shape of the tensor-core kernel (``TileShape`` in kernels_cu/prefill.cu).

    ``warps`` warps of ``m_tiles`` 16-row m-tiles each, ``block_n`` keys per K/V tile,
    ``stages`` K/V buffers (1: FlashAttention-2 order, 2: one tile ahead), ``q_regs``: Q
    fragments held in registers, ``ctas``: CTAs per SM the register budget aims for.
    """
    warps: int
    m_tiles: int
    block_n: int
    stages: int
    q_regs: bool
    ctas: int

    @property
    def block_m(self):
        """Packed query rows per work item (CTA)."""
        return 16 * self.m_tiles * self.warps

    @property
    def threads(self):
        return 32 * self.warps

    @property
    def tma(self):
        """False: this kernel copies K/V tiles with cp.async (the field of the same name on
        the Hopper tile shape)."""
        return False

    def cpp(self):
        """The C++ type naming this shape in a kernel's template arguments."""
        q = "true" if self.q_regs else "false"
        return (f"cupaged::TileShape<{self.warps}, {self.m_tiles}, {self.block_n}, {self.stages}, "
                f"{q}, {self.ctas}>")


# fp32 runs the CUDA-core kernel: 8 warps over 128 packed rows (block_n only sizes the cost)
SIMT_TILE = TileShape(8, 1, 64, 1, False, 1)


def default_tile(head_dim, v_transposed=False):
    """Tensor-core tile used for ``head_dim`` (see benchmarks/NOTES.md for the choice).

    Up to d128: 4 warps x 32 rows, 64-key tiles (128 at d64), two K/V stages, 2 CTAs per
    SM; the vllm value layout at d128 takes 32-key tiles (64 spill registers). d256: 8 warps
    x 16 rows, 64-key tiles, one stage, 1 CTA per SM. The d64 and d256 shapes won the tile
    sweep of benchmarks/NOTES.md (prefill, tile sweep after the rewrite).
    """
    if head_dim == 256:
        return TileShape(8, 1, 64, 1, False, 1)
    if head_dim == 128 and v_transposed:
        return TileShape(4, 2, 32, 2, False, 2)
    return TileShape(4, 2, 128 if head_dim == 64 else 64, 2, False, 2)


def launch_tile(dtype, head_dim, v_transposed=False):
    """The tile a launch of ``dtype`` / ``head_dim`` uses (SIMT_TILE for fp32)."""
    return SIMT_TILE if np.dtype(dtype) == float32 else default_tile(head_dim, v_transposed)


def smem_bytes(dtype, head_dim, v_transposed, tile, kv=None):
    """Dynamic shared memory of one CTA: Q ``[block_m][D + 8]``, then ``stages`` K tiles
    ``[block_n][D + 8]`` and V tiles ``[block_n][D + 8]`` (transposed, vllm values:
    ``[D][block_n + 8]``), then from an fp8 cache (format ``kv``) the staging of one tile
    (:func:`fp8_staging_bytes`); 0 for fp32."""
    if np.dtype(dtype) == float32:
        return 0
    bn, ld = tile.block_n, head_dim + 8
    v_elems = head_dim * (bn + 8) if v_transposed else bn * ld
    staging = 0 if kv is None else fp8_staging_bytes(head_dim, tile.block_n, tile.threads)
    return 2 * (tile.block_m * ld + tile.stages * (bn * ld + v_elems)) + staging


# ----------------------------------------------------------------------------- fp8 caches
# Head sizes the prefill kernels read fp8 caches at (as decode's FP8_HEAD_DIMS).
FP8_HEAD_DIMS = (64, 128)


def fp8_staging_bytes(head_dim, block_n, threads):
    """Shared memory staging one K/V tile of fp8 codes (``KVChunks`` of prefill.cu and
    ``KVRows`` of prefill_sm90.cu): per thread, a 16-byte slot per K row pass and as many
    for V (row passes, or V^T passes of 16 keys a dim, whichever are more)."""
    chunks = head_dim // 16
    row_threads = next(n for n in (4, 8, 16, 32) if chunks <= n)
    row_passes = block_n // (threads // row_threads)
    vt_passes = -(-head_dim // (threads // (block_n // 16)))
    return (row_passes + max(row_passes, vt_passes)) * threads * 16


# ----------------------------------------------------------------------------- wgmma (sm_90a)
# Layouts where "auto" picks the wgmma kernel (kernels_cu/prefill_sm90.cu) on sm_90: every
# one, as it beats mma.sync on each (docs/prefill.md, "Kernel choice"; the vllm cache's
# mma.sync path runs 32-key tiles at d128).
WGMMA_AUTO = ("ragged", "NHD", "HND", "vllm")
BACKENDS = ("auto", "mma", "wgmma")
WGMMA_HEAD_DIMS = (64, 80, 96, 112, 128, 256)


class WgmmaTile(NamedTuple):
    """Tile shape of the wgmma kernels: 128 packed rows per item, ``block_n`` keys per K/V
    tile, ``stages`` K/V buffers, ``ws``: the warp-specialised kernel (``prefill_ws_kernel``:
    a producer warpgroup copying tiles and two consumer warpgroups of 64 rows taking turns at
    the tensor cores, tiles handed over through mbarriers) rather than ``prefill_wgmma_kernel``
    (2 warpgroups of 64 rows that copy and compute, a CTA barrier per tile; ``stages`` 2: each
    wgmma batch waited for at once, 3: the P V batch of one tile overlaps the softmax of the
    next). ``tma`` (with ``ws``; the default where :func:`tma_fits`): the producer copies
    the K/V tiles by TMA (``prefill_ws_tma_kernel``; ragged K/V and NHD / HND caches of
    :data:`TMA_HEAD_DIMS`, :func:`check_tma`); ``slots`` (with ``tma``; an explicit tile,
    ``tma_tile(head_dim, kv=...)``, never a default): from an fp8 cache, the staging slots of
    K or V codes the producer copies by TMA and widens into the 16-bit tiles (0: 16-bit
    K/V). ``Config`` in prefill_sm90.cu."""
    block_n: int
    stages: int
    ws: bool = False
    producer_regs: int = 0  # ws: the producer warpgroup's setmaxnreg budget
    tma: bool = False
    slots: int = 0

    @property
    def block_m(self):
        return 128

    @property
    def threads(self):
        return WS_THREADS if self.ws else 256


# threads of the warp-specialised kernel: a producer and two consumer warpgroups (namespace
# sm90 of the generated abi.cuh: cpp())
WS_THREADS = 384


def cpp() -> str:
    """C++ of the prefill kernels' constants for the generated ``abi.cuh``."""
    return abi.constants("sm90", dict(WS_THREADS=WS_THREADS))


def ws_producer_regs(head_dim):
    """The producer warpgroup's register budget in the warp-specialised kernel (the
    consumers take the rest of the CTA's registers at launch, ``ws_consumer_regs`` in
    prefill_sm90.cu: 504 a thread of each warpgroup, 168 x 3): the largest with which both
    compile without spilling, 72 (consumers 216), and 56 (consumers 224) at d112, whose
    general score path needs more."""
    return 56 if head_dim == 112 else 72


# head sizes the TMA producer takes: core.tma's (rows of whole 128-byte column blocks)
TMA_HEAD_DIMS = tma.HEAD_DIMS
# K and V buffers of the TMA tile: three, the stage count the GPU tests ran as the default
# (two were as fast or faster at most shapes: benchmarks/NOTES.md, "TMA producer")
TMA_STAGES = 3


# The fp8 TMA tile (tma_tile with kv): two K and two V buffers (three at d128 leave no
# shared memory for the staging) and a staging slot per part of two tiles, so that the
# tensor copies of the next tile run while the last one is widened.
FP8_TMA_STAGES = 2
FP8_TMA_SLOTS = 4


def tma_tile(head_dim, stages=None, kv=None):
    """The warp-specialised tile of ``head_dim`` with the TMA producer: ``stages`` K and V
    buffers each (None: :data:`TMA_STAGES`, from an fp8 cache :data:`FP8_TMA_STAGES`);
    ``kv`` (an fp8 format, or None for 16-bit K/V): the fp8 tile, whose producer copies
    the codes by TMA into :data:`FP8_TMA_SLOTS` staging slots and widens them into the
    16-bit tiles. The fp8 tile is opt-in: :func:`wgmma_tile` never returns it."""
    if kv is None:
        return WgmmaTile(128, stages or TMA_STAGES, True, ws_producer_regs(head_dim), True)
    check_choice("kv", kv, KV_DTYPES)
    return WgmmaTile(128, stages or FP8_TMA_STAGES, True, ws_producer_regs(head_dim), True,
                     FP8_TMA_SLOTS)


class TmaGeometry(NamedTuple):
    """What decides whether a launch can take the TMA producer (:func:`tma_fits`):
    ``strides`` (a ``core.layouts.CacheStrides``, elements), and ``total_k`` (ragged K/V's
    rows) or ``block_size`` and ``num_blocks`` (a paged cache's)."""
    strides: object
    total_k: int | None = None
    block_size: int | None = None
    num_blocks: int | None = None


def tma_fits(head_dim, kv, geometry, block_n=128):
    """Whether a launch of :class:`TmaGeometry` ``geometry`` can take the TMA producer:
    K/V (16-bit, ``kv`` None, or 1-byte codes of the fp8 format ``kv``) of
    :data:`TMA_HEAD_DIMS` with contiguous dims, key, head and block strides whose bytes are
    multiples of 16 (as a tensor map's must be), coordinates within int32 (at most
    2^31 - 1 ragged rows or cache blocks), and for a cache a block size of whole 8-row
    swizzle atoms that divides ``block_n`` or is a multiple of it (so that a tile is whole
    boxes of one block each: NHD and HND; the vllm layout's chunked keys fail the
    contiguity test). Whether the tile suits ``kv`` is :func:`check_tma`'s."""
    strides = geometry.strides
    itemsize = 2 if kv is None else 1
    if (head_dim not in TMA_HEAD_DIMS or strides.k_chunk != 16 // itemsize
            or strides.v_dim != 1):
        return False
    if geometry.block_size is None:
        count = geometry.total_k
        steps = (strides.k_tok, strides.k_head, strides.v_tok, strides.v_head)
    else:
        bs = geometry.block_size
        if bs % 8 or (block_n % bs and bs % block_n):
            return False
        count = geometry.num_blocks
        steps = (strides.k_tok, strides.k_head, strides.k_block, strides.v_tok, strides.v_head,
                 strides.v_block)
    return count <= INT32_MAX and all(x > 0 and (itemsize * x) % 16 == 0 for x in steps)


def check_tma(tile, head_dim, kv, geometry):
    """Refuse a TMA tile (``tile.tma``) for a call it cannot run: the warp-specialised kernel
    only, head sizes :data:`TMA_HEAD_DIMS`, staging slots exactly from an fp8 cache (format
    ``kv``: ``tma_tile(head_dim, kv=kv)``), shared memory within
    ``core.device.SM90_SMEM_PER_CTA``, and a launch (:class:`TmaGeometry` ``geometry``) that
    :func:`tma_fits`. Raises ValueError naming the reason."""
    if not tile.tma:
        return
    if not tile.ws:
        raise ValueError("tile: tma needs the warp-specialised kernel (ws=True)")
    if head_dim not in TMA_HEAD_DIMS:
        raise ValueError(f"tile: tma takes head_dim {TMA_HEAD_DIMS}, got {head_dim}")
    if (kv is None) != (tile.slots == 0):
        want = "0 (16-bit K/V)" if kv is None else "> 0 (plan.tma_tile(head_dim, kv=kv))"
        raise ValueError(f"tile: tma from K/V of kv {kv} expects slots {want}; got kv {kv}, "
                         f"slots {tile.slots}")
    smem = wgmma_smem_bytes(head_dim, tile, kv)
    if smem > SM90_SMEM_PER_CTA:
        raise ValueError(f"tile: expected at most {SM90_SMEM_PER_CTA} bytes of shared memory, "
                         f"got {smem} (head_dim {head_dim}, stages {tile.stages}, "
                         f"slots {tile.slots})")
    if not tma_fits(head_dim, kv, geometry, tile.block_n):
        raise ValueError("tile: tma takes K/V with contiguous dims, strides of whole 16 "
                         "bytes, at most 2^31 - 1 rows or blocks, and block sizes of whole 8 "
                         f"keys that divide the tile or are a multiple of it; got kv {kv}, "
                         f"{geometry}")


def warp_specialised(head_dim, kv=None, v_transposed=False, decode_rows=False):
    """Whether a wgmma call runs the warp-specialised kernel: 16-bit caches with V rows,
    head sizes below 256, batches without decode rows. The others run
    ``prefill_wgmma_kernel`` (docs/prefill.md, "Kernel choice"): fp8 caches (widened by the
    copying threads), the vllm value layout (V^T copies need more registers than the
    producer's budget), d256 (slower warp-specialised) and paged_attention's batches
    (``decode_rows``: an item of one query row's heads keeps a warpgroup idle, and
    ``prefill_wgmma_kernel`` skips its tiles where the warp-specialised kernel computes
    them)."""
    return head_dim != 256 and kv is None and not v_transposed and not decode_rows


def wgmma_tile(head_dim, kv=None, v_transposed=False, decode_rows=False, geometry=None):
    """wgmma tile of a call. Warp-specialised (:func:`warp_specialised`): 128-key tiles, two
    K and two V stages, or for a launch whose :class:`TmaGeometry` ``geometry`` (None: not
    known, as for the tile's work-list shape) :func:`tma_fits`, the TMA producer's tile
    (:func:`tma_tile`). Otherwise ``prefill_wgmma_kernel``'s: 128-key tiles with three
    stages (P V of one tile overlapping the next softmax) at d64, two at d80..d128 (the
    faster of the two at d64 and d128, benchmarks/NOTES.md, prefill wgmma w1 s2 / s3;
    d80..d112 follow d128); d256 64-key tiles and two stages (its 128 accumulators a thread
    leave no room for 128-key scores, and two stages of 128 keys would not fit the shared
    memory). Its ``block_m`` equals ``default_tile(head_dim).block_m``, so every kernel can
    run one work list."""
    block_n = 64 if head_dim == 256 else 128
    if warp_specialised(head_dim, kv, v_transposed, decode_rows):
        if geometry is not None and tma_fits(head_dim, kv, geometry, block_n):
            return tma_tile(head_dim)
        return WgmmaTile(block_n, 2, True, ws_producer_regs(head_dim))
    return WgmmaTile(block_n, 3 if head_dim == 64 else 2)


def wgmma_smem_bytes(head_dim, tile, kv=None):
    """Dynamic shared memory of a wgmma kernel: Q ``[128][D]``, ``stages`` K and V tiles
    ``[block_n][D]`` (16-bit; V^T ``[D][block_n]`` takes as much), from an fp8 cache
    (format ``kv``) the staging of one tile (:func:`fp8_staging_bytes`) or, for the fp8 TMA
    tile, its ``slots`` slots of ``[block_n][D]`` codes, the warp-specialised kernel's
    mbarriers (8 bytes each: Q, per stage K and V full and empty, per slot full and empty),
    plus 1024 bytes to align the swizzled tiles."""
    if tile.slots:
        staging = tile.slots * tile.block_n * head_dim
    else:
        staging = 0 if kv is None else fp8_staging_bytes(head_dim, tile.block_n, tile.threads)
    barriers = 8 * (1 + 4 * tile.stages + 2 * tile.slots) if tile.ws else 0
    return (2 * (tile.block_m * head_dim + 2 * tile.stages * tile.block_n * head_dim) + staging
            + barriers + 1024)


def general_scores(opts):
    """Whether a call's scores take the score epilogue (soft-cap, ALiBi, or a scale that
    is not positive) rather than raw dot products with the scale folded into exp2."""
    return opts.logits_soft_cap > 0 or opts.alibi_slopes is not None or not opts.sm_scale > 0


def wgmma_unsupported(dtype, head_dim, layout, opts):
    """Why the wgmma kernel cannot run a call (a phrase), or None when it can: every layout,
    head size and score option runs on it, float32 does not (no 32-bit wgmma inputs)."""
    if np.dtype(dtype) == float32:
        return "float32 (fp16/bf16 only)"
    if head_dim not in WGMMA_HEAD_DIMS:
        return f"head_dim {head_dim} (only {WGMMA_HEAD_DIMS})"
    return None


def resolve_backend(backend, unsupported, arch=None, layout="ragged"):
    """``"mma"`` or ``"wgmma"`` for a call asking for ``backend``.

    Parameters
    ----------
    backend : {"auto", "mma", "wgmma"}
    unsupported : str or None
        ``wgmma_unsupported`` of the call.
    arch : str, optional
        The device's compute capability (``"90"``); None: no device (not checked).
    layout : str
        ``"ragged"`` or the cache layout; "auto" takes wgmma only for ``WGMMA_AUTO`` layouts.
    """
    check_choice("backend", backend, BACKENDS)
    if backend == "wgmma":
        if unsupported is not None:
            raise ValueError(f"backend: 'wgmma' does not support {unsupported}; use 'auto' or 'mma'")
        if arch is not None and arch != "90":
            raise ValueError(f"backend: 'wgmma' needs an sm_90 (Hopper) device, got sm_{arch}")
        return "wgmma"
    if backend == "auto" and layout in WGMMA_AUTO and unsupported is None and arch == "90":
        return "wgmma"
    return "mma"


# ----------------------------------------------------------------------------- work list
def item_tiles(seq, row0, q_lens, kv_lens, *, group, tile, causal, window_left):
    """Key tiles (``tile.block_n`` keys) that the rows of items ``(seq, row0)`` see: the
    cost by which work lists are ordered, longest first (``kernels_cu/plan.cu`` buckets it
    the same way)."""
    q_lens = np.asarray(q_lens, dtype=np.int64)
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    rows = q_lens[seq] * group
    row_last = np.minimum(row0 + tile.block_m, rows) - 1
    shift = kv_lens[seq] - q_lens[seq]
    p_first, p_last = shift + row0 // group, shift + row_last // group
    j_begin = np.maximum(0, p_first - window_left) if window_left >= 0 else np.zeros_like(p_first)
    j_end = np.minimum(kv_lens[seq], p_last + 1) if causal else kv_lens[seq]
    bn = tile.block_n
    return np.where(j_end > j_begin, (j_end - 1) // bn - j_begin // bn + 1, 0)


# The K/V of the kv heads whose items run together fill at most this share of the L2, so
# that the CTAs of a section find most of their tiles there (FlashAttention-3's head swizzle).
L2_SHARE = 0.5


def section_heads(kv_tokens, head_dim, kv_itemsize, num_kv_heads, l2_bytes):
    """kv heads per section of a work list: as many as keep ``L2_SHARE`` of the L2
    (``l2_bytes``) over their K and V rows (``kv_tokens`` keys per head: all sequences' keys,
    or a bound on them), at least 1, at most ``num_kv_heads``."""
    per_head = max(int(kv_tokens), 1) * head_dim * kv_itemsize * 2
    return int(min(num_kv_heads, max(1, int(l2_bytes * L2_SHARE) // per_head)))


def work_list(q_lens, kv_lens, *, group, num_kv_heads, tile, causal, window_left,
              section_heads=None):
    """Tile work items of a batch: kv heads in sections, each section's items longest first.

    A section is ``section_heads`` consecutive kv heads (:func:`section_heads`; None: all of
    them): its items are listed before the next section's, longest first with the heads
    innermost, so the CTAs that run together read the K/V of few heads, and each section
    ends with its shortest items.

    Parameters
    ----------
    q_lens, kv_lens : numpy.ndarray
        int ``[B]`` query and key counts per sequence (0 allowed).
    group : int
        Query heads per kv head.
    num_kv_heads : int
    tile : TileShape
        ``block_m`` packed rows per item; ``block_n`` keys per K/V tile (cost estimate).
    causal : bool
    window_left : int
        ``-1`` for no window.
    section_heads : int, optional

    Returns
    -------
    numpy.ndarray
        int32 ``[num_items, 4]``: (sequence, kv head, first packed row, 0).
    """
    q_lens = np.asarray(q_lens, dtype=np.int64)
    block_m = tile.block_m
    tiles = -(-q_lens * group // block_m)
    seq = np.repeat(np.arange(len(q_lens)), tiles)
    first_tile = np.cumsum(tiles) - tiles
    row0 = (np.arange(len(seq)) - first_tile[seq]) * block_m
    n_tiles = item_tiles(seq, row0, q_lens, kv_lens, group=group, tile=tile, causal=causal,
                         window_left=window_left)
    order = np.argsort(-(n_tiles + 1), kind="stable")
    hs = num_kv_heads if section_heads is None else section_heads
    sections = []
    for h0 in range(0, num_kv_heads, hs):
        heads = np.arange(h0, min(h0 + hs, num_kv_heads))
        items = np.zeros((len(order) * len(heads), 4), dtype=np.int32)
        items[:, 0] = np.repeat(seq[order], len(heads))
        items[:, 1] = np.tile(heads, len(order))
        items[:, 2] = np.repeat(row0[order], len(heads))
        sections.append(items)
    return np.concatenate(sections) if sections else np.zeros((0, 4), dtype=np.int32)


def decode_rows(cu_seqlens_q):
    """The host twin of paged_attention's split (``prefill_plan_kernel`` with a row map):
    ``(q_lens, rows)``, the query lengths with the decode rows' (one query row) set to 0 for
    :func:`work_list` (the prefill launch gets no item of theirs), and the decode launch's
    row map, int32 ``[batch]``: ``cu_seqlens_q[b]`` for a decode row, -1 for the others."""
    cu = np.asarray(cu_seqlens_q, dtype=np.int64)
    q_lens = np.diff(cu)
    one = q_lens == 1
    return np.where(one, 0, q_lens), np.where(one, cu[:-1], -1).astype(np.int32)


# ----------------------------------------------------------------------------- gather
# A paged prefill may gather its batch's pages into packed rows (one pass over the keys and
# values, cache_ops.GatherLaunch) and run the ragged kernel on them: the paged kernel pays a
# page's block-table read and its own copies on every tile a query block reads (fp8:
# widening too), the gather once a key. GATHER_ROWS: the packed query rows a key is seen
# by, on average over the batch (gather_rows), from which gathering pays, for 16-bit and fp8
# caches (the gather's bytes a key against the paged kernel's extra time a key and row;
# benchmarks/NOTES.md, "Paged prefill by a gather"). A batch whose lengths stay on the
# device is judged at its shapes' bound (gather_pays_at_bound), and gathers only while its
# packed rows at that bound take at most GATHER_MAX_BYTES.
GATHER_ROWS = {False: 2048, True: 512}
GATHER_MAX_BYTES = 1 << 30


def gather_rows(q_lens, kv_lens, group, causal, window_left=-1):
    """Packed query rows (``group`` a query) that see a key, on average over a batch's
    keys: each sequence's visible (query, key) pairs, causal and window counted, over its
    keys."""
    q = np.asarray(q_lens, np.float64)
    kv = np.asarray(kv_lens, np.float64)
    pairs = q * (kv - q) + q * (q + 1) / 2 if causal else q * kv
    if window_left >= 0:
        pairs = np.minimum(pairs, q * (window_left + 1))
    keys = kv.sum()
    return float(group * pairs.sum() / keys) if keys else 0.0


def gather_pays(q_lens, kv_lens, group, causal, window_left, kv):
    """Whether gathering a batch's pages before the ragged kernel pays (GATHER_ROWS; ``kv``:
    the caches' fp8 format or None)."""
    return gather_rows(q_lens, kv_lens, group, causal, window_left) >= GATHER_ROWS[kv is not None]


def gather_pays_at_bound(total_q, batch, max_keys, group, causal, window_left, kv, row_bytes):
    """``gather_pays`` for a batch known by its shapes alone: ``batch`` sequences sharing
    ``total_q`` query rows evenly, each with the ``max_keys`` keys its block-table row can
    hold; and its packed rows at that bound (``batch * max_keys`` of ``row_bytes``, keys and
    values) within GATHER_MAX_BYTES."""
    if batch <= 0 or max_keys <= 0 or 2 * batch * max_keys * row_bytes > GATHER_MAX_BYTES:
        return False
    q = min(total_q / batch, max_keys)
    return gather_pays([q] * batch, [max_keys] * batch, group, causal, window_left, kv)


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


def check_ragged(q, k, v, cu_seqlens_q, cu_seqlens_k, xp, contents=True):
    """Validate varlen_prefill's arrays; return host (cu_q, cu_k) copies (``(None, None)``
    with ``contents=False``: the prefix sums' contents are the plan kernel's to check)."""
    _, num_q_heads, head_dim = check_query("q", q, xp)
    check_array("k", k, shape=(None, None, head_dim), dtypes=q.dtype, xp=xp, contiguous=False)
    check_array("v", v, shape=tuple(k.shape), dtypes=q.dtype, xp=xp, contiguous=False)
    token_stride("k", k)
    token_stride("v", v)
    check_gqa(num_q_heads, k.shape[1], "k")
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, xp, total=q.shape[0], contents=contents)
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, xp, total=k.shape[0], contents=contents)
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k: expected shape {tuple(cu_seqlens_q.shape)} like "
                         f"cu_seqlens_q (one entry per sequence + 1), got "
                         f"{tuple(cu_seqlens_k.shape)}")
    return cu_q, cu_k


def check_paged_query(q, geometry, cache_dtype, xp, kv=None):
    """q against a cache: same dtype (an fp8 cache, format ``kv``: float16 or bfloat16 q
    and head sizes FP8_HEAD_DIMS on the device, anything on the NumPy path), same head
    size, GQA group, block size limit."""
    _, num_q_heads, head_dim = check_query("q", q, xp)
    if kv is None and q.dtype != cache_dtype:
        raise TypeError(f"k_cache: expected dtype {q.dtype} like q, got {cache_dtype}")
    if geometry.head_dim != head_dim:
        raise ValueError(f"k_cache: expected head size {head_dim} like q, got {geometry.head_dim}")
    if kv is not None and xp is not np:
        if q.dtype.itemsize != 2:
            raise TypeError(f"q: expected dtype float16 or bfloat16 with an fp8 cache "
                            f"(kv_dtype {kv!r}), got {q.dtype}")
        if head_dim not in FP8_HEAD_DIMS:
            raise ValueError(f"k_cache: expected head_dim in {FP8_HEAD_DIMS} for an fp8 cache "
                             f"(kv_dtype {kv!r}) on the device, got {head_dim}")
    check_gqa(num_q_heads, geometry.num_kv_heads, "k_cache")
    check_block_elements(geometry)


def check_layout(layout):
    check_choice("layout", layout, LAYOUTS)
    return layout
