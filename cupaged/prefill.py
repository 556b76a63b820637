"""Prefill attention: ragged (varlen) batches and paged caches, on tensor cores.

``varlen_prefill`` attends packed query rows to packed key/value rows; ``paged_prefill``
attends new query tokens to paged caches that already hold them (chunked prefill, prefix
reuse); ``paged_attention`` is the same op for batches mixing decode rows (``q_len = 1``)
and prefill rows, run by the same unified kernel (GQA heads are packed into the rows of a
tile, so a decode row fills a tile with its query-head group); ``PagedPrefiller`` does the
host work once per batch step (``plan``) and only launches per layer (``run``).

NumPy inputs run ``cupaged.reference.attention``; CuPy inputs run ``kernels_cu/prefill.cu``:
fp16/bf16 on tensor cores (mma.sync m16n8k16, FlashAttention-2 style), fp32 on a simple
CUDA-core path (correct, not tuned). ``backend="wgmma"`` runs ``kernels_cu/prefill_sm90.cu``
instead (Hopper warpgroup MMA, sm_90 only; fp16/bf16, head sizes 64/128, no soft-cap or
ALiBi, not the vllm layout); ``"auto"`` picks it where it applies when
its layout is in ``prefill_plan.WGMMA_AUTO``, else the mma.sync kernel.
"""
from __future__ import annotations

import numpy as np

from . import prefill_plan as plan_
from ._arrays import (HEAD_DIMS, accepts_dlpack, array_module, as_dtype, bfloat16, check_array,
                      check_head_dim, float16, float32, gpu_available)
from ._checks import check_block_tables, check_cu_seqlens, check_gqa, check_options, check_out
from ._compile import Spec, allow_dynamic_smem, ctype, get_kernel
from .layouts import CacheGeometry, cache_geometry
from .reference import attention as ref

__all__ = ["varlen_prefill", "paged_prefill", "paged_attention", "PagedPrefiller",
           "kernel_specializations"]

_NULL = np.uint64(0)  # null device pointer for absent optional arrays


# ----------------------------------------------------------------------------- kernels
def _expr(dtype, head_dim, v_transposed, tile):
    """Template name of the kernel for ``dtype`` / ``head_dim`` / tile (fp32: CUDA cores)."""
    if np.dtype(dtype) == float32:
        return f"cupaged::prefill_simt_kernel<{head_dim}>"
    vt = "true" if v_transposed else "false"
    return f"cupaged::prefill_mma_kernel<{ctype(dtype)}, {head_dim}, {vt}, {tile.cpp()}>"


def _expr_wgmma(dtype, head_dim, tile):
    """Template name of the sm_90a wgmma kernel."""
    return (f"cupaged::prefill_wgmma_kernel<{ctype(dtype)}, {head_dim}, {tile.block_n}, "
            f"{tile.stages}>")


def kernel_specializations():
    """Every prefill kernel specialisation: (fp16, bf16) x head dims x (V rows, V^T for the
    vllm value layout) at the default tile of the head size, fp32 x head dims (one
    CUDA-core kernel for all layouts), and the sm_90a wgmma kernel for (fp16, bf16) x
    (64, 128). The benchmark's other tiles compile on demand."""
    specs = [Spec("prefill", _expr(dt, d, vt, plan_.default_tile(d, vt)))
             for dt in (float16, bfloat16) for d in HEAD_DIMS for vt in (False, True)]
    specs += [Spec("prefill_sm90", _expr_wgmma(dt, d, plan_.wgmma_tile(d)), hopper=True)
              for dt in (float16, bfloat16) for d in plan_.WGMMA_HEAD_DIMS]
    return specs + [Spec("prefill", _expr(float32, d, False, None)) for d in HEAD_DIMS]


def _device_arch():
    import cupy
    return cupy.cuda.Device().compute_capability


def _backend(backend, dtype, head_dim, layout, opts, xp):
    """The kernel family of a call: "mma" or "wgmma" (the device arch checked for CuPy)."""
    unsupported = plan_.wgmma_unsupported(dtype, head_dim, layout, opts)
    return plan_.resolve_backend(backend, unsupported, None if xp is np else _device_arch(), layout)


def _window(opts):
    """window_left as the kernel's int32; windows past any int32 position hide nothing."""
    return -1 if opts.window_left >= plan_.INT32_MAX else opts.window_left


def _work(q_lens, kv_lens, dtype, num_q_heads, num_kv_heads, head_dim, v_transposed, causal, opts,
          tile=None, backend="mma"):
    """Host work list for one launch (``tile`` overrides the default, benchmarks only)."""
    if tile is None:
        tile = (plan_.wgmma_tile(head_dim) if backend == "wgmma"
                else plan_.launch_tile(dtype, head_dim, v_transposed))
    return plan_.work_list(q_lens, kv_lens, group=num_q_heads // num_kv_heads,
                           num_kv_heads=num_kv_heads, tile=tile, causal=causal,
                           window_left=_window(opts))


def _kernel(dtype, head_dim, v_transposed, tile, backend):
    """(kernel, dynamic smem bytes, threads) of a launch."""
    if backend == "wgmma":
        tile = plan_.wgmma_tile(head_dim) if tile is None else tile
        return (get_kernel("prefill_sm90", _expr_wgmma(dtype, head_dim, tile), hopper=True),
                plan_.wgmma_smem_bytes(head_dim, tile), tile.threads)
    tile = plan_.launch_tile(dtype, head_dim, v_transposed) if tile is None else tile
    return (get_kernel("prefill", _expr(dtype, head_dim, v_transposed, tile)),
            plan_.smem_bytes(dtype, head_dim, v_transposed, tile), tile.threads)


def _launch(q, k, v, out, lse, work, cu_q, kv_info, tables, block_size, strides, opts,
            causal, v_transposed, num_kv_heads, tile=None, backend="mma"):
    """Launch one prefill kernel over ``work`` (device int32 ``[n, 4]``); no host sync.

    ``tile`` overrides the default tile shape (benchmarks; ``work`` must be built for it);
    ``backend`` ("mma" or "wgmma", resolved) picks the kernel family.
    """
    n, head_dim = int(work.shape[0]), int(q.shape[2])
    if n == 0:
        return
    kernel, smem, threads = _kernel(q.dtype, head_dim, v_transposed, tile, backend)
    if allow_dynamic_smem(kernel, smem) and smem > 48 * 1024:
        kernel.preferred_shared_memory_carveout = 100  # room for two CTAs per SM
    i32, i64, f32 = np.int32, np.int64, np.float32
    paged = tables is not None
    args = (q, k, v, out, _NULL if lse is None else lse, work, cu_q, kv_info,
            tables if paged else _NULL, i32(tables.shape[1] if paged else 0), i32(block_size),
            i32(paged), *(i64(s) for s in strides),
            _NULL if opts.alibi_slopes is None else opts.alibi_slopes,
            _NULL if opts.sinks is None else opts.sinks,
            i32(q.shape[1]), i32(num_kv_heads), f32(opts.sm_scale), f32(opts.logits_soft_cap),
            i32(_window(opts)), i32(causal))
    kernel((n,), (threads,), args, shared_mem=smem)


def _outputs(q, out, return_lse, xp):
    out = xp.empty(q.shape, dtype=q.dtype) if out is None else out
    lse = xp.empty(q.shape[:2], dtype=np.float32) if return_lse else None
    return out, lse


def _finish(result, out, return_lse):
    """Reference result, copied into ``out`` when the caller gave one."""
    res, lse = result if return_lse else (result, None)
    if out is not None:
        out[...] = res
        res = out
    return (res, lse) if return_lse else res


def _ref_options(opts, causal):
    return dict(causal=causal, sm_scale=opts.sm_scale, window_left=opts.window_left,
                alibi_slopes=opts.alibi_slopes, sinks=opts.sinks,
                logits_soft_cap=opts.logits_soft_cap)


def _check_common(xp, q, causal, return_lse, out, options):
    causal = plan_.check_flag("causal", causal)
    return_lse = plan_.check_flag("return_lse", return_lse)
    opts = check_options(xp, q.shape[1], q.shape[2], **options)
    if out is not None:
        check_out(out, tuple(q.shape), q.dtype, xp)
    return causal, return_lse, opts


# ----------------------------------------------------------------------------- ragged
@accepts_dlpack
def varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                   causal=True, sm_scale=None, window_left=-1, alibi_slopes=None, sinks=None,
                   logits_soft_cap=0.0, out=None, return_lse=False, backend="auto"):
    """Attention over a ragged batch packed along the token axis.

    Parameters
    ----------
    q : array
        ``[total_q, num_q_heads, head_dim]`` float16, bfloat16 or float32; head_dim in
        (64, 80, 96, 112, 128, 256).
    k, v : array
        ``[total_k, num_kv_heads, head_dim]``, q's dtype; ``num_q_heads % num_kv_heads == 0``.
    cu_seqlens_q, cu_seqlens_k : array
        int32 ``[batch_size + 1]`` prefix sums of query / key lengths (0 allowed), ending at
        ``total_q`` / ``total_k``.
    max_seqlen_q, max_seqlen_k : int, optional
        Hints; when given they must be >= the longest sequence.
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
        Hopper warpgroup-MMA kernel (sm_90 only; fp16/bf16, head_dim 64 or 128, no
        logits_soft_cap or alibi_slopes, positive sm_scale; ValueError otherwise); "auto"
        the wgmma kernel where it applies on sm_90 for the layouts in
        ``prefill_plan.WGMMA_AUTO`` (measured faster: ragged K/V), else "mma".

    Returns
    -------
    out : array
        ``[total_q, num_q_heads, head_dim]``; zeros for rows with no visible key.
    lse : array
        float32 ``[total_q, num_q_heads]``, only with ``return_lse``.
    """
    xp = array_module(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, out)
    cu_q, cu_k = plan_.check_ragged(q, k, v, cu_seqlens_q, cu_seqlens_k, xp)
    q_lens, kv_lens = np.diff(cu_q), np.diff(cu_k)
    plan_.check_max_seqlen("max_seqlen_q", max_seqlen_q, q_lens)
    plan_.check_max_seqlen("max_seqlen_k", max_seqlen_k, kv_lens)
    causal, return_lse, opts = _check_common(
        xp, q, causal, return_lse, out, dict(sm_scale=sm_scale, window_left=window_left,
                                             alibi_slopes=alibi_slopes, sinks=sinks,
                                             logits_soft_cap=logits_soft_cap))
    plan_.check_aligned(q=q, k=k, v=v, out=out)
    backend = _backend(backend, q.dtype, q.shape[2], "ragged", opts, xp)
    if xp is np:
        return _finish(ref.varlen_prefill(q, k, v, cu_q, cu_k, return_lse=return_lse,
                                          **_ref_options(opts, causal)), out, return_lse)
    hk, head_dim = int(k.shape[1]), int(q.shape[2])
    work = _work(q_lens, kv_lens, q.dtype, q.shape[1], hk, head_dim, False, causal, opts,
                 backend=backend)
    out, lse = _outputs(q, out, return_lse, xp)
    _launch(q, k, v, out, lse, xp.asarray(work), cu_seqlens_q, cu_seqlens_k, None, 1,
            plan_.kv_strides("ragged", 1, hk, head_dim, q.dtype), opts, causal, False, hk,
            backend=backend)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- paged
def _check_caches(k_cache, v_cache, layout, xp):
    plan_.check_layout(layout)
    check_array("k_cache", k_cache, xp=xp, contiguous=False)
    check_array("v_cache", v_cache, xp=xp, contiguous=False)
    return cache_geometry(k_cache, v_cache, layout)


@accepts_dlpack
def paged_prefill(q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, *, causal=True,
                  sm_scale=None, window_left=-1, alibi_slopes=None, sinks=None,
                  logits_soft_cap=0.0, layout="NHD", out=None, return_lse=False, backend="auto"):
    """Attention of new query tokens against paged caches (chunked prefill, prefix reuse).

    Sequence ``b``'s ``q_len`` queries are the last ``q_len`` of its ``seq_lens[b]`` cached
    tokens (bottom-right alignment); with ``q_len > seq_lens[b]`` the leading rows see no
    key under ``causal`` and give zeros.

    Parameters
    ----------
    q : array
        ``[total_q, num_q_heads, head_dim]`` float16, bfloat16 or float32.
    k_cache, v_cache : array
        Paged caches in ``layout`` (see ``cupaged.layouts``), q's dtype, holding the new
        tokens' keys and values already.
    cu_seqlens_q : array
        int32 ``[batch_size + 1]`` query prefix sums ending at ``total_q``.
    block_tables : array
        int32 ``[batch_size, max_blocks_per_seq]``; the first ``ceil(seq_lens[b] /
        block_size)`` entries of row ``b`` are block ids, the rest unread (-1).
    seq_lens : array
        int32 ``[batch_size]`` key counts including the new tokens.
    causal, sm_scale, window_left, alibi_slopes, sinks, logits_soft_cap, out, return_lse, backend
        As in :func:`varlen_prefill` ("wgmma": NHD and HND layouts).
    layout : {"NHD", "HND", "vllm"}

    Returns
    -------
    out : array
        ``[total_q, num_q_heads, head_dim]``.
    lse : array
        float32 ``[total_q, num_q_heads]``, only with ``return_lse``.
    """
    xp = array_module(q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, alibi_slopes,
                      sinks, out)
    geo = _check_caches(k_cache, v_cache, layout, xp)
    plan_.check_paged_query(q, geo, k_cache.dtype, xp)
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, xp, total=q.shape[0])
    _, kv_lens = check_block_tables(block_tables, seq_lens, geo, xp, batch=len(cu_q) - 1)
    causal, return_lse, opts = _check_common(
        xp, q, causal, return_lse, out, dict(sm_scale=sm_scale, window_left=window_left,
                                             alibi_slopes=alibi_slopes, sinks=sinks,
                                             logits_soft_cap=logits_soft_cap))
    plan_.check_aligned(q=q, k_cache=k_cache, v_cache=v_cache, out=out)
    backend = _backend(backend, q.dtype, geo.head_dim, layout, opts, xp)
    if xp is np:
        return _finish(ref.paged_prefill(q, k_cache, v_cache, cu_q, block_tables, seq_lens,
                                         layout=layout, return_lse=return_lse,
                                         **_ref_options(opts, causal)), out, return_lse)
    v_t = layout == "vllm" and q.dtype != float32
    work = _work(np.diff(cu_q), kv_lens, q.dtype, q.shape[1], geo.num_kv_heads, geo.head_dim, v_t,
                 causal, opts, backend=backend)
    out, lse = _outputs(q, out, return_lse, xp)
    _launch(q, k_cache, v_cache, out, lse, xp.asarray(work), cu_seqlens_q, seq_lens, block_tables,
            geo.block_size, plan_.kv_strides(layout, *geo[1:], q.dtype), opts, causal, v_t,
            geo.num_kv_heads, backend=backend)
    return (out, lse) if return_lse else out


@accepts_dlpack
def paged_attention(q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, *, causal=True,
                    sm_scale=None, window_left=-1, alibi_slopes=None, sinks=None,
                    logits_soft_cap=0.0, layout="NHD", out=None, return_lse=False,
                    backend="auto"):
    """Attention for a batch mixing decode rows (``q_len = 1``) and prefill rows.

    Same arguments, semantics and results as :func:`paged_prefill`; one launch of the
    unified prefill kernel serves both kinds of rows (a decode row's query-head group is
    packed into one tile, so a decode step reads each K/V tile once per kv head).
    """
    return paged_prefill(q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens,
                         causal=causal, sm_scale=sm_scale, window_left=window_left,
                         alibi_slopes=alibi_slopes, sinks=sinks, logits_soft_cap=logits_soft_cap,
                         layout=layout, out=out, return_lse=return_lse, backend=backend)


# ----------------------------------------------------------------------------- plan / run
def _positive_int(name, value):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)


class PagedPrefiller:
    """Paged prefill planned once per batch step and run once per layer.

    ``plan`` does the host work (checks, tile work list, one upload into buffers owned by
    this object); ``run`` only checks shapes and launches: no host sync, no allocation
    beyond its outputs, and no recompilation when lengths change between plans.

    Parameters
    ----------
    num_q_heads, num_kv_heads, head_dim, block_size : int
        Query heads, kv heads (dividing ``num_q_heads``), head size (64, 80, 96, 112, 128,
        256) and cache block size.
    dtype : str or dtype
        float16, bfloat16 or float32: the dtype of q and the caches.
    layout : {"NHD", "HND", "vllm"}
    causal, window_left, logits_soft_cap, sm_scale, backend
        As in :func:`paged_prefill` ("wgmma" is checked against these here, against the
        device and ``alibi_slopes`` in ``run``; one planned work list serves both kernels).
    """

    def __init__(self, num_q_heads, num_kv_heads, head_dim, block_size, dtype="float16",
                 layout="NHD", *, causal=True, window_left=-1, logits_soft_cap=0.0,
                 sm_scale=None, backend="auto"):
        self.num_q_heads = _positive_int("num_q_heads", num_q_heads)
        self.num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
        self.block_size = _positive_int("block_size", block_size)
        check_head_dim("head_dim", head_dim)
        check_gqa(self.num_q_heads, self.num_kv_heads, "num_kv_heads")
        self.head_dim = int(head_dim)
        self.dtype = as_dtype(dtype)
        self.layout = plan_.check_layout(layout)
        self._v_transposed = self.layout == "vllm" and self.dtype != float32
        self.causal = plan_.check_flag("causal", causal)
        self._options = dict(sm_scale=sm_scale, window_left=window_left,
                             logits_soft_cap=logits_soft_cap)
        self._opts = check_options(np, self.num_q_heads, self.head_dim, **self._options)
        plan_.resolve_backend(backend, plan_.wgmma_unsupported(self.dtype, self.head_dim,
                                                               self.layout, self._opts))
        self.backend = backend
        self._host = self._device = None

    @accepts_dlpack
    def plan(self, cu_seqlens_q, block_tables, seq_lens):
        """Check a batch step and prepare its work list.

        Parameters
        ----------
        cu_seqlens_q : array
            int32 ``[batch_size + 1]`` query prefix sums (decode rows have length 1).
        block_tables : array
            int32 ``[batch_size, max_blocks_per_seq]``, -1 padded.
        seq_lens : array
            int32 ``[batch_size]`` key counts including the new tokens.
        """
        xp = array_module(cu_seqlens_q, block_tables, seq_lens)
        cu = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, xp)
        geo = CacheGeometry(plan_.INT32_MAX, self.block_size, self.num_kv_heads, self.head_dim)
        bt, sl = check_block_tables(block_tables, seq_lens, geo, xp, batch=len(cu) - 1)
        used = np.arange(bt.shape[1])[None, :] < -(-sl.astype(np.int64) // self.block_size)[:, None]
        work = _work(np.diff(cu), sl, self.dtype, self.num_q_heads, self.num_kv_heads,
                     self.head_dim, self._v_transposed, self.causal, self._opts)
        self._host = dict(cu=cu, bt=bt, sl=sl, total_q=int(cu[-1]), work=len(work),
                          max_block=int(bt[used].max()) if used.any() else -1)
        self._device = self._upload(work, cu, sl, bt) if gpu_available() else None
        return self

    @staticmethod
    def _upload(work, cu, sl, bt):
        """One host-to-device copy of every planned array; views into the owned buffer."""
        import cupy
        parts = [work.ravel(), cu, sl, bt.ravel()]
        buf = cupy.asarray(np.concatenate([np.asarray(p, dtype=np.int32) for p in parts]))
        bounds = np.cumsum([0] + [p.size for p in parts])
        views = [buf[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        return dict(buf=buf, work=views[0].reshape(-1, 4), cu=views[1], sl=views[2],
                    bt=views[3].reshape(bt.shape))

    def _check_run(self, q, k_cache, v_cache, xp):
        if self._host is None:
            raise ValueError("PagedPrefiller.run: expected plan() to be called first, got no plan")
        geo = _check_caches(k_cache, v_cache, self.layout, xp)
        want = (self.block_size, self.num_kv_heads, self.head_dim)
        if tuple(geo[1:]) != want:
            raise ValueError(f"k_cache: expected (block_size, num_kv_heads, head_dim) {want} as "
                             f"planned, got {tuple(geo[1:])}")
        if self._host["max_block"] >= geo.num_blocks:
            raise ValueError(f"block_tables: planned block id {self._host['max_block']} is out of "
                             f"range for a cache of {geo.num_blocks} blocks")
        check_array("q", q, shape=(self._host["total_q"], self.num_q_heads, self.head_dim),
                    dtypes=self.dtype, xp=xp)
        plan_.check_paged_query(q, geo, k_cache.dtype, xp)
        return geo

    @accepts_dlpack
    def run(self, q, k_cache, v_cache, *, sinks=None, alibi_slopes=None, out=None,
            return_lse=False):
        """Attention of the planned batch for one layer.

        Parameters
        ----------
        q : array
            ``[total_q, num_q_heads, head_dim]`` in the planned dtype.
        k_cache, v_cache : array
            Paged caches in the planned layout and geometry.
        sinks, alibi_slopes : array, optional
            float32 ``[num_q_heads]``.
        out : array, optional
            ``[total_q, num_q_heads, head_dim]``, written in place.
        return_lse : bool

        Returns
        -------
        out : array
            ``[total_q, num_q_heads, head_dim]``.
        lse : array
            float32 ``[total_q, num_q_heads]``, only with ``return_lse``.
        """
        xp = array_module(q, k_cache, v_cache, sinks, alibi_slopes, out)
        geo = self._check_run(q, k_cache, v_cache, xp)
        causal, return_lse, opts = _check_common(
            xp, q, self.causal, return_lse, out,
            dict(self._options, alibi_slopes=alibi_slopes, sinks=sinks))
        plan_.check_aligned(q=q, k_cache=k_cache, v_cache=v_cache, out=out)
        backend = _backend(self.backend, self.dtype, self.head_dim, self.layout, opts, xp)
        h = self._host
        if xp is np:
            return _finish(ref.paged_prefill(q, k_cache, v_cache, h["cu"], h["bt"], h["sl"],
                                             layout=self.layout, return_lse=return_lse,
                                             **_ref_options(opts, causal)), out, return_lse)
        d = self._device
        out, lse = _outputs(q, out, return_lse, xp)
        _launch(q, k_cache, v_cache, out, lse, d["work"], d["cu"], d["sl"], d["bt"],
                self.block_size, plan_.kv_strides(self.layout, *geo[1:], q.dtype), opts, causal,
                self._v_transposed, self.num_kv_heads, backend=backend)
        return (out, lse) if return_lse else out
