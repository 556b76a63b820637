"""Reference rotary position embedding (RoPE), in float64 from the math.

For an even rotary dimension ``rd`` and base ``b``, frequency ``f`` in ``[0, rd / 2)`` is
``inv_freq[f] = b ** (-2 f / rd)`` and a token at position ``p`` turns pair ``f`` by the angle
``theta = t(p) * inv_freq[f]``: the pair ``(x1, x2)``, read as the complex number
``x1 + i x2``, is multiplied by ``exp(i theta)``, i.e.
``(x1, x2) -> (x1 cos(theta) - x2 sin(theta), x2 cos(theta) + x1 sin(theta))``.
Dimensions ``[rd, head_dim)`` pass through unchanged.

Pairs (the vLLM layer contract's two styles):

- neox (``is_neox=True``, "rotate halves"): pair ``f`` is ``(x[f], x[f + rd / 2])``;
- GPT-J (``is_neox=False``, interleaved): pair ``f`` is ``(x[2 f], x[2 f + 1])``.

Scaling (``scaling={"type": ..., "factor": s}``), with ``M = max_position`` the model's
original context length:

- none: ``t(p) = p``;
- ``"linear"``: ``t(p) = p / s`` (position interpolation);
- ``"dynamic"`` (dynamic NTK, as vLLM's DynamicNTKScalingRotaryEmbedding): positions are
  not divided; the base grows to ``b' = b * (s * L / M - (s - 1)) ** (rd / (rd - 2))``
  with ``L = int(M * s)`` the length of the extended table, so positions up to ``L`` keep
  their low frequencies inside the trained range. ``max_position`` is required.
"""
from __future__ import annotations

import numpy as np


def scaling_kind(scaling):
    """``(type, factor)`` of a scaling dict; ``("none", 1.0)`` for None."""
    if scaling is None:
        return "none", 1.0
    return scaling["type"], float(scaling["factor"])


def table_length(scaling, max_position):
    """Positions a model's table covers: ``int(max_position * factor)``; None if unbounded."""
    if max_position is None:
        return None
    _, factor = scaling_kind(scaling)
    return int(max_position * factor)


def inv_frequencies(rotary_dim, base=10000.0, scaling=None, max_position=None):
    """Angular frequencies per unit of ``t(p)``, float64 ``[rotary_dim // 2]``."""
    kind, factor = scaling_kind(scaling)
    if kind == "dynamic":
        length = table_length(scaling, max_position)
        growth = factor * length / max_position - (factor - 1)
        base = base * growth ** (rotary_dim / (rotary_dim - 2))
    return float(base) ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


def rope_angles(positions, rotary_dim, base=10000.0, scaling=None, max_position=None):
    """Rotation angles ``theta[t, f]``, float64 ``[num_tokens, rotary_dim // 2]``.

    Parameters
    ----------
    positions : numpy.ndarray
        int32/int64 ``[num_tokens]`` absolute positions.
    rotary_dim : int
        Even number of rotated dimensions.
    base : float
        Frequency base ``b``.
    scaling : dict, optional
        ``{"type": "linear" | "dynamic", "factor": s}``.
    max_position : int, optional
        Original context length ``M`` (needed by dynamic scaling).
    """
    kind, factor = scaling_kind(scaling)
    t = np.asarray(positions, dtype=np.float64)
    if kind == "linear":
        t = t / factor
    return t[:, None] * inv_frequencies(rotary_dim, base, scaling, max_position)[None, :]


def pair_indices(rotary_dim, is_neox):
    """Indices ``(first, second)`` of the rotated pairs, each int ``[rotary_dim // 2]``."""
    half = rotary_dim // 2
    if is_neox:
        return np.arange(half), np.arange(half) + half
    return np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2)


def rotate(x, angles, rotary_dim, is_neox=True):
    """Rotate ``x`` ``[num_tokens, heads, head_dim]`` by ``angles`` ``[num_tokens, rd // 2]``.

    Returns float64 ``[num_tokens, heads, head_dim]``; dimensions past ``rotary_dim`` copied.
    """
    out = np.asarray(x, dtype=np.float64).copy()
    first, second = pair_indices(rotary_dim, is_neox)
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    x1, x2 = out[..., first].copy(), out[..., second].copy()
    out[..., first] = x1 * cos - x2 * sin
    out[..., second] = x2 * cos + x1 * sin
    return out


def apply_rope(positions, q, k, *, rotary_dim=None, base=10000.0, is_neox=True, scaling=None,
               max_position=None):
    """Rotary embedding of queries and keys.

    Parameters
    ----------
    positions : numpy.ndarray
        int32/int64 ``[num_tokens]``.
    q : numpy.ndarray
        ``[num_tokens, num_q_heads, head_dim]``.
    k : numpy.ndarray
        ``[num_tokens, num_kv_heads, head_dim]``.
    rotary_dim : int, optional
        Rotated leading dimensions (default ``head_dim``).
    base, is_neox, scaling, max_position
        As in the module docstring.

    Returns
    -------
    q_out, k_out : numpy.ndarray
        Same shapes and dtypes as ``q`` and ``k`` (computed in float64, rounded once).
    """
    rd = q.shape[-1] if rotary_dim is None else rotary_dim
    angles = rope_angles(positions, rd, base, scaling, max_position)
    return (rotate(q, angles, rd, is_neox).astype(q.dtype),
            rotate(k, angles, rd, is_neox).astype(k.dtype))
