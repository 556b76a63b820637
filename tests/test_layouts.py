"""Caches that carry their layout (CacheView, PagedKVCache), the refusal of raw caches
whose shape reads as both NHD and HND without a layout, and the shapes, geometry and strides
of 1-byte (fp8) caches (CPU, NumPy backend)."""
import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged.core.layouts import (CACHE_DTYPES, LAYOUTS, cache_geometry, cache_shapes,
                                  cache_strides, head_axis, k_as_nhd, key_geometry,
                                  layout_strides, resolve_layout, v_as_nhd, vllm_x)

D = 64


def _batch(rng, layout, hq=8, hk=2, bs=4, nb=10, lens=(7, 3)):
    """A NumPy float32 cache in ``layout`` (a PagedKVCache), tables, lengths and queries."""
    cache = cupaged.PagedKVCache(nb, bs, hk, D, dtype="float32", layout=layout, xp=np)
    cache.k[...] = rng.standard_normal(cache.k.shape)
    cache.v[...] = rng.standard_normal(cache.v.shape)
    lens = np.array(lens, np.int32)
    width = int(-(-lens.max() // bs))
    tables = rng.permutation(nb)[:len(lens) * width].reshape(len(lens), width).astype(np.int32)
    q = rng.standard_normal((len(lens), hq, D)).astype(np.float32)
    return cache, tables, lens, q


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ops_take_the_cache_object(rng, layout):
    cache, bt, sl, q = _batch(rng, layout)
    want = cupaged.paged_decode(q, cache.k, cache.v, bt, sl, layout=layout)
    np.testing.assert_array_equal(cupaged.paged_decode(q, cache, bt, sl), want)
    view = cupaged.CacheView(cache.k, cache.v, layout=layout, block_size=4)
    np.testing.assert_array_equal(cupaged.paged_decode(q, view, bt, sl), want)
    dec = cupaged.PagedDecoder(8, 2, D, 4, dtype="float32", layout=layout, xp=np).plan(bt, sl)
    np.testing.assert_array_equal(dec.run(q, cache), want)

    cu = np.array([0, 1, 2], np.int32)
    want = cupaged.paged_prefill(q, cache.k, cache.v, cu, bt, sl, layout=layout)
    np.testing.assert_array_equal(cupaged.paged_prefill(q, cache, cu, bt, sl), want)
    np.testing.assert_array_equal(cupaged.paged_attention(q, view, cu, bt, sl), want)
    pre = cupaged.PagedPrefiller(8, 2, D, 4, dtype="float32", layout=layout).plan(cu, bt, sl)
    np.testing.assert_array_equal(pre.run(q, k_cache=cache), want)


def test_cache_write_takes_the_cache_object(rng):
    cache, _, _, _ = _batch(rng, "HND")
    other = cupaged.PagedKVCache(10, 4, 2, D, dtype="float32", layout="HND", xp=np)
    other.k[...], other.v[...] = cache.k, cache.v
    key, value = (rng.standard_normal((3, 2, D)).astype(np.float32) for _ in range(2))
    slots = np.array([0, 5, 17], np.int64)
    cupaged.write_kv_cache(key, value, cache, slots)
    cupaged.write_kv_cache(key, value, other.k, other.v, slots, layout="HND")
    np.testing.assert_array_equal(cache.k, other.k)
    np.testing.assert_array_equal(cache.v, other.v)


def test_cache_object_layout_must_agree(rng):
    cache, bt, sl, q = _batch(rng, "HND")
    with pytest.raises(ValueError, match="k_cache: expected a cache in the layout= given 'NHD'"):
        cupaged.paged_decode(q, cache, bt, sl, layout="NHD")
    dec = cupaged.PagedDecoder(8, 2, D, 4, dtype="float32", layout="NHD", xp=np).plan(bt, sl)
    with pytest.raises(ValueError, match="PagedDecoder's layout 'NHD', got a 'HND' PagedKVCache"):
        dec.run(q, cache)
    with pytest.raises(ValueError, match="block_size: expected 4"):
        cupaged.CacheView(cache.k, cache.v, layout="HND", block_size=8)
    with pytest.raises(ValueError, match="layout"):
        cupaged.CacheView(cache.k, cache.v, layout="hnd")


def test_ambiguous_raw_cache_is_refused(rng):
    # [nb, 4, 4, D] with 8 query heads: NHD (block 4, 4 kv heads) and HND (4 kv heads,
    # block 4) both read validly, and give different numbers.
    cache, bt, sl, q = _batch(rng, "HND", hk=4, bs=4)
    with pytest.raises(ValueError, match=r"k_cache: shape \(10, 4, 4, 64\) reads as NHD .* and "
                                         r"as HND .*pass layout='NHD' or layout='HND'"):
        cupaged.paged_decode(q, cache.k, cache.v, bt, sl)
    cu = np.array([0, 1, 2], np.int32)
    for op in (cupaged.paged_prefill, cupaged.paged_attention):
        with pytest.raises(ValueError, match="k_cache: shape"):
            op(q, cache.k, cache.v, cu, bt, sl)
    right = cupaged.paged_decode(q, cache.k, cache.v, bt, sl, layout="HND")
    np.testing.assert_array_equal(cupaged.paged_decode(q, cache, bt, sl), right)
    wrong = cupaged.paged_decode(q, cache.k, cache.v, bt, sl, layout="NHD")
    assert not np.allclose(wrong, right)  # what the default used to give silently


def test_ambiguous_raw_cache_is_refused_by_wrappers_without_a_layout(rng):
    cache, bt, sl, q = _batch(rng, "HND", hk=4, bs=4)
    dec = cupaged.PagedDecoder(8, 4, D, 4, dtype="float32", xp=np).plan(bt, sl)
    with pytest.raises(ValueError, match="k_cache: shape"):
        dec.run(q, cache.k, cache.v)
    given = cupaged.PagedDecoder(8, 4, D, 4, dtype="float32", layout="HND", xp=np).plan(bt, sl)
    np.testing.assert_array_equal(given.run(q, cache.k, cache.v),
                                  cupaged.paged_decode(q, cache, bt, sl))
    pre = cupaged.PagedPrefiller(8, 4, D, 4, dtype="float32").plan(
        np.array([0, 1, 2], np.int32), bt, sl)
    with pytest.raises(ValueError, match="k_cache: shape"):
        pre.run(q, cache.k, cache.v)


def test_unambiguous_raw_cache_defaults_to_nhd(rng):
    cache, bt, sl, q = _batch(rng, "NHD", hq=4, hk=2, bs=8)  # HND would be 8 kv heads for 4
    np.testing.assert_array_equal(cupaged.paged_decode(q, cache.k, cache.v, bt, sl),
                                  cupaged.paged_decode(q, cache, bt, sl))
    # k_new's heads settle the reading when q's do not
    k4 = np.zeros((3, 4, 4, D), np.float32)
    with pytest.raises(ValueError, match="reads as NHD"):
        resolve_layout(None, k4, q=np.zeros((2, 8, D)))
    assert resolve_layout(None, np.zeros((3, 4, 2, D)), q=np.zeros((2, 8, D)),
                          num_kv_heads=2) == "NHD"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_key_geometry_reads_every_layout(layout):
    ks, _ = cache_shapes(layout, 5, 16, 4, 128, np.float16)
    assert tuple(key_geometry(np.empty(ks, np.float16), layout)) == (5, 16, 4, 128)


# ----------------------------------------------------------------------------- 1-byte caches
BYTE_DTYPES = [np.uint8, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]


def _bytes_in_layout(rng, layout, dtype, nb, bs, hk, d):
    """Random logical NHD k, v of a 1-byte dtype and the same elements placed in ``layout``."""
    k, v = (rng.integers(0, 256, (nb, bs, hk, d), dtype=np.uint8).view(dtype) for _ in "kv")
    if layout == "NHD":
        return k, v, k, v
    if layout == "HND":
        return k, v, k.transpose(0, 2, 1, 3).copy(), v.transpose(0, 2, 1, 3).copy()
    kc = k.reshape(nb, bs, hk, d // 16, 16).transpose(0, 2, 3, 1, 4).copy()
    return k, v, kc, v.transpose(0, 2, 3, 1).copy()


@pytest.mark.parametrize("dtype", BYTE_DTYPES + ["fp8_e4m3", "fp8_e5m2"])
def test_vllm_layout_packs_16_one_byte_elements(dtype):
    assert vllm_x(dtype) == 16
    ks, vs = cache_shapes("vllm", 7, 16, 3, 80, dtype)
    assert ks == (7, 3, 5, 16, 16) and vs == (7, 3, 80, 16)
    with pytest.raises(ValueError, match="head_dim: expected a multiple of 16"):
        cache_shapes("vllm", 7, 16, 3, 72, dtype)
    for layout in ("NHD", "HND"):                 # no element-size dependence
        assert cache_shapes(layout, 7, 16, 3, 72, dtype) == cache_shapes(
            layout, 7, 16, 3, 72, np.float16)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", BYTE_DTYPES)
@pytest.mark.parametrize("bs", [1, 16, 128])
def test_one_byte_caches_geometry_strides_and_views(rng, layout, dtype, bs):
    nb, hk, d = 3, 3, 48
    k, v, kc, vc = _bytes_in_layout(rng, layout, dtype, nb, bs, hk, d)
    assert (kc.shape, vc.shape) == cache_shapes(layout, nb, bs, hk, d, dtype)
    assert tuple(cache_geometry(kc, vc, layout, CACHE_DTYPES)) == (nb, bs, hk, d)
    with pytest.raises(TypeError, match="k_cache: expected dtype float16, bfloat16 or float32"):
        cache_geometry(kc, vc, layout)            # the default stays 16/32-bit only
    np.testing.assert_array_equal(k_as_nhd(kc, layout).view(np.uint8), k.view(np.uint8))
    np.testing.assert_array_equal(v_as_nhd(vc, layout).view(np.uint8), v.view(np.uint8))
    # the strides record locates every element, chunk = 16 one-byte elements
    s = cache_strides(kc, vc, layout)
    assert s == layout_strides(layout, bs, hk, d, 1)
    b, t, h, x = np.meshgrid(*map(np.arange, (nb, bs, hk, d)), indexing="ij")
    k_off = b * s.k_block + h * s.k_head + t * s.k_tok + (x // 16) * s.k_chunk + x % 16
    v_off = b * s.v_block + h * s.v_head + t * s.v_tok + (x // 16) * s.v_chunk + (x % 16) * s.v_dim
    np.testing.assert_array_equal(kc.view(np.uint8).reshape(-1)[k_off], k.view(np.uint8))
    np.testing.assert_array_equal(vc.view(np.uint8).reshape(-1)[v_off], v.view(np.uint8))
    assert head_axis(layout) == (2 if layout == "NHD" else 1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_byte_caches_with_strided_blocks(layout):
    ks, vs = cache_shapes(layout, 5, 16, 2, 32, np.uint8)
    fused = np.zeros((5, 2) + ks[1:], np.uint8)   # K and V views of one allocation
    kc = fused[:, 0]
    vc = fused[:, 1].reshape((5,) + vs[1:])
    s = cache_strides(kc, vc, layout)
    assert s.k_block == s.v_block == 2 * int(np.prod(ks[1:]))
    bad = np.zeros((5,) + ks[1:], np.uint8)[:, ..., ::2]
    with pytest.raises(ValueError, match="dense blocks"):
        cache_geometry(bad, vc, layout, CACHE_DTYPES)
