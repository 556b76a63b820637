"""Paged decode: one query token per sequence against a paged KV cache.

``paged_decode`` (functional), ``PagedDecoder`` (plan once per batch step, run once per
layer; no host sync in ``run``, capturable in a CUDA graph) and ``merge_states``. NumPy
inputs run the float64 reference (``cupaged.reference.attention``); CuPy inputs run
``kernels_cu/decode.cu``: the append kernel (with ``k_new``/``v_new``) and the decode
kernel, a persistent grid (one CTA per resident slot) whose CTAs stream host-planned pieces
of the sequences' keys; a sequence cut into several pieces is merged (sinks added once) by
the CTA finishing its last piece, or by a second kernel (``kernels_cu/merge.cu``, which
also holds ``merge_states``' kernel). Host planning (pieces, head
layout, strides, merge) lives in ``cupaged.decode_plan``, argument checks in
``cupaged.decode_checks``.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from . import abi, decode_checks as dc, decode_plan as dp, errors
from ._arrays import (FLOAT_DTYPES, HEAD_DIMS, CallCache, accepts_dlpack, array_module,
                      as_dtype, check_array, check_choice, check_head_dim, empty, host, is_cupy,
                      signature, stream_key)
from ._checks import check_gqa, check_options, table_stride, token_stride
from ._compile import Spec, ctype, launcher
from ._device import Uploader, current, scratch
from ._launch import ptr
from .layouts import LAYOUTS, block_stride
from .reference import attention as ref

LOG2E = 1.4426950408889634
PLAN_CTAS = 64  # CTAs of decode_plan_kernel: sequences are checked a CTA at a time


# ----------------------------------------------------------------------------- kernels
def _decode_expr(dtype, head_dim, vllm_v, head_tiles):
    return (f"cupaged::decode::paged_decode_kernel<{ctype(dtype)}, {head_dim}, "
            f"{'true' if vllm_v else 'false'}, {head_tiles}>")


def _pages_expr(dtype, head_dim, head_major=False):
    return (f"cupaged::decode::paged_decode_pages_kernel<{ctype(dtype)}, {head_dim}, "
            f"{'true' if head_major else 'false'}>")


def _launch_expr(lp, dtype):
    """The decode kernel of launch ``lp``."""
    if lp.pages:
        return _pages_expr(dtype, lp.head_dim, lp.head_major)
    return _decode_expr(dtype, lp.head_dim, lp.vllm_v, lp.tiles.head_tiles)


def _merge_expr(in_dtype, out_dtype):
    return f"cupaged::merge::merge_states_kernel<{ctype(in_dtype)}, {ctype(out_dtype)}>"


def _pieces_expr(dtype, head_dim):
    return f"cupaged::merge::merge_pieces_kernel<{ctype(dtype)}, {-(-head_dim // 128)}>"


def _append_expr(dtype):
    return f"cupaged::decode::append_kv_kernel<{ctype(dtype)}>"


PLAN_EXPR = "cupaged::plan::decode_plan_kernel"


def _decode_kernel(lp, dtype):
    return launcher("decode", _launch_expr(lp, dtype), abi.DECODE, hopper=lp.pages,
                    smem=lp.tiles.smem_bytes, carveout=True)


@functools.lru_cache(maxsize=None)
def _geometry(device_id, dtype, head_dim, layout, block_size, num_q_heads, num_kv_heads, pages):
    """The launch geometry on a device: one CTA per slot its decode kernel can hold."""
    import cupy
    from cupy_backends.cuda.api import driver
    lp = dp.plan_launch(itemsize=dtype.itemsize, head_dim=head_dim, layout=layout,
                        block_size=block_size, num_q_heads=num_q_heads,
                        num_kv_heads=num_kv_heads, pages=pages)
    with cupy.cuda.Device(device_id):
        kernel = _decode_kernel(lp, dtype)
    smem = lp.tiles.smem_bytes
    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.ptr, lp.threads, smem)
    sms = cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]
    return lp._replace(columns=max(1, sms * max(1, per_sm) // lp.row_groups))


def _current_geometry(dtype, head_dim, layout, block_size, num_q_heads, num_kv_heads, kv_path,
                      batch):
    """The launch geometry of a ``batch``-sequence step on the current device, its kernel
    path resolved from ``kv_path`` (``dp.resolve_kv_path``)."""
    dev = current()
    dtype = np.dtype(dtype)
    pages = dp.resolve_kv_path(kv_path, dev.compute_capability, dtype.itemsize, int(head_dim),
                               layout, int(block_size), int(num_q_heads), int(num_kv_heads),
                               int(batch))
    return _geometry(dev.id, dtype, int(head_dim), layout, int(block_size), int(num_q_heads),
                     int(num_kv_heads), pages)


# ----------------------------------------------------------------------------- device steps
class _DeviceStep(NamedTuple):
    """Device side of one step: geometry, kernels, and each launch's fixed arguments packed
    once (``_launch.Bound``), leaving the run's arrays (q, caches, outputs, per-head
    arrays, tables and lengths) to :func:`_launch_decode`."""
    launch: object       # decode_plan.DecodeLaunch on this device
    kernels: tuple       # Kernels: append (or None), decode, merge_pieces (or None), plan
    plan_args: object    # Bound of DECODE_PLAN (None: planned on the host)
    append_args: object  # Bound of APPEND (None: no append)
    decode_args: object  # Bound of DECODE
    merge_args: object   # Bound of MERGE_PIECES (None: the fused merge)
    merge_launch: tuple  # (grid, threads, warps a head) of merge_pieces_kernel, or None
    tables: object       # int32 [batch, >= width] block tables of a plan's own (None: the call's)
    lens: object         # int32 [batch] lengths of a plan's own (None: the call's)
    keep: tuple          # the device arrays the packed arguments point into (kept alive)


def _decode_fields(lp, num_q_heads, bt_stride, opts, fused):
    """DECODE's fixed fields of a launch (the block strides come with the caches)."""
    ks, vs = lp.k_strides, lp.v_strides
    return dict(khs=ks[1], kts=ks[2], kcs=ks[3], vhs=vs[1], vts=vs[2], vcs=vs[3], ves=vs[4],
                block_size=lp.block_size, block_magic=lp.block_magic,
                block_shift=lp.block_shift, bt_stride=bt_stride, num_q_heads=num_q_heads,
                num_kv_heads=lp.num_kv_heads, head_warps=lp.heads.head_warps,
                head_chunks=lp.heads.head_chunks, window_left=opts.window_left,
                fused_merge=int(fused), scale_log2=opts.sm_scale * LOG2E,
                sm_scale=opts.sm_scale, soft_cap=opts.logits_soft_cap, tile_tokens=lp.tiles.tile)


def _merge_launch(lp, batch, fused):
    """merge_pieces_kernel's launch for a step (None with the fused merge)."""
    return None if fused else dp.merge_launch(lp, batch)


def _partials(xp, lp, num_slots, name=None):
    """Partial rows and LSEs for ``num_slots`` slots (None, None without any); per-stream
    scratch when ``name`` is given."""
    if not num_slots:
        return None, None
    rows = num_slots * lp.row_groups * lp.heads_per_group
    if name is None:
        return xp.empty(rows * lp.head_dim, np.float32), xp.empty(rows, np.float32)
    buf = scratch(name, rows * (lp.head_dim + 1), np.float32)
    return buf[:rows * lp.head_dim], buf[rows * lp.head_dim:rows * (lp.head_dim + 1)]


def _device_step(lp, dtype, num_q_heads, head_dim, opts, merge, append, batch, bt_stride,
                 work, seq_info, lens, counters, pool, part_out, part_lse, plan_args=None,
                 tables=None, own_lens=None):
    """Kernels and fixed arguments of a step whose descriptors are at ``work``, piece info
    at ``seq_info`` and the lengths the append reads at ``lens``."""
    fused = merge == "fused"
    append_args = None
    if append:
        ks, vs = lp.k_strides, lp.v_strides
        append_args = abi.APPEND.bind(
            seq_lens=ptr(lens), bt_stride=bt_stride, block_size=lp.block_size,
            num_kv_heads=lp.num_kv_heads, head_dim=head_dim, khs=ks[1], kts=ks[2], kcs=ks[3],
            vhs=vs[1], vts=vs[2], vcs=vs[3], ves=vs[4])
    decode_args = abi.DECODE.bind(
        work=ptr(work), part_out=ptr(part_out), part_lse=ptr(part_lse),
        counters=ptr(counters) if fused else 0, pool_ctr=ptr(pool),
        **_decode_fields(lp, num_q_heads, bt_stride, opts, fused))
    merge_args = None
    if not fused:
        merge_args = abi.MERGE_PIECES.bind(
            part_out=ptr(part_out), part_lse=ptr(part_lse), seq_info=ptr(seq_info),
            num_q_heads=num_q_heads, num_kv_heads=lp.merge_kv_heads,
            head_chunks=lp.heads.head_chunks, hpc=lp.heads_per_group, dim=head_dim)
    kernels = (launcher("decode", _append_expr(dtype), abi.APPEND) if append else None,
               _decode_kernel(lp, dtype),
               None if fused else launcher("merge", _pieces_expr(dtype, lp.head_dim),
                                           abi.MERGE_PIECES),
               launcher("plan", PLAN_EXPR, abi.DECODE_PLAN) if plan_args is not None else None)
    return _DeviceStep(lp, kernels, plan_args, append_args, decode_args, merge_args,
                       _merge_launch(lp, batch, fused), tables, own_lens,
                       (work, seq_info, lens, counters, pool, part_out, part_lse, tables,
                        own_lens))


def _planned_on_device(lp, dtype, num_q_heads, head_dim, opts, merge, append, batch, width,
                       bt_stride, layout, index, counters, part_out, part_lse, tables=None,
                       own_lens=None):
    """The device step of a batch whose pieces decode_plan_kernel cuts on the device: its
    descriptors, piece info and checked lengths go into ``index`` (laid out as ``layout``,
    a ``decode_plan.DeviceIndex`` of at least the batch), its counters into ``counters``
    (zeros, re-armed by the kernels: the plan's own first, then the fused merge's, one a
    sequence and row group)."""
    stages, num, den = dp.min_piece_terms(lp, merge)
    work = index[:layout.info]
    lens = index[layout.lens:layout.lens + batch]
    plan_args = abi.DECODE_PLAN.bind(
        work=ptr(work), seq_info=ptr(index[layout.info:]), lens_out=ptr(lens),
        scratch=ptr(index[layout.scratch:]), done=ptr(counters), err=ptr(errors.error_word()),
        batch=batch, width=width, bt_stride=bt_stride, block_size=lp.block_size,
        append=int(append), window_left=opts.window_left, tile=lp.tiles.tile,
        columns=lp.columns, min_piece=stages, piece_num=num, piece_den=den)
    return _device_step(lp, dtype, num_q_heads, head_dim, opts, merge, append, batch,
                        bt_stride, work, index[layout.info:layout.info + 2 * batch], lens,
                        counters[1:], None, part_out, part_lse, plan_args, tables, own_lens)


def _launch_decode(dev, q, k_cache, v_cache, k_new, v_new, alibi, sinks, out, lse, num_blocks,
                   tables, lens):
    """Plan (when planned on the device), append (with ``k_new``), decode and, with a merge
    kernel, merge split pieces by a second kernel; all on the current stream, without a
    host sync. ``tables``/``lens``: the block tables and lengths the step reads."""
    batch, hq, d = q.shape
    lp = dev.launch
    append, decode, merge, plan = dev.kernels
    t = ptr(tables)
    if plan is not None:
        plan.launch(min(batch, PLAN_CTAS), 512,
                    dev.plan_args.pack(block_tables=t, seq_lens=ptr(lens), num_blocks=num_blocks))
    kbs, vbs = block_stride(k_cache), block_stride(v_cache)
    kp, vp = ptr(k_cache), ptr(v_cache)
    if k_new is not None:
        append.launch(batch, 128, dev.append_args.pack(
            k_new=ptr(k_new), v_new=ptr(v_new), k_cache=kp, v_cache=vp, block_tables=t,
            kbs=kbs, vbs=vbs, k_new_stride=token_stride("k_new", k_new),
            v_new_stride=token_stride("v_new", v_new)))
    decode.launch(lp.grid, lp.threads, dev.decode_args.pack(
        q=ptr(q), out=ptr(out), lse=ptr(lse), k_cache=kp, v_cache=vp, block_tables=t,
        alibi_slopes=ptr(alibi), sinks=ptr(sinks), kbs=kbs, vbs=vbs,
        q_stride=q.strides[0] // q.itemsize if batch > 1 else hq * d), lp.tiles.smem_bytes)
    if merge is not None:
        grid, threads, wph = dev.merge_launch
        merge.launch(grid, threads, dev.merge_args.pack(out=ptr(out), lse=ptr(lse),
                                                        sinks=ptr(sinks), wph=wph))


def _launch_merge(o_first, o_rest, o_strides, l_first, l_rest, l_strides, num_parts, rows,
                  heads, dim, sinks, out, lse):
    """Merge ``num_parts`` states per row into ``out`` ``[rows, dim]`` (and ``lse``)."""
    kernel = launcher("merge", _merge_expr(o_first.dtype, out.dtype), abi.MERGE_STATES)
    kernel(-(-rows // 4), 128, o_first=ptr(o_first), o_rest=ptr(o_rest),
           o_part_stride=o_strides[0], o_row_stride=o_strides[1], l_first=ptr(l_first),
           l_rest=ptr(l_rest), l_part_stride=l_strides[0], l_row_stride=l_strides[1],
           num_parts=num_parts, num_rows=rows, num_heads=heads, dim=dim, sinks=ptr(sinks),
           out=ptr(out), lse_out=ptr(lse))


def _call_step(xp, lp, c, dtype, block_tables, seq_lens, num_splits):
    """The device step of one ``paged_decode`` call (default merge), in per-stream scratch:
    planned on the device, or on the host when the lengths were checked there (strict mode)
    or a count of splits is asked for (then uploaded: a copy the call waits for)."""
    merge = dp.resolve_merge(None, lp)
    fused = merge == "fused"
    d = lp.head_dim
    if c.seq_lens_host is None and num_splits is None:
        layout = dp.DeviceIndex(c.batch, lp.columns)
        index = scratch("decode.index", layout.size)
        counters = scratch("decode.counters", 1 + c.batch * lp.row_groups, zero=True)
        part_out, part_lse = _partials(xp, lp, layout.pieces, "decode.partials")
        return _planned_on_device(lp, dtype, c.num_q_heads, d, c.options, merge, c.append,
                                  c.batch, block_tables.shape[1], table_stride(block_tables),
                                  layout, index, counters, part_out, part_lse)
    sl = c.seq_lens_host if c.seq_lens_host is not None else host(seq_lens)
    schedule, _ = dc.check_variants(None, None, num_splits)
    work = dp.plan_work(lp, sl, c.append, c.options.window_left, schedule, num_splits, merge)
    lay = dp.IndexLayout(c.batch, len(work.desc), 0)
    index = xp.asarray(dp.pack_index(lay, sl, work))
    part_out, part_lse = _partials(xp, lp, work.num_slots)
    counters = xp.zeros(c.batch * lp.row_groups, np.int32) if work.num_slots and fused else None
    pool = xp.zeros(2 * lp.row_groups, np.int32) if work.pool_pieces else None
    return _device_step(lp, dtype, c.num_q_heads, d, c.options, merge, c.append, c.batch,
                        table_stride(block_tables), index[lay.desc:lay.tables],
                        index[lay.info:lay.info + 2 * c.batch], index[:c.batch], counters,
                        pool, part_out, part_lse)


_CALLS = CallCache()  # paged_decode's device-planned calls by signature


def _result(out, lse, return_lse):
    return (out, lse) if return_lse else out


def _reference_into(o, lse, out, return_lse):
    """A reference result, copied into ``out`` when one is given."""
    if out is not None:
        out[...] = o
        o = out
    return _result(o, lse, return_lse)


# ----------------------------------------------------------------------------- public ops
@accepts_dlpack
def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, *, k_new=None, v_new=None,
                 sm_scale=None, window_left=-1, alibi_slopes=None, sinks=None,
                 logits_soft_cap=0.0, layout="NHD", num_splits=None, out=None,
                 return_lse=False, kv_path=None, validate=None):
    """Attention of one query token per sequence over its paged keys and values.

    Parameters
    ----------
    q : array
        ``[batch, num_q_heads, head_dim]``, float16, bfloat16 or float32; head_dim one of
        64, 80, 96, 112, 128, 256. Rows may be strided (heads dense), e.g. a view of a
        fused qkv tensor.
    k_cache, v_cache : array
        Paged caches in ``layout`` (``cupaged.layouts``), q's dtype, blocks dense (their
        stride may be larger: K and V as views of one allocation); updated in place when
        ``k_new`` is given.
    block_tables : array
        int32 ``[batch, max_blocks_per_seq]`` (rows may be strided); token ``t`` of sequence
        ``i`` lives in block ``block_tables[i, t // block_size]``; unused entries -1.
    seq_lens : array
        int32 ``[batch]`` cached tokens per sequence (0 allowed).
    k_new, v_new : array, optional
        ``[batch, num_kv_heads, head_dim]``: written at position ``seq_lens[i]`` first;
        the query then attends over ``seq_lens[i] + 1`` keys (seed 004's append).
    sm_scale : float, optional
        Score scale, default ``head_dim ** -0.5``.
    window_left : int
        ``w >= 0``: only keys ``j >= p - w`` are seen (``p`` the query position); -1: all.
    alibi_slopes, sinks : array, optional
        float32 ``[num_q_heads]``: ALiBi slopes; raw sink logits (one extra denominator
        term per head).
    logits_soft_cap : float
        ``c > 0`` maps scores to ``c * tanh(s / c)``.
    layout : {"NHD", "HND", "vllm"}
    num_splits : int, optional
        Cut each sequence into this many equal pieces (CuPy path; the "split" schedule of
        :meth:`PagedDecoder.plan`, planned on the host: reads the lengths back); default:
        the "balanced" schedule, planned on the device.
    out : array, optional
        ``[batch, num_q_heads, head_dim]`` in q's dtype, written and returned.
    return_lse : bool
        Also return the float32 natural-log LSE ``[batch, num_q_heads]`` (sink included).
    kv_path : {"pages", "staged"}, optional
        "pages": one CTA per SM copies whole cache blocks (``block_size`` tokens of up to 8
        kv heads: all of them, or a group of a divisor of their number, e.g. 8 of MHA's 32)
        with ``cp.async.bulk`` (sm_90+, 16-bit NHD caches with block_size a multiple or a
        divisor of 16 or HND ones with block_size a multiple of 16, head_dim 64/96/128, up
        to 8 query heads a kv head).
        "staged": 16-byte cp.async tiles of one kv head per CTA (every case). Default:
        "pages" where it applies to batches of 2 sequences or more and its CTAs serve every
        kv head or 4 of them or more, where it is the faster; else "staged". CuPy path
        only.
    validate : bool, optional
        Check the contents of device ``block_tables`` and ``seq_lens`` on the host before
        launching (strict mode; default ``CUPAGED_STRICT``). Otherwise the plan kernel
        checks them: a bad sequence's rows come out as zeros and ``cupaged.check_errors()``
        raises the first bad entry.

    Returns
    -------
    out : array
        ``[batch, num_q_heads, head_dim]`` in q's dtype; zeros for a sequence with no key.
    lse : array
        float32 ``[batch, num_q_heads]``; ``-inf`` (or the sink) for no key. Only with
        ``return_lse``.
    """
    key = None
    if is_cupy(q) and num_splits is None and not errors.strict(validate):
        key = (signature(q, k_cache, v_cache, block_tables, seq_lens, k_new, v_new, out,
                         alibi_slopes, sinks), sm_scale, window_left, logits_soft_cap, layout,
               bool(return_lse), kv_path, stream_key())
        hit = _CALLS.get(key)
        if hit is not None:  # checked and set up by an earlier call of this signature
            dev, num_blocks = hit
            return _run_step(dev, q, k_cache, v_cache, k_new, v_new, alibi_slopes, sinks, out,
                             return_lse, num_blocks, block_tables, seq_lens)
    options = dict(sm_scale=sm_scale, window_left=window_left, alibi_slopes=alibi_slopes,
                   sinks=sinks, logits_soft_cap=logits_soft_cap)
    c = dc.check_decode(q, k_cache, v_cache, block_tables, seq_lens, k_new, v_new, layout,
                        num_splits, out, options, validate)
    if kv_path is not None:
        check_choice("kv_path", kv_path, dp.KV_PATHS)
    if c.xp is np:
        o, lse = ref.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, k_new=k_new,
                                  v_new=v_new, sm_scale=c.options.sm_scale,
                                  window_left=c.options.window_left, alibi_slopes=alibi_slopes,
                                  sinks=sinks, logits_soft_cap=c.options.logits_soft_cap,
                                  layout=layout, return_lse=True)
        return _reference_into(o, lse, out, return_lse)
    if c.batch == 0:
        out = empty(c.xp, q.shape, q.dtype) if out is None else out
        lse = empty(c.xp, (0, c.num_q_heads), np.float32) if return_lse else None
        return _result(out, lse, return_lse)
    lp = _current_geometry(q.dtype, q.shape[2], layout, c.geometry.block_size, c.num_q_heads,
                           c.geometry.num_kv_heads, kv_path, c.batch)
    dev = _call_step(c.xp, lp, c, q.dtype, block_tables, seq_lens, num_splits)
    if key is not None and c.seq_lens_host is None:
        _CALLS.put(key, (dev, c.geometry.num_blocks))
    return _run_step(dev, q, k_cache, v_cache, k_new, v_new, alibi_slopes, sinks, out,
                     return_lse, c.geometry.num_blocks, block_tables, seq_lens)


def _run_step(dev, q, k_cache, v_cache, k_new, v_new, alibi, sinks, out, return_lse,
              num_blocks, tables, lens):
    """Outputs allocated (by the caller's framework), then the step's launches."""
    import cupy
    out = empty(cupy, q.shape, q.dtype) if out is None else out
    lse = empty(cupy, q.shape[:2], np.float32) if return_lse else None
    _launch_decode(dev, q, k_cache, v_cache, k_new, v_new, alibi, sinks, out, lse, num_blocks,
                   tables, lens)
    return _result(out, lse, return_lse)


@accepts_dlpack
def merge_states(out_a, lse_a, out_b, lse_b):
    """Combine two attention states over disjoint key sets into one.

    Parameters
    ----------
    out_a, out_b : array
        ``[num_tokens, num_heads, head_dim]``, one float dtype; each normalised over its
        own keys.
    lse_a, lse_b : array
        float32 ``[num_tokens, num_heads]`` natural-log LSEs; ``-inf`` marks an empty state.

    Returns
    -------
    out : array
        ``[num_tokens, num_heads, head_dim]`` in out_a's dtype; zeros where both are empty.
    lse : array
        float32 ``[num_tokens, num_heads]``.
    """
    xp = array_module(out_a, lse_a, out_b, lse_b)
    check_array("out_a", out_a, ndim=3, dtypes=FLOAT_DTYPES, xp=xp)
    t, h, d = out_a.shape
    check_array("out_b", out_b, shape=(t, h, d), dtypes=out_a.dtype, xp=xp)
    check_array("lse_a", lse_a, shape=(t, h), dtypes=np.float32, xp=xp)
    check_array("lse_b", lse_b, shape=(t, h), dtypes=np.float32, xp=xp)
    if xp is np:
        return ref.merge_states(out_a, lse_a, out_b, lse_b)
    out, lse = empty(xp, out_a.shape, out_a.dtype), empty(xp, (t, h), np.float32)
    if t * h:
        _launch_merge(out_a, out_b, (0, d), lse_a, lse_b, (0, 1), 2, t * h, h, d, None, out, lse)
    return out, lse


# ----------------------------------------------------------------------------- plan / run
class PagedDecoder:
    """Paged decode planned once per batch step and run once per layer.

    ``plan`` takes a step's block tables and lengths into buffers the decoder owns: host (NumPy)
    arrays are checked on the host and uploaded asynchronously through pinned memory, device
    (CuPy) arrays copied on the device without being read (strict mode, ``validate=True`` or
    ``CUPAGED_STRICT=1``, checks them on the host first). The pieces each CTA streams are
    then cut on the device by the plan kernel at the first ``run`` (which knows the cache it
    checks block ids against; a run captured in a CUDA graph cuts them at every replay), in
    equal shares of the sequences' key tiles; ``planner="host"`` cuts them on the host
    instead (the shares refined: whole sequences where they end about as soon, a pool of
    pieces taken at run time; about a millisecond of host time). ``run`` launches: no host
    sync, no allocation when ``out`` (and ``lse``) are given, no recompilation when lengths
    change. The grid is fixed (one CTA per resident slot) and the kernels read lengths,
    tables and work from buffers at fixed addresses, so a ``run`` captured in a CUDA graph
    stays valid after later ``plan`` calls of the same batch size, planner and merge mode
    (device and host plans lay the buffers out differently), whatever the lengths or
    schedule, until a plan outgrows a buffer (a wider table, or a "split" plan with more
    pieces than any "balanced" one). (The default kernel path depends on the batch size
    alone, so it holds too.) ``plan`` works on the current stream and returns the decoder;
    keep plans and runs on one stream.

    Parameters
    ----------
    num_q_heads, num_kv_heads, head_dim, block_size : int
        ``num_q_heads % num_kv_heads == 0``; head_dim one of 64, 80, 96, 112, 128, 256.
    dtype : str or dtype
        float16, bfloat16 or float32: q, caches and output.
    layout : {"NHD", "HND", "vllm"}
    window_left, logits_soft_cap, sm_scale
        As in :func:`paged_decode`.
    max_batch : int
        Most sequences a plan may hold.
    max_blocks_per_seq : int, optional
        Width of the device block-table buffer; default the first plan's width. A wider plan
        reallocates it (invalidating captured graphs).
    xp : module, optional
        ``cupy`` (kernels) or ``numpy`` (reference); default: the first plan's module. Give
        ``cupy`` to plan from NumPy metadata and run the kernels.
    kv_path : {"pages", "staged"}, optional
        As in :func:`paged_decode`.
    """

    def __init__(self, num_q_heads, num_kv_heads, head_dim, block_size, dtype="float16",
                 layout="NHD", window_left=-1, logits_soft_cap=0.0, sm_scale=None,
                 max_batch=256, max_blocks_per_seq=None, xp=None, kv_path=None):
        for name, v in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads),
                        ("block_size", block_size), ("max_batch", max_batch)):
            dc.check_positive(name, v)
        if max_blocks_per_seq is not None:
            dc.check_positive("max_blocks_per_seq", max_blocks_per_seq)
        check_gqa(num_q_heads, num_kv_heads, "num_kv_heads")
        check_head_dim("head_dim", head_dim)
        check_choice("layout", layout, LAYOUTS)
        if kv_path is not None:
            check_choice("kv_path", kv_path, dp.KV_PATHS)
        self._kv_path = kv_path
        self._opts = check_options(np, num_q_heads, head_dim, sm_scale=sm_scale,
                                   window_left=window_left, logits_soft_cap=logits_soft_cap)
        self.num_q_heads, self.num_kv_heads = int(num_q_heads), int(num_kv_heads)
        self.head_dim, self.block_size = int(head_dim), int(block_size)
        self.dtype, self.layout, self.max_batch = as_dtype(dtype), layout, int(max_batch)
        self._width = max_blocks_per_seq or 0
        self._xp = xp
        self._index = self._layout = self._part_out = self._part_lse = self._counters = None
        self._pool = None
        self._uploader = Uploader()
        self._step = None
        self._planned_blocks = None  # num_blocks the device plan last checked against
        self._runs = CallCache()     # run signatures already checked against the plan

    @accepts_dlpack
    def plan(self, block_tables, seq_lens, *, append=False, num_splits=None, schedule=None,
             merge=None, validate=None, planner="device"):
        """Check and take one step's block tables and lengths; plan the CTAs' work.

        Parameters
        ----------
        block_tables : array
            int32 ``[batch, max_blocks]``, NumPy or CuPy, ``batch <= max_batch``.
        seq_lens : array
            int32 ``[batch]`` cached tokens per sequence.
        append : bool
            This step's runs pass ``k_new``/``v_new``: one more token must fit.
        num_splits : int, optional
            Cut every sequence into this many equal pieces (implies ``schedule="split"``,
            planned on the host).
        schedule : {"balanced", "split"}, optional
            "balanced" (default): the sequences' key tiles, laid end to end, are dealt to
            the CTA columns in equal shares (a sequence crossing a share boundary is cut
            there). "split": each sequence is cut into ``num_splits`` equal pieces (default
            chosen so that the CTAs are busy), dealt to the columns in equal counts
            (planned on the host).
        merge : {"fused", "kernel"}, optional
            Who merges the pieces of a cut sequence: the CTA finishing the last one
            ("fused") or a second kernel launched after the decode kernel, one warp or more
            a query head ("kernel"; ``decode_plan.merge_launch``). Default: "kernel" on the
            pages kernel (whose fused merge holds up a CTA's whole stream) and where a CTA
            serves more than 8 query heads (MQA: one CTA would merge many heads one after
            another), else "fused".
        validate : bool, optional
            Strict mode for device arrays (see the class notes).
        planner : {"device", "host"}
            Who cuts the pieces (see the class notes); device arrays are read back for the
            host planner.

        Returns
        -------
        PagedDecoder
            This decoder.
        """
        check_choice("planner", planner, ("device", "host"))
        xp = self._xp or array_module(block_tables, seq_lens)
        bt, sl, max_block = dc.check_plan(self, block_tables, seq_lens, append, num_splits,
                                          validate)
        schedule, merge = dc.check_variants(schedule, merge, num_splits)
        host_planned = planner == "host" or schedule == "split"
        if sl is None and host_planned:
            bt, sl = host(block_tables), host(seq_lens)
            max_block = dc.planned_max_block(bt, sl, self.block_size, append)
        if sl is not None and isinstance(block_tables, np.ndarray):
            bt, sl = np.array(bt, np.int32), np.array(sl, np.int32)  # plans own their arrays
        self._xp = xp
        batch = block_tables.shape[0]
        work = device = None
        if xp is not np:
            lp = self._geometry(batch)
            merge = dp.resolve_merge(merge, lp)
            if host_planned:
                work = dp.plan_work(lp, sl, bool(append), self._opts.window_left, schedule,
                                    num_splits, merge)
                device = self._upload(lp, bt, sl, work, merge, append)
            else:
                device = self._take(lp, block_tables if sl is None else bt,
                                    seq_lens if sl is None else sl, merge, append)
        self._step = dp.Step(batch, bt, sl, bool(append), max_block, work, merge, device)
        self._planned_blocks = None
        self._runs.clear()
        return self

    @property
    def kv_path(self):
        """The current CuPy plan's kernel, "pages" or "staged" (None otherwise)."""
        step = self._step
        if step is None or step.device is None:
            return None
        return "pages" if step.device.launch.pages else "staged"

    @property
    def merge(self):
        """Who merges the current CuPy plan's cut sequences, "fused" or "kernel" (None on
        the NumPy path or before a plan, unless given)."""
        return None if self._step is None else self._step.merge

    @property
    def num_splits(self):
        """Most pieces one sequence is cut into by the current host plan (1 on the NumPy
        path, before a plan, or for a device plan, whose cuts the host does not see)."""
        step = self._step
        return 1 if step is None or step.work is None else step.work.max_pieces

    def _geometry(self, batch):
        return _current_geometry(self.dtype, self.head_dim, self.layout, self.block_size,
                                 self.num_q_heads, self.num_kv_heads, self._kv_path, batch)

    def _buffers(self, lp, rows, width, part_rows):
        """The decoder's index, partial and counter buffers, grown to hold a plan of
        ``rows`` descriptors, tables ``width`` wide and ``part_rows`` partial rows. The
        index buffer holds a host plan (``decode_plan.IndexLayout``) or a device plan
        (``decode_plan.DeviceIndex`` of ``max_batch`` sequences, then the tables' and the
        lengths' copies)."""
        import cupy
        lay = self._layout
        if lay is None or width > lay.width or rows > lay.rows:
            lay = dp.IndexLayout(self.max_batch, max(rows, lay.rows if lay else 0),
                                 max(width, self._width))
            size = max(lay.size, dp.DeviceIndex(self.max_batch, lp.columns).size
                       + self.max_batch * (lay.width + 1))
            self._index, self._layout, self._width = cupy.empty(size, np.int32), lay, lay.width
        if self._part_lse is None or self._part_lse.size < part_rows:
            self._part_out = cupy.empty(part_rows * self.head_dim, np.float32)
            self._part_lse = cupy.empty(part_rows, np.float32)
        need = 1 + self.max_batch * lp.row_groups
        if self._counters is None or self._counters.size < need:
            # re-armed to zero by the kernels that count on them
            self._counters = cupy.zeros(need, np.int32)
            self._pool = cupy.zeros(2 * lp.row_groups, np.int32)
        return lay

    def _upload(self, lp, bt, sl, work, merge, append):
        """A host plan: one asynchronous host-to-device copy of ``[lens | piece info | work
        | tables]``; buffers grow only when a plan needs more than any "balanced" plan of
        ``max_batch`` sequences."""
        batch, width = bt.shape
        rows, slots = dp.work_capacity(lp, self.max_batch)
        part_rows = max(slots, work.num_slots) * lp.row_groups * lp.heads_per_group
        lay = self._buffers(lp, max(rows, len(work.desc)), width, part_rows)
        self._uploader.upload(self._index, dp.pack_index(lay, sl, work, bt))
        idx = self._index
        tables = idx[lay.tables:lay.tables + batch * lay.width].reshape(batch, lay.width)
        return _device_step(lp, self.dtype, self.num_q_heads, self.head_dim, self._opts, merge,
                            bool(append), batch, lay.width, idx[lay.desc:lay.tables],
                            idx[lay.info:lay.info + 2 * batch], idx[:batch], self._counters,
                            self._pool if work.pool_pieces else None, self._part_out,
                            self._part_lse, tables=tables, own_lens=idx[:batch])

    def _take(self, lp, block_tables, seq_lens, merge, append):
        """A device plan: the tables and lengths copied into the decoder's buffers (after
        the device plan's index; device arrays copied on the device, host ones uploaded),
        to be cut by the plan kernel at the first run."""
        import cupy
        batch, width = block_tables.shape
        dev_lay = dp.DeviceIndex(self.max_batch, lp.columns)
        lay = self._buffers(lp, 0, width, dev_lay.pieces * lp.row_groups * lp.heads_per_group)
        idx = self._index
        at = dev_lay.size
        tables = idx[at:at + batch * lay.width].reshape(batch, lay.width)
        lens = idx[at + self.max_batch * lay.width:][:batch]
        if isinstance(block_tables, np.ndarray):
            image = np.full((self.max_batch * lay.width + batch), -1, np.int32)
            image[:batch * lay.width].reshape(batch, lay.width)[:, :width] = block_tables
            image[self.max_batch * lay.width:] = seq_lens
            self._uploader.upload(idx[at:], image)
        else:
            stream = cupy.cuda.get_current_stream().ptr
            rt = cupy.cuda.runtime
            rt.memcpy2DAsync(tables.data.ptr, lay.width * 4, block_tables.data.ptr,
                             table_stride(block_tables) * 4, width * 4, batch,
                             rt.memcpyDeviceToDevice, stream)
            rt.memcpyAsync(lens.data.ptr, seq_lens.data.ptr, batch * 4,
                           rt.memcpyDeviceToDevice, stream)
        return _planned_on_device(lp, self.dtype, self.num_q_heads, self.head_dim, self._opts,
                                  merge, bool(append), batch, width, lay.width, dev_lay, idx,
                                  self._counters, self._part_out, self._part_lse,
                                  tables=tables, own_lens=lens)

    @accepts_dlpack
    def run(self, q, k_cache, v_cache, sinks=None, alibi_slopes=None, k_new=None, v_new=None,
            out=None, return_lse=False, lse=None):
        """Decode the planned step for one layer.

        Parameters
        ----------
        q : array
            ``[batch, num_q_heads, head_dim]`` in the decoder's dtype (rows may be strided).
        k_cache, v_cache : array
            The layer's caches in the decoder's layout, block size and kv heads.
        sinks, alibi_slopes : array, optional
            float32 ``[num_q_heads]``.
        k_new, v_new : array, optional
            ``[batch, num_kv_heads, head_dim]``; required iff planned with ``append=True``.
        out : array, optional
            ``[batch, num_q_heads, head_dim]`` output buffer (no allocation when given).
        lse : array, optional
            float32 ``[batch, num_q_heads]`` LSE buffer, written when given.
        return_lse : bool

        Returns
        -------
        out, or ``(out, lse)`` with ``return_lse``; as :func:`paged_decode`.
        """
        st = self._step
        key = None
        if st is not None and st.device is not None and is_cupy(q):
            key = signature(q, k_cache, v_cache, sinks, alibi_slopes, k_new, v_new, out, lse)
        if key is None or key not in self._runs:
            xp, opts = dc.check_run(self, st, q, k_cache, v_cache, sinks, alibi_slopes, k_new,
                                    v_new, out, lse)
            if xp is np:
                return self._run_reference(q, k_cache, v_cache, sinks, alibi_slopes, k_new,
                                           v_new, out, return_lse, lse, opts)
            self._runs.put(key, True)
        shape = (st.batch, self.num_q_heads, self.head_dim)
        import cupy
        out = empty(cupy, shape, self.dtype) if out is None else out
        if lse is None and return_lse:
            lse = empty(cupy, shape[:2], np.float32)
        if st.batch:
            dev = st.device
            num_blocks = k_cache.shape[0]
            if (dev.plan_args is not None and self._planned_blocks == num_blocks
                    and not cupy.cuda.runtime.streamIsCapturing(
                        cupy.cuda.get_current_stream().ptr)):
                # planned at an earlier run; a captured run plans again at each replay, so
                # that it follows later plans
                dev = dev._replace(kernels=dev.kernels[:3] + (None,))
            _launch_decode(dev, q, k_cache, v_cache, k_new, v_new, alibi_slopes, sinks, out, lse,
                           num_blocks, dev.tables, dev.lens)
            self._planned_blocks = num_blocks
        return _result(out, lse, return_lse)

    def _run_reference(self, q, k_cache, v_cache, sinks, alibi_slopes, k_new, v_new, out,
                       return_lse, lse, opts):
        st = self._step
        o, l = ref.paged_decode(q, k_cache, v_cache, st.block_tables, st.seq_lens, k_new=k_new,
                                v_new=v_new, sm_scale=opts.sm_scale, window_left=opts.window_left,
                                alibi_slopes=alibi_slopes, sinks=sinks,
                                logits_soft_cap=opts.logits_soft_cap, layout=self.layout,
                                return_lse=True)
        if lse is not None:
            lse[...] = l
        return _reference_into(o, l if lse is None else lse, out, return_lse)


def kernel_specializations():
    """Every kernel this module can launch: append, the two merges, decode per dtype, head
    dim, value layout (rows or vllm's transposed) and heads per warp, the pages kernel
    (sm_90) per 16-bit dtype, head dim and block layout (NHD or HND), and the device plan."""
    specs = [Spec("plan", PLAN_EXPR)]
    for dt in FLOAT_DTYPES:
        specs.append(Spec("decode", _append_expr(dt)))
        specs.append(Spec("merge", _merge_expr(dt, dt)))
        specs += [Spec("merge", _pieces_expr(dt, d)) for d in (128, 256)]
        for d in HEAD_DIMS:
            for nt in sorted({dp.head_tiles(dt.itemsize, d, g) for g in (1, 64)}):
                specs += [Spec("decode", _decode_expr(dt, d, vt, nt)) for vt in (False, True)]
            if dt.itemsize == 2 and d in dp.PAGE_HEAD_DIMS:
                specs += [Spec("decode", _pages_expr(dt, d, hm), hopper=True)
                          for hm in (False, True)]
    return specs
