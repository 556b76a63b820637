"""Quest page selection for decode: page key bounds, upper-bound page scores, the top pages
of each (sequence, kv head), and decode over them.

For every cache page and kv head the bounds are the elementwise min and max of its keys
(``[num_blocks, Hk, D]`` each, tokens below the sequence's length only), float32, or
bfloat16 or fp8 e4m3 rounded outward (a min down, a max up: still bounds, in a half or a
quarter of the bytes a step reads; e4m3, which has no infinity, stores a bound past its
range as NaN, "unknown", which scores as an infinite bound). A decode
query scores page ``P`` of kv head ``h`` by ``max_g sum_d ub(q_gd, min_d, max_d)`` over the
group's query heads ``g``, with ``ub = q max`` for ``q > 0``, ``q min`` for ``q < 0`` and 0
for ``q = 0``: at least ``q . k`` for every key of the page. Each (sequence, kv head) keeps
its ``top_k`` best pages: always its last (current) one and its ``first_pages`` first
ones (attention sinks; 0 by default), never a page past its length; ties go to the
earlier page. The decode then reads, for each kv head, exactly its pages:
the cache is viewed with one kv head a block (:func:`decode_view`: HND and vllm blocks
``blk * Hk + h``; NHD ones, whose heads interleave within a token, as one-token blocks
``(blk * block_size + t) * Hk + h``) and the (sequence, kv head) pairs run as a batch of
``B * Hk`` sequences of one kv head and the group's query heads through the public
:func:`cupaged.paged_decode` / :class:`cupaged.PagedDecoder`.

NumPy inputs run the float64 reference below (the specification); CuPy inputs run
``kernels_cu/quest.cu`` with no host read of device data: sizes come from shapes
(``block_tables.shape[1]``, ``top_k``), and bad device lengths or block ids go to the error
word (``cupaged.check_errors``), their sequences selecting nothing.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core import abi, errors
from ..core.arrays import (FLOAT_DTYPES, HEAD_DIMS, CallCache, array_module, bfloat16,
                           check_array, check_head_dim)
from ..core.checks import (INT32_MAX, check_aligned, check_block_tables, check_gqa, check_int,
                           check_query, table_stride, token_stride)
from ..core.compile import Spec, ctype, launcher
from ..core.fp8 import FP8_FORMATS
from ..core.launch import current_stream, ptr
from ..core.layouts import (CacheGeometry, block_stride, check_dense_blocks, k_as_nhd,
                            key_geometry, layout_strides)

BOUNDS_THREADS = 128
BOUNDS_TOKENS = 8            # key rows a bounds thread loads at once
SCORE_THREADS = 256
SCORE_PAGES = 512            # pages a quest_score_kernel CTA scores
SCORE_BYTES_IN_FLIGHT = 4096  # bound bytes a score warp loads before reducing (score_unroll)
SCORE_MAX_UNROLL = 8         # its most steps of pages a batch (registers)
SCORE_MAX_SUMS = 16          # partial sums a score lane holds a batch (steps x group chunk)
SCORE_GROUP_CHUNKS = (1, 4, 8)  # query heads a score pass holds in registers (score_group_chunk)
SELECT_THREADS = 512
SELECT_CACHED_PAGES = 16384  # widest table whose page keys the select kernel keeps in shared memory
SELECT_STAGED_PAGES = 8192   # most kept pages whose positions it gathers there before writing
SELECT_MAX_KEYS_PER_THREAD = 32  # most page keys a select thread holds in registers (bisection)
SINK_THREADS = 128
MAX_GRID_Y = 65535  # CUDA's limit on grid.y
MAX_BATCH = MAX_GRID_Y  # grid.y of quest_bounds_kernel
_E4M3 = FP8_FORMATS["fp8_e4m3"]
E4M3 = _E4M3.dtype   # ml_dtypes.float8_e4m3fn
E4M3_DTYPES = (E4M3, np.dtype(np.uint8))
"""e4m3 bounds: ml_dtypes' float8_e4m3fn, or uint8 codes (CuPy has no float8 dtype, torch's
float8_e4m3fn arrives as its bytes)."""
BOUND_DTYPES = (np.dtype(np.float32), bfloat16) + E4M3_DTYPES
BOUND_NAMES = {"float32": BOUND_DTYPES[0], "bfloat16": bfloat16, _E4M3.name: E4M3}


class Selection(NamedTuple):
    """The pages kept for a batch (:func:`select_pages`)."""
    positions: object  # int32 [B, Hk, k] page positions, ascending, -1 past the count
    tables: object     # int32 [B * Hk, k * tokens_per_page] block table of the decode view
    lens: object       # int32 [B * Hk] keys of each (sequence, kv head) in the view
    scores: object     # float32 [B, Hk, max_blocks] (-inf past a sequence, +inf its last page)


# ----------------------------------------------------------------------------- checks
def check_bounds(k_min, k_max, shape, xp):
    """``k_min`` and ``k_max``: float32, bfloat16 or fp8 e4m3 (:data:`BOUND_DTYPES`, both
    alike), ``shape`` ``(num_blocks, Hk, D)``, C-contiguous."""
    check_array("k_min", k_min, shape=shape, dtypes=BOUND_DTYPES, xp=xp)
    check_array("k_max", k_max, shape=shape, dtypes=k_min.dtype, xp=xp)
    if xp is not np:
        check_aligned(k_min=k_min, k_max=k_max)


def _bounds_shape(k_min):
    return tuple(int(s) for s in getattr(k_min, "shape", ()))


def tokens_per_page(layout, num_kv_heads, block_size):
    """Entries a selected page takes in the decode view's block table: ``block_size`` for
    NHD caches with several kv heads (one-token blocks), else 1."""
    return block_size if layout == "NHD" and num_kv_heads > 1 else 1


def decode_view(k_cache, v_cache, layout):
    """The caches viewed with one kv head a block (no copy), their layout and block size.

    Returns
    -------
    k_view, v_view : array
        HND ``[nb * Hk, 1, bs, D]`` (block ``blk * Hk + h``), vllm ``[nb * Hk, 1, D / x,
        bs, x]`` and ``[nb * Hk, 1, D, bs]``, NHD ``[nb * bs * Hk, 1, 1, D]`` (block
        ``(blk * bs + t) * Hk + h``; the cache itself with one kv head).
    layout : str
    block_size : int

    Raises
    ------
    ValueError
        For caches whose blocks are strided (a view cannot merge the block and head axes)
        or a view of more than 2^31 - 1 blocks.
    """
    geo = key_geometry(k_cache, layout)
    nb, bs, hk, d = geo
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_dense_blocks(name, a)
        size = int(np.prod(a.shape[1:]))
        if nb > 1 and block_stride(a) != size:
            raise ValueError(f"{name}: expected dense blocks one after the other for Quest "
                             f"decode (its one-kv-head view), got a block stride of "
                             f"{block_stride(a)} elements for blocks of {size}")
    tpp = tokens_per_page(layout, hk, bs)
    if nb * hk * tpp > INT32_MAX:
        raise ValueError(f"k_cache: expected at most {INT32_MAX} one-kv-head blocks in the "
                         f"Quest decode view, got {nb * hk * tpp}")
    if layout == "NHD":
        if hk == 1:
            return k_cache, v_cache, "NHD", bs
        return (k_cache.reshape(nb * bs * hk, 1, 1, d), v_cache.reshape(nb * bs * hk, 1, 1, d),
                "NHD", 1)
    if layout == "HND":
        return (k_cache.reshape(nb * hk, 1, bs, d), v_cache.reshape(nb * hk, 1, bs, d), "HND",
                bs)
    return (k_cache.reshape(nb * hk, 1, *k_cache.shape[2:]),
            v_cache.reshape(nb * hk, 1, *v_cache.shape[2:]), "vllm", bs)


# ----------------------------------------------------------------------------- bounds
def update_page_bounds(k_cache, block_tables, seq_lens, k_min, k_max, *, layout,
                       last_page_only=False, validate=None):
    """Recompute, in place, the key bounds of the pages holding each sequence's keys.

    Parameters
    ----------
    k_cache : array
        Key cache in ``layout`` (``cupaged.layouts``; blocks may be strided).
    block_tables : array
        int32 ``[B, max_blocks]`` (rows may be strided).
    seq_lens : array
        int32 ``[B]`` keys per sequence (0 allowed).
    k_min, k_max : array
        ``[num_blocks, Hk, D]`` of a :data:`BOUND_DTYPES` dtype, written for the pages
        recomputed only (bfloat16 and e4m3 rounded outward; e4m3 NaN past +-448).
    layout : {"NHD", "HND", "vllm"}
    last_page_only : bool
        Only each sequence's last page (after a decode step appended a key to it).
    validate : bool, optional
        Check device tables and lengths on the host first (strict mode).
    """
    xp = array_module(k_cache, block_tables, seq_lens, k_min, k_max)
    geo = key_geometry(k_cache, layout)
    check_array("k_cache", k_cache, dtypes=FLOAT_DTYPES, xp=xp, contiguous=False)
    check_head_dim("k_cache head_dim", geo.head_dim)
    check_dense_blocks("k_cache", k_cache)
    bt, sl = check_block_tables(block_tables, seq_lens, geo, xp,
                                contents=xp is np or errors.strict(validate))
    check_bounds(k_min, k_max, (geo.num_blocks, geo.num_kv_heads, geo.head_dim), xp)
    batch, width = block_tables.shape
    if xp is np:
        _reference_bounds(k_cache, layout, geo.block_size, bt, sl, k_min, k_max, last_page_only)
        return
    if batch > MAX_BATCH:
        raise ValueError(f"block_tables: expected at most {MAX_BATCH} sequences, got {batch}")
    check_aligned(k_cache=k_cache)
    bounds_launch(k_cache, layout, block_tables, k_min.dtype, last_page_only)(
        current_stream(), ptr(k_cache), ptr(block_tables), ptr(seq_lens), ptr(k_min),
        ptr(k_max))


_BOUNDS = CallCache()  # bounds_launch's setups by call shape


def bounds_launch(k_cache, layout, block_tables, bound_dtype, last_page_only):
    """quest_bounds_kernel for checked device arrays ``k_cache`` (in ``layout``) and
    ``block_tables``, made once per shape, dtype, stride and device: ``launch(stream,
    k_cache, block_tables, seq_lens, k_min, k_max)`` on device addresses."""
    import cupy
    batch, width = block_tables.shape
    key = (k_cache.dtype, k_cache.shape, k_cache.strides, layout, batch, width,
           table_stride(block_tables), np.dtype(bound_dtype), bool(last_page_only),
           cupy.cuda.runtime.getDevice())
    launch = _BOUNDS.get(key)
    if launch is None:
        geo = key_geometry(k_cache, layout)
        s = layout_strides(layout, *geo[1:], k_cache.itemsize)
        go = launcher("quest", bounds_expr(k_cache.dtype, bound_dtype), abi.QUEST_BOUNDS).at(
            (1 if last_page_only else width, batch if width else 0), BOUNDS_THREADS)
        args = abi.QUEST_BOUNDS.bind(
            err=ptr(errors.error_word()), k_block=block_stride(k_cache), k_head=s.k_head,
            k_chunk=s.k_chunk, k_tok=s.k_tok, bt_stride=table_stride(block_tables),
            width=width, block_size=geo.block_size, num_blocks=geo.num_blocks,
            num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim,
            last_page_only=int(bool(last_page_only)))

        def launch(stream, k_cache, block_tables, seq_lens, k_min, k_max):
            go(args.pack(k_cache=k_cache, block_tables=block_tables, seq_lens=seq_lens,
                         k_min=k_min, k_max=k_max), stream)
        _BOUNDS.put(key, launch)
    return launch


def _reference_bounds(k_cache, layout, bs, bt, lens, k_min, k_max, last_page_only):
    """update_page_bounds on host arrays."""
    lens = lens.astype(np.int64)
    used = -(-lens // bs)
    pos = np.arange(bt.shape[1])[None, :]
    first = used - 1 if last_page_only else np.zeros_like(used)
    b, p = np.nonzero((pos >= first[:, None]) & (pos < used[:, None]))
    if not len(b):
        return
    ids = bt[b, p].astype(np.int64)
    fills = np.minimum(bs, lens[b] - p * bs)
    keys = k_as_nhd(k_cache[ids], layout).astype(np.float64)          # [P, bs, Hk, D]
    valid = (np.arange(bs)[None, :] < fills[:, None])[:, :, None, None]
    k_min[ids] = outward(np.where(valid, keys, np.inf).min(axis=1), k_min.dtype, -np.inf)
    k_max[ids] = outward(np.where(valid, keys, -np.inf).max(axis=1), k_max.dtype, np.inf)


def empty_bounds(shape, name, xp):
    """New ``k_min, k_max`` of ``shape`` in the bound dtype called ``name`` (a key of
    :data:`BOUND_NAMES`; e4m3 as uint8 codes outside NumPy), before any page is computed:
    float32 and bfloat16 ``+inf`` and ``-inf`` (the pages score ``-inf``), e4m3 unknown
    (NaN; they score ``+inf``)."""
    dtype = BOUND_NAMES[name]
    if dtype == E4M3:
        dtype = E4M3 if xp is np else np.dtype(np.uint8)
        return tuple(xp.full(shape, 0x7F, np.uint8).view(dtype) for _ in range(2))
    return xp.full(shape, np.inf, dtype=dtype), xp.full(shape, -np.inf, dtype=dtype)


def outward(x, dtype, toward):
    """float64 ``x`` in ``dtype``, rounded toward ``toward`` (-inf or +inf) where inexact.
    e4m3 (float8_e4m3fn, or uint8 codes) has no infinity: past its largest finite value the
    step reaches the NaN code (``sign | 0x7F``), an unknown bound."""
    dtype = np.dtype(dtype)
    if dtype in E4M3_DTYPES:
        nearest = np.clip(x, -_E4M3.max, _E4M3.max).astype(E4M3)   # saturated
        codes = nearest.view(np.uint8).astype(np.int32)
        back = codes.astype(np.uint8).view(E4M3).astype(np.float64)
        off = back > x if toward < 0 else back < x
        up = toward > 0
        zero = (codes & 0x7F) == 0
        away = (codes >> 7) == (0 if up else 1)       # the step moves the magnitude up
        step = np.where(zero, 0x01 if up else 0x81, np.where(away, codes + 1, codes - 1))
        out = np.where(off, step, codes).astype(np.uint8)
        return out if dtype == np.dtype(np.uint8) else out.view(E4M3)
    y = x.astype(dtype)
    back = y.astype(np.float64)
    off = back > x if toward < 0 else back < x
    return np.where(off, np.nextafter(y, np.asarray(toward, dtype)), y)


# ----------------------------------------------------------------------------- selection
def page_scores(q, k_min, k_max, block_tables, seq_lens, block_size):
    """Upper-bound scores of every page position, float32 ``[B, Hk, max_blocks]``: ``-inf``
    past a sequence's pages, ``+inf`` for its last page (the module docstring's rule).

    Parameters
    ----------
    q : array
        ``[B, Hq, D]`` decode queries (rows may be strided).
    k_min, k_max : array
        ``[num_blocks, Hk, D]`` page bounds (:data:`BOUND_DTYPES`; an e4m3 NaN is an
        unknown bound: infinite).
    block_tables, seq_lens : array
        int32 ``[B, max_blocks]`` and ``[B]``.
    block_size : int
    """
    return _select(q, k_min, k_max, block_tables, seq_lens, block_size, 0, 0, 1, None).scores


def select_pages(q, k_min, k_max, block_tables, seq_lens, block_size, top_k, *,
                 first_pages=0, tokens_per_page=1, out=None, validate=None):
    """The ``top_k`` pages of each (sequence, kv head) and the decode view's table of them.

    Parameters
    ----------
    q, k_min, k_max, block_tables, seq_lens, block_size
        As in :func:`page_scores`.
    top_k : int
        Pages kept per (sequence, kv head); ``k = min(top_k, max_blocks)`` slots.
    first_pages : int
        Pages at the start of each sequence always kept, after the last page and while
        slots last (the earliest first).
    tokens_per_page : int
        1: a table entry a page (``blk * Hk + h``); ``block_size``: one a token
        (``(blk * block_size + t) * Hk + h``), for the NHD view (:func:`decode_view`).
    out : Selection, optional
        Buffers to write (CuPy; ``positions`` may be None): no allocation.
    validate : bool, optional
        Strict mode for device tables and lengths.

    Returns
    -------
    Selection
        ``lens[b * Hk + h] = (count - 1) * block_size + fill of the last page`` for the
        ``count = min(k, pages)`` kept pages (0 for an empty sequence).
    """
    check_int("top_k", top_k)
    check_int("first_pages", first_pages, minimum=0)
    return _select(q, k_min, k_max, block_tables, seq_lens, block_size, top_k, first_pages,
                   tokens_per_page, out, validate)


def _select(q, k_min, k_max, block_tables, seq_lens, block_size, top_k, first, tpp, out,
            validate=None):
    xp = array_module(q, k_min, k_max, block_tables, seq_lens)
    batch, hq, d = check_query("q", q, xp)
    shape = _bounds_shape(k_min)
    check_bounds(k_min, k_max, shape[:2] + (d,) if len(shape) == 3 else (None, None, d), xp)
    nb, hk, _ = shape
    check_gqa(hq, hk, "k_min")
    bs = check_int("block_size", block_size)
    bt, sl = check_block_tables(block_tables, seq_lens, CacheGeometry(nb, bs, hk, d), xp,
                                batch=batch, contents=xp is np or errors.strict(validate))
    width = block_tables.shape[1]
    k = min(top_k, width)
    if nb * hk * tpp > INT32_MAX:
        raise ValueError(f"k_min: expected at most {INT32_MAX} (block, kv head, token) ids for "
                         f"the view's block table, got {nb * hk * tpp}")
    if xp is np:
        return _reference_select(q, k_min, k_max, bt, sl, bs, k, first, tpp)
    if out is None:
        out = Selection(xp.empty((batch, hk, k), np.int32) if top_k else None,
                        xp.empty((batch * hk, k * tpp), np.int32),
                        xp.empty(batch * hk, np.int32), xp.empty((batch, hk, width), np.float32))
    launch = select_launch(q, k_min, block_tables, bs, top_k, first, tpp,
                           table_stride(out.tables))
    launch(current_stream(), ptr(q), ptr(k_min), ptr(k_max), ptr(block_tables), ptr(seq_lens),
           ptr(out.scores), ptr(out.positions), ptr(out.tables), ptr(out.lens))
    return out


class SelectLaunch(NamedTuple):
    """The score and select kernels of one call shape (:func:`select_launch`), launched by
    ``launch(stream, q, k_min, k_max, block_tables, seq_lens, scores, positions, sel_tables,
    sel_lens)`` on device addresses (positions 0: not written); an empty grid (no rows, no
    pages, or no select for ``page_scores``) launches nothing."""
    score: object        # Kernel.at(...) of quest_score_kernel
    score_args: object   # its Bound record
    select: object       # Kernel.at(...) of quest_select_kernel
    select_args: object  # its Bound record

    def __call__(self, stream, q, k_min, k_max, block_tables, seq_lens, scores, positions,
                 sel_tables, sel_lens):
        self.score(self.score_args.pack(q=q, k_min=k_min, k_max=k_max,
                                        block_tables=block_tables, seq_lens=seq_lens,
                                        scores=scores), stream)
        self.select(self.select_args.pack(block_tables=block_tables, seq_lens=seq_lens,
                                          scores=scores, positions=positions,
                                          sel_tables=sel_tables, sel_lens=sel_lens), stream)


_SELECTS = CallCache()  # SelectLaunch by call shape


def select_launch(q, k_min, block_tables, block_size, top_k, first_pages, tokens_per_page,
                  sel_stride):
    """The :class:`SelectLaunch` of checked device arrays ``q [B, Hq, D]``, ``k_min
    [num_blocks, Hk, D]`` and ``block_tables [B, W]`` keeping ``top_k`` pages (0: scores
    only) into a table whose rows are ``sel_stride`` entries apart; made once per shape,
    dtype, stride and device."""
    import cupy
    batch, hq, d = q.shape
    nb, hk, _ = k_min.shape
    width = block_tables.shape[1]
    key = (q.dtype, q.shape, token_stride("q", q), k_min.dtype, k_min.shape, width,
           table_stride(block_tables), block_size, top_k, first_pages, tokens_per_page,
           sel_stride, cupy.cuda.runtime.getDevice())
    launch = _SELECTS.get(key)
    if launch is not None:
        return launch
    if -(-width // SCORE_PAGES) > MAX_GRID_Y:
        raise ValueError(f"block_tables: expected at most {MAX_GRID_Y * SCORE_PAGES} "
                         f"pages per sequence, got {width}")
    rows = batch * hk
    fixed = dict(bt_stride=table_stride(block_tables), width=width, block_size=block_size,
                 num_blocks=nb, num_kv_heads=hk)
    score = launcher("quest", score_expr(q.dtype, d, k_min.dtype, hq // hk),
                     abi.QUEST_SCORE).at((rows, -(-width // SCORE_PAGES)), SCORE_THREADS)
    score_args = abi.QUEST_SCORE.bind(err=ptr(errors.error_word()),
                                      q_stride=token_stride("q", q), group=hq // hk,
                                      pages_per_cta=SCORE_PAGES, **fixed)
    k = min(top_k, width)
    cached, staged = width <= SELECT_CACHED_PAGES, k <= SELECT_STAGED_PAGES
    smem = 4 * (k * staged + width * cached)
    select = launcher("quest", select_expr(width), abi.QUEST_SELECT, smem=smem).at(
        rows if top_k else 0, SELECT_THREADS, smem)
    select_args = abi.QUEST_SELECT.bind(top_k=k,
                                        first_pages=min(first_pages, INT32_MAX),
                                        tokens_per_page=tokens_per_page, sel_stride=sel_stride,
                                        cache_keys=int(cached), stage_positions=int(staged),
                                        **fixed)
    return _SELECTS.put(key, SelectLaunch(score, score_args, select, select_args))


def _reference_scores(q, k_min, k_max, bt, lens, bs):
    """page_scores in float64 on host arrays."""
    batch, hq, d = q.shape
    nb, hk, _ = k_min.shape
    qg = q.astype(np.float64).reshape(batch, hk, hq // hk, 1, d)
    ids = np.clip(bt, 0, max(nb - 1, 0))
    mx = bound_values(k_max[ids], np.inf).transpose(0, 2, 1, 3)[:, :, None]   # [B, Hk, 1, W, D]
    mn = bound_values(k_min[ids], -np.inf).transpose(0, 2, 1, 3)[:, :, None]
    with np.errstate(invalid="ignore"):  # 0 * inf, +inf - inf: NaN, made -inf below
        terms = np.where(qg > 0, qg * mx, np.where(qg < 0, qg * mn, 0.0))
        ub = terms.sum(axis=-1).max(axis=2)                                 # [B, Hk, W]
    ub = np.where(np.isnan(ub), -np.inf, ub)
    used = -(-lens.astype(np.int64) // bs)
    pos = np.arange(bt.shape[1])[None, None, :]
    ub = np.where(pos < used[:, None, None], ub, -np.inf)
    return np.where(pos == used[:, None, None] - 1, np.inf, ub)


def bound_values(bounds, unknown):
    """Host bounds as float64; e4m3 ones (float8_e4m3fn, or uint8 codes) with their NaN
    code (an unknown bound) as ``unknown`` (+inf for a max, -inf for a min)."""
    if bounds.dtype in E4M3_DTYPES:
        x = bounds.view(E4M3).astype(np.float64)
        return np.where(np.isnan(x), unknown, x)
    return bounds.astype(np.float64)


def _reference_select(q, k_min, k_max, bt, lens, bs, k, first, tpp):
    """select_pages on host arrays: the best pages by float64 score (the last page first,
    then the ``first`` first pages, ties to the earlier page), in position order."""
    scores = _reference_scores(q, k_min, k_max, bt, lens, bs)
    batch, hk, width = scores.shape
    lens = lens.astype(np.int64)
    used = -(-lens // bs)
    pos = np.arange(width)
    last = pos[None, None, :] == used[:, None, None] - 1
    # rank: the last page, the first pages (in position order), then by score descending,
    # then by position
    order = np.broadcast_to(pos, scores.shape)
    lead = np.broadcast_to(pos < first, scores.shape)
    rank = np.lexsort((order, np.where(lead, 0.0, -scores), ~lead,
                       ~np.broadcast_to(last, scores.shape)), axis=-1)[..., :k]
    count = np.minimum(used, k)
    keep = np.arange(k)[None, None, :] < count[:, None, None]
    positions = np.sort(np.where(keep, rank, width), axis=-1)
    positions = np.where(keep, positions, -1).astype(np.int32)
    blocks = np.take_along_axis(np.broadcast_to(bt[:, None, :], (batch, hk, width)),
                                np.maximum(positions, 0), axis=-1).astype(np.int64)
    heads = np.arange(hk)[None, :, None]
    if tpp == 1:
        tables = blocks * hk + heads
    else:
        tok = np.arange(tpp)[None, None, None, :]
        tables = ((blocks[..., None] * bs + tok) * hk + heads[..., None]).reshape(batch, hk, -1)
        keep = np.repeat(keep, tpp, axis=-1)
    tables = np.where(keep, tables, -1).astype(np.int32).reshape(batch * hk, k * tpp)
    fill = lens - (used - 1) * bs
    sel = np.where(count > 0, (count - 1) * bs + fill, 0)
    sel_lens = np.repeat(sel, hk).astype(np.int32)
    return Selection(positions, tables, sel_lens, scores.astype(np.float32))


# ----------------------------------------------------------------------------- sinks
def fold_sinks(out, lse, sinks, num_q_heads):
    """Fold sink logits into a decode's output ``[rows, D]`` and LSE ``[rows]`` (in place,
    both over the keys alone; row ``r`` is query head ``r % num_q_heads``): ``out *= 1 /
    (1 + exp(sink - lse))``, ``lse = logaddexp(lse, sink)``."""
    xp = array_module(out, lse, sinks)
    if xp is np:
        s = sinks[np.arange(lse.shape[0]) % num_q_heads].astype(np.float64)
        l64 = lse.astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            scale = np.where(np.isneginf(l64), 0.0, 1.0 / (1.0 + np.exp(s - l64)))
        out[...] = (out.astype(np.float64) * scale[:, None]).astype(out.dtype)
        lse[...] = np.logaddexp(l64, s)
        return
    sinks_launch(out.dtype, lse.shape[0], num_q_heads, out.shape[-1])(
        current_stream(), ptr(out), ptr(lse), ptr(sinks))


_SINKS = CallCache()  # sinks_launch's setups by call shape


def sinks_launch(dtype, rows, num_q_heads, head_dim):
    """fold_sinks' kernel for ``rows`` rows of ``dtype`` output, made once per shape and
    device: ``launch(stream, out, lse, sinks)`` on device addresses."""
    import cupy
    key = (np.dtype(dtype), rows, num_q_heads, head_dim, cupy.cuda.runtime.getDevice())
    launch = _SINKS.get(key)
    if launch is None:
        go = launcher("quest", sinks_expr(dtype), abi.QUEST_SINKS).at(
            -(-rows // (SINK_THREADS // 32)), SINK_THREADS)
        args = abi.QUEST_SINKS.bind(rows=rows, num_q_heads=num_q_heads, head_dim=head_dim)

        def launch(stream, out, lse, sinks):
            go(args.pack(out=out, lse=lse, sinks=sinks), stream)
        _SINKS.put(key, launch)
    return launch


# ----------------------------------------------------------------------------- kernels
def bounds_expr(dtype, bound_dtype):
    return (f"cupaged::quest::quest_bounds_kernel<{ctype(dtype)}, {bound_ctype(bound_dtype)}, "
            f"{BOUNDS_THREADS}, {BOUNDS_TOKENS}>")


def bound_ctype(bound_dtype):
    """C type of a bound dtype in kernel templates (e4m3: ``fp8.cuh``'s code type)."""
    return f"cupaged::{_E4M3.name}" if np.dtype(bound_dtype) in E4M3_DTYPES else ctype(bound_dtype)


def score_chunk(head_dim, bound_dtype, group):
    """Bound dims a score lane loads at once: 4 floats (16 bytes), 8 bfloat16 (16 bytes) or
    8 e4m3 codes (8 bytes: 16 would double q's registers), but 4 of either where a pass
    holds more than 4 query heads (q takes 2 registers a dim a head) and where ``head_dim /
    8`` is no power of two (lanes past the head cost registers)."""
    d = int(head_dim)
    if (np.dtype(bound_dtype).itemsize == 4 or score_group_chunk(d, group) > 4
            or (d // 8) & (d // 8 - 1)):
        return 4
    return 8


def score_lanes(head_dim, chunk):
    """Lanes a page takes in the score kernel: its ``head_dim / chunk`` loads rounded up to
    a power of two, 8 to 32 (more than 32 loads: several a lane)."""
    loads = int(head_dim) // chunk
    return 8 if loads <= 8 else 16 if loads <= 16 else 32


def score_unroll(head_dim, bound_dtype, group):
    """Steps of pages (32 / score_lanes a step) a score warp loads as a batch: about
    SCORE_BYTES_IN_FLIGHT of bounds (the loads of one page alone leave the warp waiting on
    memory latency), at most SCORE_MAX_UNROLL, and with the group chunk at most
    SCORE_MAX_SUMS partial sums a lane and one total a lane once they are summed, a power of
    two; half of both limits for e4m3 bounds (their widening takes registers)."""
    chunk = score_chunk(head_dim, bound_dtype, group)
    lanes = score_lanes(head_dim, chunk)
    size = np.dtype(bound_dtype).itemsize
    step = 2 * int(head_dim) * size * (32 // lanes)
    cut = 2 if size == 1 else 1
    most = min(SCORE_MAX_UNROLL // cut, max(1, SCORE_BYTES_IN_FLIGHT // step),
               min(lanes, SCORE_MAX_SUMS // cut) // score_group_chunk(head_dim, group))
    return 1 << (most.bit_length() - 1)


def score_group_chunk(head_dim, group):
    """Query heads a score pass holds in registers (q split in two a head): the smallest of
    SCORE_GROUP_CHUNKS at least ``group``, at most 4 for D = 256; larger groups take several
    passes over the pages."""
    cap = 4 if int(head_dim) > 128 else SCORE_GROUP_CHUNKS[-1]
    return min([c for c in SCORE_GROUP_CHUNKS if c >= min(group, cap)])


def score_expr(dtype, head_dim, bound_dtype, group):
    return (f"cupaged::quest::quest_score_kernel<{ctype(dtype)}, {bound_ctype(bound_dtype)}, "
            f"{head_dim}, {score_chunk(head_dim, bound_dtype, group)}, {SCORE_THREADS}, "
            f"{score_group_chunk(head_dim, group)}, {score_unroll(head_dim, bound_dtype, group)}>")


def select_keys_per_thread(width):
    """Page keys a select thread holds in registers for rows of ``width`` pages (a power of
    two, at most SELECT_MAX_KEYS_PER_THREAD), or 0 for rows too wide (the radix select on
    keys in shared or global memory)."""
    per = -(-int(width) // SELECT_THREADS)
    if per > SELECT_MAX_KEYS_PER_THREAD or int(width) > SELECT_CACHED_PAGES:
        return 0
    return 1 << max(0, per - 1).bit_length()


def select_expr(width):
    return (f"cupaged::quest::quest_select_kernel<{SELECT_THREADS}, "
            f"{select_keys_per_thread(width)}>")


def sinks_expr(dtype):
    return f"cupaged::quest::quest_sinks_kernel<{ctype(dtype)}, {SINK_THREADS}>"


def kernel_specializations():
    """Every Quest kernel: select per keys a thread; sinks per dtype; bounds per dtype and
    bound dtype; scores per dtype, head size, bound dtype and group chunk."""
    widths = [SELECT_THREADS << j for j in range(SELECT_MAX_KEYS_PER_THREAD.bit_length() + 1)]
    specs = [Spec("quest", e) for e in dict.fromkeys(select_expr(w) for w in widths)]
    for dt in FLOAT_DTYPES:
        specs.append(Spec("quest", sinks_expr(dt)))
        for bt in BOUND_NAMES.values():
            specs.append(Spec("quest", bounds_expr(dt, bt)))
            specs += [Spec("quest", e) for e in dict.fromkeys(
                score_expr(dt, d, bt, g) for d in HEAD_DIMS for g in SCORE_GROUP_CHUNKS)]
    return specs
