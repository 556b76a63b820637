"""Benchmark of paged decode against the HBM ceiling and torch's dense decode.

For batch B in {1, 8, 64, 256} and context L in {512, 2K, 8K, 32K, 128K} (bf16, d128, page
16; GQA Hq32/Hk8, MHA Hq=Hk=32 and MQA Hk=1; shapes over ~40 GB of K+V skipped) it reports
the time of ``PagedDecoder.run`` (planned once, replayed from a CUDA graph as a serving loop
would; ``eager_us`` without the graph), the K+V bytes read per second, their fraction of the
device-to-device copy bandwidth measured in the same run (``timing.copy_bandwidth``), and,
when torch is importable, SDPA's cuDNN and flash dense decode on the same shapes (q
``[B, Hq, 1, D]``, k/v ``[B, Hk, L, D]``, graph-replayed too).

The ``variant`` column is the plan's ``schedule/merge`` (``PagedDecoder.plan``): every row runs
the plan's defaults ("balanced", and the "kernel" merge on the pages kernel and for MQA's 32
query heads a kv head, else the "fused" one); on the B{1, 64} x L{2K, 8K} GQA shapes the other
three variants follow ("split/kernel" is the earlier design: equal splits per sequence, merged
by a second kernel). At B64 x L8K page size 1 vs 16 and the HND layout (4 KB contiguous per
page and kv head instead of 256-byte rows) are compared too, and on B{1, 64} x L{2K, 8K} the
"staged" kernel against the default ``path`` ("pages" on sm_90 for these GQA shapes).
``frac_read`` is the fraction of a read-only streaming probe's bandwidth
(``timing.read_bandwidth``; cuDNN exceeds it at long contexts, so it is a floor for the real
ceiling), ``vs_cudnn`` our TB/s over cuDNN's. K/V sets rotate so L2 (60 MB) does not serve
them, and every timed configuration is checked against the reference on one sequence and kv
head (``ok``: relative error under 2e-2).

fp8 rows (``kv`` "fp8_e4m3": the cache in e4m3, q and output bf16) follow at GQA B64 x L8K,
B8 x L32K, B256 x L2K and B1 x L2K (``--quick``: B64 x L8K and B1 x L2K), each beside the
bf16-cache row of the same shape in the same run: ``vs_bf16`` is the fp8 time over the bf16
time, and TB/s, ``frac_copy`` and ``frac_read`` count the bytes actually read (one byte an
element). Their ``ok`` compares with the reference on the same quantised cache. Run:
``python -m cupaged.bench.decode [--quick]``.
"""
from __future__ import annotations

import time

import numpy as np

from ..cache_ops.api import write_kv_cache
from ..decode import api as decode
from ..core.arrays import bfloat16
from ..reference import attention as ref
from .timing import (bench_main, copy_bandwidth, read_bandwidth, settle, time_gpu,
                     torch_or_none)

HEAD_DIM, DTYPE = 128, bfloat16
HEADS = {"GQA": (32, 8), "MHA": (32, 32), "MQA": (32, 1)}
BATCHES, LENGTHS = (1, 8, 64, 256), (512, 2048, 8192, 32768, 131072)
MAX_KV_BYTES = 40e9
DEFAULT_VARIANT = (None, None)  # the plan's defaults (decode_plan.resolve_merge)
VARIANTS = (("balanced", "fused"), ("balanced", "kernel"), ("split", "fused"), ("split", "kernel"))
TOLERANCE = 2e-2
LARGE_FREE_BYTES, FREE_SETTLE_SECONDS = 4e9, 0.5
FP8 = "fp8_e4m3"
FP8_SCALE = 1 / 32  # N(0, 1) values over this scale: codes well inside e4m3's range
FP8_SHAPES, FP8_QUICK = ((64, 8192), (8, 32768), (256, 2048), (1, 2048)), ((64, 8192), (1, 2048))


def kv_bytes(batch, length, num_kv_heads, itemsize=None):
    """K+V bytes a decode of B x L reads (``itemsize`` bytes an element; default bf16's)."""
    itemsize = np.dtype(DTYPE).itemsize if itemsize is None else itemsize
    return 2 * batch * length * num_kv_heads * HEAD_DIM * itemsize


def _random_fill(a, seed):
    """Fill a device array with N(0, 1) values in chunks (no full-size float32 temporary)."""
    import cupy
    flat, rs = a.reshape(-1), cupy.random.RandomState(seed)
    for i in range(0, flat.size, 1 << 27):
        n = min(1 << 27, flat.size - i)
        flat[i:i + n] = rs.standard_normal(n, dtype=cupy.float32).astype(a.dtype)
    return a


def _paged_batch(batch, length, page, seed):
    """Block tables (blocks in random order) and lengths, as host arrays."""
    per_seq = -(-length // page)
    ids = np.random.default_rng(seed).permutation(batch * per_seq).astype(np.int32)
    return ids.reshape(batch, per_seq), np.full(batch, length, np.int32)


def _fp8_fill(k, v, layout, seed, kv_dtype=FP8):
    """Fill uint8 caches with the ``kv_dtype`` codes of N(0, 1) values over FP8_SCALE,
    written by ``write_kv_cache`` a chunk of tokens at a time."""
    import cupy
    nb = k.shape[0]
    page, hk = (k.shape[1], k.shape[2]) if layout == "NHD" else (k.shape[2], k.shape[1])
    rs = cupy.random.RandomState(seed)
    step = max(1, (1 << 24) // (hk * HEAD_DIM))  # 128 MB of float32 rows a write
    for t0 in range(0, nb * page, step):
        n = min(step, nb * page - t0)
        rows = rs.standard_normal((2, n, hk, HEAD_DIM), dtype=cupy.float32).astype(DTYPE)
        write_kv_cache(rows[0], rows[1], k, v, cupy.arange(t0, t0 + n, dtype=cupy.int64),
                       layout=layout, kv_dtype=kv_dtype, k_scale=FP8_SCALE, v_scale=FP8_SCALE)
    return k, v


def _check(out, q, k, v, tables, lens, group, layout, kv_dtype=None):
    """Relative error of sequence 0, kv head 0 against the float64 reference (on the same
    quantised cache for fp8)."""
    page = k.shape[1] if layout == "NHD" else k.shape[2]
    blocks = tables[0, :-(-int(lens[0]) // page)]
    if layout == "NHD":
        kh, vh = (c[blocks.tolist()][:, :, :1] for c in (k, v))
    else:  # HND: [blocks, heads, page, d] -> [blocks, page, 1, d]
        kh, vh = (c[blocks.tolist()][:, :1].transpose(0, 2, 1, 3) for c in (k, v))
    local = np.arange(len(blocks), dtype=np.int32)[None]
    if kv_dtype is None:
        kh, vh = (x.get().astype(np.float32) for x in (kh, vh))
        fp8 = {}
    else:
        kh, vh = (np.ascontiguousarray(x.get()) for x in (kh, vh))
        fp8 = dict(kv_dtype=kv_dtype, k_scale=FP8_SCALE, v_scale=FP8_SCALE)
    want = ref.paged_decode(q[:1, :group].get().astype(np.float32), kh, vh, local, lens[:1],
                            **fp8)
    got = out[:1, :group].get().astype(np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _kv_sets(make, nbytes, min_total=256 << 20, most=128):
    """Enough K/V sets (``make()`` each) that cycling through them defeats the 60 MB L2."""
    return [make() for _ in range(max(1, min(most, -(-min_total // nbytes))))]


def _graph_time(run_set, sets):
    """Seconds per call of ``run_set(set)``: one CUDA graph runs every set once, so neither
    Python nor launch gaps are timed (as a serving loop replays its decode step). Work
    queued on the caller's stream (a plan's upload) lands first: the timing stream does
    not wait for it by itself."""
    import cupy
    cupy.cuda.get_current_stream().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        run_set(sets[0])  # compiles, sets kernel attributes
        stream.synchronize()
        stream.begin_capture()
        for kv in sets:
            run_set(kv)
        graph = stream.end_capture()
        return time_gpu(graph.launch) / len(sets)


def bench_paged(batch, length, heads, page=16, variant=DEFAULT_VARIANT, layout="NHD",
                backend="auto", kv_dtype=None):
    """One row: ``PagedDecoder.run`` on a B x L batch (time, TB/s, fractions of the copy and
    read ceilings) with the plan's ``variant = (schedule, merge)`` and ``backend`` (default:
    the library's choice), on bf16 caches or (``kv_dtype``) fp8 ones."""
    import cupy
    hq, hk = heads
    nbytes = kv_bytes(batch, length, hk, 1 if kv_dtype else None)
    tables, lens = _paged_batch(batch, length, page, seed=batch + length)
    shape = (tables.size,) + ((page, hk) if layout == "NHD" else (hk, page)) + (HEAD_DIM,)

    def make():
        if kv_dtype is not None:
            return _fp8_fill(cupy.empty(shape, np.uint8), cupy.empty(shape, np.uint8), layout, 1,
                             kv_dtype)
        return _random_fill(cupy.empty(shape, DTYPE), 1), _random_fill(cupy.empty(shape, DTYPE), 2)

    sets = _kv_sets(make, nbytes)
    q = _random_fill(cupy.empty((batch, hq, HEAD_DIM), DTYPE), 3)
    out = cupy.empty_like(q)
    dec = decode.PagedDecoder(hq, hk, HEAD_DIM, page, dtype=DTYPE, layout=layout,
                              max_batch=batch, xp=cupy, backend=backend, kv_dtype=kv_dtype)
    scales = {} if kv_dtype is None else dict(k_scale=FP8_SCALE, v_scale=FP8_SCALE)
    dec.plan(tables, lens, schedule=variant[0], merge=variant[1], planner="host")
    variant = (variant[0] or "balanced", dec.merge)
    cupy.cuda.Device().synchronize()
    seconds = _graph_time(lambda kv: dec.run(q, *kv, out=out, **scales), sets)
    turn = iter(range(1 << 30))
    eager = time_gpu(lambda: dec.run(q, *sets[next(turn) % len(sets)], out=out, **scales))
    out.fill(np.nan)
    dec.run(q, *sets[0], out=out, **scales)
    err = _check(out, q, *sets[0], tables, lens, hq // hk, layout, kv_dtype)
    bw = nbytes / seconds
    return {"heads": f"{hq}/{hk}", "kv": kv_dtype or "bf16", "B": batch, "L": length,
            "page": page, "layout": layout,
            "variant": "/".join(variant), "path": dec.kernel, "splits": dec.num_splits, "us": seconds * 1e6,
            "eager_us": eager * 1e6, "TB/s": bw / 1e12, "frac_copy": bw / copy_bandwidth(),
            "frac_read": bw / read_bandwidth(), "vs_bf16": None, "err": err,
            "ok": bool(err < TOLERANCE)}


def bench_torch(batch, length, heads):
    """SDPA cuDNN and flash dense decode TB/s on the same shape (None where unavailable)."""
    torch = torch_or_none()
    if torch is None:
        return {}
    from torch.nn.attention import SDPBackend, sdpa_kernel
    hq, hk = heads
    nbytes = kv_bytes(batch, length, hk)
    q = torch.randn(batch, hq, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    sets = _kv_sets(lambda: tuple(torch.randn(batch, hk, length, HEAD_DIM, device="cuda",
                                              dtype=torch.bfloat16) for _ in range(2)), nbytes)
    figures = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        def run_set(kv):
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(q, *kv, enable_gqa=hq != hk)
        try:
            figures[f"{name}_TB/s"] = nbytes / _torch_graph_time(torch, run_set, sets) / 1e12
        except Exception:  # backend unavailable for this shape or build
            figures[f"{name}_TB/s"] = None
    return figures


def _torch_graph_time(torch, run_set, sets, reps=20):
    """Seconds per ``run_set`` call, replaying a CUDA graph over every set (median)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_set(sets[0])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for kv in sets:
            run_set(kv)
    settle(graph.replay, torch.cuda.synchronize, warmup=1)
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e-3 / len(sets))
    return float(np.median(times))


def _free():
    """Give the K/V sets back (CuPy's pool, torch's cache); after more than LARGE_FREE_BYTES,
    wait FREE_SETTLE_SECONDS: for a while after tens of GB are freed the GPU runs the next
    work slower, longer than ``timing.settle`` covers (benchmarks/NOTES.md, decode v10d)."""
    import cupy
    pool = cupy.get_default_memory_pool()
    held = pool.total_bytes()
    pool.free_all_blocks()
    torch = torch_or_none()
    if torch is not None:
        held += torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
    if held > LARGE_FREE_BYTES:
        cupy.cuda.Device().synchronize()
        time.sleep(FREE_SETTLE_SECONDS)


def run(quick=False):
    """Rows of the decode benchmark (see the module docstring); ``quick`` runs a subset."""
    shapes = [(name, b, l) for name in HEADS for b in BATCHES for l in LENGTHS
              if kv_bytes(b, l, HEADS[name][1]) <= MAX_KV_BYTES]
    if quick:
        shapes = [s for s in shapes if s[0] == "GQA" and s[1] in (1, 64) and s[2] in (2048, 8192)]
    copy_bandwidth()
    read_bandwidth()
    rows = []
    for name, b, l in shapes:
        row = bench_paged(b, l, HEADS[name])
        _free()
        row.update(bench_torch(b, l, HEADS[name]))
        if row.get("cudnn_TB/s"):
            row["vs_cudnn"] = row["TB/s"] / row["cudnn_TB/s"]
        _free()
        rows.append(row)
    defaults = {(r["B"], r["L"]): r["variant"] for r in rows if r["heads"] == "32/8"}
    for b in (1, 64):  # the other plan variants where the goals are set
        for l in (2048, 8192):
            for variant in VARIANTS:
                if "/".join(variant) != defaults.get((b, l)):
                    rows.append(bench_paged(b, l, HEADS["GQA"], variant=variant))
                    _free()
    for page, layout in ((1, "NHD"), (16, "HND")):  # vs page 16 NHD above, at B64 x L8K
        rows.append(bench_paged(64, 8192, HEADS["GQA"], page=page, layout=layout))
        _free()
    for b, l in ((1, 2048), (1, 8192), (64, 2048), (64, 8192)):  # the other kernel path
        rows.append(bench_paged(b, l, HEADS["GQA"], backend="staged"))
        _free()
    rows += _fp8_rows(rows, FP8_QUICK if quick else FP8_SHAPES)
    return rows


def _fp8_rows(rows, shapes):
    """fp8-cache rows at ``shapes`` (B, L) of GQA, each with ``vs_bf16``: its time over the
    bf16-cache row of the same shape (the first, default-plan row above, or one run here)."""
    bf16 = {}
    for r in rows:
        if (r["heads"], r["kv"], r["page"], r["layout"]) == ("32/8", "bf16", 16, "NHD"):
            bf16.setdefault((r["B"], r["L"]), r)
    out = []
    for b, l in shapes:
        base = bf16.get((b, l))
        if base is None:
            base = bench_paged(b, l, HEADS["GQA"])
            _free()
            out.append(base)
        row = bench_paged(b, l, HEADS["GQA"], kv_dtype=FP8)
        _free()
        row["vs_bf16"] = row["us"] / base["us"]
        out.append(row)
    return out


def main(argv=None):
    bench_main(run, argv, copy_ceiling=True)


if __name__ == "__main__":
    main()
