"""What a caller sees: public calls issued back to back, beside the kernels they launch.

For each op (``paged_decode`` at B64 x L8K and B1 x L2K, ``paged_attention`` on a mixed
batch, ``varlen_prefill`` B2 x S8K causal, ``paged_prefill`` B2 x S8K causal from a bf16 and
an fp8 cache (device metadata), ``write_kv_cache`` of 64K tokens, ``apply_rope``
of 16K tokens, ``PagedDecoder.plan`` from host and from device metadata and
``PagedDecoder.run``, ``QuestDecoder.run`` and ``quest_decode`` at B8 x L128K, top 256
pages, bf16 bounds) and
each kind of caller array (``cupy``; ``torch`` tensors and ``jax``
arrays where they are importable), one row gives:

- ``host_us``: host time of one call (median of ``perf_counter`` around each call, calls
  issued in bursts without a sync between them);
- ``gpu_us``: the time per call of calls issued back to back (CUDA events around many
  calls): what a caller's loop sustains, the larger of host and device time;
- ``graph_us``: the same call captured once in a CUDA graph and replayed (the kernels
  alone; every public op is capturable);
- ``peer_us``: the torch peer on the same data (SDPA cuDNN dense attention, a pair of
  ``index_copy_``), back to back, where there is one;
- ``vs_graph``: graph_us / gpu_us (1.0: the call costs nothing beyond its kernels).

A first row measures the floor of a small call's host time: two launches of an empty
kernel and one output allocation.

All Hq32/Hk8 d128 bf16, page 16, NHD. ``--quick`` leaves out the mixed batch. Run:
``cupaged bench overhead [--quick]``.
"""
from __future__ import annotations

import time

import numpy as np

from ..decode import api as decode
from ..prefill import api as prefill
from ..cache_ops import api as cache_ops
from ..rope import api as rope
from ..core.arrays import bfloat16
from .timing import back_to_back_us, bench_main, copy_bandwidth, torch_or_none

HQ, HK, D, PAGE = 32, 8, 128, 16


def _host_us(call, n=200, burst=10):
    """Host microseconds of one call: the median over ``n`` calls, issued in bursts of
    ``burst`` without a sync between them (the device synchronised between bursts, so that
    a burst never waits for a full launch queue)."""
    import cupy
    call()  # warm: kernels loaded, the call's setup cached
    times = []
    for _ in range(n // burst):
        cupy.cuda.Device().synchronize()
        for _ in range(burst):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    cupy.cuda.Device().synchronize()
    return float(np.median(times)) * 1e6


def _graph_us(call, n=50):
    """Replayed-graph microseconds of ``call`` (captured on a CuPy stream)."""
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        call()
        stream.synchronize()
        stream.begin_capture()
        call()
        graph = stream.end_capture()
        graph.launch()
        stream.synchronize()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(n):
            graph.launch()
        stop.record()
        stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) * 1e3 / n


def _rand(shape, seed, dtype=bfloat16):
    import cupy
    rs = cupy.random.RandomState(seed)
    return rs.standard_normal(shape, dtype=cupy.float32).astype(dtype)


def _paged(batch, length, seed=0):
    import cupy
    per = -(-length // PAGE)
    ids = np.random.default_rng(seed).permutation(batch * per).astype(np.int32)
    tables = ids.reshape(batch, per)
    lens = np.full(batch, length, np.int32)
    nb = batch * per
    return dict(kc=_rand((nb, PAGE, HK, D), 1), vc=_rand((nb, PAGE, HK, D), 2),
                tables=cupy.asarray(tables), lens=cupy.asarray(lens), tables_host=tables,
                lens_host=lens)


def _as(kind, arrays):
    if kind == "cupy":
        return arrays
    if kind == "jax":
        import jax.dlpack
        return {n: jax.dlpack.from_dlpack(a) if hasattr(a, "__cuda_array_interface__") else a
                for n, a in arrays.items()}
    torch = torch_or_none()
    return {n: torch.from_dlpack(a) if hasattr(a, "__cuda_array_interface__") else a
            for n, a in arrays.items()}


def _jax_or_none():
    """JAX with a GPU backend (not preallocating device memory), or None."""
    import os
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
        jax.devices("gpu")
    except Exception:
        return None
    jax.config.update("jax_enable_x64", True)  # int64 slot mappings and positions stay int64
    return jax


def _floor_row():
    """The host floor of a call like paged_decode's: two launches of an empty kernel and
    one output allocation, back to back."""
    import cupy
    from cupy_backends.cuda.api import driver
    nop = cupy.RawKernel('extern "C" __global__ void nop() {}', "nop")
    nop((1,), (32,), ())
    fn = nop.kernel.ptr

    def call():
        stream = cupy.cuda.get_current_stream().ptr
        cupy.empty((1, HQ, D), bfloat16)
        driver.launchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, 0, 0)
        driver.launchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, 0, 0)
    return {"op": "floor: 2 empty launches + 1 output", "shape": "", "arrays": "cupy",
            "host_us": _host_us(call), "gpu_us": back_to_back_us(call, "cupy")}


def _row(op, shape, kind, call, graph_call, peer=None, extra=None):
    row = {"op": op, "shape": shape, "arrays": kind, "host_us": _host_us(call),
           "gpu_us": back_to_back_us(call, kind), "graph_us": _graph_us(graph_call)}
    row["vs_graph"] = row["graph_us"] / row["gpu_us"]
    if peer is not None:
        row["peer_us"] = back_to_back_us(peer, "torch")
    row.update(extra or {})
    return row


def _decode_rows(batch, length, kinds):
    import cupy
    case = _paged(batch, length)
    case["q"] = _rand((batch, HQ, D), 3)
    rows = []
    dec = decode.PagedDecoder(HQ, HK, D, PAGE, dtype=bfloat16, max_batch=batch, xp=cupy,
                              layout="NHD")
    out = cupy.empty(case["q"].shape, bfloat16)
    planned = lambda: dec.run(case["q"], case["kc"], case["vc"], out=out)
    dec.plan(case["tables_host"], case["lens_host"], planner="host")
    host_planned = _graph_us(planned)
    dec.plan(case["tables_host"], case["lens_host"])
    torch = torch_or_none()
    peer = None
    if torch is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        tq = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
        tk = torch.randn(batch, HK, length, D, device="cuda", dtype=torch.bfloat16)
        tv = torch.randn_like(tk)

        def peer():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv,
                                                                        enable_gqa=True)
    for kind in kinds:
        a = _as(kind, case)
        call = lambda: decode.paged_decode(a["q"], a["kc"], a["vc"], a["tables"], a["lens"],
                                           layout="NHD")
        rows.append(_row("paged_decode", f"B{batch} x L{length}", kind, call,
                         lambda: decode.paged_decode(case["q"], case["kc"], case["vc"],
                                                     case["tables"], case["lens"], layout="NHD"),
                         peer, {"planned_graph_us": _graph_us(planned),
                                "host_planned_graph_us": host_planned}))
    for kind in kinds:  # the engine's per-layer call: a planned decoder's run
        a = _as(kind, case)
        dec.plan(a["tables"], a["lens"])
        run = lambda: dec.run(a["q"], a["kc"], a["vc"])
        rows.append(_row("PagedDecoder.run", f"B{batch} x L{length}", kind, run, planned))
    return rows


def _quest_rows(kinds, batch=8, length=131072, top_k=256, bounds="bfloat16"):
    """``QuestDecoder.run`` (NHD, bounds of dtype ``bounds``: a name in
    ``quest.BOUND_NAMES``) beside the dense planned decode of the same cache replayed
    (``dense_graph_us``): issue 22's Quest row as a caller sees it."""
    import cupy
    from ..sparse import QuestDecoder, quest, quest_decode
    case = _paged(batch, length)
    case["q"] = _rand((batch, HQ, D), 3)
    nb = case["kc"].shape[0]
    case["k_min"], case["k_max"] = quest.empty_bounds((nb, HK, D), bounds, cupy)
    quest.update_page_bounds(case["kc"], case["tables"], case["lens"], case["k_min"],
                             case["k_max"], layout="NHD")
    dense = decode.PagedDecoder(HQ, HK, D, PAGE, dtype=bfloat16, max_batch=batch, xp=cupy,
                                layout="NHD").plan(case["tables"], case["lens"])
    out = cupy.empty(case["q"].shape, bfloat16)
    dense_graph = _graph_us(lambda: dense.run(case["q"], case["kc"], case["vc"], out=out))
    dec = QuestDecoder(HQ, HK, D, PAGE, top_k, dtype=bfloat16, layout="NHD", max_batch=batch)
    # captured on CuPy arrays after each kind's plan (the same step)
    graph = lambda: dec.run(case["q"], case["kc"], case["vc"], case["k_min"], case["k_max"],
                            out=out)
    # the functional form (QuestPolicy.decode's): its decoder planned at every call
    once = lambda a, out=None: quest_decode(a["q"], a["kc"], a["vc"], a["k_min"], a["k_max"],
                                            a["tables"], a["lens"], top_k, layout="NHD",
                                            out=out)
    shape = f"B{batch} x L{length} top {top_k} {bounds} bounds"
    rows = []
    for kind in kinds:
        a = _as(kind, case)
        dec.plan(a["tables"], a["lens"])
        run = lambda: dec.run(a["q"], a["kc"], a["vc"], a["k_min"], a["k_max"])
        rows.append(_row("QuestDecoder.run", shape, kind, run, graph,
                         extra={"dense_graph_us": dense_graph}))
    for kind in kinds:
        a = _as(kind, case)
        rows.append(_row("quest_decode", shape, kind, lambda: once(a),
                         lambda: once(case, out), extra={"dense_graph_us": dense_graph}))
    return rows


def _plan_rows(batch, length, kinds):
    import cupy
    case = _paged(batch, length)
    dec = decode.PagedDecoder(HQ, HK, D, PAGE, dtype=bfloat16, max_batch=batch, xp=cupy,
                              layout="NHD")
    rows = [{"op": "PagedDecoder.plan", "shape": f"B{batch} host metadata", "arrays": "numpy",
             "host_us": _host_us(lambda: dec.plan(case["tables_host"], case["lens_host"]))},
            {"op": "PagedDecoder.plan planner=host", "shape": f"B{batch} host metadata",
             "arrays": "numpy", "host_us": _host_us(lambda: dec.plan(
                 case["tables_host"], case["lens_host"], planner="host"))}]
    for kind in kinds:
        a = _as(kind, case)
        rows.append({"op": "PagedDecoder.plan", "shape": f"B{batch} device metadata",
                     "arrays": kind,
                     "host_us": _host_us(lambda: dec.plan(a["tables"], a["lens"]))})
    return rows


def _mixed_rows(kinds):
    """paged_attention: 63 decode rows over L8K and one 2K-token prefill chunk."""
    import cupy
    case = _paged(64, 8192)
    q_lens = np.ones(64, np.int32)
    q_lens[-1] = 2048
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
    case.update(cu=cu, q=_rand((int(q_lens.sum()), HQ, D), 4))
    rows = []
    for kind in kinds:
        a = _as(kind, case)
        call = lambda: prefill.paged_attention(a["q"], a["kc"], a["vc"], a["cu"], a["tables"],
                                               a["lens"], layout="NHD")
        rows.append(_row("paged_attention", "63 x L8K decode + 2K chunk", kind, call,
                         lambda: prefill.paged_attention(case["q"], case["kc"], case["vc"],
                                                         case["cu"], case["tables"], case["lens"],
                                                         layout="NHD")))
    return rows


def _prefill_rows(kinds):
    import cupy
    b, s = 2, 8192
    case = dict(q=_rand((b * s, HQ, D), 5), k=_rand((b * s, HK, D), 6),
                v=_rand((b * s, HK, D), 7), cu=cupy.asarray(np.arange(b + 1, dtype=np.int32) * s))
    flops = 4 * b * s * s * D * HQ / 2
    torch = torch_or_none()
    peer = None
    if torch is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        tq = torch.randn(b, HQ, s, D, device="cuda", dtype=torch.bfloat16)
        tk = torch.randn(b, HK, s, D, device="cuda", dtype=torch.bfloat16)

        def peer():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(
                    tq, tk, tk, is_causal=True, enable_gqa=True)
    rows = []
    for kind in kinds:
        a = _as(kind, case)
        call = lambda: prefill.varlen_prefill(a["q"], a["k"], a["v"], a["cu"], a["cu"])
        row = _row("varlen_prefill", "B2 x S8K causal", kind, call,
                   lambda: prefill.varlen_prefill(case["q"], case["k"], case["v"], case["cu"],
                                                  case["cu"]), peer)
        row["TFLOP/s"] = flops / row["gpu_us"] / 1e6
        rows.append(row)
    return rows


def _paged_prefill_rows(kinds):
    """paged_prefill B2 x S8K causal with device metadata (the lengths read by the kernels
    alone: it gathers the pages first), from the bf16 cache and from an fp8 e4m3 one (codes
    drawn below NaN, per-head device scales)."""
    import cupy
    b, s = 2, 8192
    case = _paged(b, s, seed=3)
    case.update(q=_rand((b * s, HQ, D), 14),
                cu=cupy.asarray(np.arange(b + 1, dtype=np.int32) * s),
                k8=cupy.asarray(np.random.default_rng(4).integers(0, 256, case["kc"].shape,
                                                                  np.uint8) & 0x77),
                v8=cupy.asarray(np.random.default_rng(5).integers(0, 256, case["vc"].shape,
                                                                  np.uint8) & 0x77),
                ks=cupy.full(HK, 0.05, np.float32), vs=cupy.full(HK, 0.05, np.float32))
    flops = 4 * b * s * s * D * HQ / 2
    rows = []
    for cache, fp8 in (("bf16", False), ("fp8_e4m3", True)):
        for kind in kinds:
            a = _as(kind, case)

            def call(a=a, fp8=fp8):
                if fp8:
                    return prefill.paged_prefill(a["q"], a["k8"], a["v8"], a["cu"], a["tables"],
                                                 a["lens"], layout="NHD", kv_dtype="fp8_e4m3",
                                                 k_scale=a["ks"], v_scale=a["vs"])
                return prefill.paged_prefill(a["q"], a["kc"], a["vc"], a["cu"], a["tables"],
                                             a["lens"], layout="NHD")
            row = _row("paged_prefill", f"B2 x S8K causal, {cache} cache", kind, call,
                       lambda fp8=fp8: call(case, fp8))
            row["TFLOP/s"] = flops / row["gpu_us"] / 1e6
            rows.append(row)
    return rows


def _write_rows(kinds):
    import cupy
    tokens = 65536
    nb = tokens // PAGE + 8
    case = dict(key=_rand((tokens, HK, D), 8), value=_rand((tokens, HK, D), 9),
                kc=_rand((nb, PAGE, HK, D), 10), vc=_rand((nb, PAGE, HK, D), 11),
                slots=cupy.asarray(np.random.default_rng(0).permutation(nb * PAGE)[:tokens]
                                   .astype(np.int64)))
    nbytes = 4 * case["key"].nbytes  # key and value read, then written
    copy = copy_bandwidth()
    torch = torch_or_none()
    peer = None
    if torch is not None:
        tk = torch.from_dlpack(case["kc"]).view(-1, HK, D)
        tv = torch.from_dlpack(case["vc"]).view(-1, HK, D)
        kk, vv = torch.from_dlpack(case["key"]), torch.from_dlpack(case["value"])
        idx = torch.from_dlpack(case["slots"])

        def peer():
            tk.index_copy_(0, idx, kk)
            tv.index_copy_(0, idx, vv)
    rows = []
    for kind in kinds:
        a = _as(kind, case)
        call = lambda: cache_ops.write_kv_cache(a["key"], a["value"], a["kc"], a["vc"], a["slots"])
        row = _row("write_kv_cache", "64K tokens NHD", kind, call,
                   lambda: cache_ops.write_kv_cache(case["key"], case["value"], case["kc"],
                                                    case["vc"], case["slots"]), peer)
        row["frac_copy"] = nbytes / (row["gpu_us"] * 1e-6) / copy
        rows.append(row)
    return rows


def _rope_rows(kinds):
    import cupy
    tokens = 16384
    case = dict(q=_rand((tokens, HQ, D), 12), k=_rand((tokens, HK, D), 13),
                pos=cupy.asarray(np.random.default_rng(1).integers(0, 8192, tokens)
                                 .astype(np.int64)))
    rows = []
    for kind in kinds:
        a = _as(kind, case)
        call = lambda: rope.apply_rope(a["pos"], a["q"], a["k"], max_position=8192)
        rows.append(_row("apply_rope", "16K tokens", kind, call,
                         lambda: rope.apply_rope(case["pos"], case["q"], case["k"],
                                                 max_position=8192)))
    return rows


def run(quick=False):
    kinds = ["cupy"] + (["torch"] if torch_or_none() is not None else [])
    kinds += ["jax"] if _jax_or_none() is not None else []
    rows = [_floor_row()]
    rows += _decode_rows(64, 8192, kinds) + _decode_rows(1, 2048, kinds)
    rows += _plan_rows(64, 8192, kinds) + _plan_rows(256, 2048, kinds)
    rows += _prefill_rows(kinds)  # the TMA launch's host cost (tensor maps per K/V address)
    rows += _paged_prefill_rows(kinds)
    if not quick:
        rows += _mixed_rows(kinds)
    rows += _write_rows(kinds) + _rope_rows(kinds)
    if not quick:
        rows += _quest_rows(kinds) + _quest_rows(kinds, bounds="fp8_e4m3")
    return rows


COLUMNS = ["op", "shape", "arrays", "host_us", "gpu_us", "graph_us", "planned_graph_us",
           "host_planned_graph_us", "vs_graph", "peer_us", "dense_graph_us", "TFLOP/s",
           "frac_copy"]


def main(argv=None):
    bench_main(run, argv, columns=COLUMNS)


if __name__ == "__main__":
    main()
