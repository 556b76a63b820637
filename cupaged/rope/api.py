"""Rotary position embedding (RoPE) of queries and keys: ``apply_rope``.

The math (pair styles, linear and dynamic-NTK scaling) is in :mod:`cupaged.reference.rope`,
which also runs NumPy inputs. On CuPy one kernel launch rotates ``q`` and ``k`` together,
forming each token's angles from its position and the float64 frequencies (scaling folded
in; kept on the device per rotary_dim, base, scaling, max_position and device), so that
no table bounds the positions and the host never reads them: a position out of range
(negative, or past ``int(max_position * factor)``) is reported to the device error word
(``cupaged.errors``) and its rows come out as zeros, or refused on the host first in
strict mode and for host positions.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ..core import abi, errors
from ..core.arrays import (FLOAT_DTYPES, CallCache, accepts_dlpack, array_module, check_array,
                           check_range, empty, host, hot)
from ..core.checks import token_stride
from ..core.compile import Spec, ctype, launcher
from ..core.device import owned_array
from ..core.launch import current_stream, ptr
from ..reference import rope as ref

SCALING_TYPES = ("linear", "dynamic")
THREADS = 256  # rope_kernel's block (ROPE_THREADS of the generated abi.cuh: cpp())


def cpp() -> str:
    """C++ of the RoPE kernel's constants for the generated ``abi.cuh``."""
    return abi.constants(None, dict(ROPE_THREADS=THREADS))


class RopePlan(NamedTuple):
    """Validated arguments of one ``apply_rope`` call."""
    num_tokens: int
    head_dim: int
    rotary_dim: int
    base: float
    is_neox: bool
    scaling: dict | None
    max_position: int | None
    limit: int              # positions must lie below this (-1: no bound)


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
    """View ``x`` ``[T, H, D]`` or ``[T, H * D]`` as ``[T, H, D]`` (token rows may be
    strided, heads dense)."""
    if x.ndim == 3:
        check_array(name, x, shape=(tokens, None, head_dim), contiguous=False)
    else:
        if x.shape[1] % head_dim:
            raise ValueError(f"{name}: expected [num_tokens, num_heads * {head_dim}], got {tuple(x.shape)}")
        if x.shape[1] > 1 and x.strides[1] != x.itemsize:
            raise ValueError(f"{name}: expected a contiguous last dimension, got strides {x.strides}")
        xp = np if isinstance(x, np.ndarray) else __import__("cupy")
        x = xp.lib.stride_tricks.as_strided(
            x, (tokens, x.shape[1] // head_dim, head_dim),
            (x.strides[0], head_dim * x.itemsize, x.itemsize))
    token_stride(name, x)
    return x


def plan_rope(positions, q, k, rotary_dim, base, is_neox, scaling, max_position, head_dim, xp,
              validate=None):
    """Check every argument of :func:`apply_rope` (device positions' values only in strict
    mode); return the plan and 3-D views of q, k."""
    check_array("positions", positions, ndim=1, dtypes=(np.int32, np.int64), xp=xp)
    tokens = int(positions.shape[0])
    for name, x in (("q", q), ("k", k)):
        check_array(name, x, dtypes=FLOAT_DTYPES, xp=xp, contiguous=False)
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
    limit = ref.table_length(scaling, max_position)
    if xp is np or errors.strict(validate):
        check_range("positions", host(positions), 0,
                    np.iinfo(np.int64).max if limit is None else limit)
    plan = RopePlan(tokens, int(head_dim), int(rd), float(base), bool(is_neox), scaling,
                    None if max_position is None else int(max_position),
                    -1 if limit is None else limit)
    return plan, q3, k3


# ----------------------------------------------------------------------------- frequencies
_FREQUENCIES = {}


def frequencies(plan):
    """float64 ``[rotary_dim // 2]`` device frequencies of ``plan`` per unit position (linear
    scaling folded in), cached per device on their own allocation (``owned_array``: a table
    first made under a caller's transient pool, such as a CUDA graph's, must outlive it)."""
    import cupy
    kind, factor = ref.scaling_kind(plan.scaling)
    key = (plan.rotary_dim, plan.base, kind, factor, plan.max_position,
           cupy.cuda.runtime.getDevice())
    f = _FREQUENCIES.get(key)
    if f is None:
        inv = ref.inv_frequencies(plan.rotary_dim, plan.base, plan.scaling, plan.max_position)
        f = owned_array(inv.size, np.float64)
        f.set(inv / factor if kind == "linear" else inv)
        _FREQUENCIES[key] = f
    return f


# ----------------------------------------------------------------------------- kernel
def _vector_width(plan, dtype, arrays):
    """16-byte vectors where the rotated halves/pairs and every row are aligned, else scalar."""
    vec = 16 // np.dtype(dtype).itemsize
    rotated = plan.rotary_dim // 2 if plan.is_neox else plan.rotary_dim
    aligned = all(a.data.ptr % 16 == 0 and (a.shape[0] < 2 or a.strides[0] % 16 == 0)
                  for a in arrays)
    if aligned and rotated % vec == 0 and plan.head_dim % vec == 0:
        return vec
    return 1 if plan.is_neox else 2


def _setup(plan, positions, q, k, q_out, k_out):
    """(launch, Bound) of a rotation of this shape (None: nothing to rotate)."""
    if plan.num_tokens == 0:
        return None
    vec = _vector_width(plan, q.dtype, (q, k, q_out, k_out))
    rotated = plan.rotary_dim // 2 if plan.is_neox else plan.rotary_dim
    rot_units = rotated // vec
    pass_units = 0 if q_out is q else (plan.head_dim - plan.rotary_dim) // vec
    q_heads, k_heads = q.shape[1], k.shape[1]
    total = plan.num_tokens * (q_heads + k_heads) * (rot_units + pass_units)
    if total == 0:
        return None
    return (launcher("rope", _expr(q.dtype, plan.is_neox, vec), abi.ROPE).at(
                -(-total // THREADS), THREADS),
            abi.ROPE.bind(
                positions_are_64bit=int(positions.dtype == np.int64),
                inv_freq=ptr(frequencies(plan)), err=ptr(errors.error_word()),
                num_tokens=plan.num_tokens, max_positions=plan.limit, q_tok=token_stride("q", q),
                k_tok=token_stride("k", k), qo_tok=token_stride("q_out", q_out),
                ko_tok=token_stride("k_out", k_out), q_heads=q_heads, k_heads=k_heads,
                head_dim=plan.head_dim, rotary_dim=plan.rotary_dim, rot_units=rot_units,
                pass_units=pass_units))


def _launch(setup, positions, q, k, q_out, k_out, stream):
    """The rotation of a setup (None: nothing to rotate); the arrays by address."""
    if setup is not None:
        go, args = setup
        go(args.pack(positions=positions, q=q, k=k, q_out=q_out, k_out=k_out), stream)


_CALLS = CallCache()  # rotations by Hot.key: (setup, dtype)


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
def apply_rope(positions, q, k, *, rotary_dim=None, base=10000.0, is_neox=True, scaling=None,
               max_position=None, head_dim=None, inplace=False, validate=None):
    """Rotary position embedding of queries and keys.

    Parameters
    ----------
    positions : array
        int32 or int64 ``[num_tokens]`` absolute positions, ``>= 0`` (and
        ``< int(max_position * factor)`` when ``max_position`` is given).
    q : array
        ``[num_tokens, num_q_heads, head_dim]`` or ``[num_tokens, num_q_heads * head_dim]``,
        float16, bfloat16 or float32; heads dense, token rows may be strided (a view of a
        fused qkv tensor).
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
        The model's original context length; positions must lie below
        ``int(max_position * factor)``.
    head_dim : int, optional
        Needed when ``q`` or ``k`` is flattened ``[num_tokens, heads * head_dim]``.
    inplace : bool
        False (default): return new arrays. True: overwrite ``q`` and ``k`` and return them.
    validate : bool, optional
        Check device positions on the host first (strict mode, default ``CUPAGED_STRICT``);
        otherwise the kernel reports a bad one and zeroes its rows.

    Returns
    -------
    q_out, k_out : array
        Shapes and dtype of ``q`` and ``k``.

    Raises
    ------
    ValueError, TypeError
        On bad shapes, dtypes, mixed array modules, heads that are not dense, odd or
        oversized ``rotary_dim``, a bad ``scaling``, or out-of-range host positions.
    """
    options = (rotary_dim, base, is_neox,
               None if scaling is None else tuple(sorted(scaling.items())), max_position,
               head_dim, inplace)
    call = hot(errors.strict(validate), (positions, q, k), *options)
    if call is not None:
        hit = _CALLS.get(call.key)
        if hit is not None:  # checked and set up by an earlier call of this signature
            setup, dtype = hit
            pos, qp, kp = call.ptrs
            if inplace:
                q_out, k_out, qo, ko = q, k, qp, kp
            else:
                (q_out, qo), (k_out, ko) = call.empty(q.shape, dtype), call.empty(k.shape, dtype)
            _launch(setup, pos, qp, kp, qo, ko, call.stream)
            return call.done((q_out, k_out))
    return _rope_checked(positions, q, k, rotary_dim, base, is_neox, scaling, max_position,
                         head_dim, inplace, validate, call.key if call is not None else None)


@accepts_dlpack
def _rope_checked(positions, q, k, rotary_dim, base, is_neox, scaling, max_position, head_dim,
                  inplace, validate, cache_key):
    """apply_rope's checks, its setup (cached under ``cache_key`` for 3-D q and k) and
    its launch."""
    xp = array_module(positions, q, k)
    plan, q3, k3 = plan_rope(positions, q, k, rotary_dim, base, is_neox, scaling, max_position,
                             head_dim, xp, validate)
    if xp is np:
        rq, rk = ref.apply_rope(positions, q3, k3, rotary_dim=plan.rotary_dim, base=plan.base,
                                is_neox=plan.is_neox, scaling=plan.scaling,
                                max_position=plan.max_position)
        q_out, k_out = (q3, k3) if inplace else (np.empty_like(q3), np.empty_like(k3))
        q_out[...], k_out[...] = rq, rk
    else:
        q_out, k_out = ((q3, k3) if inplace else
                        (empty(xp, q3.shape, q3.dtype), empty(xp, k3.shape, k3.dtype)))
        setup = _setup(plan, positions, q3, k3, q_out, k_out)
        if q.ndim == 3 and k.ndim == 3:
            _CALLS.put(cache_key, (setup, q.dtype))
        _launch(setup, *(ptr(a) for a in (positions, q3, k3, q_out, k_out)), current_stream())
    if inplace:
        return q, k
    return q_out.reshape(q.shape), k_out.reshape(k.shape)
