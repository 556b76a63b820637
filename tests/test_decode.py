"""Paged decode: NumPy path and planning on the CPU; kernels vs the float64 reference on the GPU.

Caches are random with every slot that no sequence may read set to NaN, so a kernel that
reads an invisible token (or leaves an output element unwritten: outputs are NaN-poisoned
too) fails.
"""
import re

import numpy as np
import pytest

import cupaged
from cupaged.decode import plan as dp
from cupaged.core.arrays import FLOAT_DTYPES, bfloat16
from cupaged.core.layouts import LAYOUTS, cache_shapes, k_as_nhd, layout_strides, v_as_nhd
from cupaged.reference import attention as ref

TOL = {np.dtype(np.float16): 2e-3, np.dtype(bfloat16): 1e-2, np.dtype(np.float32): 1e-4}


# ----------------------------------------------------------------------------- builders
def from_nhd(k, v, layout):
    """Caches in ``layout`` from logical ``[num_blocks, block_size, Hk, D]`` arrays."""
    if layout == "NHD":
        return k.copy(), v.copy()
    if layout == "HND":
        return k.transpose(0, 2, 1, 3).copy(), v.transpose(0, 2, 1, 3).copy()
    nb, bs, hk, d = k.shape
    x = 16 // k.dtype.itemsize
    return (k.reshape(nb, bs, hk, d // x, x).transpose(0, 2, 3, 1, 4).copy(),
            v.transpose(0, 2, 3, 1).copy())


def make_case(rng, *, lens, hq=8, hk=2, d=64, bs=16, layout="NHD", dtype=np.float16,
              append=False, spare_blocks=3, top=0):
    """A random paged batch: q, caches (unread slots NaN), tables, lengths, new k/v.

    Blocks are placed in random order; with ``top`` the used blocks sit at ids
    ``[top, top + used)`` of a cache of ``top + used + spare`` blocks.
    """
    dtype = np.dtype(dtype)
    lens = np.asarray(lens, np.int32)
    need = -(-(lens.astype(np.int64) + append) // bs)
    width = int(need.max(initial=0)) + 1
    used = int(need.sum())
    nb = top + used + spare_blocks
    ids = top + rng.permutation(used + spare_blocks)[:used]
    tables = np.full((len(lens), width), -1, np.int32)
    # built in the caches' dtype from float32 draws: the long-batch cases hold 10^8 elements
    k = np.full((nb, bs, hk, d), np.nan, dtype)
    v = np.full((nb, bs, hk, d), np.nan, dtype)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[start:start + n]
        start += n
        t = np.arange(lens[i])
        for c in (k, v):
            c[tables[i, t // bs], t % bs] = rng.standard_normal((len(t), hk, d), np.float32).astype(dtype)
    kc, vc = (k, v) if layout == "NHD" else from_nhd(k, v, layout)
    return dict(q=rng.standard_normal((len(lens), hq, d)).astype(dtype), k_cache=kc, v_cache=vc,
                block_tables=tables, seq_lens=lens,
                k_new=rng.standard_normal((len(lens), hk, d)).astype(dtype) if append else None,
                v_new=rng.standard_normal((len(lens), hk, d)).astype(dtype) if append else None)


def features(rng, hq, names):
    """Keyword options for a set of feature names (window, alibi, sinks, softcap)."""
    opts = {}
    if "window" in names:
        opts["window_left"] = 100
    if "window0" in names:
        opts["window_left"] = 0
    if "alibi" in names:
        opts["alibi_slopes"] = (2.0 ** -np.arange(1, hq + 1) * 4).astype(np.float32)
    if "sinks" in names:
        opts["sinks"] = rng.standard_normal(hq).astype(np.float32) + 1.0
    if "softcap" in names:
        opts["logits_soft_cap"] = 2.0
    if "scale" in names:
        opts["sm_scale"] = 0.3
    return opts


def oracle(case, layout, **opts):
    """Reference (float64 inside) on the caches in their own dtype (in their layout, or NHD
    copies when the case appends), q and the new rows as float32: exact for every input
    dtype.

    Returns ``((out, lse), after)``: ``after`` holds q and the new rows as float32 and the
    caches as NHD ``[num_blocks, block_size, Hk, D]``, updated by an append as the op's
    would be.
    """
    c = {n: (None if a is None else a.astype(np.float32) if a.dtype in FLOAT_DTYPES else a.copy())
         for n, a in case.items() if n not in ("k_cache", "v_cache")}
    caches = [case["k_cache"], case["v_cache"]]
    nhd = [k_as_nhd(caches[0], layout), v_as_nhd(caches[1], layout)]
    if case["k_new"] is not None:  # the append writes into NHD copies
        caches = nhd = [np.ascontiguousarray(x) for x in nhd]
    result = ref.paged_decode(c["q"], *caches, c["block_tables"], c["seq_lens"], k_new=c["k_new"],
                              v_new=c["v_new"], return_lse=True,
                              layout="NHD" if case["k_new"] is not None else layout, **opts)
    c["k_cache"], c["v_cache"] = nhd
    return result, c


def rel_err(out, want):
    out, want = np.asarray(out, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(out - want) / max(np.linalg.norm(want), 1e-30)


# ----------------------------------------------------------------------------- CPU: builders
@pytest.mark.parametrize("layout", LAYOUTS)
def test_from_nhd_round_trips(rng, layout):
    k = rng.standard_normal((3, 4, 2, 16)).astype(np.float16)
    v = rng.standard_normal((3, 4, 2, 16)).astype(np.float16)
    kc, vc = from_nhd(k, v, layout)
    assert (kc.shape, vc.shape) == cache_shapes(layout, 3, 4, 2, 16, np.float16)
    np.testing.assert_array_equal(k_as_nhd(kc, layout), k)
    np.testing.assert_array_equal(v_as_nhd(vc, layout), v)


# ----------------------------------------------------------------------------- CPU: NumPy path
@pytest.mark.parametrize("layout,dtype,feats,append", [
    ("NHD", np.float32, (), False),
    ("HND", np.float16, ("window", "sinks"), True),
    ("vllm", bfloat16, ("alibi", "softcap", "scale"), False),
    ("vllm", np.float32, ("window", "alibi", "sinks", "softcap"), True),
])
def test_numpy_path_matches_reference(rng, layout, dtype, feats, append):
    case = make_case(rng, lens=[0, 1, 17, 40], hq=4, hk=2, d=64, bs=8, layout=layout,
                     dtype=dtype, append=append)
    opts = features(rng, 4, feats)
    (want, want_lse), after = oracle(case, layout, **opts)
    out = np.full(case["q"].shape, np.nan, case["q"].dtype)
    got, lse = cupaged.paged_decode(**case, layout=layout, out=out, return_lse=True, **opts)
    assert got is out
    assert rel_err(got, want) < TOL[np.dtype(dtype)]
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert_same_values(k_as_nhd(case["k_cache"], layout), after["k_cache"])
    assert_same_values(v_as_nhd(case["v_cache"], layout), after["v_cache"])


def test_numpy_empty_rows_are_zero_with_sink_lse(rng):
    case = make_case(rng, lens=[0, 5], hq=4, hk=4)
    sinks = np.arange(4, dtype=np.float32)
    out, lse = cupaged.paged_decode(**case, sinks=sinks, return_lse=True, layout="NHD")
    assert (out[0] == 0).all() and np.isfinite(out).all()
    np.testing.assert_allclose(lse[0], sinks, rtol=1e-6)


def test_decoder_numpy_matches_function(rng):
    case = make_case(rng, lens=[3, 33, 0], hq=6, hk=3, d=80, bs=4, layout="HND", append=True)
    want = cupaged.paged_decode(**{**case, "k_cache": case["k_cache"].copy(),
                                   "v_cache": case["v_cache"].copy()}, layout="HND",
                                window_left=7, return_lse=True)
    dec = cupaged.PagedDecoder(6, 3, 80, 4, dtype="float16", layout="HND", window_left=7,
                               max_batch=4)
    dec.plan(case["block_tables"], case["seq_lens"], append=True)
    lse = np.empty((3, 6), np.float32)
    got = dec.run(case["q"], case["k_cache"], case["v_cache"], k_new=case["k_new"],
                  v_new=case["v_new"], lse=lse, return_lse=True)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(lse, want[1])


def test_merge_states_numpy_matches_reference(rng):
    a, b = rng.standard_normal((2, 5, 3, 20)).astype(np.float32)
    la, lb = rng.standard_normal((2, 5, 3)).astype(np.float32)
    la[0, 0] = -np.inf
    out, lse = cupaged.merge_states(a, la, b, lb)
    want, want_lse = ref.merge_states(a, la, b, lb)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)


# ----------------------------------------------------------------------------- CPU: bad input
def _bad_cases(case):
    """(argument overrides, error type, text expected in the message)."""
    q, kc, bt, sl = case["q"], case["k_cache"], case["block_tables"], case["seq_lens"]
    nb = kc.shape[0]
    too_long = sl.copy()
    too_long[1] = bt.shape[1] * kc.shape[1] + 1
    full = sl.copy()
    full[0] = bt.shape[1] * kc.shape[1]  # fits, but leaves no room for k_new
    bad_ids = bt.copy()
    bad_ids[0, 0] = nb
    return [
        (dict(q=np.ascontiguousarray(q[..., :48])), ValueError, "q.shape[-1]"),
        (dict(q=q.astype(np.int32)), TypeError, "q"),
        (dict(q=q[:, :, None]), ValueError, "q"),
        (dict(q=np.asfortranarray(q)), ValueError, "q"),
        (dict(q=q.astype(np.float32)), TypeError, "k_cache"),
        (dict(k_cache=np.ascontiguousarray(kc[..., :32]),
              v_cache=np.ascontiguousarray(case["v_cache"][..., :32])), ValueError, "k_cache"),
        (dict(k_cache=kc[:, :, :, ::2]), ValueError, "k_cache"),
        (dict(v_cache=case["v_cache"][:1]), ValueError, "v_cache"),
        (dict(layout="NDH"), ValueError, "layout"),
        (dict(block_tables=bt.astype(np.int64)), TypeError, "block_tables"),
        (dict(block_tables=bad_ids), ValueError, "block_tables"),
        (dict(block_tables=bt[:1]), ValueError, "block_tables"),
        (dict(seq_lens=sl.astype(np.int64)), TypeError, "seq_lens"),
        (dict(seq_lens=-sl - 1), ValueError, "seq_lens"),
        (dict(seq_lens=too_long), ValueError, "seq_lens"),
        (dict(seq_lens=full, k_new=case["k_new"], v_new=case["v_new"]), ValueError, "seq_lens"),
        (dict(k_new=case["k_new"]), ValueError, "k_new"),
        (dict(k_new=case["k_new"][:, :1], v_new=case["v_new"]), ValueError, "k_new"),
        (dict(k_new=case["k_new"], v_new=case["v_new"].astype(np.float32)), TypeError, "v_new"),
        (dict(sm_scale=float("nan")), ValueError, "sm_scale"),
        (dict(window_left=-2), ValueError, "window_left"),
        (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, "alibi_slopes"),
        (dict(sinks=np.ones(q.shape[1], np.float64)), TypeError, "sinks"),
        (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
        (dict(num_splits=0), ValueError, "num_splits"),
        (dict(num_splits=2.5), ValueError, "num_splits"),
        (dict(out=np.empty(q.shape, np.float32)), TypeError, "out"),
        (dict(out=np.empty(q.shape[:2], q.dtype)), ValueError, "out"),
        (dict(block_tables=bt.tolist()), TypeError, "list"),
    ]


def test_bad_input_raises_before_any_change(rng):
    case = make_case(rng, lens=[5, 30], hq=4, hk=2, d=64, bs=8, append=True)
    case["k_new"], case["v_new"] = case.pop("k_new"), case.pop("v_new")
    for overrides, error, text in _bad_cases(case):
        args = {**case, "k_new": None, "v_new": None, "layout": "NHD", **overrides}
        before = (args["k_cache"].copy(), args["v_cache"].copy())
        with pytest.raises(error, match=re.escape(text)):
            cupaged.paged_decode(**args)
        np.testing.assert_array_equal(args["k_cache"], before[0])
        np.testing.assert_array_equal(args["v_cache"], before[1])


def test_decoder_bad_input(rng):
    case = make_case(rng, lens=[5, 30], hq=4, hk=2, d=64, bs=8)
    with pytest.raises(ValueError, match="num_kv_heads"):
        cupaged.PagedDecoder(4, 3, 64, 8, layout="NHD")
    with pytest.raises(ValueError, match="head_dim"):
        cupaged.PagedDecoder(4, 2, 72, 8, layout="NHD")
    with pytest.raises(ValueError, match="block_size"):
        cupaged.PagedDecoder(4, 2, 64, 0, layout="NHD")
    with pytest.raises(ValueError, match="backend"):
        cupaged.PagedDecoder(4, 2, 64, 8, backend="tma", layout="NHD")
    with pytest.raises(ValueError, match="backend"):
        cupaged.paged_decode(case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
                             case["seq_lens"], backend="tma", layout="NHD")
    dec = cupaged.PagedDecoder(4, 2, 64, 8, max_batch=1, layout="NHD")
    with pytest.raises(ValueError, match="plan"):
        dec.run(case["q"], case["k_cache"], case["v_cache"])
    with pytest.raises(ValueError, match="max_batch"):
        dec.plan(case["block_tables"], case["seq_lens"])
    dec = cupaged.PagedDecoder(4, 2, 64, 8, max_batch=2, layout="NHD")
    dec.plan(case["block_tables"], case["seq_lens"])
    with pytest.raises(ValueError, match="k_new"):
        dec.run(case["q"], case["k_cache"], case["v_cache"], k_new=case["q"][:, :2],
                v_new=case["q"][:, :2])
    with pytest.raises(ValueError, match="block_tables"):
        dec.run(case["q"], case["k_cache"][:2], case["v_cache"][:2])
    with pytest.raises(ValueError, match="q"):
        dec.run(case["q"][:1], case["k_cache"], case["v_cache"])


def test_merge_states_bad_input(rng):
    a = rng.standard_normal((2, 3, 8)).astype(np.float16)
    la = np.zeros((2, 3), np.float32)
    with pytest.raises(TypeError, match="out_b"):
        cupaged.merge_states(a, la, a.astype(np.float32), la)
    with pytest.raises(ValueError, match="lse_b"):
        cupaged.merge_states(a, la, a, la[:1])
    with pytest.raises(TypeError, match="lse_a"):
        cupaged.merge_states(a, la.astype(np.float64), a, la)


# ----------------------------------------------------------------------------- CPU: planning
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_cache_strides_locate_every_element(rng, layout, dtype):
    nb, bs, hk, d = 3, 5, 2, 64
    k = rng.standard_normal((nb, bs, hk, d)).astype(dtype)
    v = rng.standard_normal((nb, bs, hk, d)).astype(dtype)
    kc, vc = from_nhd(k, v, layout)
    s = layout_strides(layout, bs, hk, d, np.dtype(dtype).itemsize)
    ks = (s.k_block, s.k_head, s.k_tok, s.k_chunk, 1)
    vs = (s.v_block, s.v_head, s.v_tok, s.v_chunk, s.v_dim)
    vec = 16 // np.dtype(dtype).itemsize
    b, t, h, x = np.meshgrid(*map(np.arange, (nb, bs, hk, d)), indexing="ij")
    for strides, cache, logical in ((ks, kc, k), (vs, vc, v)):
        blk, head, tok, chunk, elem = strides
        off = b * blk + h * head + t * tok + (x // vec) * chunk + (x % vec) * elem
        np.testing.assert_array_equal(cache.reshape(-1)[off], logical)


def test_block_division_is_exact(rng):
    for bs in [1, 2, 3, 5, 7, 16, 17, 100, 128, 255, 256, 1000, 2**20 + 1]:
        magic, shift = dp.block_division(bs)
        assert magic < 2**32
        t = np.concatenate([np.arange(4 * bs), rng.integers(0, 2**31, 2000),
                            [2**31 - 1, 2**31 - 2]]).astype(object)
        assert all((x * magic) >> shift == x // bs for x in t)


# ----------------------------------------------------------------------------- GPU: kernels
def to_device(cp, case):
    return {n: (None if a is None else cp.asarray(a)) for n, a in case.items()}


def run_gpu(cp, case, layout, **kw):
    """paged_decode on device copies with NaN-poisoned out/lse; host results + device case."""
    dev = to_device(cp, case)
    opts = {n: (cp.asarray(a) if isinstance(a, np.ndarray) else a) for n, a in kw.items()}
    out = cp.full(case["q"].shape, np.nan, case["q"].dtype)
    got, lse = cupaged.paged_decode(**dev, layout=layout, out=out, return_lse=True, **opts)
    assert got is out
    return got.get(), lse.get(), dev


def assert_matches(got, lse, want, want_lse, dtype):
    """Relative norm within the dtype's tolerance (and 5x per row), empty rows exact zeros,
    LSE to 1e-3."""
    got = np.asarray(got, np.float64).reshape(-1, got.shape[-1])
    want = np.asarray(want, np.float64).reshape(-1, want.shape[-1])
    assert np.isfinite(got).all(), "unwritten or NaN output elements"
    tol = TOL[np.dtype(dtype)]
    assert rel_err(got, want) < tol
    norms = np.linalg.norm(want, axis=1)
    assert (got[norms == 0] == 0).all()
    rows = np.linalg.norm(got - want, axis=1)[norms > 0] / norms[norms > 0]
    assert rows.max(initial=0) < 5 * tol, f"worst row {rows.argmax()}: {rows.max()}"
    np.testing.assert_allclose(lse, want_lse, rtol=1e-4, atol=1e-3)


def assert_same_values(got, want):
    """Cache contents equal by value, NaN poison included: both sides as float32 (NumPy's
    NaN matching does not see the NaNs of ml_dtypes' bfloat16)."""
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def check_gpu(cp, rng, case, layout, feats=(), **kw):
    opts = features(rng, case["q"].shape[1], feats)
    (want, want_lse), after = oracle(case, layout, **opts)
    got, lse, dev = run_gpu(cp, case, layout, **opts, **kw)
    assert_matches(got, lse, want, want_lse, case["q"].dtype)
    if case["k_new"] is not None:  # the append wrote exactly the reference's values
        for name, as_nhd in (("k_cache", k_as_nhd), ("v_cache", v_as_nhd)):
            assert_same_values(as_nhd(dev[name].get(), layout), after[name])


SHAPES = [  # id, layout, dtype, head_dim, block_size, Hq, Hk, lengths
    ("nhd-bf16-d128-g4", "NHD", bfloat16, 128, 16, 32, 8, [1, 2, 17, 511, 513]),
    ("hnd-f16-d128-g4", "HND", np.float16, 128, 16, 8, 2, [4097, 0, 3]),
    ("vllm-bf16-d128-g4", "vllm", bfloat16, 128, 16, 8, 2, [17, 513, 1]),
    ("vllm-f16-d64-mha", "vllm", np.float16, 64, 32, 4, 4, [511, 2]),
    ("vllm-f32-d80-g8", "vllm", np.float32, 80, 16, 16, 2, [513, 17]),
    ("vllm-bf16-d96-bs1", "vllm", bfloat16, 96, 1, 8, 2, [17, 70]),
    ("vllm-f16-d112-bs5", "vllm", np.float16, 112, 5, 4, 2, [33, 1]),
    ("nhd-f32-d256-bs128", "NHD", np.float32, 256, 128, 8, 2, [4097, 1]),
    ("hnd-bf16-d256-mqa", "HND", bfloat16, 256, 32, 16, 1, [513, 2]),
    ("nhd-f16-d64-bs1-70000", "NHD", np.float16, 64, 1, 8, 1, [70000]),
    ("nhd-bf16-d128-mqa32", "NHD", bfloat16, 128, 16, 32, 1, [4097, 17]),
    ("nhd-bf16-d128-g80", "NHD", bfloat16, 128, 16, 80, 1, [511, 2]),
    ("nhd-f16-d96-g12", "NHD", np.float16, 96, 16, 24, 2, [513, 17, 1]),
    ("hnd-f32-d112-bs32", "HND", np.float32, 112, 32, 8, 8, [511, 513]),
    ("nhd-f16-d80-bs128", "NHD", np.float16, 80, 128, 8, 4, [17, 4097]),
    ("hnd-bf16-d64-bs128", "HND", bfloat16, 64, 128, 16, 4, [2, 511]),
    ("vllm-f32-d256-bs32", "vllm", np.float32, 256, 32, 4, 1, [97, 3]),
    ("nhd-f32-d96-bs1", "NHD", np.float32, 96, 1, 4, 1, [513]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout,dtype,d,bs,hq,hk,lens", [s[1:] for s in SHAPES],
                         ids=[s[0] for s in SHAPES])
def test_kernel_shapes(rng, cp, layout, dtype, d, bs, hq, hk, lens):
    case = make_case(rng, lens=lens, hq=hq, hk=hk, d=d, bs=bs, layout=layout, dtype=dtype)
    check_gpu(cp, rng, case, layout)


FEATURE_SETS = [("window",), ("window0",), ("alibi",), ("sinks",), ("softcap",), ("scale",),
                ("window", "alibi", "sinks", "softcap", "scale")]
FEATURE_SHAPES = [("NHD", bfloat16, 128, 16, 32, 8), ("vllm", np.float16, 64, 8, 8, 2),
                  ("HND", np.float32, 128, 1, 4, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("feats", FEATURE_SETS, ids="+".join)
@pytest.mark.parametrize("layout,dtype,d,bs,hq,hk", FEATURE_SHAPES, ids=lambda v: str(v))
def test_kernel_features(rng, cp, layout, dtype, d, bs, hq, hk, feats):
    case = make_case(rng, lens=[1, 17, 513, 4097, 0], hq=hq, hk=hk, d=d, bs=bs, layout=layout,
                     dtype=dtype)
    check_gpu(cp, rng, case, layout, feats)


@pytest.mark.gpu
@pytest.mark.parametrize("layout,dtype,d,bs,feats", [
    ("NHD", bfloat16, 128, 16, ()),
    ("vllm", np.float16, 64, 16, ("sinks", "window")),
    ("HND", np.float32, 96, 1, ("alibi",)),
    ("vllm", bfloat16, 128, 3, ()),
])
def test_kernel_append(rng, cp, layout, dtype, d, bs, feats):
    lens = [0, 15, 16, 511, 2]
    case = make_case(rng, lens=lens, hq=8, hk=2, d=d, bs=bs, layout=layout, dtype=dtype,
                     append=True)
    check_gpu(cp, rng, case, layout, feats)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2, 7, 64, 256])
@pytest.mark.parametrize("feats", [(), ("sinks", "window")], ids=["plain", "sinks+window"])
def test_kernel_forced_splits(rng, cp, num_splits, feats):
    case = make_case(rng, lens=[4097, 17, 0, 513], hq=16, hk=4, d=128, bs=16, dtype=bfloat16)
    check_gpu(cp, rng, case, "NHD", feats, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.bigmem
@pytest.mark.parametrize("layout", ["NHD", "vllm"])
def test_kernel_blocks_past_2_31_elements(rng, cp, layout):
    """The used blocks sit at the top of caches of more than 2**31 elements."""
    bs, hk, d = 16, 1, 128
    top = (2**31) // (bs * hk * d) + 16
    small = make_case(rng, lens=[300, 47], hq=4, hk=hk, d=d, bs=bs, layout=layout,
                      dtype=np.float16, append=True, spare_blocks=0)
    opts = features(rng, 4, ("sinks",))
    (want, want_lse), after = oracle(small, layout, **opts)
    dev = to_device(cp, small)
    nb = small["k_cache"].shape[0]
    for name in ("k_cache", "v_cache"):
        big = cp.empty((top + nb,) + small[name].shape[1:], np.float16)
        big[top:] = dev[name]
        dev[name] = big
    dev["block_tables"] = cp.where(dev["block_tables"] >= 0, dev["block_tables"] + top,
                                   -1).astype(cp.int32)
    out, lse = cupaged.paged_decode(**dev, layout=layout, sinks=cp.asarray(opts["sinks"]),
                                    return_lse=True)
    assert_matches(out.get(), lse.get(), want, want_lse, np.float16)
    assert_same_values(k_as_nhd(dev["k_cache"][top:].get(), layout), after["k_cache"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_merge_states_kernel(rng, cp, dtype):
    a, b = rng.standard_normal((2, 7, 5, 80)).astype(dtype)
    la, lb = (rng.standard_normal((2, 7, 5)) * 3).astype(np.float32)
    la[0, :2] = -np.inf
    lb[0, 1:3] = -np.inf
    out, lse = cupaged.merge_states(*map(cp.asarray, (a, la, b, lb)))
    want, want_lse = ref.merge_states(a.astype(np.float32), la, b.astype(np.float32), lb)
    got = out.get().astype(np.float64)
    assert rel_err(got, want) < TOL[np.dtype(dtype)]
    assert (got[0, 1] == 0).all()
    np.testing.assert_allclose(lse.get(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_decoder_graph_capture_and_replay(rng, cp):
    """Capture one run, then replay it after a new plan with new lengths and a new q."""
    hq, hk, d, bs = 16, 4, 128, 16
    lens1, lens2 = np.array([300, 17, 4000], np.int32), np.array([4100, 0, 513], np.int32)
    case = make_case(rng, lens=np.maximum(lens1, lens2), hq=hq, hk=hk, d=d, bs=bs, dtype=bfloat16)
    sinks = rng.standard_normal(hq).astype(np.float32)
    sinks_dev = cp.asarray(sinks)  # no host-to-device copy may happen during the capture
    dev = to_device(cp, case)
    dec = cupaged.PagedDecoder(hq, hk, d, bs, dtype=bfloat16, max_batch=4, xp=cp, layout="NHD")
    q_buf = cp.asarray(case["q"])
    out = cp.empty(case["q"].shape, bfloat16)
    lse = cp.empty((3, hq), np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()  # uploads above ran on the legacy stream
    with stream:
        dec.plan(case["block_tables"], lens1, num_splits=5)
        dec.run(q_buf, dev["k_cache"], dev["v_cache"], sinks=sinks_dev, out=out, lse=lse)
        stream.synchronize()
        out.fill(np.nan)
        lse.fill(np.nan)
        stream.begin_capture()
        dec.run(q_buf, dev["k_cache"], dev["v_cache"], sinks=sinks_dev, out=out, lse=lse)
        graph = stream.end_capture()
        graph.launch()
        stream.synchronize()
    (want, want_lse), _ = oracle({**case, "seq_lens": lens1}, "NHD", sinks=sinks)
    assert_matches(out.get(), lse.get(), want, want_lse, bfloat16)

    q2 = rng.standard_normal(case["q"].shape).astype(bfloat16)
    q2_dev = cp.asarray(q2)
    cp.cuda.Device().synchronize()
    with stream:
        dec.plan(case["block_tables"], lens2, planner="host")  # a plan of the same kind
        q_buf[...] = q2_dev
        out.fill(np.nan)
        lse.fill(np.nan)
        graph.launch()
        stream.synchronize()
    (want, want_lse), _ = oracle({**case, "q": q2, "seq_lens": lens2}, "NHD", sinks=sinks)
    assert_matches(out.get(), lse.get(), want, want_lse, bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("tables_on", ["host", "device"])
def test_device_planned_graph_follows_new_plans(rng, cp, tables_on):
    """A captured run of a device plan cuts the pieces at each replay: replayed after a
    plan of new lengths (and new tables) it matches the reference for those."""
    hq, hk, d, bs = 32, 8, 128, 16
    lens1, lens2 = np.array([300, 17, 4000, 64], np.int32), np.array([4100, 0, 513, 2], np.int32)
    case = make_case(rng, lens=np.maximum(lens1, lens2), hq=hq, hk=hk, d=d, bs=bs, dtype=bfloat16)
    dev = to_device(cp, case)
    put = (lambda a: a) if tables_on == "host" else cp.asarray
    dec = cupaged.PagedDecoder(hq, hk, d, bs, dtype=bfloat16, max_batch=4, xp=cp, layout="NHD")
    q_buf = cp.asarray(case["q"])
    out = cp.empty(case["q"].shape, bfloat16)
    lse = cp.empty(case["q"].shape[:2], np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with stream:
        dec.plan(put(case["block_tables"]), put(lens1))
        dec.run(q_buf, dev["k_cache"], dev["v_cache"], out=out, lse=lse)
        stream.synchronize()
        stream.begin_capture()
        dec.run(q_buf, dev["k_cache"], dev["v_cache"], out=out, lse=lse)
        graph = stream.end_capture()
        dec.plan(put(case["block_tables"]), put(lens2))
        out.fill(np.nan)
        lse.fill(np.nan)
        graph.launch()
        stream.synchronize()
    (want, want_lse), _ = oracle({**case, "seq_lens": lens2}, "NHD")
    assert_matches(out.get(), lse.get(), want, want_lse, bfloat16)


@pytest.mark.gpu
def test_decoder_matches_function_on_gpu(rng, cp):
    case = make_case(rng, lens=[5, 1000, 0], hq=8, hk=2, d=128, bs=16, layout="vllm",
                     dtype=np.float16, append=True)
    want, want_lse, _ = run_gpu(cp, case, "vllm")
    dev = to_device(cp, case)
    dec = cupaged.PagedDecoder(8, 2, 128, 16, dtype=np.float16, layout="vllm", max_batch=3)
    dec.plan(dev["block_tables"], dev["seq_lens"], append=True)
    got, lse = dec.run(dev["q"], dev["k_cache"], dev["v_cache"], k_new=dev["k_new"],
                       v_new=dev["v_new"], return_lse=True)
    np.testing.assert_array_equal(got.get(), want)
    np.testing.assert_array_equal(lse.get(), want_lse)


VARIANTS = [("balanced", "fused"), ("balanced", "kernel"), ("split", "fused"), ("split", "kernel")]


def mixed_lengths(rng, batch):
    """Empty, short and a few long sequences: more sequences than CTA columns, sequences
    cut across columns, columns holding many pieces."""
    lens = rng.integers(1, 300, batch).astype(np.int32)
    lens[rng.random(batch) < 0.15] = 0
    lens[rng.choice(batch, 3, replace=False)] = [4097, 2500, 1100]
    return lens


def decoder_run(cp, case, dec, feats_dev, out_dtype):
    out = cp.full(case["q"].shape, np.nan, out_dtype)
    lse = cp.full(case["q"].shape[:2], np.nan, np.float32)
    dec.run(cp.asarray(case["q"]), cp.asarray(case["k_cache"]), cp.asarray(case["v_cache"]),
            out=out, lse=lse, **feats_dev)
    return out.get(), lse.get()


@pytest.mark.gpu
@pytest.mark.parametrize("schedule,merge", VARIANTS, ids=["/".join(v) for v in VARIANTS])
@pytest.mark.parametrize("dtype,d,feats", [(bfloat16, 128, ()),
                                           (np.float16, 256, ("sinks", "window", "alibi"))],
                         ids=["bf16-d128", "f16-d256-features"])
def test_decoder_schedules_and_merges(rng, cp, monkeypatch, schedule, merge, dtype, d, feats):
    """Every schedule and merge mode on a mixed batch of 150 sequences matches the
    reference, twice in a row (the fused merge re-arms its counters), bit for bit. (The
    window keeps every sequence short, which "balanced" would leave whole: made to cut.)"""
    monkeypatch.setattr(dp, "WHOLE_SLACK", -1)
    monkeypatch.setattr(dp, "WHOLE_SLACK_TILES", -1)
    hq, hk = 8, 2
    case = make_case(rng, lens=mixed_lengths(rng, 150), hq=hq, hk=hk, d=d, bs=16, dtype=dtype)
    opts = features(rng, hq, feats)
    (want, want_lse), _ = oracle(case, "NHD", **opts)
    dec = cupaged.PagedDecoder(hq, hk, d, 16, dtype=dtype, max_batch=150,
                               window_left=opts.pop("window_left", -1), xp=cp, layout="NHD")
    dec.plan(case["block_tables"], case["seq_lens"], schedule=schedule, planner="host",
             merge=merge, num_splits=3 if schedule == "split" else None)
    assert dec.num_splits > 1
    feats_dev = {n: cp.asarray(a) for n, a in opts.items()}
    first = decoder_run(cp, case, dec, feats_dev, dtype)
    assert_matches(*first, want, want_lse, dtype)
    again = decoder_run(cp, case, dec, feats_dev, dtype)
    np.testing.assert_array_equal(again[0], first[0])
    np.testing.assert_array_equal(again[1], first[1])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pages", "staged"])
def test_short_batches_stay_whole(rng, cp, backend):
    """More short sequences than CTA columns: the "balanced" plan keeps each whole (no
    partial rows, no merge) and matches the reference, an empty sequence included."""
    if backend == "pages" and int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("cp.async.bulk needs sm_90")
    lens = rng.integers(1, 256, 500).astype(np.int32)
    lens[[5, 77]] = [0, 255]
    case = make_case(rng, lens=lens, hq=16, hk=4, d=128, bs=16, dtype=bfloat16)
    opts = features(rng, 16, ("sinks", "alibi"))
    (want, want_lse), _ = oracle(case, "NHD", **opts)
    dec = cupaged.PagedDecoder(16, 4, 128, 16, dtype=bfloat16, max_batch=500, backend=backend, xp=cp, layout="NHD")
    dec.plan(case["block_tables"], case["seq_lens"], planner="host")
    assert dec.num_splits == 1 and dec._step.work.num_slots == 0
    got = decoder_run(cp, case, dec, {n: cp.asarray(a) for n, a in opts.items()}, bfloat16)
    assert_matches(*got, want, want_lse, bfloat16)


@pytest.mark.gpu
def test_fused_and_kernel_merges_agree(rng, cp):
    """The same pieces merged by their last CTA or by the merge kernel (the same code)."""
    case = make_case(rng, lens=[4097, 0, 33, 2000], hq=32, hk=8, d=128, bs=16, dtype=bfloat16)
    got = {}
    for merge in ("fused", "kernel"):
        dec = cupaged.PagedDecoder(32, 8, 128, 16, dtype=bfloat16, max_batch=4, layout="NHD")
        dec.plan(cp.asarray(case["block_tables"]), cp.asarray(case["seq_lens"]), merge=merge)
        got[merge] = decoder_run(cp, case, dec, {}, bfloat16)
    np.testing.assert_allclose(got["fused"][0].astype(np.float32),
                               got["kernel"][0].astype(np.float32), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(got["fused"][1], got["kernel"][1], rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pages", "staged"])
@pytest.mark.parametrize("lens", [[70001], [40000, 0, 9000],
                                  [17, 30000, 513, 2, 20000, 4097, 1, 8193, 65]],
                         ids=["b1", "b3", "b9"])
def test_kernel_merge_splits_heads_over_warps(rng, cp, backend, lens):
    """Few long sequences have many pieces each, which the merge kernel splits over several
    warps a head (merge_launch: 16 at B1 on the pages kernel, then fewer), combining their
    shares in shared memory: outputs and LSEs (sinks in) match the reference on both kernel
    paths."""
    if backend == "pages" and int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("cp.async.bulk needs sm_90")
    case = make_case(rng, lens=lens, hq=32, hk=8, d=128, bs=16, dtype=bfloat16)
    opts = features(rng, 32, ("sinks",))
    (want, want_lse), _ = oracle(case, "NHD", **opts)
    dec = cupaged.PagedDecoder(32, 8, 128, 16, dtype=bfloat16, max_batch=len(lens),
                               backend=backend, xp=cp, layout="NHD")
    dec.plan(case["block_tables"], case["seq_lens"], merge="kernel", planner="host")
    wph = dp.merge_launch(dec._step.device.launch, len(lens))[2]
    assert (wph > 1 and dec.num_splits > 16) or len(lens) == 9  # B9: 1 or 2 a head
    got = decoder_run(cp, case, dec, {"sinks": cp.asarray(opts["sinks"])}, bfloat16)
    assert_matches(*got, want, want_lse, bfloat16)


@pytest.mark.gpu
def test_many_heads_default_to_the_kernel_merge(rng, cp):
    """MQA (32 query heads a kv head) defaults to the kernel merge, one warp a head: a long
    sequence cut into many pieces, a short one and an empty one match the reference."""
    case = make_case(rng, lens=[20000, 5, 0], hq=32, hk=1, d=128, bs=16, dtype=bfloat16)
    opts = features(rng, 32, ("sinks",))
    (want, want_lse), _ = oracle(case, "NHD", **opts)
    dec = cupaged.PagedDecoder(32, 1, 128, 16, dtype=bfloat16, max_batch=3, xp=cp, layout="NHD")
    dec.plan(case["block_tables"], case["seq_lens"], planner="host")
    assert dec.merge == "kernel" and dec.num_splits > 8
    got = decoder_run(cp, case, dec, {"sinks": cp.asarray(opts["sinks"])}, bfloat16)
    assert_matches(*got, want, want_lse, bfloat16)


@pytest.mark.gpu
def test_decoder_replans_many_pieces(rng, cp):
    """A plan with far more pieces than the buffers first held (they grow), then a small
    one reusing them; the kernel merge launched even when nothing is split."""
    case = make_case(rng, lens=mixed_lengths(rng, 40), hq=16, hk=4, d=64, bs=16,
                     dtype=np.float16)
    (want, want_lse), _ = oracle(case, "NHD")
    dec = cupaged.PagedDecoder(16, 4, 64, 16, dtype=np.float16, max_batch=40, layout="NHD")
    bt, sl = cp.asarray(case["block_tables"]), cp.asarray(case["seq_lens"])
    for kw in (dict(num_splits=256), dict(num_splits=256, merge="kernel"),
               dict(num_splits=1, merge="kernel"), dict(schedule="balanced")):
        dec.plan(bt, sl, **kw)
        assert_matches(*decoder_run(cp, case, dec, {}, np.float16), want, want_lse, np.float16)


PAGE_SHAPES = [  # id, dtype, head_dim, block_size, Hq, Hk, lengths: pages-capable NHD caches
    ("bf16-d128-bs16-g4", bfloat16, 128, 16, 32, 8, [1, 2, 17, 511, 513, 4097]),
    ("f16-d64-bs16-mqa8", np.float16, 64, 16, 8, 1, [70000, 3, 0]),
    ("f16-d96-bs32-g2", np.float16, 96, 32, 8, 4, [33, 1, 513]),
    ("bf16-d128-bs48-mha", bfloat16, 128, 48, 2, 2, [4097, 17]),
    ("bf16-d64-bs64-g3", bfloat16, 64, 64, 6, 2, [511, 2, 65]),
    ("bf16-d96-bs16-g5", bfloat16, 96, 16, 5, 1, [513, 64]),
    ("bf16-d128-bs1-g4", bfloat16, 128, 1, 32, 8, [1, 2, 17, 511, 4097]),
    ("f16-d64-bs2-g2", np.float16, 64, 2, 8, 4, [33, 1, 70000, 0]),
    ("bf16-d96-bs4-g5", bfloat16, 96, 4, 10, 2, [513, 3, 64]),
    ("f16-d128-bs8-mqa", np.float16, 128, 8, 8, 1, [4097, 17, 2]),
    ("bf16-d128-bs16-hk3-g4", bfloat16, 128, 16, 12, 3, [4097, 2, 100]),  # 6 of 8 warps
    # row groups of kv heads (8 of 32, 6 of 12, 8 of 16): in NHD a run a token
    ("bf16-d128-bs16-mha32", bfloat16, 128, 16, 32, 32, [1, 17, 513, 4097]),
    ("f16-d64-bs1-hk12-g2", np.float16, 64, 1, 24, 12, [70000, 17, 0]),
    ("bf16-d64-bs32-hk16-g2", bfloat16, 64, 32, 32, 16, [33, 1, 2049]),
]


# every shape in NHD, and in HND those whose blocks are whole tiles (16k tokens)
PAGE_CASES = [("nhd-" + s[0], "NHD") + s[1:] for s in PAGE_SHAPES] + [
    ("hnd-" + s[0], "HND") + s[1:] for s in PAGE_SHAPES if s[3] % 16 == 0]


def test_page_shapes_take_the_pages_kernel():
    for _, layout, dtype, d, bs, hq, hk, _ in PAGE_CASES:
        assert dp.pages_capable(90, np.dtype(dtype).itemsize, d, layout, bs, hq, hk)
    assert len(PAGE_CASES) == len(PAGE_SHAPES) + 9
    assert not dp.pages_capable(90, 2, 128, "HND", 8, 32, 8)  # a tile of several HND blocks
    assert not dp.pages_capable(90, 2, 128, "vllm", 16, 32, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pages", "staged"])
@pytest.mark.parametrize("feats", [("window", "sinks"), ("alibi", "softcap", "scale")],
                         ids=["window+sinks", "alibi+softcap+scale"])
@pytest.mark.parametrize("layout,dtype,d,bs,hq,hk,lens", [s[1:] for s in PAGE_CASES],
                         ids=[s[0] for s in PAGE_CASES])
def test_kernel_paths(rng, cp, backend, feats, layout, dtype, d, bs, hq, hk, lens):
    """Both kernels where the pages one applies (sm_90): window edges inside blocks and
    m-tiles, partial groups (3 and 5 heads of 8), an append into a partly filled block,
    every score modifier; in HND the whole-block copies bring in the cache's NaN-poisoned
    rows outside the visible keys, which must be zeroed."""
    if backend == "pages" and int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("cp.async.bulk needs sm_90")
    case = make_case(rng, lens=lens, hq=hq, hk=hk, d=d, bs=bs, layout=layout, dtype=dtype,
                     append=True)
    check_gpu(cp, rng, case, layout, feats, backend=backend)


@pytest.mark.gpu
def test_pages_kernel_ring_sizes_share_the_function(rng, cp):
    """Geometries with rings of different sizes launch one pages function: one planned with
    a larger ring still runs after a smaller one set the function's shared-memory limit."""
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("cp.async.bulk needs sm_90")
    big = make_case(rng, lens=[40, 513], hq=16, hk=8, d=128, bs=16, dtype=bfloat16)
    small = make_case(rng, lens=[33, 2], hq=4, hk=2, d=128, bs=16, dtype=bfloat16)
    for case in (big, small, big):
        check_gpu(cp, rng, case, "NHD", backend="pages")


@pytest.mark.gpu
@pytest.mark.parametrize("merge", ["fused", "kernel"])
@pytest.mark.parametrize("hq,hk", [(16, 4), (32, 16)], ids=["one-group", "two-groups"])
def test_pages_kernel_splits_and_merges(rng, cp, merge, hq, hk):
    """The pages kernel's partial rows (permuted dims; one row group of every head, or two
    of 8 kv heads) through both merges, twice in a row (the fused merge re-arms its
    counters)."""
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("cp.async.bulk needs sm_90")
    case = make_case(rng, lens=mixed_lengths(rng, 60), hq=hq, hk=hk, d=128, bs=16,
                     dtype=bfloat16)
    opts = features(rng, hq, ("sinks",))
    (want, want_lse), _ = oracle(case, "NHD", **opts)
    dec = cupaged.PagedDecoder(hq, hk, 128, 16, dtype=bfloat16, max_batch=60, backend="pages", xp=cp, layout="NHD")
    dec.plan(case["block_tables"], case["seq_lens"], merge=merge, planner="host")
    assert dec.kernel == "pages" and dec.num_splits > 1
    feats_dev = {n: cp.asarray(a) for n, a in opts.items()}
    first = decoder_run(cp, case, dec, feats_dev, bfloat16)
    assert_matches(*first, want, want_lse, bfloat16)
    again = decoder_run(cp, case, dec, feats_dev, bfloat16)
    np.testing.assert_array_equal(again[0], first[0])


@pytest.mark.gpu
def test_default_kernel_path(rng, cp):
    """"pages" by default where it applies on sm_90+ to 2 sequences or more, its CTAs
    serving every kv head or 4 of them or more (chosen per plan), "staged" otherwise;
    asking for "pages" where it does not apply raises before any launch."""
    hopper = int(cp.cuda.Device().compute_capability) >= 90
    case = make_case(rng, lens=[40, 3] * 8, hq=4, hk=2, d=64, bs=16, layout="vllm")
    dev = to_device(cp, case)
    for hq, hk, d, layout, dtype, want in (
            (32, 8, 128, "NHD", bfloat16, "pages"), (16, 4, 64, "NHD", np.float16, "pages"),
            (8, 2, 64, "NHD", np.float16, "pages"), (16, 1, 128, "NHD", bfloat16, "staged"),
            (8, 2, 80, "NHD", bfloat16, "staged"), (8, 2, 128, "HND", bfloat16, "pages"),
            (32, 8, 128, "NHD", np.float32, "staged"), (32, 32, 128, "NHD", bfloat16, "pages"),
            (32, 32, 128, "HND", bfloat16, "pages"), (22, 11, 64, "NHD", bfloat16, "staged")):
        dec = cupaged.PagedDecoder(hq, hk, d, 16, dtype=dtype, layout=layout, max_batch=16)
        dec.plan(dev["block_tables"], dev["seq_lens"])
        assert dec.kernel == (want if hopper else "staged"), (hq, hk, d, layout, dtype)
        dec.plan(dev["block_tables"][:1], dev["seq_lens"][:1])
        assert dec.kernel == "staged"
    with pytest.raises(ValueError, match="backend: 'pages' needs"):
        cupaged.paged_decode(**dev, layout="vllm", backend="pages")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,hq,hk", [("pages", 16, 4), ("pages", 16, 16), ("staged", 8, 2)])
@pytest.mark.parametrize("merge", ["fused", "kernel"])
def test_pool_pieces(rng, cp, monkeypatch, backend, hq, hk, merge):
    """Long batches leave each sequence's last tiles to the run-time pool: taken by the CTAs
    in any order, merged with the fixed pieces, the counts re-armed for the next launch
    (run eagerly, then replayed from a CUDA graph after a new plan)."""
    if backend == "pages" and int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("cp.async.bulk needs sm_90")
    monkeypatch.setattr(dp, "POOL_MIN_SHARE", 32)  # a pool for a test-sized batch
    low = 5000 if backend == "pages" else 12000  # a column's fixed share >= POOL_MIN_SHARE
    lens = rng.integers(low, low + 4000, 24).astype(np.int32)
    case = make_case(rng, lens=lens, hq=hq, hk=hk, d=128, bs=16, dtype=bfloat16)
    opts = features(rng, hq, ("sinks",))
    feats_dev = {n: cp.asarray(a) for n, a in opts.items()}
    dev = to_device(cp, case)
    dec = cupaged.PagedDecoder(hq, hk, 128, 16, dtype=bfloat16, max_batch=24, backend=backend,
                               xp=cp, layout="NHD")
    q = cp.asarray(case["q"])
    out = cp.empty(case["q"].shape, bfloat16)
    lse = cp.empty(case["q"].shape[:2], np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    want, want_lse = oracle(case, "NHD", **opts)[0]
    with stream:
        dec.plan(case["block_tables"], case["seq_lens"], merge=merge, planner="host")
        assert dec._step.work.pool_pieces > 0  # the case is long enough for a pool
        for _ in range(2):
            out.fill(np.nan)
            lse.fill(np.nan)
            dec.run(q, dev["k_cache"], dev["v_cache"], out=out, lse=lse, **feats_dev)
            stream.synchronize()
            assert_matches(out.get(), lse.get(), want, want_lse, bfloat16)
        stream.begin_capture()
        dec.run(q, dev["k_cache"], dev["v_cache"], out=out, lse=lse, **feats_dev)
        graph = stream.end_capture()
        lens2 = (lens - rng.integers(0, 1000, 24)).astype(np.int32)
        dec.plan(case["block_tables"], lens2, merge=merge, planner="host")
        assert dec._step.work.pool_pieces > 0
        out.fill(np.nan)
        lse.fill(np.nan)
        graph.launch()
        stream.synchronize()
    want, want_lse = oracle({**case, "seq_lens": lens2}, "NHD", **opts)[0]
    assert_matches(out.get(), lse.get(), want, want_lse, bfloat16)


@pytest.mark.gpu
def test_device_bad_input(rng, cp):
    case = make_case(rng, lens=[5, 30], hq=4, hk=2, d=64, bs=8)
    dev = to_device(cp, case)
    with pytest.raises(TypeError, match="mix"):
        cupaged.paged_decode(**{**dev, "q": case["q"]}, layout="NHD")
    with pytest.raises(TypeError, match="mix"):
        cupaged.paged_decode(**{**dev, "seq_lens": case["seq_lens"]}, layout="NHD")
    flat = cp.empty(dev["k_cache"].size + 8, dev["k_cache"].dtype)
    shifted = flat[1:1 + dev["k_cache"].size].reshape(dev["k_cache"].shape)
    with pytest.raises(ValueError, match="16-byte"):
        cupaged.paged_decode(**{**dev, "k_cache": shifted}, layout="NHD")
