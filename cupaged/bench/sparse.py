"""Benchmark of vertical+slash sparse prefill (MInference) against dense causal prefill.

One row per (S, inputs, budget): S 32K (``--quick``), else 32K and 128K (512K with
``--long``: minutes, kept out of the default run); Hq 32, Hk 8, d 128, bf16; budgets
``fixed 1000/6096`` (the contract's sizes, issue 22's figures) and, on the structured inputs,
``adaptive 0.3`` (the ``MInferencePolicy`` default: ``0.06 S`` verticals and ``0.24 S``
slashes, so at least ~42% of the causal pairs at any length). ``inputs``: ``structured``
(below) or ``random`` (standard normal q/k/v: scattered top diagonals, a pattern that keeps
most blocks; the case where sparse must not be slower than dense).

Inputs are structured like the attention of a language model rather than random: relative
to a query at ``p``, key ``j`` scores ``-(j - p) / 2900`` nats (a linear recency bias with
a half-life of ~2000 tokens, the form of ALiBi, encoded exactly in bf16 as base-128 digits
of the positions), plus noise of ~0.5 nats; the first 4 keys are attention sinks (+6.5 nats
over the most recent key, whatever the distance) and 16 random keys per kv head are heavy
"landmark" columns (+4 nats). The estimate then picks the nearest diagonals (one contiguous
band) plus the sink and landmark columns, as it does on real models; random q/k would give
scattered diagonals, each costing a 64-wide band.

Columns: ``est_ms`` (pattern estimate), ``index_ms`` (``bsr_prepare``'s schedule, the sort,
run preparation with the dense decision and the tile lists of ``sparse.tiles``: device work
only, no host sync; one head group), ``kernel_ms`` (the sparse kernel the op takes: wgmma
on sm_90), ``mma_kernel_ms`` (the mma.sync sparse kernel on the same lists),
``sparse_ms`` (estimate, index and ``kernel_ms``), ``est_share`` (estimate over
``sparse_ms``), ``op_ms`` (the public ``vertical_slash_attention`` with its argument checks,
plus the estimate), ``dense_ms`` (our ``varlen_prefill``, causal, default backend: the wgmma
kernel on sm_90) and ``vs_dense`` (dense over ``sparse_ms``; issue 7's goal: >= 5 at 128K
with the contract's budget), ``mma_ms`` (the same with the mma.sync kernel, whose tile core
the mma.sync sparse kernel shares), ``cudnn_ms`` / ``vs_cudnn`` (torch SDPA cuDNN, GQA; the
same run; issue 22's goal: >= 6 at 128K), ``diag_frac`` (slashes kept over S), ``kept``
(the kept fraction: pairs the kernel computes, whole tiles, over the causal pairs, the
dense fallback's heads included; printed beside every figure), ``dense_frac`` (the share of
heads whose pattern keeps more than ``sparse.DENSE_THRESHOLD`` of their causal blocks: they
run every causal tile), ``pair_ratio`` (pairs per second of the sparse kernel over the
default dense kernel's causal pairs per second: its efficiency per computed pair, ~1 when
the inner loops match) and ``mma_pair_ratio`` (the mma.sync sparse kernel against the
mma.sync dense one), ``mass`` (share of the causal softmax mass the pattern keeps, last
query block of heads 0-3) and ``checked`` (the kernel's rows there against a float32
recomputation).

Batched BSR rows (``budget`` "bsr"): ``varlen_block_sparse_attention`` over B 4 x S 8K
(random q/k/v, same heads and dtype), 64 x 64 blocks, one pattern per kv head keeping the
diagonal block of every block row and random causal blocks besides, beside dense causal
``varlen_prefill`` of the same batch: ``kept`` (kept blocks over the causal blocks),
``bsr_ms`` (the public op: checks, ``bsr_prepare`` and the kernel "auto" takes),
``bsr_mma_ms`` (the same with ``backend="mma"``: 64-row CTAs), ``bsr_wgmma_ms``
(``backend="wgmma"``, sm_90 only, else empty: 128-row CTAs whose halves compute apart,
64-key tiles),
``bsr128_ms`` (the mma.sync launches on 128-row CTAs, whose
two halves are two block rows), ``dense_ms``, ``mma_ms``, ``vs_dense`` (dense over
``bsr_ms``), ``block_ratio`` (kept blocks per second over the default dense kernel's causal
blocks per second; issue 22's goal: >= 0.8), ``mma_block_ratio`` (mma.sync against
mma.sync) and ``busy`` (the share of the (tile, 64-row half) slots that compute on 128-row
CTAs: random rows share few blocks, so on one mma.sync CTA those halves wait for each
other; ``bsr128_ms`` is bounded by it, 64-row CTAs are not, at twice the shared-memory
reads per computed block).
Quest decode rows (``budget`` "quest <layout> <bounds dtype>", float32 and bfloat16 bounds
for each layout): B 32 x 32K keys keeping the top 64 pages (``kept`` 1/32 of them) per
(sequence, kv head), and B 8 x 128K keeping 256 (4096 keys, issue 22's budget; not with
``--quick``); Hq 32 / Hk 8, d 128, bf16, pages of 16, ``QuestDecoder`` on random q/k/v:
``bounds_ms`` (every page's bounds, once per prefill), ``bounds_last_ms`` (the last pages: once
per step and layer), ``select_ms`` (scores and top-k alone), ``quest_ms`` (``run``: select and decode), ``dense_ms`` (dense
``paged_decode`` of the same batch), ``vs_dense`` (dense over ``quest_ms``),
``step_vs_dense`` (dense over ``quest_ms + bounds_last_ms``) and ``checked`` (a Quest decoder
keeping every page against dense, relative error < 1e-2).
Run: ``python -m cupaged.bench.sparse [--quick] [--long] [--quest]`` (``--quest``: the Quest
rows alone; ``--long``: 512K as well).
"""
from __future__ import annotations

import sys

import numpy as np

from ..core.arrays import bfloat16
from ..reference import sparse as ref
from .timing import bench_main, time_gpu, torch_or_none

HQ, HK, D = 32, 8, 128
BUDGETS = {"adaptive 0.3": dict(vertical_size=1000, slash_size=6096, adaptive_budget=0.3),
           "fixed 1000/6096": dict(vertical_size=1000, slash_size=6096, adaptive_budget=None)}
PROBE_HEADS = 4
PLACES = (1 << 14, 1 << 7, 1)      # base-128 digits of positions < 2^21
RECENCY = 2.0 ** -8                # query weight of the key digits: sm_scale * 2^-8 nats / token
SINKS, LANDMARKS = 4, 16
SINK_BOOST, LANDMARK_BOOST = 6.5, 4.0
NOISE = 0.7                        # std of the other 121 dims of q and k (~0.5 nats of score)


def _digits(pos):
    import cupy
    return cupy.stack([pos // p % 128 for p in PLACES], axis=-1).astype(cupy.float32)


def _inputs(seqlen, seed=0):
    """bf16 q [S, HQ, D], k and v [S, HK, D] with the structure of the module docstring.

    Dims 0-2: the key's position digits (q: RECENCY * place values), so q.k = RECENCY * j;
    sinks and landmarks instead carry the place values in dims 3-5, where q holds
    RECENCY * its position's digits, so they score RECENCY * p like the most recent key, plus
    their boost from dim 6; every product is exact in bf16. The other dims are noise.
    """
    import cupy
    rs = cupy.random.RandomState(seed)
    scale = D ** 0.5                                # undo sm_scale: boosts in nats
    pos = cupy.arange(seqlen)
    q = rs.standard_normal((seqlen, HQ, D), dtype=cupy.float32) * NOISE
    k = rs.standard_normal((seqlen, HK, D), dtype=cupy.float32) * NOISE
    places = cupy.asarray(PLACES, dtype=cupy.float32)
    q[:, :, 0:3] = RECENCY * places
    k[:, :, 0:3] = _digits(pos)[:, None, :]
    q[:, :, 3:6] = RECENCY * _digits(pos)[:, None, :]
    q[:, :, 6] = 4.0
    special = cupy.zeros((seqlen, HK), cupy.float32)
    special[:SINKS] = SINK_BOOST
    for h in range(HK):
        special[rs.permutation(seqlen - SINKS)[:LANDMARKS] + SINKS, h] = LANDMARK_BOOST
    is_special = (special > 0)[:, :, None]
    k[:, :, 0:3] = cupy.where(is_special, 0.0, k[:, :, 0:3])
    k[:, :, 3:6] = cupy.where(is_special, places, 0.0)
    k[:, :, 6] = special * scale / 4.0
    v = rs.standard_normal((seqlen, HK, D), dtype=cupy.float32)
    return q.astype(bfloat16), k.astype(bfloat16), v.astype(bfloat16)


def _split_times(q, k, v, v_idx, s_idx, reps, wgmma):
    """Median (index seconds, kernel seconds), computed pairs, the heads that run dense (host
    bool ``[Hq]``) and the output of the op's steps, with a list budget of one head group;
    ``wgmma``: the sm_90a attention kernel, else the mma.sync one."""
    import cupy
    from ..core.checks import check_options
    from ..sparse import attention as sa, index, launch as kernels, tiles
    n = q.shape[0]
    batch = sa.Batch(HQ, HK, D, 1, n)
    cu = cupy.asarray([0, n], dtype=np.int32)
    kv, opts, out = kernels.dense_kv(k, v, cu), check_options(cupy, HQ, D), cupy.empty_like(q)
    attn = kernels.attention_launch(q.dtype, D, wgmma=wgmma, ragged=True)
    tile_n = attn.tile_n
    cta_bound = -(-n // kernels.CTA_ROWS) + 1
    budget = HQ * cta_bound * tiles.TILE_BYTES * tiles.list_bound(
        n, v_idx.shape[1], s_idx.shape[1], 64, tile_n)
    runs = []
    for _ in range(reps):
        a, b, c = cupy.cuda.Event(), cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        meta, cta_bound, err = kernels.schedule(q, out, None, cu, kv, None, n, kernels.CTA_ROWS)
        prep = index.prepare(v_idx[None], s_idx[None], meta[1:], 64, q_lens=meta[3:],
                             len_stride=4, dense_threshold=sa.DENSE_THRESHOLD, err=err)
        (lists,) = tiles.vs_lists(prep, prep.dense, meta, 1, cta_bound, n, 64, tile_n, budget)
        b.record()
        sa.launch(q, kv, out, None, cu, meta, batch, cta_bound, lists, opts, attn)
        c.record()
        c.synchronize()
        runs.append((cupy.cuda.get_elapsed_time(a, b) * 1e-3, cupy.cuda.get_elapsed_time(b, c) * 1e-3))
    pairs = tiles.computed_pairs(lists, cta_bound)
    t_index, t_kernel = (float(np.median([r[i] for r in runs])) for i in range(2))
    return t_index, t_kernel, pairs, prep.dense.get()[0].astype(bool), out


def _probe(q, k, v, out, v_idx, s_idx, dense):
    """(mass kept, output close) on the last query block of heads 0-3 (every causal key of
    the heads that run dense)."""
    import cupy
    n = q.shape[0]
    end = -(-n // 64) * 64                      # the last query block is rows [end - 64, n)
    rows = cupy.arange(end - 64, n)
    masses, ok = [], True
    for h in range(PROBE_HEADS):
        blocks = ref.slash_blocks(s_idx[h].get(), end, n, 64, 64)
        cols = ref.vertical_columns(v_idx[h].get(), blocks, end, n, 64)
        covered = cupy.full(n + 64, bool(dense[h]))
        for st in blocks:
            covered[st:st + 64] = True
        covered[cupy.asarray(cols, dtype=np.int64)] = True
        kh = k[:, h // (HQ // HK)].astype(cupy.float32)
        s = (q[rows, h].astype(cupy.float32) @ kh.T) * D ** -0.5          # [64, n]
        causal = cupy.arange(n)[None, :] <= rows[:, None]
        p = cupy.exp(s - s.max(axis=1, keepdims=True)) * causal
        keep = p * covered[None, :n]
        masses.append(float((keep.sum(axis=1) / p.sum(axis=1)).mean()))
        want = keep @ v[:, h // (HQ // HK)].astype(cupy.float32) / keep.sum(axis=1, keepdims=True)
        got = out[rows, h].astype(cupy.float32)
        ok &= float(cupy.linalg.norm(got - want) / cupy.linalg.norm(want)) < 2e-2
    return float(np.mean(masses)), bool(ok)


def _dense_seconds(q, k, v, reps, backend="auto"):
    import cupaged
    import cupy
    cu = cupy.asarray([0, q.shape[0]], dtype=np.int32)
    return time_gpu(lambda: cupaged.varlen_prefill(q, k, v, cu, cu, causal=True, backend=backend),
                    warmup=1, reps=reps)


def _cudnn_seconds(q, k, v, reps):
    torch = torch_or_none()
    if torch is None:
        return None
    try:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        tq, tk, tv = (torch.from_dlpack(x).permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return time_gpu(lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=True,
                                                                   enable_gqa=True),
                            warmup=1, reps=reps)
    except Exception:
        return None


def _ratio(a, b):
    return None if a is None or b is None else a / b


def _random_inputs(seqlen, seed=0):
    """bf16 standard normal q [S, HQ, D], k and v [S, HK, D]."""
    import cupy
    rs = cupy.random.RandomState(seed)
    return tuple(rs.standard_normal((seqlen, h, D), dtype=cupy.float32).astype(bfloat16)
                 for h in (HQ, HK, HK))


INPUTS = {"structured": _inputs, "random": _random_inputs}


def bench_length(seqlen, budgets, reps, inputs="structured"):
    """Rows of one sequence length and kind of inputs, one per budget."""
    from .. import sparse
    from ..sparse import launch as kernels
    q, k, v = INPUTS[inputs](seqlen)
    dense = _dense_seconds(q, k, v, reps)
    dense_mma = _dense_seconds(q, k, v, reps, backend="mma")
    cudnn = _cudnn_seconds(q, k, v, reps)
    causal_pairs = HQ * seqlen * (seqlen + 1) // 2
    rows = []
    for label in budgets:
        opts = BUDGETS[label]
        est = time_gpu(lambda: sparse.estimate_vertical_slash(q, k, **opts), warmup=1, reps=reps)
        v_idx, s_idx = sparse.estimate_vertical_slash(q, k, **opts)
        op = time_gpu(lambda: sparse.vertical_slash_attention(q, k, v, v_idx, s_idx), warmup=1,
                      reps=reps)
        wgmma = kernels.use_wgmma("auto", "sparse_attention", D, True)
        t_index, t_kernel, pairs, dense_heads, out = _split_times(q, k, v, v_idx, s_idx, reps,
                                                                  wgmma)
        mass, ok = _probe(q, k, v, out, v_idx, s_idx, dense_heads)
        t_mma_kernel, mma_pairs = (_split_times(q, k, v, v_idx, s_idx, reps, False)[1:3]
                                   if wgmma else (t_kernel, pairs))
        total = est + t_index + t_kernel
        rows.append(dict(
            S=seqlen, inputs=inputs, budget=label, nv=v_idx.shape[1], ns=s_idx.shape[1],
            diag_frac=s_idx.shape[1] / seqlen, est_ms=est * 1e3, index_ms=t_index * 1e3,
            kernel_ms=t_kernel * 1e3, sparse_ms=total * 1e3, est_share=est / total,
            op_ms=(est + op) * 1e3,
            dense_ms=dense * 1e3, vs_dense=dense / total, mma_ms=dense_mma * 1e3,
            cudnn_ms=None if cudnn is None else cudnn * 1e3, vs_cudnn=_ratio(cudnn, total),
            kept=pairs / causal_pairs, dense_frac=float(dense_heads.mean()),
            pair_ratio=(pairs / t_kernel) / (causal_pairs / dense),
            mma_kernel_ms=t_mma_kernel * 1e3,
            mma_pair_ratio=(mma_pairs / t_mma_kernel) / (causal_pairs / dense_mma),
            mass=mass, checked=ok))
    return rows


BSR_BATCH, BSR_LEN, BSR_BLOCK = 4, 8192, 64
BSR_KEEP = (0.1, 0.5)              # target kept fraction of the causal blocks


def bsr_pattern(rng, batch, seqlen, block, heads, keep):
    """int32 ``(indptr, indices)`` keeping, in every (sequence, pattern head) block row ``r``,
    block ``r`` and each earlier block with probability ``(keep (r + 1) - 1) / r``; the kept
    fraction of the causal blocks; and the share of the kernel's (tile, half) slots that
    compute (``block`` 64: a CTA's two halves are block rows 2c and 2c + 1, each tile of
    their union loaded once and computed by the halves that keep it)."""
    rows = -(-seqlen // block)
    counts, indices, union = [], [], 0
    for _ in range(batch * heads):
        prev = set()
        for r in range(rows):
            p = (keep * (r + 1) - 1) / r if r else 0.0
            kept = np.flatnonzero(rng.random(r) < p).tolist() + [r]
            indices += kept
            counts.append(len(kept))
            union += len(prev | set(kept)) if r % 2 else 0
            prev = set(kept) if r % 2 == 0 else set()
        union += len(prev)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    kept = len(indices) / (batch * heads * rows * (rows + 1) / 2)
    return indptr, np.asarray(indices, np.int32), kept, len(indices) / (2 * union)


def bench_bsr(keep, reps):
    """One batched BSR row: B 4 x 8K, per-kv-head pattern keeping ~``keep`` of the causal
    blocks, beside dense causal prefill of the same batch."""
    import cupaged
    import cupy
    rs = cupy.random.RandomState(1)
    total = BSR_BATCH * BSR_LEN
    q = rs.standard_normal((total, HQ, D), dtype=cupy.float32).astype(bfloat16)
    k, v = (rs.standard_normal((total, HK, D), dtype=cupy.float32).astype(bfloat16) for _ in range(2))
    cu = cupy.arange(0, total + 1, BSR_LEN, dtype=np.int32)
    indptr, indices, kept, busy = bsr_pattern(np.random.default_rng(0), BSR_BATCH, BSR_LEN,
                                              BSR_BLOCK, HK, keep)
    indptr, indices = cupy.asarray(indptr), cupy.asarray(indices)
    out = cupy.empty_like(q)
    hopper = cupy.cuda.Device().compute_capability == "90"
    t_bsr, t_bsr_mma, t_bsr_wgmma = (time_gpu(lambda: cupaged.varlen_block_sparse_attention(
        q, k, v, cu, cu, indptr, indices, BSR_BLOCK, BSR_BLOCK, pattern_heads=HK, out=out,
        backend=b), warmup=1, reps=reps) if b != "wgmma" or hopper else None
        for b in ("auto", "mma", "wgmma"))
    # the same pattern on 128-row CTAs (two block rows a CTA) instead of the op's 64
    from ..core.checks import check_options
    from ..sparse import bsr, launch as kernels
    pattern = bsr.Pattern(indptr, indices, BSR_BLOCK, BSR_BLOCK, HK)
    t_128 = time_gpu(lambda: bsr._launch(q, kernels.dense_kv(k, v, cu), HK, cu, None, total,
                                         pattern, check_options(cupy, HQ, D), True, out, None,
                                         rows=kernels.CTA_ROWS), warmup=1, reps=reps)
    t_dense, t_mma = (time_gpu(lambda: cupaged.varlen_prefill(q, k, v, cu, cu, causal=True,
                                                              backend=b), warmup=1, reps=reps)
                      for b in ("auto", "mma"))
    return dict(S=BSR_LEN, budget="bsr", B=BSR_BATCH, kept=kept, busy=busy, bsr_ms=t_bsr * 1e3,
                bsr_mma_ms=t_bsr_mma * 1e3,
                bsr_wgmma_ms=t_bsr_wgmma * 1e3 if t_bsr_wgmma is not None else None,
                bsr128_ms=t_128 * 1e3, dense_ms=t_dense * 1e3,
                mma_ms=t_mma * 1e3, vs_dense=t_dense / t_bsr,
                block_ratio=(kept / t_bsr) / (1 / t_dense),
                mma_block_ratio=(kept / t_bsr_mma) / (1 / t_mma))


QUEST_PAGE = 16
# (batch, keys per sequence, pages kept per (sequence, kv head)): 64 pages of 16 is 1/32 of
# 32K keys; 256 pages is issue 22's budget of 4096 keys at 128K
QUEST_SHAPES = ((32, 32768, 64), (8, 131072, 256))
QUEST_LAYOUTS = ("NHD", "HND", "vllm")


def bench_quest(layout, batch, seq_len, top_k, reps):
    """Quest decode rows of one layout and shape (float32, bfloat16 and e4m3 bounds): ``batch``
    sequences of ``seq_len`` keys, ``top_k`` pages of 16 per (sequence, kv head), beside
    dense ``paged_decode`` of the same cache and batch."""
    import cupaged
    import cupy
    from ..core.layouts import cache_shapes
    from ..sparse import QuestDecoder, quest
    rs = cupy.random.RandomState(2)
    pages = seq_len // QUEST_PAGE
    nb = batch * pages
    k_shape, v_shape = cache_shapes(layout, nb, QUEST_PAGE, HK, D, bfloat16)
    k = rs.standard_normal(k_shape, dtype=cupy.float32).astype(bfloat16)
    v = rs.standard_normal(v_shape, dtype=cupy.float32).astype(bfloat16)
    q = rs.standard_normal((batch, HQ, D), dtype=cupy.float32).astype(bfloat16)
    tables = rs.permutation(nb).astype(np.int32).reshape(batch, pages)
    lens = cupy.full(batch, seq_len, np.int32)
    out = cupy.empty_like(q)
    t_dense = time_gpu(lambda: cupaged.paged_decode(q, k, v, tables, lens, layout=layout,
                                                    out=out), reps=reps)
    want = cupaged.paged_decode(q, k, v, tables, lens, layout=layout).astype(cupy.float32)
    rows = []
    for bounds in quest.BOUND_NAMES:
        k_min, k_max = quest.empty_bounds((nb, HK, D), bounds, cupy)
        dec = QuestDecoder(HQ, HK, D, QUEST_PAGE, top_k, dtype=bfloat16, layout=layout,
                           max_batch=batch).plan(tables, lens)
        t_bounds = time_gpu(lambda: dec.update_bounds(k, k_min, k_max, last_page_only=False),
                            warmup=1, reps=reps)
        t_last = time_gpu(lambda: dec.update_bounds(k, k_min, k_max), reps=reps)
        dec.run(q, k, v, k_min, k_max, out=out)
        t_select = time_gpu(lambda: quest.select_pages(
            q, k_min, k_max, tables, lens, QUEST_PAGE, top_k,
            tokens_per_page=dec.tokens_per_page, out=dec.selection), reps=reps)
        t_quest = time_gpu(lambda: dec.run(q, k, v, k_min, k_max, out=out), reps=reps)
        # every page kept: the Quest path must give dense attention
        full = QuestDecoder(HQ, HK, D, QUEST_PAGE, pages, dtype=bfloat16, layout=layout,
                            max_batch=batch).plan(tables, lens)
        got = full.run(q, k, v, k_min, k_max).astype(cupy.float32)
        err = float(cupy.linalg.norm(got - want) / cupy.linalg.norm(want))
        rows.append(dict(
            S=seq_len, budget=f"quest {layout} {bounds}", B=batch,
            kept=top_k / pages, bounds_ms=t_bounds * 1e3, bounds_last_ms=t_last * 1e3,
            select_ms=t_select * 1e3, quest_ms=t_quest * 1e3, dense_ms=t_dense * 1e3,
            vs_dense=t_dense / t_quest, step_vs_dense=t_dense / (t_quest + t_last),
            checked=err < 1e-2))
        del dec, full, k_min, k_max
    return rows


def run_quest(quick=False):
    """The Quest rows alone: two per layout and shape (the first shape alone with
    ``quick``)."""
    shapes = QUEST_SHAPES[:1] if quick else QUEST_SHAPES
    return [row for shape in shapes for layout in QUEST_LAYOUTS
            for row in bench_quest(layout, *shape, reps=5 if quick else 20)]


LONG = 524288                      # --long only


def run(quick=False, long=False):
    """Rows for S 32K (quick) or 32K and 128K (and 512K with ``long``): each budget on the
    structured inputs, the fixed budget on random ones; then the batched BSR rows and the
    Quest decode rows."""
    rows = []
    lengths = (32768,) if quick else (32768, 131072) + ((LONG,) if long else ())
    for seqlen in lengths:
        reps = 3 if seqlen <= 131072 else 1
        rows += bench_length(seqlen, list(BUDGETS), reps)
        rows += bench_length(seqlen, ["fixed 1000/6096"], reps, inputs="random")
    rows += [bench_bsr(keep, reps=3 if quick else 10) for keep in BSR_KEEP]
    return rows + run_quest(quick)


COLUMNS = ["S", "inputs", "budget", "nv", "ns", "diag_frac", "kept", "est_ms", "index_ms",
           "kernel_ms", "sparse_ms", "est_share", "op_ms", "dense_ms", "vs_dense", "mma_ms",
           "cudnn_ms", "vs_cudnn", "pair_ratio", "mma_kernel_ms", "mma_pair_ratio", "mass",
           "checked", "B", "busy", "bsr_ms", "bsr_mma_ms", "bsr_wgmma_ms", "bsr128_ms",
           "block_ratio", "mma_block_ratio", "bounds_ms", "bounds_last_ms", "select_ms", "quest_ms", "step_vs_dense"]


def main(argv=None):
    """``--quest``: the Quest rows alone; ``--long``: also S 512K."""
    argv = sys.argv[1:] if argv is None else argv
    long = "--long" in argv
    bench_main(run_quest if "--quest" in argv else lambda quick: run(quick, long), argv, COLUMNS)


if __name__ == "__main__":
    main()
