"""Paged prefill from fp8 caches: host checks on the CPU; both kernels against the float64
reference on the same quantised cache on the GPU.

The cache is quantised once (``reference.fp8.quantize``) and both sides read the same bytes:
the reference dequantises them in float64, the kernels widen them to 16 bits and scale in
fp32, so the tolerances are the 16-bit ones of test_prefill. Every slot no sequence owns
holds the code of NaN, so a kernel reading a key past a sequence's length fails; outputs
are NaN-poisoned, so an element a kernel does not write fails too.
"""
import numpy as np
import pytest

import cupaged
from cupaged.core.arrays import bfloat16
from cupaged.core.fp8 import FP8_FORMATS
from cupaged.core.layouts import LAYOUTS, k_as_nhd, v_as_nhd
from cupaged.prefill import plan as plan_
from cupaged.reference import attention as ref
from cupaged.reference.fp8 import dequantize, quantize
from test_decode import from_nhd
from test_prefill import FEATURES, Q_LENS, KV_LENS, _rand, assert_close, assert_lse, paged, ragged

FORMATS = ("fp8_e4m3", "fp8_e5m2")
BACKENDS = ("mma", "wgmma")
AMP = 3.0       # key and value magnitudes, well inside e4m3's range at the scales below
NAN_CODE = 0x7F  # NaN in both formats


# ----------------------------------------------------------------------------- builders
def scales(rng, form, hk):
    """(k_scale, v_scale) host forms: a float, float32 [] (per tensor) or [hk] (per head)."""
    if form == "float":
        return 0.05, 0.04
    if form == "tensor":
        return np.array(0.05, np.float32), np.array(0.03, np.float32)
    return (rng.uniform(0.02, 0.1, hk).astype(np.float32),
            rng.uniform(0.02, 0.1, hk).astype(np.float32))


def fp8_paged(rng, q_lens, kv_lens, *, hq=8, hk=2, d=128, dtype=bfloat16, layout="NHD",
              block_size=16, fmt="fp8_e4m3", scale="heads"):
    """A random paged batch on uint8 caches of ``fmt`` in ``layout`` (slots no sequence owns:
    NaN codes), q of ``dtype``, and its fp8 arguments (host forms)."""
    q, k, v, cu_q, cu_k = ragged(rng, q_lens, kv_lens, hq, hk, d, np.float32)
    kc, vc, bt, sl = paged(rng, k * AMP, v * AMP, cu_k, "NHD", block_size)
    ks, vs = scales(rng, scale, hk)
    k8 = quantize(kc, ks, fmt, head_axis=2, name="k_scale")
    v8 = quantize(vc, vs, fmt, head_axis=2, name="v_scale")
    owned = np.zeros(kc.shape[:2], bool)
    for b, n in enumerate(sl):
        t = np.arange(n)
        owned[bt[b, t // block_size], t % block_size] = True
    k8[~owned], v8[~owned] = NAN_CODE, NAN_CODE
    k8, v8 = from_nhd(k8, v8, layout)
    case = dict(q=q.astype(dtype), k_cache=k8, v_cache=v8, cu_seqlens_q=cu_q,
                block_tables=bt, seq_lens=sl)
    return case, dict(kv_dtype=fmt, k_scale=ks, v_scale=vs)


def _dev(cp, x):
    return cp.asarray(x) if isinstance(x, np.ndarray) else x


def _options(rng, hq, feature):
    """The reference options of a FEATURES entry (slopes and sinks drawn here) and q's scale."""
    opts = dict(FEATURES[feature]) if feature != "plain" else {}
    q_scale = opts.pop("q_scale", 1.0)
    if opts.get("alibi_slopes") == "slopes":
        opts["alibi_slopes"] = _rand(rng, hq, np.float32, 0.1)
    if opts.get("sinks") == "sinks":
        opts["sinks"] = _rand(rng, hq, np.float32)
    return opts, q_scale


def check_gpu(cp, case, fp8, layout, op="paged_prefill", backend="auto", device_scales=True,
              **opts):
    """``op`` on the device (NaN-poisoned out) against the reference on the same bytes."""
    want, want_lse = ref.paged_prefill(**case, layout=layout, return_lse=True, **fp8, **opts)
    dev = {n: cp.asarray(a) for n, a in case.items()}
    out = cp.asarray(np.full(case["q"].shape, np.nan, case["q"].dtype))
    args = {n: _dev(cp, a) for n, a in opts.items()}
    args.update(fp8 if not device_scales else {n: _dev(cp, a) for n, a in fp8.items()})
    got, lse = getattr(cupaged, op)(**dev, layout=layout, out=out, return_lse=True,
                                    backend=backend, **args)
    assert got is out
    assert_close(got.get(), want, case["q"].dtype)
    assert_lse(lse.get(), want_lse)


@pytest.fixture
def wgmma_ok(cp, request):
    """Skips the wgmma backend off sm_90."""
    if request.node.callspec.params.get("backend") == "wgmma" and \
            cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma kernel needs an sm_90 device")


# ----------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_numpy_fp8_prefill_is_attention_over_dequantised_cache(rng, layout, fmt):
    case, fp8 = fp8_paged(rng, [3, 1, 6], [9, 4, 6], d=64, block_size=4, layout=layout, fmt=fmt)
    got, lse = cupaged.paged_prefill(**case, layout=layout, return_lse=True, **fp8)
    k = dequantize(case["k_cache"], fp8["k_scale"], fmt, head_axis=2 if layout == "NHD" else 1)
    v = dequantize(case["v_cache"], fp8["v_scale"], fmt, head_axis=2 if layout == "NHD" else 1)
    cu = case["cu_seqlens_q"]
    k = np.ascontiguousarray(k_as_nhd(k, layout), np.float32)  # the widest cache dtype
    v = np.ascontiguousarray(v_as_nhd(v, layout), np.float32)
    want, want_lse = ref.paged_prefill(case["q"].astype(np.float32), k, v, cu,
                                       case["block_tables"], case["seq_lens"], return_lse=True)
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5)
    same = cupaged.paged_attention(**case, layout=layout, **fp8)
    np.testing.assert_array_equal(same, got)


def test_numpy_fp8_prefiller_and_cache_view(rng):
    case, fp8 = fp8_paged(rng, [1, 5], [7, 5], d=64, block_size=4, layout="HND",
                          fmt="fp8_e5m2", scale="tensor")
    want = cupaged.paged_prefill(**case, layout="HND", **fp8)
    view = cupaged.CacheView(case["k_cache"], case["v_cache"], layout="HND", **fp8)
    got = cupaged.paged_prefill(case["q"], view, case["cu_seqlens_q"], case["block_tables"],
                                case["seq_lens"])
    np.testing.assert_array_equal(got, want)
    pre = cupaged.PagedPrefiller(8, 2, 64, 4, dtype=bfloat16, layout="HND", kv_dtype="fp8_e5m2")
    pre.plan(case["cu_seqlens_q"], case["block_tables"], case["seq_lens"])
    np.testing.assert_array_equal(pre.run(case["q"], view), want)
    np.testing.assert_array_equal(
        pre.run(case["q"], case["k_cache"], case["v_cache"], k_scale=fp8["k_scale"],
                v_scale=fp8["v_scale"]), want)


def _bad(rng):
    case, fp8 = fp8_paged(rng, [2, 3], [4, 3], d=64, block_size=4)
    return case, fp8


@pytest.mark.parametrize("change, exc, match", [
    (dict(kv_dtype="fp8"), ValueError, "kv_dtype"),
    (dict(kv_dtype=None), ValueError, "kv_dtype: expected one of"),
    (dict(k_scale=np.ones(3, np.float32)), ValueError, r"k_scale: expected shape \[\], \[1\] or \[2\]"),
    (dict(v_scale=np.ones(2, np.float64)), TypeError, "v_scale: expected dtype float32"),
    (dict(k_scale=-1.0), ValueError, "k_scale: expected finite positive"),
    (dict(v_scale="x"), TypeError, "v_scale"),
])
def test_fp8_bad_arguments(rng, change, exc, match):
    case, fp8 = _bad(rng)
    with pytest.raises(exc, match=match):
        cupaged.paged_prefill(**case, layout="NHD", **{**fp8, **change})


def test_fp8_bad_caches(rng):
    case, fp8 = _bad(rng)
    plain = {**case, "k_cache": case["k_cache"].astype(np.float16),
             "v_cache": case["v_cache"].astype(np.float16)}
    with pytest.raises(ValueError, match="k_scale: expected None"):
        cupaged.paged_prefill(**{**plain, "q": plain["q"].astype(np.float16)}, layout="NHD",
                              k_scale=1.0)
    with pytest.raises(TypeError, match="k_cache: expected dtype uint8 or float8_e4m3fn"):
        cupaged.paged_prefill(**plain, layout="NHD", **fp8)
    pre = cupaged.PagedPrefiller(8, 2, 64, 4, dtype=bfloat16, layout="NHD")  # no kv_dtype
    pre.plan(case["cu_seqlens_q"], case["block_tables"], case["seq_lens"])
    view = cupaged.CacheView(case["k_cache"], case["v_cache"], **fp8)
    with pytest.raises(ValueError, match="kv_dtype: expected a cache of the PagedPrefiller's"):
        pre.run(case["q"], view)
    f8 = case["k_cache"].view(FP8_FORMATS["fp8_e4m3"].dtype)
    with pytest.raises(ValueError, match="build the PagedPrefiller with kv_dtype='fp8_e4m3'"):
        pre.run(case["q"], f8, case["v_cache"].view(f8.dtype))
    with pytest.raises(ValueError, match="kv_dtype"):
        cupaged.PagedPrefiller(8, 2, 64, 4, kv_dtype="e4m3")


def test_fp8_specializations_cover_the_launches():
    """Every fp8 launch (each backend, head size, V layout, score path) is in the gate."""
    from cupaged.prefill.launch import _expr, _expr_wgmma, kernel_specializations
    exprs = {s.expr for s in kernel_specializations()}
    for kv in FORMATS:
        for d in plan_.FP8_HEAD_DIMS:
            for vt in (False, True):
                assert _expr(np.float16, d, vt, plan_.default_tile(d, vt), kv) in exprs
                for general in (False, True):
                    assert _expr_wgmma(bfloat16, d, plan_.wgmma_tile(d, kv, vt), vt, general, kv) in exprs
    assert plan_.fp8_staging_bytes(128, 128, 256) == 2 * 128 * 128
    assert plan_.fp8_staging_bytes(128, 32, 128) == 2 * 32 * 128


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", plan_.FP8_HEAD_DIMS)
@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("scale", ["tensor", "heads"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_fp8_layouts(cp, wgmma_ok, rng, backend, layout, fmt, scale, block_size, head_dim):
    dtype = bfloat16 if fmt == "fp8_e4m3" else np.float16
    case, fp8 = fp8_paged(rng, Q_LENS, KV_LENS, d=head_dim, dtype=dtype, layout=layout,
                          block_size=block_size, fmt=fmt, scale=scale)
    check_gpu(cp, case, fp8, layout, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("feature", ["plain"] + sorted(FEATURES))
@pytest.mark.parametrize("layout", ["NHD", "vllm"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_fp8_features(cp, wgmma_ok, rng, backend, layout, feature):
    opts, q_scale = _options(rng, 8, feature)
    case, fp8 = fp8_paged(rng, Q_LENS, KV_LENS, layout=layout, fmt="fp8_e4m3", scale="heads")
    case["q"] = (case["q"].astype(np.float32) * q_scale).astype(bfloat16)
    check_gpu(cp, case, fp8, layout, backend=backend, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_fp8_dtypes_host_scales(cp, wgmma_ok, rng, backend, fmt, dtype):
    """Both q dtypes with each format, scales given as host floats."""
    case, fp8 = fp8_paged(rng, [5, 64, 129], [70, 64, 300], d=64, dtype=dtype, fmt=fmt,
                          scale="float", block_size=16)
    check_gpu(cp, case, fp8, "NHD", backend=backend, device_scales=False, window_left=90)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_fp8_mixed_batch(cp, wgmma_ok, rng, backend, layout):
    """paged_attention over decode rows and prefill rows of one fp8 cache."""
    case, fp8 = fp8_paged(rng, [1, 90, 1, 1, 33], [700, 90, 1, 129, 200], layout=layout,
                          fmt="fp8_e5m2", scale="tensor")
    check_gpu(cp, case, fp8, layout, op="paged_attention", backend=backend,
              sinks=_rand(rng, 8, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "mma"])
def test_gpu_fp8_hot_path_follows_scale_values(cp, rng, backend):
    """A second call of one signature (the hot path) reads its own scale arrays and caches;
    new values in the same scale array are read at the next call (no host copy)."""
    case, fp8 = fp8_paged(rng, Q_LENS, KV_LENS, fmt="fp8_e4m3", scale="heads")
    dev = {n: cp.asarray(a) for n, a in case.items()}
    ks, vs = cp.asarray(fp8["k_scale"]), cp.asarray(fp8["v_scale"])
    for step in range(3):
        want = ref.paged_prefill(**case, kv_dtype="fp8_e4m3", k_scale=ks.get(), v_scale=vs.get())
        got = cupaged.paged_prefill(**dev, kv_dtype="fp8_e4m3", k_scale=ks, v_scale=vs,
                                    backend=backend)
        assert_close(got.get(), want, bfloat16)
        ks *= 1.5
        vs[...] = cp.asarray(rng.uniform(0.02, 0.1, 2).astype(np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("scale", ["tensor", "heads", "float"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_fp8_prefiller(cp, rng, layout, scale):
    """PagedPrefiller with kv_dtype: one plan, layers with their own caches and scales, a
    CacheView bringing them, and a re-plan."""
    pre = cupaged.PagedPrefiller(8, 2, 128, 16, dtype=bfloat16, layout=layout,
                                 kv_dtype="fp8_e4m3", window_left=150)
    for q_lens, kv_lens in [([1, 300, 1, 17], [1000, 300, 5, 40]), ([64, 1, 2], [64, 2048, 2])]:
        case, fp8 = fp8_paged(rng, q_lens, kv_lens, layout=layout, scale=scale)
        pre.plan(*(cp.asarray(case[n]) for n in ("cu_seqlens_q", "block_tables", "seq_lens")))
        for layer in range(2):  # a second layer: new q, other scales over the same bytes
            if layer:
                case["q"] = _rand(rng, case["q"].shape, bfloat16)
                fp8["k_scale"], fp8["v_scale"] = (
                    x * 2 if scale == "float" else np.asarray(x * 2, np.float32)
                    for x in (fp8["k_scale"], fp8["v_scale"]))
            want = ref.paged_prefill(**case, layout=layout, window_left=150, **fp8)
            ks, vs = _dev(cp, fp8["k_scale"]), _dev(cp, fp8["v_scale"])
            q, kc, vc = (cp.asarray(case[n]) for n in ("q", "k_cache", "v_cache"))
            out = cp.asarray(np.full(q.shape, np.nan, q.dtype))
            got = pre.run(q, kc, vc, k_scale=ks, v_scale=vs, out=out)
            assert_close(got.get(), want, bfloat16)
            view = cupaged.CacheView(kc, vc, layout=layout, kv_dtype="fp8_e4m3", k_scale=ks,
                                     v_scale=vs)
            assert_close(pre.run(q, view).get(), want, bfloat16)


@pytest.mark.gpu
def test_gpu_fp8_paged_kv_cache(cp, rng):
    """A PagedKVCache of fp8 written by write_kv_cache (the kernels' quantiser) and read by
    paged_prefill equals the reference on the same bytes."""
    hk, d, bs = 2, 128, 16
    q, k, v, cu_q, cu_k = ragged(rng, [40, 7], [100, 7], 8, hk, d, bfloat16)
    ks = cp.asarray(rng.uniform(0.01, 0.05, hk).astype(np.float32))
    cache = cupaged.PagedKVCache(16, bs, hk, d, dtype=bfloat16, layout="vllm", xp=cp,
                                 kv_dtype="fp8_e5m2", k_scale=ks, v_scale=0.02)
    bt = np.array([[3, 1, 7, 9, 0, 2, 4], [5, -1, -1, -1, -1, -1, -1]], np.int32)
    sl = np.diff(cu_k).astype(np.int32)
    slots = np.concatenate([bt[b, np.arange(n) // bs].astype(np.int64) * bs + np.arange(n) % bs
                            for b, n in enumerate(sl)])
    cupaged.write_kv_cache(cp.asarray(k), cp.asarray(v), cache, cp.asarray(slots))
    got = cupaged.paged_prefill(cp.asarray(q), cache, cp.asarray(cu_q), cp.asarray(bt),
                                cp.asarray(sl))
    want = ref.paged_prefill(q, cache.k.get(), cache.v.get(), cu_q, bt, sl, layout="vllm",
                             kv_dtype="fp8_e5m2", k_scale=ks.get(), v_scale=0.02)
    assert_close(got.get(), want, bfloat16)


@pytest.mark.gpu
def test_gpu_fp8_torch_float8(rng):
    """torch float8 caches go in by DLPack, their format taken from the tensor."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn") or not torch.cuda.is_available():
        pytest.skip("torch without float8 or CUDA")
    case, fp8 = fp8_paged(rng, Q_LENS, KV_LENS, fmt="fp8_e4m3", scale="heads")
    want = ref.paged_prefill(**case, **fp8)
    t = {n: torch.from_numpy(np.ascontiguousarray(a)).cuda() for n, a in case.items()
         if n != "q"}
    q = torch.from_numpy(case["q"].astype(np.float32)).cuda().to(torch.bfloat16)
    k8, v8 = (t[n].view(torch.float8_e4m3fn) for n in ("k_cache", "v_cache"))
    got = cupaged.paged_prefill(q, k8, v8, t["cu_seqlens_q"], t["block_tables"], t["seq_lens"],
                                k_scale=torch.from_numpy(fp8["k_scale"]).cuda(),
                                v_scale=torch.from_numpy(fp8["v_scale"]).cuda())
    assert isinstance(got, torch.Tensor)
    assert_close(got.float().cpu().numpy(), want, bfloat16)
