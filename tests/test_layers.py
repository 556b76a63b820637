"""vLLM-style layers on mixed batches: vs a composition of the reference ops, seed rules, GPU."""
import numpy as np
import pytest

import cupaged
from cupaged.engine import layers
from cupaged.core.arrays import bfloat16
from cupaged.core.layouts import LAYOUTS, cache_shapes, k_as_nhd, v_as_nhd
from cupaged.reference import attention as aref
from cupaged.reference import cache as cref
from cupaged.reference import rope as rref

TOL = {np.dtype(np.float16): 2e-3, bfloat16: 1e-2, np.dtype(np.float32): 1e-4}
Q_LENS, SEQ_LENS, PADDING = [5, 1, 3, 1], [5, 9, 7, 33], 3  # prompt, decode, chunk, decode


def rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def assert_close(actual, expected, dtype):
    tol = TOL[np.dtype(dtype)]
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    np.testing.assert_allclose(a, e, rtol=tol, atol=tol * max(1.0, np.abs(e).max(initial=0)))


def mixed_batch(rng, dtype, layout, hq=8, hk=2, d=64, bs=16, num_blocks=12):
    """Inputs of one step mixing a prompt, decodes and a chunk, plus padding rows."""
    n, b = sum(Q_LENS), len(Q_LENS)
    max_blocks = -(-max(SEQ_LENS) // bs) + 1
    perm = rng.permutation(num_blocks)
    tables = np.full((b, max_blocks), -1, np.int32)
    slots, used = [], 0
    for i, (ql, sl) in enumerate(zip(Q_LENS, SEQ_LENS)):
        nb = -(-sl // bs)
        tables[i, :nb] = perm[used:used + nb]
        used += nb
        pos = np.arange(sl - ql, sl)
        slots += list(tables[i, pos // bs].astype(np.int64) * bs + pos % bs)
    slots += [-1] * PADDING
    ks, vs = cache_shapes(layout, num_blocks, bs, hk, d, dtype)
    t = n + PADDING
    return dict(query=rand(rng, (t, hq * d), dtype), key=rand(rng, (t, hk * d), dtype),
                value=rand(rng, (t, hk * d), dtype), key_cache=rand(rng, ks, dtype),
                value_cache=rand(rng, vs, dtype),
                cu=np.concatenate([[0], np.cumsum(Q_LENS)]).astype(np.int32),
                seq_lens=np.array(SEQ_LENS, np.int32), tables=tables,
                slots=np.array(slots, np.int64))


def metadata(batch, xp=np):
    return layers.AttentionMetadata(xp.asarray(batch["cu"]), xp.asarray(batch["seq_lens"]),
                                    xp.asarray(batch["tables"]), xp.asarray(batch["slots"]))


def composed_reference(batch, layer, layout, positions=None, rope=None, alibi=None, **fp8):
    """(RoPE) -> write_kv_cache -> paged_attention with the reference ops, copies of caches
    (``fp8``: the layer's ``kv_dtype`` and scales for both ops)."""
    n, hq, hk, d = sum(Q_LENS), layer.num_heads, layer.num_kv_heads, layer.head_size
    q = batch["query"][:n].reshape(n, hq, d)
    k = batch["key"][:n].reshape(n, hk, d)
    v = batch["value"][:n].reshape(n, hk, d)
    if rope is not None:
        q, k = rref.apply_rope(positions[:n], q, k, **rope)
    kc, vc = batch["key_cache"].copy(), batch["value_cache"].copy()
    cref.write_kv_cache(k, v, kc, vc, batch["slots"][:n], layout, **fp8)
    o = aref.paged_attention(q, kc, vc, batch["cu"], batch["tables"], batch["seq_lens"],
                             causal=True, sm_scale=layer.scale, window_left=layer.window_left,
                             alibi_slopes=alibi, layout=layout, **fp8)
    out = np.zeros(batch["query"].shape, q.dtype)
    out[:n] = o.reshape(n, hq * d)
    return out, kc, vc


def rope_layer(layout, window=None, scaling=None, neox=True, kv_dtype=None):
    return layers.PagedAttentionWithRoPE(8, 64, 0.11, rotary_dim=32, max_position=64, base=500,
                                         num_kv_heads=2, is_neox_style=neox, rope_scaling=scaling,
                                         sliding_window=window, layout=layout, kv_dtype=kv_dtype)


def fp8_caches(batch, kv_dtype, layout, xp=np):
    """The batch's caches quantised into fp8 ones of ``kv_dtype`` in ``layout`` (1-byte
    elements of ``xp``: float8 in NumPy, uint8 in CuPy)."""
    from cupaged.core.fp8 import cache_element_dtype, fp8_format
    from cupaged.reference.fp8 import quantize
    from test_decode import from_nhd
    codes = from_nhd(quantize(k_as_nhd(batch["key_cache"], layout), FP8_K_SCALE, kv_dtype),
                     quantize(v_as_nhd(batch["value_cache"], layout), FP8_V_SCALE, kv_dtype),
                     layout)
    elements = cache_element_dtype(fp8_format(kv_dtype), xp)
    return tuple(xp.asarray(c.view(elements)) for c in codes)


FP8_K_SCALE = np.array([0.02, 0.03], np.float32)   # per kv head: N(0, 1) rows well in range
FP8_V_SCALE = np.float32(0.025)


ROPE_KW = dict(rotary_dim=32, base=500.0, max_position=64)


# ----------------------------------------------------------------------------- CPU
def test_metadata_positions():
    batch = mixed_batch(np.random.default_rng(0), np.float32, "NHD")
    meta = metadata(batch)
    want = np.concatenate([np.arange(sl - ql, sl) for ql, sl in zip(Q_LENS, SEQ_LENS)])
    np.testing.assert_array_equal(meta.positions, want)
    assert meta.num_valid_tokens == sum(Q_LENS) and meta.num_seqs == len(Q_LENS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plain_layer_matches_composition(rng, layout):
    batch = mixed_batch(rng, np.float32, layout)
    layer = layers.PagedAttention(8, 64, 0.12, num_kv_heads=2, layout=layout)
    kc, vc = batch["key_cache"].copy(), batch["value_cache"].copy()
    out = layer(batch["query"], batch["key"], batch["value"], kc, vc, metadata(batch))
    want, want_kc, want_vc = composed_reference(batch, layer, layout)
    np.testing.assert_allclose(out, want, atol=1e-6)
    np.testing.assert_array_equal(kc, want_kc)
    np.testing.assert_array_equal(vc, want_vc)
    assert (out[sum(Q_LENS):] == 0).all()


@pytest.mark.parametrize("scaling,neox,window", [
    (None, True, None), ({"type": "linear", "factor": 2.0}, False, 4),
    ({"type": "dynamic", "factor": 2.0}, True, 1)])
def test_rope_layer_matches_composition(rng, scaling, neox, window):
    batch = mixed_batch(rng, np.float32, "HND")
    layer = rope_layer("HND", window, scaling, neox)
    meta = metadata(batch)
    positions = np.concatenate([meta.positions, np.zeros(PADDING, np.int32)])
    kc, vc = batch["key_cache"].copy(), batch["value_cache"].copy()
    out = layer(positions, batch["query"], batch["key"], batch["value"], kc, vc, meta)
    want, want_kc, _ = composed_reference(batch, layer, "HND", positions,
                                          dict(ROPE_KW, is_neox=neox, scaling=scaling))
    np.testing.assert_allclose(out, want, atol=1e-6)
    np.testing.assert_array_equal(kc, want_kc)


def test_alibi_layer_matches_composition(rng):
    batch = mixed_batch(rng, np.float32, "vllm")
    slopes = [2.0 ** -(i + 1) for i in range(8)]
    layer = layers.PagedAttentionWithALiBi(8, 64, 0.125, slopes, num_kv_heads=2, layout="vllm")
    kc, vc = batch["key_cache"].copy(), batch["value_cache"].copy()
    out = layer(batch["query"], batch["key"], batch["value"], kc, vc, metadata(batch))
    want, _, _ = composed_reference(batch, layer, "vllm", alibi=np.float32(slopes))
    np.testing.assert_allclose(out, want, atol=1e-6)


def dense_prompt(q, k, v, scale, visible, bias=None):
    """One prompt, float64, explicit mask and optional per-head bias [H, S, S]."""
    g = q.shape[1] // k.shape[1]
    kk, vv = np.repeat(k, g, axis=1).astype(np.float64), np.repeat(v, g, axis=1).astype(np.float64)
    s = scale * np.einsum("ihd,jhd->hij", q.astype(np.float64), kk)
    if bias is not None:
        s = s + bias
    s = np.where(visible[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hij,jhd->ihd", p / p.sum(-1, keepdims=True), vv)


def _prompts_without_cache(rng, layer, lens):
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t, hq, hk, d = cu[-1], layer.num_heads, layer.num_kv_heads, layer.head_size
    q, k, v = rand(rng, (t, hq * d), np.float32), rand(rng, (t, hk * d), np.float32), rand(rng, (t, hk * d), np.float32)
    meta = layers.AttentionMetadata(cu, np.array(lens, np.int32), np.zeros((len(lens), 1), np.int32),
                                    np.full(t, -1, np.int64))
    out = layer(q, k, v, None, None, meta)
    return out, cu, q.reshape(t, hq, d), k.reshape(t, hk, d), v.reshape(t, hk, d)


def test_sliding_window_sees_last_w_positions(rng):
    """Seed 002's sliding_window W (xformers local attention): keys p - W < j <= p."""
    layer = layers.PagedAttention(4, 64, 0.2, num_kv_heads=2, sliding_window=3)
    out, cu, q, k, v = _prompts_without_cache(rng, layer, [6, 4])
    for b in range(2):
        r = slice(cu[b], cu[b + 1])
        i, j = np.arange(cu[b + 1] - cu[b])[:, None], np.arange(cu[b + 1] - cu[b])[None, :]
        want = dense_prompt(q[r], k[r], v[r], 0.2, (j <= i) & (i - j < 3))
        np.testing.assert_allclose(out[r].reshape(want.shape), want, atol=1e-6)


def test_alibi_prompt_bias_is_seed_formula(rng):
    """Seed 002's prompt bias: slope_h * (j - i), causal."""
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    layer = layers.PagedAttentionWithALiBi(4, 64, 0.1, slopes, num_kv_heads=1)
    out, cu, q, k, v = _prompts_without_cache(rng, layer, [5, 7])
    for b in range(2):
        r = slice(cu[b], cu[b + 1])
        s = cu[b + 1] - cu[b]
        i, j = np.arange(s)[:, None], np.arange(s)[None, :]
        want = dense_prompt(q[r], k[r], v[r], 0.1, j <= i, slopes[:, None, None] * (j - i)[None])
        np.testing.assert_allclose(out[r].reshape(want.shape), want, atol=1e-6)


CTOR_BAD = [
    (lambda: layers.PagedAttention(8, 48, 0.1), "head_size"),
    (lambda: layers.PagedAttention(6, 64, 0.1, num_kv_heads=4), "num_kv_heads"),
    (lambda: layers.PagedAttention(8, 64, 0.1, sliding_window=0), "sliding_window"),
    (lambda: layers.PagedAttention(8, 64, float("inf")), "scale"),
    (lambda: layers.PagedAttention(8, 64, 0.1, layout="NDH"), "layout"),
    (lambda: layers.PagedAttentionWithALiBi(8, 64, 0.1, [0.5] * 7), "slopes"),
    (lambda: layers.PagedAttentionWithRoPE(8, 64, 0.1, rotary_dim=33), "rotary_dim"),
    (lambda: layers.PagedAttentionWithRoPE(8, 64, 0.1, 64, rope_scaling={"type": "yarn", "factor": 2}),
     "unknown RoPE scaling type"),
]


@pytest.mark.parametrize("make,name", CTOR_BAD, ids=[str(i) for i in range(len(CTOR_BAD))])
def test_bad_construction(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def _bad_forward_cases(batch):
    tables = batch["tables"].copy()
    tables[3, 0] = 99
    slots = batch["slots"].copy()
    slots[2] = 10 ** 6
    short = batch["seq_lens"].copy()
    short[0] = 2
    return [
        (dict(query=batch["query"][:, :-64]), ValueError, "query"),
        (dict(key_cache=batch["key_cache"].astype(np.float16),
              value_cache=batch["value_cache"].astype(np.float16)), TypeError, "key_cache"),
        (dict(key_cache=None), ValueError, "key_cache, value_cache"),
        (dict(key_cache=None, value_cache=None), ValueError, "key_cache"),
        (dict(tables=tables), ValueError, "block_tables"),
        (dict(slots=slots), ValueError, "slot_mapping"),
        (dict(seq_lens=short), ValueError, "seq_lens"),
        (dict(slots=batch["slots"][:5]), ValueError, "slot_mapping"),
        (dict(cu=batch["cu"].astype(np.int64)), TypeError, "cu_seqlens_q"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_bad_forward_leaves_cache_untouched(rng, case):
    batch = mixed_batch(rng, np.float32, "NHD")
    change, exc, name = _bad_forward_cases(batch)[case]
    batch.update(change)
    layer = layers.PagedAttention(8, 64, 0.1, num_kv_heads=2)
    kc = None if batch["key_cache"] is None else batch["key_cache"].copy()
    with pytest.raises(exc, match=name):
        layer(batch["query"], batch["key"], batch["value"], batch["key_cache"],
              batch["value_cache"], metadata(batch))
    if kc is not None:
        np.testing.assert_array_equal(batch["key_cache"], kc)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float16, bfloat16])
def test_gpu_rope_layer_mixed_batch(rng, cp, layout, dtype):
    batch = mixed_batch(rng, dtype, layout, bs=16)
    layer = rope_layer(layout, window=6, scaling={"type": "dynamic", "factor": 2.0})
    meta = metadata(batch)
    positions = np.concatenate([meta.positions, np.zeros(PADDING, np.int32)])
    want, want_kc, want_vc = composed_reference(
        batch, layer, layout, positions, dict(ROPE_KW, is_neox=True, scaling={"type": "dynamic", "factor": 2.0}))
    dev = {name: cp.asarray(a) for name, a in batch.items()}
    out = layer(cp.asarray(positions), dev["query"], dev["key"], dev["value"],
                dev["key_cache"], dev["value_cache"], metadata(dev, cp))
    assert out.dtype == dtype and out.shape == want.shape
    assert_close(out.get(), want, dtype)
    assert_close(dev["key_cache"].get(), want_kc, dtype)  # rotated keys: rounding may differ
    np.testing.assert_array_equal(dev["value_cache"].get(), want_vc)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "vllm"])
def test_gpu_alibi_layer_mixed_batch(rng, cp, layout):
    batch = mixed_batch(rng, np.float16, layout, hq=8, hk=8, d=128, bs=16, num_blocks=16)
    slopes = [2.0 ** -(0.5 * (i + 1)) for i in range(8)]
    layer = layers.PagedAttentionWithALiBi(8, 128, 0.09, slopes, layout=layout)
    want, _, _ = composed_reference(batch, layer, layout, alibi=np.float32(slopes))
    dev = {name: cp.asarray(a) for name, a in batch.items()}
    out = layer(dev["query"], dev["key"], dev["value"], dev["key_cache"], dev["value_cache"],
                metadata(dev, cp))
    assert_close(out.get(), want, np.float16)


def test_layer_takes_the_cache_object(rng):
    """A CacheView (or PagedKVCache) in the layer's layout stands in for the cache pair;
    without a layout, caches whose shape reads as both NHD and HND are refused."""
    batch = mixed_batch(rng, np.float32, "HND", hq=8, hk=2, bs=16)
    layer = layers.PagedAttention(8, 64, 0.1, num_kv_heads=2, layout="HND")
    raw = (batch["key_cache"].copy(), batch["value_cache"].copy())
    want = layer(batch["query"], batch["key"], batch["value"], *raw, metadata(batch))
    view = cupaged.CacheView(batch["key_cache"], batch["value_cache"], layout="HND")
    got = layer(batch["query"], batch["key"], batch["value"], view, metadata(batch))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(view.k, raw[0])
    with pytest.raises(ValueError, match="PagedAttention's layout 'NHD'"):
        layers.PagedAttention(8, 64, 0.1, num_kv_heads=2, layout="NHD")(
            batch["query"], batch["key"], batch["value"], view, metadata(batch))
    square = mixed_batch(rng, np.float32, "HND", hq=16, hk=16, bs=16)
    with pytest.raises(ValueError, match=r"key_cache: shape \(12, 16, 16, 64\) reads as NHD"):
        layers.PagedAttention(16, 64, 0.1, num_kv_heads=16)(
            square["query"], square["key"], square["value"], square["key_cache"],
            square["value_cache"], metadata(square))


# ----------------------------------------------------------------------------- fp8 caches
FP8_SCALES = dict(k_scale=FP8_K_SCALE, v_scale=FP8_V_SCALE)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_rope_layer_matches_composition(rng, layout, kv_dtype):
    """A layer with ``kv_dtype`` writes quantised keys and values and attends over the fp8
    cache as the reference ops given the same format and scales."""
    batch = mixed_batch(rng, np.float16, layout)
    batch["key_cache"], batch["value_cache"] = fp8_caches(batch, kv_dtype, layout)
    layer = rope_layer(layout, window=6, kv_dtype=kv_dtype)
    meta = metadata(batch)
    positions = np.concatenate([meta.positions, np.zeros(PADDING, np.int32)])
    kc, vc = batch["key_cache"].copy(), batch["value_cache"].copy()
    out = layer(positions, batch["query"], batch["key"], batch["value"], kc, vc, meta,
                **FP8_SCALES)
    want, want_kc, want_vc = composed_reference(
        batch, layer, layout, positions, dict(ROPE_KW, is_neox=True), kv_dtype=kv_dtype,
        **FP8_SCALES)
    np.testing.assert_allclose(out, want, atol=1e-6)
    np.testing.assert_array_equal(kc.view(np.uint8), want_kc.view(np.uint8))
    np.testing.assert_array_equal(vc.view(np.uint8), want_vc.view(np.uint8))
    assert (out[sum(Q_LENS):] == 0).all()


def test_fp8_layer_takes_the_cache_object(rng):
    """An fp8 PagedKVCache brings its format and scales; the layer's format must match it."""
    batch = mixed_batch(rng, np.float16, "NHD")
    cache = cupaged.PagedKVCache(12, 16, 2, 64, dtype="float16", xp=np, kv_dtype="fp8_e4m3",
                                 **FP8_SCALES)
    cache.k[...], cache.v[...] = fp8_caches(batch, "fp8_e4m3", "NHD")
    raw = (cache.k.copy(), cache.v.copy())
    layer = layers.PagedAttention(8, 64, 0.1, num_kv_heads=2, kv_dtype="fp8_e4m3")
    want = layer(batch["query"], batch["key"], batch["value"], *raw, metadata(batch),
                 **FP8_SCALES)
    got = layer(batch["query"], batch["key"], batch["value"], cache, metadata(batch))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(cache.k.view(np.uint8), raw[0].view(np.uint8))
    with pytest.raises(ValueError, match="kv_dtype 'fp8_e5m2', got a 'fp8_e4m3'"):
        layers.PagedAttention(8, 64, 0.1, num_kv_heads=2, kv_dtype="fp8_e5m2")(
            batch["query"], batch["key"], batch["value"], cache, metadata(batch))
    with pytest.raises(ValueError, match="k_scale: expected None with a PagedKVCache"):
        layer(batch["query"], batch["key"], batch["value"], cache, metadata(batch),
              k_scale=0.5)


@pytest.mark.parametrize("case", range(5))
def test_fp8_bad_arguments_leave_cache_untouched(rng, case):
    batch = mixed_batch(rng, np.float16, "NHD")
    k8, v8 = fp8_caches(batch, "fp8_e4m3", "NHD")
    plain = layers.PagedAttention(8, 64, 0.1, num_kv_heads=2)
    fp8 = layers.PagedAttention(8, 64, 0.1, num_kv_heads=2, kv_dtype="fp8_e4m3")
    layer, caches, scales, exc, msg = [
        (plain, (k8, v8), {}, TypeError, "key_cache: expected dtype float16 like query, got "
                                         "float8_e4m3fn .an fp8 cache needs the layer's kv_dtype"),
        (plain, (batch["key_cache"], batch["value_cache"]), dict(k_scale=0.5), ValueError,
         "k_scale, v_scale: expected None for a layer without kv_dtype"),
        (fp8, (batch["key_cache"], batch["value_cache"]), {}, TypeError,
         "key_cache: expected dtype uint8 or float8_e4m3fn for kv_dtype 'fp8_e4m3', got float16"),
        (fp8, (k8, v8), dict(k_scale=np.ones(3, np.float32)), ValueError,
         r"k_scale: expected shape \[\], \[1\] or \[2\]"),
        (fp8, (k8, v8.view(np.uint8)), {}, TypeError, "v_cache: expected dtype float8_e4m3fn"),
    ][case]
    before = [c.copy() for c in caches]
    with pytest.raises(exc, match=msg):
        layer(batch["query"], batch["key"], batch["value"], *caches, metadata(batch), **scales)
    for c, b in zip(caches, before):
        np.testing.assert_array_equal(c.view(np.uint8), b.view(np.uint8))


def test_fp8_bad_kv_dtype_names_the_argument():
    with pytest.raises(ValueError, match=r"kv_dtype: expected one of \('fp8_e4m3', "
                                         r"'fp8_e5m2'\), got 'fp8'"):
        rope_layer("NHD", kv_dtype="fp8")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv_dtype, dtype", [("fp8_e4m3", bfloat16), ("fp8_e5m2", np.float16)])
def test_gpu_fp8_rope_layer_mixed_batch(rng, cp, layout, kv_dtype, dtype):
    """The CuPy layer over uint8 fp8 caches against the reference ops on the same bytes:
    outputs within the 16-bit tolerance, values quantised bit for bit, rotated keys (whose
    16-bit rounding may differ) within one fp8 step."""
    from cupaged.core.fp8 import fp8_format
    from cupaged.reference.fp8 import dequantize
    batch = mixed_batch(rng, dtype, layout)
    batch["key_cache"], batch["value_cache"] = fp8_caches(batch, kv_dtype, layout)
    layer = rope_layer(layout, window=6, kv_dtype=kv_dtype)
    meta = metadata(batch)
    positions = np.concatenate([meta.positions, np.zeros(PADDING, np.int32)])
    want, want_kc, want_vc = composed_reference(
        batch, layer, layout, positions, dict(ROPE_KW, is_neox=True), kv_dtype=kv_dtype,
        **FP8_SCALES)
    dev = {name: cp.asarray(a.view(np.uint8) if a.dtype.itemsize == 1 else a)
           for name, a in batch.items()}
    out = layer(cp.asarray(positions), dev["query"], dev["key"], dev["value"],
                dev["key_cache"], dev["value_cache"], metadata(dev, cp),
                k_scale=cp.asarray(FP8_K_SCALE), v_scale=float(FP8_V_SCALE))
    assert out.dtype == dtype and out.shape == want.shape
    assert_close(out.get(), want, dtype)
    np.testing.assert_array_equal(dev["value_cache"].get(), want_vc.view(np.uint8))
    fmt = fp8_format(kv_dtype)
    got_k, want_k = (dequantize(k_as_nhd(c, layout), FP8_K_SCALE, kv_dtype)
                     for c in (dev["key_cache"].get(), want_kc.view(np.uint8)))
    np.testing.assert_allclose(got_k, want_k, rtol=2.0 ** -fmt.mantissa_bits,
                               atol=fmt.min_subnormal * FP8_K_SCALE.max())
