"""Quest decode: the selected pages of each (sequence, kv head) decoded through the public
paged decode, planned once per step (:class:`QuestDecoder`, capturable in a CUDA graph) and
functional (:func:`quest_decode`: a decoder kept per call signature, planned each call).
Selection and views: ``cupaged.sparse.quest``."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core import errors
from ..core.arrays import (CallCache, accepts_dlpack, array_module, as_dtype, check_array,
                           check_choice, check_head_dim, empty, hot)
from ..core.checks import (INT32_MAX, check_block_tables, check_gqa, check_int, check_out,
                           check_query, table_stride)
from ..core.device import Uploader
from ..core.launch import current_stream, ptr, with_ptr
from ..core.layouts import LAYOUTS, CacheGeometry, key_geometry
from . import quest


def _check_sinks(sinks, num_q_heads, xp):
    if sinks is not None:
        check_array("sinks", sinks, shape=(num_q_heads,), dtypes=np.float32, xp=xp)


def _group_rows(q, num_kv_heads):
    """q ``[B, Hq, D]`` as ``[B * Hk, G, D]`` (a view of dense rows, else a copy)."""
    batch, hq, d = q.shape
    xp = array_module(q)
    if not q.flags.c_contiguous:
        q = xp.ascontiguousarray(q)
    return q.reshape(batch * num_kv_heads, hq // num_kv_heads, d)


_DECODERS = CallCache(limit=16)  # quest_decode's QuestDecoder per call signature


def quest_decode(q, k_cache, v_cache, k_min, k_max, block_tables, seq_lens, top_k, *, layout,
                 first_pages=0, sm_scale=None, sinks=None, out=None, return_lse=False,
                 backend="auto", validate=None):
    """Decode attention of one query per sequence over each kv head's ``top_k`` pages.

    CuPy arrays (and torch tensors) run through a :class:`QuestDecoder` kept per call
    signature (shapes, strides, dtypes and options), planned at each call: the first call
    of a signature is checked, later ones plan and launch as the decoder's hot path does.

    Parameters
    ----------
    q : array
        ``[B, Hq, D]`` in the caches' dtype.
    k_cache, v_cache : array
        Caches in ``layout``, blocks dense and one after the other (the one-kv-head view of
        :func:`cupaged.sparse.quest.decode_view`).
    k_min, k_max : array
        ``[num_blocks, Hk, D]`` page bounds: float32, bfloat16 or e4m3
        (:data:`quest.BOUND_DTYPES`; :func:`quest.update_page_bounds`).
    block_tables, seq_lens : array
        int32 ``[B, max_blocks]`` and ``[B]``.
    top_k : int
        Pages per (sequence, kv head), the last always among them.
    layout : {"NHD", "HND", "vllm"}
    first_pages : int
        Pages at the start of each sequence always kept (attention sinks).
    sm_scale : float, optional
        Default ``D ** -0.5``.
    sinks : array, optional
        float32 ``[Hq]`` raw sink logits (one extra denominator term per head).
    out : array, optional
        ``[B, Hq, D]`` C-contiguous, q's dtype.
    return_lse : bool
        Also return the float32 LSE ``[B, Hq]`` (sink included).
    backend : {"auto", "pages", "staged"}
        The decode kernel, as in :func:`cupaged.paged_decode`.
    validate : bool, optional
        Strict mode for device tables and lengths.

    Returns
    -------
    out : array
        ``[B, Hq, D]``: attention over the selected keys (zeros for an empty sequence).
    lse : array
        float32 ``[B, Hq]``, with ``return_lse``.
    """
    call = hot(errors.strict(validate), (q, k_cache, v_cache, k_min, k_max, block_tables,
                                         seq_lens, sinks, out),
               top_k, layout, first_pages, sm_scale, bool(return_lse), backend)
    dec = _DECODERS.get(call.key) if call is not None else None
    if dec is not None:  # checked by an earlier call of this signature
        return dec.plan(block_tables, seq_lens).run(q, k_cache, v_cache, k_min, k_max,
                                                    sinks=sinks, out=out,
                                                    return_lse=return_lse)
    return _quest_decode_checked(q, k_cache, v_cache, k_min, k_max, block_tables, seq_lens,
                                 top_k, layout, first_pages, sm_scale, sinks, out, return_lse,
                                 backend, validate, call.key if call is not None else None)


@accepts_dlpack
def _quest_decode_checked(q, k_cache, v_cache, k_min, k_max, block_tables, seq_lens, top_k,
                          layout, first_pages, sm_scale, sinks, out, return_lse, backend,
                          validate, cache_key):
    """quest_decode's checks; on the device, its decoder (kept under ``cache_key``) planned
    and run; on the host, the reference ops composed."""
    import cupaged
    xp = array_module(q, k_cache, v_cache, k_min, k_max, block_tables, seq_lens, sinks, out)
    check_choice("layout", layout, LAYOUTS)
    check_int("top_k", top_k)
    check_int("first_pages", first_pages, minimum=0)
    k_view, v_view, view_layout, _ = quest.decode_view(k_cache, v_cache, layout)
    geo = key_geometry(k_cache, layout)
    batch, hq, d = check_query("q", q, xp)
    _check_sinks(sinks, hq, xp)
    quest.check_bounds(k_min, k_max, (geo.num_blocks, geo.num_kv_heads, d), xp)
    if out is not None:
        check_out(out, q.shape, q.dtype, xp)
    hk = geo.num_kv_heads
    if xp is not np:
        check_gqa(hq, hk, "k_cache")
        dec = QuestDecoder(hq, hk, d, geo.block_size, top_k, first_pages=first_pages,
                           dtype=q.dtype, layout=layout, sm_scale=sm_scale,
                           max_batch=max(batch, 1), xp=xp, backend=backend)
        res = dec.plan(block_tables, seq_lens, validate=validate).run(
            q, k_cache, v_cache, k_min, k_max, sinks=sinks, out=out, return_lse=return_lse)
        _DECODERS.put(cache_key, dec)
        return res
    if out is None:
        out = empty(xp, q.shape, q.dtype)
    tpp = quest.tokens_per_page(layout, hk, geo.block_size)
    sel = quest.select_pages(q, k_min, k_max, block_tables, seq_lens, geo.block_size, top_k,
                             first_pages=first_pages, tokens_per_page=tpp)
    res = cupaged.paged_decode(_group_rows(q, hk), k_view, v_view, sel.tables, sel.lens,
                               layout=view_layout, sm_scale=sm_scale,
                               out=out.reshape(batch * hk, hq // hk, d),
                               return_lse=return_lse or sinks is not None, backend=backend)
    if not (return_lse or sinks is not None):
        return out
    lse = res[1].reshape(batch, hq)
    if sinks is not None:
        quest.fold_sinks(out.reshape(batch * hq, d), lse.reshape(batch * hq), sinks, hq)
    return (out, lse) if return_lse else out


class _RunSetup(NamedTuple):
    """A checked run's launches on the current plan (QuestDecoder's hot path)."""
    select: object   # quest.SelectLaunch
    strides: object  # the inner decoder's call strides (decode.launch.Strides)
    sinks: object    # quest.sinks_launch's launch, or None
    lse: int         # address of the decoder's own LSE rows (sinks without a caller's LSE)


class QuestDecoder:
    """Quest decode planned once per batch step and run once per layer.

    ``plan`` copies the step's block tables and lengths into buffers the decoder owns (on the
    device for CuPy; no host read of device arrays outside strict mode) and plans the inner
    :class:`cupaged.PagedDecoder` over the one-kv-head view once for the step (the number
    of keys each (sequence, kv head) selects depends only on the lengths). ``update_bounds``
    refreshes a layer's page bounds for the step (by default its last pages, after the
    step's key was written); ``run`` selects each (sequence, kv head)'s pages straight into
    the inner decoder's block table and decodes them. A run (or ``update_bounds``) on
    arrays of a signature checked before in the plan's shape launches without checking
    again. No host sync, no allocation with ``out`` (and ``lse``) given: a ``update_bounds``
    + ``run`` captured in a CUDA graph stays valid for later plans of the same batch size and
    table width, whatever the lengths, tables, keys or queries.

    Parameters
    ----------
    num_q_heads, num_kv_heads, head_dim, block_size : int
        The cache's geometry (``num_q_heads % num_kv_heads == 0``).
    top_k_pages : int
        Pages read per (sequence, kv head).
    first_pages : int
        Pages at the start of each sequence always among them (attention sinks).
    dtype : str or dtype
        q, caches and output: float16, bfloat16 or float32.
    layout : {"NHD", "HND", "vllm"}
    sm_scale : float, optional
    max_batch : int
        Most sequences a plan may hold.
    xp : module, optional
        ``cupy`` or ``numpy`` (the reference); default: the first plan's module. Give
        ``cupy`` to plan from NumPy metadata and run the kernels (uploaded at plan).
    backend : {"auto", "pages", "staged"}
        The inner decode kernel, as in :func:`cupaged.paged_decode`.
    """

    def __init__(self, num_q_heads, num_kv_heads, head_dim, block_size, top_k_pages, *,
                 first_pages=0, dtype="float16", layout="NHD", sm_scale=None, max_batch=256,
                 xp=None, backend="auto"):
        import cupaged
        for name, v in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads),
                        ("block_size", block_size), ("top_k_pages", top_k_pages),
                        ("max_batch", max_batch)):
            check_int(name, v)
        self.first_pages = check_int("first_pages", first_pages, minimum=0)
        check_gqa(num_q_heads, num_kv_heads, "num_kv_heads")
        check_head_dim("head_dim", head_dim)
        check_choice("layout", layout, LAYOUTS)
        self.num_q_heads, self.num_kv_heads = num_q_heads, num_kv_heads
        self.head_dim, self.block_size, self.top_k_pages = head_dim, block_size, top_k_pages
        self.dtype, self.layout, self.sm_scale = as_dtype(dtype), layout, sm_scale
        self.max_batch, self.backend, self._xp = max_batch, backend, xp
        self.tokens_per_page = quest.tokens_per_page(layout, num_kv_heads, block_size)
        view_bs = 1 if self.tokens_per_page > 1 else block_size
        self._decoder = cupaged.PagedDecoder(
            num_q_heads // num_kv_heads, 1, head_dim, view_bs, dtype=self.dtype, layout=layout,
            sm_scale=sm_scale, max_batch=max_batch * num_kv_heads, backend=backend)
        self._uploader = Uploader()
        self._width = 0
        self._buffers = None  # (tables, lens, scores, lse) of max_batch rows, device
        self._step = None     # (batch, width, tables, lens, Selection or None)
        self._runs = CallCache()    # _RunSetup of checked run signatures, on the current plan
        self._bounds = CallCache()  # update_bounds' launches of checked signatures
        self._plan_key = None       # the step shape and buffers those are for

    @accepts_dlpack
    def plan(self, block_tables, seq_lens, *, validate=None):
        """Take a step's int32 ``block_tables [B, max_blocks]`` and ``seq_lens [B]``
        (NumPy or CuPy, ``B <= max_batch``); returns the decoder."""
        xp = self._xp or array_module(block_tables, seq_lens)
        geo = CacheGeometry(INT32_MAX, self.block_size, self.num_kv_heads, self.head_dim)
        src = array_module(block_tables, seq_lens)
        check_block_tables(block_tables, seq_lens, geo, src,
                           contents=src is np or errors.strict(validate), ids=False)
        batch, width = block_tables.shape
        if batch > self.max_batch:
            raise ValueError(f"block_tables: expected at most max_batch={self.max_batch} "
                             f"sequences, got {batch}")
        self._xp = xp
        if xp is np:
            self._step = (batch, width, np.array(block_tables, np.int32),
                          np.array(seq_lens, np.int32), None)
            return self
        tables, lens, scores = self._grow(width)
        self._uploader.copy_step(ptr(tables), width * 4, ptr(lens), block_tables, seq_lens)
        rows, k = batch * self.num_kv_heads, min(self.top_k_pages, width)
        sel_tables, sel_lens = self._decoder._plan_written(rows, k * self.tokens_per_page)
        view = quest.Selection(None, sel_tables, sel_lens,
                               scores[:rows * width].reshape(batch, self.num_kv_heads, width))
        self._step = (batch, width, tables[:batch], lens[:batch], view)
        key = (batch, width, ptr(tables), ptr(sel_tables))
        if key != self._plan_key:
            self._runs.clear()
            self._bounds.clear()
            self._plan_key = key
        return self

    def _grow(self, width):
        """Device tables, lengths and scores for ``max_batch`` sequences of tables ``width``
        wide (kept while the width stays: captured graphs point into them)."""
        import cupy
        if self._buffers is None or width != self._width:
            self._buffers = (
                cupy.empty((self.max_batch, width), np.int32), cupy.empty(self.max_batch, np.int32),
                cupy.empty(self.max_batch * self.num_kv_heads * width, np.float32),
                cupy.empty(self.max_batch * self.num_q_heads, np.float32))
            self._width = width
        return self._buffers[:3]

    @property
    def selection(self):
        """What the last ``run`` of the current CuPy plan selected: a
        :class:`cupaged.sparse.quest.Selection` (no positions) of views of the decoder's
        buffers (None before a CuPy plan)."""
        return None if self._step is None else self._step[4]

    def _planned(self):
        if self._step is None:
            raise ValueError("QuestDecoder: expected a plan() first, got none")
        return self._step

    def update_bounds(self, k_cache, k_min, k_max, *, last_page_only=True):
        """Recompute a layer's page bounds (``[num_blocks, Hk, D]``, in place) over
        the planned tables and lengths: each sequence's last page (default), or every page."""
        step = self._step
        call = None
        if step is not None and step[4] is not None:
            call = hot(False, (k_cache, k_min, k_max), bool(last_page_only))
            launch = self._bounds.get(call.key) if call is not None else None
            if launch is not None:  # checked against the plan by an earlier call
                kc, k_min_p, k_max_p = call.ptrs
                launch(call.stream, kc, ptr(step[2]), ptr(step[3]), k_min_p, k_max_p)
                return
        self._update_bounds_checked(k_cache, k_min, k_max, last_page_only,
                                    call.key if call is not None else None)

    @accepts_dlpack
    def _update_bounds_checked(self, k_cache, k_min, k_max, last_page_only, cache_key):
        _, _, tables, lens, sel = self._planned()
        quest.update_page_bounds(k_cache, tables, lens, k_min, k_max, layout=self.layout,
                                 last_page_only=last_page_only)
        if sel is not None:
            self._bounds.put(cache_key, quest.bounds_launch(k_cache, self.layout, tables,
                                                            k_min.dtype, last_page_only))

    def run(self, q, k_cache, v_cache, k_min, k_max, *, sinks=None, out=None, lse=None,
            return_lse=False):
        """Decode the planned step for one layer over each kv head's selected pages.

        Parameters
        ----------
        q : array
            ``[B, Hq, D]`` in the decoder's dtype; strided rows are copied first (an
            allocation, and checked at every call: give dense rows to a run captured in a
            CUDA graph or issued often).
        k_cache, v_cache : array
            The layer's caches (the decoder's layout, block size and kv heads).
        k_min, k_max : array
            The layer's ``[num_blocks, Hk, D]`` page bounds (:data:`quest.BOUND_DTYPES`).
        sinks : array, optional
            float32 ``[Hq]``.
        out : array, optional
            ``[B, Hq, D]`` C-contiguous output (no allocation when given).
        lse : array, optional
            float32 ``[B, Hq]`` C-contiguous, written when given.
        return_lse : bool

        Returns
        -------
        out, or ``(out, lse)`` with ``return_lse``.
        """
        step = self._step
        call = None
        if step is not None and step[4] is not None:
            call = hot(False, (q, k_cache, v_cache, k_min, k_max, sinks, out, lse),
                       bool(return_lse))
            setup = self._runs.get(call.key) if call is not None else None
            if setup is not None:  # checked against the plan by an earlier run
                return self._launch(setup, call.ptrs, out, lse, return_lse, call)
        return self._run_checked(q, k_cache, v_cache, k_min, k_max, sinks, out, lse,
                                 return_lse, call.key if call is not None else None)

    @accepts_dlpack
    def _run_checked(self, q, k_cache, v_cache, k_min, k_max, sinks, out, lse, return_lse,
                     cache_key):
        """run's checks against the plan (its launches remembered under ``cache_key``) and
        its launches."""
        batch, width, tables, lens, sel = self._planned()
        xp = array_module(q, k_cache, v_cache, k_min, k_max, sinks, out, lse)
        if xp is not self._xp:
            raise TypeError(f"q: expected {self._xp.__name__} arrays like the plan, got "
                            f"{xp.__name__} arrays")
        shape = (batch, self.num_q_heads, self.head_dim)
        check_array("q", q, shape=shape, dtypes=self.dtype, xp=xp, contiguous=False)
        if xp is np:
            res = quest_decode(q, k_cache, v_cache, k_min, k_max, tables, lens,
                               self.top_k_pages, layout=self.layout,
                               first_pages=self.first_pages, sm_scale=self.sm_scale,
                               sinks=sinks, out=out, return_lse=True)
            if lse is not None:
                lse[...] = res[1]
            return res if return_lse else res[0]
        _check_sinks(sinks, self.num_q_heads, xp)
        if lse is not None:
            check_array("lse", lse, shape=shape[:2], dtypes=np.float32, xp=xp)
        if out is not None:
            check_out(out, shape, self.dtype, xp)
        k_view, v_view, _, _ = quest.decode_view(k_cache, v_cache, self.layout)
        geo = key_geometry(k_cache, self.layout)
        if (geo.block_size, geo.num_kv_heads) != (self.block_size, self.num_kv_heads):
            raise ValueError(f"k_cache: expected block_size {self.block_size} and "
                             f"{self.num_kv_heads} kv heads like the decoder, got "
                             f"{geo.block_size} and {geo.num_kv_heads}")
        quest.check_bounds(k_min, k_max, (geo.num_blocks, geo.num_kv_heads, self.head_dim), xp)
        if not q.flags.c_contiguous:  # a copy each call: nothing to remember
            q, cache_key = xp.ascontiguousarray(q), None
        rows, group = batch * self.num_kv_heads, self.num_q_heads // self.num_kv_heads
        own_lse = self._buffers[3][:batch * self.num_q_heads]
        lse_view = None
        if lse is not None or return_lse or sinks is not None:
            lse_view = (own_lse if lse is None else lse).reshape(rows, group)
        strides = self._decoder._check_views(
            q.reshape(rows, group, self.head_dim), k_view, v_view,
            None if out is None else out.reshape(rows, group, self.head_dim), lse_view)
        setup = self._runs.put(cache_key, _RunSetup(
            quest.select_launch(q, k_min, tables, self.block_size, self.top_k_pages,
                                self.first_pages, self.tokens_per_page,
                                table_stride(sel.tables)),
            strides,
            None if sinks is None else quest.sinks_launch(self.dtype, batch * self.num_q_heads,
                                                          self.num_q_heads, self.head_dim),
            ptr(own_lse)))
        ptrs = [ptr(a) for a in (q, k_cache, v_cache, k_min, k_max, sinks, out, lse)]
        return self._launch(setup, ptrs, out, lse, return_lse, None)

    def _launch(self, setup, ptrs, out, lse, return_lse, call):
        """Outputs allocated where not given (in the caller's kind: by ``call``, else by
        :func:`empty`), then the selection, the decode and the sinks' fold on the caller's
        stream."""
        import cupy
        q, kc, vc, k_min, k_max, sinks, out_ptr, lse_ptr = ptrs
        batch, _, tables, lens, sel = self._step
        shape = (batch, self.num_q_heads, self.head_dim)
        if out is None:
            out, out_ptr = (call.empty(shape, self.dtype) if call is not None else
                            with_ptr(empty(cupy, shape, self.dtype)))
        if lse is None and return_lse:
            lse, lse_ptr = (call.empty(shape[:2], np.float32) if call is not None else
                            with_ptr(empty(cupy, shape[:2], np.float32)))
        elif lse is None and setup.sinks is not None:
            lse_ptr = setup.lse
        stream = call.stream if call is not None else current_stream()
        setup.select(stream, q, k_min, k_max, ptr(tables), ptr(lens), ptr(sel.scores), 0,
                     ptr(sel.tables), ptr(sel.lens))
        if batch:
            self._decoder._enqueue(self._decoder._step, setup.strides,
                                   (q, kc, vc, 0, 0, 0, 0, 0, 0), out_ptr, lse_ptr, stream)
        if setup.sinks is not None:
            setup.sinks(stream, out_ptr, lse_ptr, sinks)
        result = (out, lse) if return_lse else out
        return result if call is None else call.done(result)


