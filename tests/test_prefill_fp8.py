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
from cupaged.core.device import SM90_SMEM_PER_CTA
from cupaged.core.fp8 import FP8_FORMATS
from cupaged.core.layouts import LAYOUTS, k_as_nhd, layout_strides, v_as_nhd
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
              block_size=16, fmt="fp8_e4m3", scale="heads", fill=(NAN_CODE, NAN_CODE)):
    """A random paged batch on uint8 caches of ``fmt`` in ``layout`` (slots no sequence owns:
    the codes ``fill`` of K and V, NaN's by default), q of ``dtype``, and its fp8 arguments
    (host forms)."""
    q, k, v, cu_q, cu_k = ragged(rng, q_lens, kv_lens, hq, hk, d, np.float32)
    kc, vc, bt, sl = paged(rng, k * AMP, v * AMP, cu_k, "NHD", block_size)
    ks, vs = scales(rng, scale, hk)
    k8 = quantize(kc, ks, fmt, head_axis=2, name="k_scale")
    v8 = quantize(vc, vs, fmt, head_axis=2, name="v_scale")
    owned = np.zeros(kc.shape[:2], bool)
    for b, n in enumerate(sl):
        t = np.arange(n)
        owned[bt[b, t // block_size], t % block_size] = True
    k8[~owned], v8[~owned] = fill
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


# ----------------------------------------------------------------------------- fp8 TMA tile
# plan.tma_tile(d, kv=fmt): opt-in, run here as an explicit tile (no default takes it)
TMA_FMT = ("fp8_e4m3", "fp8_e5m2")
TMA_NAN = (0x7F, 0xFF)  # K and V codes past every sequence: +NaN and -NaN in both formats


def _cache_geometry(case, layout, fmt):
    from cupaged.prefill.api import _check_caches
    return _check_caches(case["k_cache"], case["v_cache"], layout, np, fmt)[0]


def test_fp8_tma_tile_is_opt_in_and_fits():
    """The fp8 TMA tile: two stages, FP8_TMA_SLOTS staging slots, its shared memory (Q,
    tiles, slots of codes, barriers, alignment) within the limit at both head sizes; no
    default (fp8 or 16-bit) is it, and the gate compiles it for both formats."""
    from cupaged.prefill.launch import _expr_wgmma, kernel_specializations
    exprs = {s.expr for s in kernel_specializations() if s.hopper}
    geo = plan_.TmaGeometry(layout_strides("NHD", 16, 2, 128, 1), block_size=16, num_blocks=64)
    for d in plan_.TMA_HEAD_DIMS:
        tile = plan_.tma_tile(d, kv="fp8_e4m3")
        assert tile == plan_.tma_tile(d, kv="fp8_e5m2")
        assert (tile.ws, tile.tma, tile.stages, tile.slots) == (True, True, plan_.FP8_TMA_STAGES,
                                                                plan_.FP8_TMA_SLOTS)
        assert tile.block_m == plan_.default_tile(d).block_m  # one work list
        want = (2 * (128 * d + 2 * 2 * 128 * d) + plan_.FP8_TMA_SLOTS * 128 * d
                + 8 * (1 + 4 * 2 + 2 * plan_.FP8_TMA_SLOTS) + 1024)
        assert plan_.wgmma_smem_bytes(d, tile, "fp8_e4m3") == want <= SM90_SMEM_PER_CTA
        assert plan_.tma_tile(d).slots == 0
        for kv in FORMATS:
            assert plan_.wgmma_tile(d, kv, geometry=geo) != tile
            for general in (False, True):
                assert _expr_wgmma(bfloat16, d, tile, False, general, kv) in exprs
    assert plan_.wgmma_smem_bytes(128, plan_.tma_tile(128, kv="fp8_e4m3"), "fp8_e4m3") == 230536
    assert (_expr_wgmma(np.float16, 64, plan_.tma_tile(64, kv="fp8_e5m2"), False, True, "fp8_e5m2")
            == "cupaged::prefill_ws_tma_kernel<__half, cupaged::fp8_e5m2, 64, 128, 2, true, 72, 4>")


def _tma_geo(layout, block_size, d=128):
    return plan_.TmaGeometry(layout_strides(layout, block_size, 2, d, 1), block_size=block_size,
                             num_blocks=50)


@pytest.mark.parametrize("tile, head_dim, kv, geometry, match", [
    (plan_.tma_tile(128), 128, "fp8_e4m3", _tma_geo("NHD", 16),
     r"expects slots > 0 .*; got kv fp8_e4m3, slots 0"),
    (plan_.tma_tile(128, kv="fp8_e4m3"), 128, None, _tma_geo("NHD", 16),
     r"expects slots 0 \(16-bit K/V\); got kv None, slots 4"),
    (plan_.tma_tile(128, 3, kv="fp8_e4m3"), 128, "fp8_e4m3", _tma_geo("NHD", 16),
     r"expected at most 232448 bytes of shared memory, got 296104 \(head_dim 128, stages 3"),
    (plan_.tma_tile(128, kv="fp8_e5m2"), 128, "fp8_e5m2", _tma_geo("vllm", 16),
     "contiguous dims.*got kv fp8_e5m2"),
    (plan_.tma_tile(128, kv="fp8_e4m3"), 128, "fp8_e4m3", _tma_geo("HND", 24),
     "block sizes of whole 8 keys"),
    (plan_.tma_tile(128, kv="fp8_e4m3"), 96, "fp8_e4m3", _tma_geo("NHD", 16, 96),
     r"head_dim \(64, 128\), got 96"),
])
def test_fp8_tma_tile_refuses_calls_it_cannot_run(tile, head_dim, kv, geometry, match):
    with pytest.raises(ValueError, match=match):
        plan_.check_tma(tile, head_dim, kv, geometry)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("block_size", [8, 16, 128, 256])
def test_fp8_tma_tile_fits_nhd_and_hnd_caches(layout, block_size):
    plan_.check_tma(plan_.tma_tile(64, kv="fp8_e5m2"), 64, "fp8_e5m2", _tma_geo(layout, block_size, 64))
    assert plan_.tma_fits(128, "fp8_e4m3", _tma_geo(layout, block_size))
    odd = _tma_geo(layout, block_size)
    odd = odd._replace(strides=odd.strides._replace(k_block=odd.strides.k_block + 8))
    assert not plan_.tma_fits(128, "fp8_e4m3", odd)  # a block stride of 8 bytes


def test_fp8_tma_tile_refuses_unknown_formats():
    with pytest.raises(ValueError, match="kv: expected one of"):
        plan_.tma_tile(128, kv="fp8")


@pytest.mark.parametrize("layout, block_size", [("NHD", 16), ("HND", 128), ("NHD", 256)])
def test_fp8_tma_maps_box_rows_of_codes(layout, block_size):
    """An fp8 cache's maps: the (dim, key in block, head, block) dims of the codes, byte
    strides equal to element strides, boxes of whole rows (D bytes) x a block's part of the
    tile, UINT8 and unswizzled (the staging slots are widened, not read by wgmma)."""
    from cupaged.core import tma
    strides = layout_strides(layout, block_size, 4, 128, 1)
    maps = tma.KVMaps(4, 128, strides, 128, block_size=block_size, num_blocks=30, itemsize=1)
    for geo, tok, head, blk in zip(maps._geo, (strides.k_tok, strides.v_tok),
                                   (strides.k_head, strides.v_head), (strides.k_block, strides.v_block)):
        assert geo.dims == (128, block_size, 4, 30)
        assert geo.strides == (tok, head, blk)
        assert geo.box == (128, min(block_size, 128), 1, 1)
        assert (geo.dtype, geo.swizzle) == (tma._UINT8, tma._SWIZZLE_NONE)
    with pytest.raises(ValueError, match="contiguous"):  # 16-bit strides given as codes
        tma.KVMaps(4, 128, layout_strides(layout, block_size, 4, 128, 2), 128,
                   block_size=block_size, num_blocks=30, itemsize=1)
    with pytest.raises(ValueError, match="itemsize 4"):
        tma.kv_geometry(128, 4, 512, 128, 512 * 16, 16, 30, 16, itemsize=4)


class _Kernel:
    """A launcher's stand-in: what ``Launches`` asked for."""

    def __init__(self, stem, expr, record, **kw):
        self.stem, self.expr, self.record, self.kw = stem, expr, record, kw

    def at(self, grid, threads, smem):
        self.grid, self.threads, self.smem = grid, threads, smem
        return self


def test_fp8_tma_launch_record(monkeypatch, rng):
    """Launches of the explicit fp8 TMA tile on an HND cache, set up on the host: its
    kernel, 384 threads, the plan's shared memory, the PREFILL_TMA record with the scales'
    fields, and 1-byte maps over the cache; a vllm cache is refused before any launch."""
    from cupaged.core import abi, tma
    from cupaged.core.checks import check_options
    from cupaged.core.fp8 import fp8_format, kernel_scales
    from cupaged.core.layouts import cache_strides
    from cupaged.prefill import launch
    monkeypatch.setattr(launch, "launcher", _Kernel)
    monkeypatch.setattr(launch, "ptr", lambda a: 0 if a is None else id(a))
    case, fp8 = fp8_paged(rng, [5, 70], [9, 300], layout="HND", fmt="fp8_e5m2", scale="float")
    geo = _cache_geometry(case, "HND", "fp8_e5m2")
    tile = plan_.tma_tile(128, kv="fp8_e5m2")
    opts = check_options(np, 8, 128)
    scales = kernel_scales(fp8_format("fp8_e5m2"), 0.05, 0.04, 2, False)
    work = np.zeros((4, 4), np.int32)
    strides = cache_strides(case["k_cache"], case["v_cache"], "HND", geo)
    run = launch.Launches(case["q"], 2, case["block_tables"], geo.block_size, geo.num_blocks, 0,
                          2, strides, opts, True, False, "wgmma", tile=tile, work=work,
                          kv="fp8_e5m2", scales=scales)
    assert run.kernel.expr == ("cupaged::prefill_ws_tma_kernel<__nv_bfloat16, cupaged::fp8_e5m2, "
                               "128, 128, 2, false, 72, 4>")
    assert run.kernel.record is abi.PREFILL_TMA and run.kernel.kw["hopper"]
    assert (run.go.grid, run.go.threads, run.threads) == (4, plan_.WS_THREADS, plan_.WS_THREADS)
    assert run.go.smem == run.smem == plan_.wgmma_smem_bytes(128, tile, "fp8_e5m2")
    k_geo = run._maps._geo[0]
    assert k_geo.box == (128, 16, 1, 1) and k_geo.dtype == tma._UINT8
    assert k_geo.strides == (strides.k_tok, strides.k_head, strides.k_block)
    case_v, _ = fp8_paged(rng, [5], [9], layout="vllm", fmt="fp8_e5m2")
    geo_v = _cache_geometry(case_v, "vllm", "fp8_e5m2")
    with pytest.raises(ValueError, match="contiguous dims"):
        launch.Launches(case_v["q"], 1, case_v["block_tables"], 16, geo_v.num_blocks, 0, 2,
                        cache_strides(case_v["k_cache"], case_v["v_cache"], "vllm", geo_v), opts,
                        True, True, "wgmma", tile=tile, work=work, kv="fp8_e5m2", scales=scales)


def check_gpu_tma(cp, case, fp8, layout, causal=True, **opts):
    """The fp8 TMA tile (explicit, a host work list) on the device, out and LSE
    NaN-poisoned, against the reference on the same bytes; scales as device arrays."""
    from cupaged.core.checks import check_options
    from cupaged.core.fp8 import fp8_format, kernel_scales
    from cupaged.core.layouts import cache_strides
    from cupaged.prefill import launch
    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("the TMA producer needs an sm_90 device")
    q, hq, d, fmt = case["q"], case["q"].shape[1], case["q"].shape[2], fp8["kv_dtype"]
    geo = _cache_geometry(case, layout, fmt)
    tile = plan_.tma_tile(d, kv=fmt)
    want, want_lse = ref.paged_prefill(**case, layout=layout, return_lse=True, causal=causal,
                                       **fp8, **opts)
    ho = check_options(np, hq, d, **opts)
    work = launch.host_work(np.diff(case["cu_seqlens_q"]), case["seq_lens"], q.dtype, hq,
                            geo.num_kv_heads, d, False, causal, ho, tile, "wgmma", fmt)
    dev = {n: cp.asarray(a) for n, a in case.items()}
    ks, vs = (cp.asarray(np.asarray(fp8[n], np.float32)) for n in ("k_scale", "v_scale"))
    dopts = ho._replace(sinks=_dev(cp, ho.sinks), alibi_slopes=_dev(cp, ho.alibi_slopes))
    run = launch.Launches(dev["q"], len(case["seq_lens"]), dev["block_tables"], geo.block_size,
                          geo.num_blocks, 0, geo.num_kv_heads,
                          cache_strides(dev["k_cache"], dev["v_cache"], layout, geo), dopts,
                          causal, False, "wgmma", tile=tile, work=cp.asarray(work), kv=fmt,
                          scales=kernel_scales(fp8_format(fmt), ks, vs, geo.num_kv_heads, False))
    assert run.tile == tile
    out = cp.asarray(np.full(q.shape, np.nan, q.dtype))
    lse = cp.full(q.shape[:2], np.nan, np.float32)
    run(*launch.addresses(dev["q"], dev["k_cache"], dev["v_cache"], out, lse,
                          dev["cu_seqlens_q"], dev["seq_lens"], dev["block_tables"],
                          dopts.alibi_slopes, dopts.sinks),
        cp.cuda.get_current_stream().ptr, *launch.addresses(ks, vs))
    assert_close(out.get(), want, q.dtype)
    assert_lse(lse.get(), want_lse)


# odd lengths around the 128-key tiles, q_len < kv_len, an empty sequence, many tiles
TMA_Q, TMA_KV = [1, 63, 64, 65, 0, 300, 1000], [1, 63, 130, 65, 40, 1000, 1000]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", plan_.TMA_HEAD_DIMS)
@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("scale", ["tensor", "heads"])
@pytest.mark.parametrize("fmt", TMA_FMT)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_gpu_fp8_tma_layouts(cp, rng, layout, fmt, scale, block_size, head_dim, causal):
    """Both formats and scale shapes, NHD and HND, page sizes below and at the tile; the
    slots past every sequence's keys hold NaN codes (+ for K, - for V), which the widening
    must turn to zeros."""
    dtype = bfloat16 if fmt == "fp8_e4m3" else np.float16
    case, fp8 = fp8_paged(rng, TMA_Q, TMA_KV, d=head_dim, dtype=dtype, layout=layout,
                          block_size=block_size, fmt=fmt, scale=scale, fill=TMA_NAN)
    check_gpu_tma(cp, case, fp8, layout, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("feature", ["plain"] + sorted(FEATURES))
@pytest.mark.parametrize("head_dim", plan_.TMA_HEAD_DIMS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_gpu_fp8_tma_features(cp, rng, layout, head_dim, feature, heads):
    """Every score option (window, sinks, soft-cap and ALiBi on the general path, any
    sm_scale), GQA 4 and none, through the fp8 TMA tile."""
    hq, hk = heads
    opts, q_scale = _options(rng, hq, feature)
    causal = opts.pop("causal", True)
    case, fp8 = fp8_paged(rng, TMA_Q, TMA_KV, hq=hq, hk=hk, d=head_dim, layout=layout,
                          fmt="fp8_e4m3", scale="heads", fill=TMA_NAN)
    case["q"] = (case["q"].astype(np.float32) * q_scale).astype(bfloat16)
    check_gpu_tma(cp, case, fp8, layout, causal=causal, **opts)
