"""Reference attention (the specification) against an explicit-loop oracle and itself.

All CPU. The oracle below walks every (query, head, key) with Python scalars, so it shares no
code path with ``cupaged.reference.attention``; the cross-checks (decode vs varlen, chunked vs
one-shot prefill, merge of halves vs whole, sink vs extra key) tie the ops to each other.
"""
import math

import numpy as np
import pytest

from cupaged.core.arrays import bfloat16
from cupaged.core.layouts import LAYOUTS, cache_shapes, k_as_nhd, v_as_nhd
from cupaged.reference import attention as ref
from cupaged.reference.cache import write_kv_cache

DTYPES = [np.float16, bfloat16, np.float32]
TOL = {np.dtype(np.float16): 2e-3, bfloat16: 1e-2, np.dtype(np.float32): 1e-5}
GQA = [(4, 4), (8, 2), (4, 1)]  # (Hq, Hk): MHA, group 4, MQA


def _rand(rng, shape, dtype=np.float32, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def loop_attend(q, k, v, *, causal=True, sm_scale=None, window_left=-1, alibi_slopes=None,
                sinks=None, logits_soft_cap=0.0):
    """One sequence, one (query, head) at a time, straight from design.md's definitions."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    q_len, hq, d = q.shape
    kv_len, hk = k.shape[:2]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    out = np.zeros((q_len, hq, d))
    lse = np.full((q_len, hq), -math.inf)
    for i in range(q_len):
        p = kv_len - q_len + i
        for h in range(hq):
            g = h // (hq // hk)
            logits, values = [], []
            for j in range(kv_len):
                if (causal and j > p) or (window_left >= 0 and j < p - window_left):
                    continue
                s = scale * float(np.dot(q[i, h], k[j, g]))
                if logits_soft_cap > 0:
                    s = logits_soft_cap * math.tanh(s / logits_soft_cap)
                if alibi_slopes is not None:
                    s += float(alibi_slopes[h]) * (j - p)
                logits.append(s)
                values.append(v[j, g])
            extra = [float(sinks[h])] if sinks is not None else []
            if not logits + extra:
                continue
            m = max(logits + extra)
            denom = sum(math.exp(s - m) for s in logits + extra)
            lse[i, h] = m + math.log(denom)
            for s, val in zip(logits, values):
                out[i, h] += math.exp(s - m) / denom * val
    return out, lse


def _close(got, want, tol, name="out"):
    got, want = _f64(got), _f64(want)
    assert got.shape == want.shape, name
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=name)


def _close_lse(got, want, tol=1e-5):
    got, want = _f64(got), _f64(want)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=tol, atol=tol)


def _seq(rng, q_len, kv_len, hq, hk, d=16, dtype=np.float32):
    return (_rand(rng, (q_len, hq, d), dtype), _rand(rng, (kv_len, hk, d), dtype),
            _rand(rng, (kv_len, hk, d), dtype))


# ----------------------------------------------------------------------------- attend vs loops
FEATURES = {
    "plain": {},
    "noncausal": dict(causal=False),
    "window": dict(window_left=3),
    "window0": dict(window_left=0),
    "noncausal_window": dict(causal=False, window_left=2),
    "alibi": dict(alibi="slopes"),
    "softcap": dict(logits_soft_cap=1.5),
    "softcap_then_alibi": dict(logits_soft_cap=1.0, alibi="slopes", window_left=5),
    "sinks": dict(sinks="logits"),
    "scale": dict(sm_scale=0.7, sinks="logits", causal=False),
}


def _options(rng, hq, spec):
    opts = dict(spec)
    if opts.get("alibi"):
        opts["alibi_slopes"] = rng.uniform(0.1, 1.0, hq).astype(np.float32)
    if opts.get("sinks"):
        opts["sinks"] = rng.uniform(-2, 2, hq).astype(np.float32)
    opts.pop("alibi", None)
    return opts


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("hq,hk", GQA)
@pytest.mark.parametrize("q_len,kv_len", [(7, 11), (9, 9), (5, 3), (1, 13)])
def test_attend_matches_loop_oracle(rng, feature, hq, hk, q_len, kv_len):
    q, k, v = _seq(rng, q_len, kv_len, hq, hk, d=8, dtype=np.float32)
    opts = _options(rng, hq, FEATURES[feature])
    out, lse = ref.attend(q, k, v, **opts)
    want_out, want_lse = loop_attend(q, k, v, **opts)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    _close(out, want_out, 1e-12)
    _close_lse(lse, want_lse, 1e-12)


def test_softcap_is_applied_before_alibi(rng):
    """The documented order is observable: ALiBi added after the tanh is not squashed."""
    q, k, v = _seq(rng, 4, 6, 2, 2, d=8)
    slopes = np.array([3.0, 5.0], np.float32)
    out, _ = ref.attend(q, k, v, alibi_slopes=slopes, logits_soft_cap=0.5)
    want, _ = loop_attend(q, k, v, alibi_slopes=slopes, logits_soft_cap=0.5)
    _close(out, want, 1e-12)
    # with the cap after ALiBi the scores lie in (-0.5, 0.5): much flatter weights
    assert np.abs(out - ref.attend(q, k, v, logits_soft_cap=0.5)[0]).max() > 0.1


@pytest.mark.parametrize("dtype", DTYPES)
def test_attend_reads_low_precision_inputs_exactly(rng, dtype):
    q, k, v = _seq(rng, 6, 8, 8, 2, d=16, dtype=dtype)
    out, lse = ref.attend(q, k, v, window_left=4)
    want_out, want_lse = loop_attend(q.astype(np.float64), k.astype(np.float64),
                                     v.astype(np.float64), window_left=4)
    _close(out, want_out, 1e-12)
    _close_lse(lse, want_lse, 1e-12)


def test_rows_without_visible_keys(rng):
    hq = 4
    q, k, v = _seq(rng, 6, 3, hq, 2)
    sinks = rng.uniform(-1, 1, hq).astype(np.float32)
    out, lse = ref.attend(q, k, v)                  # p = -3..2: rows 0-2 see nothing
    assert not out[:3].any() and np.isneginf(lse[:3]).all()
    assert np.isfinite(lse[3:]).all()
    out, lse = ref.attend(q, k, v, sinks=sinks)
    assert not out[:3].any()
    np.testing.assert_array_equal(lse[:3], np.broadcast_to(_f64(sinks), (3, hq)))
    # a single visible key gets all the weight not taken by the sink
    out, _ = ref.attend(q, k, v, window_left=0)
    _close(out[3:], np.repeat(_f64(v), hq // 2, axis=1), 1e-12)


def test_empty_sequences(rng):
    q, k, v = _seq(rng, 4, 0, 4, 2)
    sinks = np.full(4, 0.5, np.float32)
    out, lse = ref.attend(q, k, v, causal=False, sinks=sinks)
    assert out.shape == (4, 4, 16) and not out.any()
    np.testing.assert_array_equal(lse, 0.5)
    out, lse = ref.attend(q[:0], *_seq(rng, 0, 5, 4, 2)[1:])
    assert out.shape == (0, 4, 16) and lse.shape == (0, 4)


# ----------------------------------------------------------------------------- varlen
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_seed004_example(rng, dtype):
    """cu_seq_lens_q [0, 10, 13, 14], cu_seq_lens_k [0, 0, 1, 8] (seed 004)."""
    hq, hk = 8, 2
    cu_q = np.array([0, 10, 13, 14], np.int32)
    cu_k = np.array([0, 0, 1, 8], np.int32)
    q, k, v = _seq(rng, 14, 8, hq, hk, dtype=dtype)
    sinks = rng.uniform(-1, 1, hq).astype(np.float32)
    out, lse = ref.varlen_prefill(q, k, v, cu_q, cu_k, return_lse=True)
    assert out.dtype == dtype and lse.dtype == np.float32 and out.shape == q.shape
    assert not out[:10].astype(np.float32).any() and np.isneginf(lse[:10]).all()  # kv 0
    assert not out[10:12].astype(np.float32).any()        # sequence 1: p = -2, -1
    _close(out[12], np.repeat(_f64(v[0]), hq // hk, axis=0), 0)  # p = 0: key 0 only
    _close(out[13], loop_attend(q[13:], k[1:], v[1:])[0][0], TOL[np.dtype(dtype)])
    out_s, lse_s = ref.varlen_prefill(q, k, v, cu_q, cu_k, sinks=sinks, return_lse=True)
    np.testing.assert_array_equal(lse_s[:12], np.broadcast_to(sinks, (12, hq)))
    want = loop_attend(q[10:13], k[:1], v[:1], sinks=sinks)[0]
    _close(out_s[10:13], want, TOL[np.dtype(dtype)])


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_is_attend_per_sequence(rng, causal):
    lens_q, lens_k = [3, 0, 7, 1, 4], [5, 2, 7, 9, 2]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q, k, v = _seq(rng, cu_q[-1], cu_k[-1], 8, 2, d=8)
    slopes = rng.uniform(0, 0.5, 8).astype(np.float32)
    out, lse = ref.varlen_prefill(q, k, v, cu_q, cu_k, causal=causal, window_left=3,
                                  alibi_slopes=slopes, return_lse=True)
    for i in range(len(lens_q)):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        want_o, want_l = loop_attend(q[rows], k[keys], v[keys], causal=causal, window_left=3,
                                     alibi_slopes=slopes)
        _close(out[rows], want_o, 1e-5)
        _close_lse(lse[rows], want_l)


# ----------------------------------------------------------------------------- paged caches
def _paged(rng, layout, dtype, lens, hk, d, block_size, spare_blocks=3):
    """Random caches holding ``lens[i]`` tokens (plus room for one more) per sequence.

    Returns ``(k_cache, v_cache, block_tables)``; blocks are scattered at random and the
    table is -1 padded. Every cache element is random, so unread garbage is random too.
    """
    need = [-(-(n + 1) // block_size) for n in lens]
    max_blocks = max(need) + 1
    num_blocks = sum(need) + spare_blocks
    ks, vs = cache_shapes(layout, num_blocks, block_size, hk, d, dtype)
    k_cache, v_cache = _rand(rng, ks, dtype), _rand(rng, vs, dtype)
    ids = rng.permutation(num_blocks)
    tables = np.full((len(lens), max_blocks), -1, np.int32)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[start:start + n]
        start += n
    return k_cache, v_cache, tables


def _loop_gather(k_cache, v_cache, table, n, layout):
    k_nhd, v_nhd = k_as_nhd(k_cache, layout), v_as_nhd(v_cache, layout)
    bs = k_nhd.shape[1]
    k = np.stack([k_nhd[table[t // bs], t % bs] for t in range(n)]) if n else k_nhd[0, :0]
    v = np.stack([v_nhd[table[t // bs], t % bs] for t in range(n)]) if n else v_nhd[0, :0]
    return k, v


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_kv_matches_token_loop(rng, layout, dtype):
    k_cache, v_cache, tables = _paged(rng, layout, dtype, [13, 0, 16], hk=3, d=16,
                                      block_size=8)
    for i, n in enumerate([13, 0, 16]):
        k, v = ref.gather_kv(k_cache, v_cache, tables[i], n, layout)
        want_k, want_v = _loop_gather(k_cache, v_cache, tables[i], n, layout)
        assert k.shape == (n, 3, 16) and k.dtype == dtype
        np.testing.assert_array_equal(k, want_k)
        np.testing.assert_array_equal(v, want_v)
    with pytest.raises(ValueError, match="block_table"):
        ref.gather_kv(k_cache, v_cache, tables[1], 9, layout)   # one block, then -1


def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _gathered(k_cache, v_cache, tables, lens, layout):
    pairs = [_loop_gather(k_cache, v_cache, tables[i], n, layout) for i, n in enumerate(lens)]
    return np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk", GQA)
def test_paged_decode_is_varlen_on_gathered_kv(rng, layout, dtype, hq, hk):
    lens = np.array([17, 0, 1, 32, 45], np.int32)
    k_cache, v_cache, tables = _paged(rng, layout, dtype, lens, hk, 16, block_size=16)
    q = _rand(rng, (len(lens), hq, 16), dtype)
    opts = dict(sinks=rng.uniform(-1, 1, hq).astype(np.float32), window_left=20,
                alibi_slopes=rng.uniform(0, 0.3, hq).astype(np.float32), logits_soft_cap=4.0)
    out, lse = ref.paged_decode(q, k_cache, v_cache, tables, lens, layout=layout,
                                return_lse=True, **opts)
    k, v = _gathered(k_cache, v_cache, tables, lens, layout)
    want, want_lse = ref.varlen_prefill(q, k, v, _cu([1] * len(lens)), _cu(lens),
                                        return_lse=True, **opts)
    assert out.dtype == dtype and lse.dtype == np.float32
    _close(out, want, TOL[np.dtype(dtype)])
    _close_lse(lse, want_lse, 1e-6)
    assert not out[1].astype(np.float32).any()                      # length 0 -> zeros


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_appends_then_attends(rng, layout, dtype):
    hq, hk, d = 8, 2, 16
    lens = np.array([15, 16, 0, 33], np.int32)
    k_cache, v_cache, tables = _paged(rng, layout, dtype, lens, hk, d, block_size=16)
    q = _rand(rng, (len(lens), hq, d), dtype)
    k_new, v_new = _rand(rng, (len(lens), hk, d), dtype), _rand(rng, (len(lens), hk, d), dtype)
    k_old, v_old = _gathered(k_cache, v_cache, tables, lens, layout)
    out, lse = ref.paged_decode(q, k_cache, v_cache, tables, lens, k_new=k_new, v_new=v_new,
                                layout=layout, return_lse=True)
    # manual append: each sequence's old keys followed by its new one
    cu_old = _cu(lens)
    k = np.concatenate([np.concatenate([k_old[cu_old[i]:cu_old[i + 1]], k_new[i:i + 1]])
                        for i in range(len(lens))])
    v = np.concatenate([np.concatenate([v_old[cu_old[i]:cu_old[i + 1]], v_new[i:i + 1]])
                        for i in range(len(lens))])
    want, want_lse = ref.varlen_prefill(q, k, v, _cu([1] * len(lens)), _cu(lens + 1),
                                        return_lse=True)
    _close(out, want, TOL[np.dtype(dtype)])
    _close_lse(lse, want_lse, 1e-6)
    np.testing.assert_array_equal(_gathered(k_cache, v_cache, tables, lens + 1, layout)[0], k)
    with pytest.raises(ValueError, match="k_new"):
        ref.paged_decode(q, k_cache, v_cache, tables, lens, k_new=k_new, layout=layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_paged_decode_seed004_example(rng, layout):
    """block_table [[2,-1,-1,-1],[0,1,-1,-1],[3,5,6,-1]], cache_seqlens [30,32,70], bs 32."""
    hq, hk, d, bs = 4, 2, 16, 32
    tables = np.array([[2, -1, -1, -1], [0, 1, -1, -1], [3, 5, 6, -1]], np.int32)
    lens = np.array([30, 32, 70], np.int32)
    ks, vs = cache_shapes(layout, 8, bs, hk, d, np.float16)
    k_cache, v_cache = _rand(rng, ks, np.float16), _rand(rng, vs, np.float16)
    k0, v0 = k_as_nhd(k_cache, layout).copy(), v_as_nhd(v_cache, layout).copy()
    q = _rand(rng, (3, hq, d), np.float16)
    k_new, v_new = _rand(rng, (3, hk, d), np.float16), _rand(rng, (3, hk, d), np.float16)
    out = ref.paged_decode(q, k_cache, v_cache, tables, lens, k_new=k_new, v_new=v_new,
                           layout=layout)
    k1, v1 = k_as_nhd(k_cache, layout), v_as_nhd(v_cache, layout)
    landed = [(2, 30), (1, 0), (6, 6)]       # (block, offset) of each new token
    for i, (blk, off) in enumerate(landed):
        np.testing.assert_array_equal(k1[blk, off], k_new[i])
        np.testing.assert_array_equal(v1[blk, off], v_new[i])
        k0[blk, off], v0[blk, off] = k_new[i], v_new[i]
    np.testing.assert_array_equal(k1, k0)    # nothing else written
    np.testing.assert_array_equal(v1, v0)
    for i, n in enumerate([31, 33, 71]):
        k, v = _loop_gather(k_cache, v_cache, tables[i], n, layout)
        want, _ = loop_attend(q[i:i + 1], k, v)
        _close(out[i:i + 1], want, 2e-3)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float32, bfloat16])
def test_chunked_paged_prefill_equals_one_shot(rng, layout, dtype):
    """Each chunk is written to the cache, then attends to everything before it."""
    hq, hk, d, bs = 8, 2, 16, 8
    prompts, chunks = [23, 17], [[7, 9, 7], [10, 7]]
    k_cache, v_cache, tables = _paged(rng, layout, dtype, prompts, hk, d, block_size=bs)
    q = _rand(rng, (sum(prompts), hq, d), dtype)
    k, v = _rand(rng, (sum(prompts), hk, d), dtype), _rand(rng, (sum(prompts), hk, d), dtype)
    opts = dict(window_left=9, sinks=rng.uniform(-1, 1, hq).astype(np.float32),
                alibi_slopes=rng.uniform(0, 0.3, hq).astype(np.float32), logits_soft_cap=5.0)
    want, want_lse = ref.varlen_prefill(q, k, v, _cu(prompts), _cu(prompts),
                                        return_lse=True, **opts)
    starts = _cu(prompts)
    outs, lses = np.full_like(q, np.nan), np.full((sum(prompts), hq), np.nan, np.float32)
    for step in range(3):
        rows = [np.arange(starts[i] + sum(c[:step]), starts[i] + sum(c[:step + 1]))
                for i, c in enumerate(chunks)]
        done = np.array([sum(c[:step + 1]) for c in chunks], np.int32)
        new = np.concatenate(rows)
        slots = ref.append_slots(np.repeat(tables, [len(r) for r in rows], axis=0),
                                 np.concatenate([r - starts[i] for i, r in enumerate(rows)]), bs)
        write_kv_cache(k[new], v[new], k_cache, v_cache, slots, layout)
        o, l = ref.paged_prefill(q[new], k_cache, v_cache, _cu([len(r) for r in rows]), tables,
                                 done, layout=layout, return_lse=True, **opts)
        outs[new], lses[new] = o, l
    _close(outs, want, TOL[np.dtype(dtype)])
    _close_lse(lses, want_lse, 1e-6)


def test_paged_attention_mixed_batch(rng):
    """Decode rows (q_len 1) and prefill rows in one batch, q_len > kv_len included."""
    hq, hk, d = 4, 4, 16
    lens, q_lens = np.array([9, 20, 2, 5], np.int32), [1, 6, 4, 1]
    k_cache, v_cache, tables = _paged(rng, "HND", np.float32, lens, hk, d, block_size=4)
    q = _rand(rng, (sum(q_lens), hq, d))
    out = ref.paged_attention(q, k_cache, v_cache, _cu(q_lens), tables, lens, layout="HND")
    cu = _cu(q_lens)
    for i, n in enumerate(lens):
        k, v = _loop_gather(k_cache, v_cache, tables[i], n, "HND")
        _close(out[cu[i]:cu[i + 1]], loop_attend(q[cu[i]:cu[i + 1]], k, v)[0], 1e-5)
    assert not out[cu[2]:cu[2] + 2].any()    # 4 queries over 2 keys: rows 0, 1 see none
    assert ref.paged_attention is ref.paged_prefill


# ----------------------------------------------------------------------------- sinks, merging
@pytest.mark.parametrize("hq", [1, 5])
def test_sink_is_an_extra_key_with_zero_value(rng, hq):
    """A key whose score is exactly sink_h and whose value is 0 stands in for the sink."""
    d, scale = 16, 0.3
    q = rng.standard_normal((1, hq, d))
    k, v = rng.standard_normal((9, hq, d)), rng.standard_normal((9, hq, d))
    sinks = rng.uniform(-2, 3, hq).astype(np.float32)
    k_sink = q[0] * (_f64(sinks) / (scale * np.einsum("hd,hd->h", q[0], q[0])))[:, None]
    k_ext = np.concatenate([k_sink[None], k])
    v_ext = np.concatenate([np.zeros((1, hq, d)), v])
    out, lse = ref.attend(q, k, v, causal=False, sm_scale=scale, sinks=sinks)
    want, want_lse = ref.attend(q, k_ext, v_ext, causal=False, sm_scale=scale)
    _close(out, want, 1e-12)
    _close(lse, want_lse, 1e-12, "lse")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [0, 6, 13])
def test_merge_states_of_disjoint_halves(rng, dtype, split):
    hq, hk = 8, 2
    q, k, v = _seq(rng, 5, 13, hq, hk)
    sinks = rng.uniform(-1, 1, hq).astype(np.float32)
    full, full_lse = ref.attend(q, k, v, causal=False, sinks=sinks)
    # the sink belongs to exactly one part
    a, lse_a = ref.attend(q, k[:split], v[:split], causal=False, sinks=sinks)
    b, lse_b = ref.attend(q, k[split:], v[split:], causal=False)
    out, lse = ref.merge_states(a.astype(dtype), lse_a.astype(np.float32),
                                b.astype(dtype), lse_b.astype(np.float32))
    assert out.dtype == dtype and lse.dtype == np.float32
    _close(out, full, TOL[np.dtype(dtype)])
    _close(lse, full_lse, 1e-5, "lse")


def test_merge_states_empty_sides(rng):
    t, h, d = 3, 2, 8
    a = rng.standard_normal((t, h, d)).astype(np.float32)
    lse_a = rng.standard_normal((t, h)).astype(np.float32)
    empty = np.full((t, h), -np.inf, np.float32)
    garbage = np.full((t, h, d), np.nan, np.float32)   # an empty side's rows are ignored
    out, lse = ref.merge_states(a, lse_a, garbage, empty)
    np.testing.assert_allclose(out, a, rtol=1e-6)
    np.testing.assert_allclose(lse, lse_a, rtol=1e-6)
    out, lse = ref.merge_states(garbage, empty, a, lse_a)
    np.testing.assert_allclose(out, a, rtol=1e-6)
    out, lse = ref.merge_states(garbage, empty, garbage, empty)
    assert not out.any() and np.isneginf(lse).all()
