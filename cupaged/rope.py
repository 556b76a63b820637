"""Rotary position embedding (RoPE) of queries and keys: ``apply_rope``.

The math (pair styles, linear and dynamic-NTK scaling) is in :mod:`cupaged.reference.rope`,
which also runs NumPy inputs. On CuPy one kernel launch rotates ``q`` and ``k`` together,
reading each token's angles from a float32 cos/sin table that is built once (on the device,
in float64) per (rotary_dim, base, scaling, max_position, device) and then reused by every
call and every layer.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ._arrays import (FLOAT_DTYPES, accepts_dlpack, array_module, check_array, check_range,
                      host)
from ._compile import Spec, ctype, get_kernel
from .reference import rope as ref

SCALING_TYPES = ("linear", "dynamic")
_THREADS = 256
_MIN_TABLE = 4096


class RopePlan(NamedTuple):
    """Validated arguments of one ``apply_rope`` call."""
    num_tokens: int
    head_dim: int
    rotary_dim: int
    base: float
    is_neox: bool
    scaling: dict | None
    max_position: int | None
    max_pos_seen: int       # largest position in ``positions`` (-1 when empty)


# ----------------------------------------------------------------------------- checks
def check_scaling(scaling, max_position, rotary_dim):
    """Validate ``scaling``; return it as ``{"type": ..., "factor": float}`` or None."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict) or "type" not in scaling or "factor" not in scaling:
        raise ValueError(f"scaling: expected None or {{'type': 'linear'|'dynamic', 'factor': f}}, "
                         f"got {scaling!r}")
    kind, factor = scaling["type"], scaling["factor"]
    if kind not in SCALING_TYPES:
        raise ValueError(f"scaling: unknown RoPE scaling type {kind!r}; expected one of {SCALING_TYPES}")
    if not isinstance(factor, (int, float, np.floating)) or not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"scaling: expected a finite factor > 0, got {factor!r}")
    if kind == "dynamic":
        if max_position is None:
            raise ValueError("max_position: dynamic scaling needs the original context length, got None")
        if rotary_dim <= 2:
            raise ValueError(f"rotary_dim: dynamic scaling needs rotary_dim > 2, got {rotary_dim}")
    return {"type": kind, "factor": float(factor)}


def _as_heads(name, x, head_dim, tokens):
    """View ``x`` ``[T, H, D]`` or ``[T, H * D]`` as ``[T, H, D]``."""
    if x.ndim == 3:
        check_array(name, x, shape=(tokens, None, head_dim))
        return x
    if x.shape[1] % head_dim:
        raise ValueError(f"{name}: expected [num_tokens, num_heads * {head_dim}], got {tuple(x.shape)}")
    return x.reshape(tokens, x.shape[1] // head_dim, head_dim)


def plan_rope(positions, q, k, rotary_dim, base, is_neox, scaling, max_position, head_dim, xp):
    """Check every argument of :func:`apply_rope`; return the plan and 3-D views of q, k."""
    check_array("positions", positions, ndim=1, dtypes=(np.int32, np.int64), xp=xp)
    tokens = int(positions.shape[0])
    for name, x in (("q", q), ("k", k)):
        check_array(name, x, dtypes=FLOAT_DTYPES, xp=xp)
        if x.ndim not in (2, 3) or x.shape[0] != tokens:
            raise ValueError(f"{name}: expected [{tokens}, num_heads, head_dim] or "
                             f"[{tokens}, num_heads * head_dim], got {tuple(x.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"k: expected dtype {q.dtype} like q, got {k.dtype}")
    if head_dim is None:
        if q.ndim == 2 or k.ndim == 2:
            raise ValueError("head_dim: required for flattened [num_tokens, num_heads * head_dim] inputs, got None")
        head_dim = int(q.shape[2])
    if not isinstance(head_dim, (int, np.integer)) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim: expected an even int >= 2, got {head_dim!r}")
    q3, k3 = _as_heads("q", q, head_dim, tokens), _as_heads("k", k, head_dim, tokens)
    rd = head_dim if rotary_dim is None else rotary_dim
    if not isinstance(rd, (int, np.integer)) or rd < 2 or rd % 2 or rd > head_dim:
        raise ValueError(f"rotary_dim: expected an even int in [2, {head_dim}], got {rotary_dim!r}")
    if not isinstance(base, (int, float, np.floating)) or not math.isfinite(base) or base <= 0:
        raise ValueError(f"base: expected a finite float > 0, got {base!r}")
    if max_position is not None and (not isinstance(max_position, (int, np.integer)) or max_position < 1):
        raise ValueError(f"max_position: expected None or an int >= 1, got {max_position!r}")
    scaling = check_scaling(scaling, max_position, int(rd))
    pos = host(positions)
    limit = ref.table_length(scaling, max_position)
    check_range("positions", pos, 0, np.iinfo(np.int64).max if limit is None else limit)
    plan = RopePlan(tokens, int(head_dim), int(rd), float(base), bool(is_neox), scaling,
                    None if max_position is None else int(max_position),
                    int(pos.max()) if tokens else -1)
    return plan, q3, k3


# ----------------------------------------------------------------------------- cos/sin table
_TABLES = {}


def _table_key(plan, device_id):
    kind, factor = ref.scaling_kind(plan.scaling)
    return (plan.rotary_dim, plan.base, kind, factor, plan.max_position, device_id)


def _build_table(plan, length):
    """float32 ``[length, rd]`` cos then sin of the angles, computed in float64 on the device."""
    import cupy
    rd, half = plan.rotary_dim, plan.rotary_dim // 2
    kind, factor = ref.scaling_kind(plan.scaling)
    base = plan.base
    if kind == "dynamic":
        growth = factor * length / plan.max_position - (factor - 1)
        base = base * growth ** (rd / (rd - 2))
    inv_freq = cupy.asarray(base ** (-np.arange(0, rd, 2, dtype=np.float64) / rd))
    table = cupy.empty((length, rd), dtype=cupy.float32)
    step = max(1, (1 << 24) // rd)  # bounds the float64 temporaries
    for start in range(0, length, step):
        t = cupy.arange(start, min(start + step, length), dtype=cupy.float64)
        angles = (t / factor if kind == "linear" else t)[:, None] * inv_freq[None, :]
        table[start:start + len(t), :half] = cupy.cos(angles)
        table[start:start + len(t), half:] = cupy.sin(angles)
    return table


def rope_table(plan):
    """The cached device table covering every position of ``plan``.

    With ``max_position`` the table has the model's fixed length ``int(max_position *
    factor)``; without it, it grows in powers of two (at least 4096 rows) as larger
    positions arrive.
    """
    import cupy
    key = _table_key(plan, cupy.cuda.Device().id)
    fixed = ref.table_length(plan.scaling, plan.max_position)
    cached = _TABLES.get(key)
    if cached is None or cached.shape[0] <= plan.max_pos_seen:
        length = fixed if fixed is not None else max(_MIN_TABLE, 1 << max(plan.max_pos_seen, 0).bit_length())
        cached = _TABLES[key] = _build_table(plan, length)
    return cached


# ----------------------------------------------------------------------------- kernel
def _vector_width(plan, dtype, arrays):
    """16-byte vectors where the rotated halves/pairs and every row are aligned, else scalar."""
    vec = 16 // np.dtype(dtype).itemsize
    rotated = plan.rotary_dim // 2 if plan.is_neox else plan.rotary_dim
    aligned = all(a.data.ptr % 16 == 0 for a in arrays)
    if aligned and rotated % vec == 0 and plan.head_dim % vec == 0:
        return vec
    return 1 if plan.is_neox else 2


def _launch(plan, positions, q, k, q_out, k_out):
    if plan.num_tokens == 0:
        return
    vec = _vector_width(plan, q.dtype, (q, k, q_out, k_out))
    rotated = plan.rotary_dim // 2 if plan.is_neox else plan.rotary_dim
    rot_units = rotated // vec
    pass_units = 0 if q_out is q else (plan.head_dim - plan.rotary_dim) // vec
    q_heads, k_heads = q.shape[1], k.shape[1]
    total = plan.num_tokens * (q_heads + k_heads) * (rot_units + pass_units)
    if total == 0:
        return
    kern = get_kernel("rope", _expr(q.dtype, plan.is_neox, vec))
    kern((-(-total // _THREADS),), (_THREADS,),
         (positions, np.int32(positions.dtype == np.int64), rope_table(plan), q, k, q_out, k_out,
          np.int64(plan.num_tokens), np.int32(q_heads), np.int32(k_heads),
          np.int32(plan.head_dim), np.int32(plan.rotary_dim), np.int32(rot_units),
          np.int32(pass_units)))


def _expr(dtype, is_neox, vec):
    return f"cupaged::rope_kernel<{ctype(dtype)}, {'true' if is_neox else 'false'}, {vec}>"


def kernel_specializations():
    """Every rope kernel ``apply_rope`` can launch: dtype x style x (16-byte, scalar)."""
    specs = []
    for dt in FLOAT_DTYPES:
        for neox in (True, False):
            for vec in (16 // dt.itemsize, 1 if neox else 2):
                specs.append(Spec("rope", _expr(dt, neox, vec)))
    return specs


# ----------------------------------------------------------------------------- public op
@accepts_dlpack
def apply_rope(positions, q, k, *, rotary_dim=None, base=10000.0, is_neox=True, scaling=None,
               max_position=None, head_dim=None, inplace=False):
    """Rotary position embedding of queries and keys.

    Parameters
    ----------
    positions : array
        int32 or int64 ``[num_tokens]`` absolute positions, ``>= 0`` (and
        ``< int(max_position * factor)`` when ``max_position`` is given).
    q : array
        ``[num_tokens, num_q_heads, head_dim]`` or ``[num_tokens, num_q_heads * head_dim]``,
        float16, bfloat16 or float32, C-contiguous.
    k : array
        ``[num_tokens, num_kv_heads, head_dim]`` or flattened likewise; q's dtype.
    rotary_dim : int, optional
        Even number of leading dimensions rotated (default ``head_dim``); the rest pass
        through.
    base : float
        Frequency base: pair ``f`` turns by ``t(p) * base ** (-2 f / rotary_dim)``.
    is_neox : bool
        True: neox style, pairs ``(x[f], x[f + rotary_dim / 2])``; False: GPT-J style,
        interleaved pairs ``(x[2f], x[2f + 1])``.
    scaling : dict, optional
        ``{"type": "linear", "factor": s}`` divides positions by ``s``;
        ``{"type": "dynamic", "factor": s}`` (dynamic NTK, as vLLM) grows the base to
        ``base * (s * L / max_position - (s - 1)) ** (rotary_dim / (rotary_dim - 2))``
        with ``L = int(max_position * s)``; needs ``max_position``.
    max_position : int, optional
        The model's original context length; bounds the positions and sizes the cached
        cos/sin table (grown on demand when None).
    head_dim : int, optional
        Needed when ``q`` or ``k`` is flattened ``[num_tokens, heads * head_dim]``.
    inplace : bool
        False (default): return new arrays. True: overwrite ``q`` and ``k`` and return them.

    Returns
    -------
    q_out, k_out : array
        Shapes and dtype of ``q`` and ``k``.

    Raises
    ------
    ValueError, TypeError
        On bad shapes, dtypes, mixed array modules, non-contiguous inputs, odd or
        oversized ``rotary_dim``, a bad ``scaling`` or out-of-range positions.
    """
    xp = array_module(positions, q, k)
    plan, q3, k3 = plan_rope(positions, q, k, rotary_dim, base, is_neox, scaling, max_position,
                             head_dim, xp)
    if xp is np:
        rq, rk = ref.apply_rope(positions, q3, k3, rotary_dim=plan.rotary_dim, base=plan.base,
                                is_neox=plan.is_neox, scaling=plan.scaling,
                                max_position=plan.max_position)
        q_out, k_out = (q3, k3) if inplace else (np.empty_like(q3), np.empty_like(k3))
        q_out[...], k_out[...] = rq, rk
    else:
        q_out, k_out = (q3, k3) if inplace else (xp.empty_like(q3), xp.empty_like(k3))
        _launch(plan, positions, q3, k3, q_out, k_out)
    return q_out.reshape(q.shape), k_out.reshape(k.shape)
