"""Paged prefill by a gather: a batch's keys and values (16-bit, or fp8 codes widened
exactly) packed into rows by ``gather_kv``, which reads the lengths on the device, and the
ragged kernel run on them: PagedPrefiller(gather=...) for host and device plans, and
paged_prefill where the batch's reuse of its keys pays.

CPU: the choice (``plan.gather_rows`` counted by hand, ``gather_pays``, its bound
``gather_pays_at_bound``, ``gatherable``) and bad arguments. GPU: the runs against the float64
reference on the same cache bytes for every layout, cache format, page size, head size,
dtype, feature and scale form, outputs and LSE NaN-poisoned and every slot no sequence owns
NaN (a key read past a length fails); the functional call and device plans (lengths never
read by the host); bad lengths and block ids reported, their rows zeros; CUDA graphs
replayed after a re-plan.
"""
import numpy as np
import pytest

import cupaged
from cupaged.cache_ops import api as cache_ops_api
from cupaged.core import errors
from cupaged.core.arrays import HEAD_DIMS, CallCache, bfloat16
from cupaged.core.layouts import LAYOUTS, CacheStrides, layout_strides
from cupaged.prefill import api as prefill_api
from cupaged.prefill import plan as plan_
from cupaged.prefill.launch import GatherLaunches, gatherable
from cupaged.reference import attention as ref
from test_prefill import (FEATURES, GRAPH_KV_LENS, GRAPH_Q_LENS, KV_LENS, Q_LENS, _feature_opts,
                          assert_close, assert_lse, paged, ragged)
from test_prefill_fp8 import FORMATS, _dev, check_gpu, fp8_paged

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


@pytest.fixture
def always_gather(monkeypatch):
    """Every call and device plan that can gather does (the reuse thresholds at 0), on a
    fresh call cache."""
    monkeypatch.setattr(plan_, "GATHER_ROWS", {False: 0, True: 0})
    monkeypatch.setattr(prefill_api, "_CALLS", CallCache())


def gathered_calls():
    """The functional calls set up since ``always_gather`` that gather."""
    return [r for r in prefill_api._CALLS.values() if isinstance(r, GatherLaunches)]


def check_gather(cp, case, fp8, layout, device_scales=True, causal=True, planner=None,
                 device_meta=False, **opts):
    """PagedPrefiller(gather=True): plan the metadata (host arrays, or device arrays with
    ``device_meta``), run with poisoned out and LSE, compare with the reference on the same
    bytes."""
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
    meta = [cp.asarray(case[n]) if device_meta else case[n] for n in META]
    assert pre.plan(*meta, planner=planner) is pre
    assert pre.gathers is (None if device_meta or planner == "device" else True)
    scales = {n: (_dev(cp, a) if device_scales else a) for n, a in fp8.items() if n != "kv_dtype"}
    out = cp.asarray(np.full(q.shape, np.nan, q.dtype))
    lse = cp.asarray(np.full(q.shape[:2], np.nan, np.float32))
    got = pre.run(cp.asarray(q), cp.asarray(case["k_cache"]), cp.asarray(case["v_cache"]),
                  out=out, lse=lse, **{n: _dev(cp, a) for n, a in opts.items()}, **scales)
    assert got is out
    assert pre.gathers
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


def test_gather_pays_at_bound_of_the_shapes():
    row = 8 * 128 * 2  # Hk 8, d 128, 16-bit
    # B2 x S8K in tables 512 pages of 16 wide: the bound is the batch itself
    assert plan_.gather_pays_at_bound(16384, 2, 8192, 4, True, -1, None, row)
    assert plan_.gather_pays_at_bound(16384, 2, 8192, 4, True, -1, None, row) == \
        plan_.gather_pays([8192] * 2, [8192] * 2, 4, True, -1, None)
    # decode rows (one query a sequence) never pay, whatever the tables hold
    assert not plan_.gather_pays_at_bound(64, 64, 8192, 4, True, -1, "fp8_e4m3", row)
    # rows at the bound past GATHER_MAX_BYTES: read in place
    keys = plan_.GATHER_MAX_BYTES // (2 * row)
    assert plan_.gather_pays_at_bound(keys, 1, keys, 4, True, -1, None, row)
    assert not plan_.gather_pays_at_bound(keys + 1, 1, keys + 1, 4, True, -1, None, row)
    # more query rows than keys: each query sees at most the row's keys
    assert plan_.gather_pays_at_bound(10 ** 6, 1, 4096, 4, False, -1, None, row)
    assert not plan_.gather_pays_at_bound(0, 0, 4096, 4, True, -1, None, row)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("itemsize", [1, 2])
def test_dense_caches_are_gatherable(layout, itemsize):
    kv = "fp8_e4m3" if itemsize == 1 else None
    assert gatherable(layout_strides(layout, 16, 2, 128, itemsize), kv, itemsize, 16)
    assert gatherable(layout_strides(layout, 1, 2, 128, itemsize), kv, itemsize, 1)


def test_strides_off_the_chunks_are_read_in_place():
    s = layout_strides("NHD", 16, 2, 128, 2)
    assert not gatherable(s._replace(k_block=s.k_block + 4), None, 2, 16)
    assert not gatherable(s._replace(v_block=s.v_block + 8), "fp8_e4m3", 1, 16)
    assert gatherable(CacheStrides(*s)._replace(k_block=s.k_block + 8), None, 2, 16)
    # a token stride off the chunks counts only where a block holds more than one token
    assert not gatherable(s._replace(k_tok=s.k_tok + 4), None, 2, 16)
    assert gatherable(s._replace(k_tok=s.k_tok + 4), None, 2, 1)


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
    pre = cupaged.PagedPrefiller(8, 2, 64, 16)
    assert pre.gathers is None  # no plan yet


def test_numpy_gather_prefiller_is_the_reference(rng):
    case, fp8 = build(rng, "fp8_e4m3", d=64, block_size=4, layout="HND")
    pre = cupaged.PagedPrefiller(8, 2, 64, 4, dtype=bfloat16, layout="HND", kv_dtype="fp8_e4m3",
                                 gather=True).plan(*(case[n] for n in META))
    assert pre.gathers
    got = pre.run(case["q"], case["k_cache"], case["v_cache"], k_scale=fp8["k_scale"],
                  v_scale=fp8["v_scale"])
    np.testing.assert_array_equal(got, ref.paged_prefill(**case, layout="HND", **fp8))
    pre.plan(*(case[n] for n in META), planner="device")  # a device plan of host arrays
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


# ----------------------------------------------------------------------------- GPU: lengths on the device
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("kv", [None] + list(FORMATS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_functional_gather(cp, rng, always_gather, layout, kv, block_size):
    """paged_prefill with device metadata gathers (its lengths read by the gather kernel
    alone; the vllm value layout's dims only with gather=True, so read in place here) and
    matches the reference; NaN in every unowned slot."""
    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("the gather runs on sm_90")
    dtype = np.float16 if kv == "fp8_e5m2" else bfloat16
    case, fp8 = build(rng, kv, layout=layout, block_size=block_size, dtype=dtype)
    check_gpu(cp, case, fp8, layout)
    assert len(gathered_calls()) == (0 if layout == "vllm" and block_size > 1 else 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, bfloat16])
@pytest.mark.parametrize("head_dim, kv", [(d, None) for d in HEAD_DIMS]
                         + [(d, "fp8_e4m3") for d in plan_.FP8_HEAD_DIMS])
def test_gpu_functional_gather_head_dims(cp, rng, always_gather, head_dim, kv, dtype):
    """Every head size and dtype through the functional gather, odd lengths and an empty
    row (the ragged kernel's tile for the head size after the gather)."""
    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("the gather runs on sm_90")
    case, fp8 = build(rng, kv, [1, 63, 64, 65, 0, 200], [1, 63, 64, 1000, 7, 4097], d=head_dim,
                      dtype=dtype)
    check_gpu(cp, case, fp8, "NHD")
    assert len(gathered_calls()) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("kv", [None, "fp8_e4m3"])
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_gpu_functional_gather_features(cp, rng, always_gather, feature, kv):
    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("the gather runs on sm_90")
    opts = _feature_opts(rng, feature, 8)
    q_scale = opts.pop("q_scale", 1.0)
    case, fp8 = build(rng, kv, [1, 63, 64, 65, 0, 200], [1, 63, 64, 1000, 7, 4097])
    case["q"] = (case["q"].astype(np.float32) * q_scale).astype(bfloat16)
    check_gpu(cp, case, fp8, "NHD", **opts)
    assert len(gathered_calls()) == 1


@pytest.mark.gpu
def test_gpu_functional_gather_strict(cp, rng, always_gather):
    """Strict mode reads the metadata on the host and gathers exactly the batch's keys (a
    host work list over the packed rows): the reference, and no call cached."""
    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("the gather runs on sm_90")
    case, fp8 = build(rng, "fp8_e4m3", layout="HND")
    want, want_lse = ref.paged_prefill(**case, layout="HND", return_lse=True, **fp8)
    dev = {n: cp.asarray(a) for n, a in case.items()}
    scales = {n: _dev(cp, a) for n, a in fp8.items()}
    out, lse = cupaged.paged_prefill(**dev, layout="HND", return_lse=True, validate=True, **scales)
    assert_close(out.get(), want, bfloat16)
    assert_lse(lse.get(), want_lse)
    assert not prefill_api._CALLS


@pytest.mark.gpu
def test_gpu_functional_gather_auto(cp, rng):
    """Without the fixture: a long causal prefill gathers at its shapes' bound on sm_90, a
    batch of short rows in wide tables does not; both match the reference."""
    hopper = cp.cuda.Device().compute_capability == "90"
    long_case, _ = plain_paged(rng, [3000], [3000], hq=8, hk=1)
    short_case, _ = plain_paged(rng, [1, 2, 1, 3], [900, 700, 1200, 40], hq=8, hk=1)
    for case, gathers in ((long_case, hopper), (short_case, False)):
        prefill_api._CALLS.clear()
        check_gpu(cp, case, {}, "NHD")
        assert bool(gathered_calls()) == gathers


@pytest.mark.gpu
@pytest.mark.parametrize("kv", [None, "fp8_e4m3"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_device_plan_gather(cp, rng, layout, kv):
    """PagedPrefiller(gather=True) planned from device metadata and from host metadata with
    planner='device': the packed rows at the capacity's bound."""
    case, fp8 = build(rng, kv, layout=layout, block_size=16)
    check_gather(cp, case, fp8, layout, device_meta=True)
    check_gather(cp, case, fp8, layout, planner="device")


@pytest.mark.gpu
@pytest.mark.parametrize("bad", ["block", "length", "negative"])
def test_gpu_gather_bad_entries_give_zero_rows(cp, rng, always_gather, bad):
    """A block id outside the cache, a length past the table row, a negative length: reported
    through the error word, that sequence's rows zeros, the others the reference."""
    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("the gather runs on sm_90")
    cupaged.check_errors()
    q_lens, kv_lens = [5, 40, 9, 3], [50, 300, 33, 60]
    case, _ = plain_paged(rng, q_lens, kv_lens)
    want = np.asarray(ref.paged_prefill(**case), np.float32)
    dev = {n: cp.asarray(a) for n, a in case.items()}
    width = case["block_tables"].shape[1]
    if bad == "block":
        dev["block_tables"][1, 7] = case["k_cache"].shape[0]
        pattern = r"block_tables: expected entries in \[0, \d+\), got \d+ at index \(1, 7\)"
    elif bad == "length":
        dev["seq_lens"][1] = width * 16 + 1
        pattern = f"seq_lens: sequence 1 needs {width * 16 + 1} tokens"
    else:
        dev["seq_lens"][1] = -4
        pattern = r"seq_lens: expected entries in \[0, 2147483647\), got -4 at index 1"
    out = cp.asarray(np.full(case["q"].shape, np.nan, bfloat16))
    cupaged.paged_prefill(**dev, out=out)
    assert len(gathered_calls()) == 1
    with pytest.raises(errors.DeviceIndexError, match=pattern):
        cupaged.check_errors()
    got = out.get().astype(np.float32)
    cu = case["cu_seqlens_q"]
    assert (got[cu[1]:cu[2]] == 0).all()
    good = np.r_[cu[0]:cu[1], cu[2]:cu[4]]
    np.testing.assert_allclose(got[good], want[good], rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_device_plan_gather_graph_replays_new_lengths(cp, rng):
    """A device-planned gathering prefiller captured once replays after a re-plan of other
    lengths within its capacity: the lengths, prefix sums and tables are read on the device
    at each replay."""
    hq, hk, d, bs = 8, 2, 128, 16
    firsts = (GRAPH_Q_LENS[1], GRAPH_KV_LENS[1])
    seconds = (GRAPH_Q_LENS[0], GRAPH_KV_LENS[0])
    case, _ = build(rng, None, firsts[0] + seconds[0], firsts[1] + seconds[1])
    cu_all, bt, sl = (case[n] for n in META)
    pre = cupaged.PagedPrefiller(hq, hk, d, bs, dtype=bfloat16, gather=True, max_batch=4,
                                 max_blocks_per_seq=bt.shape[1])
    kc, vc = cp.asarray(case["k_cache"]), cp.asarray(case["v_cache"])
    total = max(int(cu_all[3]), int(cu_all[7] - cu_all[3]))
    q_buf = cp.zeros((total, hq, d), bfloat16)
    out = cp.empty_like(q_buf)
    stream = cp.cuda.Stream(non_blocking=True)
    graph = None
    with stream:
        for seqs in (slice(0, 3), slice(3, 7)):
            cu = (cu_all[seqs.start:seqs.stop + 1] - cu_all[seqs.start]).astype(np.int32)
            q = case["q"][cu_all[seqs.start]:cu_all[seqs.stop]]
            meta = (cu, bt[seqs].copy(), sl[seqs].copy())
            want = ref.paged_prefill(q, case["k_cache"], case["v_cache"], *meta)
            pre.plan(*(cp.asarray(a) for a in meta))
            q_buf.fill(0)
            q_buf[:len(q)].set(q)
            if graph is None:
                pre.run(q_buf, kc, vc, out=out)  # set up outside the capture
                assert pre.gathers
                stream.begin_capture()
                pre.run(q_buf, kc, vc, out=out)
                graph = stream.end_capture()
            out.fill(np.nan)
            graph.launch()
            stream.synchronize()
            got = out.get()
            assert_close(got[:len(q)], want, bfloat16)
            assert (got[len(q):].astype(np.float32) == 0).all()  # padding rows
