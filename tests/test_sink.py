"""Sink softmax and seed 000's unified sink attention: NumPy path vs oracles, kernels vs reference."""
import numpy as np
import pytest

import cupaged
from cupaged.core.arrays import bfloat16
from cupaged.reference import sink as ref

DTYPES = [np.float16, bfloat16, np.float32]
TOL = {np.dtype(np.float16): 2e-3, bfloat16: 1e-2, np.dtype(np.float32): 1e-4}


def rand(rng, shape, dtype=np.float64, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def assert_close(actual, expected, dtype):
    tol = TOL[np.dtype(dtype)]
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    np.testing.assert_allclose(a, e, rtol=tol, atol=tol * max(1.0, np.abs(e).max(initial=0)))


def assert_probs_close(actual, expected, dtype):
    """Row-relative: ``|a - e| <= tol * (|e| + max of e's row)``, so tiny probabilities count."""
    tol = TOL[np.dtype(dtype)]
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    row_max = np.abs(e).max(axis=-1, keepdims=True, initial=0)
    bad = np.abs(a - e) > tol * (np.abs(e) + row_max) + 1e-30
    assert not bad.any(), f"{bad.sum()} of {bad.size} elements differ, first at {np.argwhere(bad)[0]}"


def appended_column_softmax(logits, sinks):
    """Seed 000's definition: append the sink as a column, softmax, drop the column."""
    x = np.asarray(logits, np.float64)
    col = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None], x.shape[:-1] + (1,))
    z = np.concatenate([x, col], axis=-1)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True))[..., :-1]


def masked_logits(rng, shape, dtype, masked_fraction=0.3, empty_rows=True):
    x = rand(rng, shape, np.float64, 3.0)
    x[rng.random(shape) < masked_fraction] = -np.inf
    if empty_rows:
        x.reshape(-1, shape[-1])[::5] = -np.inf
    return x.astype(dtype)


# ----------------------------------------------------------------------------- sink_softmax, CPU
@pytest.mark.parametrize("shape", [(2, 3, 4, 9), (3, 5, 1), (4, 2, 2, 3, 6)])
def test_softmax_numpy_matches_seed_definition(rng, shape):
    x = masked_logits(rng, shape, np.float32)
    sinks = rand(rng, (shape[-3],), np.float32)
    p = cupaged.sink_softmax(x, sinks)
    assert p.dtype == np.float32 and p.shape == x.shape
    np.testing.assert_allclose(p, appended_column_softmax(x, sinks), atol=1e-6)
    np.testing.assert_array_equal(p[np.isneginf(x)], 0)
    sink_mass = 1 - p.sum(axis=-1)
    assert (sink_mass > 0).all() and (sink_mass <= 1 + 1e-6).all()


def test_softmax_all_masked_rows_are_zero():
    x = np.full((1, 2, 3, 4), -np.inf, np.float16)
    p = cupaged.sink_softmax(x, np.array([0.5, -np.inf], np.float32))
    np.testing.assert_array_equal(p, 0)


SOFTMAX_BAD = [
    (np.zeros((3, 4), np.float32), np.zeros(3, np.float32), ValueError, "logits"),
    (np.zeros((2, 3, 4), np.int32), np.zeros(2, np.float32), TypeError, "logits"),
    (np.zeros((2, 3, 4), np.float32), np.zeros(3, np.float32), ValueError, "sinks"),
    (np.zeros((2, 3, 4), np.float32), np.zeros(2, np.float16), TypeError, "sinks"),
    (np.zeros((2, 4, 3), np.float32).transpose(0, 2, 1), np.zeros(2, np.float32), ValueError, "logits"),
]


@pytest.mark.parametrize("logits,sinks,exc,name", SOFTMAX_BAD)
def test_softmax_bad_input(logits, sinks, exc, name):
    with pytest.raises(exc, match=name):
        cupaged.sink_softmax(logits, sinks)


# ----------------------------------------------------------------------------- sink_attention oracle
def _attend(q, k, v, sink, visible, scale):
    """float64 attention of one sequence under ``visible`` [q_len, kv_len], GQA, sink."""
    g = q.shape[1] // k.shape[1]
    kk, vv = (np.repeat(np.asarray(x, np.float64), g, axis=1) for x in (k, v))
    s = scale * np.einsum("ihd,jhd->hij", np.asarray(q, np.float64), kk)
    s = np.where(visible[None], s, -np.inf)
    return np.einsum("hij,jhd->ihd", appended_column_softmax(s, sink), vv)


def seed_mask(mode, qo, kv, causal, w):
    """Seed 000's mask of one sequence, rule by rule."""
    i, j = np.arange(qo)[:, None], np.arange(kv)[None, :]
    p = kv - qo + i
    if mode == "prefill":  # window counted from the row index
        visible = (j <= p) if causal else np.ones((qo, kv), bool)
        return visible & (j >= i - w) if w >= 0 else visible
    visible = (j <= p) if causal else np.ones((qo, kv), bool)
    return visible & (j >= p - w) if w >= 0 else visible


def seed_oracle(q, k, v, sink, w, causal, scale, mode, cu_q, cu_k):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = np.zeros(q.shape)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        mask = seed_mask(mode, cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b], causal, w)
        out[rows] = _attend(q[rows], k[keys], v[keys], sink, mask, scale)
    return out


def make_case(rng, mode, dtype, heads=(8, 2), d=64, batch=3, qo=4, kv=9):
    """Inputs of one mode plus the ragged (cu_q, cu_k) the oracle reads."""
    hq, hk = heads
    sink = rand(rng, (hq,), np.float32)
    if mode == "incremental":
        q, k, v = (rand(rng, s, dtype) for s in ((batch, hq, d), (batch, kv, hk, d), (batch, kv, hk, d)))
        cu_q, cu_k = np.arange(batch + 1), np.arange(batch + 1) * kv
        return dict(q=q, k=k, v=v, sink=sink), (cu_q, cu_k), (k.reshape(-1, hk, d), v.reshape(-1, hk, d))
    if mode == "varlen":
        lq, lk = np.array([3, 0, 5, 1]), np.array([7, 4, 5, 2])
        cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
        q, k, v = (rand(rng, (c[-1], h, d), dtype) for c, h in ((cu_q, hq), (cu_k, hk), (cu_k, hk)))
        return (dict(q=q, k=k, v=v, sink=sink, qo_indptr=cu_q, kv_indptr=cu_k), (cu_q, cu_k), (k, v))
    qo = kv if mode == "prefill" else qo
    q, k, v = (rand(rng, (batch * n, h, d), dtype) for n, h in ((qo, hq), (kv, hk), (kv, hk)))
    cu_q, cu_k = np.arange(batch + 1) * qo, np.arange(batch + 1) * kv
    return dict(q=q, k=k, v=v, sink=sink, batch_size=batch), (cu_q, cu_k), (k, v)


OPTIONS = [(-1, True, None), (2, True, 0.1), (-1, False, 0.2), (3, False, None), (0, True, None)]
MODES = ["prefill", "incremental", "chunk", "varlen"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window,causal,scale", OPTIONS)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (4, 1)])
def test_attention_numpy_matches_seed_oracle(rng, mode, window, causal, scale, heads):
    args, (cu_q, cu_k), (k_flat, v_flat) = make_case(rng, mode, np.float32, heads=heads)
    out = cupaged.sink_attention(window_left=window, causal=causal, sm_scale=scale, mode="auto", **args)
    want = seed_oracle(args["q"], k_flat, v_flat, args["sink"], window, causal, scale, mode, cu_q, cu_k)
    assert out.dtype == np.float32 and out.shape == args["q"].shape
    np.testing.assert_allclose(out, want, atol=1e-5)
    forced = cupaged.sink_attention(window_left=window, causal=causal, sm_scale=scale, mode=mode, **args)
    np.testing.assert_array_equal(forced, out)


def test_attention_forced_prefill_uses_row_window(rng):
    """Prefill mode with qo_len != kv_len: seed 000 counts the window from the row index."""
    args, (cu_q, cu_k), (k, v) = make_case(rng, "chunk", np.float32, qo=3, kv=8)
    out = cupaged.sink_attention(window_left=1, causal=True, sm_scale=None, mode="prefill", **args)
    want = seed_oracle(args["q"], k, v, args["sink"], 1, True, None, "prefill", cu_q, cu_k)
    np.testing.assert_allclose(out, want, atol=1e-5)
    chunk = cupaged.sink_attention(window_left=1, causal=True, sm_scale=None, mode="chunk", **args)
    assert not np.allclose(out, chunk)


def test_attention_flattened_incremental(rng):
    """Auto mode, flattened k with one query per sequence: read as [B, kv_len, Hk, D]."""
    args, _, _ = make_case(rng, "incremental", np.float32)
    b, kv, hk, d = args["k"].shape
    flat = dict(args, k=args["k"].reshape(b * kv, hk, d), v=args["v"].reshape(b * kv, hk, d))
    got = cupaged.sink_attention(window_left=2, causal=True, sm_scale=None, batch_size=b, **flat)
    want = cupaged.sink_attention(window_left=2, causal=True, sm_scale=None, **args)
    np.testing.assert_allclose(got, want, atol=1e-6)


def _args(rng, **change):
    q, k, v = rand(rng, (8, 4, 64), np.float32), rand(rng, (8, 2, 64), np.float32), rand(rng, (8, 2, 64), np.float32)
    a = dict(q=q, k=k, v=v, sink=np.zeros(4, np.float32), window_left=-1, causal=True, sm_scale=None)
    a.update(change)
    return a


ATTN_BAD = [  # the seed's errors first, then our checks
    (dict(mode="banana"), ValueError, "Unknown mode: banana"),
    (dict(), ValueError, "batch_size is required for auto-detection"),
    (dict(mode="prefill"), ValueError, "batch_size is required for prefill mode"),
    (dict(mode="chunk"), ValueError, "batch_size is required for chunk mode"),
    (dict(mode="varlen"), ValueError, "qo_indptr and kv_indptr are required"),
    (dict(qo_indptr=np.array([0, 8], np.int32)), ValueError, "qo_indptr and kv_indptr are required"),
    (dict(q=np.zeros((1, 8, 4, 64), np.float32), k=np.zeros((1, 8, 2, 64), np.float32)),
     ValueError, "Cannot auto-detect mode from tensor shapes"),
    (dict(batch_size=16, k=np.zeros((40, 2, 64), np.float32), v=np.zeros((40, 2, 64), np.float32)),
     ValueError, "Cannot auto-detect mode: qo_len=0"),
    (dict(batch_size=3, mode="prefill"), ValueError, "divisible by batch_size"),
    (dict(batch_size=0), ValueError, "batch_size"),
    (dict(batch_size=2, sink=np.zeros(2, np.float32)), ValueError, "sink"),
    (dict(batch_size=2, sink=np.zeros(4, np.float64)), TypeError, "sink"),
    (dict(batch_size=2, window_left=-2), ValueError, "window_left"),
    (dict(batch_size=2, sm_scale=float("nan")), ValueError, "sm_scale"),
    (dict(batch_size=2, causal="yes"), TypeError, "causal"),
    (dict(batch_size=2, v=np.zeros((8, 2, 64), np.float16)), TypeError, "v"),
    (dict(batch_size=2, k=np.zeros((8, 3, 64), np.float32), v=np.zeros((8, 3, 64), np.float32)),
     ValueError, "num_kv_heads"),
    (dict(batch_size=2, q=np.zeros((8, 4, 48), np.float32), k=np.zeros((8, 2, 48), np.float32),
          v=np.zeros((8, 2, 48), np.float32)), ValueError, "head size"),
    (dict(mode="varlen", qo_indptr=np.array([0, 4, 8], np.int32), kv_indptr=np.array([0, 8], np.int32)),
     ValueError, "kv_indptr"),
    (dict(mode="varlen", qo_indptr=np.array([0, 4, 7], np.int32), kv_indptr=np.array([0, 4, 8], np.int32)),
     ValueError, "qo_indptr"),
    (dict(mode="varlen", qo_indptr=np.array([0, 4, 8], np.int64), kv_indptr=np.array([0, 4, 8], np.int32)),
     TypeError, "qo_indptr"),
    (dict(mode="incremental", q=np.zeros((3, 4, 64), np.float32)), ValueError, "divisible"),
    (dict(mode="incremental", q=np.zeros((0, 4, 64), np.float32)), ValueError, "at least one sequence"),
]


@pytest.mark.parametrize("change,exc,message", ATTN_BAD, ids=[str(i) for i in range(len(ATTN_BAD))])
def test_attention_bad_input(rng, change, exc, message):
    with pytest.raises(exc, match=message):
        cupaged.sink_attention(**_args(rng, **change))


# ----------------------------------------------------------------------------- GPU: sink_softmax
SOFTMAX_SHAPES = [  # warp rows, CTA rows, split rows, odd lengths (unaligned rows)
    (2, 3, 5, 1), (2, 4, 3, 7), (1, 8, 33, 1024), (3, 2, 5, 1025), (1, 4, 9, 5000),
    (1, 2, 1, 300_001), (2, 1, 1, 1 << 20),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=[str(s[-1]) for s in SOFTMAX_SHAPES])
def test_gpu_softmax_matches_reference(rng, cp, dtype, shape):
    x = masked_logits(rng, shape, dtype)
    sinks = rand(rng, (shape[-3],), np.float32, 2.0)
    got = cupaged.sink_softmax(cp.asarray(x), cp.asarray(sinks))
    assert got.dtype == dtype and got.shape == x.shape
    want = ref.sink_softmax(x, sinks)
    assert_probs_close(got.get(), want, dtype)
    empty = np.isneginf(np.asarray(x, np.float32)).all(axis=-1)
    assert (got.get()[empty] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [bfloat16, np.float32])
@pytest.mark.parametrize("path_n", [(17, "warp"), (3001, "cta"), (70_001, "split")])
def test_gpu_softmax_writes_every_element(rng, cp, dtype, path_n):
    """Each path on a poisoned output; the input starts 2 bytes past a 16-byte boundary."""
    from cupaged.sink.api import _softmax_launch, plan_softmax
    n, path = path_n
    shape = (1, 2, 3, n)
    x = masked_logits(rng, shape, dtype, empty_rows=False)
    buf = cp.empty(x.size + 8, dtype=dtype)
    xs = buf[1:1 + x.size].reshape(shape)
    xs[...] = cp.asarray(x)
    sinks = cp.asarray(rand(rng, (2,), np.float32))
    plan = plan_softmax(6, n, 10_000)
    assert plan.path == path
    for src in (cp.asarray(x), xs):  # aligned (16-byte vectors) and misaligned (scalars)
        out = cp.full(shape, np.nan, dtype=dtype)
        _softmax_launch(plan, src, sinks, out)
        assert_probs_close(out.get(), ref.sink_softmax(x, sinks.get()), dtype)


@pytest.mark.gpu
def test_gpu_softmax_large_logits_and_neg_inf_sink(rng, cp):
    x = rand(rng, (1, 2, 4, 300), np.float32, 40.0)
    x[0, 1, 2] = -np.inf
    sinks = np.array([60.0, -np.inf], np.float32)
    got = cupaged.sink_softmax(cp.asarray(x), cp.asarray(sinks)).get()
    want = np.nan_to_num(appended_column_softmax(x, sinks))  # the seed's NaN row -> zeros
    assert_probs_close(got, want, np.float32)
    np.testing.assert_array_equal(got[0, 1, 2], 0)
    assert not np.isnan(got).any()


# ----------------------------------------------------------------------------- GPU: sink_attention
GPU_ATTN = [  # mode, dtype, heads, (window, causal, scale)
    ("prefill", np.float16, (8, 2), (-1, True, None)),
    ("prefill", bfloat16, (4, 4), (5, False, 0.1)),
    ("incremental", bfloat16, (8, 2), (-1, True, None)),
    ("incremental", np.float16, (4, 1), (6, False, None)),
    ("chunk", np.float16, (8, 2), (4, True, None)),
    ("chunk", np.float32, (4, 1), (-1, False, 0.15)),
    ("varlen", bfloat16, (8, 2), (3, True, None)),
    ("varlen", np.float16, (4, 4), (-1, False, None)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("mode,dtype,heads,opts", GPU_ATTN, ids=[f"{c[0]}-{i}" for i, c in enumerate(GPU_ATTN)])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_attention_matches_reference(rng, cp, mode, dtype, heads, opts, d):
    window, causal, scale = opts
    args, _, _ = make_case(rng, mode, dtype, heads=heads, d=d, batch=3, qo=37, kv=101)
    want = cupaged.sink_attention(window_left=window, causal=causal, sm_scale=scale, **args)
    dev = {name: cp.asarray(a) if isinstance(a, np.ndarray) else a for name, a in args.items()}
    got = cupaged.sink_attention(window_left=window, causal=causal, sm_scale=scale, **dev)
    assert got.dtype == dtype and got.shape == want.shape
    assert_close(got.get(), want, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("qo,kv,causal", [(3, 40, True), (9, 5, False), (9, 5, True)])
def test_gpu_attention_forced_prefill_row_window(rng, cp, qo, kv, causal):
    args, _, _ = make_case(rng, "chunk", np.float16, qo=qo, kv=kv)
    kw = dict(window_left=2, causal=causal, sm_scale=None, mode="prefill")
    want = cupaged.sink_attention(**kw, **args)
    dev = {name: cp.asarray(a) if isinstance(a, np.ndarray) else a for name, a in args.items()}
    assert_close(cupaged.sink_attention(**kw, **dev).get(), want, np.float16)
