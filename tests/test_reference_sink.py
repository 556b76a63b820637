"""Reference sink softmax and seed 000's unified sink attention.

The oracle here follows seed 000's formulation: a full logit matrix per sequence, the mode's
mask written out as the seed builds it, a sink column appended, a plain softmax, the sink
column dropped. It shares no code with ``cupaged.reference``.
"""
import numpy as np
import pytest

from cupaged.core.arrays import bfloat16
from cupaged.reference.attention import varlen_prefill
from cupaged.reference.sink import detect_mode, sink_attention, sink_softmax

HEADS = [(4, 4), (8, 2), (4, 1)]  # MHA, GQA 4, MQA


def rand(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def softmax_with_sink_column(logits, sink):
    """Seed 000's sink_softmax: append the sink as column n, softmax, drop it."""
    sink_col = np.broadcast_to(np.asarray(sink, np.float64)[:, None, None], logits.shape[:-1] + (1,))
    full = np.concatenate([logits.astype(np.float64), sink_col], axis=-1)
    e = np.exp(full - full.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True))[..., :-1]


def seed_mask(mode, qo_len, kv_len, causal, window_left):
    """The mask seed 000 builds in each mode, bool ``[qo_len, kv_len]``."""
    i, j = np.arange(qo_len)[:, None], np.arange(kv_len)[None, :]
    p = kv_len - qo_len + i
    mask = np.ones((qo_len, kv_len), bool)
    if mode == "incremental":
        return mask & ((kv_len - 1 - window_left <= j) if window_left >= 0 else True)
    if causal:
        mask &= p >= j
    if window_left >= 0:
        mask &= ((i if mode == "prefill" else p) - window_left) <= j
    return mask


def seed_oracle(q, k, v, sink, mask, sm_scale):
    """One sequence: q ``[qo_len, Hq, D]``, k/v ``[kv_len, Hk, D]`` -> float64 out."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    logits = sm_scale * np.einsum("qhd,khd->hqk", q.astype(np.float64), k.astype(np.float64))
    logits = np.where(mask[None], logits, -np.inf)
    return np.einsum("hqk,khd->qhd", softmax_with_sink_column(logits, sink), v.astype(np.float64))


def assert_close(actual, expected, tol):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- sink_softmax
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 7, 1), (1, 2, 3, 0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_sink_softmax_rows_sum_to_one_minus_sink(shape, dtype, rng):
    logits = rand(rng, shape, dtype)
    if logits.size:
        logits.reshape(-1)[rng.choice(logits.size, logits.size // 3, replace=False)] = -np.inf
    h = shape[-3]
    sink = rng.uniform(-1, 2, h).astype(np.float32)
    probs = sink_softmax(logits, sink)
    assert probs.shape == logits.shape and probs.dtype == np.dtype(dtype)
    tol = 2e-3 if dtype == np.float16 else 1e-6
    assert_close(probs, softmax_with_sink_column(logits, sink), tol)
    z = np.exp(logits.astype(np.float64)).sum(-1)
    p_sink = np.exp(sink.astype(np.float64))[:, None] / (z + np.exp(sink.astype(np.float64))[:, None])
    assert_close(probs.astype(np.float64).sum(-1), 1 - p_sink, tol)


def test_sink_softmax_all_masked_rows(rng):
    logits = np.full((2, 3, 4), -np.inf, np.float32)
    logits[1, 0, 2] = 0.5
    probs = sink_softmax(logits, np.array([0.3, -np.inf], np.float32))
    assert np.all(probs[0] == 0)  # finite sink takes all the mass
    assert probs[1, 0, 2] == 1 and np.all(probs[1, 1:] == 0)  # -inf sink: plain softmax, 0 rows
    bf = sink_softmax(rand(rng, (2, 1, 3), bfloat16), np.zeros(2, np.float32))
    assert bf.dtype == bfloat16


# ----------------------------------------------------------------------------- modes vs oracle
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window_left", [-1, 0, 3])
def test_prefill_and_chunk_modes_match_seed_oracle(heads, causal, window_left, rng):
    (hq, hk), d, batch = heads, 8, 3
    sink = rng.uniform(-1, 2, hq).astype(np.float32)
    for mode, qo_len, kv_len in (("prefill", 7, 7), ("chunk", 4, 9), ("prefill", 3, 8)):
        q = rand(rng, (batch * qo_len, hq, d))
        k, v = rand(rng, (batch * kv_len, hk, d)), rand(rng, (batch * kv_len, hk, d))
        out = sink_attention(q, k, v, sink, window_left, causal, 0.35, batch_size=batch, mode=mode)
        assert out.shape == q.shape and out.dtype == q.dtype
        mask = seed_mask(mode, qo_len, kv_len, causal, window_left)
        for b in range(batch):
            rows, keys = slice(b * qo_len, (b + 1) * qo_len), slice(b * kv_len, (b + 1) * kv_len)
            assert_close(out[rows], seed_oracle(q[rows], k[keys], v[keys], sink, mask, 0.35), 1e-5)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window_left", [-1, 0, 5])
@pytest.mark.parametrize("causal", [True, False])
def test_incremental_mode_matches_seed_oracle(heads, window_left, causal, rng):
    (hq, hk), d, batch, kv_len = heads, 8, 3, 11
    sink = rng.uniform(-1, 2, hq).astype(np.float32)
    q = rand(rng, (batch, hq, d), np.float16)
    k, v = rand(rng, (batch, kv_len, hk, d), np.float16), rand(rng, (batch, kv_len, hk, d), np.float16)
    out = sink_attention(q, k, v, sink, window_left, causal, None)
    assert out.shape == q.shape and out.dtype == np.float16
    mask = seed_mask("incremental", 1, kv_len, causal, window_left)
    for b in range(batch):
        assert_close(out[b:b + 1], seed_oracle(q[b:b + 1], k[b], v[b], sink, mask, d ** -0.5), 2e-3)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window_left", [-1, 2])
def test_varlen_mode_matches_seed_oracle(causal, window_left, rng):
    hq, hk, d = 8, 2, 8
    qo, kv = [5, 1, 4, 3], [5, 9, 2, 0]
    qo_indptr = np.cumsum([0] + qo).astype(np.int32)
    kv_indptr = np.cumsum([0] + kv).astype(np.int32)
    q, k, v = rand(rng, (sum(qo), hq, d)), rand(rng, (sum(kv), hk, d)), rand(rng, (sum(kv), hk, d))
    sink = rng.uniform(-1, 2, hq).astype(np.float32)
    out = sink_attention(q, k, v, sink, window_left, causal, 0.3, qo_indptr=qo_indptr,
                         kv_indptr=kv_indptr)
    for b in range(4):
        rows, keys = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
        mask = seed_mask("varlen", qo[b], kv[b], causal, window_left)
        assert_close(out[rows], seed_oracle(q[rows], k[keys], v[keys], sink, mask, 0.3), 1e-5)


# ----------------------------------------------------------------------------- modes agree
def test_prefill_equals_varlen_with_equal_lengths(rng):
    hq, hk, d, batch, n = 4, 1, 8, 2, 6
    q, k, v = rand(rng, (batch * n, hq, d)), rand(rng, (batch * n, hk, d)), rand(rng, (batch * n, hk, d))
    sink = rng.uniform(-1, 1, hq).astype(np.float32)
    indptr = np.arange(batch + 1, dtype=np.int32) * n
    for causal, window in ((True, -1), (True, 2), (False, 3)):
        pre = sink_attention(q, k, v, sink, window, causal, 0.4, batch_size=batch)  # auto
        var = sink_attention(q, k, v, sink, window, causal, 0.4, mode="varlen",
                             qo_indptr=indptr, kv_indptr=indptr)
        np.testing.assert_allclose(pre, var, rtol=1e-6)
        ref = varlen_prefill(q, k, v, indptr, indptr, causal=causal, window_left=window,
                             sm_scale=0.4, sinks=sink)
        np.testing.assert_allclose(pre, ref, rtol=1e-6)


def test_incremental_equals_varlen_with_one_query(rng):
    hq, hk, d, batch, kv_len = 8, 2, 8, 3, 7
    q = rand(rng, (batch, hq, d))
    k, v = rand(rng, (batch, kv_len, hk, d)), rand(rng, (batch, kv_len, hk, d))
    sink = rng.uniform(-1, 1, hq).astype(np.float32)
    inc = sink_attention(q, k, v, sink, -1, True, 0.5)
    qo_indptr = np.arange(batch + 1, dtype=np.int32)
    kv_indptr = qo_indptr * kv_len
    flat_k, flat_v = k.reshape(-1, hk, d), v.reshape(-1, hk, d)
    var = sink_attention(q, flat_k, flat_v, sink, -1, True, 0.5, qo_indptr=qo_indptr,
                         kv_indptr=kv_indptr)
    np.testing.assert_allclose(inc, var, rtol=1e-6)
    flat = sink_attention(q, flat_k, flat_v, sink, -1, True, 0.5, batch_size=batch)  # auto
    np.testing.assert_allclose(flat, inc, rtol=1e-6)


def test_prefill_window_counts_from_row_index(rng):
    """Forced prefill with qo_len != kv_len: the seed's window uses i, chunk mode uses p."""
    hq, d, qo_len, kv_len = 2, 4, 3, 8
    q, k, v = rand(rng, (qo_len, hq, d)), rand(rng, (kv_len, hq, d)), rand(rng, (kv_len, hq, d))
    sink = np.zeros(hq, np.float32)
    pre = sink_attention(q, k, v, sink, 1, True, 0.5, batch_size=1, mode="prefill")
    chunk = sink_attention(q, k, v, sink, 1, True, 0.5, batch_size=1, mode="chunk")
    assert not np.allclose(pre, chunk)
    mask = seed_mask("prefill", qo_len, kv_len, True, 1)
    assert_close(pre, seed_oracle(q, k, v, sink, mask, 0.5), 1e-5)


def test_detect_mode():
    q3, k3, k4 = np.zeros((6, 2, 4)), np.zeros((12, 2, 4)), np.zeros((6, 2, 2, 4))
    assert detect_mode(q3, k3, qo_indptr=np.zeros(2)) == "varlen"
    assert detect_mode(q3, k4) == "incremental"
    assert detect_mode(q3, np.zeros((6, 2, 4)), batch_size=2) == "prefill"
    assert detect_mode(q3, k3, batch_size=6) == "incremental"
    assert detect_mode(q3, k3, batch_size=2) == "chunk"


SEED_ERRORS = {
    "auto without batch_size": (dict(), (6, 12), "batch_size is required for auto-detection"),
    "qo_len 0": (dict(batch_size=8), (6, 16), "Cannot auto-detect mode: qo_len=0, kv_len=2"),
    "prefill without batch_size": (dict(mode="prefill"), (6, 6), "batch_size is required for prefill mode"),
    "chunk without batch_size": (dict(mode="chunk"), (6, 12), "batch_size is required for chunk mode"),
    "varlen without kv_indptr": (dict(qo_indptr=np.array([0, 6])), (6, 6),
                                 "qo_indptr and kv_indptr are required for varlen mode"),
    "unknown mode": (dict(mode="decode"), (6, 6), "Unknown mode: decode. Supported modes: 'auto'"),
    "not divisible": (dict(batch_size=4, mode="chunk"), (8, 10), "k: expected a token count"),
}


@pytest.mark.parametrize("case", list(SEED_ERRORS))
def test_seed_errors(case, rng):
    kwargs, (nq, nk), message = SEED_ERRORS[case]
    q, k = rand(rng, (nq, 2, 4)), rand(rng, (nk, 2, 4))
    with pytest.raises(ValueError, match=message):
        sink_attention(q, k, k, np.zeros(2, np.float32), -1, True, 0.5, **kwargs)


def test_unreadable_shapes_raise(rng):
    with pytest.raises(ValueError, match="Cannot auto-detect mode from tensor shapes"):
        sink_attention(rand(rng, (2, 2, 2, 4)), rand(rng, (2, 2, 4)), rand(rng, (2, 2, 4)),
                       np.zeros(2, np.float32), -1, True, 0.5)
