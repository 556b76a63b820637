"""Prefill launches: kernel choice ("mma" or "wgmma") and tile, the work list, each launch's
argument record (``abi.PREFILL``, ``abi.PREFILL_PLAN``) packed once per call shape, and the
launches on the current stream.

The pure host planning (tile shapes, work lists, checks) is ``prefill.plan``; the public ops
and the wrapper that call these live in ``prefill.api``.
"""
from __future__ import annotations

import numpy as np

from ..cache_ops.api import GatherLaunch
from ..core import abi, errors, tma
from . import plan as plan_
from ..core.arrays import HEAD_DIMS, bfloat16, float16, float32, gpu_available
from ..core.checks import INT32_MAX, table_stride, token_stride
from ..core.compile import Spec, kv_types, launcher
from ..core.device import current, scratch
from ..core.fp8 import KV_DTYPES
from ..core.launch import current_stream, ptr
from ..core.layouts import cache_strides, layout_strides
from ..decode import launch as decode_launch

PLAN_EXPR = "cupaged::plan::prefill_plan_kernel"


# ----------------------------------------------------------------------------- kernels
def _expr(dtype, head_dim, v_transposed, tile, kv=None):
    """Template name of the kernel for ``dtype`` / ``head_dim`` / tile / cache format ``kv``
    (fp32: CUDA cores)."""
    if np.dtype(dtype) == float32:
        return f"cupaged::prefill_simt_kernel<{head_dim}>"
    vt = "true" if v_transposed else "false"
    return f"cupaged::prefill_mma_kernel<{kv_types(dtype, kv)}, {head_dim}, {vt}, {tile.cpp()}>"


def _expr_wgmma(dtype, head_dim, tile, v_transposed, general, kv=None):
    """Template name of the sm_90a wgmma kernel of ``tile`` (``general``: the score epilogue
    path)."""
    if tile.ws:
        g = "true" if general else "false"
        name = "prefill_ws_tma_kernel" if tile.tma else "prefill_ws_kernel"
        slots = f", {tile.slots}" if tile.tma else ""  # SLOTS: the TMA kernel's last argument
        return (f"cupaged::{name}<{kv_types(dtype, kv)}, {head_dim}, {tile.block_n}, "
                f"{tile.stages}, {g}, {tile.producer_regs}{slots}>")
    flags = ", ".join("true" if f else "false" for f in (v_transposed, general))
    return (f"cupaged::prefill_wgmma_kernel<{kv_types(dtype, kv)}, {head_dim}, {tile.block_n}, "
            f"{tile.stages}, {flags}>")


def kernel_specializations():
    """Every prefill kernel specialisation: (fp16, bf16) x head dims x (V rows, V^T for the
    vllm value layout) at the default tile of the head size, fp32 x head dims (one
    CUDA-core kernel for all layouts), and the sm_90a wgmma kernel for (fp16, bf16) x head
    dims x (V rows, V^T) x (plain, general scores) at its tile; the same from fp8 caches of
    each format for the head dims ``plan.FP8_HEAD_DIMS``; the TMA-fed warp-specialised
    kernel (``plan.tma_tile``, the ragged default where ``plan.tma_fits``) for (fp16, bf16)
    x ``plan.TMA_HEAD_DIMS`` x (plain, general scores), and its fp8 tile
    (``plan.tma_tile(d, kv=kv)``, opt-in) for the same from caches of each format. The
    benchmark's other tiles compile on demand."""
    specs = []
    for kv in (None,) + KV_DTYPES:
        dims = HEAD_DIMS if kv is None else plan_.FP8_HEAD_DIMS
        specs += [Spec("prefill", _expr(dt, d, vt, plan_.default_tile(d, vt), kv))
                  for dt in (float16, bfloat16) for d in dims for vt in (False, True)]
        specs += [Spec("prefill_sm90",
                       _expr_wgmma(dt, d, plan_.wgmma_tile(d, kv, vt), vt, general, kv),
                       hopper=True)
                  for dt in (float16, bfloat16) for d in dims if d in plan_.WGMMA_HEAD_DIMS
                  for vt in (False, True) for general in (False, True)]
    specs += [Spec("prefill_sm90", _expr_wgmma(dt, d, plan_.tma_tile(d, kv=kv), False, general, kv),
                   hopper=True)
              for kv in (None,) + KV_DTYPES for dt in (float16, bfloat16)
              for d in plan_.TMA_HEAD_DIMS for general in (False, True)]
    return (specs + [Spec("prefill", _expr(float32, d, False, None)) for d in HEAD_DIMS]
            + [Spec("plan", PLAN_EXPR)])


def _device_arch():
    import cupy
    return cupy.cuda.Device().compute_capability


def choose_backend(backend, dtype, head_dim, layout, opts, xp):
    """The kernel family of a call: "mma" or "wgmma" (the device arch checked for CuPy)."""
    unsupported = plan_.wgmma_unsupported(dtype, head_dim, layout, opts)
    return plan_.resolve_backend(backend, unsupported, None if xp is np else _device_arch(), layout)


def _window(opts):
    """window_left as the kernel's int32; windows past any int32 position hide nothing."""
    return -1 if opts.window_left >= INT32_MAX else opts.window_left


def _tile(dtype, head_dim, v_transposed, backend, tile=None, kv=None, geometry=None):
    """The tile of a launch (``tile`` overrides the default, benchmarks only; ``geometry``:
    the launch's ``plan.TmaGeometry``, ``plan.wgmma_tile``)."""
    if tile is not None:
        return tile
    if backend == "wgmma":
        return plan_.wgmma_tile(head_dim, kv, v_transposed, geometry=geometry)
    return plan_.launch_tile(dtype, head_dim, v_transposed)


def sections(kv_tokens, head_dim, dtype, kv, num_kv_heads):
    """kv heads per section of a launch's work list (``plan.section_heads``) on the current
    device, for ``kv_tokens`` keys per head in q's ``dtype`` or the fp8 format ``kv``; None
    (one section) without a device, where no list is launched."""
    if not gpu_available():
        return None
    itemsize = 1 if kv is not None else np.dtype(dtype).itemsize
    return plan_.section_heads(kv_tokens, head_dim, itemsize, num_kv_heads, current().l2_bytes)


def host_work(q_lens, kv_lens, dtype, num_q_heads, num_kv_heads, head_dim, v_transposed, causal,
              opts, tile=None, backend="mma", kv=None):
    """Host work list for one launch (``kv``: the caches' fp8 format or None)."""
    tile = _tile(dtype, head_dim, v_transposed, backend, tile)
    return plan_.work_list(q_lens, kv_lens, group=num_q_heads // num_kv_heads,
                           num_kv_heads=num_kv_heads, tile=tile, causal=causal,
                           window_left=_window(opts),
                           section_heads=sections(int(np.sum(kv_lens)), head_dim, dtype, kv,
                                                  num_kv_heads))


def _kernel(dtype, head_dim, v_transposed, tile, backend, general=False, kv=None):
    """(kernel, dynamic smem bytes, threads) of a launch (``general``: the wgmma kernel's
    score epilogue path, ``plan.general_scores``; ``kv``: the caches' fp8 format or None)."""
    tile = _tile(dtype, head_dim, v_transposed, backend, tile, kv)
    if backend == "wgmma":
        smem = plan_.wgmma_smem_bytes(head_dim, tile, kv)
        expr = _expr_wgmma(dtype, head_dim, tile, v_transposed, general, kv)
        record = abi.PREFILL_TMA if tile.tma else abi.PREFILL
        return (launcher("prefill_sm90", expr, record,
                         hopper=True, smem=smem, carveout=smem > 48 * 1024), smem, tile.threads)
    smem = plan_.smem_bytes(dtype, head_dim, v_transposed, tile, kv)
    return (launcher("prefill", _expr(dtype, head_dim, v_transposed, tile, kv), abi.PREFILL,
                     smem=smem, carveout=smem > 48 * 1024), smem, tile.threads)


def work_capacity(total_q, batch, group, num_kv_heads, block_m, split=False):
    """Work items a launch over ``total_q`` query rows of ``batch`` sequences can need:
    ``sum(ceil(q_len * group / block_m)) <= ceil(total_q * group / block_m) + batch`` per
    kv head (the grid of a device-planned launch, which the host sizes without reading the
    lengths). ``split``: decode rows take no item (paged_attention's split), so at most
    ``total_q // 2`` sequences have any."""
    if split:
        batch = min(batch, total_q // 2)
    return (-(-total_q * group // block_m) + batch) * num_kv_heads


class Launches:
    """The launches of one prefill call shape, their fixed arguments packed once: the plan
    kernel (device work lists: checks, padding rows zeroed, items written into per-stream
    scratch, the list sized by :func:`work_capacity`, or into ``owned`` buffers) and the
    prefill kernel, one CTA per work item of the list's capacity.
    ``__call__`` gives the arrays. With ``work`` (a host list) the plan kernel is left out.

    Parameters
    ----------
    q : array
        The call's query (shape, dtype, strides).
    tables : array or None
        Block tables (paged) or None (ragged K/V).
    strides : cupaged.core.layouts.CacheStrides
    kv : str, optional
        The caches' fp8 format (``"fp8_e4m3"``, ``"fp8_e5m2"``); None: q's dtype.
    scales : dict, optional
        The fp8 scale fields but the pointers (``core.fp8.kernel_scales``), fixed for the
        call shape; the scale arrays' addresses come with each launch.
    owned : tuple of arrays, optional
        ``(work, plan scratch, done counter)``: int32 device buffers of the caller (a
        :class:`PagedPrefiller`'s, at fixed addresses) for the plan kernel: ``[capacity, 4]``
        (at least :func:`work_capacity`), ``1 + 2 * batch`` and 1 elements, the last two
        zero when first used.
    rows : array, optional
        int32 device ``[batch]``: paged_attention's split (:class:`MixedLaunches`): the plan
        kernel lists no decode row and writes the decode launch's row map there (a host
        ``work`` list leaves both to the host: ``plan.decode_rows``).
    """

    def __init__(self, q, batch, tables, block_size, num_blocks, total_k, num_kv_heads,
                 strides, opts, causal, v_transposed, backend, tile=None, work=None,
                 name="prefill", owned=None, kv=None, scales=None, rows=None):
        total_q, hq, d = q.shape
        self.dtype = q.dtype
        group = hq // num_kv_heads
        paged = tables is not None
        geometry = (plan_.TmaGeometry(strides, block_size=block_size, num_blocks=num_blocks)
                    if paged else plan_.TmaGeometry(strides, total_k=total_k))
        self.tile = _tile(q.dtype, d, v_transposed, backend, tile, kv, geometry)
        self.kernel, self.smem, self.threads = _kernel(q.dtype, d, v_transposed, self.tile,
                                                       backend, plan_.general_scores(opts), kv)
        plan_.check_tma(self.tile, d, kv, geometry)
        self.plan = None
        if work is None:
            if owned is None:
                capacity = work_capacity(total_q, batch, group, num_kv_heads, self.tile.block_m,
                                         rows is not None)
                owned = (scratch(f"{name}.work", 4 * capacity)[:4 * capacity].reshape(capacity, 4),
                         scratch(f"{name}.plan", 1 + 2 * batch, zero=True),
                         scratch(f"{name}.done", 1, zero=True))
            work, plan_scratch, done = owned
            capacity = work.shape[0]
            self.section_heads = self._sections(batch, tables, block_size, num_blocks, total_k,
                                                d, kv, num_kv_heads)
            self.plan = (launcher("plan", PLAN_EXPR, abi.PREFILL_PLAN).at(
                min(max(batch, 1), abi.PLAN_CTAS), abi.PLAN_THREADS), abi.PREFILL_PLAN.bind(
                work=ptr(work), scratch=ptr(plan_scratch),
                done=ptr(done), err=ptr(errors.error_word()),
                row_bytes=hq * d * q.itemsize, batch=batch, total_q=total_q, total_k=total_k,
                paged=int(paged), width=tables.shape[1] if paged else 0,
                bt_stride=table_stride(tables), block_size=block_size, num_blocks=num_blocks,
                group=group, num_kv_heads=num_kv_heads, num_q_heads=hq,
                block_m=self.tile.block_m, block_n=self.tile.block_n, causal=int(causal),
                window_left=_window(opts), capacity=capacity, rows=ptr(rows),
                section_heads=self.section_heads))
        self.work = work
        self.go = self.kernel.at(work.shape[0], self.threads, self.smem)
        # TMA: the K/V tensor maps, made per call from the addresses (core.tma)
        self._maps = None
        if self.tile.tma:
            self._maps = tma.KVMaps(num_kv_heads, d, strides, self.tile.block_n, total_k,
                                    *((block_size, num_blocks) if paged else (None, None)),
                                    itemsize=1 if kv is not None else q.itemsize)
        self.args = (abi.PREFILL_TMA if self.tile.tma else abi.PREFILL).bind(
            work=ptr(work), max_blocks=table_stride(tables), block_size=block_size,
            paged=int(paged), k_block=strides.k_block, k_head=strides.k_head,
            k_chunk=strides.k_chunk, k_tok=strides.k_tok, v_block=strides.v_block,
            v_head=strides.v_head, v_dim=strides.v_dim, v_tok=strides.v_tok, num_q_heads=hq,
            num_kv_heads=num_kv_heads, sm_scale=opts.sm_scale, soft_cap=opts.logits_soft_cap,
            window_left=_window(opts), causal=int(causal), q_tok=token_stride("q", q),
            **(scales or {}))
        # positional packers of the launches' per-call addresses
        maps = ("k_map", "v_map") if self.tile.tma else ()
        self._pack = self.args.packer("q", "k", "v", "out", "lse", "cu_q", "kv_info",
                                      "block_tables", "alibi", "sinks", "k_scale", "v_scale",
                                      *maps)
        self._plan_pack = None if self.plan is None else self.plan[1].packer(
            "cu_q", "kv_info", "block_tables", "out", "lse")

    def _sections(self, batch, tables, block_size, num_blocks, total_k, head_dim, kv,
                  num_kv_heads):
        """kv heads per section of the device list: the keys per head are ``total_k``
        (ragged) or bounded by the blocks the tables can name (paged)."""
        if tables is not None:
            total_k = min(num_blocks, batch * tables.shape[1]) * block_size
        return sections(total_k, head_dim, self.dtype, kv, num_kv_heads) or num_kv_heads

    def __call__(self, q, k, v, out, lse, cu_q, kv_info, tables, alibi, sinks, stream,
                 k_scale=0, v_scale=0):
        """Launch on ``stream`` (a raw pointer), without a host sync; every array by its
        device address (0 for None; ``k_scale`` / ``v_scale``: fp8 scale arrays)."""
        if self.plan is not None:
            self.plan[0](self._plan_pack(cu_q, kv_info, tables, out, lse), stream)
        maps = () if self._maps is None else self._maps(k, v)
        self.go(self._pack(q, k, v, out, lse, cu_q, kv_info, tables, alibi, sinks, k_scale,
                           v_scale, *maps), stream)


class MixedLaunches:
    """paged_attention's launches with its decode rows split off (docs/prefill.md, "Mixed
    batches"): the prefill launches (``prefill``, a :class:`Launches` with a row map: the
    plan kernel lists the rows of sequences with ``q_len > 1`` and writes the decode rows'
    map) and the split-KV decode launches (``decode``, a ``decode.launch.row_map_step``:
    decode_plan_kernel, the decode kernel and its merge, reading q and writing out / lse
    through the map). Called as :class:`Launches`."""

    def __init__(self, prefill, decode, strides):
        self.prefill, self.decode, self.strides = prefill, decode, strides
        self.dtype = prefill.dtype
        self.work = prefill.work

    def __call__(self, q, k, v, out, lse, cu_q, kv_info, tables, alibi, sinks, stream,
                 k_scale=0, v_scale=0):
        """Launch both on ``stream``, without a host sync (prefill plan and kernel, then
        decode plan, kernel and merge)."""
        self.prefill(q, k, v, out, lse, cu_q, kv_info, tables, alibi, sinks, stream, k_scale,
                     v_scale)
        decode_launch.launch_decode(self.decode, self.strides,
                                    (q, k, v, 0, 0, alibi, sinks, k_scale, v_scale), out, lse,
                                    tables, kv_info, stream)


class GatherLaunches:
    """A paged batch as the gather of its sequences' pages into packed rows (``gather``, a
    ``cache_ops.api.GatherLaunch`` writing ``rows``' ``k`` and ``v`` and their offsets
    ``cu_k``, int32 ``[batch + 1]``, from the lengths it reads on the device) and the
    ragged launches over them (``ragged``, a :class:`Launches` over a host work list or
    the plan kernel's, the kv info ``cu_k``; an fp8 cache's scales given to it, as to the
    paged kernel). Called as :class:`Launches`: the cache, its block tables, the lengths and
    the scales are the call's."""

    def __init__(self, gather, ragged, rows):
        self.gather, self.ragged = gather, ragged
        self.dtype = ragged.dtype
        self.work = ragged.work
        self._k, self._v, self._cu_k = ptr(rows["k"]), ptr(rows["v"]), ptr(rows["cu_k"])

    def __call__(self, q, k, v, out, lse, cu_q, kv_info, tables, alibi, sinks, stream,
                 k_scale=0, v_scale=0):
        """Launch both on ``stream``, without a host sync (``kv_info``: the paged lengths,
        read by the gather)."""
        self.gather(k, v, tables, kv_info, stream)
        self.ragged(q, self._k, self._v, out, lse, cu_q, self._cu_k, 0, alibi, sinks, stream,
                    k_scale, v_scale)


def gather_launches(q, batch, tables, geo, strides, opts, causal, backend, kv, scales, rows,
                    work=None, owned=None, name="prefill"):
    """The :class:`GatherLaunches` of a paged call shape over ``batch`` sequences (block
    tables ``tables``, cache geometry ``geo`` and element ``strides``; ``kv``: the caches'
    fp8 format or None) into ``rows`` (``gather_buffers``); ``work`` and ``owned`` as in
    :class:`Launches`, for the ragged launch over the packed rows."""
    packed = layout_strides("ragged", 1, geo.num_kv_heads, geo.head_dim, q.itemsize)
    ragged = Launches(q, batch, None, 1, 0, rows["k"].shape[0], geo.num_kv_heads, packed, opts,
                      causal, False, backend, work=work, name=name, owned=owned, scales=scales)
    gather = GatherLaunch(q.dtype, kv, strides, geo, batch, tables, rows["cu_k"], rows["k"],
                          rows["v"])
    return GatherLaunches(gather, ragged, rows)


def gather_buffers(name, tokens, batch, num_kv_heads, head_dim, dtype):
    """Packed rows for :func:`gather_launches` from per-stream scratch ``name`` (grown only;
    a replaced buffer is kept for the launches that hold it): ``k`` and ``v`` of ``tokens``
    rows ``[num_kv_heads, head_dim]`` of 16-bit elements, ``cu_k`` of ``batch + 1``
    ints."""
    n = max(int(tokens), 1) * num_kv_heads * head_dim
    k = scratch(f"{name}.gather_k", n, np.uint16)[:n].reshape(-1, num_kv_heads, head_dim)
    v = scratch(f"{name}.gather_v", n, np.uint16)[:n].reshape(-1, num_kv_heads, head_dim)
    return dict(k=k, v=v, cu_k=scratch(f"{name}.gather_cu", batch + 1)[:batch + 1])


def gathers_by_default(dtype, value_dims):
    """Whether a paged prefill leaves its gather to the batch's reuse of its keys
    (``plan.gather_pays``): an sm_90 device, 16-bit rows, values not in the vllm layout's
    dims (``value_dims``: read an element at a time, too slow to pay)."""
    return (np.dtype(dtype) != float32 and not value_dims and gpu_available()
            and current().compute_capability == "90")


def gatherable(strides, kv, itemsize, block_size):
    """Whether ``gather_kv`` can read caches of these element strides (``kv``: fp8 format
    or None) and block size: every key offset, and the value offsets but the vllm layout's
    dims, whole 16-byte chunks (token strides do not count in blocks of one token)."""
    x = 16 // (1 if kv is not None else itemsize)
    toks = block_size > 1
    keys = (strides.k_block, strides.k_head, strides.k_chunk) + ((strides.k_tok,) if toks else ())
    values = (strides.v_block, strides.v_head) + (
        (strides.v_tok,) if strides.v_dim == 1 and toks else ())
    return all(s % x == 0 for s in keys + values)


def can_split(q, k_cache, v_cache, batch):
    """Whether paged_attention's decode rows can take the decode launch: a batch with
    query rows, and q's row stride and the caches' block strides within the decode
    kernel's 32-bit ints (otherwise every row stays on the prefill launch, which takes
    64-bit strides)."""
    strides = [c.strides[0] // c.itemsize for c in (k_cache, v_cache)]
    return (batch > 0 and q.shape[0] > 0 and max(strides) <= INT32_MAX
            and token_stride("q", q) <= INT32_MAX)


def split_launches(q, k_cache, v_cache, batch, tables, geo, layout, opts, causal, v_transposed,
                   backend, kv=None, scales=None, work=None, rows=None, owned=None,
                   decode_buffers=None, name="mixed", tile=None):
    """The :class:`MixedLaunches` of a paged_attention call shape over ``batch`` sequences
    (block tables ``tables``, cache geometry ``geo``): ``work`` and ``rows`` a host plan's
    uploads (``plan.decode_rows``), else the plan kernel writes both (``rows``: a device
    buffer of ``batch`` ints, default per-stream scratch; ``owned`` as in
    :class:`Launches`; ``tile``: the prefill launch's, as there); ``decode_buffers``:
    ``decode.launch.row_map_buffers`` or a callable ``(launch, batch)`` giving them
    (default per-stream scratch)."""
    dl = decode_launch
    if rows is None:
        rows = scratch(f"{name}.rows", max(batch, 1))[:batch]
    pre = Launches(q, batch, tables, geo.block_size, geo.num_blocks, 0, geo.num_kv_heads,
                   cache_strides(k_cache, v_cache, layout, geo), opts, causal, v_transposed,
                   backend, tile=tile, work=work, name=name, owned=owned, kv=kv,
                   scales=scales, rows=rows)
    launch = dl.current_geometry(q.dtype, q.shape[2], layout, geo.block_size, q.shape[1],
                                 geo.num_kv_heads, "auto", batch, kv)
    if decode_buffers is None:
        decode_buffers = dl.row_map_buffers(launch, batch, f"{name}.decode")
    elif callable(decode_buffers):  # the owner's, for this geometry
        decode_buffers = decode_buffers(launch, batch)
    step = dl.row_map_step(launch, q.dtype, q.shape[1],
                           opts._replace(window_left=_window(opts)), batch, tables.shape[1],
                           table_stride(tables), rows, decode_buffers)
    return MixedLaunches(pre, step, dl.call_strides(q, k_cache, v_cache, None, None, scales))


def addresses(*arrays):
    """The device addresses of CuPy arrays (0 for None)."""
    return [ptr(a) for a in arrays]


def _device_work(q, out, lse, cu_q, kv_info, tables, block_size, num_blocks, total_k,
                 num_kv_heads, tile, causal, opts, name="prefill"):
    """The device work list of a call (the plan kernel alone; tests of its output) and its
    kv heads per section."""
    strides = layout_strides("ragged", 1, num_kv_heads, q.shape[2], q.itemsize)
    run = Launches(q, cu_q.shape[0] - 1, tables, block_size, num_blocks, total_k,
                   num_kv_heads, strides, opts, causal, False, "mma", tile=tile, name=name)
    go, args = run.plan
    go(args.pack(cu_q=ptr(cu_q), kv_info=ptr(kv_info), block_tables=ptr(tables), out=ptr(out),
                 lse=ptr(lse)), current_stream())
    return run.work, run.section_heads


def _launch(q, k, v, out, lse, work, cu_q, kv_info, tables, block_size, strides, opts,
            causal, v_transposed, num_kv_heads, tile=None, backend="mma"):
    """Launch one prefill kernel over a host-planned ``work`` (device int32 ``[n, 4]``),
    set up for this call alone; no host sync (tests of explicit tiles)."""
    total_k = k.shape[0] if tables is None else 0
    Launches(q, cu_q.shape[0] - 1, tables, block_size, 0, total_k, num_kv_heads, strides, opts,
             causal, v_transposed, backend, tile=tile, work=work)(
        *addresses(q, k, v, out, lse, cu_q, kv_info, tables, opts.alibi_slopes, opts.sinks),
        current_stream())
