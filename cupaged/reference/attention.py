"""Reference attention: the specification every attention kernel is tested against.

Everything is computed in float64 straight from the math of docs/design.md; inputs are NumPy
arrays already validated by the public ops. For one sequence with ``q_len`` queries and
``kv_len`` keys, query ``i`` sits at absolute position ``p = kv_len - q_len + i``
(bottom-right alignment, with or without ``causal``) and its score against key ``j`` is
built in this order:

1. ``s = sm_scale * q_i . k_j`` (``sm_scale`` defaults to ``head_dim ** -0.5``);
2. soft-cap, if ``logits_soft_cap = c > 0``: ``s = c * tanh(s / c)``;
3. ALiBi, if ``alibi_slopes`` is given: ``s += slope_h * (j - p)``;
4. mask: key ``j`` is visible iff ``j <= p`` (when ``causal``) and ``j >= p - w`` (when
   ``window_left = w >= 0``); hidden keys drop out of the softmax.

With a sink logit ``sink_h`` (raw, not scaled) the softmax denominator gains one term:
``out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink_h - m))`` with
``m = max(max_j s_j, sink_h)``, and ``lse = m + log(denominator)``. A row with no visible
key returns zeros and ``lse = -inf`` (``sink_h`` with sinks). Query head ``h`` reads kv head
``h // (Hq // Hk)`` (GQA/MQA).

fp8 caches (``kv_dtype``, ``k_scale``, ``v_scale``) are read back in float64
(``cupaged.reference.fp8.dequantize``) as they are gathered; everything after the gather is
the same math on those values.
"""
from __future__ import annotations

import numpy as np

from ..core.fp8 import check_kv_scales, resolve_kv_dtype
from ..core.layouts import CACHE_DTYPES, cache_geometry, k_as_nhd, v_as_nhd
from .cache import write_kv_cache
from .fp8 import dequantize


# ----------------------------------------------------------------------------- one sequence
_ROWS = 128  # query rows per block in attend


def query_positions(q_len, kv_len):
    """Absolute positions ``p = kv_len - q_len + i`` of the queries, int64 ``[q_len]``."""
    return np.arange(q_len, dtype=np.int64) + (kv_len - q_len)


def visible_keys(q_len, kv_len, *, causal=True, window_left=-1, positions=None):
    """Mask of the keys each query sees, bool ``[q_len, kv_len]``.

    Key ``j`` is visible to query ``i`` (position ``p``) iff ``j <= p`` when ``causal`` and
    ``j >= p - window_left`` when ``window_left >= 0``; ``positions`` (int64 ``[q_len]``)
    gives the queries' positions, default :func:`query_positions`.
    """
    if positions is None:
        positions = query_positions(q_len, kv_len)
    p = positions[:, None]
    j = np.arange(kv_len, dtype=np.int64)[None, :]
    visible = np.ones((len(positions), kv_len), dtype=bool)
    if causal:
        visible &= j <= p
    if window_left >= 0:
        visible &= j >= p - window_left
    return visible


def softmax_with_sink(s, sinks=None):
    """Softmax over the last axis with an optional sink term in the denominator.

    Parameters
    ----------
    s : numpy.ndarray
        float64 ``[..., H, rows, n]`` scores; ``-inf`` marks hidden keys.
    sinks : numpy.ndarray, optional
        ``[H]`` raw sink logits, broadcast over the leading axes and the rows.

    Returns
    -------
    probs : numpy.ndarray
        float64 ``[..., H, rows, n]``, excluding the sink column; each row sums to
        ``1 - p_sink``. Rows whose scores and sink are all ``-inf`` are zeros.
    lse : numpy.ndarray
        float64 ``[..., H, rows]``: ``log(sum_j exp(s_j) + exp(sink_h))``, ``-inf`` for an
        empty row.
    """
    s = np.asarray(s, dtype=np.float64)
    m = s.max(axis=-1, initial=-np.inf)
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float64)[:, None]
        m = np.maximum(m, sink)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m_safe[..., None])
    denom = e.sum(axis=-1)
    if sinks is not None:
        denom = denom + np.exp(sink - m_safe)
    with np.errstate(divide="ignore"):
        lse = m_safe + np.log(denom)
    probs = e / np.where(denom > 0, denom, 1.0)[..., None]
    return probs, lse


def _per_kv_head(x, num_kv_heads):
    """``[n, Hq, ...]`` -> float64 ``[Hk, group * n, ...]``: kv head ``h``'s query heads
    ``h * group .. (h + 1) * group - 1`` one after another (GQA as one product per kv head)."""
    n, num_q_heads = x.shape[:2]
    group = num_q_heads // num_kv_heads
    x = np.asarray(x, np.float64).reshape(n, num_kv_heads, group, *x.shape[2:])
    return np.moveaxis(x, 0, 2).reshape(num_kv_heads, group * n, *x.shape[3:])


def attention_scores(q, k, *, sm_scale=None, alibi_slopes=None, logits_soft_cap=0.0,
                     positions=None):
    """Unmasked scores of one sequence, steps 1-3 of the module docstring.

    Parameters
    ----------
    q : numpy.ndarray
        ``[q_len, Hq, D]``.
    k : numpy.ndarray
        ``[kv_len, Hk, D]``, ``Hq % Hk == 0``.
    positions : numpy.ndarray, optional
        int64 ``[q_len]``: the queries' positions counted from key 0 of ``k`` (ALiBi's
        distances); default :func:`query_positions`.

    Returns
    -------
    numpy.ndarray
        float64 ``[Hq, q_len, kv_len]``.
    """
    q_len, num_q_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[:2]
    scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    # [Hk, group * q_len, D] @ [Hk, D, kv_len]: a batched product BLAS runs (einsum's own
    # loops are ten times slower at a few thousand keys)
    s = np.matmul(_per_kv_head(q, num_kv_heads),
                  np.ascontiguousarray(k, np.float64).transpose(1, 2, 0))
    s = scale * s.reshape(num_q_heads, q_len, kv_len)
    if logits_soft_cap > 0:
        s = logits_soft_cap * np.tanh(s / logits_soft_cap)
    if alibi_slopes is not None:
        if positions is None:
            positions = query_positions(q_len, kv_len)
        distance = np.arange(kv_len)[None, :] - positions[:, None]
        s = s + np.asarray(alibi_slopes, np.float64)[:, None, None] * distance[None]
    return s


def attend_masked(q, k, v, visible, *, sm_scale=None, alibi_slopes=None, sinks=None,
                  logits_soft_cap=0.0, positions=None):
    """Attention of one sequence under an explicit visibility mask.

    Same as :func:`attend` with the mask (step 4) given as ``visible``, bool
    ``[q_len, kv_len]`` (``positions`` as in :func:`attention_scores`). Returns
    ``(out, lse)``: float64 ``[q_len, Hq, D]`` and ``[q_len, Hq]``.
    """
    s = attention_scores(q, k, sm_scale=sm_scale, alibi_slopes=alibi_slopes,
                         logits_soft_cap=logits_soft_cap, positions=positions)
    s = np.where(visible[None], s, -np.inf)
    probs, lse = softmax_with_sink(s, sinks)
    (q_len, num_q_heads), (kv_len, num_kv_heads, head_dim) = q.shape[:2], v.shape
    out = np.matmul(probs.reshape(num_kv_heads, num_q_heads // num_kv_heads * q_len, kv_len),
                    np.ascontiguousarray(v, np.float64).transpose(1, 0, 2))
    return out.reshape(num_q_heads, q_len, head_dim).transpose(1, 0, 2), lse.T


def attend(q, k, v, *, causal=True, sm_scale=None, window_left=-1, alibi_slopes=None,
           sinks=None, logits_soft_cap=0.0):
    """Attention of one sequence: the definition of every attention op in cupaged.

    Parameters
    ----------
    q : numpy.ndarray
        ``[q_len, Hq, D]``, any float dtype; ``q_len`` may be 0.
    k, v : numpy.ndarray
        ``[kv_len, Hk, D]``, ``Hq % Hk == 0``; ``kv_len`` may be 0.
    causal : bool
        Key ``j`` visible only if ``j <= p = kv_len - q_len + i``.
    sm_scale : float, optional
        Score scale, default ``D ** -0.5``.
    window_left : int
        ``w >= 0`` also hides keys ``j < p - w``; ``-1`` for no window.
    alibi_slopes : numpy.ndarray, optional
        float32 ``[Hq]``; adds ``slope_h * (j - p)`` after the soft-cap.
    sinks : numpy.ndarray, optional
        float32 ``[Hq]`` raw sink logits, one extra denominator term per row.
    logits_soft_cap : float
        ``c > 0`` maps scores to ``c * tanh(s / c)`` before ALiBi.

    Returns
    -------
    out : numpy.ndarray
        float64 ``[q_len, Hq, D]``; zeros for a row with no visible key.
    lse : numpy.ndarray
        float64 ``[q_len, Hq]`` natural-log sum of exponentials including the sink;
        ``-inf`` (or ``sink_h``) for a row with no visible key.
    """
    q_len, kv_len = q.shape[0], k.shape[0]
    positions = query_positions(q_len, kv_len)
    k, v = np.ascontiguousarray(k, np.float64), np.ascontiguousarray(v, np.float64)
    out = np.zeros((q_len, q.shape[1], v.shape[2]))
    lse = np.full((q_len, q.shape[1]), -np.inf)
    # the same math a block of query rows at a time, over the keys the block sees: the
    # float64 scores of a long sequence would not fit in the caches (nor, at 10^5 keys, in
    # memory)
    for r0 in range(0, q_len, _ROWS):
        rows = slice(r0, r0 + _ROWS)
        visible = visible_keys(q_len, kv_len, causal=causal, window_left=window_left,
                               positions=positions[rows])
        seen = np.flatnonzero(visible.any(axis=0))
        lo, hi = (int(seen[0]), int(seen[-1]) + 1) if len(seen) else (0, 0)
        out[rows], lse[rows] = attend_masked(
            q[rows], k[lo:hi], v[lo:hi], visible[:, lo:hi], sm_scale=sm_scale,
            alibi_slopes=alibi_slopes, sinks=sinks, logits_soft_cap=logits_soft_cap,
            positions=positions[rows] - lo)
    return out, lse


# ----------------------------------------------------------------------------- batches
def _attend_batch(q, cu_seqlens_q, kv_of, return_lse, options):
    """Run :func:`attend` per sequence; ``kv_of(i)`` gives sequence ``i``'s ``(k, v)``."""
    cu_q = np.asarray(cu_seqlens_q, dtype=np.int64)
    out = np.zeros(q.shape, dtype=np.float64)
    lse = np.full(q.shape[:2], -np.inf)
    for i in range(len(cu_q) - 1):
        rows = slice(cu_q[i], cu_q[i + 1])
        k_i, v_i = kv_of(i)
        out[rows], lse[rows] = attend(q[rows], k_i, v_i, **options)
    out = out.astype(q.dtype)
    return (out, lse.astype(np.float32)) if return_lse else out


def varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=True, sm_scale=None,
                   window_left=-1, alibi_slopes=None, sinks=None, logits_soft_cap=0.0,
                   return_lse=False):
    """Attention over a ragged batch of sequences packed along the token axis.

    Parameters
    ----------
    q : numpy.ndarray
        ``[total_q, Hq, D]``, float16, bfloat16 or float32.
    k, v : numpy.ndarray
        ``[total_k, Hk, D]``.
    cu_seqlens_q, cu_seqlens_k : numpy.ndarray
        int32 ``[B + 1]`` prefix sums: sequence ``i`` owns query rows
        ``[cu_seqlens_q[i], cu_seqlens_q[i+1])`` and key rows likewise; lengths may be 0.
    causal, sm_scale, window_left, alibi_slopes, sinks, logits_soft_cap
        As in :func:`attend`, positions counted per sequence.
    return_lse : bool
        Also return the LSE.

    Returns
    -------
    out : numpy.ndarray
        ``[total_q, Hq, D]`` in q's dtype.
    lse : numpy.ndarray
        float32 ``[total_q, Hq]``, only with ``return_lse``.
    """
    cu_k = np.asarray(cu_seqlens_k, dtype=np.int64)

    def kv_of(i):
        return k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]

    options = dict(causal=causal, sm_scale=sm_scale, window_left=window_left,
                   alibi_slopes=alibi_slopes, sinks=sinks, logits_soft_cap=logits_soft_cap)
    return _attend_batch(q, cu_seqlens_q, kv_of, return_lse, options)


# ----------------------------------------------------------------------------- paged caches
def gather_kv(k_cache, v_cache, block_table, kv_len, layout="NHD", *, kv_dtype=None,
              k_scale=None, v_scale=None):
    """The first ``kv_len`` keys and values of one sequence of a paged cache.

    Parameters
    ----------
    k_cache, v_cache : numpy.ndarray
        Paged caches in ``layout`` (see ``cupaged.layouts``).
    block_table : numpy.ndarray
        int32 ``[max_blocks]``; token ``t`` lives in block ``block_table[t // block_size]``
        at offset ``t % block_size``. Entries past the last used block may be -1.
    kv_len : int
        Number of tokens to gather.
    layout : {"NHD", "HND", "vllm"}
    kv_dtype : {None, "fp8_e4m3", "fp8_e5m2"}
        The caches' format (``reference.cache.write_kv_cache``); None: their own dtype.
    k_scale, v_scale : float or numpy.ndarray, optional
        fp8 only: float32 ``[]`` or ``[Hk]`` (default 1.0).

    Returns
    -------
    k, v : numpy.ndarray
        ``[kv_len, Hk, D]`` copies: in the cache dtype, or float64 ``byte * scale`` for fp8.
    """
    fmt = resolve_kv_dtype(kv_dtype, k_cache, v_cache)
    _, block_size, num_kv_heads, head_dim = cache_geometry(k_cache, v_cache, layout,
                                                           CACHE_DTYPES)
    k_scale, v_scale = check_kv_scales(fmt, k_scale, v_scale, num_kv_heads)
    num_used = -(-int(kv_len) // block_size)
    blocks = np.asarray(block_table[:num_used], dtype=np.int64)
    if num_used > len(blocks) or (blocks < 0).any():
        raise ValueError(f"block_table: expected {num_used} valid block ids for {kv_len} "
                         f"tokens, got {blocks.tolist()}")
    shape = (num_used * block_size, num_kv_heads, head_dim)
    k = k_as_nhd(k_cache[blocks], layout).reshape(shape)[:kv_len]
    v = v_as_nhd(v_cache[blocks], layout).reshape(shape)[:kv_len]
    if fmt is not None:
        k = dequantize(k, k_scale, fmt.name, head_axis=1, name="k_scale")
        v = dequantize(v, v_scale, fmt.name, head_axis=1, name="v_scale")
    return k, v


def paged_prefill(q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, *, causal=True,
                  sm_scale=None, window_left=-1, alibi_slopes=None, sinks=None,
                  logits_soft_cap=0.0, layout="NHD", return_lse=False, kv_dtype=None,
                  k_scale=None, v_scale=None):
    """Attention of new query tokens against paged caches (chunked prefill, prefix reuse).

    Sequence ``i``'s queries are the last ``q_len_i`` positions of its ``seq_lens[i]``
    cached tokens (bottom-right alignment); with ``q_len_i > seq_lens[i]`` the leading
    rows see no key under ``causal`` and give zeros. Decode rows are ``q_len_i = 1``, so
    this also defines mixed batches (:func:`paged_attention`).

    Parameters
    ----------
    q : numpy.ndarray
        ``[total_q, Hq, D]``.
    k_cache, v_cache : numpy.ndarray
        Paged caches in ``layout``, already holding the new tokens' keys and values.
    cu_seqlens_q : numpy.ndarray
        int32 ``[B + 1]`` query prefix sums.
    block_tables : numpy.ndarray
        int32 ``[B, max_blocks]``, -1 padded.
    seq_lens : numpy.ndarray
        int32 ``[B]`` key counts including the new tokens.
    causal, sm_scale, window_left, alibi_slopes, sinks, logits_soft_cap
        As in :func:`attend`.
    layout : {"NHD", "HND", "vllm"}
    return_lse : bool
    kv_dtype, k_scale, v_scale
        fp8 caches, as in :func:`gather_kv`: attention runs on the dequantised keys and
        values.

    Returns
    -------
    out : numpy.ndarray
        ``[total_q, Hq, D]`` in q's dtype.
    lse : numpy.ndarray
        float32 ``[total_q, Hq]``, only with ``return_lse``.
    """
    def kv_of(i):
        return gather_kv(k_cache, v_cache, block_tables[i], int(seq_lens[i]), layout,
                         kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)

    options = dict(causal=causal, sm_scale=sm_scale, window_left=window_left,
                   alibi_slopes=alibi_slopes, sinks=sinks, logits_soft_cap=logits_soft_cap)
    return _attend_batch(q, cu_seqlens_q, kv_of, return_lse, options)


paged_attention = paged_prefill
"""Mixed batches of decode rows (``q_len = 1``) and prefill rows: :func:`paged_prefill`."""


def append_slots(block_tables, positions, block_size):
    """Cache slots of token ``positions[i]`` of each sequence, int64 ``[B]``.

    ``slot = block_tables[i, p // block_size] * block_size + p % block_size``.
    """
    pos = np.asarray(positions, dtype=np.int64)
    blocks = np.asarray(block_tables, dtype=np.int64)[np.arange(len(pos)), pos // block_size]
    return blocks * block_size + pos % block_size


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, *, k_new=None, v_new=None,
                 sm_scale=None, window_left=-1, alibi_slopes=None, sinks=None,
                 logits_soft_cap=0.0, layout="NHD", return_lse=False, kv_dtype=None,
                 k_scale=None, v_scale=None):
    """One query token per sequence against paged caches, optionally appending first.

    Parameters
    ----------
    q : numpy.ndarray
        ``[B, Hq, D]``.
    k_cache, v_cache : numpy.ndarray
        Paged caches in ``layout``; modified in place when ``k_new`` is given.
    block_tables : numpy.ndarray
        int32 ``[B, max_blocks]``, -1 padded.
    seq_lens : numpy.ndarray
        int32 ``[B]`` cached lengths. Without ``k_new`` the query attends over these
        keys; with it, these are the lengths before the append (the continuous-batching contract's
        ``cache_seqlens``).
    k_new, v_new : numpy.ndarray, optional
        ``[B, Hk, D]`` the new token's key and value, written in place at position
        ``seq_lens[i]`` of sequence ``i`` before attending over ``seq_lens[i] + 1`` keys.
    sm_scale, window_left, alibi_slopes, sinks, logits_soft_cap
        As in :func:`attend`; the query sits at position ``kv_len - 1``.
    layout : {"NHD", "HND", "vllm"}
    return_lse : bool
    kv_dtype, k_scale, v_scale
        fp8 caches, as in :func:`gather_kv`; ``k_new`` and ``v_new`` are quantised as they
        are appended (``reference.cache.write_kv_cache``) and read back like every other key.

    Returns
    -------
    out : numpy.ndarray
        ``[B, Hq, D]`` in q's dtype; zeros for a sequence with no keys.
    lse : numpy.ndarray
        float32 ``[B, Hq]``, only with ``return_lse``.
    """
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new, v_new: expected both or neither, got only one")
    lens = np.asarray(seq_lens, dtype=np.int64)
    fp8 = dict(kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)
    if k_new is not None:
        block_size = cache_geometry(k_cache, v_cache, layout, CACHE_DTYPES).block_size
        slots = append_slots(block_tables, lens, block_size)
        write_kv_cache(k_new, v_new, k_cache, v_cache, slots, layout, **fp8)
        lens = lens + 1
    cu_q = np.arange(q.shape[0] + 1, dtype=np.int32)
    return paged_prefill(q, k_cache, v_cache, cu_q, block_tables, lens, causal=True,
                         sm_scale=sm_scale, window_left=window_left,
                         alibi_slopes=alibi_slopes, sinks=sinks,
                         logits_soft_cap=logits_soft_cap, layout=layout,
                         return_lse=return_lse, **fp8)


# ----------------------------------------------------------------------------- merging
def merge_states(out_a, lse_a, out_b, lse_b):
    """Combine two partial attentions over disjoint key sets into one.

    ``out = (exp(lse_a - m) out_a + exp(lse_b - m) out_b) / (exp(lse_a - m) + exp(lse_b - m))``
    and ``lse = m + log(exp(lse_a - m) + exp(lse_b - m))`` with ``m = max(lse_a, lse_b)``.

    Parameters
    ----------
    out_a, out_b : numpy.ndarray
        ``[T, H, D]`` partial outputs, each normalised over its own keys; rows of an
        empty part (LSE ``-inf``) are ignored, whatever they hold.
    lse_a, lse_b : numpy.ndarray
        float32 ``[T, H]`` their LSEs; ``-inf`` marks an empty part.

    Returns
    -------
    out : numpy.ndarray
        ``[T, H, D]`` in out_a's dtype; zeros where both sides are empty.
    lse : numpy.ndarray
        float32 ``[T, H]``; ``-inf`` where both sides are empty.
    """
    la, lb = np.asarray(lse_a, np.float64), np.asarray(lse_b, np.float64)
    m = np.maximum(la, lb)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    wa, wb = np.exp(la - m_safe), np.exp(lb - m_safe)
    total = wa + wb
    with np.errstate(divide="ignore"):
        lse = m_safe + np.log(total)
    denom = np.where(total > 0, total, 1.0)[..., None]
    out = (_weighted(wa, out_a) + _weighted(wb, out_b)) / denom
    return out.astype(out_a.dtype), lse.astype(np.float32)


def _weighted(weight, out):
    """``weight[..., None] * out`` in float64; a zero weight (empty part) ignores ``out``."""
    w = weight[..., None]
    with np.errstate(invalid="ignore"):
        return np.where(w > 0, w * out.astype(np.float64), 0.0)
