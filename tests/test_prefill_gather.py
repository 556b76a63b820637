"""Paged prefill by a gather: PagedPrefiller(gather=...) packs a host-planned batch's keys
and values (16-bit, or fp8 codes widened exactly) and runs the ragged kernel on them.

CPU: the choice (``plan.gather_rows`` counted by hand, ``gather_pays``, ``gatherable``) and
bad arguments. GPU: the runs against the float64 reference on the same cache bytes for every
layout, cache format, page size, head size, dtype, feature and scale form, outputs and LSE
NaN-poisoned and every slot no sequence owns NaN (a key read past a length fails); a CUDA
graph replayed after a re-plan.
"""
import numpy as np
import pytest

import cupaged
from cupaged.cache_ops import api as cache_ops_api
from cupaged.core.arrays import HEAD_DIMS, bfloat16
from cupaged.core.layouts import LAYOUTS, CacheStrides, layout_strides
from cupaged.prefill import plan as plan_
from cupaged.prefill.launch import gatherable
from cupaged.reference import attention as ref
from test_prefill import (FEATURES, GRAPH_KV_LENS, GRAPH_Q_LENS, KV_LENS, Q_LENS, _feature_opts,
                          assert_close, assert_lse, paged, ragged)
from test_prefill_fp8 import FORMATS, _dev, fp8_paged

META = ("cu_seqlens_q", "block_tables", "seq_lens")


def plain_paged(rng, q_lens, kv_lens, *, hq=8, hk=2, d=128, dtype=bfloat16, layout="NHD",
                block_size=16):
    """A random paged batch on 16-bit caches whose unowned slots hold NaN."""
    q, k, v, cu_q, cu_k = ragged(rng, q_lens, kv_lens, hq, hk, d, dtype)
    kc, vc, bt, sl = paged(rng, k, v, cu_k, layout, block_size, fill=np.nan)
    return dict(q=q, k_cache=kc, v_cache=vc, cu_seqlens_q=cu_q, block_tables=bt, seq_lens=sl), {}


def build(rng, kv, q_lens=Q_LENS, kv_lens=KV_LENS, **kw):
    """(case, fp8 arguments) on a cache of ``kv`` (None: 16-bit)."""
    if kv is None:
        return plain_paged(rng, q_lens, kv_lens, **kw)
    return fp8_paged(rng, q_lens, kv_lens, fmt=kv, **kw)


def check_gather(cp, case, fp8, layout, device_scales=True, causal=True, **opts):
    """PagedPrefiller(gather=True): plan the host metadata, run with poisoned out and LSE,
    compare with the reference on the same bytes."""
    q = case["q"]
    hq, d = q.shape[1:]
    hk = case["k_cache"].shape[2] if layout == "NHD" else case["k_cache"].shape[1]
    block_size = case["k_cache"].shape[1] if layout == "NHD" else (
        case["k_cache"].shape[2] if layout == "HND" else case["k_cache"].shape[3])
    want, want_lse = ref.paged_prefill(**case, layout=layout, return_lse=True, causal=causal,
                                       **fp8, **opts)
    fixed = {n: opts.pop(n) for n in ("window_left", "logits_soft_cap", "sm_scale") if n in opts}
    pre = cupaged.PagedPrefiller(hq, hk, d, block_size, dtype=q.dtype, layout=layout,
                                 causal=causal, kv_dtype=fp8.get("kv_dtype"), gather=True,
                                 **fixed)
    assert pre.plan(*(case[n] for n in META)) is pre
    assert pre.gathers
    scales = {n: (_dev(cp, a) if device_scales else a) for n, a in fp8.items() if n != "kv_dtype"}
    out = cp.asarray(np.full(q.shape, np.nan, q.dtype))
    lse = cp.asarray(np.full(q.shape[:2], np.nan, np.float32))
    got = pre.run(cp.asarray(q), cp.asarray(case["k_cache"]), cp.asarray(case["v_cache"]),
                  out=out, lse=lse, **{n: _dev(cp, a) for n, a in opts.items()}, **scales)
    assert got is out
    assert_close(out.get(), want, q.dtype)
    assert_lse(lse.get(), want_lse)
    return pre


# ----------------------------------------------------------------------------- CPU
def test_gather_rows_counts_visible_pairs():
    # causal q 4 over kv 10: 4 * 6 + 4 * 5 / 2 = 34 pairs; q 3 non-causal over 5: 15
    assert plan_.gather_rows([4], [10], 1, True) == pytest.approx(3.4)
    assert plan_.gather_rows([4, 0], [10, 6], 2, True) == pytest.approx(2 * 34 / 16)
    assert plan_.gather_rows([3], [5], 4, False) == pytest.approx(4 * 15 / 5)
    # window 1: each query sees at most 2 keys
    assert plan_.gather_rows([4], [10], 1, True, window_left=1) == pytest.approx(0.8)
    assert plan_.gather_rows([0], [0], 1, True) == 0.0


def test_gather_pays_from_its_reuse_thresholds():
    long = ([8192], [8192])  # causal: about 4096 rows a key
    decode = ([1] * 63 + [2048], [8192] * 63 + [2048])
    assert plan_.gather_pays(*long, 1, True, -1, None)
    assert plan_.gather_pays(*long, 1, True, -1, "fp8_e4m3")
    assert not plan_.gather_pays(*decode, 4, True, -1, None)
    rows = plan_.gather_rows([1500], [1500], 1, True)  # 750.5
    assert plan_.GATHER_ROWS[True] <= rows < plan_.GATHER_ROWS[False]
    assert plan_.gather_pays([1500], [1500], 1, True, -1, "fp8_e5m2")
    assert not plan_.gather_pays([1500], [1500], 1, True, -1, None)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("itemsize", [1, 2])
def test_dense_caches_are_gatherable(layout, itemsize):
    kv = "fp8_e4m3" if itemsize == 1 else None
    assert gatherable(layout_strides(layout, 16, 2, 128, itemsize), kv, itemsize)


def test_strides_off_the_chunks_are_read_in_place():
    s = layout_strides("NHD", 16, 2, 128, 2)
    assert not gatherable(s._replace(k_block=s.k_block + 4), None, 2)
    assert not gatherable(s._replace(v_block=s.v_block + 8), "fp8_e4m3", 1)
    assert gatherable(CacheStrides(*s)._replace(k_block=s.k_block + 8), None, 2)


@pytest.mark.parametrize("kv", [None] + list(FORMATS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float16, bfloat16])
def test_gather_specializations_cover_the_launches(dtype, layout, kv):
    """The gather a PagedPrefiller can launch is among the compile gate's kernels."""
    strides = layout_strides(layout, 16, 2, 128, 1 if kv else np.dtype(dtype).itemsize)
    expr = cache_ops_api.gather_expr(dtype, kv, strides.v_dim != 1)
    assert expr in {s.expr for s in cache_ops_api.kernel_specializations()}


def test_gather_bad_arguments(rng):
    with pytest.raises(TypeError, match="gather: expected a bool, got 'yes'"):
        cupaged.PagedPrefiller(8, 2, 64, 16, gather="yes")
    with pytest.raises(ValueError, match="gather: expected False or None with split_decode"):
        cupaged.PagedPrefiller(8, 2, 64, 16, gather=True, split_decode=True)
    with pytest.raises(ValueError, match="gather: expected False or None for float32"):
        cupaged.PagedPrefiller(8, 2, 64, 16, dtype=np.float32, gather=True)
    case, _ = plain_paged(rng, [3, 5], [9, 5], d=64, dtype=np.float16)
    pre = cupaged.PagedPrefiller(8, 2, 64, 16, gather=True)
    with pytest.raises(ValueError, match="gather: expected a host plan"):
        pre.plan(*(case[n] for n in META), planner="device")
    assert not pre.gathers and pre._host is None  # refused before any state changed


def test_numpy_gather_prefiller_is_the_reference(rng):
    case, fp8 = build(rng, "fp8_e4m3", d=64, block_size=4, layout="HND")
    pre = cupaged.PagedPrefiller(8, 2, 64, 4, dtype=bfloat16, layout="HND", kv_dtype="fp8_e4m3",
                                 gather=True).plan(*(case[n] for n in META))
    assert pre.gathers
    got = pre.run(case["q"], case["k_cache"], case["v_cache"], k_scale=fp8["k_scale"],
                  v_scale=fp8["v_scale"])
    np.testing.assert_array_equal(got, ref.paged_prefill(**case, layout="HND", **fp8))


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("kv", [None] + list(FORMATS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_gather_layouts(cp, rng, layout, kv, block_size):
    dtype = np.float16 if kv == "fp8_e5m2" else bfloat16
    case, fp8 = build(rng, kv, layout=layout, block_size=block_size, dtype=dtype)
    check_gather(cp, case, fp8, layout)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, bfloat16])
@pytest.mark.parametrize("head_dim, kv", [(d, None) for d in HEAD_DIMS]
                         + [(d, "fp8_e4m3") for d in plan_.FP8_HEAD_DIMS])
def test_gpu_gather_head_dims_and_dtypes(cp, rng, head_dim, kv, dtype):
    case, fp8 = build(rng, kv, [1, 63, 64, 65, 0, 200], [1, 63, 64, 1000, 7, 4097], d=head_dim,
                      dtype=dtype)
    check_gather(cp, case, fp8, "NHD")


@pytest.mark.gpu
@pytest.mark.parametrize("kv", [None, "fp8_e4m3"])
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_gpu_gather_features(cp, rng, feature, kv):
    opts = _feature_opts(rng, feature, 8)
    q_scale, causal = opts.pop("q_scale", 1.0), opts.pop("causal", True)
    case, fp8 = build(rng, kv, layout="HND")
    case["q"] = (case["q"].astype(np.float32) * q_scale).astype(bfloat16)
    check_gather(cp, case, fp8, "HND", causal=causal, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", ["float", "tensor", "heads"])
def test_gpu_gather_scale_forms(cp, rng, scale):
    """A host float, a device value for every head, a device value per head; then a second
    layer's scales over the same plan."""
    device_scales = scale != "float"  # arrays are device arrays (a launch takes their address)
    case, fp8 = build(rng, "fp8_e4m3", scale=scale, block_size=16)
    pre = check_gather(cp, case, fp8, "NHD", device_scales=device_scales)
    # a second layer over the same plan: other scales, the same packed rows' buffers
    for name, factor in (("k_scale", 2.0), ("v_scale", 0.5)):
        x = fp8[name]
        fp8[name] = x * factor if isinstance(x, float) else np.asarray(x * factor, np.float32)
    want = ref.paged_prefill(**case, layout="NHD", **fp8)
    given = {n: _dev(cp, fp8[n]) if device_scales else fp8[n] for n in ("k_scale", "v_scale")}
    got = pre.run(*(cp.asarray(case[n]) for n in ("q", "k_cache", "v_cache")), **given)
    assert_close(got.get(), want, bfloat16)


@pytest.mark.gpu
def test_gpu_gather_auto_choice(cp, rng):
    """None gathers a long prefill on sm_90 and not a decode-heavy batch; False never."""
    hopper = cp.cuda.Device().compute_capability == "90"
    long_case, _ = plain_paged(rng, [3000], [3000], hq=8, hk=1)
    decode_case, _ = plain_paged(rng, [1, 1, 1, 40], [900, 700, 1200, 40], hq=8, hk=1)
    for case, gathers in ((long_case, hopper), (decode_case, False)):
        for gather in (None, False):
            pre = cupaged.PagedPrefiller(8, 1, 128, 16, dtype=bfloat16, gather=gather)
            pre.plan(*(case[n] for n in META))
            assert pre.gathers == (gathers and gather is None)
            want = ref.paged_prefill(**case)
            got = pre.run(*(cp.asarray(case[n]) for n in ("q", "k_cache", "v_cache")))
            assert_close(got.get(), want, bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", [None, "fp8_e4m3"])
def test_gpu_gather_graph_replays_after_replan(cp, rng, kv):
    """plan a batch, run, capture the run in a CUDA graph, plan a batch of fewer keys, more
    sequences (within max_batch) and as many query rows and work items over the same
    cache, replay: the new plan's reference; the packed rows keep their address."""
    hq, hk, d, bs = 8, 2, 128, 16
    firsts = (GRAPH_Q_LENS[1], GRAPH_KV_LENS[1])  # 2998 keys, then 1404
    seconds = (GRAPH_Q_LENS[0], GRAPH_KV_LENS[0])
    case, fp8 = build(rng, kv, firsts[0] + seconds[0], firsts[1] + seconds[1])
    cu_all, bt, sl = (case[n] for n in META)
    steps = []
    for seqs in (slice(0, 3), slice(3, 7)):
        cu = (cu_all[seqs.start:seqs.stop + 1] - cu_all[seqs.start]).astype(np.int32)
        q = case["q"][cu_all[seqs.start]:cu_all[seqs.stop]]
        meta = (cu, bt[seqs].copy(), sl[seqs].copy())
        want, want_lse = ref.paged_prefill(q, case["k_cache"], case["v_cache"], *meta,
                                           return_lse=True, **fp8)
        steps.append((meta, q, want, want_lse))
    assert steps[0][1].shape == steps[1][1].shape
    pre = cupaged.PagedPrefiller(hq, hk, d, bs, dtype=bfloat16, kv_dtype=kv, gather=True,
                                 max_batch=4)
    kc, vc = cp.asarray(case["k_cache"]), cp.asarray(case["v_cache"])
    scales = {n: _dev(cp, fp8[n]) for n in ("k_scale", "v_scale") if n in fp8}
    q_buf = cp.empty(steps[0][1].shape, bfloat16)
    out = cp.empty_like(q_buf)
    lse = cp.empty(q_buf.shape[:2], np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        meta, q, want, want_lse = steps[0]
        pre.plan(*meta)
        assert pre.gathers
        q_buf.set(q)
        pre.run(q_buf, kc, vc, out=out, lse=lse, **scales)  # set up outside the capture
        out.fill(np.nan)
        lse.fill(np.nan)
        stream.begin_capture()
        pre.run(q_buf, kc, vc, out=out, lse=lse, **scales)
        graph = stream.end_capture()
        packed = pre._rows["k"].data.ptr
        meta, q, want, want_lse = steps[1]
        pre.plan(*meta)
        assert pre._rows["k"].data.ptr == packed
        q_buf.set(q)
        graph.launch()
        stream.synchronize()
    assert_close(out.get(), want, bfloat16)
    assert_lse(lse.get(), want_lse)
