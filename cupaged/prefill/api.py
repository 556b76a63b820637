"""Prefill attention: ragged (varlen) batches and paged caches, on tensor cores.

``varlen_prefill`` attends packed query rows to packed key/value rows; ``paged_prefill``
attends new query tokens to paged caches that already hold them (chunked prefill, prefix
reuse); ``paged_attention`` is the same op for batches mixing decode rows (``q_len = 1``)
and prefill rows, run by the same unified kernel (GQA heads are packed into the rows of a
tile, so a decode row fills a tile with its query-head group); ``PagedPrefiller`` does the
host work once per batch step (``plan``) and only launches per layer (``run``).

NumPy inputs run ``cupaged.reference.attention``; CuPy inputs run ``kernels_cu/prefill.cu``:
fp16/bf16 on tensor cores (mma.sync m16n8k16, FlashAttention-2 style), fp32 on a simple
CUDA-core path (correct, not tuned). Paged caches may be fp8 (``kv_dtype``, ``k_scale``,
``v_scale``: docs/design.md, "fp8 caches"): both kernels read them with float16/bfloat16 q
at head sizes ``prefill.plan.FP8_HEAD_DIMS``, widening the tiles to 16 bits on the way to
the tensor cores. ``backend="wgmma"`` runs ``kernels_cu/prefill_sm90.cu``
instead (Hopper warpgroup MMA, sm_90 only; fp16/bf16, every head size, layout and score
option); ``"auto"`` picks it on sm_90 for fp16/bf16 when the layout is in
``prefill.plan.WGMMA_AUTO`` (every layout), else the mma.sync kernel (docs/prefill.md,
"Kernel choice"). Kernel choice, argument records and launches live in
``cupaged.prefill.launch``.
"""
from __future__ import annotations

import numpy as np

from ..core import errors
from . import plan as plan_
from ..core.arrays import (CallCache, accepts_dlpack, array_module, as_dtype, check_array,
                           check_choice, check_head_dim, empty, float32, gpu_available, hot)
from ..core.checks import (INT32_MAX, check_aligned, check_block_tables, check_cu_seqlens,
                           check_gqa, check_int, check_lse, check_options, check_out,
                           token_stride)
from ..core.device import Uploader
from ..core.fp8 import (check_scale_arrays, fp8_format, given_kv_dtype, resolve_kv_dtype,
                        scale_parts)
from ..core.launch import current_stream, ptr
from ..core.layouts import (CACHE_DTYPES, CacheGeometry, accepts_cache, cache_geometry,
                            cache_strides, layout_strides, resolve_layout)
from ..reference import attention as ref
from ..decode.launch import row_map_buffers
from .launch import (Launches, addresses, can_split, choose_backend, gather_buffers,
                     gather_launches, gatherable, gathers_by_default, host_work, split_launches,
                     work_capacity)

__all__ = ["varlen_prefill", "paged_prefill", "paged_attention", "PagedPrefiller"]

def _outputs(q, out, return_lse, xp):
    out = empty(xp, q.shape, q.dtype) if out is None else out
    lse = empty(xp, q.shape[:2], np.float32) if return_lse else None
    return out, lse


def _finish(result, out, return_lse):
    """Reference result, copied into ``out`` when the caller gave one."""
    res, lse = result if return_lse else (result, None)
    if out is not None:
        out[...] = res
        res = out
    return (res, lse) if return_lse else res


def _into_lse(result, lse, return_lse):
    """A reference ``(out, lse)`` result with its LSE copied into the caller's ``lse``
    buffer when one is given; ``out`` alone unless ``return_lse``."""
    if lse is None:
        return result
    res, values = result
    lse[...] = values
    return (res, lse) if return_lse else res


def _ref_options(opts, causal):
    return dict(causal=causal, sm_scale=opts.sm_scale, window_left=opts.window_left,
                alibi_slopes=opts.alibi_slopes, sinks=opts.sinks,
                logits_soft_cap=opts.logits_soft_cap)


def _check_common(xp, q, causal, return_lse, out, options, **keys_values):
    """The checks every prefill call shares: flags, options, ``out`` and, for device
    arrays, the 16-byte alignment of q, out and ``keys_values``."""
    causal = plan_.check_flag("causal", causal)
    return_lse = plan_.check_flag("return_lse", return_lse)
    opts = check_options(xp, q.shape[1], q.shape[2], **options)
    if out is not None:
        check_out(out, tuple(q.shape), q.dtype, xp)
    if xp is not np:
        check_aligned(q=q, out=out, **keys_values)
    return causal, return_lse, opts


# ----------------------------------------------------------------------------- ragged
def varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                   causal=True, sm_scale=None, window_left=-1, alibi_slopes=None, sinks=None,
                   logits_soft_cap=0.0, out=None, return_lse=False, backend="auto",
                   validate=None):
    """Attention over a ragged batch packed along the token axis.

    Parameters
    ----------
    q : array
        ``[total_q, num_q_heads, head_dim]`` float16, bfloat16 or float32; head_dim in
        (64, 80, 96, 112, 128, 256). Token rows may be strided (heads dense): views of a
        fused qkv tensor go in without a copy; so may k's and v's.
    k, v : array
        ``[total_k, num_kv_heads, head_dim]``, q's dtype; ``num_q_heads % num_kv_heads == 0``.
    cu_seqlens_q, cu_seqlens_k : array
        int32 ``[batch_size + 1]`` prefix sums of query / key lengths (0 allowed), from 0,
        ending at most at ``total_q`` / ``total_k``; query rows past the last entry are
        padding and come out as zeros.
    max_seqlen_q, max_seqlen_k : int, optional
        Hints; when given (and the prefix sums are checked on the host) they must be >= the
        longest sequence.
    causal : bool
        Query ``i`` of a sequence sits at ``p = kv_len - q_len + i`` and sees keys ``j <= p``.
    sm_scale : float, optional
        Default ``head_dim ** -0.5``.
    window_left : int
        ``w >= 0`` also hides keys ``j < p - w``; -1: no window.
    alibi_slopes, sinks : array, optional
        float32 ``[num_q_heads]``: ALiBi slopes (adds ``slope * (j - p)``) and raw sink logits.
    logits_soft_cap : float
        ``c > 0`` maps scores to ``c * tanh(s / c)``.
    out : array, optional
        ``[total_q, num_q_heads, head_dim]`` in q's dtype, written in place.
    return_lse : bool
        Also return the float32 natural-log LSE ``[total_q, num_q_heads]`` (with the sink).
    backend : {"auto", "mma", "wgmma"}
        Kernel family for CuPy inputs: "mma" the mma.sync kernel (any GPU); "wgmma" the
        Hopper warpgroup-MMA kernel (sm_90 only; fp16/bf16, every head size, layout and
        option; ValueError for float32 or another GPU); "auto" the wgmma kernel on sm_90
        for fp16/bf16 and the layouts in ``prefill.plan.WGMMA_AUTO`` (ragged K/V and every
        cache layout, docs/prefill.md), else "mma".
    validate : bool, optional
        Check device prefix sums on the host first (strict mode; default
        ``CUPAGED_STRICT``); otherwise the plan kernel checks them on the device (see
        ``cupaged.errors``: bad rows come out as zeros, ``check_errors()`` raises).

    Returns
    -------
    out : array
        ``[total_q, num_q_heads, head_dim]``; zeros for rows with no visible key.
    lse : array
        float32 ``[total_q, num_q_heads]``, only with ``return_lse``.
    """
    arrays = (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, out)
    call = hot(errors.strict(validate), arrays, "ragged", causal, sm_scale, window_left,
               logits_soft_cap, bool(return_lse), backend)
    if call is not None:
        hit = _CALLS.get(call.key)
        if hit is not None:  # checked and set up by an earlier call of this signature
            return _run_hot(hit, call, q, out, return_lse)
    return _varlen_checked(*arrays, max_seqlen_q, max_seqlen_k, causal, sm_scale, window_left,
                           logits_soft_cap, return_lse, backend, validate,
                           call.key if call is not None else None)


@accepts_dlpack
def _varlen_checked(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, out, max_seqlen_q,
                    max_seqlen_k, causal, sm_scale, window_left, logits_soft_cap, return_lse,
                    backend, validate, cache_key):
    """varlen_prefill's checks, its launches' setup (cached under ``cache_key`` when planned
    on the device) and its launches."""
    xp = array_module(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, out)
    contents = xp is np or errors.strict(validate)
    cu_q, cu_k = plan_.check_ragged(q, k, v, cu_seqlens_q, cu_seqlens_k, xp, contents)
    if contents:
        plan_.check_max_seqlen("max_seqlen_q", max_seqlen_q, np.diff(cu_q))
        plan_.check_max_seqlen("max_seqlen_k", max_seqlen_k, np.diff(cu_k))
    causal, return_lse, opts = _check_common(
        xp, q, causal, return_lse, out, dict(sm_scale=sm_scale, window_left=window_left,
                                             alibi_slopes=alibi_slopes, sinks=sinks,
                                             logits_soft_cap=logits_soft_cap), k=k, v=v)
    backend = choose_backend(backend, q.dtype, q.shape[2], "ragged", opts, xp)
    if xp is np:
        return _finish(ref.varlen_prefill(q, k, v, cu_q, cu_k, return_lse=return_lse,
                                          **_ref_options(opts, causal)), out, return_lse)
    hk, head_dim = int(k.shape[1]), int(q.shape[2])
    strides = layout_strides("ragged", 1, hk, head_dim, q.itemsize)._replace(
        k_tok=token_stride("k", k), v_tok=token_stride("v", v))
    work = None
    if cu_q is not None:  # strict mode: a host work list
        work = xp.asarray(host_work(np.diff(cu_q), np.diff(cu_k), q.dtype, q.shape[1], hk, head_dim,
                                False, causal, opts, backend=backend))
    run = Launches(q, cu_seqlens_q.shape[0] - 1, None, 1, 0, k.shape[0], hk, strides, opts,
                    causal, False, backend, work=work)
    if work is None:
        _CALLS.put(cache_key, run)
    return _run(run, q, out, return_lse, (q, k, v, cu_seqlens_q, cu_seqlens_k, None,
                                          alibi_slopes, sinks))


def _run(run, q, out, return_lse, arrays):
    """Outputs allocated (by the caller's framework), then the call's launches; ``arrays``:
    q, k (or k_cache), v, cu_seqlens_q, the kv info (cu_seqlens_k or seq_lens), block
    tables, alibi_slopes and sinks, then k_scale and v_scale arrays (paged; None: none)."""
    import cupy
    out, lse = _outputs(q, out, return_lse, cupy)
    q, k, v, cu_q, kv_info, tables, alibi, sinks, *scales = addresses(*arrays)
    run(q, k, v, ptr(out), ptr(lse), cu_q, kv_info, tables, alibi, sinks, current_stream(),
        *scales)
    return (out, lse) if return_lse else out


def _run_hot(run, call, q, out, return_lse):
    """A cached call's launches: ``call.ptrs`` hold q, k, v, cu_seqlens_q, the kv info,
    [block tables,] alibi_slopes, sinks, [k_scale, v_scale,] and out, as the public op
    lists its arrays (the bracketed ones paged only)."""
    *ptrs, out_ptr = call.ptrs
    if len(ptrs) == 7:  # ragged: no block tables, no scales
        ptrs[5:5] = [0]
        ptrs += [0, 0]
    if out is None:
        out, out_ptr = call.empty(q.shape, run.dtype)
    lse = lse_ptr = 0
    if return_lse:
        lse, lse_ptr = call.empty(q.shape[:2], np.float32)
    q, k, v, cu_q, kv_info, tables, alibi, sinks, k_scale, v_scale = ptrs
    run(q, k, v, out_ptr, lse_ptr, cu_q, kv_info, tables, alibi, sinks, call.stream, k_scale,
        v_scale)
    return call.done((out, lse) if return_lse else out)


_CALLS = CallCache()  # device-planned prefill calls by signature


# ----------------------------------------------------------------------------- paged
def _check_caches(k_cache, v_cache, layout, xp, kv_dtype=None):
    """A cache pair in ``layout``: ``(geometry, fp8 format or None)`` (``kv_dtype``, or a
    float8 cache's own format; ``core.fp8.resolve_kv_dtype``)."""
    plan_.check_layout(layout)
    check_array("k_cache", k_cache, xp=xp, contiguous=False)
    check_array("v_cache", v_cache, xp=xp, contiguous=False)
    return (cache_geometry(k_cache, v_cache, layout, CACHE_DTYPES),
            resolve_kv_dtype(kv_dtype, k_cache, v_cache))


@accepts_cache(1)
def paged_prefill(q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, *, causal=True,
                  sm_scale=None, window_left=-1, alibi_slopes=None, sinks=None,
                  logits_soft_cap=0.0, layout=None, out=None, return_lse=False, backend="auto",
                  validate=None, kv_dtype=None, k_scale=None, v_scale=None):
    """Attention of new query tokens against paged caches (chunked prefill, prefix reuse).

    Sequence ``b``'s ``q_len`` queries are the last ``q_len`` of its ``seq_lens[b]`` cached
    tokens (bottom-right alignment); with ``q_len > seq_lens[b]`` the leading rows see no
    key under ``causal`` and give zeros.

    Parameters
    ----------
    q : array
        ``[total_q, num_q_heads, head_dim]`` float16, bfloat16 or float32.
    k_cache, v_cache : array
        Paged caches in ``layout`` (see ``cupaged.layouts``), q's dtype or fp8
        (``kv_dtype``), holding the new tokens' keys and values already.
    cu_seqlens_q : array
        int32 ``[batch_size + 1]`` query prefix sums ending at ``total_q``.
    block_tables : array
        int32 ``[batch_size, max_blocks_per_seq]``; the first ``ceil(seq_lens[b] /
        block_size)`` entries of row ``b`` are block ids, the rest unread (-1).
    seq_lens : array
        int32 ``[batch_size]`` key counts including the new tokens.
    causal, sm_scale, window_left, alibi_slopes, sinks, logits_soft_cap, out, return_lse, backend
        As in :func:`varlen_prefill` ("wgmma", and "auto" on sm_90: every layout). On the
        wgmma backend of an sm_90 device a long prefill's pages are first gathered into
        packed rows by a kernel that reads the lengths on the device, where its shapes'
        bound says that pays (docs/prefill.md, "Paged prefill by a gather"; per-stream
        scratch of up to ``prefill.plan.GATHER_MAX_BYTES``).
    validate : bool, optional
        As in :func:`varlen_prefill`, for the prefix sums, lengths and block tables (a bad
        length or block id gives its sequence's rows as zeros).
    layout : {"NHD", "HND", "vllm"}, optional
        Layout of raw cache arrays; default "NHD", refused (ValueError) when k_cache's shape
        also reads validly as HND. A cache given as a :class:`cupaged.CacheView` or
        :class:`cupaged.PagedKVCache` (in place of ``k_cache, v_cache``) brings its own
        (and an fp8 one its ``kv_dtype`` and scales).
    kv_dtype : {None, "fp8_e4m3", "fp8_e5m2"}
        The caches' format (docs/design.md, fp8 caches); None: their own dtype (a float8
        cache is in its format, a uint8 cache needs a name). The kernels read fp8 caches
        with float16 or bfloat16 q and head_dim in ``prefill.plan.FP8_HEAD_DIMS`` (64,
        128), every layout and option, both backends; the NumPy path takes every case.
    k_scale, v_scale : float or array, optional
        fp8 only (default 1.0): the cache holds ``key / k_scale``, ``value / v_scale``. A
        Python float, or a float32 array of shape ``[]`` or ``[1]`` (one scale) or
        ``[num_kv_heads]`` on q's device; arrays are read by the kernels (their values,
        finite and positive, are checked on the host only in strict mode), so a call stays
        sync-free and a captured graph follows later values.

    Returns
    -------
    out : array
        ``[total_q, num_q_heads, head_dim]``.
    lse : array
        float32 ``[total_q, num_q_heads]``, only with ``return_lse``.
    """
    return _paged(q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, causal, sm_scale,
                  window_left, alibi_slopes, sinks, logits_soft_cap, layout, out, return_lse,
                  backend, validate, kv_dtype, k_scale, v_scale, None)


def _paged(q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, causal, sm_scale,
           window_left, alibi_slopes, sinks, logits_soft_cap, layout, out, return_lse, backend,
           validate, kv_dtype, k_scale, v_scale, split):
    """paged_prefill (``split`` None) and paged_attention (``split``: its split_decode): the
    hot path, else the checks."""
    kv_dtype = given_kv_dtype(kv_dtype, k_cache)
    scale_arrays, scale_values = scale_parts(k_scale, v_scale)
    arrays = (q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, alibi_slopes, sinks,
              *scale_arrays, out)
    op = "paged" if split is None else ("mixed split" if split else "mixed")
    call = hot(errors.strict(validate), arrays, op, causal, sm_scale,
               window_left, logits_soft_cap, layout, bool(return_lse), backend, kv_dtype,
               scale_values)
    if call is not None:
        hit = _CALLS.get(call.key)
        if hit is not None:  # checked and set up by an earlier call of this signature
            return _run_hot(hit, call, q, out, return_lse)
    return _paged_checked(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                          alibi_slopes, sinks, k_scale, v_scale, out, causal, sm_scale,
                          window_left, logits_soft_cap, layout, return_lse, backend, validate,
                          kv_dtype, call.key if call is not None else None, split)


@accepts_dlpack
def _paged_checked(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, alibi_slopes,
                   sinks, k_scale, v_scale, out, causal, sm_scale, window_left, logits_soft_cap,
                   layout, return_lse, backend, validate, kv_dtype, cache_key, split=None):
    """paged_prefill's (``split`` None) and paged_attention's checks, their launches' setup
    (cached under ``cache_key`` when planned on the device) and their launches (``split``:
    decode rows on the decode launch, ``prefill.launch.split_launches``, where
    ``can_split``). paged_attention's prefill launch takes ``plan.wgmma_tile``'s tile for
    batches with decode rows where they stay on it; split off, the prefill launch takes
    paged_prefill's tile."""
    layout = resolve_layout(layout, k_cache, q)
    xp = array_module(q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, alibi_slopes,
                      sinks, out)
    geo, fmt = _check_caches(k_cache, v_cache, layout, xp, kv_dtype)
    kv = None if fmt is None else fmt.name
    plan_.check_paged_query(q, geo, k_cache.dtype, xp, kv)
    scales = check_scale_arrays(fmt, k_scale, v_scale, geo.num_kv_heads, xp, validate)
    contents = xp is np or errors.strict(validate)
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, xp, total=q.shape[0], contents=contents)
    _, kv_lens = check_block_tables(block_tables, seq_lens, geo, xp,
                                    batch=cu_seqlens_q.shape[0] - 1, contents=contents)
    causal, return_lse, opts = _check_common(
        xp, q, causal, return_lse, out, dict(sm_scale=sm_scale, window_left=window_left,
                                             alibi_slopes=alibi_slopes, sinks=sinks,
                                             logits_soft_cap=logits_soft_cap),
        k_cache=k_cache, v_cache=v_cache)
    backend = choose_backend(backend, q.dtype, geo.head_dim, layout, opts, xp)
    if xp is np:
        return _finish(ref.paged_prefill(q, k_cache, v_cache, cu_q, block_tables, seq_lens,
                                         layout=layout, return_lse=return_lse, kv_dtype=kv,
                                         k_scale=k_scale, v_scale=v_scale,
                                         **_ref_options(opts, causal)), out, return_lse)
    v_t = layout == "vllm" and q.dtype != float32
    batch = cu_seqlens_q.shape[0] - 1
    mixed = split is not None
    split = bool(split) and can_split(q, k_cache, v_cache, batch)
    # decode rows on the prefill launch take its tile for them; split off, the prefill
    # launch is paged_prefill's (the launch's default tile)
    tile = (plan_.wgmma_tile(geo.head_dim, kv, v_t, decode_rows=True)
            if mixed and not split and backend == "wgmma" else None)
    strides = cache_strides(k_cache, v_cache, layout, geo)
    gather = not mixed and _gathers(q, geo, strides, batch, block_tables.shape[1], cu_q,
                                    kv_lens, causal, opts, backend, kv)
    work = rows = None
    if cu_q is not None:  # strict mode: a host work list (and the decode rows' map)
        q_lens = np.diff(cu_q)
        if split:
            q_lens, rows = plan_.decode_rows(cu_q)
            rows = xp.asarray(rows)
        work = xp.asarray(host_work(q_lens, kv_lens, q.dtype, q.shape[1], geo.num_kv_heads,
                                    geo.head_dim, v_t and not gather, causal, opts,
                                    backend=backend, kv=None if gather else kv))
    if gather:
        tokens = (int(np.sum(kv_lens, dtype=np.int64)) if work is not None else
                  batch * block_tables.shape[1] * geo.block_size)
        rows = gather_buffers("prefill", tokens, batch, geo.num_kv_heads, geo.head_dim, q.dtype)
        run = gather_launches(q, batch, block_tables, geo, strides, opts, causal, backend, kv,
                              scales, rows, work=work)
    elif split:
        run = split_launches(q, k_cache, v_cache, batch, block_tables, geo, layout, opts, causal,
                             v_t, backend, kv, scales, work=work, rows=rows, tile=tile)
    else:
        run = Launches(q, batch, block_tables, geo.block_size, geo.num_blocks, 0,
                       geo.num_kv_heads, strides, opts, causal, v_t, backend, tile=tile,
                       work=work, kv=kv, scales=scales)
    if work is None:
        _CALLS.put(cache_key, run)
    return _run(run, q, out, return_lse, (q, k_cache, v_cache, cu_seqlens_q, seq_lens,
                                          block_tables, alibi_slopes, sinks,
                                          *scale_parts(k_scale, v_scale)[0]))


def _gathers(q, geo, strides, batch, width, cu_q, kv_lens, causal, opts, backend, kv):
    """Whether a paged_prefill call gathers its pages into packed rows before the ragged
    kernel (``prefill.launch.gather_launches``): on the wgmma backend of an sm_90 device,
    for caches ``gatherable`` reads but the vllm value layout (read an element at a time),
    where ``plan.gather_pays`` for its lengths (strict mode: ``cu_q`` and ``kv_lens`` on the
    host) or ``plan.gather_pays_at_bound`` for its shapes (lengths left on the device)."""
    if backend != "wgmma" or not gathers_by_default(q.dtype, strides.v_dim != 1):
        return False
    if not gatherable(strides, kv, q.itemsize, geo.block_size):
        return False
    group = q.shape[1] // geo.num_kv_heads
    window = opts.window_left
    if cu_q is not None:
        return plan_.gather_pays(np.diff(cu_q), kv_lens, group, causal, window, kv)
    row_bytes = geo.num_kv_heads * geo.head_dim * q.itemsize
    return plan_.gather_pays_at_bound(q.shape[0], batch, width * geo.block_size, group, causal,
                                      window, kv, row_bytes)


@accepts_cache(1)
def paged_attention(q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, *, causal=True,
                    sm_scale=None, window_left=-1, alibi_slopes=None, sinks=None,
                    logits_soft_cap=0.0, layout=None, out=None, return_lse=False,
                    backend="auto", validate=None, kv_dtype=None, k_scale=None, v_scale=None,
                    split_decode=True):
    """Attention for a batch mixing decode rows (``q_len = 1``) and prefill rows.

    Same arguments, semantics and results as :func:`paged_prefill`. By default the batch
    is split on the device without a host read (docs/prefill.md, "Mixed batches"): the
    prefill plan kernel lists the rows of sequences with ``q_len > 1`` for the prefill
    kernel and writes a row map of the decode rows, whose keys the split-KV decode kernel
    streams (persistent grid and merge, as :func:`cupaged.paged_decode`), reading q and
    writing out / lse through the map. Strict mode splits on the host the same way
    (``prefill.plan.decode_rows``). Every row stays on one prefill launch, on a kernel for
    batches with decode rows (``plan.wgmma_tile(..., decode_rows=True)``), with
    ``split_decode=False`` and where the decode kernel cannot take the arrays
    (``prefill.launch.can_split``: strides past 32 bits, an empty batch).

    Parameters
    ----------
    q : array
        ``[total_q, num_q_heads, head_dim]``, float16, bfloat16 or float32; sequence ``i``
        owns rows ``[cu_seqlens_q[i], cu_seqlens_q[i + 1])`` (1 row for a decode row), the
        last ``q_len_i`` of its ``seq_lens[i]`` positions; rows past ``cu_seqlens_q[-1]``
        are padding (zeros out).
    k_cache, v_cache : array
        Paged caches in ``layout``, q's dtype or fp8 (``kv_dtype``), already holding the
        new tokens.
    cu_seqlens_q : array
        int32 ``[batch + 1]`` query prefix sums.
    block_tables : array
        int32 ``[batch, max_blocks_per_seq]``, -1 padded.
    seq_lens : array
        int32 ``[batch]`` keys per sequence, new tokens included.
    causal, sm_scale, window_left, alibi_slopes, sinks, logits_soft_cap, layout, out, \
return_lse, backend, validate, kv_dtype, k_scale, v_scale
        As in :func:`paged_prefill` (``backend`` picks the prefill kernel; the decode rows
        take ``paged_decode``'s "auto" kernel).
    split_decode : bool
        Decode rows on the split-KV decode launch (the default), or all rows on one
        prefill launch.

    Returns
    -------
    out : array
        ``[total_q, num_q_heads, head_dim]`` in q's dtype.
    lse : array
        float32 ``[total_q, num_q_heads]``; only with ``return_lse``.
    """
    split = plan_.check_flag("split_decode", split_decode)
    return _paged(q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, causal, sm_scale,
                  window_left, alibi_slopes, sinks, logits_soft_cap, layout, out, return_lse,
                  backend, validate, kv_dtype, k_scale, v_scale, split)


# ----------------------------------------------------------------------------- plan / run
class PagedPrefiller:
    """Paged prefill planned once per batch step and run once per layer.

    ``plan`` takes a step's prefix sums, lengths and block tables. Host (NumPy) arrays are
    checked and turned into the tile work list on the host, then uploaded asynchronously
    (pinned memory) into buffers this object owns (``planner="device"``: checked and
    uploaded, the list written on the device as for device arrays). Device (CuPy) arrays
    are copied into those buffers without being read; at each ``run`` (which knows the
    cache and the output) the plan kernel checks them, zeroes the padding rows and writes
    the work list on the device, or the host does it all at ``plan`` in strict mode
    (``validate=True``, ``CUPAGED_STRICT=1``). ``run`` only checks shapes and launches: no
    host sync, no allocation beyond its outputs, no recompilation when lengths change.

    CUDA graphs: the buffers (prefix sums, lengths and tables of ``max_batch`` sequences
    ``max_blocks_per_seq`` wide, the plan kernel's scratch, the work list) sit at fixed
    addresses and grow only when a plan needs more; every launch covers their whole
    capacity (sequences past a plan's batch are empty, work items past its list return at
    once), so a ``run`` captured after one plan replays correctly after later plans that
    fit: any lengths, any batch up to ``max_batch``, tables up to ``max_blocks_per_seq``
    wide, and for a device plan the captured q's rows (rows past a plan's last prefix come
    out as zeros); a host plan needs q rows equal to its token count and at most as many
    work items as the list holds. A plan that does not fit grows the buffers, which
    invalidates captured graphs. Keep plans and runs on one stream (the plan kernel's
    scratch is the prefiller's own). ``plan`` returns the prefiller.

    Parameters
    ----------
    num_q_heads, num_kv_heads, head_dim, block_size : int
        Query heads, kv heads (dividing ``num_q_heads``), head size (64, 80, 96, 112, 128,
        256) and cache block size.
    dtype : str or dtype
        float16, bfloat16 or float32: the dtype of q and (without ``kv_dtype``) the caches.
    layout : {"NHD", "HND", "vllm"}, optional
        Cache layout; default "NHD", and then a raw cache whose shape also reads validly as
        HND is refused at ``run`` (a CacheView or PagedKVCache brings its layout).
    kv_dtype : {None, "fp8_e4m3", "fp8_e5m2"}
        The caches' fp8 format (fixed with the kernels, as FlashInfer's ``kv_data_type``;
        the scales come with each layer's ``run``); None: caches of ``dtype``. fp8 caches
        take float16 or bfloat16 ``dtype`` and head_dim in ``prefill.plan.FP8_HEAD_DIMS``
        on the device.
    causal, window_left, logits_soft_cap, sm_scale, backend
        As in :func:`paged_prefill` ("wgmma" is checked against these here, against the
        device in ``run``; one planned work list serves both kernels).
    max_batch, max_blocks_per_seq : int, optional
        Initial capacity of the buffers (sequences, block-table width); default: the first
        plan's.
    split_decode : bool
        True: decode rows (``q_len = 1``) on the split-KV decode launch, as
        :func:`paged_attention` by default (a host plan lists only the other rows and
        uploads the decode rows' map, a device plan's kernel writes both at each run; the
        decode pieces are cut on the device at each run, into buffers the prefiller owns, so
        a captured run stays valid). False (default): every row on the prefill launch (a
        batch of prefill rows needs no decode launch; needed where
        ``prefill.launch.can_split`` refuses the run's arrays after a host plan, and for
        ``gather``).
    gather : bool, optional
        Without ``split_decode``: each ``run`` first gathers the batch's keys and values into
        packed rows of ``dtype`` that the prefiller owns (fp8 codes widened exactly; the
        lengths read on the device by the gather), then runs the ragged kernel on them, with
        the fp8 scales applied as the paged kernel applies them (docs/prefill.md, "Paged
        prefill by a gather"). The rows, ``2 * rows * num_kv_heads * head_dim`` elements,
        hold a host plan's keys or, for a device plan, the capacity's bound
        (``max_batch * max_blocks_per_seq * block_size``); they grow only when a plan needs
        more, which invalidates captured graphs. None (default): on an sm_90 device where
        the batch's reuse of its keys makes it pay (``prefill.plan.gather_pays`` for a host
        plan's lengths, ``gather_pays_at_bound`` for a device plan's run), never for the
        vllm value layout; True: every plan (on any device); False: never. Caches whose
        strides are not whole 16-byte chunks are read in place
        (``prefill.launch.gatherable``).
    """

    def __init__(self, num_q_heads, num_kv_heads, head_dim, block_size, dtype="float16",
                 layout=None, *, causal=True, window_left=-1, logits_soft_cap=0.0,
                 sm_scale=None, backend="auto", max_batch=None, max_blocks_per_seq=None,
                 kv_dtype=None, split_decode=False, gather=None):
        self.num_q_heads = check_int("num_q_heads", num_q_heads)
        self.num_kv_heads = check_int("num_kv_heads", num_kv_heads)
        self.block_size = check_int("block_size", block_size)
        check_head_dim("head_dim", head_dim)
        check_gqa(self.num_q_heads, self.num_kv_heads, "num_kv_heads")
        self.head_dim = int(head_dim)
        self.dtype = as_dtype(dtype)
        self.layout_given = layout is not None
        self.layout = plan_.check_layout("NHD" if layout is None else layout)
        self._v_transposed = self.layout == "vllm" and self.dtype != float32
        self.kv_dtype = None if kv_dtype is None else fp8_format(kv_dtype).name
        self.causal = plan_.check_flag("causal", causal)
        self._options = dict(sm_scale=sm_scale, window_left=window_left,
                             logits_soft_cap=logits_soft_cap)
        self._opts = check_options(np, self.num_q_heads, self.head_dim, **self._options)
        plan_.resolve_backend(backend, plan_.wgmma_unsupported(self.dtype, self.head_dim,
                                                               self.layout, self._opts))
        self.backend = backend
        self._host = self._device = None
        self._buffers = None
        self._caps = (0 if max_batch is None else check_int("max_batch", max_batch),
                      0 if max_blocks_per_seq is None
                      else check_int("max_blocks_per_seq", max_blocks_per_seq), 0)
        self.split_decode = plan_.check_flag("split_decode", split_decode)
        self.gather = None if gather is None else plan_.check_flag("gather", gather)
        if self.gather and self.split_decode:
            raise ValueError("gather: expected False or None with split_decode=True (the split "
                             "plan reads decode rows in place), got True")
        if self.gather and self.dtype == float32:
            raise ValueError("gather: expected False or None for float32 (packed rows are "
                             "16-bit), got True")
        self._rows = None  # the gather's packed rows and offsets (owned, grown only)
        self._decode_owned = (None, None)  # (geometry key, decode buffers) of split runs
        self._retired = []  # replaced decode buffers (graphs captured earlier point at them)
        self._uploader = Uploader()
        self._runs = CallCache()  # launch setups of this plan by run signature

    @property
    def _tile(self):
        return plan_.launch_tile(self.dtype, self.head_dim, self._v_transposed)

    @accepts_dlpack
    def plan(self, cu_seqlens_q, block_tables, seq_lens, *, validate=None, planner=None):
        """Check a batch step and prepare its work list.

        Parameters
        ----------
        cu_seqlens_q : array
            int32 ``[batch_size + 1]`` query prefix sums (decode rows have length 1).
        block_tables : array
            int32 ``[batch_size, max_blocks_per_seq]``, -1 padded.
        seq_lens : array
            int32 ``[batch_size]`` key counts including the new tokens.
        validate : bool, optional
            Strict mode for device arrays (see the class notes).
        planner : {"host", "device"}, optional
            Who writes the work list of host arrays: the host at ``plan`` (default) or the
            plan kernel at each ``run`` (q may then have more rows than the plan's tokens,
            as for device arrays). Device arrays are planned on the device (on the host in
            strict mode).

        Returns
        -------
        PagedPrefiller
            This prefiller.
        """
        if planner is not None:
            check_choice("planner", planner, ("host", "device"))
        xp = array_module(cu_seqlens_q, block_tables, seq_lens)
        self._runs.clear()
        contents = xp is np or errors.strict(validate)
        cu = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, xp, contents=contents)
        geo = CacheGeometry(INT32_MAX, self.block_size, self.num_kv_heads, self.head_dim)
        batch = cu_seqlens_q.shape[0] - 1
        bt, sl = check_block_tables(block_tables, seq_lens, geo, xp, batch=batch,
                                    contents=contents)
        if not contents:
            self._host = dict(cu=None, bt=None, sl=None, total_q=None, max_block=-1,
                              gather=None)
            self._device = self._take(cu_seqlens_q, block_tables, seq_lens)
            return self
        cu, bt, sl = (np.array(a, np.int32) for a in (cu, bt, sl))  # the plan's own copies
        used = np.arange(bt.shape[1])[None, :] < -(-sl.astype(np.int64) // self.block_size)[:, None]
        on_host = planner != "device"
        q_lens, rows = np.diff(cu), None
        if on_host and self.split_decode:
            q_lens, rows = plan_.decode_rows(cu)
        gather = self._gathers(q_lens, sl) if on_host else None  # a device plan: at run
        # a gathered batch's list is the ragged kernel's (packed 16-bit rows; the same items)
        work = host_work(q_lens, sl, self.dtype, self.num_q_heads, self.num_kv_heads,
                         self.head_dim, self._v_transposed and not gather, self.causal,
                         self._opts, kv=None if gather else self.kv_dtype) if on_host else None
        self._host = dict(cu=cu, bt=bt, sl=sl, total_q=int(cu[-1]) if on_host else None,
                          max_block=int(bt[used].max()) if used.any() else -1, gather=gather)
        self._device = self._upload(work, cu, sl, bt, rows) if gpu_available() else None
        if gather and self._device is not None:
            self._gather_rows(int(np.sum(sl, dtype=np.int64)))
        return self

    @property
    def gathers(self):
        """Whether runs of the last plan gather the batch's pages into packed rows first
        (``gather``; for a device plan, known from its first run, None before; caches are
        read in place where ``prefill.launch.gatherable`` refuses them)."""
        return None if self._host is None else self._host.get("gather")

    def _gathers(self, q_lens, kv_lens):
        """The ``gather`` choice for a host plan of these lengths."""
        if not self._may_gather():
            return bool(self.gather)
        return plan_.gather_pays(q_lens, kv_lens, self.num_q_heads // self.num_kv_heads,
                                 self.causal, self._opts.window_left, self.kv_dtype)

    def _gathers_at_bound(self, total_q, batch, width):
        """The ``gather`` choice for a device plan's run over ``total_q`` query rows at the
        capacity (``batch`` sequences of tables ``width`` wide)."""
        if not self._may_gather():
            return bool(self.gather)
        row_bytes = self.num_kv_heads * self.head_dim * self.dtype.itemsize
        return plan_.gather_pays_at_bound(total_q, batch, width * self.block_size,
                                          self.num_q_heads // self.num_kv_heads, self.causal,
                                          self._opts.window_left, self.kv_dtype, row_bytes)

    def _may_gather(self):
        """Whether ``gather=None`` leaves the choice to the batch (no split, and
        ``prefill.launch.gathers_by_default``)."""
        return (self.gather is None and not self.split_decode
                and gathers_by_default(self.dtype, self._v_transposed and self.block_size > 1))

    def _gather_rows(self, tokens):
        """The gather's packed rows and offsets, grown (only) to ``tokens`` rows and the
        capacity's sequences (a new buffer drops the run setups that held the old)."""
        n_seq = self._caps[0]
        have = self._rows
        if have is None or have["cu_k"].shape[0] < n_seq + 1 or have["k"].shape[0] < tokens:
            import cupy  # the pool, as _grow's buffers: a prefiller a step reuses its memory
            rows = max(tokens, 1 if have is None else have["k"].shape[0])
            shape = (rows, self.num_kv_heads, self.head_dim)
            self._rows = dict(k=cupy.empty(shape, np.uint16), v=cupy.empty(shape, np.uint16),
                              cu_k=cupy.empty(n_seq + 1, np.int32))
            self._runs.clear()
        return self._rows

    def _grow(self, batch, width, items):
        """The owned buffers, grown (only) to hold ``batch`` sequences, tables ``width`` wide
        and ``items`` work items: ``meta`` int32 ``[cu (S + 1) | lens (S) | tables (S * W) |
        plan scratch (1 + 2 S) | done (1) | decode rows' map (S)]`` and ``work`` int32
        ``[N, 4]``, zeroed when made
        (the plan kernel's flag and counter start at 0 and are re-armed by it); views of
        their parts at the capacity ``(S, W, N)``."""
        import cupy
        old = self._caps
        caps = tuple(max(a, b) for a, b in zip(old, (batch, width, items)))
        n_seq, n_width, n_items = caps
        b = self._buffers
        if b is None or caps[:2] != old[:2]:
            meta = cupy.zeros(2 * n_seq + 1 + n_seq * n_width + 3 * n_seq + 2, np.int32)
        else:
            meta = b["meta"]
        work = b["work"] if b is not None and n_items == old[2] else cupy.zeros((max(n_items, 1), 4), np.int32)
        self._caps = caps
        t = 2 * n_seq + 1
        s = t + n_seq * n_width
        views = dict(meta=meta, work=work, cu=meta[:n_seq + 1], sl=meta[n_seq + 1:t],
                     bt=meta[t:s].reshape(n_seq, n_width), scratch=meta[s:s + 1 + 2 * n_seq],
                     done=meta[s + 1 + 2 * n_seq:s + 2 + 2 * n_seq],
                     rows=meta[s + 2 + 2 * n_seq:s + 2 + 3 * n_seq])
        views.update(cu_ptr=ptr(views["cu"]), sl_ptr=ptr(views["sl"]), bt_ptr=ptr(views["bt"]))
        self._buffers = views
        return views

    def _upload(self, work, cu, sl, bt, rows=None):
        """One asynchronous host-to-device copy of the planned arrays, padded to the
        capacity: prefix sums repeat the last one, lengths 0, tables -1, (a host work
        list) items of sequence -1 and (split) the decode rows' map -1."""
        batch, width = bt.shape
        d = self._grow(batch, width, 0 if work is None else len(work))
        n_seq, n_width, n_items = self._caps
        head = np.full(2 * n_seq + 1 + n_seq * n_width, -1, np.int32)
        head[:n_seq + 1] = cu[-1]
        head[:batch + 1] = cu
        head[n_seq + 1:2 * n_seq + 1] = 0
        head[n_seq + 1:n_seq + 1 + batch] = sl
        head[2 * n_seq + 1:].reshape(n_seq, n_width)[:batch, :width] = bt
        parts = [(ptr(d["meta"]), head.nbytes, head)]
        if work is not None:
            items = np.full((d["work"].shape[0], 4), -1, np.int32)
            items[:len(work)] = work
            parts.append((ptr(d["work"]), items.nbytes, items.ravel()))
        if rows is not None:
            image = np.full(n_seq, -1, np.int32)
            image[:batch] = rows
            parts.append((ptr(d["rows"]), image.nbytes, image))
        self._uploader.upload_rows(parts)
        return d

    def _take(self, cu_seqlens_q, block_tables, seq_lens):
        """Copies of device arrays in the owned buffers (no host read), padded on the
        device to the capacity as :meth:`_upload` pads (table columns past the plan's
        width -1, so that a length beyond them fails the plan kernel's id check); the work
        list is written on the device at run."""
        import cupy
        batch, width = block_tables.shape
        d = self._grow(batch, width, 0)
        n_seq, n_width, _ = self._caps
        rt, stream = cupy.cuda.runtime, cupy.cuda.get_current_stream().ptr
        for dst, src in ((d["cu"], cu_seqlens_q), (d["sl"], seq_lens)):
            rt.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, rt.memcpyDeviceToDevice, stream)
        if batch < n_seq:
            d["cu"][batch + 1:] = d["cu"][batch]  # a device-side broadcast: no host read
            d["sl"][batch:] = 0
        if batch and width:
            rt.memcpy2DAsync(d["bt"].data.ptr, n_width * 4, block_tables.data.ptr,
                             block_tables.strides[0] if batch > 1 else width * 4, width * 4,
                             batch, rt.memcpyDeviceToDevice, stream)
        if width < n_width:
            d["bt"][:batch, width:] = -1
        return d

    def _launches(self, q, geo, k_cache, v_cache, opts, backend, scales):
        """The launches of a run over the owned buffers: the host work list, or the plan
        kernel over every sequence of the capacity writing a list of at least
        :func:`~cupaged.prefill.launch.work_capacity` items (grown here when q has more rows
        than any earlier run's); split (``split_decode``): with the decode launch of the
        decode rows (``prefill.launch.split_launches``)."""
        n_seq = self._caps[0]
        host_planned = self._host["total_q"] is not None
        split = self.split_decode and can_split(q, k_cache, v_cache, n_seq)
        if host_planned and self.split_decode and not split and q.shape[0] and n_seq:
            raise ValueError("k_cache: expected block strides and a q row stride within 2^31 "
                             "- 1 elements for a split plan (prefill.launch.can_split); build "
                             "the PagedPrefiller with split_decode=False for these arrays")
        if not host_planned:
            need = work_capacity(q.shape[0], n_seq, self.num_q_heads // self.num_kv_heads,
                                 self.num_kv_heads, self._tile.block_m)
            if need > self._caps[2]:
                self._runs.clear()
                self._device = self._grow(0, 0, need)
        d = self._device
        work = d["work"] if host_planned else None
        owned = None if host_planned else (d["work"], d["scratch"], d["done"])
        strides = cache_strides(k_cache, v_cache, self.layout, geo)
        if not host_planned:
            self._host["gather"] = self._gathers_at_bound(q.shape[0], n_seq, self._caps[1])
        if self._host["gather"] and gatherable(strides, self.kv_dtype, q.itemsize,
                                               self.block_size):
            rows = (self._rows if host_planned else
                    self._gather_rows(n_seq * self._caps[1] * self.block_size))
            return gather_launches(q, n_seq, d["bt"], geo, strides, opts, self.causal, backend,
                                   self.kv_dtype, scales, rows, work=work, owned=owned,
                                   name="prefiller")
        if split:
            return split_launches(q, k_cache, v_cache, n_seq, d["bt"], geo, self.layout, opts,
                                  self.causal, self._v_transposed, backend, self.kv_dtype,
                                  scales, work=work, rows=d["rows"], owned=owned,
                                  decode_buffers=self._decode_buffers, name="prefiller")
        return Launches(q, n_seq, d["bt"], self.block_size, geo.num_blocks, 0,
                        self.num_kv_heads, strides, opts, self.causal, self._v_transposed,
                        backend, work=work, name="prefiller", owned=owned, kv=self.kv_dtype,
                        scales=scales)

    def _decode_buffers(self, launch, batch):
        """The split runs' decode buffers (``decode.launch.row_map_buffers``), owned and
        kept while the capacity and decode geometry stay (a captured run stays valid)."""
        key = (batch, launch.columns, launch.row_groups, launch.heads_per_group,
               launch.head_dim)
        have, buffers = self._decode_owned
        if have != key:
            if buffers is not None:
                self._retired.append(buffers)
            buffers = row_map_buffers(launch, batch)
            self._decode_owned = (key, buffers)
        return buffers

    def _check_run(self, q, k_cache, v_cache, xp):
        if self._host is None:
            raise ValueError("PagedPrefiller.run: expected plan() to be called first, got no plan")
        geo, fmt = _check_caches(k_cache, v_cache, self.layout, xp, self.kv_dtype)
        if fmt is not None and self.kv_dtype is None:
            raise ValueError(f"k_cache: expected caches of dtype {self.dtype} (the prefiller's "
                             f"kv_dtype None), got {k_cache.dtype}; build the PagedPrefiller "
                             f"with kv_dtype={fmt.name!r}")
        want = (self.block_size, self.num_kv_heads, self.head_dim)
        if tuple(geo[1:]) != want:
            raise ValueError(f"k_cache: expected (block_size, num_kv_heads, head_dim) {want} as "
                             f"planned, got {tuple(geo[1:])}")
        if self._host["max_block"] >= geo.num_blocks:
            raise ValueError(f"block_tables: planned block id {self._host['max_block']} is out of "
                             f"range for a cache of {geo.num_blocks} blocks")
        total_q, cu = self._host["total_q"], self._host["cu"]
        check_array("q", q, shape=(total_q, self.num_q_heads, self.head_dim), dtypes=self.dtype,
                    xp=xp, contiguous=False)
        if cu is not None and q.shape[0] < cu[-1]:  # a device planner of host arrays
            raise ValueError(f"q: expected at least {int(cu[-1])} rows (the plan's tokens), "
                             f"got {q.shape[0]}")
        plan_.check_paged_query(q, geo, k_cache.dtype, xp, self.kv_dtype)
        return geo, fmt

    @accepts_cache(2, owner=True)
    def run(self, q, k_cache, v_cache=None, *, sinks=None, alibi_slopes=None, out=None, lse=None,
            return_lse=False, k_scale=None, v_scale=None):
        """Attention of the planned batch for one layer.

        Parameters
        ----------
        q : array
            ``[total_q, num_q_heads, head_dim]`` in the planned dtype (token rows may be
            strided); for a device plan, any number of rows (those past the last prefix are
            padding: zeros).
        k_cache, v_cache : array
            Paged caches in the planned layout, geometry and format (``kv_dtype``).
        sinks, alibi_slopes : array, optional
            float32 ``[num_q_heads]``.
        out : array, optional
            ``[total_q, num_q_heads, head_dim]``, written in place.
        lse : array, optional
            float32 ``[total_q, num_q_heads]`` LSE buffer, written when given.
        return_lse : bool
        k_scale, v_scale : float or array, optional
            The layer's fp8 scales (the prefiller's ``kv_dtype``), as in
            :func:`paged_prefill`.

        Returns
        -------
        out : array
            ``[total_q, num_q_heads, head_dim]``.
        lse : array
            float32 ``[total_q, num_q_heads]``, only with ``return_lse``.
        """
        scale_arrays, scale_values = scale_parts(k_scale, v_scale)
        arrays = (q, k_cache, v_cache, alibi_slopes, sinks, *scale_arrays, out, lse)
        call = (hot(False, arrays, bool(return_lse), scale_values)
                if self._device is not None else None)
        if call is not None:
            hit = self._runs.get(call.key)
            if hit is not None:  # checked against the plan by an earlier run
                d = self._device
                qp, kp, vp, alibi, sk, ks, vs, out_ptr, lse_ptr = call.ptrs
                if out is None:
                    out, out_ptr = call.empty(q.shape, self.dtype)
                if lse is None and return_lse:
                    lse, lse_ptr = call.empty(q.shape[:2], np.float32)
                hit(qp, kp, vp, out_ptr, lse_ptr, d["cu_ptr"], d["sl_ptr"], d["bt_ptr"], alibi,
                    sk, call.stream, ks, vs)
                return call.done((out, lse) if return_lse else out)
        return self._run_checked(q, k_cache, v_cache, alibi_slopes, sinks, k_scale, v_scale,
                                 out, lse, return_lse, call.key if call is not None else None)

    @accepts_dlpack
    def _run_checked(self, q, k_cache, v_cache, alibi_slopes, sinks, k_scale, v_scale, out, lse,
                     return_lse, cache_key):
        """run's checks against the plan, its launches' setup (cached under ``cache_key``)
        and its launches."""
        xp = array_module(q, k_cache, v_cache, sinks, alibi_slopes, out, lse)
        geo, fmt = self._check_run(q, k_cache, v_cache, xp)
        scales = check_scale_arrays(fmt, k_scale, v_scale, geo.num_kv_heads, xp)
        causal, return_lse, opts = _check_common(
            xp, q, self.causal, return_lse, out,
            dict(self._options, alibi_slopes=alibi_slopes, sinks=sinks), k_cache=k_cache,
            v_cache=v_cache)
        check_lse(lse, q.shape[0], self.num_q_heads, xp)
        want_lse = return_lse or lse is not None
        backend = choose_backend(self.backend, self.dtype, self.head_dim, self.layout, opts, xp)
        h = self._host
        if xp is np:
            result = _finish(ref.paged_prefill(q, k_cache, v_cache, h["cu"], h["bt"], h["sl"],
                                               layout=self.layout, return_lse=want_lse,
                                               kv_dtype=self.kv_dtype, k_scale=k_scale,
                                               v_scale=v_scale, **_ref_options(opts, causal)),
                             out, want_lse)
            return _into_lse(result, lse, return_lse)
        out, new_lse = _outputs(q, out, want_lse and lse is None, xp)
        lse = new_lse if lse is None else lse
        run = self._launches(q, geo, k_cache, v_cache, opts, backend, scales)
        self._runs.put(cache_key, run)
        d = self._device
        run(*addresses(q, k_cache, v_cache, out, lse, d["cu"], d["sl"], d["bt"], alibi_slopes,
                       sinks), current_stream(), *addresses(*scale_parts(k_scale, v_scale)[0]))
        return (out, lse) if return_lse else out
