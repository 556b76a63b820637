"""Paged decode launches: kernel choice, the launch geometry on a device, each kernel's
argument record packed once per step, and the launches of a step on the current stream.

The step's host plan (pieces, head layout, strides, merge) comes from ``decode.plan``; the
public ops and the wrapper that call these live in ``decode.api``.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from ..core import abi, errors
from . import checks, plan
from ..core.arrays import FLOAT_DTYPES, HEAD_DIMS, host
from ..core.checks import table_stride, token_stride
from ..core.compile import Spec, ctype, kv_types, launcher
from ..core.device import current, facts, scratch
from ..core.fp8 import KV_DTYPES
from ..core.launch import ptr
from ..core.layouts import block_stride



# ----------------------------------------------------------------------------- kernels
def _decode_expr(dtype, head_dim, vllm_v, head_tiles, kv=None):
    return (f"cupaged::decode::paged_decode_kernel<{kv_types(dtype, kv)}, {head_dim}, "
            f"{'true' if vllm_v else 'false'}, {head_tiles}>")


def _pages_expr(dtype, head_dim, head_major=False, kv=None):
    return (f"cupaged::decode::paged_decode_pages_kernel<{kv_types(dtype, kv)}, {head_dim}, "
            f"{'true' if head_major else 'false'}>")


def _launch_expr(launch, dtype):
    """The decode kernel of ``launch``."""
    if launch.pages:
        return _pages_expr(dtype, launch.head_dim, launch.head_major, launch.kv)
    return _decode_expr(dtype, launch.head_dim, launch.vllm_v, launch.tiles.head_tiles,
                        launch.kv)


def _merge_expr(in_dtype, out_dtype):
    return f"cupaged::merge::merge_states_kernel<{ctype(in_dtype)}, {ctype(out_dtype)}>"


def _pieces_expr(dtype, head_dim):
    return f"cupaged::merge::merge_pieces_kernel<{ctype(dtype)}, {-(-head_dim // 128)}>"


def _append_expr(dtype, kv=None):
    return f"cupaged::decode::append_kv_kernel<{kv_types(dtype, kv)}>"


PLAN_EXPR = "cupaged::plan::decode_plan_kernel"


def _decode_kernel(launch, dtype):
    return launcher("decode", _launch_expr(launch, dtype), abi.DECODE, hopper=launch.pages,
                    smem=launch.tiles.smem_bytes, carveout=True)


@functools.lru_cache(maxsize=None)
def _geometry(device_id, dtype, head_dim, layout, block_size, num_q_heads, num_kv_heads, pages,
              kv):
    """The launch geometry on a device: one CTA per slot its decode kernel can hold."""
    import cupy
    from cupy_backends.cuda.api import driver
    launch = plan.plan_launch(itemsize=1 if kv else dtype.itemsize, head_dim=head_dim,
                              layout=layout, block_size=block_size, num_q_heads=num_q_heads,
                              num_kv_heads=num_kv_heads, pages=pages, kv=kv)
    with cupy.cuda.Device(device_id):
        kernel = _decode_kernel(launch, dtype)
    smem = launch.tiles.smem_bytes
    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.ptr, launch.threads, smem)
    sms = facts(device_id).sms
    return launch._replace(columns=max(1, sms * max(1, per_sm) // launch.row_groups))


def current_geometry(dtype, head_dim, layout, block_size, num_q_heads, num_kv_heads, backend,
                      batch, kv=None):
    """The launch geometry of a ``batch``-sequence step on the current device for q of
    ``dtype`` and caches of fp8 format ``kv`` (None: of ``dtype``), its kernel path resolved
    from ``backend`` (``dp.resolve_backend``)."""
    device = current()
    dtype = np.dtype(dtype)
    pages = plan.resolve_backend(backend, device.compute_capability, 1 if kv else dtype.itemsize,
                                 int(head_dim), layout, int(block_size), int(num_q_heads),
                                 int(num_kv_heads), int(batch))
    return _geometry(device.id, dtype, int(head_dim), layout, int(block_size), int(num_q_heads),
                     int(num_kv_heads), pages, kv)


# ----------------------------------------------------------------------------- device steps
class _DeviceStep(NamedTuple):
    """Device side of one step: geometry, kernels, and each launch's fixed arguments packed
    once (``_launch.Bound``), leaving the run's arrays (q, caches, outputs, per-head
    arrays, tables and lengths) to :func:`launch_decode`."""
    launch: object       # decode.plan.DecodeLaunch on this device
    launches: tuple      # Kernel.at launches: append (or None), decode, merge_pieces (or
                         # None), plan (or None)
    plan_args: object    # Bound of DECODE_PLAN (None: planned on the host)
    append_args: object  # Bound of APPEND (None: no append)
    decode_args: object  # Bound of DECODE
    merge_args: object   # Bound of MERGE_PIECES (None: the fused merge)
    merge_wph: int       # warps a head of merge_pieces_kernel (0: the fused merge)
    tables: object       # int32 [batch, >= width] block tables of a plan's own (None: the call's)
    lens: object         # int32 [batch] lengths of a plan's own (None: the call's)
    keep: tuple          # the device arrays the packed arguments point into (kept alive)
    packers: dict        # Strides -> the launches' positional packers (_packers)


def _stride_fields(strides):
    """The DECODE and APPEND fields of a cache's strides (the block strides come with the
    caches): key head, token and chunk; value head, token, chunk and element."""
    return dict(khs=strides.k_head, kts=strides.k_tok, kcs=strides.k_chunk,
                vhs=strides.v_head, vts=strides.v_tok, vcs=strides.v_chunk, ves=strides.v_dim)


def _decode_fields(launch, num_q_heads, bt_stride, opts, fused):
    """DECODE's fixed fields of a launch (the block strides come with the caches)."""
    return dict(**_stride_fields(launch.strides), block_size=launch.block_size,
                block_magic=launch.block_magic, block_shift=launch.block_shift,
                bt_stride=bt_stride, num_q_heads=num_q_heads,
                num_kv_heads=launch.num_kv_heads, head_warps=launch.heads.head_warps,
                head_chunks=launch.heads.head_chunks, window_left=opts.window_left,
                fused_merge=int(fused), scale_log2=opts.sm_scale * abi.LOG2E,
                sm_scale=opts.sm_scale, soft_cap=opts.logits_soft_cap,
                tile_tokens=launch.tiles.tile)


def _partials(xp, launch, num_slots, name=None):
    """Partial rows and LSEs for ``num_slots`` slots (None, None without any); per-stream
    scratch when ``name`` is given."""
    if not num_slots:
        return None, None
    rows = num_slots * launch.row_groups * launch.heads_per_group
    if name is None:
        return xp.empty(rows * launch.head_dim, np.float32), xp.empty(rows, np.float32)
    buf = scratch(name, rows * (launch.head_dim + 1), np.float32)
    return buf[:rows * launch.head_dim], buf[rows * launch.head_dim:rows * (launch.head_dim + 1)]


def _device_step(launch, dtype, num_q_heads, head_dim, opts, merge, append, batch, bt_stride,
                 work, seq_info, lens, counters, pool, part_out, part_lse, plan_args=None,
                 tables=None, own_lens=None):
    """Kernels and fixed arguments of a step whose descriptors are at ``work``, piece info
    at ``seq_info`` and the lengths the append reads at ``lens``."""
    fused = merge == "fused"
    append_args = None
    if append:
        append_args = abi.APPEND.bind(
            seq_lens=ptr(lens), bt_stride=bt_stride, block_size=launch.block_size,
            num_kv_heads=launch.num_kv_heads, head_dim=head_dim, **_stride_fields(launch.strides))
    decode_args = abi.DECODE.bind(
        work=ptr(work), part_out=ptr(part_out), part_lse=ptr(part_lse),
        counters=ptr(counters) if fused else 0, pool_ctr=ptr(pool),
        **_decode_fields(launch, num_q_heads, bt_stride, opts, fused))
    merge_args = None
    if not fused:
        merge_args = abi.MERGE_PIECES.bind(
            part_out=ptr(part_out), part_lse=ptr(part_lse), seq_info=ptr(seq_info),
            num_q_heads=num_q_heads, num_kv_heads=launch.merge_kv_heads,
            head_chunks=launch.heads.head_chunks, hpc=launch.heads_per_group, dim=head_dim)
    merge_dims = None if fused else plan.merge_launch(launch, batch)  # (grid, threads, wph)
    launches = (
        launcher("decode", _append_expr(dtype, launch.kv), abi.APPEND).at(batch, 128)
        if append else None,
        _decode_kernel(launch, dtype).at(launch.grid, launch.threads, launch.tiles.smem_bytes),
        None if fused else launcher("merge", _pieces_expr(dtype, launch.head_dim),
                                    abi.MERGE_PIECES).at(*merge_dims[:2]),
        launcher("plan", PLAN_EXPR, abi.DECODE_PLAN).at(min(batch, abi.PLAN_CTAS), abi.PLAN_THREADS)
        if plan_args is not None else None)
    return _DeviceStep(launch, launches, plan_args, append_args, decode_args, merge_args,
                       0 if fused else merge_dims[2], tables, own_lens,
                       (work, seq_info, lens, counters, pool, part_out, part_lse, tables,
                        own_lens), {})


def planned_on_device(launch, dtype, num_q_heads, head_dim, opts, merge, append, batch, width,
                       bt_stride, layout, index, counters, part_out, part_lse, tables=None,
                       own_lens=None):
    """The device step of a batch whose pieces decode_plan_kernel cuts on the device: its
    descriptors, piece info and checked lengths go into ``index`` (laid out as ``layout``,
    a ``decode.plan.DeviceIndex`` of at least the batch), its counters into ``counters``
    (zeros, re-armed by the kernels: the plan's own first, then the fused merge's, one a
    sequence and row group)."""
    stages, num, den = plan.min_piece_terms(launch, merge)
    work = index[:layout.info]
    lens = index[layout.lens:layout.lens + batch]
    plan_args = abi.DECODE_PLAN.bind(
        work=ptr(work), seq_info=ptr(index[layout.info:]), lens_out=ptr(lens),
        scratch=ptr(index[layout.scratch:]), done=ptr(counters), err=ptr(errors.error_word()),
        batch=batch, width=width, bt_stride=bt_stride, block_size=launch.block_size,
        append=int(append), window_left=opts.window_left, tile=launch.tiles.tile,
        columns=launch.columns, min_piece=stages, piece_num=num, piece_den=den)
    return _device_step(launch, dtype, num_q_heads, head_dim, opts, merge, append, batch,
                        bt_stride, work, index[layout.info:layout.info + 2 * batch], lens,
                        counters[1:], None, part_out, part_lse, plan_args, tables, own_lens)


def planned_on_host(launch, dtype, num_q_heads, head_dim, opts, merge, append, batch, bt_stride,
                     layout, index, counters, pool, part_out, part_lse, tables=None,
                     own_lens=None):
    """The device step of a host plan packed into ``index`` (laid out as ``layout``, a
    ``decode.plan.IndexLayout``): its descriptors, piece info and lengths."""
    return _device_step(launch, dtype, num_q_heads, head_dim, opts, merge, append, batch,
                        bt_stride, index[layout.desc:layout.tables],
                        index[layout.info:layout.info + 2 * batch], index[:batch], counters,
                        pool, part_out, part_lse, tables=tables, own_lens=own_lens)


class Strides(NamedTuple):
    """What a step's launches take of a call's arrays besides their addresses (fixed by
    the call's signature, host scale values included)."""
    kbs: int          # block strides of the caches (elements)
    vbs: int
    q_stride: int     # q's row stride (elements)
    k_new_stride: int
    v_new_stride: int
    num_blocks: int
    k_scale_stride: int = 0    # fp8 scales (abi.SCALES; core.fp8.kernel_scales)
    v_scale_stride: int = 0
    k_scale_value: float = 1.0
    v_scale_value: float = 1.0


def call_strides(q, k_cache, v_cache, k_new, v_new, scales=None):
    """The :class:`Strides` of a call's arrays and scale fields (``core.fp8.kernel_scales``;
    None: a plain cache's)."""
    batch, hq, d = q.shape
    return Strides(block_stride(k_cache), block_stride(v_cache),
                   q.strides[0] // q.itemsize if batch > 1 else hq * d,
                   token_stride("k_new", k_new) if k_new is not None else 0,
                   token_stride("v_new", v_new) if v_new is not None else 0,
                   k_cache.shape[0], **(scales or {}))


def _packers(device, strides):
    """The positional packers of a step's launches for calls of ``strides`` (the call's
    strides and scale fields fixed with the step's): plan (tables, lengths), append (k_new,
    v_new, caches, tables, scales), decode (q, out, lse, caches, tables, alibi, sinks,
    scales) and merge (out, lse, sinks); None where the step has no such launch. Made once
    per step and strides."""
    packers = device.packers.get(strides)
    if packers is None:
        scales = dict(k_scale_stride=strides.k_scale_stride,
                      v_scale_stride=strides.v_scale_stride,
                      k_scale_value=strides.k_scale_value, v_scale_value=strides.v_scale_value)
        plan_pack = append_pack = merge_pack = None
        if device.plan_args is not None:
            plan_pack = device.plan_args.bind(num_blocks=strides.num_blocks).packer(
                "block_tables", "seq_lens")
        if device.append_args is not None:
            append_pack = device.append_args.bind(
                kbs=strides.kbs, vbs=strides.vbs, k_new_stride=strides.k_new_stride,
                v_new_stride=strides.v_new_stride, **scales).packer(
                "k_new", "v_new", "k_cache", "v_cache", "block_tables", "k_scale", "v_scale")
        decode_pack = device.decode_args.bind(
            kbs=strides.kbs, vbs=strides.vbs, q_stride=strides.q_stride, **scales).packer(
            "q", "out", "lse", "k_cache", "v_cache", "block_tables", "alibi_slopes", "sinks",
            "k_scale", "v_scale")
        if device.merge_args is not None:
            merge_pack = device.merge_args.bind(wph=device.merge_wph).packer("out", "lse",
                                                                            "sinks")
        if len(device.packers) > 16:
            device.packers.clear()
        packers = device.packers[strides] = (plan_pack, append_pack, decode_pack, merge_pack)
    return packers


def launch_decode(device, strides, ptrs, out, lse, tables, lens, stream, plan=True):
    """Plan (when planned on the device and ``plan``), append (with ``k_new``), decode and,
    with a merge kernel, merge split pieces by a second kernel; on ``stream`` (a raw
    pointer), without a host sync. ``strides``: the call's :class:`Strides`; ``ptrs``: the
    addresses of q, k_cache, v_cache, k_new, v_new, alibi_slopes, sinks, k_scale and
    v_scale (0: none); ``out``, ``lse``, ``tables``, ``lens``: addresses of the outputs and
    of the block tables and lengths the step reads."""
    q, kc, vc, k_new, v_new, alibi, sinks, k_scale, v_scale = ptrs
    append, decode, merge, plan_go = device.launches
    plan_pack, append_pack, decode_pack, merge_pack = _packers(device, strides)
    if plan and plan_go is not None:
        plan_go(plan_pack(tables, lens), stream)
    if k_new:
        append(append_pack(k_new, v_new, kc, vc, tables, k_scale, v_scale), stream)
    decode(decode_pack(q, out, lse, kc, vc, tables, alibi, sinks, k_scale, v_scale), stream)
    if merge is not None:
        merge(merge_pack(out, lse, sinks), stream)


def row_map_buffers(launch, batch, name=None):
    """``(index, counters, partial rows, partial lses)`` of a device-planned step of
    ``batch`` sequences on ``launch`` (``plan.DeviceIndex``; counters zeroed, re-armed by
    the kernels): per-stream scratch under ``name``, or new arrays (a PagedPrefiller's own)."""
    import cupy
    layout = plan.DeviceIndex(batch, launch.columns)
    counters = 1 + batch * launch.row_groups
    if name is None:
        part_out, part_lse = _partials(cupy, launch, layout.pieces)
        return (cupy.empty(layout.size, np.int32), cupy.zeros(counters, np.int32), part_out,
                part_lse)
    return (scratch(f"{name}.index", layout.size), scratch(f"{name}.counters", counters, zero=True),
            *_partials(cupy, launch, layout.pieces, f"{name}.partials"))


def row_map_step(launch, dtype, num_q_heads, opts, batch, width, bt_stride, rows, buffers):
    """The device step of paged_attention's decode launch: decode_plan_kernel cuts the key
    tiles of the sequences ``b`` with ``rows[b] >= 0`` (``rows``: int32 device ``[batch]``,
    their q / out rows; the others get no keys and write nothing), then the decode kernel
    and merge read and write their rows through ``rows``. ``buffers``:
    :func:`row_map_buffers`. No append (the mixed batch's caches hold the new tokens)."""
    merge = plan.resolve_merge(None, launch)
    index, counters, part_out, part_lse = buffers
    step = planned_on_device(launch, dtype, num_q_heads, launch.head_dim, opts, merge, False,
                             batch, width, bt_stride, plan.DeviceIndex(batch, launch.columns),
                             index, counters, part_out, part_lse)
    r = ptr(rows)
    return step._replace(
        plan_args=step.plan_args.bind(rows=r), decode_args=step.decode_args.bind(rows=r),
        merge_args=None if step.merge_args is None else step.merge_args.bind(rows=r),
        keep=step.keep + (rows,))


def launch_merge(o_first, o_rest, o_strides, l_first, l_rest, l_strides, num_parts, rows,
                  heads, dim, sinks, out, lse):
    """Merge ``num_parts`` states per row into ``out`` ``[rows, dim]`` (and ``lse``)."""
    kernel = launcher("merge", _merge_expr(o_first.dtype, out.dtype), abi.MERGE_STATES)
    kernel(-(-rows // 4), 128, o_first=ptr(o_first), o_rest=ptr(o_rest),
           o_part_stride=o_strides[0], o_row_stride=o_strides[1], l_first=ptr(l_first),
           l_rest=ptr(l_rest), l_part_stride=l_strides[0], l_row_stride=l_strides[1],
           num_parts=num_parts, num_rows=rows, num_heads=heads, dim=dim, sinks=ptr(sinks),
           out=ptr(out), lse_out=ptr(lse))


def call_step(xp, launch, checked, dtype, block_tables, seq_lens, num_splits):
    """The device step of one ``paged_decode`` call (default merge), in per-stream scratch:
    planned on the device, or on the host when the lengths were checked there (strict mode)
    or a count of splits is asked for (then uploaded: a copy the call waits for)."""
    merge = plan.resolve_merge(None, launch)
    fused = merge == "fused"
    d, batch, opts = launch.head_dim, checked.batch, checked.options
    if checked.seq_lens_host is None and num_splits is None:
        layout = plan.DeviceIndex(batch, launch.columns)
        index = scratch("decode.index", layout.size)
        counters = scratch("decode.counters", 1 + batch * launch.row_groups, zero=True)
        part_out, part_lse = _partials(xp, launch, layout.pieces, "decode.partials")
        return planned_on_device(launch, dtype, checked.num_q_heads, d, opts, merge,
                                  checked.append, batch, block_tables.shape[1],
                                  table_stride(block_tables), layout, index, counters, part_out,
                                  part_lse)
    sl = checked.seq_lens_host if checked.seq_lens_host is not None else host(seq_lens)
    schedule, _ = checks.check_variants(None, None, num_splits)
    work = plan.plan_work(launch, sl, checked.append, opts.window_left, schedule, num_splits,
                          merge)
    lay = plan.IndexLayout(batch, len(work.desc), 0)
    index = xp.asarray(plan.pack_index(lay, sl, work))
    part_out, part_lse = _partials(xp, launch, work.num_slots)
    counters = xp.zeros(batch * launch.row_groups, np.int32) if work.num_slots and fused else None
    pool = xp.zeros(2 * launch.row_groups, np.int32) if work.pool_pieces else None
    return planned_on_host(launch, dtype, checked.num_q_heads, d, opts, merge, checked.append,
                            batch, table_stride(block_tables), lay, index, counters, pool,
                            part_out, part_lse)


def kernel_specializations():
    """Every kernel this module can launch: append, the two merges, decode per dtype, head
    dim, value layout (rows or vllm's transposed) and heads per warp, the pages kernel
    (sm_90) per 16-bit dtype, head dim and block layout (NHD or HND), the same for fp8
    caches of each format under 16-bit q (head dims ``plan.FP8_HEAD_DIMS``: whole 64-dim
    chunk rounds), and the device plan."""
    specs = [Spec("plan", PLAN_EXPR)]
    for dt in FLOAT_DTYPES:
        specs.append(Spec("decode", _append_expr(dt)))
        specs.append(Spec("merge", _merge_expr(dt, dt)))
        specs += [Spec("merge", _pieces_expr(dt, d)) for d in (128, 256)]
        for d in HEAD_DIMS:
            for nt in sorted({plan.head_tiles(dt.itemsize, d, g) for g in (1, 64)}):
                specs += [Spec("decode", _decode_expr(dt, d, vt, nt)) for vt in (False, True)]
            if dt.itemsize == 2 and d in plan.PAGE_HEAD_DIMS:
                specs += [Spec("decode", _pages_expr(dt, d, hm), hopper=True)
                          for hm in (False, True)]
        if dt.itemsize != 2:
            continue
        for kv in KV_DTYPES:
            specs.append(Spec("decode", _append_expr(dt, kv)))
            for d in plan.FP8_HEAD_DIMS:
                specs += [Spec("decode", _decode_expr(dt, d, vt, 1, kv)) for vt in (False, True)]
                if d in plan.PAGE_HEAD_DIMS:
                    specs += [Spec("decode", _pages_expr(dt, d, hm, kv), hopper=True)
                              for hm in (False, True)]
    return specs
