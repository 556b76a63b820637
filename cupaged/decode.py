"""Paged decode: one query token per sequence against a paged KV cache.

``paged_decode`` (functional), ``PagedDecoder`` (plan once per batch step, run once per
layer; no host sync in ``run``, capturable in a CUDA graph) and ``merge_states``. NumPy
inputs run the float64 reference (``cupaged.reference.attention``); CuPy inputs run
``kernels_cu/decode.cu``: the append kernel (with ``k_new``/``v_new``), the split-KV decode
kernel and, with more than one split, the merge kernel, which adds sinks once. Host
planning (split count, head layout, strides) lives in ``cupaged.decode_plan``.
"""
from __future__ import annotations

import functools

import numpy as np

from . import decode_plan as dp
from ._arrays import (FLOAT_DTYPES, HEAD_DIMS, accepts_dlpack, array_module, as_dtype,
                      check_array, check_choice, check_head_dim)
from ._checks import check_gqa, check_options
from ._compile import Spec, ctype, get_kernel
from .layouts import LAYOUTS
from .reference import attention as ref

LOG2E = 1.4426950408889634
_NULL = np.uint64(0)


# ----------------------------------------------------------------------------- launches
@functools.lru_cache(maxsize=None)
def _device_limits(device_id):
    import cupy
    attrs = cupy.cuda.Device(device_id).attributes
    return attrs["MultiProcessorCount"], attrs["MaxSharedMemoryPerMultiprocessor"]


def _current_limits():
    import cupy
    return _device_limits(cupy.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _kernel_on(device_id, expr, smem_bytes):
    kernel = get_kernel("decode", expr)
    if smem_bytes > 48 * 1024:
        kernel.max_dynamic_shared_size_bytes = smem_bytes
    return kernel


def _kernel(expr, smem_bytes=0):
    import cupy
    return _kernel_on(cupy.cuda.Device().id, expr, smem_bytes)


def _decode_expr(dtype, head_dim, vllm_v, head_tiles):
    return (f"cupaged::decode::paged_decode_kernel<{ctype(dtype)}, {head_dim}, "
            f"{'true' if vllm_v else 'false'}, {head_tiles}>")


def _merge_expr(in_dtype, out_dtype):
    return f"cupaged::decode::merge_states_kernel<{ctype(in_dtype)}, {ctype(out_dtype)}>"


def _ptr(a):
    return _NULL if a is None else a


def _i32(values):
    return tuple(np.int32(v) for v in values)


def _launch_merge(o_first, o_rest, o_strides, l_first, l_rest, l_strides, num_parts, rows,
                  heads, dim, sinks, out, lse):
    """Merge ``num_parts`` states per row into ``out`` ``[rows, dim]`` (and ``lse``)."""
    kernel = _kernel(_merge_expr(o_first.dtype, out.dtype))
    kernel((-(-rows // 4),), (128,),
           (o_first, o_rest, np.int64(o_strides[0]), np.int64(o_strides[1]), l_first, l_rest,
            np.int64(l_strides[0]), np.int64(l_strides[1]), *_i32((num_parts, rows, heads, dim)),
            _ptr(sinks), out, _ptr(lse)))


def _launch_decode(lp, q, k_cache, v_cache, block_tables, seq_lens, k_new, v_new, opts, out,
                   lse, part_out, part_lse):
    """Append (if planned), decode and merge (with splits) on the current stream."""
    batch, hq, d = q.shape
    bt_stride = block_tables.shape[1]
    if lp.append:
        append = _kernel(f"cupaged::decode::append_kv_kernel<{ctype(q.dtype)}>")
        append((batch,), (128,), (k_new, v_new, k_cache, v_cache, block_tables, seq_lens,
                                  *_i32((bt_stride, lp.block_size, lp.num_kv_heads, d)),
                                  *_i32(lp.k_strides[:4]), *_i32(lp.v_strides)))
    split = lp.num_splits > 1
    kernel = _kernel(_decode_expr(q.dtype, d, lp.vllm_v, lp.tiles.head_tiles), lp.tiles.smem_bytes)
    kernel(lp.grid, (dp.NTHREADS,),
           (q, out, _ptr(None if split else lse), _ptr(part_out if split else None),
            _ptr(part_lse if split else None), k_cache, v_cache, block_tables, seq_lens,
            _ptr(opts.alibi_slopes), _ptr(opts.sinks), *_i32(lp.k_strides[:4]),
            *_i32(lp.v_strides), np.int32(lp.block_size), np.uint32(lp.block_magic),
            *_i32((lp.block_shift, bt_stride, hq, lp.num_kv_heads, lp.heads.head_warps,
                   lp.heads.head_chunks, lp.num_splits, lp.append, opts.window_left)),
            np.float32(opts.sm_scale * LOG2E), np.float32(opts.sm_scale),
            np.float32(opts.logits_soft_cap)),
           shared_mem=lp.tiles.smem_bytes)
    if split:
        s = lp.num_splits
        _launch_merge(part_out, part_out[d:], (d, s * d), part_lse, part_lse[1:], (1, s), s,
                      batch * hq, hq, d, opts.sinks, out, lse)


def _plan(dtype, head_dim, layout, block_size, num_q_heads, num_kv_heads, seq_lens, append,
          window_left, num_splits):
    sms, smem = _current_limits()
    return dp.plan_launch(itemsize=dtype.itemsize, head_dim=head_dim, layout=layout,
                          block_size=block_size, num_q_heads=num_q_heads,
                          num_kv_heads=num_kv_heads, seq_lens=seq_lens, append=append,
                          window_left=window_left, num_splits=num_splits, num_sms=sms,
                          smem_per_sm=smem)


def _partials(xp, rows, num_splits, head_dim):
    if num_splits == 1:
        return None, None
    return (xp.empty(rows * num_splits * head_dim, np.float32),
            xp.empty(rows * num_splits, np.float32))


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
                 return_lse=False):
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
        KV splits per sequence (CuPy path); default chosen from batch, heads, lengths and
        the SM count.
    out : array, optional
        ``[batch, num_q_heads, head_dim]`` in q's dtype, written and returned.
    return_lse : bool
        Also return the float32 natural-log LSE ``[batch, num_q_heads]`` (sink included).

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
    c = dp.check_decode(q, k_cache, v_cache, block_tables, seq_lens, k_new, v_new, layout,
                      num_splits, out, options)
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
    lp = _plan(q.dtype, q.shape[2], layout, c.geometry.block_size, c.num_q_heads,
               c.geometry.num_kv_heads, c.seq_lens_host, c.append, c.options.window_left,
               num_splits)
    part_out, part_lse = _partials(xp, c.batch * c.num_q_heads, lp.num_splits, q.shape[2])
    _launch_decode(lp, q, k_cache, v_cache, block_tables, seq_lens, k_new, v_new, c.options,
                   out, lse, part_out, part_lse)
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

    ``plan`` does a step's host work once: checks on host copies, the split choice, and ONE
    upload of lengths and block tables into an index buffer the decoder owns and reuses.
    ``run`` checks shapes and launches: no host sync, no allocation when ``out`` (and
    ``lse``) are given, no recompilation when lengths change. A ``run`` captured in a CUDA
    graph stays valid after later ``plan`` calls of the same batch size: the kernels read
    lengths and tables from the same buffers and derive each split's keys on the device
    (the graph keeps the split count it was captured with). ``plan`` uploads on the current
    stream; keep plans and runs on one stream.

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
    """

    def __init__(self, num_q_heads, num_kv_heads, head_dim, block_size, dtype="float16",
                 layout="NHD", window_left=-1, logits_soft_cap=0.0, sm_scale=None,
                 max_batch=256, max_blocks_per_seq=None, xp=None):
        for name, v in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads),
                        ("block_size", block_size), ("max_batch", max_batch)):
            dp.check_positive(name, v)
        if max_blocks_per_seq is not None:
            dp.check_positive("max_blocks_per_seq", max_blocks_per_seq)
        check_gqa(num_q_heads, num_kv_heads, "num_kv_heads")
        check_head_dim("head_dim", head_dim)
        check_choice("layout", layout, LAYOUTS)
        self._opts = check_options(np, num_q_heads, head_dim, sm_scale=sm_scale,
                                   window_left=window_left, logits_soft_cap=logits_soft_cap)
        self.num_q_heads, self.num_kv_heads = int(num_q_heads), int(num_kv_heads)
        self.head_dim, self.block_size = int(head_dim), int(block_size)
        self.dtype, self.layout, self.max_batch = as_dtype(dtype), layout, int(max_batch)
        self._width = max_blocks_per_seq
        self._xp = xp
        self._index = self._part_out = self._part_lse = None
        self._step = None

    @accepts_dlpack
    def plan(self, block_tables, seq_lens, *, append=False, num_splits=None):
        """Check and upload one step's block tables and lengths; choose the split count.

        Parameters
        ----------
        block_tables : array
            int32 ``[batch, max_blocks]``, NumPy or CuPy, ``batch <= max_batch``.
        seq_lens : array
            int32 ``[batch]`` cached tokens per sequence.
        append : bool
            This step's runs pass ``k_new``/``v_new``: one more token must fit.
        num_splits : int, optional
            Override the split heuristic.
        """
        xp = self._xp or array_module(block_tables, seq_lens)
        bt, sl, max_block = dp.check_plan(self, block_tables, seq_lens, append, num_splits)
        self._xp = xp
        launch = tables = lens = None
        if xp is not np:
            launch = _plan(self.dtype, self.head_dim, self.layout, self.block_size,
                           self.num_q_heads, self.num_kv_heads, sl, bool(append),
                           self._opts.window_left, num_splits)
            tables, lens = self._upload(bt, sl, launch.num_splits)
        self._step = dp.Step(len(sl), bt, sl, bool(append), max_block, launch, tables, lens)

    @property
    def num_splits(self):
        """Split count of the current plan (1 on the NumPy path or before a plan)."""
        step = self._step
        return 1 if step is None or step.launch is None else step.launch.num_splits

    def _upload(self, bt, sl, num_splits):
        """One host-to-device copy of ``[lens | tables]``; buffers grow only when needed."""
        import cupy
        batch, width = bt.shape
        if self._index is None or width > self._width:
            self._width = max(width, self._width or 0)
            self._index = cupy.empty(self.max_batch * (1 + self._width), np.int32)
        rows = max(batch * num_splits * self.num_q_heads,
                   dp.max_partial_rows(self.num_q_heads, self.num_kv_heads, self.head_dim,
                                       self.dtype.itemsize, _current_limits()[0]))
        if self._part_lse is None or self._part_lse.size < rows:
            self._part_out = cupy.empty(rows * self.head_dim, np.float32)
            self._part_lse = cupy.empty(rows, np.float32)
        host = dp.pack_index(bt, sl, self.max_batch, self._width)
        self._index[:host.size].set(host)
        tables = self._index[self.max_batch:host.size].reshape(batch, self._width)
        return tables, self._index[:batch]

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
        xp, opts = dp.check_run(self, st, q, k_cache, v_cache, sinks, alibi_slopes, k_new,
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
            _launch_decode(st.launch, q, k_cache, v_cache, st.tables_dev, st.lens_dev, k_new,
                           v_new, opts, out, lse, self._part_out, self._part_lse)
        return _result(out, lse, return_lse)


def kernel_specializations():
    """Every kernel this module can launch: append, merge, and decode per dtype, head dim,
    value layout (rows or vllm's transposed) and heads per warp."""
    specs = []
    for dt in FLOAT_DTYPES:
        specs.append(Spec("decode", f"cupaged::decode::append_kv_kernel<{ctype(dt)}>"))
        specs += [Spec("decode", _merge_expr(src, dt)) for src in dict.fromkeys((np.float32, dt))]
        for d in HEAD_DIMS:
            for nt in sorted({dp.head_tiles(dt.itemsize, d, g) for g in (1, 64)}):
                specs += [Spec("decode", _decode_expr(dt, d, vt, nt)) for vt in (False, True)]
    return specs
