"""Reference cache operations: scatter new keys/values into a paged cache, copy and swap blocks.

These are the specification of ``cupaged.cache_ops``. They move elements without any
arithmetic, so the kernels must match them bit for bit; a write into an fp8 cache quantises
each row first (``cupaged.reference.fp8``: one correctly rounded division and one rounding,
so bit for bit too). Inputs are assumed valid (the public ops validate); every function works
in place on NumPy arrays.

Layouts (see ``cupaged.layouts``), for slot ``s``, block ``b = s // block_size`` and offset
``o = s % block_size``, token row ``key[t, h, d]`` lands at

- ``"NHD"``: ``k_cache[b, o, h, d]``
- ``"HND"``: ``k_cache[b, h, o, d]``
- ``"vllm"``: ``k_cache[b, h, d // x, o, d % x]`` (``x = 16 // itemsize``) and
  ``v_cache[b, h, d, o]``
"""
from __future__ import annotations

import numpy as np

from ..core.fp8 import check_kv_scales, resolve_kv_dtype
from ..core.layouts import LAYOUTS, vllm_x
from .fp8 import as_bytes, quantize


def _block_size(k_cache, layout):
    return k_cache.shape[{"NHD": 1, "HND": 2, "vllm": 3}[layout]]


def write_kv_cache(key, value, k_cache, v_cache, slot_mapping, layout="NHD", *,
                   kv_dtype=None, k_scale=None, v_scale=None):
    """Write one key and value row per token into its cache slot, in place.

    Parameters
    ----------
    key, value : numpy.ndarray
        ``[num_tokens, num_kv_heads, head_dim]``: the caches' dtype, or (fp8 caches)
        float16, bfloat16 or float32.
    k_cache, v_cache : numpy.ndarray
        Paged caches in ``layout`` (shapes from ``cupaged.layouts.cache_shapes``); modified.
        fp8 caches are uint8 or the format's float8 dtype.
    slot_mapping : numpy.ndarray
        int64 ``[num_tokens]``; slot ``block * block_size + offset`` of each token, ``-1`` to
        skip the token. Non-negative slots are distinct.
    layout : {"NHD", "HND", "vllm"}
    kv_dtype : {None, "fp8_e4m3", "fp8_e5m2"}
        The caches' format; None: their own dtype (a float8 cache is in its format, a uint8
        cache needs a name).
    k_scale, v_scale : float or numpy.ndarray, optional
        fp8 only: float32 ``[]`` or ``[num_kv_heads]`` (default 1.0); the cache holds
        ``key / k_scale`` and ``value / v_scale``, quantised (``reference.fp8.quantize``).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    fmt = resolve_kv_dtype(kv_dtype, k_cache, v_cache)
    k_scale, v_scale = check_kv_scales(fmt, k_scale, v_scale, np.shape(key)[1])
    slots = np.asarray(slot_mapping).astype(np.int64)
    keep = slots >= 0
    key, value, slots = np.asarray(key)[keep], np.asarray(value)[keep], slots[keep]
    if fmt is not None:
        # quantised rows are bytes; write them through uint8 views of the caches
        key = quantize(key, k_scale, fmt.name, head_axis=1, name="k_scale")
        value = quantize(value, v_scale, fmt.name, head_axis=1, name="v_scale")
        k_cache, v_cache = as_bytes(k_cache, fmt), as_bytes(v_cache, fmt)
    bs = _block_size(k_cache, layout)
    blk, off = slots // bs, slots % bs
    if layout == "NHD":
        k_cache[blk, off] = key
        v_cache[blk, off] = value
    elif layout == "HND":
        k_cache[blk, :, off] = key
        v_cache[blk, :, off] = value
    else:
        x = vllm_x(k_cache.dtype)
        t, hk, d = key.shape
        # [t, hk, d] -> [t, hk, d // x, x]; the cache's [b, :, :, o, :] has that shape
        k_cache[blk, :, :, off, :] = key.reshape(t, hk, d // x, x)
        v_cache[blk, :, :, off] = value


def copy_blocks(k_cache, v_cache, block_mapping):
    """Copy whole blocks ``src -> dst`` inside a cache pair, in place (copy-on-write).

    Parameters
    ----------
    k_cache, v_cache : numpy.ndarray
        Caches of any layout; the block index is the leading dimension in every layout.
    block_mapping : numpy.ndarray
        Integer ``[num_pairs, 2]`` of ``(src, dst)`` block ids. Every source is read before
        any destination is written.
    """
    pairs = np.asarray(block_mapping, dtype=np.int64).reshape(-1, 2)
    src, dst = pairs[:, 0], pairs[:, 1]
    k_cache[dst] = k_cache[src]
    v_cache[dst] = v_cache[src]


def swap_blocks(src_cache, dst_cache, block_mapping):
    """Copy blocks ``src_cache[src] -> dst_cache[dst]`` between two caches (swap in/out).

    Parameters
    ----------
    src_cache, dst_cache : numpy.ndarray
        ``[num_blocks_src, ...]`` and ``[num_blocks_dst, ...]`` with equal trailing shapes
        and dtypes (one key or one value cache each).
    block_mapping : numpy.ndarray
        Integer ``[num_pairs, 2]`` of ``(src, dst)`` block ids.
    """
    pairs = np.asarray(block_mapping, dtype=np.int64).reshape(-1, 2)
    dst_cache[pairs[:, 1]] = src_cache[pairs[:, 0]]
