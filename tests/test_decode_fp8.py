"""Paged decode on fp8 caches: host checks on the CPU; kernels vs the float64 reference on the
same quantised cache on the GPU.

The cache is quantised once (``reference.fp8.quantize``) and both sides read the same bytes:
the reference dequantises them in float64, the kernels convert them to float16 (bf16 q
scaled into float16's range) and scale in fp32, so the tolerances are the 16-bit ones of
test_decode. Every slot no sequence may read holds the code of NaN (the decode kernels read
it back as NaN), so a kernel reading an invisible token fails; outputs are NaN-poisoned.
"""
import numpy as np
import pytest

import cupaged
from cupaged.core.arrays import bfloat16
from cupaged.core.layouts import cache_shapes, k_as_nhd, v_as_nhd
from cupaged.decode import plan as dp
from cupaged.reference import attention as ref
from cupaged.reference.fp8 import quantize
from test_decode import assert_matches, features, from_nhd, make_case, mixed_lengths

FORMATS = ("fp8_e4m3", "fp8_e5m2")
AMP = 3.0  # key and value magnitudes: codes well inside e4m3's range at the scales below


# ----------------------------------------------------------------------------- builders
def scales(rng, form, hk):
    """(k_scale, v_scale) host forms: a float, float32 [] or [1] (per tensor), [hk]."""
    if form == "float":
        return 0.05, 0.04
    if form == "tensor0d":
        return np.float32(0.05) * np.ones((), np.float32), np.array(0.03, np.float32)
    if form == "tensor1":
        return np.array([0.06], np.float32), np.array([0.05], np.float32)
    return (rng.uniform(0.02, 0.1, hk).astype(np.float32),
            rng.uniform(0.02, 0.1, hk).astype(np.float32))


def fp8_case(rng, *, lens, hq=8, hk=2, d=128, bs=16, layout="NHD", dtype=bfloat16,
             fmt="fp8_e4m3", scale="heads", append=False):
    """A random paged batch on uint8 caches of ``fmt`` in ``layout`` (unread slots: NaN
    codes), q / k_new / v_new of ``dtype``, and its scales (host forms)."""
    base = make_case(rng, lens=lens, hq=hq, hk=hk, d=d, bs=bs, layout="NHD",
                     dtype=np.float32, append=append)
    ks, vs = scales(rng, scale, hk)
    k8 = quantize(base["k_cache"] * AMP, ks, fmt, head_axis=2, name="k_scale")
    v8 = quantize(base["v_cache"] * AMP, vs, fmt, head_axis=2, name="v_scale")
    k8, v8 = from_nhd(k8, v8, layout)
    case = dict(q=base["q"].astype(dtype), k_cache=k8, v_cache=v8,
                block_tables=base["block_tables"], seq_lens=base["seq_lens"],
                k_new=None if not append else (base["k_new"] * AMP).astype(dtype),
                v_new=None if not append else (base["v_new"] * AMP).astype(dtype))
    return case, dict(kv_dtype=fmt, k_scale=ks, v_scale=vs)


def fp8_oracle(case, layout, fp8, **opts):
    """Reference ``(out, lse)`` and the caches after its append (copies)."""
    k, v = case["k_cache"].copy(), case["v_cache"].copy()
    out, lse = ref.paged_decode(case["q"], k, v, case["block_tables"], case["seq_lens"],
                                k_new=case["k_new"], v_new=case["v_new"], layout=layout,
                                return_lse=True, **fp8, **opts)
    return out, lse, k, v


def on_device(cp, value):
    return cp.asarray(value) if isinstance(value, np.ndarray) else value


def check_fp8(cp, case, layout, fp8, opts, **kw):
    """paged_decode on the device (NaN-poisoned out) against the reference; the appended
    codes bit for bit."""
    want, want_lse, k_after, v_after = fp8_oracle(case, layout, fp8, **opts)
    dev = {n: (None if a is None else cp.asarray(a)) for n, a in case.items()}
    out = cp.full(case["q"].shape, np.nan, case["q"].dtype)
    got, lse = cupaged.paged_decode(**dev, layout=layout, out=out, return_lse=True,
                                    **{n: on_device(cp, a) for n, a in {**fp8, **opts}.items()},
                                    **kw)
    assert got is out
    assert_matches(got.get(), lse.get(), want, want_lse, case["q"].dtype)
    if case["k_new"] is not None:
        np.testing.assert_array_equal(dev["k_cache"].get(), k_after)
        np.testing.assert_array_equal(dev["v_cache"].get(), v_after)


def pages_or_skip(cp, backend):
    if backend == "pages" and int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("cp.async.bulk needs sm_90")


# ----------------------------------------------------------------------------- CPU: host checks
def _numpy_case(rng, fmt="fp8_e4m3", **kw):
    case, fp8 = fp8_case(rng, lens=[5, 20], hq=4, hk=2, d=64, fmt=fmt, dtype=np.float16, **kw)
    return case, fp8


def test_numpy_path_is_the_reference(rng):
    case, fp8 = _numpy_case(rng, append=True, scale="float")
    want, want_lse, k_after, _ = fp8_oracle(case, "NHD", fp8)
    got, lse = cupaged.paged_decode(**case, **fp8, return_lse=True)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(lse, want_lse)
    np.testing.assert_array_equal(case["k_cache"], k_after)


def test_numpy_float8_caches_need_no_kv_dtype(rng):
    import ml_dtypes
    case, fp8 = _numpy_case(rng, fmt="fp8_e5m2")
    want = cupaged.paged_decode(**case, **fp8)
    f8 = {**case, "k_cache": case["k_cache"].view(ml_dtypes.float8_e5m2),
          "v_cache": case["v_cache"].view(ml_dtypes.float8_e5m2)}
    got = cupaged.paged_decode(**f8, k_scale=fp8["k_scale"], v_scale=fp8["v_scale"])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kw,error,message", [
    (dict(), ValueError, r"kv_dtype: expected one of \('fp8_e4m3', 'fp8_e5m2'\) for uint8"),
    (dict(kv_dtype="fp8"), ValueError, r"kv_dtype: expected one of"),
    (dict(kv_dtype="fp8_e4m3", k_scale=-1.0), ValueError, "k_scale: expected finite positive"),
    (dict(kv_dtype="fp8_e4m3", v_scale=np.ones(3, np.float32)), ValueError,
     r"v_scale: expected shape \[\], \[1\] or \[2\]"),
    (dict(kv_dtype="fp8_e4m3", k_scale="1"), TypeError, "k_scale: expected a float"),
])
def test_bad_fp8_arguments_raise_by_name(rng, kw, error, message):
    case, _ = _numpy_case(rng, append=True)
    k0 = case["k_cache"].copy()
    with pytest.raises(error, match=message):
        cupaged.paged_decode(**case, **kw)
    np.testing.assert_array_equal(case["k_cache"], k0)   # no append happened


def test_plain_caches_take_no_scales(rng):
    case = make_case(rng, lens=[3], hq=4, hk=2, d=64)
    with pytest.raises(ValueError, match="k_scale: expected None for caches that are not fp8"):
        cupaged.paged_decode(**case, k_scale=0.5)


def test_decoder_format_is_checked_at_run(rng):
    case, fp8 = _numpy_case(rng)
    dec = cupaged.PagedDecoder(4, 2, 64, 16, layout="NHD").plan(case["block_tables"],
                                                                case["seq_lens"])
    with pytest.raises(ValueError, match="kv_dtype: expected one of"):
        dec.run(case["q"], case["k_cache"], case["v_cache"])
    with pytest.raises(ValueError, match="kv_dtype: expected one of"):
        cupaged.PagedDecoder(4, 2, 64, 16, kv_dtype="e4m3")
    dec8 = cupaged.PagedDecoder(4, 2, 64, 16, layout="NHD", kv_dtype="fp8_e4m3")
    dec8.plan(case["block_tables"], case["seq_lens"])
    got = dec8.run(case["q"], case["k_cache"], case["v_cache"], k_scale=fp8["k_scale"],
                   v_scale=fp8["v_scale"])
    np.testing.assert_array_equal(got, cupaged.paged_decode(**case, **fp8))
    plain = make_case(rng, lens=[5, 20], hq=4, hk=2, d=64)
    with pytest.raises(TypeError, match="k_cache: expected dtype uint8 or float8_e4m3fn"):
        dec8.run(plain["q"], plain["k_cache"], plain["v_cache"])


def test_cache_view_brings_format_and_scales(rng):
    case, fp8 = _numpy_case(rng, layout="HND")
    view = cupaged.CacheView(case["k_cache"], case["v_cache"], layout="HND", **fp8)
    got = cupaged.paged_decode(case["q"], view, case["block_tables"], case["seq_lens"])
    np.testing.assert_array_equal(got, cupaged.paged_decode(**case, **fp8, layout="HND"))
    with pytest.raises(ValueError, match="k_scale: expected None with a CacheView"):
        cupaged.paged_decode(case["q"], view, case["block_tables"], case["seq_lens"],
                             k_scale=1.0)
    with pytest.raises(ValueError, match="kv_dtype: expected 'fp8_e4m3' like the CacheView"):
        cupaged.paged_decode(case["q"], view, case["block_tables"], case["seq_lens"],
                             kv_dtype="fp8_e5m2")
    cu = np.arange(len(case["seq_lens"]) + 1, dtype=np.int32)  # prefill reads the view too
    got = cupaged.paged_prefill(case["q"], view, cu, case["block_tables"], case["seq_lens"])
    np.testing.assert_array_equal(got, cupaged.paged_prefill(
        case["q"], case["k_cache"], case["v_cache"], cu, case["block_tables"], case["seq_lens"],
        layout="HND", **fp8))


def test_fp8_geometry_and_specializations():
    """fp8 launches: 1-byte strides (vllm x = 16), padded staged rows, twice the page
    tokens; every launchable fp8 kernel is in the compile gate's list."""
    from cupaged.decode import launch
    assert dp.stage_row_pad(1, 128) == 64 and dp.stage_row_pad(1, 64) == 0
    assert dp.stage_row_pad(2, 128) == 8 and dp.stage_row_pad(4, 96) == 4
    for d in dp.FP8_HEAD_DIMS:  # rows 64 bytes past a multiple of 128
        assert (d + dp.stage_row_pad(1, d)) % 128 == 64
    lp = dp.plan_launch(itemsize=1, head_dim=128, layout="vllm", block_size=16, num_q_heads=32,
                        num_kv_heads=8, kv="fp8_e4m3")
    assert lp.strides.k_chunk == 16 * 16 and lp.tiles.head_tiles == 1 and lp.kv == "fp8_e4m3"
    assert dp.page_tile(16, 8, 128, 1) == 2 * dp.page_tile(16, 8, 128, 2)
    assert dp.page_smem_bytes(16, 8, 128, 1) == dp.page_smem_bytes(16, 8, 128, 2)
    assert dp.pages_capable(90, 1, 128, "NHD", 16, 32, 8)
    assert not dp.pages_capable(90, 1, 96, "NHD", 16, 32, 8)      # not whole 64-dim rounds
    specs = {s.expr for s in launch.kernel_specializations()}
    for dt in (np.float16, bfloat16):
        for kv in FORMATS:
            assert launch._append_expr(dt, kv) in specs
            for d in dp.FP8_HEAD_DIMS:
                for layout in ("NHD", "HND", "vllm"):
                    for pages in (False, True):
                        if pages and not dp.pages_capable(90, 1, d, layout, 16, 32, 8):
                            continue
                        lp = dp.plan_launch(itemsize=1, head_dim=d, layout=layout, block_size=16,
                                            num_q_heads=64, num_kv_heads=4, pages=pages, kv=kv)
                        assert launch._launch_expr(lp, np.dtype(dt)) in specs


# ----------------------------------------------------------------------------- GPU: kernels
LAYOUT_CASES = [  # layout, format, scale form, q dtype, block size
    ("NHD", "fp8_e4m3", "heads", bfloat16, 16), ("NHD", "fp8_e5m2", "float", np.float16, 16),
    ("HND", "fp8_e4m3", "tensor0d", np.float16, 16), ("HND", "fp8_e5m2", "heads", bfloat16, 128),
    ("vllm", "fp8_e4m3", "tensor1", bfloat16, 16), ("vllm", "fp8_e5m2", "heads", np.float16, 16),
    ("vllm", "fp8_e4m3", "float", np.float16, 1), ("vllm", "fp8_e5m2", "tensor0d", bfloat16, 128),
    ("NHD", "fp8_e4m3", "tensor1", np.float16, 1), ("NHD", "fp8_e5m2", "heads", bfloat16, 128),
    ("HND", "fp8_e4m3", "heads", bfloat16, 1), ("HND", "fp8_e5m2", "float", np.float16, 16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["staged", "auto"])
@pytest.mark.parametrize("layout,fmt,scale,dtype,bs", LAYOUT_CASES,
                         ids=["-".join(map(str, c[:3])) + f"-bs{c[4]}" for c in LAYOUT_CASES])
def test_layouts_formats_scales(rng, cp, backend, layout, fmt, scale, dtype, bs):
    """Every layout, format, scale shape and page size, odd lengths (empty, one token,
    block and tile edges); "auto" takes the pages kernel where it applies on sm_90."""
    case, fp8 = fp8_case(rng, lens=[1, 0, 17, 513, 4097], hq=32, hk=8, d=128, bs=bs,
                         layout=layout, dtype=dtype, fmt=fmt, scale=scale)
    check_fp8(cp, case, layout, fp8, {}, backend=backend)


FEATURES = [(), ("sinks",), ("window",), ("window0", "sinks"), ("alibi", "softcap"),
            ("alibi", "window", "sinks", "softcap", "scale")]


@pytest.mark.gpu
@pytest.mark.parametrize("append", [False, True], ids=["", "append"])
@pytest.mark.parametrize("backend,layout", [("pages", "NHD"), ("pages", "HND"),
                                            ("staged", "NHD"), ("staged", "vllm")])
@pytest.mark.parametrize("feats", FEATURES, ids=["+".join(f) or "plain" for f in FEATURES])
def test_features(rng, cp, backend, layout, feats, append):
    """Sinks, windows, ALiBi, soft-cap, sm_scale and LSE on both kernels; with append the
    new tokens are quantised on the device exactly as the reference writes them."""
    pages_or_skip(cp, backend)
    fmt = FORMATS[len(feats) % 2]
    dtype = bfloat16 if append else np.float16
    case, fp8 = fp8_case(rng, lens=[2, 300, 1025, 0], hq=16, hk=4, d=128, bs=16, layout=layout,
                         dtype=dtype, fmt=fmt, append=append)
    check_fp8(cp, case, layout, fp8, features(rng, 16, feats), backend=backend)


SHAPES = [  # id, layout, head dim, block size, Hq, Hk, lengths, backend
    ("d64-g4-pages", "NHD", 64, 16, 16, 4, [511, 2, 70], "pages"),
    ("d64-mha-hnd-pages", "HND", 64, 32, 8, 8, [513, 17], "pages"),
    ("d128-mqa8-pages", "NHD", 128, 16, 8, 1, [4097, 3], "pages"),
    ("d64-vllm-mqa", "vllm", 64, 32, 16, 1, [600, 5], "staged"),
    ("d128-g16", "NHD", 128, 16, 32, 2, [1000, 17], "staged"),
    ("d128-g80", "HND", 128, 16, 80, 1, [511, 2], "staged"),
    ("d64-bs1-long", "NHD", 64, 1, 8, 2, [20000], "staged"),
    ("d128-bs5", "vllm", 128, 5, 8, 2, [33, 1], "staged"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout,d,bs,hq,hk,lens,backend", [s[1:] for s in SHAPES],
                         ids=[s[0] for s in SHAPES])
def test_head_dims_and_groups(rng, cp, fmt, layout, d, bs, hq, hk, lens, backend):
    """Head dims 64 and 128, MHA to MQA and groups past 8 (several warps, head chunks),
    block sizes not dividing 16 (ragged vllm value groups)."""
    pages_or_skip(cp, backend)
    case, fp8 = fp8_case(rng, lens=lens, hq=hq, hk=hk, d=d, bs=bs, layout=layout,
                         dtype=bfloat16, fmt=fmt)
    check_fp8(cp, case, layout, fp8, features(rng, hq, ("sinks",)), backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pages", "staged"])
@pytest.mark.parametrize("schedule,merge", [("balanced", "fused"), ("split", "kernel")])
def test_decoder_plans_and_runs(rng, cp, backend, schedule, merge):
    """PagedDecoder with kv_dtype: split sequences merged, the hot run path (a second run
    takes the cached check), and a device scale array read at run time: a new value in
    the same array gives the new result (the host never reads it)."""
    pages_or_skip(cp, backend)
    hq, hk, d = 32, 8, 128
    case, fp8 = fp8_case(rng, lens=mixed_lengths(rng, 40), hq=hq, hk=hk, d=d, dtype=bfloat16,
                         fmt="fp8_e4m3")
    dec = cupaged.PagedDecoder(hq, hk, d, 16, dtype=bfloat16, layout="NHD", max_batch=40,
                               xp=cp, backend=backend, kv_dtype="fp8_e4m3")
    dec.plan(case["block_tables"], case["seq_lens"], schedule=schedule, merge=merge)
    assert dec.kernel == backend
    dev = {n: cp.asarray(case[n]) for n in ("q", "k_cache", "v_cache")}
    k_scale, v_scale = cp.asarray(fp8["k_scale"]), cp.asarray(fp8["v_scale"])
    for step in range(3):
        if step == 2:  # the same arrays, new values
            fp8 = {**fp8, "k_scale": fp8["k_scale"] * 2, "v_scale": fp8["v_scale"] * 0.5}
            k_scale[...] = cp.asarray(fp8["k_scale"])
            v_scale[...] = cp.asarray(fp8["v_scale"])
        out = cp.full(case["q"].shape, np.nan, bfloat16)
        lse = cp.full(case["q"].shape[:2], np.nan, np.float32)
        dec.run(dev["q"], dev["k_cache"], dev["v_cache"], k_scale=k_scale, v_scale=v_scale,
                out=out, lse=lse)
        want, want_lse, _, _ = fp8_oracle(case, "NHD", fp8)
        assert_matches(out.get(), lse.get(), want, want_lse, bfloat16)


@pytest.mark.gpu
def test_decoder_append_and_graph_replay(rng, cp):
    """A captured run with append on an fp8 PagedKVCache (format and float scales from the
    cache), replayed: the same codes written, the same result."""
    hq, hk, d, bs = 16, 4, 128, 16
    case, _ = fp8_case(rng, lens=[300, 17, 4000], hq=hq, hk=hk, d=d, bs=bs, dtype=np.float16,
                       fmt="fp8_e5m2", scale="float", append=True)
    fp8 = dict(kv_dtype="fp8_e5m2", k_scale=0.05, v_scale=0.04)
    want, want_lse, k_after, v_after = fp8_oracle(case, "NHD", fp8)
    cache = cupaged.PagedKVCache(case["k_cache"].shape[0], bs, hk, d, dtype=np.float16,
                                 layout="NHD", xp=cp, kv_dtype="fp8_e5m2", k_scale=0.05,
                                 v_scale=0.04)
    dec = cupaged.PagedDecoder(hq, hk, d, bs, dtype=np.float16, layout="NHD", max_batch=4,
                               xp=cp, kv_dtype="fp8_e5m2")
    q, k_new, v_new = (cp.asarray(case[n]) for n in ("q", "k_new", "v_new"))
    out, lse = cp.empty(q.shape, np.float16), cp.empty(q.shape[:2], np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    for replay in (False, True):
        cache.k[...] = cp.asarray(case["k_cache"])
        cache.v[...] = cp.asarray(case["v_cache"])
        cp.cuda.Device().synchronize()
        with stream:
            dec.plan(case["block_tables"], case["seq_lens"], append=True)
            out.fill(np.nan)
            if not replay:
                dec.run(q, cache, k_new=k_new, v_new=v_new, out=out, lse=lse)
                stream.begin_capture()
                dec.run(q, cache, k_new=k_new, v_new=v_new, out=out, lse=lse)
                graph = stream.end_capture()
            else:
                graph.launch()
            stream.synchronize()
        assert_matches(out.get(), lse.get(), want, want_lse, np.float16)
        np.testing.assert_array_equal(cache.k.get(), k_after)
        np.testing.assert_array_equal(cache.v.get(), v_after)


@pytest.mark.gpu
def test_torch_float8_caches(rng, cp):
    """torch float8 caches go in zero-copy (their format from the tensor), torch out."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8")
    case, fp8 = fp8_case(rng, lens=[70, 5], hq=8, hk=2, d=128, dtype=np.float16,
                         scale="tensor1")
    want, want_lse, _, _ = fp8_oracle(case, "NHD", fp8)

    def t(a, dtype=None):
        x = torch.from_numpy(np.ascontiguousarray(a)).cuda()
        return x.view(dtype) if dtype is not None else x
    q = torch.from_numpy(case["q"]).cuda()
    k8, v8 = t(case["k_cache"], torch.float8_e4m3fn), t(case["v_cache"], torch.float8_e4m3fn)
    for _ in range(2):  # checked, then hot
        out, lse = cupaged.paged_decode(q, k8, v8, t(case["block_tables"]), t(case["seq_lens"]),
                                        k_scale=t(fp8["k_scale"]), v_scale=t(fp8["v_scale"]),
                                        layout="NHD", return_lse=True)
        assert isinstance(out, torch.Tensor)
        assert_matches(out.cpu().numpy(), lse.cpu().numpy(), want, want_lse, np.float16)


@pytest.mark.gpu
def test_device_scale_checks(rng, cp):
    """Device scales: dtype and shape checked on the host, values only in strict mode."""
    case, fp8 = fp8_case(rng, lens=[5], hq=4, hk=2, d=64, dtype=np.float16)
    dev = {n: (None if a is None else cp.asarray(a)) for n, a in case.items()}
    with pytest.raises(TypeError, match="k_scale: expected dtype float32, got float16"):
        cupaged.paged_decode(**dev, kv_dtype="fp8_e4m3", k_scale=cp.ones(2, np.float16))
    with pytest.raises(ValueError, match=r"v_scale: expected shape \[\], \[1\] or \[2\]"):
        cupaged.paged_decode(**dev, kv_dtype="fp8_e4m3", v_scale=cp.ones(3, np.float32))
    with pytest.raises(TypeError, match="k_scale: expected a float or a float32 device array"):
        cupaged.paged_decode(**dev, kv_dtype="fp8_e4m3", k_scale=np.ones(2, np.float32))
    with pytest.raises(ValueError, match="k_scale: expected finite positive"):
        cupaged.paged_decode(**dev, kv_dtype="fp8_e4m3", k_scale=-cp.ones(2, np.float32),
                             validate=True)
    with pytest.raises(TypeError, match="q: expected dtype float16 or bfloat16 with an fp8"):
        cupaged.paged_decode(**{**dev, "q": dev["q"].astype(np.float32)}, kv_dtype="fp8_e4m3")
    case96, _ = fp8_case(rng, lens=[5], hq=4, hk=2, d=96, dtype=np.float16)
    dev96 = {n: (None if a is None else cp.asarray(a)) for n, a in case96.items()}
    with pytest.raises(ValueError, match=r"k_cache: expected head_dim in \(64, 128\)"):
        cupaged.paged_decode(**dev96, kv_dtype="fp8_e4m3")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend,layout", [("pages", "NHD"), ("staged", "NHD"),
                                            ("staged", "vllm")])
def test_every_code_reads_back_exactly(cp, backend, layout, fmt, dtype):
    """With one key a sequence the output is its value row times v_scale: every finite code
    of the format (subnormals included) widened in the kernel, at its head dim, exactly."""
    pages_or_skip(cp, backend)
    from cupaged.core.fp8 import FP8_FORMATS
    f8 = FP8_FORMATS[fmt].dtype
    codes = np.arange(256, dtype=np.uint8)
    codes[~np.isfinite(codes.view(f8).astype(np.float32))] = 0   # NaN / inf codes: never written
    d, hq = 128, 8
    k = np.zeros((4, 16, 1, d), np.uint8)
    v = np.zeros((4, 16, 1, d), np.uint8)
    v[0, 0, 0], v[1, 0, 0] = codes[:128], codes[128:]
    k[:2, 0, 0] = codes[1:129]
    kc, vc = from_nhd(k, v, layout)
    q = np.ones((2, hq, d), dtype)
    dev = dict(q=cp.asarray(q), k_cache=cp.asarray(kc), v_cache=cp.asarray(vc),
               block_tables=cp.asarray(np.array([[0], [1]], np.int32)),
               seq_lens=cp.asarray(np.array([1, 1], np.int32)))
    out = cp.full(q.shape, np.nan, dtype)
    cupaged.paged_decode(**dev, kv_dtype=fmt, k_scale=0.5, v_scale=1.0, layout=layout,
                         backend=backend, out=out)
    want = np.stack([codes[:128], codes[128:]]).view(f8).astype(np.float64)
    got = out.get().astype(np.float64)
    for h in range(hq):
        np.testing.assert_array_equal(got[:, h], want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_append_saturates(rng, cp, fmt):
    """k_new / v_new beyond the format's range (infinities included) are appended as +-max,
    bit for bit as the reference, and the output stays finite."""
    case, fp8 = fp8_case(rng, lens=[3, 40], hq=8, hk=2, d=64, dtype=np.float16, fmt=fmt,
                         append=True)
    case["k_new"][0, 0, :3] = [60000, -np.inf, np.inf]
    case["v_new"][1, 1, 5] = -65504
    _, _, k_after, v_after = fp8_oracle(case, "NHD", fp8)
    dev = {n: (None if a is None else cp.asarray(a)) for n, a in case.items()}
    out = cupaged.paged_decode(**dev, **{n: on_device(cp, a) for n, a in fp8.items()},
                               layout="NHD", backend="staged")
    np.testing.assert_array_equal(dev["k_cache"].get(), k_after)
    np.testing.assert_array_equal(dev["v_cache"].get(), v_after)
    assert np.isfinite(out.get().astype(np.float32)).all()
