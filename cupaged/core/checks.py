"""Argument checks shared by the attention ops (decode, prefill, sink, sparse).

Each check raises ValueError/TypeError naming the argument, the expected and the actual
value. Shapes, dtypes, devices and options are checked always. The contents of index
arrays are checked here when they are host (NumPy) arrays, or device arrays in strict mode
(``cupaged.errors.strict``: one host copy, a sync); otherwise the kernels check them
(``contents=False``: nothing read).
"""
from __future__ import annotations

import math
import operator
from typing import NamedTuple

import numpy as np

from .arrays import FLOAT_DTYPES, check_array, check_head_dim, check_range, host


INT32_MAX = 2**31 - 1  # kernels offset within a cache block and count in 32-bit ints


def check_int(name, value, minimum=1, maximum=None):
    """An int (NumPy ints included, bools not) of at least ``minimum`` (and at most
    ``maximum``), returned as an int.

    Raises TypeError for a non-int, ValueError for one out of range."""
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {value!r}") from None
    if number < minimum or (maximum is not None and number > maximum):
        want = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name}: expected an int {want}, got {value!r}")
    return number


def check_aligned(**arrays):
    """Arrays a kernel reads with 16-byte vector loads (CuPy, or pinned NumPy the kernel reads
    through its device alias) must start at a 16-byte aligned address; None and empty arrays
    pass, as do NumPy arrays (the reference backend reads them)."""
    for name, a in arrays.items():
        if a is None or not a.size:
            continue
        address = a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr
        if address % 16:
            raise ValueError(f"{name}: expected a 16-byte aligned data pointer, "
                             f"got {address:#x}")


def check_block_elements(geometry, **caches):
    """A cache block (``block_size * num_kv_heads * head_dim`` elements) and, for each of
    ``caches``, the distance from one block to the next must stay within 2^31 - 1 elements:
    kernels take in-block offsets and block strides as 32-bit ints."""
    n = geometry.block_size * geometry.num_kv_heads * geometry.head_dim
    if n > INT32_MAX:
        raise ValueError(f"k_cache: expected a cache block of at most {INT32_MAX} elements, got {n}")
    for name, cache in caches.items():
        stride = cache.strides[0] // cache.itemsize
        if stride > INT32_MAX:
            raise ValueError(f"{name}: expected blocks at most {INT32_MAX} elements apart, got "
                             f"a block stride of {stride}")


class AttentionOptions(NamedTuple):
    """Scalar and per-head options after validation (``sm_scale`` resolved)."""
    sm_scale: float
    window_left: int
    alibi_slopes: object  # float32 [num_q_heads] or None
    sinks: object         # float32 [num_q_heads] or None
    logits_soft_cap: float


def check_options(xp, num_q_heads, head_dim, *, sm_scale=None, window_left=-1,
                  alibi_slopes=None, sinks=None, logits_soft_cap=0.0) -> AttentionOptions:
    """Validate the options every attention op takes; resolve ``sm_scale``."""
    if sm_scale is None:
        sm_scale = head_dim ** -0.5
    if not isinstance(sm_scale, (int, float, np.floating)) or not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale: expected a finite float, got {sm_scale!r}")
    if not isinstance(window_left, (int, np.integer)) or window_left < -1:
        raise ValueError(f"window_left: expected an int >= -1 (-1: no window), got {window_left!r}")
    if (not isinstance(logits_soft_cap, (int, float, np.floating))
            or not math.isfinite(logits_soft_cap) or logits_soft_cap < 0):
        raise ValueError(f"logits_soft_cap: expected a finite float >= 0 (0: off), got {logits_soft_cap!r}")
    for name, arr in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if arr is not None:
            check_array(name, arr, shape=(num_q_heads,), dtypes=np.float32, xp=xp)
    return AttentionOptions(float(sm_scale), int(window_left), alibi_slopes, sinks,
                            float(logits_soft_cap))


def token_stride(name, x):
    """Elements from one token's rows to the next of ``x`` ``[tokens, heads, head_dim]``,
    whose heads must be dense (views of a fused qkv tensor qualify: ``qkv.split``,
    ``qkv.unbind(1)``); device rows must also start 16 bytes apart."""
    item = x.itemsize
    if x.ndim != 3:
        raise ValueError(f"{name}: expected 3 dimensions, got shape {tuple(x.shape)}")
    _, h, d = x.shape
    if x.size == 0:
        return h * d
    if (d > 1 and x.strides[2] != item) or (h > 1 and x.strides[1] != d * item):
        raise ValueError(f"{name}: expected dense heads [.., heads, head_dim] (strides "
                         f"({d * item}, {item}) bytes), got strides {x.strides}")
    stride = x.strides[0] if x.shape[0] > 1 else h * d * item
    if stride % item or stride < 0:
        raise ValueError(f"{name}: expected a token stride of whole elements, got {stride} bytes")
    if not isinstance(x, np.ndarray) and stride % 16:
        raise ValueError(f"{name}: expected token rows 16 bytes apart or a multiple of it, got "
                         f"{stride} bytes")
    return stride // item


def check_query(name, q, xp, ndim=3):
    """Validate a query ``[tokens, num_q_heads, head_dim]`` (token rows may be strided:
    :func:`token_stride`); return its shape."""
    check_array(name, q, ndim=ndim, dtypes=FLOAT_DTYPES, xp=xp, contiguous=False)
    check_head_dim(f"{name}.shape[-1]", q.shape[-1])
    if ndim == 3:
        token_stride(name, q)
    return tuple(int(s) for s in q.shape)


def check_gqa(num_q_heads, num_kv_heads, kv_name="k"):
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"{kv_name}: num_kv_heads ({num_kv_heads}) must divide the number of "
                         f"query heads ({num_q_heads})")


def check_cu_seqlens(name, cu, xp, total=None, contents=True, padding=True):
    """Validate int32 ``[batch + 1]`` cumulative lengths; return the host copy (None with
    ``contents=False``: only the shape and dtype checked).

    Starts at 0, never decreases, and (when ``total`` is given) ends at ``total``, or with
    ``padding`` at most at ``total`` (rows past the last entry are padding).
    """
    check_array(name, cu, ndim=1, dtypes=np.int32, xp=xp)
    if cu.shape[0] < 1:
        raise ValueError(f"{name}: expected shape [batch_size + 1] with at least one entry, got {tuple(cu.shape)}")
    if not contents:
        return None
    h = host(cu)
    if h[0] != 0:
        raise ValueError(f"{name}: expected {name}[0] == 0, got {int(h[0])}")
    d = np.diff(h)
    if (d < 0).any():
        i = int(np.argmax(d < 0))
        raise ValueError(f"{name}: expected non-decreasing entries, got {int(h[i])} then {int(h[i + 1])} at index {i}")
    if total is not None and (int(h[-1]) > total or (not padding and int(h[-1]) != total)):
        raise ValueError(f"{name}: expected last entry {'at most ' if padding else ''}{total} "
                         f"(the number of tokens), got {int(h[-1])}")
    return h


def check_index_layout(name, a):
    """An index array's rows may be strided, its last dimension must be contiguous."""
    if a.ndim and a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
        raise ValueError(f"{name}: expected a contiguous last dimension, got strides {a.strides}")


def table_stride(tables):
    """Elements from one block-table row to the next (0 without tables)."""
    if tables is None:
        return 0
    return tables.strides[0] // tables.itemsize if tables.shape[0] > 1 else tables.shape[1]


def check_block_tables(block_tables, seq_lens, geometry, xp, *, batch=None, extra_tokens=0,
                       contents=True, ids=True):
    """Validate a paged batch's block tables and kv lengths; return host copies (``(None,
    None)`` with ``contents=False``: shapes and dtypes only; with ``ids=False`` the lengths
    are checked but the block ids are left to the kernel that reads them).

    Parameters
    ----------
    block_tables : int32 ``[batch, max_blocks_per_seq]``
    seq_lens : int32 ``[batch]``
        Keys of each sequence in the cache; ``extra_tokens`` more must also fit (the
        in-place append of decode).
    geometry : layouts.CacheGeometry

    The first ``ceil((seq_len + extra_tokens) / block_size)`` entries of each row must be
    block ids in ``[0, num_blocks)``; later entries are not read (conventionally -1).
    """
    check_array("block_tables", block_tables, ndim=2, dtypes=np.int32, xp=xp, contiguous=False)
    check_index_layout("block_tables", block_tables)
    b = block_tables.shape[0] if batch is None else batch
    if block_tables.shape[0] != b:
        check_array("block_tables", block_tables, shape=(b, None), contiguous=False)
    check_array("seq_lens", seq_lens, shape=(b,), dtypes=np.int32, xp=xp)
    if not contents:
        return None, None
    bt, sl = host(block_tables), host(seq_lens)
    if not sl.size:
        return bt, sl
    bs, max_blocks = geometry.block_size, bt.shape[1]
    # one reduction decides the common case (every length fits); the messages name the
    # first bad sequence
    hi = int(sl.view(np.uint32).max())  # a negative length reads as 2^31 or more
    if hi >= INT32_MAX:
        check_range("seq_lens", sl, 0, INT32_MAX)
    if -(-(hi + extra_tokens) // bs) > max_blocks:
        need = -(-(sl.astype(np.int64) + extra_tokens) // bs)
        i = int(np.argmax(need > max_blocks))
        raise ValueError(f"seq_lens: sequence {i} needs {int(need[i])} blocks of {bs} for "
                         f"{int(sl[i]) + extra_tokens} tokens, but block_tables has {max_blocks} per sequence")
    if ids:
        need = -(-(sl.astype(np.int64) + extra_tokens) // bs)
        used = np.arange(max_blocks)[None, :] < need[:, None]
        check_range("block_tables", np.where(used, bt, 0), 0, geometry.num_blocks)
    return bt, sl


def check_out(out, shape, dtype, xp):
    """Validate a caller-provided output buffer."""
    check_array("out", out, shape=shape, dtypes=dtype, xp=xp)
    return out


def check_lse(lse, rows, num_q_heads, xp):
    """A caller's LSE buffer (None passes): float32 ``[rows, num_q_heads]``."""
    if lse is not None:
        check_array("lse", lse, shape=(rows, num_q_heads), dtypes=np.float32, xp=xp)
