"""Benchmark of the cache ops: write_kv_cache per layout, the gather of paged prefill
(``gather_kv``: a batch's pages into packed 16-bit rows, from bf16 and fp8 caches),
copy_blocks, swap_blocks both ways.

Reports milliseconds, TB/s counting bytes read plus bytes written, and the fraction of the
device-to-device copy bandwidth measured in the same run (``timing.copy_bandwidth``); the
fp8 write row quantises bf16 rows into an e4m3 cache (NHD, per-head scales: 2 bytes read and
1 written an element). The
kernel figure (``ms``) times the launch alone; ``public_ms`` times the public call, whose
checks copy the indices to the host (a sync). Every timed configuration is checked against
the reference first. Run: ``python -m cupaged.bench.cache [--quick]``.
"""
from __future__ import annotations

import numpy as np

from ..cache_ops import api as cache_ops
from ..core.arrays import bfloat16
from ..core.fp8 import fp8_format, kernel_scales
from ..core.layouts import LAYOUTS, CacheGeometry, cache_shapes
from ..reference import cache as ref
from .timing import bench_main, copy_bandwidth, time_gpu

BLOCK_SIZE, KV_HEADS, HEAD_DIM, DTYPE = 16, 8, 128, bfloat16


def _random(shape, seed):
    """Random bf16 values (host-generated, never zeros) as a CuPy array."""
    import cupy
    rng = np.random.default_rng(seed)
    return cupy.asarray(rng.standard_normal(shape, np.float32).astype(DTYPE))


def _filled(shape):
    import cupy
    a = cupy.empty(shape, DTYPE)
    a.view(cupy.uint16).fill(0x3F80)         # 1.0: differs from every written value
    return a


def _same(device, host):
    return bool((device.get().view(np.uint8) == host.view(np.uint8)).all())


def _row(op, variant, note, seconds, nbytes, public=None, ok=True):
    bw = nbytes / seconds
    return {"op": op, "variant": variant, "shape": note, "ms": seconds * 1e3,
            "public_ms": None if public is None else public * 1e3, "TB/s": bw / 1e12,
            "frac_copy": bw / copy_bandwidth(), "matches_ref": ok}


def bench_write(layout, tokens, check=True, kv_dtype=None):
    """One row: write ``tokens`` tokens (prefill-like: whole blocks in random order) into a
    bf16 cache or (``kv_dtype``) an fp8 one, quantised with per-head scales."""
    import cupy
    num_blocks = tokens * 5 // (4 * BLOCK_SIZE)
    geo = CacheGeometry(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    fmt = None if kv_dtype is None else fp8_format(kv_dtype)
    ks, vs = cache_shapes(layout, *geo, DTYPE if fmt is None else fmt.name)
    if fmt is None:
        k, v = _filled(ks), _filled(vs)
    else:  # a byte pattern no write leaves
        k, v = cupy.full(ks, 0x11, np.uint8), cupy.full(vs, 0x11, np.uint8)
    key = _random((tokens, KV_HEADS, HEAD_DIM), 0)
    value = _random((tokens, KV_HEADS, HEAD_DIM), 1)
    blocks = np.random.default_rng(2).permutation(num_blocks)[: tokens // BLOCK_SIZE]
    slots = (blocks[:, None] * BLOCK_SIZE + np.arange(BLOCK_SIZE)).reshape(-1).astype(np.int64)
    slots_dev = cupy.asarray(slots)
    host_scales = [None, None] if fmt is None else [
        np.random.default_rng(s).uniform(0.01, 0.1, KV_HEADS).astype(np.float32) for s in (3, 4)]
    k_scale, v_scale = (None if s is None else cupy.asarray(s) for s in host_scales)
    fp8 = dict(kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)
    ok = True
    if check:
        k_host, v_host = k.get(), v.get()
        cache_ops.write_kv_cache(key, value, k, v, slots_dev, layout=layout, **fp8)
        ref.write_kv_cache(key.get(), value.get(), k_host, v_host, slots, layout,
                           kv_dtype=kv_dtype, k_scale=host_scales[0], v_scale=host_scales[1])
        ok = _same(k, k_host) and _same(v, v_host)
    setup = cache_ops._write_setup(key, value, k, v, geo, layout, fmt,
                                   kernel_scales(fmt, k_scale, v_scale, KV_HEADS, False))
    addresses = [0 if a is None else a.data.ptr
                 for a in (key, value, k, v, slots_dev, k_scale, v_scale)]
    t = time_gpu(lambda: cache_ops._launch_write(setup, addresses,
                                                 cupy.cuda.get_current_stream().ptr))
    tp = time_gpu(lambda: cache_ops.write_kv_cache(key, value, k, v, slots_dev, layout=layout,
                                                   **fp8), reps=5)
    nbytes = key.nbytes + value.nbytes + (k.itemsize * key.size + v.itemsize * value.size)
    kind = "bf16" if fmt is None else f"bf16 -> {fmt.name}"
    return _row("write_kv_cache", layout, f"{tokens} tok x {KV_HEADS}h x d{HEAD_DIM} {kind}",
                t, nbytes, tp, ok)


def bench_gather(layout, tokens, kv_dtype=None, seqs=4):
    """One row: ``gather_kv`` of ``seqs`` sequences of ``tokens / seqs`` keys each, in pages
    of random order, from a bf16 cache or (``kv_dtype``) an fp8 one into packed bf16 rows
    (the bytes of the cache read, 2 an element written); checked: the packed rows are the
    written rows (bf16 bits), or their codes' values (fp8, scales left out)."""
    import cupy
    from ..prefill.launch import gather_buffers
    from ..core.layouts import cache_strides
    from ..reference.fp8 import dequantize, quantize
    per_seq = tokens // seqs
    width = -(-per_seq // BLOCK_SIZE)
    num_blocks = seqs * width + 3
    geo = CacheGeometry(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    fmt = None if kv_dtype is None else fp8_format(kv_dtype)
    ks, vs = cache_shapes(layout, *geo, DTYPE if fmt is None else fmt.name)
    k, v = (cupy.zeros(ks, DTYPE if fmt is None else np.uint8),
            cupy.zeros(vs, DTYPE if fmt is None else np.uint8))
    key = _random((seqs * per_seq, KV_HEADS, HEAD_DIM), 5)
    value = _random((seqs * per_seq, KV_HEADS, HEAD_DIM), 6)
    tables = np.random.default_rng(7).permutation(num_blocks)[:seqs * width].astype(np.int32)
    tables = tables.reshape(seqs, width)
    t = np.arange(per_seq)
    slots = np.concatenate([tables[b, t // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE
                            + t % BLOCK_SIZE for b in range(seqs)])
    host_scales = [None, None] if fmt is None else [
        np.random.default_rng(s).uniform(0.01, 0.1, KV_HEADS).astype(np.float32) for s in (8, 9)]
    k_scale, v_scale = (None if s is None else cupy.asarray(s) for s in host_scales)
    cache_ops.write_kv_cache(key, value, k, v, cupy.asarray(slots), layout=layout,
                             kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)
    rows = gather_buffers("bench", seqs * per_seq, seqs, KV_HEADS, HEAD_DIM, DTYPE)
    tables_dev = cupy.asarray(tables)
    lens = cupy.full(seqs, per_seq, np.int32)
    gather = cache_ops.GatherLaunch(DTYPE, kv_dtype, cache_strides(k, v, layout, geo), geo, seqs,
                                    tables_dev, rows["cu_k"], rows["k"], rows["v"])
    stream = cupy.cuda.get_current_stream().ptr
    launch = lambda: gather(k.data.ptr, v.data.ptr, tables_dev.data.ptr, lens.data.ptr, stream)
    launch()
    ok = True
    for src, out, scale in ((key, rows["k"], host_scales[0]), (value, rows["v"], host_scales[1])):
        got = out.get().view(DTYPE).astype(np.float32)
        want = src.get().astype(np.float32)
        if fmt is not None:  # the codes' values: x / scale quantised
            want = dequantize(quantize(want, scale, fmt.name), 1.0, fmt.name)
        ok = ok and bool((got == want).all())
    seconds = time_gpu(launch)
    nbytes = (k.itemsize + 2) * (key.size + value.size)
    kind = "bf16" if fmt is None else f"{fmt.name} -> bf16"
    return _row("gather_kv", layout, f"{seqs} x {per_seq} tok x {KV_HEADS}h x d{HEAD_DIM} {kind}",
                seconds, nbytes, None, ok)


def bench_copy(num_pairs, check=True):
    """One row: copy_blocks of ``num_pairs`` random (src, dst) pairs in an NHD cache."""
    num_blocks = 3 * num_pairs
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k, v = _random(shape, 3), _random(shape, 4)
    perm = np.random.default_rng(5).permutation(num_blocks)
    pairs = np.stack([perm[:num_pairs], perm[num_pairs:2 * num_pairs]], axis=1)
    ok = True
    if check:
        k_host, v_host = k.get(), v.get()
        cache_ops.copy_blocks(k, v, pairs)
        ref.copy_blocks(k_host, v_host, pairs)
        ok = _same(k, k_host) and _same(v, v_host)
    block_bytes = k[0].nbytes
    t = time_gpu(lambda: cache_ops._launch_copy((k, k, v, v), pairs, block_bytes, 2,
                                                k.shape[0], k.shape[0]))
    tp = time_gpu(lambda: cache_ops.copy_blocks(k, v, pairs), reps=5)
    return _row("copy_blocks", "kernel", f"{num_pairs} pairs x 2 x {block_bytes >> 10} KiB",
                t, 4 * num_pairs * block_bytes, tp, ok)


def bench_swap(num_blocks, run, direction, method, check=True):
    """One row: swap ``num_blocks`` blocks (runs of ``run`` consecutive) out or in."""
    import cupy
    import cupyx
    shape = (4 * num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    device = _random(shape, 6)
    host = cupyx.empty_pinned((num_blocks,) + shape[1:], DTYPE)
    host.view(np.uint16).fill(0x3F80)
    starts = np.random.default_rng(7).permutation(4 * num_blocks // run)[: num_blocks // run]
    dev_ids = (starts[:, None] * run + np.arange(run)).reshape(-1)
    pairs = np.stack([dev_ids, np.arange(num_blocks)], axis=1)
    src, dst = (device, host) if direction == "out" else (host, device)
    if direction == "in":
        pairs = pairs[:, ::-1].copy()
    ok = True
    if check:
        expect = dst.copy() if isinstance(dst, np.ndarray) else dst.get()
        ref.swap_blocks(src if isinstance(src, np.ndarray) else src.get(), expect, pairs)
        cache_ops.swap_blocks(src, dst, pairs, method=method)
        cupy.cuda.get_current_stream().synchronize()
        got = dst if isinstance(dst, np.ndarray) else dst.get()
        ok = bool((got.view(np.uint16) == expect.view(np.uint16)).all())
    block_bytes = device[0].nbytes
    t = time_gpu(lambda: cache_ops.swap_blocks(src, dst, pairs, method=method), reps=10)
    return _row(f"swap_blocks {direction}", method,
                f"{num_blocks} blocks, runs of {run}, {block_bytes >> 10} KiB", t,
                2 * num_blocks * block_bytes, None, ok)


def run(quick=False):
    """Time every cache op; return table rows (dicts)."""
    import cupy
    tokens = 8192 if quick else 65536
    rows = [bench_write(layout, tokens) for layout in LAYOUTS]
    rows.append(bench_write("NHD", tokens, kv_dtype="fp8_e4m3"))
    gathers = [("NHD", None), ("NHD", "fp8_e4m3")] + ([] if quick else [
        ("HND", None), ("HND", "fp8_e4m3"), ("vllm", None), ("vllm", "fp8_e4m3")])
    rows += [bench_gather(layout, 65536, kv) for layout, kv in gathers]
    rows.append(bench_copy(512 if quick else 2048))
    n = 256 if quick else 1024
    for direction in ("out", "in"):
        for run_len in (1, 64):
            for method in ("kernel", "memcpy"):
                rows.append(bench_swap(n, run_len, direction, method))
    cupy.get_default_memory_pool().free_all_blocks()
    return rows


def main(argv=None):
    bench_main(run, argv, copy_ceiling=True)


if __name__ == "__main__":
    main()
