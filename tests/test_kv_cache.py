"""PagedKVCache: construction, and a serving round (append, write, fork, copy-on-write)."""
import sys

import numpy as np
import pytest

import cupaged
from cupaged.core.arrays import HEAD_DIMS, bfloat16
from cupaged.core.layouts import LAYOUTS, cache_shapes, k_as_nhd, v_as_nhd


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", np.float32])
def test_shapes_and_attributes(layout, dtype):
    c = cupaged.PagedKVCache(5, 16, 2, 64, dtype=dtype, layout=layout, xp=np)
    ks, vs = cache_shapes(layout, 5, 16, 2, 64, c.dtype)
    assert c.k.shape == ks and c.v.shape == vs and c.k.dtype == c.dtype == np.dtype(dtype)
    assert isinstance(c.k, np.ndarray) and not c.k.any()
    assert c.layout == layout and c.pool.num_blocks == 5 and c.pool.block_size == 16
    assert c.nbytes == c.k.nbytes + c.v.nbytes


def test_default_module_and_import_hygiene():
    c = cupaged.PagedKVCache(2, 4, 1, 64)
    assert c.xp is (sys.modules.get("cupy") if cupaged.gpu_available() else np)
    assert c.dtype == np.float16 and c.layout == "NHD"


@pytest.mark.parametrize("kwargs, err, msg", [
    (dict(num_blocks=0), ValueError, "num_blocks: expected an int >= 1, got 0"),
    (dict(block_size=2.5), TypeError, "block_size: expected an int"),
    (dict(head_dim=4), ValueError, "head_dim: head size 4 is not supported"),
    (dict(head_dim=72), ValueError, "head_dim: head size 72 is not supported; expected one of"),
    (dict(head_dim=48, dtype="float32"), ValueError, "head_dim: head size 48 is not supported"),
    (dict(dtype="int8"), TypeError, "dtype: expected one of"),
    (dict(layout="NDH"), ValueError, "layout: expected one of"),
    (dict(xp=object()), TypeError, "xp: expected numpy or cupy"),
])
def test_bad_arguments(kwargs, err, msg):
    args = dict(num_blocks=4, block_size=8, num_kv_heads=2, head_dim=64, xp=np)
    args.update(kwargs)
    with pytest.raises(err, match=msg):
        cupaged.PagedKVCache(**args)


def test_every_supported_head_size():
    for head_dim in HEAD_DIMS:
        assert cupaged.PagedKVCache(1, 1, 1, head_dim, xp=np).k.shape[-1] == head_dim


def _gather(cache, table, seq):
    """A sequence's keys and values ``[len, Hk, D]`` read through its block table."""
    xp, bs = cache.xp, cache.block_size
    pos = np.arange(int(table.seq_lens[seq]))
    blocks, offs = xp.asarray(table.block_tables[seq, pos // bs]), xp.asarray(pos % bs)
    k = k_as_nhd(cache.k.view(np.uint16), cache.layout)[blocks, offs]
    v = v_as_nhd(cache.v.view(np.uint16), cache.layout)[blocks, offs]
    return (k.get(), v.get()) if xp is not np else (k, v)


def _serving_round(rng, xp, layout):
    cache = cupaged.PagedKVCache(12, 8, 2, 64, dtype=bfloat16, layout=layout, xp=xp)
    table = cupaged.BlockTable(cache.pool, max_seqs=4, max_blocks_per_seq=5)
    hist = {}

    def step(seq, n):
        slots = table.append(seq, n)
        cache.copy_blocks(table.take_copies())
        kv = rng.standard_normal((2, n, 2, 64)).astype(bfloat16)
        cache.write(xp.asarray(kv[0]), xp.asarray(kv[1]), slots)
        old = hist.get(seq, np.zeros((2, 0, 2, 64), bfloat16))
        hist[seq] = np.concatenate([old, kv], axis=1)

    step(0, 21)                      # blocks: 8 + 8 + 5 of 8
    table.fork(0, 1)
    hist[1] = hist[0]
    step(1, 3)                       # copy on write of the shared partial block
    step(0, 2)                       # sequence 0 alone in its block now: in place
    table.fork(1, 2)
    hist[2] = hist[1]
    step(2, 9)
    step(1, 1)
    table.free(0)
    del hist[0]
    step(3, 17)                      # reuses freed blocks
    for seq, (k, v) in hist.items():
        gk, gv = _gather(cache, table, seq)
        assert (gk == k.view(np.uint16)).all(), f"seq {seq} keys"
        assert (gv == v.view(np.uint16)).all(), f"seq {seq} values"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_serving_round_numpy(rng, layout):
    _serving_round(rng, np, layout)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_serving_round_gpu(rng, cp, layout):
    _serving_round(rng, cp, layout)


# ----------------------------------------------------------------------------- fp8 caches
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_cache_arrays_write_and_decode(rng, layout):
    """An fp8 cache: 1-byte arrays (NumPy: the format's float8 dtype), half the bytes;
    ``write`` quantises with its scales, and the ops take its format and scales."""
    from cupaged.core.fp8 import FP8_FORMATS
    from cupaged.reference.cache import write_kv_cache
    ks = rng.uniform(0.01, 0.1, 2).astype(np.float32)
    c = cupaged.PagedKVCache(6, 16, 2, 64, dtype=bfloat16, layout=layout, xp=np,
                             kv_dtype="fp8_e5m2", k_scale=ks, v_scale=0.05)
    plain = cupaged.PagedKVCache(6, 16, 2, 64, dtype=bfloat16, layout=layout, xp=np)
    assert c.k.dtype == FP8_FORMATS["fp8_e5m2"].dtype and 2 * c.nbytes == plain.nbytes
    assert c.k.shape == cache_shapes(layout, 6, 16, 2, 64, "fp8_e5m2")[0]
    assert "kv_dtype='fp8_e5m2'" in repr(c)
    key, value = (rng.standard_normal((2, 40, 2, 64)) * 3).astype(bfloat16)
    slots = np.arange(40, dtype=np.int64)
    c.write(key, value, slots)
    k8, v8 = np.zeros_like(c.k), np.zeros_like(c.v)
    write_kv_cache(key, value, k8, v8, slots, layout, k_scale=ks, v_scale=0.05)
    assert (c.k.view(np.uint8) == k8.view(np.uint8)).all()
    assert (c.v.view(np.uint8) == v8.view(np.uint8)).all()
    q = rng.standard_normal((2, 4, 64)).astype(bfloat16)
    tables, lens = np.array([[0, 1, 2], [3, 4, 5]], np.int32), np.array([40, 0], np.int32)
    got = cupaged.paged_decode(q, c, tables, lens)
    want = cupaged.paged_decode(q, k8, v8, tables, lens, layout=layout, k_scale=ks,
                                v_scale=0.05)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kwargs, err, msg", [
    (dict(kv_dtype="fp8"), ValueError, "kv_dtype: expected one of"),
    (dict(k_scale=0.5), ValueError, "k_scale, v_scale: expected None without kv_dtype"),
    (dict(kv_dtype="fp8_e4m3", v_scale=-1.0), ValueError, "v_scale: expected finite positive"),
    (dict(kv_dtype="fp8_e4m3", k_scale=np.ones(3, np.float32)), ValueError,
     r"k_scale: expected shape \[\], \[1\] or \[2\]"),
])
def test_fp8_cache_bad_arguments(kwargs, err, msg):
    with pytest.raises(err, match=msg):
        cupaged.PagedKVCache(4, 8, 2, 64, xp=np, **kwargs)
