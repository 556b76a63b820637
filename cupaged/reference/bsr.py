"""Reference batched block-sparse-row (BSR) attention: ragged and paged batches.

The specification a batched BSR kernel is tested against, in float64; inputs are NumPy
arrays already validated (``cupaged.sparse.index.check_bsr_batch``).

The pattern (FlashInfer's ``indptr``/``indices`` form, one CSR matrix for the whole batch)
----------------------------------------------------------------------------------------
Sequence ``b`` has ``q_len_b`` queries and ``kv_len_b`` keys; its score matrix is cut into
``block_m x block_n`` tiles: block row ``r`` holds the local query rows
``[r * block_m, (r + 1) * block_m)``, block column ``c`` the keys
``[c * block_n, (c + 1) * block_n)`` (the last block of each may be partial). With
``R_b = ceil(q_len_b / block_m)`` block rows and ``C_b = ceil(kv_len_b / block_n)`` block
columns, each of the ``H_p`` pattern heads of every sequence owns ``R_b`` consecutive CSR
rows, ordered sequence, then pattern head, then block row:

- ``row_offsets[b] = H_p * sum_{b' < b} R_{b'}`` (:func:`bsr_row_offsets`, int32 ``[B + 1]``);
- sequence ``b``, pattern head ``g``, block row ``r`` is CSR row
  ``t = row_offsets[b] + g * R_b + r``;
- its kept key blocks are ``indices[indptr[t]:indptr[t + 1]]``, block ids in ``[0, C_b)``,
  strictly increasing; ``indptr`` int32 ``[row_offsets[B] + 1]``, ``indptr[0] = 0``,
  non-decreasing, ``indptr[-1] = len(indices)``.

``H_p`` is ``Hq`` (one pattern per query head), ``Hk`` (one per kv head, shared by the
``Hq / Hk`` query heads of its group) or 1 (one per sequence, shared by all heads); query
head ``h`` reads pattern head ``h // (Hq / H_p)``. It is the ``pattern_heads`` argument.

Semantics
---------
A key is a candidate for a query iff it lies in a kept block of the query's row. Then
everything of ``cupaged.reference.attention`` applies unchanged, on the candidates only:
bottom-right aligned positions ``p = kv_len_b - q_len_b + i``, causal (``j <= p``) and
``window_left`` (``j >= p - w``) masks on top of the pattern, ``sm_scale``, soft-cap, ALiBi
(``slope_h * (j - p)``), sinks in the denominator, natural-log LSE. A row left with no key
gives zeros and LSE ``-inf`` (``sink_h`` with sinks); a row with no kept block is such a row.
With every block kept this is exactly ``varlen_prefill`` / ``paged_prefill``.
"""
from __future__ import annotations

import numpy as np

from .attention import attend_masked, gather_kv, visible_keys
from .sparse import bsr_mask


def bsr_row_offsets(q_lens, block_m, pattern_heads):
    """First CSR row of each sequence: int32 ``[B + 1]``, ``H_p * cumsum(ceil(q_len / block_m))``.

    Parameters
    ----------
    q_lens : numpy.ndarray
        int ``[B]`` queries per sequence (``diff(cu_seqlens_q)``).
    block_m : int
        Query rows per block.
    pattern_heads : int
        ``H_p``: patterns per sequence.
    """
    rows = -(-np.asarray(q_lens, np.int64) // int(block_m))
    offsets = np.zeros(len(rows) + 1, np.int64)
    offsets[1:] = np.cumsum(rows * int(pattern_heads))
    return offsets.astype(np.int32)


def bsr_sequence_mask(indptr, indices, row_offset, q_len, kv_len, block_m, block_n,
                      pattern_heads):
    """Kept-block mask of one sequence, bool ``[H_p, q_len, kv_len]`` (no causal or window).

    ``row_offset`` is the sequence's ``row_offsets[b]``.
    """
    rows = -(-q_len // block_m)
    masks = []
    for g in range(pattern_heads):
        first = row_offset + g * rows
        ptr = np.asarray(indptr[first:first + rows + 1], np.int64)
        masks.append(bsr_mask(ptr - ptr[0], indices[ptr[0]:ptr[-1]], q_len, kv_len, block_m,
                              block_n, causal=False))
    return np.stack(masks) if masks else np.zeros((0, q_len, kv_len), bool)


def _attend_pattern(q, k, v, pattern, visible, options):
    """Attention of one sequence, query head ``h`` under ``pattern[h // group] & visible``."""
    num_q_heads = q.shape[1]
    group, kv_group = num_q_heads // pattern.shape[0], num_q_heads // k.shape[1]
    out = np.zeros(q.shape, np.float64)
    lse = np.zeros(q.shape[:2], np.float64)
    slopes, sinks = options["alibi_slopes"], options["sinks"]
    for h in range(num_q_heads):
        kh = slice(h // kv_group, h // kv_group + 1)
        o, l_ = attend_masked(
            q[:, h:h + 1], k[:, kh], v[:, kh], pattern[h // group] & visible,
            sm_scale=options["sm_scale"], logits_soft_cap=options["logits_soft_cap"],
            alibi_slopes=None if slopes is None else np.asarray(slopes)[h:h + 1],
            sinks=None if sinks is None else np.asarray(sinks)[h:h + 1])
        out[:, h], lse[:, h] = o[:, 0], l_[:, 0]
    return out, lse


def _bsr_batch(q, cu_seqlens_q, kv_of, indptr, indices, block_m, block_n, pattern_heads,
               causal, window_left, options):
    """Run every sequence; ``kv_of(b)`` gives sequence ``b``'s ``(k, v)``."""
    cu_q = np.asarray(cu_seqlens_q, np.int64)
    offsets = bsr_row_offsets(np.diff(cu_q), block_m, pattern_heads)
    out = np.zeros(q.shape, np.float64)
    lse = np.full(q.shape[:2], -np.inf)
    for b in range(len(cu_q) - 1):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        q_len = rows.stop - rows.start
        if q_len == 0:
            continue
        k_b, v_b = kv_of(b)
        kv_len = k_b.shape[0]
        pattern = bsr_sequence_mask(indptr, indices, int(offsets[b]), q_len, kv_len, block_m,
                                    block_n, pattern_heads)
        visible = visible_keys(q_len, kv_len, causal=causal, window_left=window_left)
        out[rows], lse[rows] = _attend_pattern(q[rows], k_b, v_b, pattern, visible, options)
    return out, lse


def varlen_block_sparse_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, indptr, indices,
                                  block_m, block_n, *, pattern_heads, causal=True,
                                  sm_scale=None, window_left=-1, alibi_slopes=None,
                                  sinks=None, logits_soft_cap=0.0):
    """Batched BSR attention over a ragged batch (the module docstring's pattern form).

    Parameters
    ----------
    q : numpy.ndarray
        ``[total_q, Hq, D]``.
    k, v : numpy.ndarray
        ``[total_k, Hk, D]``, ``Hq % Hk == 0``.
    cu_seqlens_q, cu_seqlens_k : numpy.ndarray
        int32 ``[B + 1]`` prefix sums; sequence ``b`` owns query rows
        ``[cu_seqlens_q[b], cu_seqlens_q[b + 1])`` and key rows likewise. Lengths may be 0.
    indptr : numpy.ndarray
        int32 ``[row_offsets[B] + 1]``, ``row_offsets = bsr_row_offsets(diff(cu_seqlens_q),
        block_m, pattern_heads)``: CSR row pointer over (sequence, pattern head, block row).
    indices : numpy.ndarray
        int32 ``[nnz]``, ``nnz = indptr[-1]``: kept key block ids of each CSR row, in
        ``[0, ceil(kv_len_b / block_n))``, strictly increasing within a row.
    block_m, block_n : int
        Query rows and keys per block.
    pattern_heads : int
        ``H_p`` in ``{Hq, Hk, 1}``; query head ``h`` reads pattern head ``h // (Hq / H_p)``.
    causal, sm_scale, window_left, alibi_slopes, sinks, logits_soft_cap
        As in ``cupaged.reference.attention.attend``, applied inside the kept blocks.

    Returns
    -------
    out : numpy.ndarray
        float64 ``[total_q, Hq, D]``; zeros for a row with no candidate key.
    lse : numpy.ndarray
        float64 ``[total_q, Hq]`` natural-log LSE including the sink; ``-inf`` (or
        ``sink_h``) for a row with no candidate key.
    """
    cu_k = np.asarray(cu_seqlens_k, np.int64)

    def kv_of(b):
        return k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]

    options = dict(sm_scale=sm_scale, alibi_slopes=alibi_slopes, sinks=sinks,
                   logits_soft_cap=logits_soft_cap)
    return _bsr_batch(q, cu_seqlens_q, kv_of, indptr, indices, block_m, block_n,
                      int(pattern_heads), bool(causal), int(window_left), options)


def paged_block_sparse_attention(q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens,
                                 indptr, indices, block_m, block_n, *, pattern_heads,
                                 causal=True, sm_scale=None, window_left=-1, alibi_slopes=None,
                                 sinks=None, logits_soft_cap=0.0, layout="NHD", kv_dtype=None,
                                 k_scale=None, v_scale=None):
    """Batched BSR attention with keys and values in a paged cache.

    Sequence ``b``'s keys are the first ``seq_lens[b]`` tokens of its block table
    (``cupaged.reference.attention.gather_kv``); its queries are the last
    ``q_len_b = diff(cu_seqlens_q)[b]`` positions (``p = seq_lens[b] - q_len_b + i``). The
    cache page size and ``block_n`` are independent: key block ``c`` is keys
    ``[c * block_n, (c + 1) * block_n)`` of the sequence whatever pages hold them.

    Parameters
    ----------
    q : numpy.ndarray
        ``[total_q, Hq, D]``.
    k_cache, v_cache : numpy.ndarray
        Paged caches in ``layout`` (``"NHD"``, ``"HND"`` or ``"vllm"``).
    cu_seqlens_q : numpy.ndarray
        int32 ``[B + 1]``.
    block_tables : numpy.ndarray
        int32 ``[B, max_blocks]``, -1 padded.
    seq_lens : numpy.ndarray
        int32 ``[B]`` key counts: ``kv_len_b``, which sizes ``C_b``.
    indptr, indices, block_m, block_n, pattern_heads
        As in :func:`varlen_block_sparse_attention`.
    causal, sm_scale, window_left, alibi_slopes, sinks, logits_soft_cap
        As in ``cupaged.reference.attention.attend``.
    layout, kv_dtype, k_scale, v_scale
        As in ``cupaged.reference.attention.gather_kv`` (fp8 caches read back in float64).

    Returns
    -------
    out, lse : numpy.ndarray
        float64 ``[total_q, Hq, D]`` and ``[total_q, Hq]``, as in
        :func:`varlen_block_sparse_attention`.
    """
    def kv_of(b):
        return gather_kv(k_cache, v_cache, block_tables[b], int(seq_lens[b]), layout,
                         kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)

    options = dict(sm_scale=sm_scale, alibi_slopes=alibi_slopes, sinks=sinks,
                   logits_soft_cap=logits_soft_cap)
    return _bsr_batch(q, cu_seqlens_q, kv_of, indptr, indices, block_m, block_n,
                      int(pattern_heads), bool(causal), int(window_left), options)
