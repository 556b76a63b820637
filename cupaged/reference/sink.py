"""Reference sink attention: ``sink_softmax`` and the unified ``sink_attention`` of the
sink-attention contract (docs/design.md).

A sink is one extra logit per query head, ``sink_h``, that joins every softmax row as if it
were a key with that score and a zero value: it adds ``exp(sink_h)`` to the denominator
and nothing to the numerator (the math is in :mod:`cupaged.reference.attention`).

``sink_attention`` keeps the contract's API, shapes, mode detection and error messages. Its
masks follow docs/design.md's bottom-right alignment (query ``i`` of a sequence with ``q_len``
queries and ``kv_len`` keys at ``p = kv_len - q_len + i``) in every mode but one: in
``"prefill"`` mode the contract counts the window from the row index ``i`` instead of ``p``
(``j >= i - window_left``), while the causal bound stays ``j <= p``. Prefill mode is meant for
``q_len == kv_len``, where ``i == p`` and the two agree; forcing it with unequal lengths and a
window reproduces the contract's mask. Where the contract's own code fails on bad shapes (a
torch view error, or its auto-detected "incremental" case with flattened ``k``, which its einsum
cannot take), this module raises ``ValueError`` or, for the flattened case, reads ``k`` as
``[batch_size, kv_len, Hk, D]``, the intent the contract states.
"""
from __future__ import annotations

import numpy as np

from .attention import attend_masked, softmax_with_sink, varlen_prefill

MODES = ("auto", "prefill", "incremental", "chunk", "varlen")


def sink_softmax(logits, sinks):
    """Softmax with a sink column appended, the sink column dropped from the result.

    Parameters
    ----------
    logits : numpy.ndarray
        ``[..., H, rows, n]`` (the contract's ``[batch, heads, m, n]``), float dtype; ``-inf``
        entries are hidden keys.
    sinks : numpy.ndarray
        float32 ``[H]`` raw sink logits.

    Returns
    -------
    numpy.ndarray
        ``[..., H, rows, n]`` probabilities ``exp(s_j) / (sum_j exp(s_j) + exp(sink_h))``,
        computed in float64 and returned in logits' dtype (as the contract's ``torch.softmax``).
        Each row sums to ``1 - p_sink``; a finite sink keeps the denominator positive, so a
        row of all ``-inf`` gives zeros (a ``-inf`` sink as well: zeros, where torch gives
        NaN).
    """
    logits = np.asarray(logits)
    probs, _ = softmax_with_sink(logits.astype(np.float64), sinks)
    return probs.astype(logits.dtype)


# ----------------------------------------------------------------------------- modes
def detect_mode(q, k, batch_size=None, qo_indptr=None, kv_indptr=None):
    """The sink-attention contract's ``mode="auto"`` rule.

    ``"varlen"`` when an indptr is given; ``"incremental"`` for ``q`` of rank 3 and ``k``
    of rank 4; for two flattened ``[total, heads, D]`` arrays, with per-sequence lengths
    ``q.shape[0] // batch_size`` and ``k.shape[0] // batch_size``: equal -> ``"prefill"``,
    ``q_len == 1`` -> ``"incremental"``, otherwise ``"chunk"``.

    Raises
    ------
    ValueError
        Without ``batch_size`` for flattened inputs, for ``q_len == 0`` or for other ranks.
    """
    if qo_indptr is not None or kv_indptr is not None:
        return "varlen"
    if q.ndim == 3 and k.ndim == 4:
        return "incremental"
    if q.ndim == 3 and k.ndim == 3:
        if batch_size is None:
            raise ValueError("batch_size is required for auto-detection in prefill/chunk modes")
        qo_len, kv_len = q.shape[0] // batch_size, k.shape[0] // batch_size
        if qo_len == kv_len:
            return "prefill"
        if qo_len == 1:
            return "incremental"
        if qo_len > 1:
            return "chunk"
        raise ValueError(f"Cannot auto-detect mode: qo_len={qo_len}, kv_len={kv_len}")
    raise ValueError(f"Cannot auto-detect mode from tensor shapes: q={tuple(q.shape)}, "
                     f"k={tuple(k.shape)}")


def uniform_length(name, total, batch_size):
    """Tokens per sequence of ``batch_size`` equal sequences laid end to end (``total``)."""
    if batch_size < 1:
        raise ValueError(f"q: expected at least one sequence, got shape [{batch_size}, ...]")
    if total % batch_size:
        raise ValueError(f"{name}: expected a token count divisible by batch_size="
                         f"{batch_size}, got {total}")
    return total // batch_size


def uniform_indptr(batch_size, length):
    """int32 ``[batch_size + 1]`` offsets of equal sequences of ``length`` tokens."""
    return np.arange(batch_size + 1, dtype=np.int32) * length


def _incremental(q, k, v, options):
    """q ``[B, Hq, D]``, k/v ``[B, L, Hk, D]`` (or flattened ``[B * L, Hk, D]``)."""
    batch = q.shape[0]
    if k.ndim == 3:
        kv_len = uniform_length("k", k.shape[0], batch)
        k, v = (x.reshape(batch, kv_len, *x.shape[1:]) for x in (k, v))
    if k.ndim != 4 or k.shape[0] != batch:
        raise ValueError(f"k: expected [{batch}, kv_len, num_kv_heads, head_dim] for "
                         f"incremental mode, got {tuple(k.shape)}")
    kv_len = k.shape[1]
    flat = (x.reshape(batch * kv_len, *x.shape[2:]) for x in (k, v))
    return varlen_prefill(q, *flat, uniform_indptr(batch, 1),
                          uniform_indptr(batch, kv_len), **options)


def _prefill_row_window(q, k, v, batch_size, qo_len, kv_len, options):
    """Prefill mode with a window and ``qo_len != kv_len``: the window counts from row ``i``."""
    causal, window_left = options["causal"], options["window_left"]
    i = np.arange(qo_len)[:, None]
    j = np.arange(kv_len)[None, :]
    visible = j >= i - window_left
    if causal:
        visible &= j <= i + (kv_len - qo_len)
    out = np.empty(q.shape, dtype=np.float64)
    for b in range(batch_size):
        rows, keys = slice(b * qo_len, (b + 1) * qo_len), slice(b * kv_len, (b + 1) * kv_len)
        out[rows], _ = attend_masked(q[rows], k[keys], v[keys], visible,
                                     sm_scale=options["sm_scale"], sinks=options["sinks"])
    return out.astype(q.dtype)


def _flattened(q, k, v, batch_size, mode, options):
    """Prefill and chunk modes: q ``[B * qo_len, Hq, D]``, k/v ``[B * kv_len, Hk, D]``."""
    if batch_size is None:
        raise ValueError(f"batch_size is required for {mode} mode")
    qo_len = uniform_length("q", q.shape[0], batch_size)
    kv_len = uniform_length("k", k.shape[0], batch_size)
    if mode == "prefill" and options["window_left"] >= 0 and qo_len != kv_len:
        return _prefill_row_window(q, k, v, batch_size, qo_len, kv_len, options)
    return varlen_prefill(q, k, v, uniform_indptr(batch_size, qo_len),
                          uniform_indptr(batch_size, kv_len), **options)


def sink_attention(q, k, v, sink, window_left, causal, sm_scale, batch_size=None, mode="auto",
                   qo_indptr=None, kv_indptr=None):
    """The sink-attention contract's unified sink attention: prefill, incremental, chunk and varlen modes.

    Parameters
    ----------
    q : numpy.ndarray
        ``[total_q, Hq, D]`` (prefill, chunk, varlen) or ``[B, Hq, D]`` (incremental).
    k, v : numpy.ndarray
        ``[total_kv, Hk, D]``, or ``[B, kv_len, Hk, D]`` for incremental mode;
        ``Hq % Hk == 0``, query head ``h`` reads kv head ``h // (Hq // Hk)``.
    sink : numpy.ndarray
        float32 ``[Hq]`` raw sink logits.
    window_left : int
        ``w >= 0`` hides keys ``j < p - w`` (prefill mode: ``j < i - w``); -1 for none.
    causal : bool
        Hide keys ``j > p``. Incremental rows see every key either way.
    sm_scale : float or None
        Score scale; None means ``D ** -0.5``.
    batch_size : int, optional
        Number of equal-length sequences in prefill and chunk modes (and to auto-detect
        them); ``q.shape[0]`` in incremental mode, ``len(qo_indptr) - 1`` in varlen mode.
    mode : {"auto", "prefill", "incremental", "chunk", "varlen"}
        See :func:`detect_mode` for ``"auto"``. Prefill: ``qo_len == kv_len``; chunk:
        the queries are the last ``qo_len`` of ``kv_len`` positions; varlen: ragged.
    qo_indptr, kv_indptr : numpy.ndarray, optional
        int32 ``[B + 1]`` prefix sums of query and kv lengths (varlen mode).

    Returns
    -------
    numpy.ndarray
        ``[total_q, Hq, D]`` (or ``[B, Hq, D]``) in q's dtype.

    Raises
    ------
    ValueError
        With the sink-attention contract's messages: unknown mode, missing ``batch_size``
        or indptrs, shapes auto-detection cannot read; and for token counts not divisible
        by ``batch_size``.
    """
    if mode == "auto":
        mode = detect_mode(q, k, batch_size, qo_indptr, kv_indptr)
    options = dict(causal=causal, sm_scale=sm_scale, window_left=window_left, sinks=sink)
    if mode == "incremental":
        return _incremental(q, k, v, options)
    if mode in ("prefill", "chunk"):
        return _flattened(q, k, v, batch_size, mode, options)
    if mode == "varlen":
        if qo_indptr is None or kv_indptr is None:
            raise ValueError("qo_indptr and kv_indptr are required for varlen mode")
        return varlen_prefill(q, k, v, qo_indptr, kv_indptr, **options)
    raise ValueError(f"Unknown mode: {mode}. Supported modes: "
                     + ", ".join(repr(m) for m in MODES))
