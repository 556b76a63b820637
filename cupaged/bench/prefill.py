"""Benchmark of prefill attention: TFLOP/s beside torch SDPA (flash, cuDNN) in the same run.

Rows (bf16, H 32 query and kv heads unless said otherwise):

- ``varlen``: ``varlen_prefill`` on equal lengths, causal and not, d 64 / 128 / 256 and
  S 512 .. 32K (batch chosen so each row has about 16K-32K tokens); ``flash_TFLOPs`` and
  ``cudnn_TFLOPs`` are torch SDPA on the same [B, H, S, D] problem (None without torch, or
  when the backend refuses it), ``vs_flash`` / ``vs_cudnn`` the ratios.
- ``headline mt=1``: the headline shape on the other tile config of the kernel (8 warps
  of 16 rows instead of 4 warps of 32), to choose the default from measurements.
- ``varlen mixed``: one ragged batch of very different lengths (1 .. 16K).
- ``paged``: the same problems through ``PagedPrefiller`` on an NHD cache of page 16 with
  shuffled blocks; ``vs_ragged`` is its speed relative to the ragged row (goal >= 0.9).

Causal flops count the visible (query, key) pairs: 2 * B * H * S * S * D for equal lengths.
``ms`` times the kernel launch alone (plan built once); ``public_ms`` the public call with
its host checks. Every timed configuration is checked against the float64 reference on the
last 16 queries of sequence 0. Run: ``python -m cupaged.bench.prefill [--quick]``.
"""
from __future__ import annotations

import sys

import numpy as np

from .._arrays import bfloat16
from ..reference import attention as aref
from .timing import format_table, time_gpu, torch_or_none

H = 32


def _random(shape, seed):
    import cupy
    rng = np.random.default_rng(seed)
    return cupy.asarray(rng.standard_normal(shape, np.float32).astype(bfloat16))


def _flops(q_lens, kv_lens, head_dim, causal):
    pairs = 0
    for s, n in zip(q_lens, kv_lens):
        full = s * n
        pairs += full if not causal else full - s * (s - 1) // 2 if n >= s else n * (n + 1) // 2
    return 4 * H * head_dim * pairs


def _check(out, q, k, v, cu, causal):
    """Last 16 queries of sequence 0 against the reference."""
    end = int(cu[1])
    rows = slice(max(0, end - 16), end)
    want, _ = aref.attend(q[rows].get(), k[:end].get(), v[:end].get(), causal=causal)
    got = np.asarray(out[rows].get(), np.float64)
    return bool(np.linalg.norm(got - want) <= 2e-2 * np.linalg.norm(want))


# ----------------------------------------------------------------------------- peers
def _sdpa(batch, seqlen, head_dim, causal, backend):
    """Seconds of torch SDPA restricted to ``backend`` on [B, H, S, D] bf16, or None."""
    torch = torch_or_none()
    if torch is None:
        return None
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import torch.nn.functional as F
        q, k, v = (torch.randn(batch, H, seqlen, head_dim, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            return time_gpu(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    except Exception:
        return None


# ----------------------------------------------------------------------------- ours
def _ragged_inputs(q_lens, head_dim, seed=0):
    import cupy
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q, k, v = (_random((int(cu[-1]), H, head_dim), seed + i) for i in range(3))
    return q, k, v, cu, cupy.asarray(cu)


def _ragged_launcher(q, k, v, cu_host, cu_dev, causal, mt=None):
    """Launch-only closure of varlen_prefill with its work list built once."""
    import cupy
    from .. import prefill, prefill_plan
    from .._checks import check_options
    lens = np.diff(cu_host)
    work = cupy.asarray(prefill_plan.work_list(lens, lens, group=1, num_kv_heads=H,
                                               head_dim=q.shape[2], causal=causal, window_left=-1))
    opts = check_options(cupy, H, q.shape[2])
    strides = prefill_plan.kv_strides("ragged", 1, H, q.shape[2], q.dtype)
    out = cupy.empty_like(q)

    def launch():
        prefill._launch(q, k, v, out, None, work, cu_dev, cu_dev, None, 1, strides, opts,
                        causal, False, H, mt=mt)
        return out
    return launch


def _paged_launcher(q, k, v, cu_host, causal, block_size=16):
    """PagedPrefiller.run over an NHD cache holding k/v in shuffled pages."""
    import cupy
    import cupaged
    lens = np.diff(cu_host)
    need = -(-lens // block_size)
    ids = np.random.default_rng(1).permutation(int(need.sum())).astype(np.int32)
    tables = np.full((len(lens), int(need.max())), -1, np.int32)
    slots = []
    for b, first in enumerate(np.cumsum(need) - need):
        tables[b, :need[b]] = ids[first:first + need[b]]
        t = np.arange(lens[b])
        slots.append(tables[b, t // block_size].astype(np.int64) * block_size + t % block_size)
    slots = cupy.asarray(np.concatenate(slots))
    shape = (int(need.sum()), block_size, H, q.shape[2])
    kc, vc = cupy.zeros(shape, q.dtype), cupy.zeros(shape, q.dtype)
    kc.reshape(-1, H, q.shape[2])[slots] = k
    vc.reshape(-1, H, q.shape[2])[slots] = v
    pre = cupaged.PagedPrefiller(H, H, q.shape[2], block_size, dtype=q.dtype, causal=causal)
    pre.plan(cu_host, tables, lens.astype(np.int32))
    out = cupy.empty_like(q)
    return lambda: pre.run(q, kc, vc, out=out)


def bench_case(q_lens, head_dim, causal, label, peers=True, paged=True, mt=None):
    """Rows for one batch: ragged (with peers for equal lengths), then paged page 16.

    ``mt`` picks a non-default tile config (m-tiles per warp) of the ragged kernel.
    """
    from .. import prefill
    q, k, v, cu_host, cu_dev = _ragged_inputs(q_lens, head_dim)
    flops = _flops(q_lens, q_lens, head_dim, causal)
    launch = _ragged_launcher(q, k, v, cu_host, cu_dev, causal, mt)
    ok = _check(launch(), q, k, v, cu_host, causal)
    seconds = time_gpu(launch)
    public = time_gpu(lambda: prefill.varlen_prefill(q, k, v, cu_dev, cu_dev, causal=causal), reps=5)
    equal = len(set(q_lens)) == 1
    shape = (f"B{len(q_lens)} S{q_lens[0]}" if equal else f"B{len(q_lens)} T{int(cu_host[-1])}") \
        + f" H{H} d{head_dim} {'causal' if causal else 'full'}"
    row = dict(op="varlen", variant=label, shape=shape, ms=seconds * 1e3, public_ms=public * 1e3,
               TFLOPs=flops / seconds / 1e12, checked=ok)
    if peers and equal:
        for name, backend in (("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION")):
            t = _sdpa(len(q_lens), q_lens[0], head_dim, causal, backend)
            row[f"{name}_TFLOPs"] = None if t is None else flops / t / 1e12
            row[f"vs_{name}"] = None if t is None else t / seconds
    rows = [row]
    if paged:
        run = _paged_launcher(q, k, v, cu_host, causal)
        ok = _check(run(), q, k, v, cu_host, causal)
        t = time_gpu(run)
        rows.append(dict(op="paged", variant=label + " page16", shape=shape, ms=t * 1e3,
                         TFLOPs=flops / t / 1e12, vs_ragged=seconds / t, checked=ok))
    del q, k, v
    return rows


def run(quick=False):
    """All rows; ``quick`` keeps the headline shape and a few others."""
    rows = bench_case([8192] * 2, 128, True, "headline")
    rows += bench_case([8192] * 2, 128, True, "headline mt=1", peers=False, paged=False, mt=1)
    rows += bench_case([8192] * 2, 128, False, "headline", paged=not quick)
    cases = [(s, d, c) for s in ((512, 4096) if quick else (512, 2048, 8192, 32768))
             for d in ((128,) if quick else (64, 128, 256)) for c in (True,)]
    for s, d, c in cases:
        if (s, d) != (8192, 128):
            rows += bench_case([s] * max(1, 16384 // s), d, c, "sweep", paged=s == 2048)
    mixed = [16384, 1, 700, 5000, 33, 3000, 128, 9000, 1, 250] if not quick else [4096, 1, 700, 33]
    rows += bench_case(mixed, 128, True, "mixed", peers=False)
    return rows


COLUMNS = ["op", "variant", "shape", "ms", "public_ms", "TFLOPs", "flash_TFLOPs", "cudnn_TFLOPs",
           "vs_flash", "vs_cudnn", "vs_ragged", "checked"]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    print(format_table(run(quick="--quick" in argv), COLUMNS))


if __name__ == "__main__":
    main()
