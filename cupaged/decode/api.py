"""Paged decode: one query token per sequence against a paged KV cache.

``paged_decode`` (functional), ``PagedDecoder`` (plan once per batch step, run once per
layer; no host sync in ``run``, capturable in a CUDA graph) and ``merge_states``. NumPy
inputs run the float64 reference (``cupaged.reference.attention``); CuPy inputs run
``kernels_cu/decode.cu``: the append kernel (with ``k_new``/``v_new``) and the decode
kernel, a persistent grid (one CTA per resident slot) whose CTAs stream pieces of the
sequences' keys (cut on the device by ``kernels_cu/plan.cu``, or on the host); a sequence
cut into several pieces is merged (sinks added once) by the CTA finishing its last piece,
or by a second kernel (``kernels_cu/merge.cu``, which also holds ``merge_states``' kernel).
Host planning (pieces, head layout, strides, merge) lives in ``cupaged.decode.plan``,
argument checks in ``cupaged.decode.checks``, kernel choice, argument records and launches
in ``cupaged.decode.launch``.
"""
from __future__ import annotations

import sys

import numpy as np

from ..core import errors
from . import checks, plan
from ..core.arrays import (FLOAT_DTYPES, CallCache, accepts_dlpack, array_module, as_dtype,
                           check_array, check_choice, check_head_dim, empty, host, hot)
from ..core.checks import check_gqa, check_options, check_int
from ..core.device import Uploader
from ..core.fp8 import fp8_format, given_kv_dtype, scale_parts
from ..core.launch import current_stream, ptr, with_ptr
from ..core.layouts import LAYOUTS, accepts_cache, resolve_layout
from ..reference import attention as ref
from .launch import (call_step, call_strides, current_geometry, launch_decode, launch_merge,
                     planned_on_device, planned_on_host)


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
@accepts_cache(1)
def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, *, k_new=None, v_new=None,
                 sm_scale=None, window_left=-1, alibi_slopes=None, sinks=None,
                 logits_soft_cap=0.0, layout=None, num_splits=None, out=None,
                 return_lse=False, backend="auto", validate=None, kv_dtype=None,
                 k_scale=None, v_scale=None):
    """Attention of one query token per sequence over its paged keys and values.

    Parameters
    ----------
    q : array
        ``[batch, num_q_heads, head_dim]``, float16, bfloat16 or float32; head_dim one of
        64, 80, 96, 112, 128, 256. Rows may be strided (heads dense), e.g. a view of a
        fused qkv tensor.
    k_cache, v_cache : array
        Paged caches in ``layout`` (``cupaged.layouts``), q's dtype or fp8 (``kv_dtype``),
        blocks dense (their stride may be larger: K and V as views of one allocation);
        updated in place when ``k_new`` is given.
    block_tables : array
        int32 ``[batch, max_blocks_per_seq]`` (rows may be strided); token ``t`` of sequence
        ``i`` lives in block ``block_tables[i, t // block_size]``; unused entries -1.
    seq_lens : array
        int32 ``[batch]`` cached tokens per sequence (0 allowed).
    k_new, v_new : array, optional
        ``[batch, num_kv_heads, head_dim]`` in q's dtype: written at position
        ``seq_lens[i]`` first (quantised into an fp8 cache); the query then attends over
        ``seq_lens[i] + 1`` keys (the continuous-batching contract's append,
        docs/design.md).
    sm_scale : float, optional
        Score scale, default ``head_dim ** -0.5``.
    window_left : int
        ``w >= 0``: only keys ``j >= p - w`` are seen (``p`` the query position); -1: all.
    alibi_slopes, sinks : array, optional
        float32 ``[num_q_heads]``: ALiBi slopes; raw sink logits (one extra denominator
        term per head).
    logits_soft_cap : float
        ``c > 0`` maps scores to ``c * tanh(s / c)``.
    layout : {"NHD", "HND", "vllm"}, optional
        Layout of raw cache arrays; default "NHD", refused (ValueError) when k_cache's shape
        also reads validly as HND. A cache given as a :class:`cupaged.CacheView` or
        :class:`cupaged.PagedKVCache` (in place of ``k_cache, v_cache``) brings its own.
    num_splits : int, optional
        Cut each sequence into this many equal pieces (CuPy path; the "split" schedule of
        :meth:`PagedDecoder.plan`, planned on the host: reads the lengths back); default:
        the "balanced" schedule, planned on the device.
    out : array, optional
        ``[batch, num_q_heads, head_dim]`` in q's dtype, written and returned.
    return_lse : bool
        Also return the float32 natural-log LSE ``[batch, num_q_heads]`` (sink included).
    backend : {"auto", "pages", "staged"}
        The kernel (the one kernel-choice keyword of the attention ops, as ``backend`` of
        :func:`cupaged.varlen_prefill`). "pages": one CTA per SM copies whole cache blocks (``block_size`` tokens of up to 8
        kv heads: all of them, or a group of a divisor of their number, e.g. 8 of MHA's 32)
        with ``cp.async.bulk`` (sm_90+, 16-bit NHD caches with block_size a multiple or a
        divisor of 16 or HND ones with block_size a multiple of 16, head_dim 64/96/128, up
        to 8 query heads a kv head).
        "staged": 16-byte cp.async tiles of one kv head per CTA (every case). "auto":
        "pages" where it applies to batches of 2 sequences or more and its CTAs serve every
        kv head or 4 of them or more, where it is the faster; else "staged". CuPy path
        only.
    validate : bool, optional
        Check the contents of device ``block_tables`` and ``seq_lens`` (and device scales)
        on the host before launching (strict mode; default ``CUPAGED_STRICT``). Otherwise
        the plan kernel checks them: a bad sequence's rows come out as zeros and
        ``cupaged.check_errors()`` raises the first bad entry.
    kv_dtype : {None, "fp8_e4m3", "fp8_e5m2"}
        The caches' format (docs/design.md, fp8 caches); None: their own dtype (a float8
        cache is in its format, a uint8 cache needs a name). The kernels read fp8 caches
        with float16 or bfloat16 q and head_dim 64 or 128; the NumPy path takes every
        case.
    k_scale, v_scale : float or array, optional
        fp8 only (default 1.0): the cache holds ``key / k_scale``, ``value / v_scale``. A
        Python float, or a float32 array of shape ``[]`` or ``[1]`` (one scale: vLLM's
        ``layer._k_scale``) or ``[num_kv_heads]`` on q's device; arrays are read by the
        kernels (their values, finite and positive, are checked on the host only in strict
        mode), so a call stays sync-free and a captured graph follows later values.

    Returns
    -------
    out : array
        ``[batch, num_q_heads, head_dim]`` in q's dtype; zeros for a sequence with no key.
    lse : array
        float32 ``[batch, num_q_heads]``; ``-inf`` (or the sink) for no key. Only with
        ``return_lse``.
    """
    kv_dtype = given_kv_dtype(kv_dtype, k_cache)
    scale_arrays, scale_values = scale_parts(k_scale, v_scale)
    arrays = (q, k_cache, v_cache, k_new, v_new, alibi_slopes, sinks, *scale_arrays,
              block_tables, seq_lens, out)
    call = None
    if num_splits is None:
        call = hot(errors.strict(validate), arrays, sm_scale, window_left, logits_soft_cap,
                   layout, bool(return_lse), backend, kv_dtype, scale_values)
        hit = _CALLS.get(call.key) if call is not None else None
        if hit is not None:  # checked and set up by an earlier call of this signature
            device, strides, dtype = hit
            *ptrs, tables, lens, out_ptr = call.ptrs
            if out is None:
                out, out_ptr = call.empty(q.shape, dtype)
            lse = lse_ptr = 0
            if return_lse:
                lse, lse_ptr = call.empty(q.shape[:2], np.float32)
            launch_decode(device, strides, ptrs, out_ptr, lse_ptr, tables, lens, call.stream)
            return call.done((out, lse) if return_lse else out)
    return _decode_checked(q, k_cache, v_cache, k_new, v_new, alibi_slopes, sinks, k_scale,
                           v_scale, block_tables, seq_lens, out, num_splits, sm_scale,
                           window_left, logits_soft_cap, layout, return_lse, backend, validate,
                           kv_dtype, call.key if call is not None else None)


@accepts_dlpack
def _decode_checked(q, k_cache, v_cache, k_new, v_new, alibi_slopes, sinks, k_scale, v_scale,
                    block_tables, seq_lens, out, num_splits, sm_scale, window_left,
                    logits_soft_cap, layout, return_lse, backend, validate, kv_dtype,
                    cache_key):
    """paged_decode's checks, its device step (cached under ``cache_key`` when planned on
    the device) and its launches."""
    layout = resolve_layout(layout, k_cache, q,
                            k_new.shape[1] if getattr(k_new, "ndim", 0) == 3 else None)
    options = dict(sm_scale=sm_scale, window_left=window_left, alibi_slopes=alibi_slopes,
                   sinks=sinks, logits_soft_cap=logits_soft_cap)
    checked = checks.check_decode(q, k_cache, v_cache, block_tables, seq_lens, k_new, v_new,
                                  layout, num_splits, out, options, validate, kv_dtype,
                                  k_scale, v_scale)
    check_choice("backend", backend, plan.BACKENDS)
    xp = checked.xp
    if xp is np:
        o, lse = ref.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, k_new=k_new,
                                  v_new=v_new, sm_scale=checked.options.sm_scale,
                                  window_left=checked.options.window_left,
                                  alibi_slopes=alibi_slopes, sinks=sinks,
                                  logits_soft_cap=checked.options.logits_soft_cap,
                                  layout=layout, return_lse=True, kv_dtype=kv_dtype,
                                  k_scale=k_scale, v_scale=v_scale)
        return _reference_into(o, lse, out, return_lse)
    out = empty(xp, q.shape, q.dtype) if out is None else out
    lse = empty(xp, q.shape[:2], np.float32) if return_lse else None
    if checked.batch:
        geo = checked.geometry
        launch = current_geometry(q.dtype, q.shape[2], layout, geo.block_size,
                                  checked.num_q_heads, geo.num_kv_heads, backend, checked.batch,
                                  checked.kv)
        device = call_step(xp, launch, checked, q.dtype, block_tables, seq_lens, num_splits)
        strides = call_strides(q, k_cache, v_cache, k_new, v_new, checked.scales)
        if checked.seq_lens_host is None:
            _CALLS.put(cache_key, (device, strides, q.dtype))
        scale_arrays = scale_parts(k_scale, v_scale)[0]
        launch_decode(device, strides, [ptr(a) for a in (q, k_cache, v_cache, k_new, v_new,
                                                         alibi_slopes, sinks, *scale_arrays)],
                      ptr(out), ptr(lse), ptr(block_tables), ptr(seq_lens), current_stream())
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
        launch_merge(out_a, out_b, (0, d), lse_a, lse_b, (0, 1), 2, t * h, h, d, None, out, lse)
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
        float16, bfloat16 or float32: q, output and (without ``kv_dtype``) the caches.
    layout : {"NHD", "HND", "vllm"}, optional
        Cache layout; default "NHD", and then a raw cache whose shape also reads validly as
        HND is refused at ``run`` (a CacheView or PagedKVCache brings its layout).
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
    backend : {"auto", "pages", "staged"}
        As in :func:`paged_decode`.
    kv_dtype : {None, "fp8_e4m3", "fp8_e5m2"}
        The caches' fp8 format (fixed with the kernels a plan launches, as FlashInfer's
        ``kv_data_type``; the scales come with each layer's ``run``); None: caches of
        ``dtype``. fp8 caches take float16 or bfloat16 ``dtype`` and head_dim 64 or 128
        on the device.
    """

    def __init__(self, num_q_heads, num_kv_heads, head_dim, block_size, dtype="float16",
                 layout=None, window_left=-1, logits_soft_cap=0.0, sm_scale=None,
                 max_batch=256, max_blocks_per_seq=None, xp=None, backend="auto",
                 kv_dtype=None):
        for name, v in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads),
                        ("block_size", block_size), ("max_batch", max_batch)):
            check_int(name, v)
        if max_blocks_per_seq is not None:
            check_int("max_blocks_per_seq", max_blocks_per_seq)
        check_gqa(num_q_heads, num_kv_heads, "num_kv_heads")
        check_head_dim("head_dim", head_dim)
        self.layout_given = layout is not None
        layout = "NHD" if layout is None else layout
        check_choice("layout", layout, LAYOUTS)
        check_choice("backend", backend, plan.BACKENDS)
        self.backend = backend
        self._opts = check_options(np, num_q_heads, head_dim, sm_scale=sm_scale,
                                   window_left=window_left, logits_soft_cap=logits_soft_cap)
        self.num_q_heads, self.num_kv_heads = int(num_q_heads), int(num_kv_heads)
        self.head_dim, self.block_size = int(head_dim), int(block_size)
        self.dtype, self.layout, self.max_batch = as_dtype(dtype), layout, int(max_batch)
        self.kv_dtype = None if kv_dtype is None else fp8_format(kv_dtype).name
        self._width = max_blocks_per_seq or 0
        self._xp = xp
        self._index = self._layout = self._part_out = self._part_lse = self._counters = None
        self._pool = None
        self._uploader = Uploader()
        self._step = None
        self._planned_blocks = None  # num_blocks the device plan last checked against
        self._runs = CallCache()     # run signatures already checked against the plan
        self._checked_for = None     # (module, batch, append, max block) of those checks
        self._device_steps = CallCache()  # device-planned steps by shape, on the buffers
        self._geometries = CallCache()    # launch geometries by (device, batch)

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
            a query head ("kernel"; ``decode.plan.merge_launch``). Default: "kernel" on the
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
        schedule, merge = checks.check_variants(schedule, merge, num_splits)
        host_planned = planner == "host" or schedule == "split"
        # a device planner's plan kernel checks the block ids it reads
        bt, sl, max_block = checks.check_plan(self, block_tables, seq_lens, append,
                                              num_splits, validate,
                                              ids=xp is np or host_planned)
        if sl is None and host_planned:
            bt, sl = host(block_tables), host(seq_lens)
            max_block = checks.planned_max_block(bt, sl, self.block_size, append)
        if sl is not None and isinstance(block_tables, np.ndarray):
            # plans own their arrays; a device plan keeps only its uploaded copy of the tables
            bt = np.array(bt, np.int32) if xp is np or host_planned else None
            sl = np.array(sl, np.int32)
        batch = block_tables.shape[0]
        work = device = None
        if xp is not np:
            launch = self._geometry(batch)
            merge = plan.resolve_merge(merge, launch)
            if host_planned:
                work = plan.plan_work(launch, sl, bool(append), self._opts.window_left,
                                      schedule, num_splits, merge)
                device = self._upload(launch, bt, sl, work, merge, append)
            else:
                device = self._take(launch, block_tables, seq_lens, merge, append)
        self._set_step(xp, plan.Step(batch, bt, sl, bool(append), max_block, work, merge,
                                     device))
        return self

    def _set_step(self, xp, step):
        """Make ``step`` the current plan; runs checked against an earlier plan stay checked
        while the module, batch, append and largest block id are the same."""
        self._xp, self._step = xp, step
        self._planned_blocks = None
        checked = (xp, step.batch, step.append, step.max_block)  # what runs are checked against
        if checked != self._checked_for:
            self._runs.clear()
            self._checked_for = checked

    def _plan_written(self, batch, width):
        """A device plan of ``batch`` sequences whose block tables (``width`` blocks wide) and
        lengths the caller writes into the returned views of the decoder's buffers on the
        current stream before the next run (Quest's select kernel does): ``(tables
        [batch, width] with rows the buffer's width apart, lens [batch])``, at addresses
        kept while the batch and width are. The plan kernel checks and cuts them at the
        next run, so the lengths must then stay until the next plan; the tables' block ids
        may change between runs (unchecked then: the writer keeps them in range)."""
        import cupy
        launch = self._geometry(batch)
        merge = plan.resolve_merge(None, launch)
        device = self._device_step(launch, batch, width, merge, False)
        self._set_step(cupy, plan.Step(batch, None, None, False, -1, None, merge, device))
        return device.tables[:, :width], device.lens

    @property
    def kernel(self):
        """The kernel the current CuPy plan runs, "pages" or "staged" (None otherwise;
        ``backend`` is the choice it was resolved from)."""
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
        """The launch geometry of a ``batch``-sequence step on the current device (kept per
        device and batch: plans look it up every step)."""
        import cupy
        key = (cupy.cuda.runtime.getDevice(), batch)
        launch = self._geometries.get(key)
        if launch is None:
            launch = self._geometries.put(key, current_geometry(
                self.dtype, self.head_dim, self.layout, self.block_size, self.num_q_heads,
                self.num_kv_heads, self.backend, batch, self.kv_dtype))
        return launch

    def _buffers(self, launch, rows, width, part_rows):
        """The decoder's index, partial and counter buffers, grown to hold a plan of
        ``rows`` descriptors, tables ``width`` wide and ``part_rows`` partial rows. The
        index buffer holds a host plan (``decode.plan.IndexLayout``) or a device plan
        (``decode.plan.DeviceIndex`` of ``max_batch`` sequences, then the tables' and the
        lengths' copies)."""
        import cupy
        lay = self._layout
        if lay is None or width > lay.width or rows > lay.rows:
            lay = plan.IndexLayout(self.max_batch, max(rows, lay.rows if lay else 0),
                                 max(width, self._width))
            size = max(lay.size, plan.DeviceIndex(self.max_batch, launch.columns).size
                       + self.max_batch * (lay.width + 1))
            self._index, self._layout, self._width = cupy.empty(size, np.int32), lay, lay.width
            self._device_steps.clear()
        if self._part_lse is None or self._part_lse.size < part_rows:
            self._part_out = cupy.empty(part_rows * self.head_dim, np.float32)
            self._part_lse = cupy.empty(part_rows, np.float32)
            self._device_steps.clear()
        need = 1 + self.max_batch * launch.row_groups
        if self._counters is None or self._counters.size < need:
            # re-armed to zero by the kernels that count on them
            self._counters = cupy.zeros(need, np.int32)
            self._pool = cupy.zeros(2 * launch.row_groups, np.int32)
            self._device_steps.clear()
        return lay

    def _upload(self, launch, bt, sl, work, merge, append):
        """A host plan: one asynchronous host-to-device copy of ``[lens | piece info | work
        | tables]``; buffers grow only when a plan needs more than any "balanced" plan of
        ``max_batch`` sequences."""
        batch, width = bt.shape
        rows, slots = plan.work_capacity(launch, self.max_batch)
        part_rows = max(slots, work.num_slots) * launch.row_groups * launch.heads_per_group
        lay = self._buffers(launch, max(rows, len(work.desc)), width, part_rows)
        self._uploader.upload(self._index, plan.pack_index(lay, sl, work, bt))
        idx = self._index
        tables = idx[lay.tables:lay.tables + batch * lay.width].reshape(batch, lay.width)
        return planned_on_host(launch, self.dtype, self.num_q_heads, self.head_dim, self._opts,
                                merge, bool(append), batch, lay.width, lay, idx,
                                self._counters, self._pool if work.pool_pieces else None,
                                self._part_out, self._part_lse, tables=tables,
                                own_lens=idx[:batch])

    def _take(self, launch, block_tables, seq_lens, merge, append):
        """A device plan: the tables and lengths copied into the decoder's buffers (device
        arrays copied on the device, host ones uploaded), to be cut by the plan kernel at
        the first run."""
        batch, width = block_tables.shape
        step = self._device_step(launch, batch, width, merge, append)
        self._uploader.copy_step(ptr(step.tables), self._layout.width * 4, ptr(step.lens),
                                 block_tables, seq_lens)
        return step

    def _device_step(self, launch, batch, width, merge, append):
        """The device plan of a ``batch`` x ``width`` step on the decoder's buffers: its
        tables and lengths after the device plan's index. Its packed arguments depend only
        on the batch's shape and the buffers, so it is made once per shape."""
        device_index = plan.DeviceIndex(self.max_batch, launch.columns)
        lay = self._buffers(launch, 0, width,
                            device_index.pieces * launch.row_groups * launch.heads_per_group)
        key = (batch, width, lay.width, merge, bool(append), launch)
        step = self._device_steps.get(key)
        if step is None:
            idx = self._index
            at = device_index.size
            # the lengths right after the tables: one upload of host metadata
            tables = idx[at:at + batch * lay.width].reshape(batch, lay.width)
            lens = idx[at + batch * lay.width:][:batch]
            step = self._device_steps.put(key, planned_on_device(
                launch, self.dtype, self.num_q_heads, self.head_dim, self._opts, merge,
                bool(append), batch, width, lay.width, device_index, idx, self._counters,
                self._part_out, self._part_lse, tables=tables, own_lens=lens))
        return step

    @accepts_cache(2, owner=True)
    def run(self, q, k_cache, v_cache=None, *, sinks=None, alibi_slopes=None, k_new=None,
            v_new=None, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
        """Decode the planned step for one layer.

        Parameters
        ----------
        q : array
            ``[batch, num_q_heads, head_dim]`` in the decoder's dtype (rows may be strided).
        k_cache, v_cache : array
            The layer's caches in the decoder's layout, block size and kv heads; or
            ``k_cache`` a CacheView or PagedKVCache of them (``v_cache`` left out).
        sinks, alibi_slopes : array, optional
            float32 ``[num_q_heads]``.
        k_new, v_new : array, optional
            ``[batch, num_kv_heads, head_dim]``; required iff planned with ``append=True``.
        out : array, optional
            ``[batch, num_q_heads, head_dim]`` output buffer (no allocation when given).
        lse : array, optional
            float32 ``[batch, num_q_heads]`` LSE buffer, written when given.
        return_lse : bool
        k_scale, v_scale : float or array, optional
            The layer's fp8 scales (the decoder's ``kv_dtype``), as in :func:`paged_decode`.

        Returns
        -------
        out, or ``(out, lse)`` with ``return_lse``; as :func:`paged_decode`.
        """
        step = self._step
        scale_arrays, scale_values = scale_parts(k_scale, v_scale)
        arrays = (q, k_cache, v_cache, k_new, v_new, alibi_slopes, sinks, *scale_arrays, out,
                  lse)
        call = None
        if step is not None and step.device is not None:
            call = hot(False, arrays, scale_values)
            strides = self._runs.get(call.key) if call is not None else None
            if strides is not None:  # checked against the plan by an earlier run
                return self._launch(step, strides, call.ptrs, out, lse, return_lse, call)
        return self._run_checked(q, k_cache, v_cache, k_new, v_new, alibi_slopes, sinks,
                                 k_scale, v_scale, out, lse, return_lse,
                                 call.key if call is not None else None)

    @accepts_dlpack
    def _run_checked(self, q, k_cache, v_cache, k_new, v_new, alibi_slopes, sinks, k_scale,
                     v_scale, out, lse, return_lse, cache_key):
        """run's checks against the plan (remembered under ``cache_key``) and its launches."""
        step = self._step
        xp, opts, scales = checks.check_run(self, step, q, k_cache, v_cache, sinks,
                                            alibi_slopes, k_new, v_new, out, lse, k_scale,
                                            v_scale)
        if xp is np:
            return self._run_reference(q, k_cache, v_cache, sinks, alibi_slopes, k_new, v_new,
                                       out, return_lse, lse, opts, k_scale, v_scale)
        strides = self._runs.put(cache_key, call_strides(q, k_cache, v_cache, k_new, v_new,
                                                         scales))
        ptrs = [ptr(a) for a in (q, k_cache, v_cache, k_new, v_new, alibi_slopes, sinks,
                                 *scale_parts(k_scale, v_scale)[0], out, lse)]
        return self._launch(step, strides, ptrs, out, lse, return_lse, None)

    def _check_views(self, q, k_cache, v_cache, out, lse):
        """run's checks of a device call without sinks, ALiBi, appended keys or scales
        against the plan; its strides (for :meth:`_enqueue`)."""
        checks.check_run(self, self._step, q, k_cache, v_cache, None, None, None, None, out,
                         lse)
        return call_strides(q, k_cache, v_cache, None, None)

    def _launch(self, step, strides, ptrs, out, lse, return_lse, call):
        """Outputs allocated (in the caller's kind: by ``call``, else by :func:`empty`),
        then the step's launches on the caller's stream."""
        *ptrs, out_ptr, lse_ptr = ptrs
        shape = (step.batch, self.num_q_heads, self.head_dim)
        if out is None:
            out, out_ptr = (call.empty(shape, self.dtype) if call is not None else
                            with_ptr(empty(sys.modules["cupy"], shape, self.dtype)))
        if lse is None and return_lse:
            lse, lse_ptr = (call.empty(shape[:2], np.float32) if call is not None else
                            with_ptr(empty(sys.modules["cupy"], shape[:2], np.float32)))
        if step.batch:
            self._enqueue(step, strides, ptrs, out_ptr, lse_ptr,
                          call.stream if call is not None else current_stream())
        result = _result(out, lse, return_lse)
        return result if call is None else call.done(result)

    def _enqueue(self, step, strides, ptrs, out_ptr, lse_ptr, stream):
        """A device step's launches on ``stream`` (raw) for a run checked to ``strides``:
        ``ptrs`` the addresses of q, k_cache, v_cache, k_new, v_new, alibi_slopes, sinks,
        k_scale and v_scale (0: none), then those of the outputs."""
        device = step.device
        # planned at an earlier run, unless captured: a captured run plans at each replay,
        # so that it follows later plans
        replan = (device.plan_args is not None
                  and (self._planned_blocks != strides.num_blocks
                       or sys.modules["cupy"].cuda.runtime.streamIsCapturing(stream)))
        launch_decode(device, strides, ptrs, out_ptr, lse_ptr, ptr(device.tables),
                      ptr(device.lens), stream, plan=replan)
        self._planned_blocks = strides.num_blocks

    def _run_reference(self, q, k_cache, v_cache, sinks, alibi_slopes, k_new, v_new, out,
                       return_lse, lse, opts, k_scale, v_scale):
        step = self._step
        o, l = ref.paged_decode(q, k_cache, v_cache, step.block_tables, step.seq_lens, k_new=k_new,
                                v_new=v_new, sm_scale=opts.sm_scale, window_left=opts.window_left,
                                alibi_slopes=alibi_slopes, sinks=sinks,
                                logits_soft_cap=opts.logits_soft_cap, layout=self.layout,
                                return_lse=True, kv_dtype=self.kv_dtype, k_scale=k_scale,
                                v_scale=v_scale)
        if lse is not None:
            lse[...] = l
        return _reference_into(o, l if lse is None else lse, out, return_lse)
