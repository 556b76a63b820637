"""The CuPy host path without a GPU (tests/fake_device.py): what the planned ops would
launch, compared between their checked first call and their hot later calls, and where each
launch reads what another wrote. The GPU tests check the results; these check, on any
machine, that the hot path skips the checks and launches exactly what the checked path does,
and that a call does nothing the stand-in cannot do (a read of device data, a CuPy kernel of
its own: both need a driver and raise here).
"""
import numpy as np
import pytest

import cupaged
from cupaged import sparse
from cupaged.core.arrays import bfloat16, gpu_available
from cupaged.sparse import quest

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.skipif(gpu_available(), reason="a stand-in for machines without a GPU")

from fake_device import fake_device  # noqa: E402


@pytest.fixture
def fake():
    with fake_device() as f:
        yield f


def _cache_shapes(layout, nb, bs, hk, d):
    if layout == "vllm":
        return (nb, hk, d // 8, bs, 8), (nb, hk, d, bs)
    shape = (nb, hk, bs, d) if layout == "HND" else (nb, bs, hk, d)
    return shape, shape


def _layer(fake, layout, nb, bs, hk, d, bound_dtype):
    ks, vs = _cache_shapes(layout, nb, bs, hk, d)
    return (fake.array(ks, bfloat16), fake.array(vs, bfloat16),
            fake.array((nb, hk, d), bound_dtype), fake.array((nb, hk, d), bound_dtype))


def _without(launches, field):
    """Launches as comparable tuples, ``field`` (an output allocated per call) left out."""
    return [(l.expr, l.grid, l.block, l.smem,
             sorted((k, v) for k, v in l.fields().items() if k != field)) for l in launches]


QUEST_CASES = [  # layout, batch, length, Hq, Hk, D, page, top k, first pages, bound dtype
    ("HND", 8, 4096, 32, 8, 128, 16, 64, 0, bfloat16),
    ("NHD", 3, 1000, 12, 2, 64, 16, 8, 2, np.float32),
    ("vllm", 2, 777, 8, 8, 256, 8, 5, 1, np.float32),
    ("NHD", 1, 50, 4, 1, 128, 16, 100, 0, bfloat16),
]


@pytest.mark.parametrize("outputs", ["out", "out+lse", "return_lse", "sinks", "alloc"])
@pytest.mark.parametrize("layout,batch,length,hq,hk,d,bs,k,first,bound_dtype", QUEST_CASES)
def test_quest_decoder_hot_runs_launch_what_the_checked_run_does(
        fake, outputs, layout, batch, length, hq, hk, d, bs, k, first, bound_dtype):
    width = -(-length // bs)
    nb = batch * width + 3
    kc, vc, k_min, k_max = _layer(fake, layout, nb, bs, hk, d, bound_dtype)
    q = fake.array((batch, hq, d), bfloat16)
    kwargs = {}
    if outputs != "alloc":
        kwargs["out"] = fake.array((batch, hq, d), bfloat16)
    if outputs == "out+lse":
        kwargs["lse"] = fake.array((batch, hq), np.float32)
    if outputs == "return_lse":
        kwargs["return_lse"] = True
    if outputs == "sinks":
        kwargs["sinks"] = fake.array((hq,), np.float32)
    dec = sparse.QuestDecoder(hq, hk, d, bs, k, first_pages=first, dtype=bfloat16,
                              layout=layout, max_batch=batch + 1, xp=cupy)
    dec.plan(np.zeros((batch, width), np.int32), np.full(batch, length, np.int32))
    checked = dec._run_checked
    calls = []
    dec._run_checked = lambda *a: calls.append(1) or checked(*a)
    runs = []
    for _ in range(3):
        fake.launches.clear()
        dec.update_bounds(kc, k_min, k_max)
        dec.run(q, kc, vc, k_min, k_max, **kwargs)
        runs.append(list(fake.launches))
    assert len(calls) == 1, "later runs of a checked signature must take the hot path"
    names = [l.name for l in runs[0]]
    assert names[:4] == ["quest_bounds_kernel", "quest_score_kernel", "quest_select_kernel",
                         "decode_plan_kernel"]
    assert names[-1] == "quest_sinks_kernel" if outputs == "sinks" else "sinks" not in names[-1]
    # the first run after a plan also cuts the selection (the plan kernel); later ones not
    first_run = [l for l in runs[0] if l.name != "decode_plan_kernel"]
    allocated = {"alloc": "out", "return_lse": "lse"}.get(outputs)
    for later in runs[1:]:
        assert [l.name for l in later] == [l.name for l in first_run]
        assert _without(later, allocated) == _without(first_run, allocated)
        if allocated is None:
            assert [l.args for l in later] == [l.args for l in first_run]


def test_quest_decoder_select_writes_where_the_decode_reads(fake):
    batch, length, hq, hk, d, bs, k = 3, 1000, 12, 2, 64, 16, 8
    width = -(-length // bs)
    kc, vc, k_min, k_max = _layer(fake, "NHD", batch * width, bs, hk, d, np.float32)
    q, out = fake.array((batch, hq, d), bfloat16), fake.array((batch, hq, d), bfloat16)
    dec = sparse.QuestDecoder(hq, hk, d, bs, k, dtype=bfloat16, layout="NHD", max_batch=4)
    tables, lens = fake.array((batch, width), np.int32), fake.array((batch,), np.int32)
    fake.copies.clear()
    dec.plan(tables, lens)
    dst_tables, dst_lens = fake.copies[0][0], fake.copies[1][0]  # device-to-device copies
    assert fake.copies[0][2] == tables.data.ptr and fake.copies[1][1] == lens.data.ptr
    dec.run(q, kc, vc, k_min, k_max, out=out)
    f = {l.name: l.fields() for l in fake.launches}
    assert f["quest_score_kernel"]["block_tables"] == dst_tables
    assert f["quest_score_kernel"]["seq_lens"] == dst_lens
    assert f["quest_score_kernel"]["q"] == q.data.ptr
    sel = f["quest_select_kernel"]
    assert (sel["block_tables"], sel["seq_lens"]) == (dst_tables, dst_lens)
    assert sel["scores"] == f["quest_score_kernel"]["scores"]
    assert f["decode_plan_kernel"]["block_tables"] == sel["sel_tables"]
    assert f["decode_plan_kernel"]["seq_lens"] == sel["sel_lens"]
    decode = next(v for n, v in f.items() if n.startswith("paged_decode"))
    assert decode["block_tables"] == sel["sel_tables"]
    assert decode["bt_stride"] == sel["sel_stride"] >= k * bs
    assert (decode["q"], decode["out"], decode["k_cache"]) == (q.data.ptr, out.data.ptr,
                                                               kc.data.ptr)
    assert dec.selection.tables.data.ptr == sel["sel_tables"]
    assert dec.selection.tables.shape == (batch * hk, k * bs)


def test_quest_decoder_follows_layers_and_new_plans(fake):
    """A second layer's arrays take their own checked run, then their hot one; a plan of
    another shape makes new launches (its grid, its buffers)."""
    hq, hk, d, bs, k = 8, 2, 128, 16, 4
    dec = sparse.QuestDecoder(hq, hk, d, bs, k, dtype=bfloat16, layout="HND", max_batch=4,
                              xp=cupy)
    layers = [_layer(fake, "HND", 64, bs, hk, d, bfloat16) for _ in range(2)]
    for batch, width in ((3, 20), (2, 9)):
        dec.plan(np.zeros((batch, width), np.int32), np.full(batch, 5 * bs, np.int32))
        q, out = fake.array((batch, hq, d), bfloat16), fake.array((batch, hq, d), bfloat16)
        for _ in range(2):
            for kc, vc, k_min, k_max in layers:
                fake.launches.clear()
                dec.run(q, kc, vc, k_min, k_max, out=out)
                f = {l.name: (l.grid, l.fields()) for l in fake.launches}
                assert f["quest_score_kernel"][0][0] == batch * hk
                assert f["quest_score_kernel"][1]["k_min"] == k_min.data.ptr
                assert f["quest_score_kernel"][1]["width"] == width
                assert f["quest_select_kernel"][1]["top_k"] == min(k, width)
                decode = next(v for n, v in f.items() if n.startswith("paged_decode"))
                assert decode[1]["k_cache"] == kc.data.ptr
                assert decode[1]["v_cache"] == vc.data.ptr


def test_quest_functional_select_writes_dense_rows(fake):
    batch, hq, hk, d, bs, width, k = 2, 8, 2, 64, 16, 30, 7
    q = fake.array((batch, hq, d), bfloat16)
    k_min, k_max = (fake.array((100, hk, d), np.float32) for _ in range(2))
    tables, lens = fake.array((batch, width), np.int32), fake.array((batch,), np.int32)
    for tpp in (1, bs):
        fake.launches.clear()
        sel = quest.select_pages(q, k_min, k_max, tables, lens, bs, k, tokens_per_page=tpp)
        f = fake.launches[-1].fields()
        assert fake.launches[-1].name == "quest_select_kernel"
        assert f["sel_stride"] == k * tpp == sel.tables.shape[1]
        assert f["sel_tables"] == sel.tables.data.ptr and f["positions"] == sel.positions.data.ptr


def test_paged_decoder_hot_runs_launch_what_the_checked_run_does(fake):
    batch, hq, hk, d, bs, width = 5, 16, 4, 128, 16, 40
    dec = cupaged.PagedDecoder(hq, hk, d, bs, dtype=bfloat16, layout="NHD", max_batch=8,
                               xp=cupy)
    dec.plan(np.zeros((batch, width), np.int32), np.full(batch, 300, np.int32))
    kc, vc = (fake.array((batch * width, bs, hk, d), bfloat16) for _ in range(2))
    q, out = fake.array((batch, hq, d), bfloat16), fake.array((batch, hq, d), bfloat16)
    runs = []
    for _ in range(3):
        fake.launches.clear()
        dec.run(q, kc, vc, out=out)
        runs.append([(l.expr, l.grid, l.block, l.smem, l.args) for l in fake.launches])
    assert runs[0][0][0].startswith("cupaged::plan::decode_plan_kernel") or \
        "decode_plan_kernel" in runs[0][0][0]
    assert runs[1] == runs[2] == runs[0][1:]


# ----------------------------------------------------------------------------- every hot path
def _calls(fake, call, n=3):
    """The launches of ``n`` calls of ``call``, each a list of (expr, grid, block, smem, args)."""
    runs = []
    for _ in range(n):
        fake.launches.clear()
        call()
        runs.append([(l.expr, l.grid, l.block, l.smem, l.args) for l in fake.launches])
    return runs


def _hot_op(fake, op):
    """A public call with a hot path, on dense outputs given (nothing allocated a call), and
    whether its first call also plans for the later ones (a planned object's first run after
    a plan)."""
    a = fake.array
    batch, hq, hk, d, bs, length, s = 4, 16, 4, 128, 16, 1000, 300
    width = -(-length // bs)
    kc, vc = (a((batch * width, bs, hk, d), bfloat16) for _ in range(2))
    q, out = a((batch, hq, d), bfloat16), a((batch, hq, d), bfloat16)
    tables, lens = a((batch, width), np.int32), a((batch,), np.int32)
    qp, op_out = a((batch * s, hq, d), bfloat16), a((batch * s, hq, d), bfloat16)
    kp, vp = a((batch * s, hk, d), bfloat16), a((batch * s, hk, d), bfloat16)
    cu = a((batch + 1,), np.int32)
    if op == "paged_decode":
        return lambda: cupaged.paged_decode(q, kc, vc, tables, lens, layout="NHD", out=out), False
    if op == "PagedDecoder.run":
        dec = cupaged.PagedDecoder(hq, hk, d, bs, dtype=bfloat16, layout="NHD", max_batch=8,
                                   xp=cupy).plan(tables, lens)
        return lambda: dec.run(q, kc, vc, out=out), True
    if op == "varlen_prefill":
        return lambda: cupaged.varlen_prefill(qp, kp, vp, cu, cu, s, s, out=op_out), False
    if op == "paged_prefill":
        return lambda: cupaged.paged_prefill(qp, kc, vc, cu, tables, lens, layout="NHD",
                                             out=op_out), False
    if op == "paged_attention":
        return lambda: cupaged.paged_attention(qp, kc, vc, cu, tables, lens, layout="NHD",
                                               out=op_out), False
    if op == "PagedPrefiller.run":  # host metadata: its device form pads on the device
        pre = cupaged.PagedPrefiller(hq, hk, d, bs, dtype=bfloat16, layout="NHD", max_batch=8)
        pre.plan(np.arange(batch + 1, dtype=np.int32) * s,
                 np.arange(batch * width, dtype=np.int32).reshape(batch, width),
                 np.full(batch, length, np.int32))
        return lambda: pre.run(qp, kc, vc, out=op_out), True
    if op == "quest_decode":
        k_min, k_max = (a((batch * width, hk, d), bfloat16) for _ in range(2))
        return lambda: sparse.quest_decode(q, kc, vc, k_min, k_max, tables, lens, 8,
                                           layout="NHD", out=out), False
    tokens = batch * s
    if op == "write_kv_cache":
        key, value, slots = (a((tokens, hk, d), bfloat16), a((tokens, hk, d), bfloat16),
                             a((tokens,), np.int64))
        return lambda: cupaged.write_kv_cache(key, value, kc, vc, slots, layout="NHD"), False
    assert op == "apply_rope"
    pos = a((tokens,), np.int64)
    # the frequency table, made once per device by a host copy, stood in
    from cupaged.rope import api as rope_api
    rope_api._FREQUENCIES.clear()
    fake.patch(rope_api, "frequencies", lambda plan: a((plan.rotary_dim // 2,), np.float64))
    return lambda: cupaged.apply_rope(pos, qp, kp, max_position=8192, inplace=True), False


HOT_OPS = ["paged_decode", "PagedDecoder.run", "varlen_prefill", "paged_prefill",
           "paged_attention", "PagedPrefiller.run", "quest_decode", "write_kv_cache",
           "apply_rope"]


@pytest.mark.parametrize("op", HOT_OPS)
def test_hot_calls_launch_what_the_checked_call_does(fake, op):
    """The first call of a signature is checked and sets up; later calls take the hot path
    and launch the same kernels with the same argument bytes (device arrays only: a host
    read of device data would fail on the stand-in device)."""
    call, plans_first = _hot_op(fake, op)
    first, *later = _calls(fake, call)
    assert first, f"{op}: launched nothing"
    if plans_first:  # the plan kernel runs at the first run after a plan only
        first = [l for l in first if "plan_kernel" not in l[0]]
    for run in later:
        assert [l[0] for l in run] == [l[0] for l in first]
        assert run == first
