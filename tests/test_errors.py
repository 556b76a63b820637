"""Bad device index contents: never followed, reported through the device error word and
raised by ``cupaged.check_errors``; in strict mode refused on the host before anything runs.

Every GPU case also runs under compute-sanitizer memcheck in the GPU suite (no access
outside an array whatever the indices hold).
"""
import numpy as np
import pytest

import cupaged
from cupaged.core import abi, errors
from cupaged.core.arrays import bfloat16
from cupaged.reference import attention as ref


# ----------------------------------------------------------------------------- host side
def test_error_codes_round_trip():
    for arg in abi.ERROR_ARGUMENTS:
        for check in abi.ERROR_CHECKS:
            assert abi.decode_error(abi.error_code(arg, check)) == (arg, check)


@pytest.mark.parametrize("words, text", [
    ((abi.error_code("block_tables", "range"), 3, 7, 999, 64), r"block_tables: expected entries in \[0, 64\), got 999 at index \(3, 7\)"),
    ((abi.error_code("slot_mapping", "range"), 12, -1, -5, 100), r"slot_mapping: expected entries in \[0, 100\), got -5 at index 12"),
    ((abi.error_code("cu_seqlens_q", "order"), 2, -1, 3, 9), r"cu_seqlens_q: expected non-decreasing entries, got 9 then 3 at index 2"),
    ((abi.error_code("cu_seqlens_k", "start"), 0, -1, 4, 0), r"cu_seqlens_k: expected cu_seqlens_k\[0\] == 0, got 4"),
    ((abi.error_code("cu_seqlens_q", "end"), 3, -1, 90, 80), r"cu_seqlens_q: expected entries at most 80"),
    ((abi.error_code("seq_lens", "table"), 1, -1, 300, 256), r"seq_lens: sequence 1 needs 300 tokens, but block_tables holds 256"),
])
def test_messages_name_argument_index_and_value(words, text):
    import re
    assert re.search(text, errors.message(np.asarray(words + (0, 0, 0), np.int64)))


def test_strict_mode(monkeypatch):
    monkeypatch.delenv("CUPAGED_STRICT", raising=False)
    assert not errors.strict() and errors.strict(True)
    monkeypatch.setenv("CUPAGED_STRICT", "1")
    assert errors.strict() and not errors.strict(False)
    monkeypatch.setenv("CUPAGED_STRICT", "0")
    assert not errors.strict()


def test_check_errors_without_a_device_word_is_a_no_op():
    errors.check_errors()


# ----------------------------------------------------------------------------- device side
def _decode_case(rng, cp, lens=(40, 7, 100, 0, 33), hq=8, hk=2, d=128, bs=16):
    lens = np.asarray(lens, np.int32)
    need = -(-lens // bs)
    width = int(need.max()) + 1
    nb = int(need.sum()) + 4
    ids = rng.permutation(nb).astype(np.int32)
    tables = np.full((len(lens), width), -1, np.int32)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[start:start + n]
        start += n
    k = rng.standard_normal((nb, bs, hk, d), np.float32).astype(bfloat16)
    v = rng.standard_normal((nb, bs, hk, d), np.float32).astype(bfloat16)
    q = rng.standard_normal((len(lens), hq, d), np.float32).astype(bfloat16)
    return dict(q=q, k_cache=k, v_cache=v, block_tables=tables, seq_lens=lens)


def _dev(cp, case):
    return {n: cp.asarray(a) for n, a in case.items()}


def _expect_error(pattern):
    with pytest.raises(errors.DeviceIndexError, match=pattern):
        cupaged.check_errors()
    cupaged.check_errors()  # cleared


@pytest.mark.gpu
@pytest.mark.parametrize("bad", ["random", "past_cache", "negative"])
def test_decode_bad_block_ids(rng, cp, bad):
    cupaged.check_errors()
    case = _decode_case(rng, cp)
    tables = case["block_tables"].copy()
    nb = case["k_cache"].shape[0]
    if bad == "random":
        tables[2] = rng.integers(-2**31, 2**31 - 1, tables.shape[1], dtype=np.int64).astype(np.int32)
    elif bad == "past_cache":
        tables[2, 1] = nb
    else:
        tables[2, 0] = -7
    dev = _dev(cp, {**case, "block_tables": tables})
    out = cupaged.paged_decode(**dev, layout="NHD").get().astype(np.float32)
    _expect_error(r"block_tables: expected entries in \[0, %d\), got -?\d+ at index \(2, \d+\)" % nb)
    assert (out[2] == 0).all()
    good = [0, 1, 3, 4]
    want = ref.paged_decode(case["q"][good], case["k_cache"], case["v_cache"],
                            case["block_tables"][good], case["seq_lens"][good])
    np.testing.assert_allclose(out[good], np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_decode_lengths_past_the_table_and_strict_mode(rng, cp):
    cupaged.check_errors()
    case = _decode_case(rng, cp)
    lens = case["seq_lens"].copy()
    lens[1] = 10**6
    dev = _dev(cp, {**case, "seq_lens": lens})
    out = cupaged.paged_decode(**dev, layout="NHD").get().astype(np.float32)
    _expect_error("seq_lens: sequence 1 needs 1000000 tokens")
    assert (out[1] == 0).all()
    poisoned = cp.full(case["q"].shape, np.nan, bfloat16)
    with pytest.raises(ValueError, match="seq_lens: sequence 1 needs"):
        cupaged.paged_decode(**dev, out=poisoned, validate=True, layout="NHD")
    assert bool(cp.isnan(poisoned.astype(cp.float32)).all())  # nothing ran
    cupaged.check_errors()


@pytest.mark.gpu
def test_decoder_plan_from_garbage_device_tables(rng, cp):
    cupaged.check_errors()
    case = _decode_case(rng, cp)
    tables = rng.integers(-2**31, 2**31 - 1, case["block_tables"].shape, dtype=np.int64).astype(np.int32)
    dec = cupaged.PagedDecoder(8, 2, 128, 16, dtype=bfloat16, max_batch=8, layout="NHD")
    dec.plan(cp.asarray(tables), cp.asarray(case["seq_lens"]))
    dev = _dev(cp, case)
    out = dec.run(dev["q"], dev["k_cache"], dev["v_cache"]).get().astype(np.float32)
    _expect_error("block_tables: expected entries in")
    assert (out[case["seq_lens"] > 0] == 0).all()


@pytest.mark.gpu
def test_decoder_plan_from_host_tables_past_the_cache(rng, cp):
    """Host tables on the device planner: lengths checked on the host, block ids by the
    plan kernel at run (the plan has no cache); strict mode checks the ids at run before
    anything is launched."""
    cupaged.check_errors()
    case = _decode_case(rng, cp)
    tables = case["block_tables"].copy()
    nb = case["k_cache"].shape[0]
    tables[2, 1] = nb + 5
    dec = cupaged.PagedDecoder(8, 2, 128, 16, dtype=bfloat16, max_batch=8, layout="NHD",
                               xp=cp)
    with pytest.raises(ValueError, match="seq_lens: sequence 0 needs"):
        dec.plan(tables[:, :1], case["seq_lens"])  # lengths past the table: on the host
    dec.plan(tables, case["seq_lens"])
    dev = _dev(cp, case)
    out = dec.run(dev["q"], dev["k_cache"], dev["v_cache"]).get().astype(np.float32)
    _expect_error(r"block_tables: expected entries in \[0, %d\), got %d at index \(2, 1\)"
                  % (nb, nb + 5))
    assert (out[2] == 0).all()
    good = [0, 1, 3, 4]
    want = ref.paged_decode(case["q"][good], case["k_cache"], case["v_cache"],
                            case["block_tables"][good], case["seq_lens"][good])
    np.testing.assert_allclose(out[good], np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    poisoned = cp.full(case["q"].shape, np.nan, bfloat16)
    for metadata in (tables, cp.asarray(tables)):  # host or device tables, read in strict mode
        lens = case["seq_lens"] if metadata is tables else cp.asarray(case["seq_lens"])
        dec.plan(metadata, lens, validate=True)
        with pytest.raises(ValueError, match="block_tables: expected block ids below"):
            dec.run(dev["q"], dev["k_cache"], dev["v_cache"], out=poisoned)
        assert bool(cp.isnan(poisoned.astype(cp.float32)).all())  # nothing ran
    cupaged.check_errors()


@pytest.mark.gpu
def test_append_skips_bad_sequences(rng, cp):
    cupaged.check_errors()
    case = _decode_case(rng, cp, lens=(40, 7, 100, 5, 33))
    tables = case["block_tables"].copy()
    tables[0, 2] = 10**6  # the appended token of sequence 0 would land in block 10**6
    dev = _dev(cp, {**case, "block_tables": tables})
    k0, v0 = dev["k_cache"].copy(), dev["v_cache"].copy()
    knew = cp.asarray(rng.standard_normal((5, 2, 128), np.float32).astype(bfloat16))
    cupaged.paged_decode(**dev, k_new=knew, v_new=knew, layout="NHD")
    _expect_error(r"block_tables: expected entries in .* at index \(0, 2\)")
    changed = cp.any(dev["k_cache"] != k0, axis=(1, 2, 3)).get()
    assert changed.sum() == 4  # sequences 1..4 appended one token each, in one block each
    assert (cp.any(dev["v_cache"] != v0, axis=(1, 2, 3)).get() == changed).all()


@pytest.mark.gpu
def test_varlen_decreasing_prefix_sums(rng, cp):
    cupaged.check_errors()
    q = cp.asarray(rng.standard_normal((30, 8, 64), np.float32).astype(np.float16))
    k = cp.asarray(rng.standard_normal((30, 2, 64), np.float32).astype(np.float16))
    cu_bad = cp.asarray(np.array([0, 10, 5, 30], np.int32))
    cu = cp.asarray(np.array([0, 10, 20, 30], np.int32))
    out = cupaged.varlen_prefill(q, k, k, cu_bad, cu)
    _expect_error("cu_seqlens_q: expected non-decreasing entries, got 10 then 5 at index 2")
    assert float(cp.abs(out.astype(cp.float32)).max()) == 0.0
    with pytest.raises(ValueError, match="cu_seqlens_q: expected non-decreasing"):
        cupaged.varlen_prefill(q, k, k, cu_bad, cu, validate=True)
    out = cupaged.varlen_prefill(q, k, k, cu, cp.asarray(np.array([3, 10, 20, 30], np.int32)))
    _expect_error(r"cu_seqlens_k: expected cu_seqlens_k\[0\] == 0, got 3")
    out = cupaged.varlen_prefill(q, k, k, cu, cp.asarray(np.array([0, 10, 20, 31], np.int32)))
    _expect_error("cu_seqlens_k: expected entries at most 30")


@pytest.mark.gpu
def test_paged_prefill_bad_sequence_rows_are_zero(rng, cp):
    cupaged.check_errors()
    case = _decode_case(rng, cp)
    q_lens = np.array([5, 7, 9, 0, 3], np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), 8, 128), np.float32).astype(bfloat16)
    tables = case["block_tables"].copy()
    tables[2, 0] = 2**30
    dev = _dev(cp, {**case, "block_tables": tables})
    out = cupaged.paged_prefill(cp.asarray(q), dev["k_cache"], dev["v_cache"], cp.asarray(cu),
                                dev["block_tables"], dev["seq_lens"], layout="NHD").get().astype(np.float32)
    _expect_error(r"block_tables: expected entries in .* got 1073741824 at index \(2, 0\)")
    assert (out[cu[2]:cu[3]] == 0).all()
    good = np.r_[cu[0]:cu[2], cu[4]:cu[5]]
    want = ref.paged_prefill(q, case["k_cache"], case["v_cache"], cu, case["block_tables"],
                             case["seq_lens"])
    np.testing.assert_allclose(out[good], np.asarray(want, np.float32)[good], rtol=2e-2,
                               atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND", "vllm"])
def test_write_skips_slots_past_the_cache(rng, cp, layout):
    cupaged.check_errors()
    cache = cupaged.PagedKVCache(8, 16, 2, 64, dtype="float16", layout=layout, xp=cp)
    key = cp.asarray(rng.standard_normal((6, 2, 64), np.float32).astype(np.float16))
    slots = cp.asarray(np.array([0, 5, 128, -1, 2**40, 17], np.int64))
    cupaged.write_kv_cache(key, key, cache.k, cache.v, slots, layout=layout)
    _expect_error(r"slot_mapping: expected entries in \[0, 128\), got 128 at index 2|"
                  r"slot_mapping: expected entries in \[0, 128\), got 1099511627776 at index 4")
    want_k, want_v = np.zeros(cache.k.shape, np.float16), np.zeros(cache.v.shape, np.float16)
    good = np.array([0, 1, 5], np.int64)
    cupaged.write_kv_cache(key.get()[good], key.get()[good], want_k, want_v,
                           np.array([0, 5, 17], np.int64), layout=layout)
    np.testing.assert_array_equal(cache.k.get(), want_k)
    np.testing.assert_array_equal(cache.v.get(), want_v)
    with pytest.raises(ValueError, match="slot 5 appears more than once"):
        cupaged.write_kv_cache(key[:2], key[:2], cache.k, cache.v,
                               cp.asarray(np.array([5, 5], np.int64)), layout=layout,
                               validate=True)


@pytest.mark.gpu
def test_rope_positions_out_of_range(rng, cp):
    cupaged.check_errors()
    q = cp.asarray(rng.standard_normal((4, 4, 64), np.float32))
    pos = cp.asarray(np.array([0, 9000, 5, -1], np.int32))
    qo, ko = cupaged.apply_rope(pos, q, q, max_position=8192)
    _expect_error(r"positions: expected entries in \[0, 8192\), got (9000 at index 1|-1 at index 3)")
    assert float(cp.abs(qo[1]).max()) == 0.0 and float(cp.abs(qo[3]).max()) == 0.0
    want, _ = cupaged.apply_rope(np.array([0, 5]), q.get()[[0, 2]], q.get()[[0, 2]],
                                 max_position=8192)
    np.testing.assert_allclose(qo.get()[[0, 2]], want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_copy_blocks_device_mapping_out_of_range(rng, cp):
    cupaged.check_errors()
    cache = cupaged.PagedKVCache(6, 16, 2, 64, dtype="float16", xp=cp)
    cache.k[...] = cp.asarray(rng.standard_normal(cache.k.shape, np.float32).astype(np.float16))
    before = cache.k.get()
    cupaged.copy_blocks(cache.k, cache.v, cp.asarray(np.array([[0, 1], [2, 9]], np.int64)))
    _expect_error(r"block_mapping: expected entries in \[0, 6\), got 9 at index \(1, 1\)")
    after = cache.k.get()
    np.testing.assert_array_equal(after[1], before[0])
    np.testing.assert_array_equal(after[2:], before[2:])
