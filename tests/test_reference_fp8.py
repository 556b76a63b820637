"""fp8 caches in the reference: the quantisation rule (reference.fp8, core.fp8), the cache
write that quantises, and attention over quantised caches (CPU, NumPy).

Checks written independently of the code under test: every code's round trip, ties to even
from exact midpoints, the half-ulp bound, saturation, per-head scales read back head by head,
a token-by-token gather, and the error of fp8 attention against bf16 attention bounded by the
propagation of the realised quantisation errors.
"""
import math

import ml_dtypes
import numpy as np
import pytest

from cupaged.core.arrays import bfloat16
from cupaged.core.fp8 import FP8_FORMATS, KV_DTYPES, check_scale
from cupaged.core.layouts import LAYOUTS, cache_shapes, head_axis, k_as_nhd, v_as_nhd
from cupaged.reference import attention as ref
from cupaged.reference.cache import copy_blocks, swap_blocks, write_kv_cache
from cupaged.reference.fp8 import dequantize, half_ulp, quantize

PAGES = [1, 16, 128]
HK, D = 3, 48          # odd head count; head_dim a multiple of 16 (vllm's x for 1 byte)


def _scale(rng, kind, hk=HK):
    """A per-tensor or per-head float32 scale, never a power of two (rounding is exercised)."""
    if kind == "tensor":
        return np.float32(rng.uniform(0.003, 0.03))
    return (rng.uniform(0.003, 0.03, hk) * 2.0 ** np.arange(hk)).astype(np.float32)


def _values(rng, shape, scale, fmt=None, hk_axis=1):
    """bf16 values sized per head like ``scale``: ``normal * 100 * scale`` (a calibrated
    cache's size), or with ``fmt`` normal times a log-uniform size from the format's smallest
    subnormal to its max (subnormals, normals and values past the range)."""
    s = np.asarray(scale, np.float64)
    if s.ndim:
        s = s.reshape([-1 if a == hk_axis % len(shape) else 1 for a in range(len(shape))])
    size = 100.0
    if fmt is not None:
        f = FP8_FORMATS[fmt]
        size = np.exp(rng.uniform(math.log(f.min_subnormal), math.log(f.max), shape))
    return (rng.standard_normal(shape) * size * s).astype(bfloat16)


def _codes(fmt):
    """All 256 bit patterns and which of them are finite values."""
    codes = np.arange(256, dtype=np.uint8)
    return codes, np.isfinite(codes.view(FP8_FORMATS[fmt].dtype).astype(np.float64))


# ----------------------------------------------------------------------------- the rule
def test_format_facts():
    e4, e5 = FP8_FORMATS["fp8_e4m3"], FP8_FORMATS["fp8_e5m2"]
    assert KV_DTYPES == ("fp8_e4m3", "fp8_e5m2")
    assert e4.dtype == np.dtype(ml_dtypes.float8_e4m3fn) and e4.max == 448.0
    assert e5.dtype == np.dtype(ml_dtypes.float8_e5m2) and e5.max == 57344.0
    assert (e4.mantissa_bits, e5.mantissa_bits) == (3, 2)
    assert (e4.min_subnormal, e5.min_subnormal) == (2.0 ** -9, 2.0 ** -16)


@pytest.mark.parametrize("fmt", KV_DTYPES)
def test_every_code_round_trips(rng, fmt):
    codes, finite = _codes(fmt)
    for scale in (np.float32(1.0), np.float32(rng.uniform(0.01, 10))):
        values = dequantize(codes[finite], scale, fmt, head_axis=0)
        assert values.dtype == np.float64
        np.testing.assert_array_equal(quantize(values, scale, fmt, head_axis=0),
                                      codes[finite])


@pytest.mark.parametrize("fmt", KV_DTYPES)
def test_ties_round_to_even(fmt):
    codes, finite = _codes(fmt)
    positive = codes[finite & (codes < 0x80)]
    values = positive.view(FP8_FORMATS[fmt].dtype).astype(np.float32)
    order = np.argsort(values)
    lo, hi = positive[order][:-1], positive[order][1:]
    a, b = values[order][:-1], values[order][1:]
    mid = (a + b) / np.float32(2)                 # exact in float32
    one = np.float32(1.0)
    want = np.where(lo % 2 == 0, lo, hi)          # the even pattern wins a tie
    np.testing.assert_array_equal(quantize(mid, one, fmt, head_axis=0), want)
    np.testing.assert_array_equal(quantize(-mid, one, fmt, head_axis=0), want | 0x80)
    up, down = np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(0))
    np.testing.assert_array_equal(quantize(up, one, fmt, head_axis=0), hi)
    np.testing.assert_array_equal(quantize(down, one, fmt, head_axis=0), lo)


@pytest.mark.parametrize("fmt", KV_DTYPES)
@pytest.mark.parametrize("kind", ["tensor", "head"])
def test_round_trip_within_half_ulp(rng, fmt, kind):
    scale = _scale(rng, kind)
    x = _values(rng, (1001, HK, D), scale, fmt)
    got = dequantize(quantize(x, scale, fmt, head_axis=1), scale, fmt, head_axis=1)
    s = np.broadcast_to(np.asarray(scale, np.float64), (HK,))[None, :, None]
    exact = x.astype(np.float64) / s
    inside = np.abs(exact) <= FP8_FORMATS[fmt].max
    assert inside.mean() > 0.8 and (~inside).any()
    # step 3's half ulp at the float32 quotient, plus step 1's float32 rounding
    bound = half_ulp(exact.astype(np.float32), fmt) + 2.0 ** -24 * np.abs(exact)
    err = np.abs(got / s - exact)
    assert (err[inside] <= bound[inside]).all()
    assert np.isfinite(got).all()


@pytest.mark.parametrize("fmt", KV_DTYPES)
@pytest.mark.parametrize("kind", ["tensor", "head"])
def test_values_beyond_the_range_saturate(rng, fmt, kind):
    scale = _scale(rng, kind)
    fmax = FP8_FORMATS[fmt].max
    s = np.broadcast_to(np.asarray(scale, np.float64), (HK,))[:, None]
    size = np.array([1.0001, 1.05, 1.2, 2.0, 1e3, 1e30, np.inf])
    x = np.concatenate([size, -size])[None, :] * fmax * s      # [HK, 14]
    x = np.concatenate([x.astype(np.float32), x.astype(bfloat16).astype(np.float32)], 1)
    got = dequantize(quantize(x, scale, fmt, head_axis=0), scale, fmt, head_axis=0)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, np.sign(x) * fmax * s)
    nan = quantize(np.float32([np.nan]), np.float32(1.0), fmt, head_axis=0)
    assert np.isnan(nan.view(FP8_FORMATS[fmt].dtype).astype(np.float32)).all()


def test_float8_arrays_read_like_their_bytes(rng):
    for fmt in KV_DTYPES:
        codes = rng.integers(0, 256, (5, HK, 16), dtype=np.uint8)
        codes[codes & 0x7F >= 0x7C] = 1          # keep to finite patterns of both formats
        scale = _scale(rng, "head")
        as_float8 = codes.view(FP8_FORMATS[fmt].dtype)
        np.testing.assert_array_equal(dequantize(as_float8, scale, fmt, head_axis=1),
                                      dequantize(codes, scale, fmt, head_axis=1))
    with pytest.raises(TypeError, match="codes: expected dtype uint8 or float8_e4m3fn"):
        dequantize(codes.view(ml_dtypes.float8_e5m2), 1.0, "fp8_e4m3")
    with pytest.raises(ValueError, match="fmt: expected one of"):
        quantize(codes, 1.0, "fp8_e3m4")


# ----------------------------------------------------------------------------- scale checks
BAD_SCALES = [
    (np.ones(HK + 1, np.float32), ValueError, r"expected shape \[\], \[1\] or \[3\]"),
    (np.ones((1, HK), np.float32), ValueError, r"expected shape \[\], \[1\] or \[3\]"),
    (np.float32(0.0), ValueError, "expected finite positive values, got 0.0"),
    (np.float32([1, -2, 1]), ValueError, "expected finite positive values, got -2.0 at index 1"),
    (np.float32([1, 1, np.inf]), ValueError, "expected finite positive values, got inf at index 2"),
    (np.float32(np.nan), ValueError, "expected finite positive values, got nan"),
    (np.ones(HK, np.float64), TypeError, "expected dtype float32, got float64"),
    (np.float64(0.5), TypeError, "expected dtype float32, got float64"),
    (np.ones(HK, np.float16), TypeError, "expected dtype float32, got float16"),
    (np.ones(HK, np.int32), TypeError, "expected dtype float32, got int32"),
    (True, TypeError, "expected a float or a float32 array, got bool"),
    ("0.5", TypeError, "expected a float or a float32 array, got str"),
]


@pytest.mark.parametrize("bad,error,message", BAD_SCALES)
def test_bad_scales_are_refused_by_name(rng, bad, error, message):
    ks, vs = cache_shapes("NHD", 4, 16, HK, D, np.uint8)
    k8, v8 = np.zeros(ks, np.uint8), np.zeros(vs, np.uint8)
    key = _values(rng, (2, HK, D), 0.01)
    slots = np.array([3, 17], np.int64)
    with pytest.raises(error, match="k_scale: " + message):
        write_kv_cache(key, key, k8, v8, slots, kv_dtype="fp8_e4m3", k_scale=bad)
    with pytest.raises(error, match="v_scale: " + message):
        write_kv_cache(key, key, k8, v8, slots, kv_dtype="fp8_e4m3", v_scale=bad)
    assert not k8.any() and not v8.any()                  # nothing written
    q = _values(rng, (1, HK, D), 1.0)
    table = np.array([[0, 1]], np.int32)
    with pytest.raises(error, match="v_scale: " + message):
        ref.paged_decode(q, k8, v8, table, np.array([5], np.int32), kv_dtype="fp8_e5m2",
                         v_scale=bad)


def test_scale_shapes_and_defaults():
    np.testing.assert_array_equal(check_scale("k_scale", 0.5, 3), np.float32([0.5] * 3))
    per_head = np.float32([1, 2, 3])
    assert check_scale("k_scale", per_head, 3).dtype == np.float32
    with pytest.raises(TypeError, match="k_scale: expected a float"):
        check_scale("k_scale", None, 3)


def test_kv_dtype_must_fit_the_caches(rng):
    key = _values(rng, (1, HK, D), 0.01)
    slots = np.array([0], np.int64)
    shape = cache_shapes("NHD", 2, 16, HK, D, np.uint8)[0]
    u8, e5 = np.zeros(shape, np.uint8), np.zeros(shape, ml_dtypes.float8_e5m2)
    f16 = np.zeros(shape, np.float16)
    with pytest.raises(ValueError, match="kv_dtype: expected one of .* for uint8 caches"):
        write_kv_cache(key, key, u8, u8.copy(), slots)
    with pytest.raises(ValueError, match="kv_dtype: expected one of"):
        write_kv_cache(key, key, u8, u8.copy(), slots, kv_dtype="fp8")
    with pytest.raises(TypeError, match="k_cache: expected dtype uint8 or float8_e4m3fn"):
        write_kv_cache(key, key, f16, f16.copy(), slots, kv_dtype="fp8_e4m3")
    with pytest.raises(TypeError, match="k_cache: expected dtype uint8 or float8_e4m3fn"):
        write_kv_cache(key, key, e5, e5.copy(), slots, kv_dtype="fp8_e4m3")
    with pytest.raises(TypeError, match="v_cache: expected dtype uint8 or float8_e5m2"):
        write_kv_cache(key, key, e5, f16, slots)
    with pytest.raises(ValueError, match="k_scale: expected None for caches that are not fp8"):
        write_kv_cache(key.astype(np.float16), key.astype(np.float16), f16, f16.copy(), slots,
                       k_scale=np.float32(1))
    write_kv_cache(key, key, e5, e5.copy(), slots)        # a float8 cache names its format
    assert e5.view(np.uint8).any()


# ----------------------------------------------------------------------------- cache write
def _empty_caches(layout, fmt, block_size, num_blocks, cache_dtype):
    dtype = np.uint8 if cache_dtype == "uint8" else FP8_FORMATS[fmt].dtype
    ks, vs = cache_shapes(layout, num_blocks, block_size, HK, D, dtype)
    return np.zeros(ks, dtype), np.zeros(vs, dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", KV_DTYPES)
@pytest.mark.parametrize("kind", ["tensor", "head"])
@pytest.mark.parametrize("block_size", PAGES)
def test_write_quantises_each_head_with_its_scale(rng, layout, fmt, kind, block_size):
    num_blocks = max(3, -(-45 // block_size) + 1)
    k8, v8 = _empty_caches(layout, fmt, block_size, num_blocks, "uint8")
    k_f8, v_f8 = _empty_caches(layout, fmt, block_size, num_blocks, "float8")
    ks, vs = _scale(rng, kind), _scale(rng, kind)
    n = 37
    key, value = _values(rng, (n, HK, D), ks, fmt), _values(rng, (n, HK, D), vs, fmt)
    slots = rng.permutation(num_blocks * block_size)[:n].astype(np.int64)
    slots[rng.choice(n, 5, replace=False)] = -1
    opts = dict(kv_dtype=fmt, k_scale=ks, v_scale=vs)
    write_kv_cache(key, value, k8, v8, slots, layout, **opts)
    write_kv_cache(key, value, k_f8, v_f8, slots, layout, **opts)
    np.testing.assert_array_equal(k_f8.view(np.uint8), k8)
    np.testing.assert_array_equal(v_f8.view(np.uint8), v8)
    # token by token, head by head, each with that head's scale as a per-tensor scale
    k_nhd, v_nhd = k_as_nhd(k8, layout), v_as_nhd(v8, layout)
    ks_h, vs_h = np.broadcast_to(ks, (HK,)), np.broadcast_to(vs, (HK,))
    for t in np.flatnonzero(slots >= 0):
        b, o = divmod(int(slots[t]), block_size)
        for h in range(HK):
            np.testing.assert_array_equal(k_nhd[b, o, h], quantize(key[t, h], ks_h[h], fmt))
            np.testing.assert_array_equal(v_nhd[b, o, h], quantize(value[t, h], vs_h[h], fmt))
    written = np.zeros(num_blocks * block_size, bool)
    written[slots[slots >= 0]] = True
    assert not k_nhd.reshape(-1, HK, D)[~written].any()    # skipped slots stay untouched
    # the whole cache reads back per head along the layout's head axis
    deq = dequantize(k8, ks, fmt, head_axis=head_axis(layout))
    want = dequantize(k_nhd, ks, fmt, head_axis=2)
    np.testing.assert_array_equal(k_as_nhd(deq, layout), want)


def test_copy_and_swap_move_fp8_bytes(rng):
    k8, v8 = _empty_caches("vllm", "fp8_e4m3", 16, 4, "float8")
    k8.view(np.uint8)[...] = rng.integers(0, 0x7E, k8.shape, dtype=np.uint8)
    v8.view(np.uint8)[...] = rng.integers(0, 0x7E, v8.shape, dtype=np.uint8)
    before = k8.view(np.uint8).copy()
    copy_blocks(k8, v8, np.array([[0, 3]]))
    np.testing.assert_array_equal(k8.view(np.uint8)[3], before[0])
    host = np.zeros_like(k8)
    swap_blocks(k8, host, np.array([[1, 2]]))
    np.testing.assert_array_equal(host.view(np.uint8)[2], before[1])


# ----------------------------------------------------------------------------- attention
def _fp8_batch(rng, layout, fmt, kind, block_size, lens, hq=6, extra=1):
    """Quantised caches holding ``lens[i]`` tokens per sequence (room for ``extra`` more),
    written through write_kv_cache from bf16 rows; also the same rows in a bf16 cache."""
    need = [-(-(n + extra) // block_size) for n in lens]
    num_blocks = sum(need) + 2
    k8, v8 = _empty_caches(layout, fmt, block_size, num_blocks, "uint8")
    ks16, vs16 = cache_shapes(layout, num_blocks, block_size, HK, D, bfloat16)
    k16, v16 = np.zeros(ks16, bfloat16), np.zeros(vs16, bfloat16)
    tables = np.full((len(lens), max(need) + 1), -1, np.int32)
    ids = rng.permutation(num_blocks)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[start:start + n]
        start += n
    k_scale, v_scale = _scale(rng, kind), _scale(rng, kind)
    for i, n in enumerate(lens):
        pos = np.arange(n)
        slots = tables[i, pos // block_size].astype(np.int64) * block_size + pos % block_size
        key, value = _values(rng, (n, HK, D), k_scale), _values(rng, (n, HK, D), v_scale)
        write_kv_cache(key, value, k8, v8, slots, layout, kv_dtype=fmt, k_scale=k_scale,
                       v_scale=v_scale)
        write_kv_cache(key, value, k16, v16, slots, layout)
    q = rng.standard_normal((len(lens), hq, D)).astype(bfloat16).astype(np.float32)
    fp8 = dict(kv_dtype=fmt, k_scale=k_scale, v_scale=v_scale)
    return (k8, v8), (k16, v16), tables, q, fp8


def _features(rng, hq):
    return dict(sinks=rng.uniform(-1, 1, hq).astype(np.float32), window_left=30,
                alibi_slopes=rng.uniform(0, 0.2, hq).astype(np.float32), logits_soft_cap=8.0)


def _loop_dequantised(caches, tables, lens, layout, fp8, block_size):
    """Token-by-token gather of the caches, read back in float64 head by head."""
    k_nhd, v_nhd = k_as_nhd(caches[0], layout), v_as_nhd(caches[1], layout)
    ks = np.broadcast_to(fp8["k_scale"], (HK,))
    vs = np.broadcast_to(fp8["v_scale"], (HK,))
    rows_k, rows_v = [], []
    for i, n in enumerate(lens):
        for t in range(n):
            b, o = tables[i, t // block_size], t % block_size
            rows_k.append([dequantize(k_nhd[b, o, h], ks[h], fp8["kv_dtype"]) for h in range(HK)])
            rows_v.append([dequantize(v_nhd[b, o, h], vs[h], fp8["kv_dtype"]) for h in range(HK)])
    empty = np.zeros((0, HK, D))
    return (np.array(rows_k).reshape(-1, HK, D) if rows_k else empty,
            np.array(rows_v).reshape(-1, HK, D) if rows_v else empty)


def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", KV_DTYPES)
@pytest.mark.parametrize("kind", ["tensor", "head"])
@pytest.mark.parametrize("block_size", PAGES)
def test_decode_over_fp8_is_attention_over_the_dequantised_cache(rng, layout, fmt, kind,
                                                                 block_size):
    lens = np.array([45, 0, 1, 16, 29], np.int32)
    caches, _, tables, q, fp8 = _fp8_batch(rng, layout, fmt, kind, block_size, lens)
    hq = q.shape[1]
    opts = _features(rng, hq)
    k_new, v_new = (_values(rng, (len(lens), HK, D), fp8[s]) for s in ("k_scale", "v_scale"))
    out, lse = ref.paged_decode(q, *caches, tables, lens, k_new=k_new, v_new=v_new,
                                layout=layout, return_lse=True, **opts, **fp8)
    # the appended rows are in the cache, quantised like every other row
    k, v = _loop_dequantised(caches, tables, lens + 1, layout, fp8, block_size)
    last = _cu(lens + 1)[1:] - 1
    s_k = np.broadcast_to(np.asarray(fp8["k_scale"], np.float64), (HK,))[None, :, None]
    np.testing.assert_array_equal(k[last], dequantize(quantize(k_new, fp8["k_scale"], fmt),
                                                      fp8["k_scale"], fmt))
    assert (np.abs(k[last] - k_new.astype(np.float64)) <= np.abs(k_new) / 8 + s_k).all()
    want, want_lse = ref.varlen_prefill(q, k, v, _cu([1] * len(lens)), _cu(lens + 1),
                                        return_lse=True, **opts)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", KV_DTYPES)
@pytest.mark.parametrize("kind", ["tensor", "head"])
def test_prefill_over_fp8_is_attention_over_the_dequantised_cache(rng, layout, fmt, kind):
    lens = np.array([40, 7, 0, 19], np.int32)
    q_lens = np.array([13, 7, 0, 1], np.int32)          # chunked, whole, empty, decode row
    caches, _, tables, _, fp8 = _fp8_batch(rng, layout, fmt, kind, 16, lens, extra=0)
    q = rng.standard_normal((int(q_lens.sum()), 6, D)).astype(np.float32)
    opts = _features(rng, 6)
    out, lse = ref.paged_attention(q, *caches, _cu(q_lens), tables, lens, layout=layout,
                                   return_lse=True, **opts, **fp8)
    k, v = _loop_dequantised(caches, tables, lens, layout, fp8, 16)
    want, want_lse = ref.varlen_prefill(q, k, v, _cu(q_lens), _cu(lens), return_lse=True,
                                        **opts)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", KV_DTYPES)
@pytest.mark.parametrize("kind", ["tensor", "head"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_fp8_decode_error_against_bf16_decode(rng, layout, fmt, kind, block_size):
    """|out_fp8 - out_bf16| <= (exp(2*Delta) - 1) * V + dV per (sequence, query head):
    Delta bounds the score errors the quantised keys cause (soft-cap and ALiBi do not widen
    them), which move each softmax weight by a factor within exp(+-2*Delta) (the sink term
    included); V = max |v| over the keys, dV = max |v_fp8 - v_bf16|. The LSE moves by at
    most Delta. Delta and dV come from the realised quantisation errors (exact in float64),
    which are also within the a-priori half-ulp bound where nothing saturates."""
    lens = np.array([45, 1, 29, 64], np.int32)
    caches, bf16, tables, q, fp8 = _fp8_batch(rng, layout, fmt, kind, block_size, lens)
    hq, group = q.shape[1], q.shape[1] // HK
    opts = _features(rng, hq)
    out8, lse8 = ref.paged_decode(q, *caches, tables, lens, layout=layout, return_lse=True,
                                  **opts, **fp8)
    out16, lse16 = ref.paged_decode(q, *bf16, tables, lens, layout=layout, return_lse=True,
                                    **opts)
    k8, v8 = _loop_dequantised(caches, tables, lens, layout, fp8, block_size)
    cu = _cu(lens)
    ratios = []
    for i in range(len(lens)):
        k16, v16 = (ref.gather_kv(*bf16, tables[i], int(lens[i]), layout)[j].astype(np.float64)
                    for j in (0, 1))
        dk, dv = k8[cu[i]:cu[i + 1]] - k16, v8[cu[i]:cu[i + 1]] - v16
        s = np.broadcast_to(np.asarray(fp8["k_scale"], np.float64), (HK,))[None, :, None]
        a_priori = half_ulp((k16 / s).astype(np.float32), fmt) * s + 2.0 ** -24 * np.abs(k16)
        inside = np.abs(k16 / s) <= FP8_FORMATS[fmt].max    # the rest saturates
        assert (np.abs(dk) <= a_priori)[inside].all()
        for h in range(hq):
            kv_h = h // group
            delta = D ** -0.5 * np.abs(dk[:, kv_h] @ q[i, h].astype(np.float64)).max()
            big_v = np.abs(v16[:, kv_h]).max()
            bound = math.expm1(2 * delta) * big_v + np.abs(dv[:, kv_h]).max()
            err = np.abs(out8[i, h].astype(np.float64) - out16[i, h]).max()
            assert err <= bound + 2.0 ** -22 * big_v, (i, h, err, bound)
            assert abs(float(lse8[i, h]) - float(lse16[i, h])) <= delta + 1e-5
            ratios.append(err / big_v)
    assert max(ratios) > 0                                # the error is real, and bounded
