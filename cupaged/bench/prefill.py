"""Benchmark of prefill attention: tile variants side by side, and TFLOP/s beside torch SDPA.

Rows (bf16, H 32 query and kv heads):

- ``tiles``: the tensor-core kernel's tile shapes (``prefill_plan.TileShape``: warps x rows
  per warp, keys per K/V tile, K/V stages, Q in registers, CTAs per SM) timed on the same
  problem, B2 S8192 at d128 (causal and not), d64 and d256 causal. The row marked
  ``default`` is the shape the library launches; ``vs_default`` is a variant's speed relative
  to it; ``regs`` / ``local_B`` the registers and local (spill) bytes per thread.
  ``flash_TFLOPs`` / ``cudnn_TFLOPs`` are torch SDPA on the same [B, H, S, D] problem (None
  without torch, or when the backend refuses it), ``vs_flash`` / ``vs_cudnn`` the ratios.
- ``wgmma`` (sm_90 only): the Hopper warpgroup-MMA kernel (``backend="wgmma"``) on the
  same problem as the default row it follows (B2 S8192 d128 / d64 / d256, causal and full;
  d80 / d96 / d112 causal; paged NHD, HND and vllm page 16; the sweep and mixed rows),
  ``vs_default`` its speed relative to the mma.sync default; the tile "auto" takes on
  ragged K/V is marked ``default`` (the results page's headline compares it with the peers).
- ``wgmma soft-cap`` / ``alibi`` / ``sinks``: the wgmma kernel with that score option at B2
  S8192 d128 causal; ``vs_default`` its speed relative to the plain wgmma launch.
- ``paged``: the default tile through ``PagedPrefiller`` on NHD, HND and vllm caches of page
  16 with shuffled blocks; ``vs_ragged`` is its speed relative to the ragged row (goal >= 0.9).
- ``sweep``: default tile, S 512 .. 32K (batch chosen so each row has 16K-32K tokens; B8 x S2K
  in ``--quick`` too, an issue 20 row).
- ``mixed``: one ragged batch of very different lengths (1 .. 16K).
- ``NHD page16 fp8_e4m3 cache`` (and HND, vllm without ``--quick``): the paged row's
  prefill (``PagedPrefiller``, backend "auto") from an fp8 e4m3 cache with per-head scales,
  beside the same prefill from a bf16 cache of that layout in the same run (``vs_bf16``:
  bf16 time over fp8 time, issue 21's goal >= 0.9 for NHD; ``err_vs_bf16``: the output's
  relative error against the bf16 cache's). On sm_90, NHD and HND also time the opt-in
  fp8 TMA tile (``plan.tma_tile(d, kv=...)``, tile ``ws ... tma fp8 slots4``) beside it,
  ``vs_bf16`` against the same bf16 row. ``paged_prefill`` rows: the public call with
  device metadata (lengths never read by the host; it gathers where its shapes' bound
  pays, ``plan.gather_pays_at_bound``) from the bf16 cache (``vs_ragged`` against the ragged
  wgmma default row) and from the fp8 one (``vs_bf16`` against it).
- ``mixed decode + chunk``: issue 20's batch of 63 decode rows at 8K and a 2K-token chunk
  through one ``paged_attention`` (its default split: decode rows on the decode launch),
  beside ``paged_decode`` + ``paged_prefill`` on its parts (``vs_split`` >= 1 is the goal)
  and ``paged_attention(..., split_decode=False)`` (every row on one prefill launch).

Causal flops count the visible (query, key) pairs: 2 * B * H * S * S * D for equal lengths.
``ms`` times the kernel launch alone (work list and launch set up once, as a public call's
hot path holds them); ``public_ms`` the public call
with its host checks. ``checked``: the first and last 16 queries of sequence 0 against the
float64 reference, and (variants) the whole output against the default tile's.
Run: ``python -m cupaged.bench.prefill [--quick]`` or ``cupaged bench prefill``.
"""
from __future__ import annotations

import numpy as np

from ..core.launch import current_stream
from ..core.layouts import layout_strides
from ..prefill import plan as plan_
from ..core.arrays import bfloat16
from ..reference import attention as aref
from .timing import bench_main, time_gpu, torch_or_none

H = 32
TS = plan_.TileShape
# candidate tiles per head size, the default first
VARIANTS = {
    128: [plan_.default_tile(128), TS(4, 2, 64, 1, False, 2), TS(4, 2, 32, 2, False, 2),
          TS(8, 1, 64, 2, True, 1), TS(8, 2, 64, 2, False, 1)],
    64: [plan_.default_tile(64), TS(4, 2, 64, 2, True, 2), TS(8, 1, 128, 2, True, 1)],
    256: [plan_.default_tile(256), TS(8, 1, 32, 2, False, 1)],
}
# wgmma tiles (sm_90): the warp-specialised kernel with the TMA producer (3 stages: the
# default at d64 and d128 for ragged K/V and NHD / HND caches; 2 stages) and with the
# cp.async producer, and prefill_wgmma_kernel with 2 stages (plain) and 3 stages
# (overlapped): plan_.wgmma_tile(d, geometry=...) names the default of each head size and call.
WGMMA_VARIANTS = [plan_.tma_tile(128), plan_.tma_tile(128, 2),
                  plan_.WgmmaTile(128, 2, True, plan_.ws_producer_regs(128)), plan_.WgmmaTile(128, 2),
                  plan_.WgmmaTile(128, 3)]


def tile_label(tile):
    """Short name of a tile shape: warps x rows per warp, keys per tile, stages, Q regs."""
    q = " qreg" if tile.q_regs else ""
    return f"{tile.warps}w x{16 * tile.m_tiles}r n{tile.block_n} s{tile.stages}{q} {tile.ctas}cta"


def _random(shape, seed):
    import cupy
    rng = np.random.default_rng(seed)
    return cupy.asarray(rng.standard_normal(shape, np.float32).astype(bfloat16))


def _flops(q_lens, kv_lens, head_dim, causal):
    pairs = 0
    for s, n in zip(q_lens, kv_lens):
        full = s * n
        pairs += full if not causal else full - s * (s - 1) // 2 if n >= s else n * (n + 1) // 2
    return 4 * H * head_dim * pairs


def _check(out, q, k, v, cu, causal, want_out=None):
    """First and last 16 queries of sequence 0 against the reference; the whole output
    against ``want_out`` (another kernel's) when given."""
    end = int(cu[1])
    kh, vh = k[:end].get(), v[:end].get()
    for rows in (slice(0, min(16, end)), slice(max(0, end - 16), end)):
        if not causal and rows.start == 0 and end > 16:
            continue  # non-causal first rows cost a full pass; the last rows suffice
        want, _ = aref.attend(q[rows].get(), kh[:rows.stop] if causal else kh,
                              vh[:rows.stop] if causal else vh, causal=causal)
        got = np.asarray(out[rows].get(), np.float64)
        if not np.linalg.norm(got - want) <= 2e-2 * np.linalg.norm(want):
            return False
    if want_out is not None:
        import cupy
        a, b = _bf16_as_f32(out), _bf16_as_f32(want_out)
        if not float(cupy.linalg.norm(a - b)) <= 1e-2 * float(cupy.linalg.norm(b)):
            return False
    return True


def _bf16_as_f32(x):
    """A bf16 device array widened to float32 exactly (bit shift; no bf16 arithmetic)."""
    import cupy
    return (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)


# ----------------------------------------------------------------------------- peers
def _sdpa(batch, seqlen, head_dim, causal, backend):
    """Seconds of torch SDPA restricted to ``backend`` on [B, H, S, D] bf16, or None."""
    torch = torch_or_none()
    if torch is None:
        return None
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import torch.nn.functional as F
        q, k, v = (torch.randn(batch, H, seqlen, head_dim, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            return time_gpu(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    except Exception:
        return None


def _peers(row, q_lens, head_dim, causal, flops, seconds):
    for name, backend in (("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION")):
        t = _sdpa(len(q_lens), q_lens[0], head_dim, causal, backend)
        row[f"{name}_TFLOPs"] = None if t is None else flops / t / 1e12
        row[f"vs_{name}"] = None if t is None else t / seconds


# ----------------------------------------------------------------------------- ours
def _ragged_inputs(q_lens, head_dim, seed=0):
    import cupy
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q, k, v = (_random((int(cu[-1]), H, head_dim), seed + i) for i in range(3))
    return q, k, v, cu, cupy.asarray(cu)


def _ragged_launcher(q, k, v, cu_host, cu_dev, causal, tile=None, backend="mma", options=None):
    """Launch-only closure of varlen_prefill with its work list built once (``tile``: a
    non-default tile shape; ``backend``: "mma" or "wgmma"; ``options``: score options of
    ``check_options``). Returns (launch, kernel)."""
    import cupy
    from ..prefill import launch as prefill
    from ..core.checks import check_options
    lens = np.diff(cu_host)
    opts = check_options(cupy, H, q.shape[2], **(options or {}))
    strides = layout_strides("ragged", 1, H, q.shape[2], q.itemsize)
    if tile is None:
        tile = _ragged_default(q, k) if backend == "wgmma" else plan_.launch_tile(q.dtype, q.shape[2])
    work = cupy.asarray(prefill.host_work(lens, lens, q.dtype, H, H, q.shape[2], False, causal, opts, tile))
    out = cupy.empty_like(q)
    # set up once, as a public call's hot path holds it: each launch packs addresses only
    run = prefill.Launches(q, len(lens), None, 1, 0, k.shape[0], H, strides, opts, causal,
                           False, backend, tile=tile, work=work)
    launch = _held_launch(run, (q, k, v, out, None, cu_dev, cu_dev, None, opts.alibi_slopes,
                                opts.sinks))
    return launch, prefill._kernel(q.dtype, q.shape[2], False, tile, backend,
                                   plan_.general_scores(opts))[0]


def _paged_launcher(q, k, v, cu_host, causal, layout="NHD", block_size=16, backend="mma",
                    kv_dtype=None, k_scale=None, v_scale=None, tile=None, gather=False,
                    call=False):
    """PagedPrefiller.run over a ``layout`` cache holding k/v in shuffled pages (``kv_dtype``:
    an fp8 cache written with the scales ``k_scale`` / ``v_scale``, device arrays); with
    ``tile`` (a wgmma tile no default takes, such as ``plan.tma_tile(d, kv=kv_dtype)``) the
    launch of that tile over a host work list instead, set up once (:func:`_tile_launch`);
    ``gather``: PagedPrefiller's (False: the cache read in place); ``call``: the public
    ``paged_prefill`` with device metadata instead (its own choice of gather)."""
    import cupy
    import cupaged
    from ..core.layouts import cache_shapes
    lens = np.diff(cu_host)
    need = -(-lens // block_size)
    ids = np.random.default_rng(1).permutation(int(need.sum())).astype(np.int32)
    tables = np.full((len(lens), int(need.max())), -1, np.int32)
    slots = []
    for b, first in enumerate(np.cumsum(need) - need):
        tables[b, :need[b]] = ids[first:first + need[b]]
        t = np.arange(lens[b])
        slots.append(tables[b, t // block_size].astype(np.int64) * block_size + t % block_size)
    slots = cupy.asarray(np.concatenate(slots))
    elements = q.dtype if kv_dtype is None else np.uint8
    ks, vs = cache_shapes(layout, int(need.sum()), block_size, H, q.shape[2], kv_dtype or q.dtype)
    kc, vc = cupy.empty(ks, elements), cupy.empty(vs, elements)
    fp8 = {} if kv_dtype is None else dict(k_scale=k_scale, v_scale=v_scale)
    cupaged.write_kv_cache(k, v, kc, vc, slots, layout=layout, kv_dtype=kv_dtype, **fp8)
    out = cupy.empty_like(q)
    if tile is not None:
        return _tile_launch(q, kc, vc, out, cu_host, tables, causal, layout, tile, kv_dtype,
                            k_scale, v_scale)
    if call:
        meta = [cupy.asarray(a) for a in (cu_host, tables, lens.astype(np.int32))]
        return lambda: cupaged.paged_prefill(q, kc, vc, *meta, causal=causal, layout=layout,
                                             backend=backend, kv_dtype=kv_dtype, out=out, **fp8)
    pre = cupaged.PagedPrefiller(H, H, q.shape[2], block_size, dtype=q.dtype, layout=layout,
                                 causal=causal, backend=backend, kv_dtype=kv_dtype,
                                 gather=gather)
    pre.plan(cu_host, tables, lens.astype(np.int32))
    return lambda: pre.run(q, kc, vc, out=out, **fp8)


def _tile_launch(q, kc, vc, out, cu_host, tables, causal, layout, tile, kv_dtype, k_scale,
                 v_scale):
    """Launch-only closure of the wgmma ``tile`` over paged caches ``kc`` / ``vc`` (each
    sequence's keys its queries; the fp8 format ``kv_dtype`` with device scales), its work
    list and launch set up once as a public call's hot path holds them."""
    import cupy
    from ..core.checks import check_options
    from ..core.fp8 import fp8_format, kernel_scales
    from ..core.layouts import cache_strides
    from ..prefill import launch as prefill
    from ..prefill.api import _check_caches
    lens = np.diff(cu_host).astype(np.int32)
    d = q.shape[2]
    opts = check_options(cupy, H, d)
    geo = _check_caches(kc, vc, layout, cupy, kv_dtype)[0]
    work = cupy.asarray(prefill.host_work(lens, lens, q.dtype, H, H, d, False, causal, opts,
                                          tile, "wgmma", kv_dtype))
    scales = (None if kv_dtype is None
              else kernel_scales(fp8_format(kv_dtype), k_scale, v_scale, H, False))
    tables = cupy.asarray(tables)
    run = prefill.Launches(q, len(lens), tables, geo.block_size, geo.num_blocks, 0, H,
                           cache_strides(kc, vc, layout, geo), opts, causal, False, "wgmma",
                           tile=tile, work=work, kv=kv_dtype, scales=scales)
    return _held_launch(run, (q, kc, vc, out, None, cupy.asarray(cu_host), cupy.asarray(lens),
                              tables, None, None, k_scale, v_scale))


def _held_launch(run, held):
    """Closure launching ``run`` (a ``prefill.launch.Launches``) on the current stream over
    ``held``: its arrays in the launch's order (q, k, v, out, lse, cu_q, kv info, tables,
    alibi, sinks[, k_scale, v_scale]), passed by address and kept alive by the closure;
    returns out."""
    from ..prefill import launch as prefill
    arrays = prefill.addresses(*held)

    def launch():
        run(*arrays[:10], current_stream(), *arrays[10:])
        return held[3]
    return launch


def _shape(q_lens, cu_host, head_dim, causal):
    equal = len(set(q_lens)) == 1
    return (f"B{len(q_lens)} S{q_lens[0]}" if equal else f"B{len(q_lens)} T{int(cu_host[-1])}") \
        + f" H{H} d{head_dim} {'causal' if causal else 'full'}"


def _hopper():
    import cupy
    return cupy.cuda.Device().compute_capability == "90"


def _ragged_default(q, k):
    """The wgmma tile of a ragged launch over these inputs (``plan.wgmma_tile``)."""
    strides = layout_strides("ragged", 1, H, q.shape[2], q.itemsize)
    return plan_.wgmma_tile(q.shape[2], geometry=plan_.TmaGeometry(strides, total_k=k.shape[0]))


def _paged_default(q, k, layout, block_size=16):
    """The wgmma tile of PagedPrefiller over these inputs in a ``layout`` cache."""
    strides = layout_strides(layout, block_size, H, q.shape[2], q.itemsize)
    return plan_.wgmma_tile(q.shape[2], v_transposed=layout == "vllm",  # blocks <= keys
                            geometry=plan_.TmaGeometry(strides, block_size=block_size,
                                                       num_blocks=k.shape[0]))


def wgmma_label(tile):
    if tile.ws:
        tma = (f" tma fp8 slots{tile.slots}" if tile.slots else " tma") if tile.tma else ""
        return f"ws 1+2wg x64r n{tile.block_n} s{tile.stages}" + tma
    return f"2wg x64r n{tile.block_n} s{tile.stages}" + (" overlap" if tile.stages == 3 else "")


def bench_wgmma(inputs, causal, layouts=(), tiles=None):
    """The wgmma kernel on the inputs of a default row: each of ``tiles`` (default: the
    head size's own) on the ragged rows, then PagedPrefiller over a cache of page 16 in
    each of ``layouts``, read in place (its default tile) and gathered into packed rows
    (``gather``: the ragged default tile after the gather), ``vs_ragged`` against the first
    ragged row; checked against the reference and the default's output; [] off sm_90."""
    q, k, v, cu_host, base_out, base_s, flops = inputs
    if not _hopper() or q.shape[2] not in plan_.WGMMA_HEAD_DIMS:
        return []
    import cupy
    rows, ragged_s, default = [], None, _ragged_default(q, k)
    for tile, layout, gather in ([(t, None, False) for t in tiles or [default]]
                                 + [(_paged_default(q, k, x), x, False) for x in layouts]
                                 + [(_ragged_default(q, k), x, True) for x in layouts]):
        if layout is not None:
            launch, kernel = _paged_launcher(q, k, v, cu_host, causal, layout, backend="wgmma",
                                             gather=gather), None
        else:
            launch, kernel = _ragged_launcher(q, k, v, cu_host, cupy.asarray(cu_host), causal, tile, "wgmma")
        ok = _check(launch().copy(), q, k, v, cu_host, causal, base_out)
        seconds = time_gpu(launch)
        ragged_s = seconds if ragged_s is None else ragged_s
        row = dict(op="varlen" if layout is None else "paged",
                   variant="wgmma" + ("" if layout is None else f" {layout} page16")
                   + (" gather" if gather else ""),
                   tile=wgmma_label(tile) + (" default" if layout is None and tile == default else ""),
                   shape=_shape(list(np.diff(cu_host)), cu_host, q.shape[2], causal),
                   ms=seconds * 1e3, TFLOPs=flops / seconds / 1e12, vs_default=base_s / seconds,
                   vs_ragged=None if layout is None else ragged_s / seconds, checked=ok)
        if kernel is not None:
            row.update(regs=kernel.raw.num_regs, local_B=kernel.raw.local_size_bytes)
        rows.append(row)
    return rows


def score_options():
    """The score options whose cost the ``wgmma scores`` rows time (issue 20: <= 5 %)."""
    import cupy
    slopes = cupy.asarray((2.0 ** -np.arange(1, H + 1) / 8).astype(np.float32))
    return {"soft-cap": dict(logits_soft_cap=30.0), "alibi": dict(alibi_slopes=slopes),
            "sinks": dict(sinks=cupy.zeros(H, np.float32))}


def bench_wgmma_scores(inputs, causal):
    """The wgmma kernel with each of :func:`score_options` on the inputs of a default row;
    ``vs_default``: speed relative to the plain wgmma launch, ``checked``: the output
    against the mma.sync kernel's with the same options; [] off sm_90."""
    q, k, v, cu_host, _, _, flops = inputs
    if not _hopper():
        return []
    import cupy
    from ..prefill import api as prefill
    cu = cupy.asarray(cu_host)
    plain, _ = _ragged_launcher(q, k, v, cu_host, cu, causal, backend="wgmma")
    base = time_gpu(plain)
    rows = []
    for name, options in score_options().items():
        launch, kernel = _ragged_launcher(q, k, v, cu_host, cu, causal, backend="wgmma",
                                          options=options)
        got = _bf16_as_f32(launch().copy())
        want = _bf16_as_f32(prefill.varlen_prefill(q, k, v, cu, cu, causal=causal, backend="mma",
                                                   **options))
        seconds = time_gpu(launch)
        rows.append(dict(op="varlen", variant=f"wgmma {name}",
                         tile=wgmma_label(_ragged_default(q, k)),
                         shape=_shape(list(np.diff(cu_host)), cu_host, q.shape[2], causal),
                         ms=seconds * 1e3, TFLOPs=flops / seconds / 1e12, vs_default=base / seconds,
                         regs=kernel.raw.num_regs, local_B=kernel.raw.local_size_bytes,
                         checked=float(cupy.linalg.norm(got - want)) <= 1e-2 * float(cupy.linalg.norm(want))))
    return rows


def bench_mixed_decode(decode_rows=63, context=8192, chunk=2048):
    """Issue 20's mixed batch: ``decode_rows`` decode rows of ``context`` keys and one
    prefill chunk of ``chunk`` new tokens (Hq 32, Hk 8, d128 bf16, NHD page 16) through one
    ``paged_attention`` call (its default: decode rows on the split-KV decode launch),
    beside ``paged_decode`` on the decode rows plus ``paged_prefill`` on the chunk
    (``vs_split``: the pair's time over the mixed call's; goal >= 1), and the same call
    with ``split_decode=False`` (every row on one prefill launch). ``checked``: all give
    the same rows."""
    import cupy
    import cupaged
    hq, hk, d, bs = 32, 8, 128, 16
    lens = np.array([context] * decode_rows + [chunk], np.int32)
    need = -(-lens // bs)
    ids = np.random.default_rng(2).permutation(int(need.sum())).astype(np.int32)
    tables = np.full((len(lens), int(need.max())), -1, np.int32)
    for b, first in enumerate(np.cumsum(need) - need):
        tables[b, :need[b]] = ids[first:first + need[b]]
    kc = _random((int(need.sum()), bs, hk, d), 3)
    vc = _random((int(need.sum()), bs, hk, d), 4)
    q = _random((decode_rows + chunk, hq, d), 5)
    cu = cupy.asarray(np.concatenate([np.arange(decode_rows + 1), [decode_rows + chunk]]).astype(np.int32))
    bt, sl = cupy.asarray(tables), cupy.asarray(lens)
    dec_bt, dec_sl, pre_bt, pre_sl = bt[:decode_rows], sl[:decode_rows], bt[decode_rows:], sl[decode_rows:]
    pre_cu = cupy.asarray(np.array([0, chunk], np.int32))

    def mixed():
        return cupaged.paged_attention(q, kc, vc, cu, bt, sl, layout="NHD")

    def one_launch():  # every row on the prefill launch
        return cupaged.paged_attention(q, kc, vc, cu, bt, sl, layout="NHD", split_decode=False)

    def split():
        return (cupaged.paged_decode(q[:decode_rows], kc, vc, dec_bt, dec_sl, layout="NHD"),
                cupaged.paged_prefill(q[decode_rows:], kc, vc, pre_cu, pre_bt, pre_sl, layout="NHD"))

    got = _bf16_as_f32(mixed())
    dec, pre = split()
    want = cupy.concatenate([_bf16_as_f32(dec), _bf16_as_f32(pre)])
    ok = float(cupy.linalg.norm(got - want)) <= 1e-2 * float(cupy.linalg.norm(want))
    ok_one = float(cupy.linalg.norm(_bf16_as_f32(one_launch()) - want)) <= 1e-2 * float(
        cupy.linalg.norm(want))
    t_mixed, t_split, t_one = time_gpu(mixed), time_gpu(split), time_gpu(one_launch)
    shape = f"{decode_rows} x L{context} + chunk {chunk}, Hq{hq} Hk{hk} d{d} page {bs}"
    return [dict(op="paged_attention", variant="mixed decode + chunk", shape=shape,
                 ms=t_mixed * 1e3, vs_split=t_split / t_mixed, checked=ok),
            dict(op="decode + prefill", variant="split pair", shape=shape, ms=t_split * 1e3,
                 checked=ok),
            dict(op="paged_attention", variant="mixed, split_decode=False", shape=shape,
                 ms=t_one * 1e3, vs_split=t_split / t_one, checked=ok_one)]


def bench_tiles(q_lens, head_dim, causal, tiles, label="tiles", peers=True, public=True):
    """One row per tile shape (the first is the reference for ``vs_default``); peers on the first."""
    from ..prefill import api as prefill
    q, k, v, cu_host, cu_dev = _ragged_inputs(q_lens, head_dim)
    flops = _flops(q_lens, q_lens, head_dim, causal)
    rows, base_out, base_s = [], None, None
    for i, tile in enumerate(tiles):
        launch, kernel = _ragged_launcher(q, k, v, cu_host, cu_dev, causal, tile)
        out = launch().copy()
        ok = _check(out, q, k, v, cu_host, causal, base_out)
        seconds = time_gpu(launch)
        row = dict(op="varlen", variant=label, tile=tile_label(tile) + (" default" if i == 0 else ""),
                   shape=_shape(q_lens, cu_host, head_dim, causal), ms=seconds * 1e3,
                   TFLOPs=flops / seconds / 1e12, regs=kernel.raw.num_regs,
                   local_B=kernel.raw.local_size_bytes, checked=ok)
        if i == 0:
            base_out, base_s = out, seconds
            if public:
                t = time_gpu(lambda: prefill.varlen_prefill(q, k, v, cu_dev, cu_dev, causal=causal), reps=5)
                row["public_ms"] = t * 1e3
            if peers and len(set(q_lens)) == 1:
                _peers(row, q_lens, head_dim, causal, flops, seconds)
        else:
            row["vs_default"] = base_s / seconds
        rows.append(row)
    return rows, (q, k, v, cu_host, base_out, base_s, flops)


def bench_paged(inputs, causal, layouts=("NHD",)):
    """Default tile through PagedPrefiller on each layout, page 16, beside the ragged time."""
    q, k, v, cu_host, base_out, base_s, flops = inputs
    rows = []
    for layout in layouts:
        run = _paged_launcher(q, k, v, cu_host, causal, layout)
        ok = _check(run(), q, k, v, cu_host, causal, base_out)
        t = time_gpu(run)
        rows.append(dict(op="paged", variant=f"{layout} page16", shape=_shape(list(np.diff(cu_host)), cu_host,
                                                                          q.shape[2], causal),
                         ms=t * 1e3, TFLOPs=flops / t / 1e12, vs_ragged=base_s / t, checked=ok))
    return rows


def bench_fp8(inputs, causal, layouts=("NHD",), kv_dtype="fp8_e4m3", ragged_s=None):
    """Paged prefill (PagedPrefiller, page 16, backend "auto") from a ``kv_dtype`` cache in
    each of ``layouts`` with per-head scales (each head's largest magnitude at the format's
    largest value), read in place and gathered (``gather``), and the public
    ``paged_prefill`` with device metadata (``paged_prefill`` rows: its own choice), beside
    the same prefill from a bf16 cache of that layout run the same way in this run (the
    ``paged_prefill`` row of the bf16 cache is a row too, ``vs_ragged`` against ``ragged_s``,
    the ragged wgmma default):
    ``vs_bf16`` the bf16 time over the fp8 time (issue 21: >= 0.9), ``err_vs_bf16`` the fp8
    output's relative error (norm) against the bf16 cache's; ``checked``: sequence 0's
    first and last rows against the reference over the dequantised cache. On sm_90 the NHD
    and HND caches get a second fp8 row: the opt-in fp8 TMA tile
    (``plan.tma_tile(d, kv=kv_dtype)``) launched explicitly, ``vs_bf16`` against the same
    bf16 time."""
    import cupy
    from ..core.fp8 import fp8_format
    from ..reference.fp8 import dequantize, quantize
    q, k, v, cu_host, _, _, flops = inputs
    top = fp8_format(kv_dtype).max
    k_scale, v_scale = (cupy.abs(_bf16_as_f32(x)).max(axis=(0, 2)) / np.float32(top)
                        for x in (k, v))
    end = int(cu_host[1])
    k0, v0 = (cupy.asarray(dequantize(quantize(x[:end].get(), s.get(), kv_dtype), s.get(),
                                      kv_dtype).astype(np.float32))
              for x, s in ((k, k_scale), (v, v_scale)))
    shape = _shape(list(np.diff(cu_host)), cu_host, q.shape[2], causal)
    tma = plan_.tma_tile(q.shape[2], kv=kv_dtype) if q.shape[2] in plan_.TMA_HEAD_DIMS else None
    rows = []
    modes = (("", dict(gather=False)), (" gather", dict(gather=True)),
             (" paged_prefill", dict(call=True)))
    for layout, (label, mode) in [(x, m) for x in layouts for m in modes]:
        plain = _paged_launcher(q, k, v, cu_host, causal, layout, backend="auto", **mode)
        want = plain().copy()
        t_plain = time_gpu(plain)
        if mode.get("call"):
            rows.append(dict(op="paged_prefill", variant=f"{layout} page16 bf16 cache",
                             tile="default", shape=shape, ms=t_plain * 1e3,
                             TFLOPs=flops / t_plain / 1e12,
                             vs_ragged=None if ragged_s is None else ragged_s / t_plain,
                             checked=_check(want, q, k, v, cu_host, causal)))
        tiles = [None] + ([tma] if tma is not None and layout != "vllm" and _hopper()
                          and not label else [])
        for tile in tiles:
            fp8 = _paged_launcher(q, k, v, cu_host, causal, layout, backend="auto",
                                  kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale, tile=tile,
                                  **mode)
            got = fp8()
            err = float(cupy.linalg.norm(_bf16_as_f32(got) - _bf16_as_f32(want))
                        / cupy.linalg.norm(_bf16_as_f32(want)))
            ok = _check(got, q, k0, v0, cu_host, causal)
            t_fp8 = time_gpu(fp8)
            rows.append(dict(op="paged_prefill" if mode.get("call") else "paged",
                             variant=f"{layout} page16 {kv_dtype} cache"
                             + ("" if mode.get("call") else label),
                             tile="default" if tile is None else wgmma_label(tile), shape=shape,
                             ms=t_fp8 * 1e3, TFLOPs=flops / t_fp8 / 1e12,
                             vs_bf16=t_plain / t_fp8, err_vs_bf16=err, checked=ok))
    return rows


def run(quick=False):
    """All rows; ``quick`` keeps the tile comparison at d128 and a few others."""
    paged = ("NHD", "HND") if quick else ("NHD", "HND", "vllm")
    rows, inputs = bench_tiles([8192] * 2, 128, True, VARIANTS[128])
    wgmma = bench_wgmma(inputs, True, paged, WGMMA_VARIANTS)
    ragged_s = next((r["ms"] / 1e3 for r in wgmma if r["op"] == "varlen"), None)
    rows += wgmma + bench_wgmma_scores(inputs, True)
    rows += bench_paged(inputs, True, ("NHD",) if quick else ("NHD", "HND", "vllm"))
    rows += bench_fp8(inputs, True, paged, ragged_s=ragged_s)
    del inputs
    r, inputs = bench_tiles([8192] * 2, 128, False, VARIANTS[128][:1] if quick else VARIANTS[128][:4])
    rows += r + bench_wgmma(inputs, False, tiles=WGMMA_VARIANTS)
    for d in (64, 256):
        r, inputs = bench_tiles([8192] * 2, d, True, VARIANTS[d][:1] if quick else VARIANTS[d])
        rows += r + bench_wgmma(inputs, True, tiles=WGMMA_VARIANTS if d == 64 else None)
    r, inputs = bench_tiles([8192] * 2, 64, False, VARIANTS[64][:1])
    rows += r + bench_wgmma(inputs, False, tiles=WGMMA_VARIANTS)
    for d in (96,) if quick else (80, 96, 112):
        r, inputs = bench_tiles([8192] * 2, d, True, [plan_.default_tile(d)], peers=False)
        rows += r + bench_wgmma(inputs, True)
    del inputs
    for s in ((512, 2048, 4096) if quick else (512, 2048, 32768)):  # 2048: B8 x S2K
        r, inputs = bench_tiles([s] * max(1, 16384 // s), 128, True, VARIANTS[128][:1], "sweep")
        rows += r + bench_wgmma(inputs, True) + (bench_paged(inputs, True) if s == 2048 else [])
    mixed = [16384, 1, 700, 5000, 33, 3000, 128, 9000, 1, 250] if not quick else [4096, 1, 700, 33]
    r, inputs = bench_tiles(mixed, 128, True, VARIANTS[128][:1], "mixed", peers=False)
    rows += r + bench_wgmma(inputs, True)
    del inputs
    return rows + bench_mixed_decode()


COLUMNS = ["op", "variant", "tile", "shape", "ms", "public_ms", "TFLOPs", "flash_TFLOPs",
           "cudnn_TFLOPs", "vs_flash", "vs_cudnn", "vs_default", "vs_ragged", "vs_split",
           "vs_bf16", "err_vs_bf16", "regs", "local_B", "checked"]


def main(argv=None):
    bench_main(run, argv, COLUMNS)


if __name__ == "__main__":
    main()
