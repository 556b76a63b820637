"""Reference block-sparse attention: vertical+slash estimate, index conversion, BSR.

The specification of ``cupaged.sparse``, in float64 and plain loops; inputs are NumPy
arrays already validated by the public ops.

Positions follow docs/design.md: a sequence with ``q_len`` queries and ``kv_len >= q_len`` keys
places query ``i`` at ``p = kv_len - q_len + i``; causal attention sees keys ``j <= p``.

Vertical indices are key positions ``j``; slash indices are diagonal offsets ``d = p - j``
(0 is the main diagonal). Per sequence they are int32 ``[H, n]`` (one row per query head);
batched calls stack them as ``[B, H, n]``, padding short rows with :data:`PAD` (any entry
``>= kv_len`` is padding and ignored).

The vertical+slash pattern is MInference's index conversion (``block_m x block_n``
tiles). For the query block of local rows ``[m0, m0 + block_m)`` let ``end`` be the
absolute position just past its last row, ``end = kv_len - q_len + m0 + block_m`` (rows
past ``q_len`` included, as in MInference). Slash ``d < min(end, kv_len)`` covers the
keys ``[hi - block_m, hi)`` with ``hi = max(end - d, block_m)``, for every row of the
block. Taking the slashes by descending ``d`` (ascending ranges), a range starting at or
before the end of the current merged range extends it by whole ``block_n`` blocks up to
its end; one starting later opens a new merged range of ``ceil(block_m / block_n)``
blocks. Merged ranges are cut into ``block_n``-wide key blocks (``block_offset``, their
first keys, ascending). Vertical columns ``v < min(end, kv_len)`` inside no key block
are ``column_index`` (ascending, unique). Causality applies on top. With
``block_m == block_n`` this is MInference's conversion exactly, except that MInference
drops verticals past the last merged range while they are kept here.
"""
from __future__ import annotations

import numpy as np

from .attention import attend_masked, gather_kv, query_positions, visible_keys

PAD = np.iinfo(np.int32).max
"""Padding value of batched vertical/slash index rows (ignored: it is ``>= kv_len``)."""


# ----------------------------------------------------------------------------- estimate
def pattern_sizes(kv_len, vertical_size, slash_size, num_sink_tokens=30,
                  num_recent_diags=100, adaptive_budget=None):
    """Numbers ``(nv, ns)`` of vertical and slash indices kept for ``kv_len`` keys.

    With ``adaptive_budget = f``: ``budget = int(kv_len * f)``,
    ``vertical = max(num_sink_tokens + 1, int(0.2 * budget))`` and
    ``slash = max(num_recent_diags + 1, int(0.8 * budget))``; both capped at ``kv_len``.
    """
    if adaptive_budget is not None:
        budget = int(kv_len * adaptive_budget)
        vertical_size = max(num_sink_tokens + 1, int(budget * 0.2))
        slash_size = max(num_recent_diags + 1, int(budget * 0.8))
    return min(int(vertical_size), kv_len), min(int(slash_size), kv_len)


def last_q_probs(q, k, last_q=64, sm_scale=None):
    """Causal softmax of the last ``last_q`` queries over all keys, float64.

    Parameters
    ----------
    q : numpy.ndarray
        ``[q_len, Hq, D]``.
    k : numpy.ndarray
        ``[kv_len, Hk, D]``, ``kv_len >= q_len``.

    Returns
    -------
    probs : numpy.ndarray
        float64 ``[Hq, n, kv_len]``, ``n = min(last_q, q_len)``; zero where ``j > p``.
    positions : numpy.ndarray
        int64 ``[n]`` absolute positions of those queries.
    """
    q_len, num_q_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[:2]
    n = min(last_q, q_len)
    scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    k64 = np.repeat(k.astype(np.float64), num_q_heads // num_kv_heads, axis=1)
    s = scale * np.matmul(q[q_len - n:].astype(np.float64).transpose(1, 0, 2), k64.transpose(1, 2, 0))
    pos = query_positions(q_len, kv_len)[q_len - n:]
    visible = np.arange(kv_len)[None, :] <= pos[:, None]
    s = np.where(visible[None], s, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True), pos


def _top_sorted(scores, k):
    """Indices of the ``k`` largest scores per row (ties: lower index), sorted ascending."""
    order = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
    return np.sort(order, axis=-1).astype(np.int32)


def estimate_vertical_slash(q, k, *, vertical_size, slash_size, last_q=64, num_sink_tokens=30,
                            num_recent_diags=100, adaptive_budget=None, sm_scale=None):
    """MInference's pattern estimate from the last ``last_q`` queries (the MInference
    contract of docs/design.md).

    The causal softmax of the last queries over all keys gives a vertical score per key
    (its column sum) and a slash score per diagonal ``d = p - j`` (its sum along the
    diagonal). The first ``num_sink_tokens`` keys and ``num_recent_diags`` diagonals are
    forced in; the top ``nv``/``ns`` of each (sizes from :func:`pattern_sizes` on
    ``kv_len``) are kept.

    Parameters
    ----------
    q : numpy.ndarray
        ``[q_len, Hq, D]``.
    k : numpy.ndarray
        ``[kv_len, Hk, D]``, ``kv_len >= q_len``, ``Hq % Hk == 0``.

    Returns
    -------
    v_idx : numpy.ndarray
        int32 ``[Hq, nv]`` key positions, ascending.
    s_idx : numpy.ndarray
        int32 ``[Hq, ns]`` diagonal offsets, ascending.
    """
    v_scores, s_scores = estimate_scores(q, k, last_q=last_q, sm_scale=sm_scale)
    kv_len = k.shape[0]
    nv, ns = pattern_sizes(kv_len, vertical_size, slash_size, num_sink_tokens,
                           num_recent_diags, adaptive_budget)
    v_scores[:, :num_sink_tokens] = np.inf
    s_scores[:, :num_recent_diags] = np.inf
    return _top_sorted(v_scores, nv), _top_sorted(s_scores, ns)


def estimate_scores(q, k, *, last_q=64, sm_scale=None):
    """Vertical and slash scores before forcing and top-k, float64 ``[Hq, kv_len]`` each."""
    probs, pos = last_q_probs(q, k, last_q, sm_scale)
    kv_len = k.shape[0]
    vertical = probs.sum(axis=1)
    diag = pos[:, None] - np.arange(kv_len)[None, :]
    keep = diag >= 0
    slash = np.stack([np.bincount(diag[keep], weights=p[keep], minlength=kv_len)
                      for p in probs])
    return vertical, slash


# ----------------------------------------------------------------------------- index
def slash_blocks(s_row, end, kv_len, block_m, block_n):
    """First keys of the key blocks one query block's slashes cover, ascending.

    ``s_row`` holds diagonal offsets (any order, duplicates allowed); see the module
    docstring for the merge rule.
    """
    per_range = -(-block_m // block_n) * block_n
    ranges = []
    for d in sorted(set(int(x) for x in s_row), reverse=True):
        if d >= end or d >= kv_len:
            continue
        hi = max(end - d, block_m)
        lo = hi - block_m
        if ranges and lo <= ranges[-1][1]:
            if hi > ranges[-1][1]:
                ranges[-1][1] += -(-(hi - ranges[-1][1]) // block_n) * block_n
        else:
            ranges.append([lo, lo + per_range])
    return [s for lo, hi in ranges for s in range(lo, hi, block_n)]


def vertical_columns(v_row, blocks, end, kv_len, block_n):
    """Vertical columns ``v < min(end, kv_len)`` outside every key block, ascending."""
    limit = min(end, kv_len)
    starts = np.asarray(blocks, dtype=np.int64)
    cols = []
    for v in sorted(set(int(x) for x in v_row)):
        if v >= limit:
            break
        if not ((starts <= v) & (v < starts + block_n)).any():
            cols.append(v)
    return cols


def index_widths(nnz_v, nnz_s, max_kv_len, block_m, block_n):
    """Widths ``(W_s, W_v)`` of ``block_offset`` and ``column_index`` rows.

    A query block gets at most ``ceil(block_m / block_n)`` key blocks per slash and at
    most ``ceil((max_kv_len + block_m - 1) / block_n)`` in all (block starts lie below
    ``max(end, block_m)``), and at most one column per vertical.
    """
    w_s = min(nnz_s * -(-block_m // block_n), -(-(max_kv_len + block_m - 1) // block_n))
    return max(w_s, 1), max(nnz_v, 1)


def vertical_slash_index(seqlens, v_idx, s_idx, context_size, block_m=64, block_n=64,
                         kv_seqlens=None, max_kv_len=None):
    """MInference's index conversion: vertical+slash indices to block and column lists.

    Parameters
    ----------
    seqlens : numpy.ndarray
        int32 ``[B]`` queries per sequence.
    v_idx : numpy.ndarray
        int32 ``[B, H, NNZ_V]`` key positions (padding: ``>= kv_len``).
    s_idx : numpy.ndarray
        int32 ``[B, H, NNZ_S]`` diagonal offsets (padding: ``>= kv_len``).
    context_size : int
        Padded query length: ``M = ceil(context_size / block_m)`` query blocks.
    block_m, block_n : int
        Query rows per block, keys per key block.
    kv_seqlens : numpy.ndarray, optional
        int32 ``[B]`` keys per sequence (default ``seqlens``); queries are the last
        ``seqlens[b]`` positions.
    max_kv_len : int, optional
        The bound on the key counts that sizes the lists (:func:`index_widths`): default
        ``context_size`` without ``kv_seqlens``, else their largest.

    Returns
    -------
    block_count : numpy.ndarray
        int32 ``[B, H, M]``.
    block_offset : numpy.ndarray
        int32 ``[B, H, M, W_s]`` first key of each key block (``W_s`` from
        :func:`index_widths`); entries past ``block_count`` are 0.
    column_count : numpy.ndarray
        int32 ``[B, H, M]``.
    column_index : numpy.ndarray
        int32 ``[B, H, M, W_v]``; entries past ``column_count`` are 0.
    """
    seqlens = np.asarray(seqlens, dtype=np.int64)
    kv_given = kv_seqlens
    kv_seqlens = seqlens if kv_seqlens is None else np.asarray(kv_seqlens, dtype=np.int64)
    batch, heads, nnz_v = v_idx.shape
    num_m = -(-int(context_size) // block_m)
    if max_kv_len is None:
        max_kv_len = int(context_size) if kv_given is None else int(kv_seqlens.max(initial=0))
    w_s, w_v = index_widths(nnz_v, s_idx.shape[2], max_kv_len, block_m, block_n)
    block_count = np.zeros((batch, heads, num_m), np.int32)
    block_offset = np.zeros((batch, heads, num_m, w_s), np.int32)
    column_count = np.zeros((batch, heads, num_m), np.int32)
    column_index = np.zeros((batch, heads, num_m, w_v), np.int32)
    for b in range(batch):
        q_len, kv_len = int(seqlens[b]), int(kv_seqlens[b])
        for h in range(heads):
            for m in range(-(-q_len // block_m)):
                end = kv_len - q_len + m * block_m + block_m
                blocks = slash_blocks(s_idx[b, h], end, kv_len, block_m, block_n)
                cols = vertical_columns(v_idx[b, h], blocks, end, kv_len, block_n)
                block_count[b, h, m], column_count[b, h, m] = len(blocks), len(cols)
                block_offset[b, h, m, :len(blocks)] = blocks
                column_index[b, h, m, :len(cols)] = cols
    return block_count, block_offset, column_count, column_index


def vertical_slash_mask(block_count, block_offset, column_count, column_index, q_len, kv_len,
                        block_m=64, block_n=64):
    """Visibility mask of one sequence from its index arrays, causality applied.

    Parameters
    ----------
    block_count, column_count : numpy.ndarray
        int32 ``[H, M]`` (one sequence of :func:`vertical_slash_index`).
    block_offset, column_index : numpy.ndarray
        int32 ``[H, M, W]``.

    Returns
    -------
    numpy.ndarray
        bool ``[H, q_len, kv_len]``.
    """
    heads = block_count.shape[0]
    mask = np.zeros((heads, q_len, kv_len), dtype=bool)
    for h in range(heads):
        for m in range(-(-q_len // block_m)):
            rows = slice(m * block_m, min(q_len, (m + 1) * block_m))
            for s in block_offset[h, m, :block_count[h, m]]:
                mask[h, rows, s:s + block_n] = True
            mask[h, rows, column_index[h, m, :column_count[h, m]]] = True
    return mask & _causal(q_len, kv_len)[None]


def dense_heads(block_count, column_count, q_len, kv_len, block_m, block_n, threshold):
    """Heads of one sequence that run dense: those whose pattern keeps more than
    ``threshold`` of its causal blocks.

    Query block ``m`` keeps ``block_count[h, m] + ceil(column_count[h, m] / block_n)``
    blocks of the ``ceil(min(end_m, kv_len) / block_n)`` it could see (``end_m`` as in the
    module docstring); a head runs dense iff its kept sum exceeds ``threshold`` times its
    causal sum (float64 product; None: no head).

    Parameters
    ----------
    block_count, column_count : numpy.ndarray
        int ``[H, M]`` (one sequence of :func:`vertical_slash_index`).

    Returns
    -------
    numpy.ndarray
        bool ``[H]``.
    """
    heads = block_count.shape[0]
    if threshold is None:
        return np.zeros(heads, bool)
    rows = -(-q_len // block_m)
    ends = kv_len - q_len + (np.arange(rows, dtype=np.int64) + 1) * block_m
    causal = int((-(-np.maximum(np.minimum(ends, kv_len), 0) // block_n)).sum())
    bc = block_count[:, :rows].astype(np.int64)
    kept = (bc + -(-column_count[:, :rows].astype(np.int64) // block_n)).sum(axis=1)
    return np.array([int(n) > float(threshold) * causal for n in kept], bool)


def bsr_mask(indptr, indices, q_len, kv_len, block_m, block_n, causal=True):
    """Visibility mask of a block-sparse-row pattern, bool ``[q_len, kv_len]``.

    Row block ``r`` (query rows ``[r * block_m, (r + 1) * block_m)``) sees the key blocks
    ``indices[indptr[r]:indptr[r + 1]]`` (keys ``[c * block_n, (c + 1) * block_n)``).
    """
    mask = np.zeros((q_len, kv_len), dtype=bool)
    for r in range(len(indptr) - 1):
        rows = slice(r * block_m, (r + 1) * block_m)
        for c in indices[indptr[r]:indptr[r + 1]]:
            mask[rows, c * block_n:(c + 1) * block_n] = True
    return mask & _causal(q_len, kv_len) if causal else mask


def _causal(q_len, kv_len):
    return np.arange(kv_len)[None, :] <= query_positions(q_len, kv_len)[:, None]


# ----------------------------------------------------------------------------- attention
def _masked(q, k, v, visible, sm_scale, sinks, window_left=-1, alibi_slopes=None,
            logits_soft_cap=0.0):
    """Per-head masked attention: visible ``[Hq, q_len, kv_len]`` (the pattern, causality
    applied), ``window_left`` on top; float64 out and lse."""
    out = np.zeros(q.shape, np.float64)
    lse = np.zeros(q.shape[:2], np.float64)
    group = q.shape[1] // k.shape[1]
    window = visible_keys(q.shape[0], k.shape[0], causal=False, window_left=window_left)
    for h in range(q.shape[1]):
        kh = slice(h // group, h // group + 1)
        per_head = {name: None if x is None else np.asarray(x)[h:h + 1]
                    for name, x in (("sinks", sinks), ("alibi_slopes", alibi_slopes))}
        o, l_ = attend_masked(q[:, h:h + 1], k[:, kh], v[:, kh], visible[h] & window,
                              sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, **per_head)
        out[:, h], lse[:, h] = o[:, 0], l_[:, 0]
    return out, lse


def vertical_slash_attention(q, k, v, v_idx, s_idx, *, block_m=64, block_n=64, sm_scale=None,
                             sinks=None, window_left=-1, alibi_slopes=None, logits_soft_cap=0.0,
                             dense_threshold=None):
    """Causal attention of one sequence restricted to its vertical+slash pattern.

    Inside the pattern (causality applied) everything of ``cupaged.reference.attention``
    holds: ``window_left`` (keys ``j >= p - w``) masks on top, ``sm_scale``, soft-cap, ALiBi
    ``slope_h (j - p)``, sinks in the denominator. With ``dense_threshold``, the heads of
    :func:`dense_heads` see every causal key instead (their pattern's superset).

    Parameters
    ----------
    q : numpy.ndarray
        ``[q_len, Hq, D]``.
    k, v : numpy.ndarray
        ``[kv_len, Hk, D]``, ``kv_len >= q_len``.
    v_idx, s_idx : numpy.ndarray
        int32 ``[Hq, nv]`` and ``[Hq, ns]`` (padding ``>= kv_len`` allowed).
    dense_threshold : float, optional
        Heads keeping more than this fraction of their causal blocks see every causal key
        (:func:`dense_heads`); None: the pattern always.

    Returns
    -------
    out, lse : numpy.ndarray
        float64 ``[q_len, Hq, D]`` and ``[q_len, Hq]``.
    """
    q_len, kv_len = q.shape[0], k.shape[0]
    bc, bo, cc, ci = vertical_slash_index([q_len], v_idx[None], s_idx[None], max(q_len, 1),
                                          block_m, block_n, kv_seqlens=[kv_len])
    mask = vertical_slash_mask(bc[0], bo[0], cc[0], ci[0], q_len, kv_len, block_m, block_n)
    mask[dense_heads(bc[0], cc[0], q_len, kv_len, block_m, block_n, dense_threshold)] = \
        _causal(q_len, kv_len)
    return _masked(q, k, v, mask, sm_scale, sinks, window_left, alibi_slopes, logits_soft_cap)


def varlen_vertical_slash_attention(q, k, v, v_idx, s_idx, cu_seqlens_q, cu_seqlens_k, **kw):
    """:func:`vertical_slash_attention` per sequence of a packed batch.

    ``q`` ``[total_q, Hq, D]``, ``k``/``v`` ``[total_k, Hk, D]``, ``v_idx``/``s_idx``
    ``[B, Hq, n]``, ``cu_seqlens_*`` int32 ``[B + 1]``. Returns float64 out and lse.
    """
    def kv_of(b):
        rows = slice(int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1]))
        return k[rows], v[rows]
    return _per_sequence(q, cu_seqlens_q, kv_of, v_idx, s_idx, kw)


def paged_vertical_slash_attention(q, k_cache, v_cache, v_idx, s_idx, cu_seqlens_q,
                                   block_tables, seq_lens, layout="NHD", **kw):
    """:func:`vertical_slash_attention` per sequence, keys and values in a paged cache."""
    def kv_of(b):
        return gather_kv(k_cache, v_cache, block_tables[b], int(seq_lens[b]), layout)
    return _per_sequence(q, cu_seqlens_q, kv_of, v_idx, s_idx, kw)


def _per_sequence(q, cu_seqlens_q, kv_of, v_idx, s_idx, kw):
    out = np.zeros(q.shape, np.float64)
    lse = np.full(q.shape[:2], -np.inf)
    for b in range(len(cu_seqlens_q) - 1):
        rows = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        if rows.stop > rows.start:
            k_b, v_b = kv_of(b)
            out[rows], lse[rows] = vertical_slash_attention(q[rows], k_b, v_b, v_idx[b],
                                                            s_idx[b], **kw)
    return out, lse


def block_sparse_attention(q, k, v, indptr, indices, block_m, block_n, *, causal=True,
                           sm_scale=None, sinks=None, window_left=-1, alibi_slopes=None,
                           logits_soft_cap=0.0):
    """Attention of one sequence restricted to a block-sparse-row (BSR) pattern.

    Parameters
    ----------
    q : numpy.ndarray
        ``[q_len, Hq, D]``.
    k, v : numpy.ndarray
        ``[kv_len, Hk, D]``.
    indptr : numpy.ndarray
        int32 ``[ceil(q_len / block_m) + 1]``.
    indices : numpy.ndarray
        int32 ``[nnz]`` key block ids in ``[0, ceil(kv_len / block_n))``, shared by all heads.
    causal : bool
        Also hide keys ``j > p`` (bottom-right aligned).
    sm_scale, sinks, window_left, alibi_slopes, logits_soft_cap
        As in ``cupaged.reference.attention.attend``, inside the kept blocks.

    Returns
    -------
    out, lse : numpy.ndarray
        float64 ``[q_len, Hq, D]`` and ``[q_len, Hq]``.
    """
    mask = bsr_mask(indptr, indices, q.shape[0], k.shape[0], block_m, block_n, causal)
    return _masked(q, k, v, np.broadcast_to(mask, (q.shape[1],) + mask.shape), sm_scale, sinks,
                   window_left, alibi_slopes, logits_soft_cap)
