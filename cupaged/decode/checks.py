"""Argument checks of paged decode (``paged_decode``, ``PagedDecoder.plan`` and ``run``):
shapes, dtypes, modules, layouts and plan options before any launch, so that bad input
raises without changing any state; the contents of block tables and lengths on the host
when they are NumPy arrays or in strict mode (``cupaged.errors``), else on the device by
the plan kernel.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core.arrays import array_module, check_array, check_choice
from ..core.checks import (INT32_MAX, check_aligned, check_block_elements, check_block_tables,
    check_gqa, check_lse, check_options, check_out, check_query, token_stride)
from ..core.errors import strict
from ..core.fp8 import check_scale_arrays, resolve_kv_dtype
from .plan import FP8_HEAD_DIMS, MAX_SPLITS, MERGES, SCHEDULES
from ..core.layouts import CACHE_DTYPES, LAYOUTS, CacheGeometry, cache_geometry



class Checked(NamedTuple):
    """A validated ``paged_decode`` call."""
    xp: object
    batch: int
    num_q_heads: int
    geometry: CacheGeometry
    options: object       # _checks.AttentionOptions
    append: bool
    seq_lens_host: object  # int32 [batch] when checked on the host, else None
    kv: object = None      # the caches' fp8 format name (None: q's dtype)
    scales: object = None  # the kernels' scale fields (core.fp8.kernel_scales; device calls)


def check_caches(q, k_cache, v_cache, layout, xp, kv_dtype=None):
    """Validate a cache pair against q; return ``(geometry, fp8 format or None)``. A plain
    cache has q's dtype; an fp8 one (``kv_dtype``, or a float8 cache's own format) takes
    16-bit q and head dims FP8_HEAD_DIMS on the device (any q dtype on the NumPy path).
    Device caches must also be 16-byte aligned (cp.async) with blocks under 2**31 elements
    (32-bit in-block offsets, block strides included)."""
    check_choice("layout", layout, LAYOUTS)
    geo = cache_geometry(k_cache, v_cache, layout, CACHE_DTYPES)
    fmt = resolve_kv_dtype(kv_dtype, k_cache, v_cache)
    if fmt is None and k_cache.dtype != q.dtype:
        raise TypeError(f"k_cache: expected dtype {q.dtype} like q, got {k_cache.dtype}")
    if geo.head_dim != q.shape[2]:
        raise ValueError(f"k_cache: expected head_dim {q.shape[2]} like q, got {geo.head_dim}")
    if fmt is not None and xp is not np:
        if q.dtype.itemsize != 2:
            raise TypeError(f"q: expected dtype float16 or bfloat16 with an fp8 cache "
                            f"(kv_dtype {fmt.name!r}), got {q.dtype}")
        if geo.head_dim not in FP8_HEAD_DIMS:
            raise ValueError(f"k_cache: expected head_dim in {FP8_HEAD_DIMS} for an fp8 cache "
                             f"(kv_dtype {fmt.name!r}) on the device, got {geo.head_dim}")
    if xp is not np:
        check_block_elements(geo, k_cache=k_cache, v_cache=v_cache)
        check_aligned(k_cache=k_cache, v_cache=v_cache)
    return geo, fmt


def check_new_kv(k_new, v_new, batch, geo, dtype, xp):
    """Validate the append operands; True when there is a token to append."""
    if k_new is None and v_new is None:
        return False
    if k_new is None or v_new is None:
        given = "k_new" if v_new is None else "v_new"
        raise ValueError(f"k_new, v_new: expected both or neither, got only {given}")
    for name, a in (("k_new", k_new), ("v_new", v_new)):
        check_array(name, a, shape=(batch, geo.num_kv_heads, geo.head_dim), dtypes=dtype, xp=xp,
                    contiguous=False)
        token_stride(name, a)
    return True


def check_num_splits(num_splits):
    """``None`` (heuristic) or an int in ``[1, MAX_SPLITS]``."""
    if num_splits is None:
        return
    if (isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer))
            or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits: expected None or an int in [1, {MAX_SPLITS}], "
                         f"got {num_splits!r}")


def check_variants(schedule, merge, num_splits):
    """Check a plan's ``(schedule, merge)``; the schedule defaults to "balanced" ("split"
    when ``num_splits`` is given, the only schedule that takes a count), ``merge=None``
    stays None (``resolve_merge`` picks it for a launch)."""
    check_num_splits(num_splits)
    if schedule is None:
        schedule = "balanced" if num_splits is None else "split"
    check_choice("schedule", schedule, SCHEDULES)
    if num_splits is not None and schedule != "split":
        raise ValueError(f"num_splits: expected None with schedule={schedule!r} (only "
                         f"'split' takes a count), got {num_splits!r}")
    if merge is not None:
        check_choice("merge", merge, MERGES)
    return schedule, merge


def check_decode(q, k_cache, v_cache, block_tables, seq_lens, k_new, v_new, layout,
                 num_splits, out, options, validate=None, kv_dtype=None, k_scale=None,
                 v_scale=None) -> Checked:
    """Every check of ``paged_decode`` before any launch (index contents on host copies for
    NumPy arrays or in strict mode)."""
    xp = array_module(q, k_cache, v_cache, block_tables, seq_lens, k_new, v_new, out,
                      options["alibi_slopes"], options["sinks"])
    batch, hq, d = check_query("q", q, xp)
    geo, fmt = check_caches(q, k_cache, v_cache, layout, xp, kv_dtype)
    scales = check_scale_arrays(fmt, k_scale, v_scale, geo.num_kv_heads, xp, validate)
    check_gqa(hq, geo.num_kv_heads, "k_cache")
    append = check_new_kv(k_new, v_new, batch, geo, q.dtype, xp)
    opts = check_options(xp, hq, d, **options)
    _, sl = check_block_tables(block_tables, seq_lens, geo, xp, batch=batch,
                               extra_tokens=int(append),
                               contents=xp is np or strict(validate))
    check_num_splits(num_splits)
    if out is not None:
        check_out(out, (batch, hq, d), q.dtype, xp)
    return Checked(xp, batch, hq, geo, opts, append, sl, None if fmt is None else fmt.name,
                   scales)


def check_plan(dec, block_tables, seq_lens, append, num_splits, validate=None, ids=True):
    """Checks of ``PagedDecoder.plan``; ``(tables, lengths, max block id)`` on the host, or
    ``(None, None, -1)`` for device arrays outside strict mode (the plan kernel checks them).

    Block ids are range-checked against the cache at ``run`` (the plan has no cache); with
    ``ids=False`` (a device planner) the host checks only the lengths of host tables, and
    the plan kernel checks the ids (the max block id is then -1).
    """
    geo = CacheGeometry(INT32_MAX, dec.block_size, dec.num_kv_heads, dec.head_dim)
    xp = array_module(block_tables, seq_lens)
    ids = ids or strict(validate)
    bt, sl = check_block_tables(block_tables, seq_lens, geo, xp,
                                extra_tokens=int(bool(append)),
                                contents=xp is np or strict(validate), ids=ids)
    if block_tables.shape[0] > dec.max_batch:
        raise ValueError(f"block_tables: expected at most max_batch={dec.max_batch} "
                         f"sequences, got {block_tables.shape[0]}")
    check_num_splits(num_splits)
    if sl is None or not ids:
        return bt, sl, -1
    return bt, sl, planned_max_block(bt, sl, dec.block_size, append)


def check_run(dec, step, q, k_cache, v_cache, sinks, alibi_slopes, k_new, v_new, out, lse,
              k_scale=None, v_scale=None):
    """Checks of ``PagedDecoder.run`` against decoder ``dec`` and its plan ``step`` (shapes,
    dtypes, modules, the caches' format; no sync); returns ``(xp, options, scale fields or
    None)``."""
    if step is None:
        raise ValueError("PagedDecoder.run: expected a plan() first, got none")
    xp = array_module(q, k_cache, v_cache, sinks, alibi_slopes, k_new, v_new, out, lse)
    if xp is not dec._xp:
        raise TypeError(f"q: expected {dec._xp.__name__} arrays like the plan, got "
                        f"{xp.__name__} arrays")
    shape = (step.batch, dec.num_q_heads, dec.head_dim)
    check_array("q", q, shape=shape, dtypes=dec.dtype, xp=xp, contiguous=False)
    token_stride("q", q)
    geo, fmt = check_caches(q, k_cache, v_cache, dec.layout, xp, dec.kv_dtype)
    if fmt is not None and dec.kv_dtype is None:
        raise ValueError(f"k_cache: expected caches of dtype {dec.dtype} (the decoder's "
                         f"kv_dtype None), got {k_cache.dtype}; build the PagedDecoder with "
                         f"kv_dtype={fmt.name!r}")
    scales = check_scale_arrays(fmt, k_scale, v_scale, geo.num_kv_heads, xp)
    if (geo.block_size, geo.num_kv_heads) != (dec.block_size, dec.num_kv_heads):
        raise ValueError(f"k_cache: expected block_size {dec.block_size} and "
                         f"{dec.num_kv_heads} kv heads like the decoder, got "
                         f"{geo.block_size} and {geo.num_kv_heads}")
    if step.max_block >= geo.num_blocks:
        raise ValueError(f"block_tables: expected block ids below {geo.num_blocks} (the "
                         f"cache's blocks), the plan reads block {step.max_block}")
    if check_new_kv(k_new, v_new, step.batch, geo, dec.dtype, xp) != step.append:
        raise ValueError(f"k_new, v_new: expected them {'' if step.append else 'not '}"
                         f"given, as planned with append={step.append}")
    opts = check_options(xp, dec.num_q_heads, dec.head_dim, sm_scale=dec._opts.sm_scale,
                         window_left=dec._opts.window_left, alibi_slopes=alibi_slopes,
                         sinks=sinks, logits_soft_cap=dec._opts.logits_soft_cap)
    if out is not None:
        check_out(out, shape, dec.dtype, xp)
    check_lse(lse, step.batch, dec.num_q_heads, xp)
    return xp, opts, scales


def planned_max_block(block_tables, seq_lens, block_size, append):
    """Largest block id read for ``seq_lens (+1 with append)`` tokens, -1 if none."""
    need = -(-(np.asarray(seq_lens, np.int64) + bool(append)) // block_size)
    used = np.arange(block_tables.shape[1])[None, :] < need[:, None]
    return int(block_tables[used].max(initial=-1))
