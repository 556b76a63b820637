"""Host-side planning of paged decode: argument checks, tile geometry, head layout, split
count, cache strides and the packed index upload.

No GPU work here: the numbers mirror the compile-time constants of ``kernels_cu/decode.cu``
(``NTHREADS``, ``NWARPS``, ``STAGES``, ``Cfg``) and pick each launch's shape from host
copies of the lengths. ``plan_launch`` gathers them into the record the launch code reads.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ._arrays import array_module, check_array, check_choice
from ._checks import check_block_tables, check_gqa, check_options, check_out, check_query
from .layouts import LAYOUTS, CacheGeometry, cache_geometry

NTHREADS = 128
NWARPS = NTHREADS // 32
STAGES = 3
MAX_SPLITS = 256
MAX_CTAS_PER_SM = 4   # beyond this, registers rather than shared memory limit residency
DEFAULT_SMS = 132     # H200; used when no device is asked
DEFAULT_SMEM_PER_SM = 228 * 1024
INT32_MAX = 2**31 - 1


# ----------------------------------------------------------------------------- checks
class Checked(NamedTuple):
    """A validated ``paged_decode`` call."""
    xp: object
    batch: int
    num_q_heads: int
    geometry: CacheGeometry
    options: object       # _checks.AttentionOptions
    append: bool
    seq_lens_host: object  # int32 [batch]


def check_caches(q, k_cache, v_cache, layout, xp):
    """Validate a cache pair against q; return its geometry. Device caches must also be
    16-byte aligned (cp.async) with blocks under 2**31 elements (32-bit in-block offsets)."""
    check_choice("layout", layout, LAYOUTS)
    geo = cache_geometry(k_cache, v_cache, layout)
    if k_cache.dtype != q.dtype:
        raise TypeError(f"k_cache: expected dtype {q.dtype} like q, got {k_cache.dtype}")
    if geo.head_dim != q.shape[2]:
        raise ValueError(f"k_cache: expected head_dim {q.shape[2]} like q, got {geo.head_dim}")
    if xp is not np:
        if geo.block_size * geo.num_kv_heads * geo.head_dim > INT32_MAX:
            raise ValueError(f"k_cache: expected fewer than 2**31 elements per block, got "
                             f"{geo.block_size} x {geo.num_kv_heads} x {geo.head_dim}")
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if c.data.ptr % 16:
                raise ValueError(f"{name}: expected a 16-byte aligned base address, got one "
                                 f"{c.data.ptr % 16} bytes past alignment")
    return geo


def check_new_kv(k_new, v_new, batch, geo, dtype, xp):
    """Validate the append operands; True when there is a token to append."""
    if k_new is None and v_new is None:
        return False
    if k_new is None or v_new is None:
        given = "k_new" if v_new is None else "v_new"
        raise ValueError(f"k_new, v_new: expected both or neither, got only {given}")
    for name, a in (("k_new", k_new), ("v_new", v_new)):
        check_array(name, a, shape=(batch, geo.num_kv_heads, geo.head_dim), dtypes=dtype, xp=xp)
    return True


def check_num_splits(num_splits):
    """``None`` (heuristic) or an int in ``[1, MAX_SPLITS]``."""
    if num_splits is None:
        return
    if (isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer))
            or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits: expected None or an int in [1, {MAX_SPLITS}], "
                         f"got {num_splits!r}")


def check_lse(lse, batch, num_q_heads, xp):
    """A caller's LSE buffer: float32 ``[batch, num_q_heads]``."""
    if lse is not None:
        check_array("lse", lse, shape=(batch, num_q_heads), dtypes=np.float32, xp=xp)


def check_decode(q, k_cache, v_cache, block_tables, seq_lens, k_new, v_new, layout,
                 num_splits, out, options) -> Checked:
    """Every check of ``paged_decode`` (index checks on host copies), before any launch."""
    xp = array_module(q, k_cache, v_cache, block_tables, seq_lens, k_new, v_new, out,
                      options["alibi_slopes"], options["sinks"])
    batch, hq, d = check_query("q", q, xp)
    geo = check_caches(q, k_cache, v_cache, layout, xp)
    check_gqa(hq, geo.num_kv_heads, "k_cache")
    append = check_new_kv(k_new, v_new, batch, geo, q.dtype, xp)
    opts = check_options(xp, hq, d, **options)
    _, sl = check_block_tables(block_tables, seq_lens, geo, xp, batch=batch,
                               extra_tokens=int(append))
    check_num_splits(num_splits)
    if out is not None:
        check_out(out, (batch, hq, d), q.dtype, xp)
    return Checked(xp, batch, hq, geo, opts, append, sl)


def check_positive(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


class Step(NamedTuple):
    """One plan: host copies, the launch record and device views of the uploaded indices."""
    batch: int
    block_tables: object  # int32 [batch, width], host
    seq_lens: object      # int32 [batch], host
    append: bool
    max_block: int        # largest block id the step reads (-1: none)
    launch: object        # decode_plan.DecodeLaunch (device runs) or None
    tables_dev: object    # int32 [batch, width_cap] view of the index buffer, or None
    lens_dev: object      # int32 [batch] view of the index buffer, or None


def check_plan(dec, block_tables, seq_lens, append, num_splits):
    """Checks of ``PagedDecoder.plan`` on host copies; ``(tables, lengths, max block id)``.

    Block ids are range-checked against the cache at ``run`` (the plan has no cache).
    """
    geo = CacheGeometry(INT32_MAX, dec.block_size, dec.num_kv_heads, dec.head_dim)
    bt, sl = check_block_tables(block_tables, seq_lens, geo, array_module(block_tables),
                                extra_tokens=int(bool(append)))
    if bt.shape[0] > dec.max_batch:
        raise ValueError(f"block_tables: expected at most max_batch={dec.max_batch} "
                         f"sequences, got {bt.shape[0]}")
    check_num_splits(num_splits)
    return bt, sl, planned_max_block(bt, sl, dec.block_size, append)


def check_run(dec, st, q, k_cache, v_cache, sinks, alibi_slopes, k_new, v_new, out, lse):
    """Checks of ``PagedDecoder.run`` against decoder ``dec`` and its plan ``st`` (shapes,
    dtypes, modules; no sync); returns ``(xp, options)``."""
    if st is None:
        raise ValueError("PagedDecoder.run: expected a plan() first, got none")
    xp = array_module(q, k_cache, v_cache, sinks, alibi_slopes, k_new, v_new, out, lse)
    if xp is not dec._xp:
        raise TypeError(f"q: expected {dec._xp.__name__} arrays like the plan, got "
                        f"{xp.__name__} arrays")
    shape = (st.batch, dec.num_q_heads, dec.head_dim)
    check_array("q", q, shape=shape, dtypes=dec.dtype, xp=xp)
    geo = check_caches(q, k_cache, v_cache, dec.layout, xp)
    if (geo.block_size, geo.num_kv_heads) != (dec.block_size, dec.num_kv_heads):
        raise ValueError(f"k_cache: expected block_size {dec.block_size} and "
                         f"{dec.num_kv_heads} kv heads like the decoder, got "
                         f"{geo.block_size} and {geo.num_kv_heads}")
    if st.max_block >= geo.num_blocks:
        raise ValueError(f"block_tables: expected block ids below {geo.num_blocks} (the "
                         f"cache's blocks), the plan reads block {st.max_block}")
    if check_new_kv(k_new, v_new, st.batch, geo, dec.dtype, xp) != st.append:
        raise ValueError(f"k_new, v_new: expected them {'' if st.append else 'not '}"
                         f"given, as planned with append={st.append}")
    opts = check_options(xp, dec.num_q_heads, dec.head_dim, sm_scale=dec._opts.sm_scale,
                         window_left=dec._opts.window_left, alibi_slopes=alibi_slopes,
                         sinks=sinks, logits_soft_cap=dec._opts.logits_soft_cap)
    if out is not None:
        check_out(out, shape, dec.dtype, xp)
    check_lse(lse, st.batch, dec.num_q_heads, xp)
    return xp, opts


def planned_max_block(block_tables, seq_lens, block_size, append):
    """Largest block id read for ``seq_lens (+1 with append)`` tokens, -1 if none."""
    need = -(-(np.asarray(seq_lens, np.int64) + bool(append)) // block_size)
    used = np.arange(block_tables.shape[1])[None, :] < need[:, None]
    return int(block_tables[used].max(initial=-1))


def pack_index(block_tables, seq_lens, max_batch, width):
    """Host int32 ``[max_batch + batch * width]``: lengths, then tables padded to ``width``.

    Lengths start at 0 and tables at ``max_batch`` whatever the batch, so device views of
    one buffer keep their addresses from plan to plan.
    """
    batch = block_tables.shape[0]
    host = np.full(max_batch + batch * width, -1, np.int32)
    host[:batch] = seq_lens
    host[max_batch:].reshape(batch, width)[:, :block_tables.shape[1]] = block_tables
    return host


# ----------------------------------------------------------------------------- geometry
class TileConfig(NamedTuple):
    """Compile-time geometry of one decode kernel specialisation."""
    tile: int            # tokens per pipeline stage
    head_tiles: int      # NT: n8 head tiles per warp (template parameter)
    heads_per_warp: int  # 8 * NT
    smem_bytes: int      # dynamic shared memory per CTA


def head_tiles(itemsize, head_dim, group) -> int:
    """NT = 2 (16 query heads a warp) for groups over 8 on 16-bit caches up to d128, else 1."""
    return 2 if itemsize == 2 and head_dim <= 128 and group > 8 else 1


def tile_config(itemsize, head_dim, vllm_v, nt) -> TileConfig:
    """Mirror of ``Cfg<T, D, NT>`` and the kernel's shared-memory carve-up.

    ``vllm_v``: the value tile is stored transposed (``[D][TILE + VEC]``), as the vllm
    value layout keeps tokens contiguous.
    """
    vec = 16 // itemsize
    row_bytes = head_dim * itemsize
    tile = 64 if row_bytes <= 256 else 32 if row_bytes <= 512 else 16
    k_elems = tile * (head_dim + vec)
    v_elems = head_dim * (tile + vec) if vllm_v else k_elems
    smem = STAGES * (k_elems + v_elems) * itemsize
    if itemsize == 4:  # the CUDA-core path stages each warp's q rows in shared memory
        smem += NWARPS * 8 * nt * (head_dim + 4) * 4
    return TileConfig(tile, nt, 8 * nt, smem)


class HeadLayout(NamedTuple):
    head_warps: int   # warps splitting a CTA's query heads (the rest split its tokens)
    head_chunks: int  # CTAs splitting one kv head's group (groups beyond 4 warps' heads)


def head_layout(group, heads_per_warp) -> HeadLayout:
    warps = -(-group // heads_per_warp)
    head_warps = min(NWARPS, warps)
    return HeadLayout(head_warps, -(-group // (head_warps * heads_per_warp)))


def visible_lengths(seq_lens, append, window_left):
    """Keys each query sees, int64 ``[batch]``: the window caps ``seq_len (+1)``."""
    kv = np.asarray(seq_lens, dtype=np.int64) + int(append)
    return np.minimum(kv, window_left + 1) if window_left >= 0 else kv


def ctas_per_sm(smem_bytes, smem_per_sm=DEFAULT_SMEM_PER_SM) -> int:
    """Resident CTAs per SM as shared memory allows (1 KB reserved per CTA)."""
    return max(1, min(MAX_CTAS_PER_SM, smem_per_sm // (smem_bytes + 1024)))


def choose_num_splits(ctas, max_tiles, slots) -> int:
    """Splits per (sequence, kv head) so that one wave of ``slots`` resident CTAs is full.

    ``ctas`` CTAs run without splitting and the longest sequence spans ``max_tiles`` tiles.
    With fewer than half a wave, split each into about ``slots // ctas`` (whole waves, no
    ragged tail), keeping at least ``STAGES - 1`` tiles per split (a CTA's first loads all
    go out at once) and no split of the longest sequence empty.
    """
    if ctas <= 0 or max_tiles <= 0 or 2 * ctas > slots:
        return 1
    splits = max(1, min(slots // ctas, -(-max_tiles // (STAGES - 1)), MAX_SPLITS))
    return int(-(-max_tiles // -(-max_tiles // splits)))


def block_division(block_size):
    """``(magic, shift)`` with ``t // block_size == (t * magic) >> shift`` for ``0 <= t < 2**31``."""
    l = (int(block_size) - 1).bit_length()  # ceil(log2(block_size))
    shift = 31 + l
    return -(-(1 << shift) // int(block_size)), shift


def cache_strides(layout, block_size, num_kv_heads, head_dim, itemsize):
    """Element strides ``(block, head, tok, chunk, elem)`` of the key and value caches.

    Element (block, head, token, dim) sits at ``block*block + head*head + token*tok +
    (dim // VEC)*chunk + (dim % VEC)*elem`` with ``VEC = 16 // itemsize``.
    """
    bs, hk, d, vec = block_size, num_kv_heads, head_dim, 16 // itemsize
    if layout == "NHD":
        s = (bs * hk * d, d, hk * d, vec, 1)
        return s, s
    if layout == "HND":
        s = (hk * bs * d, bs * d, d, vec, 1)
        return s, s
    # vllm: key [nb, hk, d // x, bs, x], value [nb, hk, d, bs]
    return (hk * d * bs, d * bs, vec, bs * vec, 1), (hk * d * bs, d * bs, 1, vec * bs, bs)


class DecodeLaunch(NamedTuple):
    """Everything one paged-decode launch needs besides the arrays."""
    head_dim: int
    num_kv_heads: int
    vllm_v: bool
    tiles: TileConfig
    heads: HeadLayout
    num_splits: int
    grid: tuple
    k_strides: tuple
    v_strides: tuple
    block_size: int
    block_magic: int
    block_shift: int
    append: bool


def plan_launch(*, itemsize, head_dim, layout, block_size, num_q_heads, num_kv_heads,
                seq_lens, append, window_left, num_splits=None, num_sms=DEFAULT_SMS,
                smem_per_sm=DEFAULT_SMEM_PER_SM) -> DecodeLaunch:
    """Choose the kernel specialisation, head layout and split count of one decode launch.

    ``seq_lens`` is the host copy of the cached lengths (the batch is its size);
    ``num_splits`` overrides the heuristic.
    """
    batch = len(seq_lens)
    group = num_q_heads // num_kv_heads
    vllm_v = layout == "vllm"
    tiles = tile_config(itemsize, head_dim, vllm_v, head_tiles(itemsize, head_dim, group))
    heads = head_layout(group, tiles.heads_per_warp)
    ctas = batch * num_kv_heads * heads.head_chunks
    if num_splits is None:
        slots = num_sms * ctas_per_sm(tiles.smem_bytes, smem_per_sm)
        max_visible = int(visible_lengths(seq_lens, append, window_left).max(initial=0))
        max_tiles = -(-max_visible // tiles.tile) + (window_left >= 0 and max_visible > 0)
        num_splits = choose_num_splits(ctas, max_tiles, slots)
    k_strides, v_strides = cache_strides(layout, block_size, num_kv_heads, head_dim, itemsize)
    magic, shift = block_division(block_size)
    grid = (int(num_splits), num_kv_heads * heads.head_chunks, batch)
    return DecodeLaunch(head_dim, num_kv_heads, vllm_v, tiles, heads, int(num_splits), grid,
                        k_strides, v_strides, int(block_size), magic, shift, bool(append))


def max_partial_rows(num_q_heads, num_kv_heads, head_dim, itemsize, num_sms=DEFAULT_SMS) -> int:
    """Upper bound of ``batch * num_splits * num_q_heads`` for heuristic split counts.

    With more than one split, ``batch * Hk * head_chunks * num_splits <= slots <=
    num_sms * MAX_CTAS_PER_SM``, so a ``PagedDecoder`` sizes its partial buffers once.
    """
    group = num_q_heads // num_kv_heads
    heads = head_layout(group, 8 * head_tiles(itemsize, head_dim, group))
    return math.ceil(num_sms * MAX_CTAS_PER_SM / (num_kv_heads * heads.head_chunks)) * num_q_heads
