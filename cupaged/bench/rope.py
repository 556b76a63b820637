"""Benchmark of RoPE throughput and of what attention sinks cost inside decode and prefill.

Rows:

- ``rope``: ``apply_rope`` on T tokens, Hq 32, Hk 8, d 128, bf16 (neox, GPT-J, in place):
  bytes read plus written (q, k, positions, the table rows) over time, as TB/s and as a
  fraction of the device-to-device copy bandwidth measured in the same run. ``ms`` times
  the launch alone, ``public_ms`` the public call (its position check syncs).
- ``decode`` / ``prefill``: ``paged_decode`` (B64 L8K Hq32 Hk8 d128 bf16, page 16; through
  ``PagedDecoder`` when present, so no host checks are timed) and ``varlen_prefill`` (B2
  S8192 H32 d128 causal bf16) without and with sinks; ``sink_overhead`` is the relative
  slowdown (goal: < 3 %). A row is skipped when its op module is missing.

Every timed configuration is checked against the reference on a slice first.
Run: ``python -m cupaged.bench.rope [--quick]``.
"""
from __future__ import annotations

import numpy as np

from ..core.arrays import bfloat16
from ..reference import attention as aref
from ..reference import rope as rref
from .timing import bench_main, copy_bandwidth, rotating, time_gpu

HQ, HK, D = 32, 8, 128


def _random(shape, seed, scale=1.0):
    import cupy
    rng = np.random.default_rng(seed)
    return cupy.asarray((scale * rng.standard_normal(shape, np.float32)).astype(bfloat16))


def _close(got, want, tol=2e-2):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return bool(np.linalg.norm(got - want) <= tol * np.linalg.norm(want))


# ----------------------------------------------------------------------------- RoPE
def bench_rope(tokens, is_neox=True, inplace=False):
    import cupy
    from ..rope import api as rope
    item = np.dtype(bfloat16).itemsize

    def make():
        pos = cupy.asarray(np.random.default_rng(tokens).integers(0, 8192, tokens), dtype=cupy.int32)
        return pos, _random((tokens, HQ, D), 1), _random((tokens, HK, D), 2)

    data_bytes = tokens * (HQ + HK) * D * item
    nxt = rotating(make, 2 * data_bytes)
    pos, q, k = nxt()
    plan, _, _ = rope.plan_rope(pos, q, k, None, 10000.0, is_neox, None, 8192, None, cupy)
    q_out, k_out = (q, k) if inplace else (cupy.empty_like(q), cupy.empty_like(k))
    # the reference reads the inputs before the launch (which may rotate them in place)
    want_q, want_k = rref.apply_rope(pos[:64].get(), q[:64].get(), k[:64].get(), is_neox=is_neox,
                                     max_position=8192)
    rope._launch(plan, pos, q, k, q_out, k_out)
    ok = _close(q_out[:64].get(), want_q) and _close(k_out[:64].get(), want_k)

    def launch():
        p, a, b = nxt()
        rope._launch(plan, p, a, b, *((a, b) if inplace else (q_out, k_out)))

    seconds = time_gpu(launch)
    public = time_gpu(lambda: rope.apply_rope(pos, q, k, is_neox=is_neox, max_position=8192))
    nbytes = 2 * data_bytes + tokens * (4 + D * 4)  # q, k in and out; positions; table rows
    bw = nbytes / seconds
    variant = ("neox" if is_neox else "gptj") + (" inplace" if inplace else "")
    return dict(op="rope", variant=variant, shape=f"T{tokens} Hq{HQ} Hk{HK} d{D} bf16",
                ms=seconds * 1e3, public_ms=public * 1e3, TBps=bw / 1e12,
                frac_copy=bw / copy_bandwidth(), checked=ok)


# ----------------------------------------------------------------------------- sinks
def _decode_inputs(batch, kv_len, block_size=16):
    import cupy
    blocks_per_seq = kv_len // block_size
    num_blocks = batch * blocks_per_seq
    tables = np.random.default_rng(3).permutation(num_blocks).astype(np.int32)
    tables = tables.reshape(batch, blocks_per_seq)
    shape = (num_blocks, block_size, HK, D)
    return dict(q=_random((batch, HQ, D), 4), k_cache=_random(shape, 5), v_cache=_random(shape, 6),
                block_tables=cupy.asarray(tables),
                seq_lens=cupy.full(batch, kv_len, dtype=cupy.int32), host_tables=tables)


def _decode_runner(inp, sinks):
    import cupaged
    try:
        dec = cupaged.PagedDecoder(HQ, HK, D, 16, dtype="bfloat16", layout="NHD")
        dec.plan(inp["block_tables"], inp["seq_lens"])
        return lambda: dec.run(inp["q"], inp["k_cache"], inp["v_cache"], sinks=sinks)
    except (AttributeError, ImportError, TypeError):
        return lambda: cupaged.paged_decode(inp["q"], inp["k_cache"], inp["v_cache"],
                                            inp["block_tables"], inp["seq_lens"], sinks=sinks,
                                            layout="NHD")


def _check_decode(inp, sinks, out, kv_len):
    import cupy
    blocks = cupy.asarray(inp["host_tables"][0])
    k, v = aref.gather_kv(inp["k_cache"][blocks].get(), inp["v_cache"][blocks].get(),
                          np.arange(len(blocks)), kv_len)
    want, _ = aref.attend(inp["q"][:1].get(), k, v, sinks=None if sinks is None else sinks.get())
    return _close(out[:1].get(), want)


def bench_decode_sinks(batch, kv_len):
    """Rows of paged decode without and with sinks, or [] when decode is missing."""
    import importlib.util
    if importlib.util.find_spec("cupaged.decode.api") is None:
        return []
    inp = _decode_inputs(batch, kv_len)
    sinks = _random((HQ,), 7, 2.0).astype(np.float32)
    nbytes = 2 * batch * kv_len * HK * D * np.dtype(bfloat16).itemsize
    return _sink_rows("decode", f"B{batch} L{kv_len} Hq{HQ} Hk{HK} d{D} bf16 page16",
                      lambda s: _decode_runner(inp, s), sinks,
                      lambda out, s: _check_decode(inp, s, out, kv_len), nbytes=nbytes)


def bench_prefill_sinks(batch, seqlen):
    """Rows of causal varlen prefill without and with sinks, or [] when prefill is missing."""
    import cupy
    try:
        from ..prefill.api import varlen_prefill
    except ImportError:
        return []
    tokens = batch * seqlen
    q, k, v = (_random((tokens, HQ, D), s) for s in (8, 9, 10))
    cu = cupy.asarray(np.arange(batch + 1, dtype=np.int32) * seqlen)
    sinks = _random((HQ,), 11, 2.0).astype(np.float32)

    def runner(s):
        return lambda: varlen_prefill(q, k, v, cu, cu, seqlen, seqlen, causal=True, sinks=s)

    def check(out, s):  # the last 16 queries of sequence 0 against every key of it
        rows = slice(seqlen - 16, seqlen)
        want, _ = aref.attend(q[rows].get(), k[:seqlen].get(), v[:seqlen].get(),
                              sinks=None if s is None else s.get())
        return _close(out[rows].get(), want)

    flops = 4 * batch * HQ * D * seqlen * seqlen / 2
    return _sink_rows("prefill", f"B{batch} S{seqlen} H{HQ} d{D} causal bf16", runner, sinks,
                      check, flops=flops)


def _sink_rows(op, shape, runner, sinks, check, nbytes=None, flops=None):
    rows, base = [], None
    for variant, s in (("no sinks", None), ("sinks", sinks)):
        fn = runner(s)
        ok = check(fn(), s)
        seconds = time_gpu(fn)
        base = seconds if base is None else base
        row = dict(op=op, variant=variant, shape=shape, ms=seconds * 1e3, checked=ok,
                   sink_overhead=seconds / base - 1)
        if nbytes:
            row.update(TBps=nbytes / seconds / 1e12, frac_copy=nbytes / seconds / copy_bandwidth())
        if flops:
            row.update(TFLOPs=flops / seconds / 1e12)
        rows.append(row)
    return rows


def run(quick=False):
    """All rows: RoPE (neox, GPT-J, in place), then sinks in decode and prefill."""
    tokens = 4096 if quick else 16384
    rows = [bench_rope(tokens), bench_rope(tokens, is_neox=False), bench_rope(tokens, inplace=True)]
    rows += bench_decode_sinks(16 if quick else 64, 2048 if quick else 8192)
    rows += bench_prefill_sinks(1 if quick else 2, 2048 if quick else 8192)
    return rows


COLUMNS = ["op", "variant", "shape", "ms", "public_ms", "TBps", "frac_copy", "TFLOPs",
           "sink_overhead", "checked"]


def main(argv=None):
    bench_main(run, argv, COLUMNS)


if __name__ == "__main__":
    main()
