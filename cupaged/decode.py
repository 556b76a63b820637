"""Paged decode: one query token per sequence against a paged KV cache.

``paged_decode`` (functional), ``PagedDecoder`` (plan once per batch step, run once per
layer; no host sync in ``run``, capturable in a CUDA graph) and ``merge_states``. NumPy
inputs run the float64 reference (``cupaged.reference.attention``); CuPy inputs run
``kernels_cu/decode.cu``: the append kernel (with ``k_new``/``v_new``) and the decode
kernel, a persistent grid (one CTA per resident slot) whose CTAs stream host-planned pieces
of the sequences' keys; a sequence cut into several pieces is merged (sinks added once) by
the CTA finishing its last piece, or by a second kernel. Host planning (pieces, head
layout, strides, merge) lives in ``cupaged.decode_plan``, argument checks in
``cupaged.decode_checks``.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from . import decode_checks as dc, decode_plan as dp
from ._arrays import (FLOAT_DTYPES, HEAD_DIMS, accepts_dlpack, array_module, as_dtype,
                      check_array, check_choice, check_head_dim)
from ._checks import check_gqa, check_options
from ._compile import Spec, allow_dynamic_smem, ctype, get_kernel
from .layouts import LAYOUTS
from .reference import attention as ref

LOG2E = 1.4426950408889634
_NULL = np.uint64(0)


# ----------------------------------------------------------------------------- launches
@functools.lru_cache(maxsize=None)
def _kernel_on(device_id, expr, smem_bytes, hopper=False):
    kernel = get_kernel("decode", expr, hopper=hopper)
    allow_dynamic_smem(kernel, smem_bytes)  # the pages kernel's ring varies with the geometry
    if smem_bytes:
        kernel.preferred_shared_memory_carveout = 100  # every resident CTA's tiles
    return kernel


def _kernel(expr, smem_bytes=0, hopper=False):
    import cupy
    return _kernel_on(cupy.cuda.Device().id, expr, smem_bytes, hopper)


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
    return f"cupaged::decode::merge_states_kernel<{ctype(in_dtype)}, {ctype(out_dtype)}>"


def _pieces_expr(dtype, head_dim):
    return f"cupaged::decode::merge_pieces_kernel<{ctype(dtype)}, {-(-head_dim // 128)}>"


def _append_expr(dtype):
    return f"cupaged::decode::append_kv_kernel<{ctype(dtype)}>"


@functools.lru_cache(maxsize=None)
def _geometry(device_id, dtype, head_dim, layout, block_size, num_q_heads, num_kv_heads, pages):
    """The launch geometry on a device: one CTA per slot its decode kernel can hold."""
    import cupy
    from cupy_backends.cuda.api import driver
    lp = dp.plan_launch(itemsize=dtype.itemsize, head_dim=head_dim, layout=layout,
                        block_size=block_size, num_q_heads=num_q_heads,
                        num_kv_heads=num_kv_heads, pages=pages)
    smem = lp.tiles.smem_bytes
    kernel = _kernel_on(device_id, _launch_expr(lp, dtype), smem, lp.pages)
    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, lp.threads, smem)
    sms = cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]
    return lp._replace(columns=max(1, sms * max(1, per_sm) // lp.row_groups))


def _current_geometry(dtype, head_dim, layout, block_size, num_q_heads, num_kv_heads, kv_path,
                      batch):
    """The launch geometry of a ``batch``-sequence step on the current device, its kernel
    path resolved from ``kv_path`` (``dp.resolve_kv_path``)."""
    import cupy
    device = cupy.cuda.Device()
    dtype = np.dtype(dtype)
    pages = dp.resolve_kv_path(kv_path, device.compute_capability, dtype.itemsize, int(head_dim),
                               layout, int(block_size), int(num_q_heads), int(num_kv_heads),
                               int(batch))
    return _geometry(device.id, dtype, int(head_dim), layout, int(block_size), int(num_q_heads),
                     int(num_kv_heads), pages)


class _DeviceStep(NamedTuple):
    """Device side of one step: geometry, kernels, index views, scratch and the decode
    kernel's scalar arguments."""
    launch: object    # decode_plan.DecodeLaunch on this device
    kernels: tuple    # RawKernels: append (or None), decode, merge_pieces (or None)
    work: object      # int32 [rows * DESC_INTS] piece descriptors (16-byte aligned)
    seq_info: object  # int32 [batch * 2]
    tables: object    # int32 [batch, width] block tables
    lens: object      # int32 [batch] cached lengths
    part_out: object  # float32 partial rows, or None (nothing split)
    part_lse: object
    counters: object  # int32 [batch * row groups] zeros (fused merge), or None
    pool: object      # int32 [2 * row groups] zeros (pool pieces taken, CTAs done), or None
    scalars: tuple    # the decode kernel's arguments after the arrays
    merge_launch: tuple  # (grid, threads, warps a head) of merge_pieces_kernel, or None


def _ptr(a):
    return _NULL if a is None else a


def _i32(values):
    return tuple(np.int32(v) for v in values)


def _decode_scalars(lp, num_q_heads, bt_stride, opts, fused):
    return (*_i32(lp.k_strides[:4]), *_i32(lp.v_strides), np.int32(lp.block_size),
            np.uint32(lp.block_magic),
            *_i32((lp.block_shift, bt_stride, num_q_heads, lp.num_kv_heads, lp.heads.head_warps,
                   lp.heads.head_chunks, opts.window_left, fused)),
            np.float32(opts.sm_scale * LOG2E), np.float32(opts.sm_scale),
            np.float32(opts.logits_soft_cap))


def _launch_merge(o_first, o_rest, o_strides, l_first, l_rest, l_strides, num_parts, rows,
                  heads, dim, sinks, out, lse):
    """Merge ``num_parts`` states per row into ``out`` ``[rows, dim]`` (and ``lse``)."""
    kernel = _kernel(_merge_expr(o_first.dtype, out.dtype))
    kernel((-(-rows // 4),), (128,),
           (o_first, o_rest, np.int64(o_strides[0]), np.int64(o_strides[1]), l_first, l_rest,
            np.int64(l_strides[0]), np.int64(l_strides[1]), *_i32((num_parts, rows, heads, dim)),
            _ptr(sinks), out, _ptr(lse)))


def _step_kernels(lp, dtype, append, merge_kernel):
    """``(append or None, decode, merge_pieces or None)`` for one step's launches."""
    return (_kernel(_append_expr(dtype)) if append else None,
            _kernel(_launch_expr(lp, dtype), lp.tiles.smem_bytes, lp.pages),
            _kernel(_pieces_expr(dtype, lp.head_dim)) if merge_kernel else None)


def _merge_launch(lp, batch, fused):
    """merge_pieces_kernel's launch for a step (None with the fused merge)."""
    return None if fused else dp.merge_launch(lp, batch)


def _launch_decode(dev, q, k_cache, v_cache, k_new, v_new, opts, out, lse):
    """Append (with ``k_new``), decode and, with a merge kernel in ``dev.kernels``, merge
    split pieces by a second kernel; all on the current stream."""
    batch, hq, d = q.shape
    lp = dev.launch
    append, decode, merge = dev.kernels
    if k_new is not None:
        append((batch,), (128,), (k_new, v_new, k_cache, v_cache, dev.tables, dev.lens,
                                  *_i32((dev.tables.shape[1], lp.block_size, lp.num_kv_heads, d)),
                                  *_i32(lp.k_strides[:4]), *_i32(lp.v_strides)))
    decode(lp.grid, (lp.threads,),
           (q, out, _ptr(lse), _ptr(dev.part_out), _ptr(dev.part_lse), _ptr(dev.counters),
            _ptr(dev.pool), dev.work, k_cache, v_cache, dev.tables, _ptr(opts.alibi_slopes),
            _ptr(opts.sinks)) + dev.scalars, shared_mem=lp.tiles.smem_bytes)
    if merge is not None:
        grid, threads, wph = dev.merge_launch
        merge(grid, (threads,),
              (_ptr(dev.part_out), _ptr(dev.part_lse), dev.seq_info,
               *_i32((hq, lp.merge_kv_heads, lp.heads.head_chunks, lp.heads_per_group, d)),
               _ptr(opts.sinks), out, _ptr(lse), np.int32(wph)))


def _partials(xp, lp, num_slots):
    """Partial rows and LSEs for ``num_slots`` slots (None, None without any)."""
    if not num_slots:
        return None, None
    rows = num_slots * lp.row_groups * lp.heads_per_group
    return xp.empty(rows * lp.head_dim, np.float32), xp.empty(rows, np.float32)


def _call_step(xp, lp, c, dtype, block_tables, seq_lens, num_splits):
    """Work plan and device step of one ``paged_decode`` call (default merge)."""
    schedule, _ = dc.check_variants(None, None, num_splits)
    merge = dp.resolve_merge(None, lp)
    work = dp.plan_work(lp, c.seq_lens_host, c.append, c.options.window_left, schedule,
                        num_splits, merge)
    layout = dp.IndexLayout(c.batch, len(work.desc), 0)
    index = xp.asarray(dp.pack_index(layout, c.seq_lens_host, work))
    part_out, part_lse = _partials(xp, lp, work.num_slots)
    fused = merge == "fused"
    counters = xp.zeros(c.batch * lp.row_groups, np.int32) if work.num_slots and fused else None
    pool = xp.zeros(2 * lp.row_groups, np.int32) if work.pool_pieces else None
    scalars = _decode_scalars(lp, c.num_q_heads, block_tables.shape[1], c.options, int(fused))
    return _DeviceStep(lp, _step_kernels(lp, dtype, c.append, not fused),
                       index[layout.desc:layout.tables],
                       index[layout.info:layout.info + 2 * c.batch], block_tables, seq_lens,
                       part_out, part_lse, counters, pool, scalars,
                       _merge_launch(lp, c.batch, fused))


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
                 return_lse=False, kv_path=None):
    """Attention of one query token per sequence over its paged keys and values.

    Parameters
    ----------
    q : array
        ``[batch, num_q_heads, head_dim]``, float16, bfloat16 or float32; head_dim one of
        64, 80, 96, 112, 128, 256.
    k_cache, v_cache : array
        Paged caches in ``layout`` (``cupaged.layouts``), q's dtype; updated in place when
        ``k_new`` is given.
    block_tables : array
        int32 ``[batch, max_blocks_per_seq]``; token ``t`` of sequence ``i`` lives in block
        ``block_tables[i, t // block_size]``; unused entries -1.
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
        :meth:`PagedDecoder.plan`); default: the "balanced" schedule.
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

    Returns
    -------
    out : array
        ``[batch, num_q_heads, head_dim]`` in q's dtype; zeros for a sequence with no key.
    lse : array
        float32 ``[batch, num_q_heads]``; ``-inf`` (or the sink) for no key. Only with
        ``return_lse``.
    """
    options = dict(sm_scale=sm_scale, window_left=window_left, alibi_slopes=alibi_slopes,
                   sinks=sinks, logits_soft_cap=logits_soft_cap)
    c = dc.check_decode(q, k_cache, v_cache, block_tables, seq_lens, k_new, v_new, layout,
                      num_splits, out, options)
    if kv_path is not None:
        check_choice("kv_path", kv_path, dp.KV_PATHS)
    if c.xp is np:
        o, lse = ref.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, k_new=k_new,
                                  v_new=v_new, sm_scale=c.options.sm_scale,
                                  window_left=c.options.window_left, alibi_slopes=alibi_slopes,
                                  sinks=sinks, logits_soft_cap=c.options.logits_soft_cap,
                                  layout=layout, return_lse=True)
        return _reference_into(o, lse, out, return_lse)
    xp = c.xp
    out = xp.empty(q.shape, q.dtype) if out is None else out
    lse = xp.empty((c.batch, c.num_q_heads), np.float32) if return_lse else None
    if c.batch == 0:
        return _result(out, lse, return_lse)
    lp = _current_geometry(q.dtype, q.shape[2], layout, c.geometry.block_size, c.num_q_heads,
                           c.geometry.num_kv_heads, kv_path, c.batch)
    dev = _call_step(xp, lp, c, q.dtype, block_tables, seq_lens, num_splits)
    _launch_decode(dev, q, k_cache, v_cache, k_new, v_new, c.options, out, lse)
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
    out, lse = xp.empty_like(out_a), xp.empty((t, h), np.float32)
    if t * h:
        _launch_merge(out_a, out_b, (0, d), lse_a, lse_b, (0, 1), 2, t * h, h, d, None, out, lse)
    return out, lse


# ----------------------------------------------------------------------------- plan / run
class PagedDecoder:
    """Paged decode planned once per batch step and run once per layer.

    ``plan`` does a step's host work once: checks on host copies, the work plan (which CTA
    streams which keys), and ONE upload of lengths, work and block tables into an index
    buffer the decoder owns and reuses. ``run`` checks shapes and launches: no host sync, no
    allocation when ``out`` (and ``lse``) are given, no recompilation when lengths change.
    The grid is fixed (one CTA per resident slot) and the kernels read lengths, tables and
    work from buffers at fixed addresses, so a ``run`` captured in a CUDA graph stays valid
    after later ``plan`` calls of the same batch size and merge mode, whatever the lengths
    or schedule, until a plan outgrows a buffer (a wider table, or a "split" plan with more
    pieces than any "balanced" one). (The default kernel path depends on the batch size
    alone, so it holds too.) ``plan`` uploads on the current stream; keep plans and runs on
    one stream.

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
        ``cupy`` (kernels) or ``numpy`` (reference); default: the first plan's module.
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
        self._step = None

    @accepts_dlpack
    def plan(self, block_tables, seq_lens, *, append=False, num_splits=None, schedule=None,
             merge=None):
        """Check and upload one step's block tables and lengths; plan the CTAs' work.

        Parameters
        ----------
        block_tables : array
            int32 ``[batch, max_blocks]``, NumPy or CuPy, ``batch <= max_batch``.
        seq_lens : array
            int32 ``[batch]`` cached tokens per sequence.
        append : bool
            This step's runs pass ``k_new``/``v_new``: one more token must fit.
        num_splits : int, optional
            Cut every sequence into this many equal pieces (implies ``schedule="split"``).
        schedule : {"balanced", "split"}, optional
            "balanced" (default): the sequences' key tiles, laid end to end, are dealt to
            the CTA columns in equal shares (a sequence crossing a share boundary is cut
            there). "split": each sequence is cut into ``num_splits`` equal pieces (default
            chosen so that the CTAs are busy), dealt to the columns in equal counts.
        merge : {"fused", "kernel"}, optional
            Who merges the pieces of a cut sequence: the CTA finishing the last one
            ("fused") or a second kernel launched after the decode kernel, one warp or more
            a query head ("kernel"; ``decode_plan.merge_launch``). Default: "kernel" on the
            pages kernel (whose fused merge holds up a CTA's whole stream) and where a CTA
            serves more than 8 query heads (MQA: one CTA would merge many heads one after
            another), else "fused".
        """
        xp = self._xp or array_module(block_tables, seq_lens)
        bt, sl, max_block = dc.check_plan(self, block_tables, seq_lens, append, num_splits)
        schedule, merge = dc.check_variants(schedule, merge, num_splits)
        self._xp = xp
        work = device = None
        if xp is not np:
            lp = self._geometry(len(sl))
            merge = dp.resolve_merge(merge, lp)
            work = dp.plan_work(lp, sl, bool(append), self._opts.window_left, schedule,
                                num_splits, merge)
            device = self._upload(lp, bt, sl, work, merge, append)
        self._step = dp.Step(len(sl), bt, sl, bool(append), max_block, work, merge, device)

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
        """Most pieces one sequence is cut into by the current plan (1 on the NumPy path or
        before a plan)."""
        step = self._step
        return 1 if step is None or step.work is None else step.work.max_pieces

    def _geometry(self, batch):
        return _current_geometry(self.dtype, self.head_dim, self.layout, self.block_size,
                                 self.num_q_heads, self.num_kv_heads, self._kv_path, batch)

    def _upload(self, lp, bt, sl, work, merge, append):
        """One host-to-device copy of ``[lens | piece info | work | tables]``; buffers grow
        only when a plan needs more than any "balanced" plan of ``max_batch`` sequences."""
        import cupy
        batch, width = bt.shape
        rows, slots = dp.work_capacity(lp, self.max_batch)
        lay = self._layout
        if lay is None or width > lay.width or len(work.desc) > lay.rows:
            lay = dp.IndexLayout(self.max_batch, max(rows, len(work.desc), lay.rows if lay else 0),
                                 max(width, self._width))
            self._index, self._layout, self._width = cupy.empty(lay.size, np.int32), lay, lay.width
        part_rows = max(slots, work.num_slots) * lp.row_groups * lp.heads_per_group
        if self._part_lse is None or self._part_lse.size < part_rows:
            self._part_out = cupy.empty(part_rows * self.head_dim, np.float32)
            self._part_lse = cupy.empty(part_rows, np.float32)
        if self._counters is None or self._pool.size < 2 * lp.row_groups:
            # re-armed to zero by the kernels that count on them
            self._counters = cupy.zeros(self.max_batch * lp.row_groups, np.int32)
            self._pool = cupy.zeros(2 * lp.row_groups, np.int32)
        host = dp.pack_index(lay, sl, work, bt)
        self._index[:host.size].set(host)
        idx, fused = self._index, merge == "fused"
        tables = idx[lay.tables:lay.tables + batch * lay.width].reshape(batch, lay.width)
        return _DeviceStep(lp, _step_kernels(lp, self.dtype, bool(append), not fused),
                           idx[lay.desc:lay.tables], idx[lay.info:lay.info + 2 * batch], tables,
                           idx[:batch], self._part_out, self._part_lse,
                           self._counters if fused else None, self._pool,
                           _decode_scalars(lp, self.num_q_heads, lay.width, self._opts, int(fused)),
                           _merge_launch(lp, batch, fused))

    @accepts_dlpack
    def run(self, q, k_cache, v_cache, sinks=None, alibi_slopes=None, k_new=None, v_new=None,
            out=None, return_lse=False, lse=None):
        """Decode the planned step for one layer.

        Parameters
        ----------
        q : array
            ``[batch, num_q_heads, head_dim]`` in the decoder's dtype.
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
        xp, opts = dc.check_run(self, st, q, k_cache, v_cache, sinks, alibi_slopes, k_new,
                                v_new, out, lse)
        shape = (st.batch, self.num_q_heads, self.head_dim)
        if xp is np:
            o, l = ref.paged_decode(q, k_cache, v_cache, st.block_tables, st.seq_lens,
                                    k_new=k_new, v_new=v_new, sm_scale=opts.sm_scale,
                                    window_left=opts.window_left, alibi_slopes=alibi_slopes,
                                    sinks=sinks, logits_soft_cap=opts.logits_soft_cap,
                                    layout=self.layout, return_lse=True)
            if lse is not None:
                lse[...] = l
            return _reference_into(o, l if lse is None else lse, out, return_lse)
        out = xp.empty(shape, self.dtype) if out is None else out
        if lse is None and return_lse:
            lse = xp.empty(shape[:2], np.float32)
        if st.batch:
            _launch_decode(st.device, q, k_cache, v_cache, k_new, v_new, opts, out, lse)
        return _result(out, lse, return_lse)


def kernel_specializations():
    """Every kernel this module can launch: append, the two merges, decode per dtype, head
    dim, value layout (rows or vllm's transposed) and heads per warp, and the pages kernel
    (sm_90) per 16-bit dtype, head dim and block layout (NHD or HND)."""
    specs = []
    for dt in FLOAT_DTYPES:
        specs.append(Spec("decode", _append_expr(dt)))
        specs.append(Spec("decode", _merge_expr(dt, dt)))
        specs += [Spec("decode", _pieces_expr(dt, d)) for d in (128, 256)]
        for d in HEAD_DIMS:
            for nt in sorted({dp.head_tiles(dt.itemsize, d, g) for g in (1, 64)}):
                specs += [Spec("decode", _decode_expr(dt, d, vt, nt)) for vt in (False, True)]
            if dt.itemsize == 2 and d in dp.PAGE_HEAD_DIMS:
                specs += [Spec("decode", _pages_expr(dt, d, hm), hopper=True)
                          for hm in (False, True)]
    return specs
