"""cupaged.sparse.bsr: batched block-sparse-row attention, ragged and paged.

CPU tests: the public ops on NumPy inputs are the reference, their checks and limits. GPU
tests (marked ``gpu``): the kernels against the float64 reference (``cupaged.reference.bsr``)
on fresh random inputs with NaN-poisoned outputs, odd lengths, empty sequences and rows,
every pattern head count, paged caches, and bad device patterns reported, not followed.
"""
import numpy as np
import pytest

import cupaged
from cupaged import sparse
from cupaged.core import abi, errors
from cupaged.core.arrays import bfloat16
from cupaged.core.checks import AttentionOptions
from cupaged.reference import bsr as ref
from cupaged.sparse import bsr
from test_reference_bsr import _batch, _cu, _full, _pattern, _to_paged
from test_sparse_gpu import (BACKENDS, FEATURES, TOL, _check_close, _rand, _rel_err, needs_backend,
                             on_device, score_options)



def _check(got, want, dtype):
    """``(out, lse)`` of a kernel against the reference's."""
    out, lse = (np.asarray(x, np.float64) for x in got)
    _check_close(out, want[0], dtype)
    np.testing.assert_allclose(lse, want[1], rtol=2e-3, atol=2e-3)


# ----------------------------------------------------------------------------- CPU
def test_numpy_inputs_run_the_reference(rng):
    q_lens, kv_lens = [7, 0, 13, 1], [19, 3, 13, 9]
    q, k, v, cu_q, cu_k = _batch(rng, q_lens, kv_lens, 4, 2, 64, np.float32)
    indptr, indices = _pattern(rng, q_lens, kv_lens, 4, 8, 2, 0.5)
    sinks = rng.standard_normal(4).astype(np.float32)
    out = np.full(q.shape, np.nan, np.float32)
    got, lse = cupaged.varlen_block_sparse_attention(q, k, v, cu_q, cu_k, indptr, indices, 4, 8,
                                                     pattern_heads=2, sinks=sinks, out=out,
                                                     return_lse=True)
    want = ref.varlen_block_sparse_attention(q, k, v, cu_q, cu_k, indptr, indices, 4, 8,
                                             pattern_heads=2, sinks=sinks)
    assert got is out
    np.testing.assert_array_equal(got, want[0].astype(np.float32))
    np.testing.assert_array_equal(lse, want[1].astype(np.float32))


def test_paged_numpy_inputs_run_the_reference(rng):
    q_lens, kv_lens = [5, 9], [21, 9]
    q, k, v, cu_q, _ = _batch(rng, q_lens, kv_lens, 4, 2, 64, np.float32)
    indptr, indices = _pattern(rng, q_lens, kv_lens, 4, 8, 4, 0.5)
    kc, vc, tables = _to_paged(rng, k, v, kv_lens, "vllm", 8)
    lens = np.array(kv_lens, np.int32)
    got = cupaged.paged_block_sparse_attention(q, kc, vc, cu_q, tables, lens, indptr, indices, 4,
                                               8, pattern_heads=4, layout="vllm", causal=False)
    want = ref.paged_block_sparse_attention(q, kc, vc, cu_q, tables, lens, indptr, indices, 4, 8,
                                            pattern_heads=4, layout="vllm", causal=False)
    np.testing.assert_array_equal(got, want[0].astype(np.float32))


def test_single_sequence_is_the_batch_of_one(rng):
    q, k, v, cu_q, cu_k = _batch(rng, [100], [130], 4, 2, 64, np.float32)
    indptr, indices = _pattern(rng, [100], [130], 32, 32, 1, 0.5)
    one, lse = sparse.block_sparse_attention(q, k, v, indptr, indices, 32, 32, return_lse=True)
    batch = ref.varlen_block_sparse_attention(q, k, v, cu_q, cu_k, indptr, indices, 32, 32,
                                              pattern_heads=1)
    np.testing.assert_array_equal(one, batch[0].astype(np.float32))
    np.testing.assert_array_equal(lse, batch[1].astype(np.float32))
    assert cupaged.block_sparse_attention is sparse.block_sparse_attention


def _case(rng):
    q, k, v, cu_q, cu_k = _batch(rng, [5, 3], [9, 3], 4, 2, 64, np.float32)
    indptr, indices = _full([5, 3], [9, 3], 4, 4, 2)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, indptr=indptr,
                indices=indices, block_m=4, block_n=4)


@pytest.mark.parametrize("edit,error,match", [
    (dict(pattern_heads=3), ValueError, r"pattern_heads: expected \[1, 2, 4\].*got 3"),
    (dict(cu_seqlens_k=np.array([0, 9], np.int32)), ValueError, r"cu_seqlens_k: expected shape \(3,\)"),
    (dict(cu_seqlens_q=np.array([0, 8, 8], np.int32)), ValueError, r"indptr: expected shape \[5\]"),
    (dict(indices=np.zeros(3, np.int32)), ValueError, "indptr: expected last entry"),
    (dict(indptr=np.zeros(7, np.int64)), TypeError, "indptr: expected dtype int32"),
    (dict(block_n=0), ValueError, "block_n"),
    (dict(k=np.zeros((12, 2, 8), np.float32)), TypeError, "k: expected dtype float32 and head size 64"),
    (dict(sinks=np.zeros(3, np.float32)), ValueError, "sinks"),
    (dict(backend="tiles"), ValueError, r"backend: expected one of .*'wgmma'.*got 'tiles'"),
])
def test_bad_arguments_raise_naming_them(rng, edit, error, match):
    kw = dict(_case(rng), pattern_heads=2) | edit
    with pytest.raises(error, match=match):
        cupaged.varlen_block_sparse_attention(**kw)


def test_gpu_limits_are_named():
    """What the CUDA kernel does not take is refused before any launch (the check is host
    only, so it runs here on NumPy stand-ins)."""
    q = np.zeros((10, 4, 64), np.float16)
    pattern = bsr.Pattern(None, None, 64, 64, 1)
    bsr._check_gpu(q, pattern)                   # window, ALiBi and soft-cap are taken
    with pytest.raises(ValueError, match="block_m: the CUDA kernel needs a multiple of 64"):
        bsr._check_gpu(q, bsr.Pattern(None, None, 32, 64, 1))
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        bsr._check_gpu(q.astype(np.float32), pattern)


@pytest.mark.parametrize("edit,error,match", [
    (dict(window_left=-2), ValueError, r"window_left: expected an int >= -1 \(-1: no window\), got -2"),
    (dict(window_left=2.5), ValueError, "window_left: expected an int"),
    (dict(logits_soft_cap=-1.0), ValueError, r"logits_soft_cap: expected a finite float >= 0"),
    (dict(logits_soft_cap=float("nan")), ValueError, "logits_soft_cap"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, r"alibi_slopes: expected shape \[4\], got \(3,\)"),
    (dict(alibi_slopes=np.ones(4, np.float64)), TypeError, "alibi_slopes: expected dtype float32"),
])
def test_score_options_are_checked_by_name(rng, edit, error, match):
    kw = dict(_case(rng), pattern_heads=2) | edit
    with pytest.raises(error, match=match):
        cupaged.varlen_block_sparse_attention(**kw)


def test_score_options_pick_the_general_kernel():
    from cupaged.sparse import launch
    base = AttentionOptions(0.1, -1, None, None, 0.0)
    assert not launch.general_scores(base)
    for edit in (dict(window_left=0), dict(alibi_slopes=np.ones(2, np.float32)),
                 dict(logits_soft_cap=1.0), dict(sm_scale=-0.1), dict(sm_scale=0.0)):
        assert launch.general_scores(base._replace(**edit)), edit
    assert launch.attention_expr(np.float16, 128).endswith(", false>")
    assert launch.attention_expr(np.float16, 128, "bsr_attention", 64, True).endswith(", true>")


@pytest.mark.parametrize("words, text", [
    ((abi.error_code("indices", "range"), 12, -1, 9, 4), r"indices: expected entries in \[0, 4\), got 9 at index 12"),
    ((abi.error_code("indices", "increasing"), 5, -1, 2, 3), r"indices: expected strictly increasing entries within each CSR row, got 3 then 2 at index 5"),
    ((abi.error_code("indptr", "size"), -1, -1, 7, 9), r"indptr: expected 9 entries .*got 7"),
    ((abi.error_code("indptr", "last"), 8, -1, 30, 31), r"indptr: expected the last entry 31, got 30 at index 8"),
    ((abi.error_code("indptr", "order"), 3, -1, 2, 5), r"indptr: expected non-decreasing entries, got 5 then 2"),
])
def test_device_error_messages(words, text):
    import re
    assert re.search(text, errors.message(np.asarray(words + (0, 0, 0), np.int64)))


# ----------------------------------------------------------------------------- GPU helpers
def _gpu_case(rng, q_lens, kv_lens, hq, hk, d, dtype, bm, bn, heads, density):
    q, k, v = (_rand(rng, (sum(n), h, d), dtype) for n, h in
               ((q_lens, hq), (kv_lens, hk), (kv_lens, hk)))
    indptr, indices = _pattern(rng, q_lens, kv_lens, bm, bn, heads, density)
    return q, k, v, _cu(q_lens), _cu(kv_lens), indptr, indices


def _want_varlen(q, k, v, cu_q, cu_k, indptr, indices, bm, bn, heads, **opts):
    f64 = (x.astype(np.float64) for x in (q, k, v))
    return ref.varlen_block_sparse_attention(*f64, cu_q, cu_k, indptr, indices, bm, bn,
                                             pattern_heads=heads, **opts)


def _run_varlen(cp, q, k, v, cu_q, cu_k, indptr, indices, bm, bn, heads, backend="auto", **opts):
    needs_backend(cp, backend)
    dev = [cp.asarray(x) for x in (q, k, v, cu_q, cu_k, indptr, indices)]
    opts = on_device(cp, opts)
    out = cp.full(q.shape, np.nan, dtype=q.dtype)
    got, lse = cupaged.varlen_block_sparse_attention(*dev, bm, bn, pattern_heads=heads, out=out,
                                                     return_lse=True, backend=backend, **opts)
    assert got is out
    return cp.asnumpy(got), cp.asnumpy(lse)


# ----------------------------------------------------------------------------- GPU: ragged
Q_LENS, KV_LENS = [300, 0, 1, 129, 64, 77, 5], [300, 50, 64, 700, 64, 77, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,bm,bn,heads,causal,sinks", [
    (np.float16, 128, 64, 64, "q", True, False),
    (bfloat16, 128, 64, 64, "kv", True, True),
    (np.float16, 128, 128, 32, "shared", False, True),
    (bfloat16, 64, 64, 96, "q", False, False),
    (np.float16, 80, 192, 16, "kv", True, False),
    (bfloat16, 96, 64, 128, "shared", True, True),
    (np.float16, 112, 128, 64, "q", True, True),
    (bfloat16, 256, 64, 64, "kv", True, False),
    (np.float16, 256, 128, 48, "q", False, True),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_matches_reference(cp, rng, dtype, d, bm, bn, heads, causal, sinks, backend):
    hq, hk = 8, 2
    h_p = {"q": hq, "kv": hk, "shared": 1}[heads]
    case = _gpu_case(rng, Q_LENS, KV_LENS, hq, hk, d, dtype, bm, bn, h_p, 0.4)
    opts = dict(causal=causal, sinks=rng.standard_normal(hq).astype(np.float32) if sinks else None)
    got = _run_varlen(cp, *case, bm, bn, h_p, backend=backend, **opts)
    _check(got, _want_varlen(*case, bm, bn, h_p, **opts), dtype)
    cupaged.check_errors()                       # a good pattern reports nothing


@pytest.mark.gpu
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("dtype,d,bm,bn,heads,causal", [
    (np.float16, 64, 64, 64, "q", True),
    (bfloat16, 80, 128, 32, "kv", False),
    (np.float16, 96, 192, 48, "shared", True),
    (bfloat16, 112, 64, 96, "q", True),
    (np.float16, 128, 128, 64, "kv", True),
    (bfloat16, 128, 64, 64, "shared", False),
    (np.float16, 256, 64, 64, "q", True),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_score_options_match_reference(cp, rng, feature, dtype, d, bm, bn, heads, causal,
                                              backend):
    """window_left, ALiBi, soft-cap and a negative scale, alone and together, causal or not,
    on both kernels and, on the mma.sync one, both CTA heights (block_m 64 / 192: 64-row CTAs;
    128: 128-row CTAs)."""
    hq, hk = 8, 2
    h_p = {"q": hq, "kv": hk, "shared": 1}[heads]
    case = _gpu_case(rng, Q_LENS, KV_LENS, hq, hk, d, dtype, bm, bn, h_p, 0.5)
    opts = dict(causal=causal, **score_options(rng, hq, feature))
    got = _run_varlen(cp, *case, bm, bn, h_p, backend=backend, **opts)
    _check(got, _want_varlen(*case, bm, bn, h_p, **opts), dtype)
    cupaged.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page", [16, 24])
def test_paged_score_options_equal_ragged(cp, rng, layout, page):
    q_lens, kv_lens = [70, 0, 129, 1, 9], [500, 33, 200, 64, 4]
    q, k, v, cu_q, cu_k, indptr, indices = _gpu_case(rng, q_lens, kv_lens, 8, 2, 128,
                                                     bfloat16, 128, 64, 2, 0.5)
    kc, vc, tables = _to_paged(rng, k, v, kv_lens, layout, page)
    lens = np.array(kv_lens, np.int32)
    opts = score_options(rng, 8, "all")
    got = _run_paged(cp, q, kc, vc, cu_q, tables, lens, indptr, indices, 128, 64, 2, layout, **opts)
    ragged = _run_varlen(cp, q, k, v, cu_q, cu_k, indptr, indices, 128, 64, 2, **opts)
    np.testing.assert_array_equal(got[0], ragged[0])
    np.testing.assert_array_equal(got[1], ragged[1])
    _check(got, _want_varlen(q, k, v, cu_q, cu_k, indptr, indices, 128, 64, 2, **opts), bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, bfloat16])
def test_full_pattern_with_options_equals_dense_prefill(cp, rng, dtype):
    q_lens, kv_lens = [300, 1, 129], [300, 64, 700]
    q, k, v, cu_q, cu_k = _batch(rng, q_lens, kv_lens, 8, 2, 128, dtype)
    indptr, indices = _full(q_lens, kv_lens, 64, 64, 1)
    opts = on_device(cp, score_options(rng, 8, "all"))
    got, _ = _run_varlen(cp, q, k, v, cu_q, cu_k, indptr, indices, 64, 64, 1, **opts)
    dense = cupaged.varlen_prefill(*(cp.asarray(x) for x in (q, k, v, cu_q, cu_k)), **opts)
    _check_close(got, cp.asnumpy(dense).astype(np.float64), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("bm,rows", [(64, 128), (192, 128), (128, 64)])
def test_either_cta_height_serves_any_block_rows(cp, rng, d, bm, rows):
    """The CTA height the op does not pick for ``bm`` (128-row CTAs over two block rows of
    other blocks, or 64-row CTAs inside one block row) gives the reference's result too."""
    from cupaged.core.checks import check_options
    from cupaged.sparse import launch
    case = _gpu_case(rng, Q_LENS, KV_LENS, 4, 2, d, np.float16, bm, 64, 2, 0.4)
    q, k, v, cu_q, cu_k, indptr, indices = (cp.asarray(x) for x in case)
    sinks = rng.standard_normal(4).astype(np.float32)
    out = cp.full(q.shape, np.nan, dtype=q.dtype)
    lse = cp.full(q.shape[:2], np.nan, dtype=np.float32)
    opts = check_options(cp, 4, d, sinks=cp.asarray(sinks))
    bsr._launch(q, launch.dense_kv(k, v, cu_k), 2, cu_q, None, k.shape[0],
                bsr.Pattern(indptr, indices, bm, 64, 2), opts, True, out, lse, rows=rows)
    _check((cp.asnumpy(out), cp.asnumpy(lse)), _want_varlen(*case, bm, 64, 2, sinks=sinks),
           np.float16)
    cupaged.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("density", [0.0, 0.1, 1.0])
def test_long_rows_and_densities(cp, rng, density):
    """3000 keys: long block rows (many tiles per CTA), runs of adjacent blocks, empty and
    full rows; sm_scale other than the default."""
    q_lens, kv_lens = [2000, 700], [3000, 700]
    case = _gpu_case(rng, q_lens, kv_lens, 4, 1, 128, bfloat16, 64, 64, 4, density)
    opts = dict(sm_scale=0.05)
    got = _run_varlen(cp, *case, 64, 64, 4, **opts)
    want = _want_varlen(*case, 64, 64, 4, **opts)
    if density == 0.0:
        assert (got[0] == 0).all() and np.isneginf(got[1]).all()
    else:
        _check(got, want, bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, bfloat16])
def test_full_pattern_equals_dense_prefill(cp, rng, dtype):
    q_lens, kv_lens = [200, 33, 0, 64], [500, 33, 10, 64]
    case = _gpu_case(rng, q_lens, kv_lens, 8, 2, 128, dtype, 64, 64, 1, 2.0)
    got, lse = _run_varlen(cp, *case, 64, 64, 1)
    q, k, v, cu_q, cu_k = (cp.asarray(x) for x in case[:5])
    dense, dense_lse = cupaged.varlen_prefill(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    assert _rel_err(got, cp.asnumpy(dense)) < TOL[np.dtype(dtype)]
    np.testing.assert_allclose(lse, cp.asnumpy(dense_lse), rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
def test_padding_rows_and_empty_patterns(cp, rng):
    """Rows past cu_seqlens_q[-1] are zeros with LSE -inf; no kept block gives zeros and the
    sink as LSE."""
    q, k, v, cu_q, cu_k, _, _ = _gpu_case(rng, [70, 10], [90, 10], 4, 2, 64, np.float16, 64, 64, 1, 0)
    q = np.concatenate([q, _rand(rng, (9, 4, 64), np.float16)])
    rows = ref.bsr_row_offsets([70, 10], 64, 2)[-1]
    sinks = rng.standard_normal(4).astype(np.float32)
    got, lse = _run_varlen(cp, q, k, v, cu_q, cu_k, np.zeros(rows + 1, np.int32),
                           np.zeros(0, np.int32), 64, 64, 2, sinks=sinks)
    assert (got == 0).all()
    np.testing.assert_allclose(lse[:80], np.broadcast_to(sinks, (80, 4)), rtol=1e-6)
    assert np.isneginf(lse[80:]).all()


@pytest.mark.gpu
def test_single_sequence_gpu_is_the_batch_of_one(cp, rng):
    q, k, v, cu_q, cu_k, indptr, indices = _gpu_case(rng, [300], [420], 4, 2, 128, np.float16,
                                                     64, 32, 1, 0.5)
    dev = [cp.asarray(x) for x in (q, k, v, indptr, indices)]
    one = sparse.block_sparse_attention(*dev, 64, 32)
    batch, _ = _run_varlen(cp, q, k, v, cu_q, cu_k, indptr, indices, 64, 32, 1)
    np.testing.assert_array_equal(cp.asnumpy(one), batch)


@pytest.mark.gpu
def test_torch_in_torch_out(rng):
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k, indptr, indices = _gpu_case(rng, [100, 50], [100, 80], 4, 2, 64,
                                                     np.float16, 64, 64, 2, 0.5)
    t = [torch.from_numpy(np.asarray(x)).cuda() for x in (q, k, v, cu_q, cu_k, indptr, indices)]
    got = cupaged.varlen_block_sparse_attention(*t, 64, 64, pattern_heads=2)
    assert isinstance(got, torch.Tensor) and got.is_cuda
    want = _want_varlen(q, k, v, cu_q, cu_k, indptr, indices, 64, 64, 2)
    assert _rel_err(got.cpu().numpy(), want[0]) < TOL[np.dtype(np.float16)]


# ----------------------------------------------------------------------------- GPU: paged
def _run_paged(cp, q, kc, vc, cu_q, tables, lens, indptr, indices, bm, bn, heads, layout, **opts):
    dev = [cp.asarray(x) for x in (q, kc, vc, cu_q, tables, lens, indptr, indices)]
    opts = on_device(cp, opts)
    out = cp.full(q.shape, np.nan, dtype=q.dtype)
    got, lse = cupaged.paged_block_sparse_attention(*dev, bm, bn, pattern_heads=heads,
                                                    layout=layout, out=out, return_lse=True, **opts)
    return cp.asnumpy(got), cp.asnumpy(lse)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page", [1, 16, 24, 128])
@pytest.mark.parametrize("bm", [64, 128])
@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_equals_ragged(cp, rng, layout, page, bm, backend):
    """Every page size (powers of two and not) gives the ragged kernel's result exactly, and
    the reference's; q_len > kv_len rows see nothing when causal."""
    q_lens, kv_lens = [70, 0, 129, 1, 9], [500, 33, 200, 64, 4]
    q, k, v, cu_q, cu_k, indptr, indices = _gpu_case(rng, q_lens, kv_lens, 8, 2, 128,
                                                     np.float16, bm, 64, 2, 0.4)
    kc, vc, tables = _to_paged(rng, k, v, kv_lens, layout, page)
    lens = np.array(kv_lens, np.int32)
    got = _run_paged(cp, q, kc, vc, cu_q, tables, lens, indptr, indices, bm, 64, 2, layout,
                     backend=backend)
    ragged = _run_varlen(cp, q, k, v, cu_q, cu_k, indptr, indices, bm, 64, 2, backend=backend)
    np.testing.assert_array_equal(got[0], ragged[0])
    np.testing.assert_array_equal(got[1], ragged[1])
    _check(got, _want_varlen(q, k, v, cu_q, cu_k, indptr, indices, bm, 64, 2), np.float16)


@pytest.mark.gpu
@pytest.mark.bigmem
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_blocks_past_2_31_elements(cp, rng, layout):
    """Pages at the top of a cache of more than 2^31 elements (64-bit offsets)."""
    page, hk, d = 16, 2, 128
    num_blocks = (2 ** 31) // (page * hk * d) + 64
    q_lens, kv_lens = [64, 100], [300, 100]
    q, k, v, cu_q, cu_k, indptr, indices = _gpu_case(rng, q_lens, kv_lens, 4, hk, d, bfloat16,
                                                     64, 64, 4, 0.6)
    need = [-(-n // page) for n in kv_lens]
    ids = num_blocks - 1 - rng.permutation(sum(need))
    tables = np.full((2, max(need)), -1, np.int32)
    shape = (num_blocks, page, hk, d) if layout == "NHD" else (num_blocks, hk, page, d)
    kc, vc = cp.zeros(shape, k.dtype), cp.zeros(shape, k.dtype)
    used = 0
    for b, n in enumerate(kv_lens):
        tables[b, :need[b]] = ids[used:used + need[b]]
        used += need[b]
        rows = np.zeros((need[b] * page, hk, d), k.dtype)
        for src, cache in ((k, kc), (v, vc)):
            rows[:n] = src[cu_k[b]:cu_k[b] + n]
            blocks = cp.asarray(rows.reshape(need[b], page, hk, d))
            cache[cp.asarray(tables[b, :need[b]])] = blocks if layout == "NHD" else blocks.transpose(0, 2, 1, 3)
    got = _run_paged(cp, q, kc, vc, cu_q, tables, np.array(kv_lens, np.int32), indptr, indices,
                     64, 64, 4, layout)
    del kc, vc
    _check(got, _want_varlen(q, k, v, cu_q, cu_k, indptr, indices, 64, 64, 4), bfloat16)


@pytest.mark.gpu
def test_paged_gpu_limits(cp, rng):
    q, k, v, cu_q, _, indptr, indices = _gpu_case(rng, [10], [20], 4, 2, 64, np.float16, 64, 64, 1, 1.0)
    kc, vc, tables = _to_paged(rng, k, v, [20], "vllm", 16)
    with pytest.raises(ValueError, match="NHD' or 'HND'"):
        _run_paged(cp, q, kc, vc, cu_q, tables, np.array([20], np.int32), indptr, indices, 64, 64,
                   1, "vllm")


# ----------------------------------------------------------------------------- GPU: bad input
def _bad_case(rng):
    q_lens, kv_lens = [130, 64, 70], [200, 64, 300]
    return q_lens, kv_lens, _gpu_case(rng, q_lens, kv_lens, 4, 2, 64, np.float16, 64, 64, 2, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("bad,match", [
    ("index", r"indices: expected entries in \[0, 4\), got 9 at index 6"),
    ("order", r"indices: expected strictly increasing entries within each CSR row"),
    ("indptr", r"indptr: expected entries in \[0, 47\), got 51 at index 2"),
])
def test_bad_pattern_rows_come_out_as_zeros(cp, rng, bad, match):
    """A bad entry of a CSR row (sequence 0, pattern head 0, block row 1: rows 64-127 of
    query heads 0-1; a bad indptr[2] also ends row 1 and starts row 2, rows 128-129) is
    reported and never followed; those rows are zeros, the others right."""
    q_lens, kv_lens, case = _bad_case(rng)
    q, k, v, cu_q, cu_k, indptr, indices = case
    good = _want_varlen(*case, 64, 64, 2)
    indices = indices.copy()
    indptr = indptr.copy()
    lo = indptr[1]                                     # row 1: blocks 0..3
    if bad == "index":
        indices[lo + 2] = 9
    elif bad == "order":
        indices[lo + 1], indices[lo + 2] = indices[lo + 2], indices[lo + 1]
    else:
        indptr[2] = len(indices) + 5                   # past nnz = 46
    cupaged.check_errors()
    got, lse = _run_varlen(cp, q, k, v, cu_q, cu_k, indptr, indices, 64, 64, 2)
    with pytest.raises(errors.DeviceIndexError, match=match):
        cupaged.check_errors()
    rows = slice(64, 130 if bad == "indptr" else 128)
    assert (got[rows, :2] == 0).all() and np.isneginf(lse[rows, :2]).all()
    keep = np.ones(q.shape[:2], bool)
    keep[rows, :2] = False
    assert _rel_err(got[keep], good[0][keep]) < TOL[np.dtype(np.float16)]
    with pytest.raises(ValueError, match="indices|indptr"):
        cupaged.varlen_block_sparse_attention(*(cp.asarray(x) for x in (q, k, v, cu_q, cu_k, indptr,
                                                                        indices)),
                                              64, 64, pattern_heads=2, validate=True)


@pytest.mark.gpu
def test_bad_frame_gives_zeros_everywhere(cp, rng):
    """An indptr sized for other lengths: reported, and no row follows the pattern."""
    q_lens, kv_lens, (q, k, v, cu_q, cu_k, indptr, indices) = _bad_case(rng)
    cu_q = _cu([130, 64, 6])                           # 2 * (3 + 1 + 1) + 1 = 11 entries, not 13
    q = q[:200]
    cupaged.check_errors()
    got, lse = _run_varlen(cp, q, k, v, cu_q, cu_k, indptr, indices, 64, 64, 2)
    with pytest.raises(errors.DeviceIndexError, match="indptr: expected 11 entries"):
        cupaged.check_errors()
    assert (got == 0).all() and np.isneginf(lse).all()


@pytest.mark.gpu
@pytest.mark.parametrize("bad,match", [
    ("block", r"block_tables: expected entries in \[0, "),
    ("length", "seq_lens: sequence 2 needs"),
])
def test_bad_block_tables_give_zeros(cp, rng, bad, match):
    q_lens, kv_lens, (q, k, v, cu_q, cu_k, indptr, indices) = _bad_case(rng)
    kc, vc, tables = _to_paged(rng, k, v, kv_lens, "NHD", 16)
    lens = np.array(kv_lens, np.int32)
    if bad == "block":
        tables[2, 3] = kc.shape[0] + 5
    else:
        lens[2] = tables.shape[1] * 16 + 1
    cupaged.check_errors()
    got, lse = _run_paged(cp, q, kc, vc, cu_q, tables, lens, indptr, indices, 64, 64, 2, "NHD")
    with pytest.raises(errors.DeviceIndexError, match=match):
        cupaged.check_errors()
    rows = slice(194, 264)                             # sequence 2
    assert (got[rows] == 0).all() and np.isneginf(lse[rows]).all()
    good = _want_varlen(q, k, v, cu_q, cu_k, indptr, indices, 64, 64, 2)
    assert _rel_err(got[:194], good[0][:194]) < TOL[np.dtype(np.float16)]


@pytest.mark.gpu
def test_bad_cu_seqlens_q_is_reported(cp, rng):
    q_lens, kv_lens, (q, k, v, cu_q, cu_k, indptr, indices) = _bad_case(rng)
    cu_q = cu_q.copy()
    cu_q[2] = cu_q[1] - 1
    cupaged.check_errors()
    _run_varlen(cp, q, k, v, cu_q, cu_k, indptr, indices, 64, 64, 2)
    with pytest.raises(errors.DeviceIndexError, match="cu_seqlens_q: expected non-decreasing"):
        cupaged.check_errors()


# ----------------------------------------------------------------------------- launch wiring
class _Recorder:
    """Stands in for a compiled kernel: packs the fields into its record (a missing or
    misspelt field raises) and keeps the launch."""

    def __init__(self, record, calls):
        self.record, self.calls = record, calls

    def __call__(self, grid, block, smem=0, **fields):
        self.record.pack_into(bytearray(self.record.size), **fields)
        self.calls.append((self.record.name, grid, block, smem, fields))


@pytest.fixture
def recorded(monkeypatch):
    """Launches of bsr.py and attention.py recorded on the host (NumPy arrays for device
    ones; addresses from id())."""
    import sys
    import types
    from cupaged.sparse import attention, launch, tiles
    calls = []
    fake_ptr = lambda a: 0 if a is None else id(a)  # noqa: E731
    for module in (bsr, launch, attention):
        monkeypatch.setattr(module, "ptr", fake_ptr)
    monkeypatch.setattr(tiles, "address", fake_ptr)
    monkeypatch.setattr(launch, "launcher", lambda stem, expr, record, **kw: _Recorder(record, calls))
    monkeypatch.setattr(launch, "attention_kernel",
                        lambda dtype, d, kind="sparse_attention", rows=128, general=False:
                        _Recorder(abi.SPARSE, calls))
    monkeypatch.setattr(launch, "error_word", lambda: np.zeros(8, np.int64))
    monkeypatch.setattr(launch.tma, "encode", lambda address, geometry: bytes(128))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(empty=np.empty))
    return calls


@pytest.mark.parametrize("wgmma", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_bsr_launches_pack_their_records(rng, recorded, paged, wgmma):
    from cupaged.sparse import launch
    q_lens, kv_lens = [300, 0, 77], [300, 50, 200]
    q, k, v, cu_q, cu_k = _batch(rng, q_lens, kv_lens, 8, 2, 128, np.float16)
    indptr, indices = _pattern(rng, q_lens, kv_lens, 64, 64, 2, 0.5)
    opts = AttentionOptions(0.1, -1, None, np.zeros(8, np.float32), 0.0)
    pattern = bsr.Pattern(indptr, indices, 64, 64, 2)
    out, lse = np.empty_like(q), np.empty(q.shape[:2], np.float32)
    if paged:
        kc, vc, tables = _to_paged(rng, k, v, kv_lens, "HND", 16)
        kv = launch.paged_kv(kc, vc, tables, "HND")
        bsr._launch(q, kv, 2, cu_q, np.array(kv_lens, np.int32), 0, pattern, opts, True, out, lse,
                    wgmma=wgmma)
    else:
        bsr._launch(q, launch.dense_kv(k, v, cu_k), 2, cu_q, None, k.shape[0], pattern, opts,
                    True, out, lse, wgmma=wgmma)
    (prep, g0, b0, _, f0), (attn, g1, b1, smem, f1) = recorded
    tma = wgmma and not paged                          # dense rows of d128: the TMA kernel
    assert (prep, attn) == ("BsrPrepareArgs", "SparseArgsTma" if tma else "SparseArgs")
    assert ("k_map" in f1) == tma
    rows = 128 if wgmma else 64                        # block_m 64: 64-row mma.sync CTAs
    bound = -(-377 // rows) + 3
    assert g0 == 1 and b0 == launch.PREP_THREADS and g1 == (8, bound)
    if wgmma:
        assert b1 == 384 and smem == launch.ws_smem(128, "bsr_attention")
    else:
        assert b1 == launch.attention_tile(128, 64).threads and smem == launch.attention_smem(128, 64)
    assert f0["cta_bound"] == f1["cta_bound"] == bound and f0["cta_rows"] == rows
    assert f0["indptr_len"] == f1["indptr_len"] == len(indptr) and f1["nnz"] == len(indices)
    assert f1["pattern_group"] == 4 and f1["group"] == 4 and f1["q_tok"] == 8 * 128
    assert f0["row_bytes"] == 8 * 128 * 2 and f0["table_width"] == (tables.shape[1] if paged else 0)
    assert (f1["block_tables"] != 0) == paged and (f1["cu_k"] != 0) == (not paged)


def test_cta_rows_follow_the_block_rows():
    assert [bsr.cta_rows(m) for m in (64, 128, 192, 256, 320)] == [64, 128, 64, 128, 64]


def test_vertical_slash_launch_packs_its_record(rng, recorded):
    from cupaged.sparse import attention, launch, tiles
    q, k, v, cu_q, cu_k = _batch(rng, [130], [130], 4, 2, 64, np.float16)
    lists = tiles.TileLists(np.zeros(8, np.int32), np.zeros((8 * 7, 2), np.int32), 0, 4, 7,
                            np.zeros((1, 4, 3), np.int32), 4, 3)
    batch = attention.Batch(4, 2, 64, 1, 130)
    opts = AttentionOptions(0.125, -1, None, None, 0.0)
    meta = np.zeros(launch.bsr_meta_size(1, 3), np.int32)
    attention.launch(q, launch.dense_kv(k, v, cu_k), np.empty_like(q), None, cu_q, meta, batch, 3,
                     lists, opts, launch.attention_launch(np.float16, 64))
    (name, grid, _, _, fields), = recorded
    assert name == "SparseArgs" and grid == (4, 3)
    assert fields["list_cap"] == 7 and fields["cols_width"] == 3 and fields["lse"] == 0
    assert fields["cta_bound"] == 3 and fields["batch"] == 1 and fields["bsr_meta"] == id(meta)