"""Cache ops: reference vs element-by-element oracles, NumPy path, bad input, GPU kernels."""
import numpy as np
import pytest

import cupaged
from cupaged.cache_ops import api as cache_ops
from cupaged.core.arrays import bfloat16
from cupaged.core.layouts import LAYOUTS, CacheGeometry, cache_shapes, k_as_nhd, v_as_nhd
from cupaged.reference import cache as ref
from cupaged.core.fp8 import FP8_FORMATS as FP8

DTYPES = [np.float16, bfloat16, np.float32]


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _slots(rng, num_tokens, num_slots, skip=0.2):
    """Distinct random slots with a fraction of -1 (skipped tokens)."""
    s = rng.choice(num_slots, size=num_tokens, replace=False).astype(np.int64)
    s[rng.random(num_tokens) < skip] = -1
    return s


def _caches(rng, layout, nb, bs, hk, d, dtype, xp=np):
    ks, vs = cache_shapes(layout, nb, bs, hk, d, dtype)
    return xp.asarray(_rand(rng, ks, dtype)), xp.asarray(_rand(rng, vs, dtype))


def _bits(a):
    a = a.get() if hasattr(a, "get") else np.asarray(a)
    return a.view(np.uint8)


# ----------------------------------------------------------------------------- reference
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_reference_write_matches_loop(rng, layout, dtype):
    nb, bs, hk, d, t = 5, 4, 3, 16, 11
    k, v = _caches(rng, layout, nb, bs, hk, d, dtype)
    k0, v0 = k.copy(), v.copy()
    key, value = _rand(rng, (t, hk, d), dtype), _rand(rng, (t, hk, d), dtype)
    slots = _slots(rng, t, nb * bs)
    ref.write_kv_cache(key, value, k, v, slots, layout)
    want_k, want_v = k_as_nhd(k0, layout).copy(), v_as_nhd(v0, layout).copy()
    for i, s in enumerate(slots):
        if s >= 0:
            want_k[s // bs, s % bs] = key[i]
            want_v[s // bs, s % bs] = value[i]
    np.testing.assert_array_equal(k_as_nhd(k, layout), want_k)
    np.testing.assert_array_equal(v_as_nhd(v, layout), want_v)


def test_reference_vllm_key_layout_by_hand():
    k, v = (np.zeros(s, np.float16) for s in cache_shapes("vllm", 2, 4, 1, 16, np.float16))
    key = np.arange(16, dtype=np.float16).reshape(1, 1, 16)
    ref.write_kv_cache(key, key + 100, k, v, np.array([6], np.int64), "vllm")
    np.testing.assert_array_equal(k[1, 0, 1, 2], np.arange(8, 16))     # x = 8
    np.testing.assert_array_equal(v[1, 0, :, 2], np.arange(16) + 100)
    assert np.count_nonzero(k) == 15 and np.count_nonzero(v) == 16


def test_reference_copy_and_swap_match_loop(rng):
    k, v = _rand(rng, (6, 2, 3), np.float32), _rand(rng, (6, 2, 3), np.float32)
    pairs = np.array([[0, 3], [1, 5], [0, 4]])
    want_k, want_v = k.copy(), v.copy()
    for s, d in pairs:
        want_k[d], want_v[d] = k[s], v[s]
    ref.copy_blocks(k, v, pairs)
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(v, want_v)
    dst = np.zeros((3, 2, 3), np.float32)
    ref.swap_blocks(k, dst, np.array([[5, 0], [2, 2]]))
    np.testing.assert_array_equal(dst, np.stack([k[5], np.zeros((2, 3)), k[2]]))


# ----------------------------------------------------------------------------- NumPy path
@pytest.mark.parametrize("layout", LAYOUTS)
def test_public_numpy_path_is_reference(rng, layout):
    dtype = bfloat16
    k, v = _caches(rng, layout, 4, 8, 2, 64, dtype)
    k1, v1 = k.copy(), v.copy()
    key, value = _rand(rng, (13, 2, 64), dtype), _rand(rng, (13, 2, 64), dtype)
    slots = _slots(rng, 13, 32)
    out = cupaged.write_kv_cache(key, value, k, v, slots, layout=layout)
    assert out[0] is k and out[1] is v
    ref.write_kv_cache(key, value, k1, v1, slots, layout)
    assert (_bits(k) == _bits(k1)).all() and (_bits(v) == _bits(v1)).all()
    pairs = np.array([[0, 2], [1, 3]], np.int32)
    cupaged.copy_blocks(k, v, pairs)
    ref.copy_blocks(k1, v1, pairs)
    assert (_bits(k) == _bits(k1)).all() and (_bits(v) == _bits(v1)).all()
    host = np.zeros_like(v)
    assert cupaged.swap_blocks(v, host, [[3, 0]]) is host
    assert (_bits(host[0]) == _bits(v[3])).all() and not host[1:].any()


def _write_args(rng, layout="NHD"):
    k, v = _caches(rng, layout, 4, 8, 2, 64, np.float16)
    key, value = _rand(rng, (5, 2, 64), np.float16), _rand(rng, (5, 2, 64), np.float16)
    return dict(key=key, value=value, k_cache=k, v_cache=v,
                slot_mapping=np.array([0, 9, -1, 31, 4], np.int64), layout=layout)


WRITE_ERRORS = [
    ("layout", "HDN", ValueError, "layout: expected one of"),
    ("key", lambda a: a["key"].astype(np.float32), TypeError, "key: expected dtype float16"),
    ("key", lambda a: a["key"][:, :1], ValueError, r"key: expected shape \[\*, 2, 64\]"),
    ("value", lambda a: a["value"][:4], ValueError, r"value: expected shape \[5, 2, 64\]"),
    ("value", lambda a: a["value"][..., ::-1], ValueError, "value: expected dense heads"),
    ("k_cache", lambda a: np.ascontiguousarray(a["k_cache"][:, :4]), ValueError,
     r"v_cache: expected shape \[4, 4, 2, 64\] to match k_cache"),
    ("k_cache", lambda a: a["k_cache"][:, ::-1], ValueError, "k_cache: expected dense blocks"),
    ("v_cache", lambda a: a["v_cache"].astype(np.float32), TypeError, "v_cache: expected dtype"),
    ("slot_mapping", lambda a: a["slot_mapping"].astype(np.int32), TypeError,
     "slot_mapping: expected dtype int64"),
    ("slot_mapping", lambda a: a["slot_mapping"][:4], ValueError, r"slot_mapping: expected shape \[5\]"),
    ("slot_mapping", lambda a: np.array([0, 9, -1, 32, 4]), ValueError,
     r"slot_mapping: expected entries in \[0, 32\) or \[-1\], got 32 at index 3"),
    ("slot_mapping", lambda a: np.array([0, 9, -2, 3, 4]), ValueError, "got -2 at index 2"),
    ("key", lambda a: list(a["key"]), TypeError, "expected numpy.ndarray or cupy.ndarray"),
]


@pytest.mark.parametrize("arg, bad, err, msg", WRITE_ERRORS)
def test_write_bad_input_raises_and_changes_nothing(rng, arg, bad, err, msg):
    args = _write_args(rng)
    k, v = args["k_cache"], args["v_cache"]
    k0, v0 = k.copy(), v.copy()
    args[arg] = bad(args) if callable(bad) else bad
    with pytest.raises(err, match=msg):
        cupaged.write_kv_cache(**args)
    np.testing.assert_array_equal(k, k0)
    np.testing.assert_array_equal(v, v0)


def test_write_rejects_short_rows(rng):
    k = v = np.zeros((4, 8, 2, 4), np.float16)
    key = np.zeros((1, 2, 4), np.float16)
    with pytest.raises(ValueError, match="k_cache: expected head_dim .* multiple of 16 bytes"):
        cupaged.write_kv_cache(key, key, k, v, np.zeros(1, np.int64))


def test_write_bad_vllm_geometry(rng):
    args = _write_args(rng, "vllm")
    args["k_cache"] = args["k_cache"].reshape(4, 2, 4, 8, 2, 8)
    with pytest.raises(ValueError, match="k_cache: expected 5 dimensions"):
        cupaged.write_kv_cache(**args)


@pytest.mark.parametrize("mapping, err, msg", [
    ([[0, 4]], ValueError, r"destination blocks\): expected entries in \[0, 4\)"),
    ([[-1, 2]], ValueError, r"source blocks\): expected entries in \[0, 4\), got -1"),
    ([[0, 2], [1, 2]], ValueError, "block 2 appears more than once"),
    ([[0, 2], [2, 3]], ValueError, "block 2 is both a source and a destination"),
    ([[0.0, 2.0]], TypeError, "expected an integer array"),
    ([0, 2], ValueError, r"expected shape \[num_pairs, 2\]"),
])
def test_copy_blocks_bad_mapping_changes_nothing(rng, mapping, err, msg):
    k, v = _rand(rng, (4, 3, 8), np.float16), _rand(rng, (4, 3, 8), np.float16)
    k0, v0 = k.copy(), v.copy()
    with pytest.raises(err, match=msg):
        cupaged.copy_blocks(k, v, np.asarray(mapping))
    np.testing.assert_array_equal(k, k0)
    np.testing.assert_array_equal(v, v0)


def test_copy_and_swap_bad_caches(rng):
    k = _rand(rng, (4, 3, 8), np.float16)
    with pytest.raises(ValueError, match="v_cache: expected 4 blocks"):
        cupaged.copy_blocks(k, _rand(rng, (5, 3, 8), np.float16), [[0, 1]])
    with pytest.raises(TypeError, match="v_cache: expected dtype float16"):
        cupaged.copy_blocks(k, k.astype(np.float32), [[0, 1]])
    with pytest.raises(ValueError, match=r"dst_cache: expected blocks of shape \(3, 8\)"):
        cupaged.swap_blocks(k, np.zeros((4, 3, 4), np.float16), [[0, 1]])
    with pytest.raises(ValueError, match="src_cache: expected a cache"):
        cupaged.swap_blocks(k[0, 0], k[0, 0], [[0, 1]])
    with pytest.raises(ValueError, match="method: expected one of"):
        cupaged.swap_blocks(k, k.copy(), [[0, 1]], method="dma")
    with pytest.raises(ValueError, match=r"source blocks\): expected entries in \[0, 4\), got 9"):
        cupaged.swap_blocks(k, np.zeros((9, 3, 8), np.float16), [[9, 1]])
    with pytest.raises(ValueError, match="both a source and a destination"):
        cupaged.swap_blocks(k, k, [[0, 1], [1, 2]])        # same memory: must be disjoint
    assert not cupaged.swap_blocks(k, np.zeros_like(k), np.zeros((0, 2), np.int64)).any()


def test_write_duplicate_slots_one_row_wins_unless_strict(rng):
    """Two tokens with one slot write one of their rows (vLLM's rule); strict mode refuses
    them before anything is written."""
    args = _write_args(rng)
    slots = args["slot_mapping"].copy()
    slots[1] = slots[0]
    k0 = args["k_cache"].copy()
    with pytest.raises(ValueError, match=f"slot {slots[0]} appears more than once"):
        cupaged.write_kv_cache(**{**args, "slot_mapping": slots}, validate=True)
    np.testing.assert_array_equal(args["k_cache"], k0)
    cupaged.write_kv_cache(**{**args, "slot_mapping": slots})
    bs = args["k_cache"].shape[1]
    row = args["k_cache"][slots[0] // bs, slots[0] % bs]
    assert any(np.array_equal(row, args["key"][t]) for t in (0, 1))


# ----------------------------------------------------------------------------- planning
def test_write_launch_config():
    geo = CacheGeometry(10, 16, 8, 128)
    expr, grid, smem, f = cache_ops.write_launch_config(1001, geo, 2, "NHD")
    assert expr == "cupaged::write_rows<false, cupaged::Bits>" and f["tpt_log2"] == 7 and f["row_vecs"] == 128
    per_cta = cache_ops.WRITE_UNROLL * (cache_ops.THREADS >> 7)  # a 128-thread group a token
    assert grid == (-(-1001 // per_cta), 1)  # one vector step: 128 vectors a row
    assert smem == 2 * cache_ops.WRITE_UNROLL * cache_ops.THREADS * 16  # staging slots
    # 64 heads x d128: 1024 vectors a row, four steps of 256 threads
    _, grid, _, f = cache_ops.write_launch_config(1001, CacheGeometry(10, 16, 64, 128), 2, "NHD")
    assert f["tpt_log2"] == 8 and grid == (-(-1001 // cache_ops.WRITE_UNROLL), 4)
    expr, grid, _, f = cache_ops.write_launch_config(1001, CacheGeometry(10, 16, 1, 64), 2, "HND")
    per_cta = cache_ops.WRITE_UNROLL * (cache_ops.THREADS >> 3)
    assert expr == "cupaged::write_rows<true, cupaged::Bits>" and f["tpt_log2"] == 3
    assert grid == (-(-1001 // per_cta), 1)
    expr, grid, smem, ints = cache_ops.write_launch_config(65, geo, 4, "vllm")
    tile = cache_ops.VLLM_TILE
    assert expr == "cupaged::write_vllm<unsigned int, cupaged::Bits>" and grid == (-(-65 // tile), 8)
    assert smem == 2 * tile * 33 * 16                        # 32 vectors per row, padded to 33
    assert cache_ops.write_launch_config(65, CacheGeometry(1, 1, 1, 256), 4, "vllm")[2] > 48 << 10


def test_copy_grid_and_block_runs():
    assert cache_ops.copy_grid(70000, 32768, 2) == (70000, 2, 2)
    assert cache_ops.copy_grid(3, 16, 1) == (3, 1, 1)
    pairs = np.array([[5, 9], [3, 1], [4, 2], [6, 10], [8, 0], [7, 20]])
    np.testing.assert_array_equal(cache_ops.block_runs(pairs),
                                  [[3, 1, 2], [5, 9, 2], [7, 20, 1], [8, 0, 1]])


def test_swap_method_follows_run_length():
    scattered = np.stack([np.arange(0, 64, 2), np.arange(32)], axis=1)
    runs = np.stack([np.arange(64), np.arange(64)], axis=1)
    assert cache_ops.swap_method(scattered, 32 << 10) == "kernel"
    assert cache_ops.swap_method(runs, 32 << 10) == "memcpy"         # one 2 MiB run
    assert cache_ops.swap_method(scattered[:1], 2 << 20) == "memcpy"


def test_kernel_specializations_cover_launches():
    exprs = {s.expr for s in cache_ops.kernel_specializations()}
    for layout in LAYOUTS:
        for itemsize in (2, 4):
            geo = CacheGeometry(4, 16, 2, 64)
            assert cache_ops.write_launch_config(5, geo, itemsize, layout)[0] in exprs
    assert "cupaged::copy_blocks_kernel" in exprs


# ----------------------------------------------------------------------------- GPU
def _check_gpu_write(rng, cp, layout, dtype, nb, bs, hk, d, t):
    k, v = _caches(rng, layout, nb, bs, hk, d, dtype)
    key, value = _rand(rng, (t, hk, d), dtype), _rand(rng, (t, hk, d), dtype)
    slots = _slots(rng, t, nb * bs)
    dk, dv = cp.asarray(k), cp.asarray(v)
    cupaged.write_kv_cache(cp.asarray(key), cp.asarray(value), dk, dv, cp.asarray(slots),
                           layout=layout)
    ref.write_kv_cache(key, value, k, v, slots, layout)
    assert (_bits(dk) == _bits(k)).all(), "key cache differs"
    assert (_bits(dv) == _bits(v)).all(), "value cache differs"


# ----------------------------------------------------------------------------- fp8 writes
FP8_FORMATS = tuple(FP8)


def _fp8_rows(rng, shape, dtype):
    """Rows of magnitudes from the formats' subnormals to past their largest values (which
    saturate), with +-inf and a NaN among them."""
    x = rng.standard_normal(shape) * 10.0 ** rng.integers(-7, 7, shape)
    flat = x.reshape(-1)
    flat[rng.choice(flat.size, 3, replace=False)] = [np.inf, -np.inf, np.nan]
    with np.errstate(over="ignore"):  # past float16's range: infinities, which saturate too
        return x.astype(dtype)


def _fp8_scales(rng, form, hk):
    if form == "float":
        return 0.37, 1.9
    if form == "tensor":
        return np.array(0.37, np.float32), np.array([1.9], np.float32)
    return (rng.uniform(0.01, 4, hk).astype(np.float32),
            rng.uniform(0.01, 4, hk).astype(np.float32))


def _fp8_caches(rng, layout, nb, bs, hk, d):
    """Random codes, infinities excepted (e5m2's 0x7c and 0xfc): slots a write leaves
    alone must read back as they were, and no written slot may hold an infinity."""
    ks, vs = cache_shapes(layout, nb, bs, hk, d, np.uint8)
    k, v = (rng.integers(0, 256, s, dtype=np.uint8) for s in (ks, vs))
    for c in (k, v):
        c[(c & 0x7f) == 0x7c] = 0x3c
    return k, v


def test_fp8_write_host_checks(rng):
    k8, v8 = _fp8_caches(rng, "NHD", 4, 16, 2, 64)
    k0 = k8.copy()
    key = _fp8_rows(rng, (3, 2, 64), np.float16)
    slots = np.array([0, 5, -1], np.int64)
    with pytest.raises(ValueError, match="kv_dtype: expected one of .* for uint8 caches"):
        cupaged.write_kv_cache(key, key, k8, v8, slots)
    with pytest.raises(ValueError, match="kv_dtype: expected one of"):
        cupaged.write_kv_cache(key, key, k8, v8, slots, kv_dtype="e4m3")
    with pytest.raises(TypeError, match="value: expected dtype float16, got float32"):
        cupaged.write_kv_cache(key, key.astype(np.float32), k8, v8, slots, kv_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="v_scale: expected finite positive"):
        cupaged.write_kv_cache(key, key, k8, v8, slots, kv_dtype="fp8_e4m3", v_scale=0.0)
    k16, v16 = _caches(rng, "NHD", 4, 16, 2, 64, np.float16)
    with pytest.raises(ValueError, match="k_scale: expected None for caches that are not fp8"):
        cupaged.write_kv_cache(key, key, k16, v16, slots, k_scale=0.5)
    assert (k8 == k0).all()


def test_fp8_write_numpy_path_is_reference(rng):
    k8, v8 = _fp8_caches(rng, "vllm", 4, 16, 2, 64)
    k1, v1 = k8.copy(), v8.copy()
    key, value = _fp8_rows(rng, (9, 2, 64), bfloat16), _fp8_rows(rng, (9, 2, 64), bfloat16)
    slots = _slots(rng, 9, 64)
    ks, vs = _fp8_scales(rng, "heads", 2)
    cupaged.write_kv_cache(key, value, k8, v8, slots, layout="vllm", kv_dtype="fp8_e5m2",
                           k_scale=ks, v_scale=vs)
    ref.write_kv_cache(key, value, k1, v1, slots, "vllm", kv_dtype="fp8_e5m2", k_scale=ks,
                       v_scale=vs)
    assert (k8 == k1).all() and (v8 == v1).all()


FP8_WRITES = [(layout, fmt, dtype, bs) for layout, bs in zip(LAYOUTS, (16, 1, 128))
              for fmt in FP8_FORMATS for dtype in DTYPES]


def _assert_same_codes(got, want, fmt):
    """Bit for bit, NaN codes as NaN (the kernel's NaN sign may differ), no infinity."""
    f8 = FP8[fmt].dtype
    nan = np.isnan(want.view(f8).astype(np.float32))
    assert (got[~nan] == want[~nan]).all(), "codes differ"
    assert np.isnan(got[nan].view(f8).astype(np.float32)).all(), "NaN not kept"
    assert np.isfinite(got[~nan].view(f8).astype(np.float32)).all(), "an infinity was written"


@pytest.mark.gpu
@pytest.mark.parametrize("layout,fmt,dtype,bs", FP8_WRITES,
                         ids=[f"{l}-{f}-{np.dtype(d).name}-bs{b}" for l, f, d, b in FP8_WRITES])
def test_gpu_fp8_write_bit_exact(rng, cp, layout, fmt, dtype, bs):
    """The kernels quantise exactly as the reference (round to nearest even, saturation,
    subnormals) for every layout, format, input dtype and scale shape; skipped tokens and
    untouched slots keep their bytes; a second call (the cached setup) reads the device
    scale arrays anew."""
    nb, hk, d, t = max(3, 300 // bs), 3, 128, 97
    form = ("float", "tensor", "heads")[FP8_WRITES.index((layout, fmt, dtype, bs)) % 3]
    k8, v8 = _fp8_caches(rng, layout, nb, bs, hk, d)
    dk, dv = cp.asarray(k8), cp.asarray(v8)
    for call in range(2):
        key, value = _fp8_rows(rng, (t, hk, d), dtype), _fp8_rows(rng, (t, hk, d), dtype)
        slots = _slots(rng, t, nb * bs)
        ks, vs = _fp8_scales(rng, form, hk)
        dev_scales = [cp.asarray(x) if isinstance(x, np.ndarray) else x for x in (ks, vs)]
        cupaged.write_kv_cache(cp.asarray(key), cp.asarray(value), dk, dv, cp.asarray(slots),
                               layout=layout, kv_dtype=fmt, k_scale=dev_scales[0],
                               v_scale=dev_scales[1])
        ref.write_kv_cache(key, value, k8, v8, slots, layout, kv_dtype=fmt, k_scale=ks,
                           v_scale=vs)
        _assert_same_codes(dk.get(), k8, fmt)
        _assert_same_codes(dv.get(), v8, fmt)


# per-head scales: ordinary ones, significands of all ones (1.99999988, 0.99999994, where a
# reciprocal's product is not the quotient), powers of two, and scales outside [2^-60, 2^60]
EDGE_SCALES = np.array([0.37, 1.9, float.fromhex("0x1.fffffep0"), float.fromhex("0x1.fffffep-1"),
                        1.0, 2.0 ** -20, 2.0 ** -70, 2.0 ** 70], np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("dtype", [np.float16, bfloat16])
def test_gpu_fp8_write_every_input_value_and_edge_scales(rng, cp, fmt, dtype):
    """Every 16-bit value of the input dtype (subnormals, infinities, NaNs, -0) quantised
    against every scale of EDGE_SCALES (a head each, the values rotated through the heads),
    bit for bit as the reference: the write's quotients come from one reciprocal a scale,
    exact where that holds and by division where not."""
    hk, d = len(EDGE_SCALES), 128
    every = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    t = every.size // d
    nb, bs = t // 16 + 2, 16
    k8, v8 = _fp8_caches(rng, "NHD", nb, bs, hk, d)
    dk, dv = cp.asarray(k8), cp.asarray(v8)
    slots = rng.permutation(nb * bs)[:t].astype(np.int64)
    for shift in range(hk):
        heads = [np.roll(every, (h + shift) * 4099).reshape(t, d) for h in range(hk)]
        key = np.stack(heads, axis=1)
        value = -key
        cupaged.write_kv_cache(cp.asarray(key), cp.asarray(value), dk, dv, cp.asarray(slots),
                               layout="NHD", kv_dtype=fmt, k_scale=cp.asarray(EDGE_SCALES),
                               v_scale=cp.asarray(EDGE_SCALES[::-1].copy()))
        ref.write_kv_cache(key, value, k8, v8, slots, "NHD", kv_dtype=fmt, k_scale=EDGE_SCALES,
                           v_scale=EDGE_SCALES[::-1].copy())
        _assert_same_codes(dk.get(), k8, fmt)
        _assert_same_codes(dv.get(), v8, fmt)


@pytest.mark.gpu
def test_gpu_fp8_write_strided_rows_and_device_scale_checks(rng, cp):
    """Key and value as views of a fused qkv tensor; device scale shapes and dtypes refused
    on the host, their values only in strict mode."""
    hk, d, t = 4, 64, 33
    k8, v8 = _fp8_caches(rng, "HND", 5, 16, hk, d)
    dk, dv = cp.asarray(k8), cp.asarray(v8)
    qkv = _fp8_rows(rng, (t, 3 * hk, d), np.float16)
    dqkv = cp.asarray(qkv)
    slots = _slots(rng, t, 80)
    ks = rng.uniform(0.1, 2, hk).astype(np.float32)
    cupaged.write_kv_cache(dqkv[:, hk:2 * hk], dqkv[:, 2 * hk:], dk, dv, cp.asarray(slots),
                           layout="HND", kv_dtype="fp8_e4m3", k_scale=cp.asarray(ks))
    ref.write_kv_cache(qkv[:, hk:2 * hk], qkv[:, 2 * hk:], k8, v8, slots, "HND",
                       kv_dtype="fp8_e4m3", k_scale=ks)
    _assert_same_codes(dk.get(), k8, "fp8_e4m3")
    _assert_same_codes(dv.get(), v8, "fp8_e4m3")
    args = (dqkv[:, :hk], dqkv[:, :hk], dk, dv, cp.asarray(slots))
    with pytest.raises(TypeError, match="k_scale: expected dtype float32, got float64"):
        cupaged.write_kv_cache(*args, layout="HND", kv_dtype="fp8_e4m3",
                               k_scale=cp.ones(hk, np.float64))
    with pytest.raises(ValueError, match=r"v_scale: expected shape \[\], \[1\] or \[4\]"):
        cupaged.write_kv_cache(*args, layout="HND", kv_dtype="fp8_e4m3",
                               v_scale=cp.ones(2, np.float32))
    with pytest.raises(ValueError, match="k_scale: expected finite positive"):
        cupaged.write_kv_cache(*args, layout="HND", kv_dtype="fp8_e4m3",
                               k_scale=cp.zeros(hk, np.float32), validate=True)
    _assert_same_codes(dk.get(), k8, "fp8_e4m3")  # nothing written


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [1, 8, 16, 32, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_write_bit_exact(rng, cp, layout, dtype, bs):
    nb = max(3, 300 // bs)
    _check_gpu_write(rng, cp, layout, dtype, nb, bs, 3, 128, min(nb * bs, 257))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 80, 96, 112, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_write_head_dims(rng, cp, layout, dtype, d):
    _check_gpu_write(rng, cp, layout, dtype, 7, 16, 5, d, 97)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [None, "fp8_e4m3"])
@pytest.mark.parametrize("hk,t", [(32, 6001), (8, 8193), (3, 20011)])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_gpu_write_many_tokens_and_steps(rng, cp, layout, hk, t, fmt):
    """Thousands of CTAs; at 32 heads x d128 two vector steps a token (grid y), at 3 heads
    rows of 48 vectors in 64-thread groups, lanes past the row idle."""
    bs, d = 16, 128
    nb = -(-t // bs) + 7
    if fmt is None:
        k, v = _caches(rng, layout, nb, bs, hk, d, bfloat16)
        key, value = _rand(rng, (t, hk, d), bfloat16), _rand(rng, (t, hk, d), bfloat16)
        scales = {}
    else:
        k, v = _fp8_caches(rng, layout, nb, bs, hk, d)
        key, value = _fp8_rows(rng, (t, hk, d), bfloat16), _fp8_rows(rng, (t, hk, d), bfloat16)
        ks, vs = _fp8_scales(rng, "heads", hk)
        scales = dict(kv_dtype=fmt, k_scale=ks, v_scale=vs)
    slots = _slots(rng, t, nb * bs)
    dk, dv = cp.asarray(k), cp.asarray(v)
    dev = {n: cp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in scales.items()}
    cupaged.write_kv_cache(cp.asarray(key), cp.asarray(value), dk, dv, cp.asarray(slots),
                           layout=layout, **dev)
    ref.write_kv_cache(key, value, k, v, slots, layout, **scales)
    if fmt is None:
        assert (_bits(dk) == _bits(k)).all() and (_bits(dv) == _bits(v)).all()
    else:
        _assert_same_codes(dk.get(), k, fmt)
        _assert_same_codes(dv.get(), v, fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_write_consecutive_prefill_slots(rng, cp, layout):
    """A prefill writes consecutive slots; also the zero-token and all-skipped cases."""
    k, v = _caches(rng, layout, 40, 16, 8, 128, bfloat16)
    dk, dv = cp.asarray(k), cp.asarray(v)
    key, value = _rand(rng, (611, 8, 128), bfloat16), _rand(rng, (611, 8, 128), bfloat16)
    slots = np.arange(3, 614, dtype=np.int64)
    cupaged.write_kv_cache(cp.asarray(key), cp.asarray(value), dk, dv, cp.asarray(slots),
                           layout=layout)
    ref.write_kv_cache(key, value, k, v, slots, layout)
    none = cp.full(5, -1, cp.int64)
    cupaged.write_kv_cache(cp.asarray(key[:5]), cp.asarray(value[:5]), dk, dv, none,
                           layout=layout)
    cupaged.write_kv_cache(cp.asarray(key[:0]), cp.asarray(value[:0]), dk, dv, none[:0],
                           layout=layout)
    assert (_bits(dk) == _bits(k)).all() and (_bits(dv) == _bits(v)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_copy_blocks(rng, cp, layout, dtype):
    k, v = _caches(rng, layout, 50, 16, 3, 64, dtype)
    dk, dv = cp.asarray(k), cp.asarray(v)
    perm = rng.permutation(50)
    pairs = np.stack([perm[:17], perm[17:34]], axis=1).astype(np.int32)
    cupaged.copy_blocks(dk, dv, cp.asarray(pairs))
    ref.copy_blocks(k, v, pairs)
    assert (_bits(dk) == _bits(k)).all() and (_bits(dv) == _bits(v)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["kernel", "memcpy", "auto"])
def test_gpu_swap_round_trip(rng, cp, method):
    import cupyx
    k, _ = _caches(rng, "HND", 64, 16, 4, 128, np.float16)
    dev = cp.asarray(k)
    host = cupyx.empty_pinned((20,) + k.shape[1:], np.float16)
    host[...] = _rand(rng, host.shape, np.float16)
    expect_host = host.copy()
    out_pairs = np.array([[5, 0], [6, 1], [7, 2], [40, 9], [2, 19], [3, 18]])
    ref.swap_blocks(k, expect_host, out_pairs)
    assert cupaged.swap_blocks(dev, host, out_pairs, method=method) is host
    cp.cuda.get_current_stream().synchronize()
    assert (_bits(host) == _bits(expect_host)).all()
    in_pairs = np.array([[0, 60], [1, 61], [9, 5], [19, 0], [12, 30]])
    ref.swap_blocks(expect_host, k, in_pairs)
    cupaged.swap_blocks(host, dev, in_pairs, method=method)
    assert (_bits(dev) == _bits(k)).all()
    other = cp.asarray(_rand(rng, (8,) + k.shape[1:], np.float16))
    expect_other = other.get()
    dev_pairs = np.array([[60, 0], [61, 1], [5, 7]])        # device to device
    ref.swap_blocks(k, expect_other, dev_pairs)
    cupaged.swap_blocks(dev, other, dev_pairs, method=method)
    assert (_bits(other) == _bits(expect_other)).all()


@pytest.mark.gpu
def test_gpu_swap_needs_pinned_host(rng, cp):
    dev = cp.zeros((4, 16, 64), cp.float16)
    pageable = np.ones((4, 16, 64), np.float16)
    with pytest.raises(ValueError, match="dst_cache: expected a NumPy array in pinned"):
        cupaged.swap_blocks(dev, pageable, [[0, 1]])
    with pytest.raises(TypeError, match="mix NumPy"):
        cupaged.copy_blocks(dev, pageable, [[0, 1]])
    assert (pageable == 1).all()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.bigmem
def test_gpu_cache_past_2_31_elements(rng, cp, layout):
    """Blocks starting beyond 2**31 elements: write there, copy down and back up."""
    bs, hk, d = 16, 8, 128
    per_block = bs * hk * d
    nb = 2 ** 31 // per_block + 64                    # 4.3 GB per fp16 cache
    ks, vs = cache_shapes(layout, nb, bs, hk, d, np.float16)
    dk, dv = cp.empty(ks, cp.float16), cp.empty(vs, cp.float16)
    top = np.arange(nb - 8, nb)
    low = np.arange(8)
    for blocks in (top, low):
        for c in (dk, dv):
            c[blocks[0]:blocks[-1] + 1] = cp.asarray(_rand(rng, (8,) + c.shape[1:], np.float16))
    assert int(top[0]) * per_block >= 2 ** 31
    hk_, hv_ = dk[nb - 8:].get(), dv[nb - 8:].get()   # reference on the top 8 blocks only
    slots = _slots(rng, 101, 8 * bs)
    key, value = _rand(rng, (101, hk, d), np.float16), _rand(rng, (101, hk, d), np.float16)
    dev_slots = np.where(slots >= 0, slots + (nb - 8) * bs, -1)
    cupaged.write_kv_cache(cp.asarray(key), cp.asarray(value), dk, dv, cp.asarray(dev_slots),
                           layout=layout)
    ref.write_kv_cache(key, value, hk_, hv_, slots, layout)
    assert (_bits(dk[nb - 8:]) == _bits(hk_)).all() and (_bits(dv[nb - 8:]) == _bits(hv_)).all()
    cupaged.copy_blocks(dk, dv, np.stack([top[:4], low[:4]], axis=1))
    cupaged.copy_blocks(dk, dv, np.stack([low[4:], top[4:]], axis=1))
    assert (_bits(dk[:4]) == _bits(hk_[:4])).all() and (_bits(dv[:4]) == _bits(hv_[:4])).all()
    assert (_bits(dk[nb - 4:]) == _bits(dk[4:8])).all()
    assert (_bits(dv[nb - 4:]) == _bits(dv[4:8])).all()
    del dk, dv
    cp.get_default_memory_pool().free_all_blocks()


@pytest.mark.gpu
def test_gpu_torch_tensors_on_side_stream(rng):
    torch = pytest.importorskip("torch")
    dev = torch.device("cuda")
    k, v = _caches(rng, "vllm", 12, 16, 2, 64, np.float16)
    tk, tv = torch.from_numpy(k.copy()).to(dev), torch.from_numpy(v.copy()).to(dev)
    key, value = _rand(rng, (37, 2, 64), np.float16), _rand(rng, (37, 2, 64), np.float16)
    slots = _slots(rng, 37, 12 * 16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        tkey, tval = torch.from_numpy(key).to(dev), torch.from_numpy(value).to(dev)
        tslots = torch.from_numpy(slots).to(dev)
        ok, ov = cupaged.write_kv_cache(tkey, tval, tk, tv, tslots, layout="vllm")
        assert isinstance(ok, torch.Tensor) and ok.data_ptr() == tk.data_ptr()
        assert ov.data_ptr() == tv.data_ptr()
        pairs = torch.tensor([[0, 5], [1, 6]], dtype=torch.int64, device=dev)
        ck, _ = cupaged.copy_blocks(tk, tv, pairs)
        assert ck.data_ptr() == tk.data_ptr()
        host = torch.empty((3,) + tuple(tk.shape[1:]), dtype=torch.float16).pin_memory()
        cupaged.swap_blocks(tk, host.numpy(), [[5, 0], [6, 1], [7, 2]])
    stream.synchronize()
    ref.write_kv_cache(key, value, k, v, slots, "vllm")
    ref.copy_blocks(k, v, [[0, 5], [1, 6]])
    assert (tk.cpu().numpy() == k).all() and (tv.cpu().numpy() == v).all()
    assert (host.numpy() == k[5:8]).all()
