"""No public call waits for the device: with a long spin kernel queued first on the
caller's stream, every op (and a whole layer step) returns while the spin still runs, for
CuPy arrays and for torch tensors alike."""
import numpy as np
import pytest

import cupaged
from cupaged import sparse
from cupaged.core.arrays import bfloat16

SPIN_MS = 50


def _spin_cycles(cp):
    return int(SPIN_MS * 1e-3 * cp.cuda.Device().attributes["ClockRate"] * 1e3)


_SPIN = r'''
extern "C" __global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
}
'''


def assert_no_sync_cupy(cp, call):
    """``call()`` returns before a spin queued ahead of it on CuPy's current stream ends."""
    call()  # warm: kernels compiled and loaded, buffers allocated
    stream = cp.cuda.get_current_stream()
    stream.synchronize()
    spin = cp.RawKernel(_SPIN, "spin")
    spin((1,), (1,), (np.int64(_spin_cycles(cp)),))
    call()
    assert not stream.done, "the call waited for the device"
    stream.synchronize()


def assert_no_sync_torch(torch, call):
    call()
    torch.cuda.synchronize()
    torch.cuda._sleep(_spin_cycles(__import__("cupy")))
    call()
    assert not torch.cuda.current_stream().query(), "the call waited for the device"
    torch.cuda.synchronize()


def _paged(rng, xp, lens=(300, 17, 2048, 0, 513), hq=32, hk=8, d=128, bs=16, dtype=bfloat16):
    lens = np.asarray(lens, np.int32)
    need = -(-(lens + 1) // bs)
    nb = int(need.sum()) + 2
    tables = np.full((len(lens), int(need.max()) + 1), -1, np.int32)
    ids = rng.permutation(nb).astype(np.int32)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[start:start + n]
        start += n
    rnd = lambda *s: xp.asarray(rng.standard_normal(s, np.float32).astype(dtype))
    q_lens = np.minimum(lens, 3)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    pinned = __import__("cupyx").empty_pinned((4, bs, hk, d), dtype) if xp is not np else None
    positions = np.concatenate([np.arange(s - n, s) for s, n in zip(lens, q_lens)]).astype(np.int32)
    return dict(q=rnd(len(lens), hq, d), kc=rnd(nb, bs, hk, d), vc=rnd(nb, bs, hk, d),
                lse=xp.asarray(rng.standard_normal((int(cu[-1]), hq), np.float32)),
                pairs=xp.asarray(np.array([[0, 1], [2, 3]], np.int64)), pinned=pinned,
                logits=xp.asarray(rng.standard_normal((2, hq, 5, 77), np.float32)),
                sink=xp.asarray(rng.standard_normal(hq, np.float32)),
                positions=xp.asarray(positions),
                slots_host=np.arange(int(cu[-1]), dtype=np.int64),
                tables=xp.asarray(tables), lens=xp.asarray(lens), cu=xp.asarray(cu),
                qp=rnd(int(cu[-1]), hq, d), kn=rnd(len(lens), hk, d),
                slots=xp.asarray(np.arange(int(cu[-1]), dtype=np.int64)),
                kv=rnd(int(cu[-1]), hk, d), tables_host=tables, lens_host=lens, cu_host=cu,
                # BSR: one 64-row block row per sequence and kv head, keeping key block 0
                bsr_ptr=xp.asarray(np.arange(hk * int((q_lens > 0).sum()) + 1, dtype=np.int32)),
                bsr_idx=xp.asarray(np.zeros(hk * int((q_lens > 0).sum()), np.int32)),
                k8=xp.zeros((nb, bs, hk, d), np.uint8), v8=xp.zeros((nb, bs, hk, d), np.uint8),
                # vertical+slash: a band of 8 diagonals and 4 sink columns, per sequence
                vs_v=xp.asarray(np.tile(np.arange(4, dtype=np.int32), (len(lens), hq, 1))),
                vs_s=xp.asarray(np.tile(np.arange(8, dtype=np.int32), (len(lens), hq, 1))),
                q_lens=xp.asarray(q_lens.astype(np.int32)), max_len=int(lens.max()),
                k_scale=xp.asarray(np.full(hk, 0.05, np.float32)),
                v_scale=xp.asarray(np.array(0.1, np.float32)))


def _calls(c):
    """Every public op on the arrays of ``_paged`` (one module's arrays)."""
    dec_dev = cupaged.PagedDecoder(32, 8, 128, 16, dtype=bfloat16, max_batch=8, layout="NHD")
    dec_host = cupaged.PagedDecoder(32, 8, 128, 16, dtype=bfloat16, max_batch=8,
                                    xp=__import__("cupy"), layout="NHD")
    dec8 = cupaged.PagedDecoder(32, 8, 128, 16, dtype=bfloat16, max_batch=8, layout="NHD",
                                kv_dtype="fp8_e4m3")
    pre = cupaged.PagedPrefiller(32, 8, 128, 16, dtype=bfloat16, layout="NHD")
    pre8 = cupaged.PagedPrefiller(32, 8, 128, 16, dtype=bfloat16, layout="NHD",
                                  kv_dtype="fp8_e4m3")
    pos = c["slots"]
    fp8 = dict(kv_dtype="fp8_e4m3", k_scale=c["k_scale"], v_scale=c["v_scale"])
    return {
        "paged_decode_fp8": lambda: cupaged.paged_decode(c["q"], c["k8"], c["v8"], c["tables"],
                                                         c["lens"], layout="NHD", **fp8),
        "paged_decode_append_fp8": lambda: cupaged.paged_decode(
            c["q"], c["k8"], c["v8"], c["tables"], c["lens"], k_new=c["kn"], v_new=c["kn"],
            layout="NHD", **fp8),
        "write_kv_cache_fp8": lambda: cupaged.write_kv_cache(c["kv"], c["kv"], c["k8"], c["v8"],
                                                             c["slots"], **fp8),
        "decoder_fp8_plan_run": lambda: dec8.plan(c["tables"], c["lens"]).run(
            c["q"], c["k8"], c["v8"], k_scale=c["k_scale"], v_scale=c["v_scale"]),
        "paged_decode": lambda: cupaged.paged_decode(c["q"], c["kc"], c["vc"], c["tables"], c["lens"], layout="NHD"),
        "paged_decode_append": lambda: cupaged.paged_decode(
            c["q"], c["kc"], c["vc"], c["tables"], c["lens"], k_new=c["kn"], v_new=c["kn"], layout="NHD"),
        "paged_attention": lambda: cupaged.paged_attention(c["qp"], c["kc"], c["vc"], c["cu"],
                                                           c["tables"], c["lens"], layout="NHD"),
        "paged_attention_fp8": lambda: cupaged.paged_attention(
            c["qp"], c["k8"], c["v8"], c["cu"], c["tables"], c["lens"], layout="NHD", **fp8),
        "prefiller_fp8_device_plan_run": lambda: pre8.plan(c["cu"], c["tables"], c["lens"]).run(
            c["qp"], c["k8"], c["v8"], k_scale=c["k_scale"], v_scale=c["v_scale"]),
        "varlen_prefill": lambda: cupaged.varlen_prefill(c["qp"], c["kv"], c["kv"], c["cu"], c["cu"]),
        "write_kv_cache": lambda: cupaged.write_kv_cache(c["kv"], c["kv"], c["kc"], c["vc"], c["slots"]),
        "apply_rope": lambda: cupaged.apply_rope(pos, c["qp"], c["kv"], max_position=8192),
        "decoder_device_plan_run": lambda: dec_dev.plan(c["tables"], c["lens"]).run(c["q"], c["kc"], c["vc"]),
        "decoder_host_plan_run": lambda: dec_host.plan(c["tables_host"], c["lens_host"]).run(
            c["q"], c["kc"], c["vc"]),
        "prefiller_host_plan_run": lambda: pre.plan(c["cu_host"], c["tables_host"],
                                                    c["lens_host"]).run(c["qp"], c["kc"], c["vc"]),
        "prefiller_device_plan_run": lambda: pre.plan(c["cu"], c["tables"], c["lens"]).run(
            c["qp"], c["kc"], c["vc"]),
        "merge_states": lambda: cupaged.merge_states(c["qp"], c["lse"], c["qp"], c["lse"]),
        "copy_blocks_host_pairs": lambda: cupaged.copy_blocks(c["kc"], c["vc"], [[0, 1], [2, 3]]),
        "copy_blocks_device_pairs": lambda: cupaged.copy_blocks(c["kc"], c["vc"], c["pairs"]),
        "swap_out_memcpy": lambda: cupaged.swap_blocks(c["kc"], c["pinned"], [[0, 1], [1, 0]],
                                                       method="memcpy"),
        "swap_in_kernel": lambda: cupaged.swap_blocks(c["pinned"], c["kc"], [[0, 1], [1, 0]],
                                                      method="kernel"),
        "sink_softmax": lambda: cupaged.sink_softmax(c["logits"], c["sink"]),
        "sink_attention": lambda: cupaged.sink_attention(c["qp"], c["kv"], c["kv"], c["sink"], -1,
                                                         True, None, qo_indptr=c["cu"],
                                                         kv_indptr=c["cu"]),
        "layer_step": lambda: _layer_step(c),
        "varlen_block_sparse_attention": lambda: cupaged.varlen_block_sparse_attention(
            c["qp"], c["kv"], c["kv"], c["cu"], c["cu"], c["bsr_ptr"], c["bsr_idx"], 64, 64,
            pattern_heads=8),
        "vertical_slash_attention": lambda: sparse.vertical_slash_attention(
            c["qp"], c["kv"], c["kv"], c["vs_v"][0], c["vs_s"][0], validate=False),
        "varlen_vertical_slash_attention": lambda: sparse.vertical_slash_attention(
            c["qp"], c["kv"], c["kv"], c["vs_v"], c["vs_s"], cu_seqlens_q=c["cu"],
            cu_seqlens_k=c["cu"], validate=False),
        "paged_vertical_slash_attention": lambda: sparse.paged_vertical_slash_attention(
            c["qp"], c["kc"], c["vc"], c["vs_v"], c["vs_s"], c["cu"], c["tables"], c["lens"],
            layout="NHD", validate=False),
        "vertical_slash_index": lambda: sparse.vertical_slash_index(
            c["q_lens"], c["vs_v"], c["vs_s"], 64, kv_seqlens=c["lens"], max_kv_len=c["max_len"]),
        "paged_block_sparse_attention": lambda: cupaged.paged_block_sparse_attention(
            c["qp"], c["kc"], c["vc"], c["cu"], c["tables"], c["lens"], c["bsr_ptr"], c["bsr_idx"],
            64, 64, pattern_heads=8, layout="NHD"),
    }


def _layer_step(c):
    """A whole step of two RoPE layers: the step's metadata from host arrays (uploaded once)
    and each layer's rotation, cache write and attention."""
    meta = cupaged.layers.AttentionMetadata(c["cu_host"], c["lens_host"], c["tables_host"],
                                            c["slots_host"], xp=__import__("cupy"))
    layer = cupaged.layers.PagedAttentionWithRoPE(32, 128, 128 ** -0.5, 128, num_kv_heads=8)
    n = c["qp"].shape[0]
    q, k = c["qp"].reshape(n, -1), c["kv"].reshape(n, -1)
    for _ in range(2):
        layer(c["positions"], q, k, k, c["kc"], c["vc"], meta)


NAMES = ["paged_decode", "paged_decode_append", "paged_attention", "paged_attention_fp8",
         "prefiller_fp8_device_plan_run", "varlen_prefill",
         "write_kv_cache", "apply_rope", "decoder_device_plan_run", "decoder_host_plan_run",
         "prefiller_host_plan_run", "prefiller_device_plan_run", "merge_states",
         "copy_blocks_host_pairs", "copy_blocks_device_pairs", "swap_out_memcpy",
         "swap_in_kernel", "sink_softmax", "sink_attention", "layer_step",
         "varlen_block_sparse_attention", "paged_block_sparse_attention",
         "vertical_slash_attention", "varlen_vertical_slash_attention",
         "paged_vertical_slash_attention", "vertical_slash_index", "paged_decode_fp8",
         "paged_decode_append_fp8", "write_kv_cache_fp8", "decoder_fp8_plan_run"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_cupy_calls_do_not_sync(rng, cp, name):
    c = _paged(rng, cp)
    assert_no_sync_cupy(cp, _calls(c)[name])
    cupaged.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_torch_calls_do_not_sync(rng, cp, name):
    torch = pytest.importorskip("torch")
    c = _paged(rng, cp)
    t = {n: (torch.from_dlpack(a) if isinstance(a, cp.ndarray) else a) for n, a in c.items()}
    assert_no_sync_torch(torch, _calls(t)[name])
    cupaged.check_errors()
