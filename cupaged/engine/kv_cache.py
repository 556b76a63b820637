"""A paged KV cache: key and value arrays in one layout plus the pool of their blocks."""
from __future__ import annotations

import numpy as np

from ..core.arrays import as_dtype, check_choice, check_head_dim, cupy_module, gpu_available
from ..core.checks import check_int
from ..core.fp8 import cache_element_dtype, check_scale, fp8_format, is_host_scale
from .blocks import BlockPool
from ..cache_ops.api import copy_blocks, write_kv_cache
from ..core.layouts import LAYOUTS, CacheView, cache_shapes


class PagedKVCache(CacheView):
    """Key and value caches of ``num_blocks`` blocks and the ``BlockPool`` over them.

    A :class:`cupaged.CacheView`: the attention ops take it in place of ``(k, v)`` with its
    layout, e.g. ``cupaged.paged_decode(q, cache, block_tables, seq_lens)``.

    Parameters
    ----------
    num_blocks, block_size, num_kv_heads : int
        Cache geometry.
    head_dim : int
        Head size, one of ``cupaged.core.arrays.HEAD_DIMS`` (64, 80, 96, 112, 128, 256): the
        sizes the attention kernels are built for (refused here, not at attention time).
    dtype : str or dtype
        float16 (default), bfloat16 or float32: the caches' elements, or with ``kv_dtype``
        the rows written into them (and the attention's q).
    layout : {"NHD", "HND", "vllm"}
        ``k`` and ``v`` shapes are ``cupaged.layouts.cache_shapes(layout, ...)``, e.g. NHD
        ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    xp : module, optional
        ``numpy`` or ``cupy``; default cupy when a CUDA device is usable, else numpy.
    kv_dtype : {None, "fp8_e4m3", "fp8_e5m2"}
        Store keys and values in this fp8 format: 1-byte caches (the format's float8 dtype
        in NumPy, uint8 in CuPy, which has no float8 dtype), half the bytes of 16-bit ones.
        The cache then brings its format and scales to the ops it is passed to (a
        :class:`cupaged.CacheView`).
    k_scale, v_scale : float or array, optional
        fp8 scales (default 1.0): a float, or float32 ``[]``, ``[1]`` or ``[num_kv_heads]``
        in ``xp`` (see :func:`cupaged.write_kv_cache`).

    Attributes
    ----------
    k, v : array
        The caches (zero-filled), in ``xp``.
    pool : BlockPool
        Free list and refcounts of the blocks; build ``BlockTable`` objects on it.
    """

    def __init__(self, num_blocks, block_size, num_kv_heads, head_dim, dtype="float16",
                 layout="NHD", xp=None, kv_dtype=None, k_scale=None, v_scale=None):
        check_choice("layout", layout, LAYOUTS)
        self.num_blocks = check_int("num_blocks", num_blocks)
        self.block_size = check_int("block_size", block_size)
        self.num_kv_heads = check_int("num_kv_heads", num_kv_heads)
        self.head_dim = check_int("head_dim", head_dim)
        check_head_dim("head_dim", self.head_dim)
        self.dtype = as_dtype(dtype)
        if xp is None:
            xp = cupy_module() if gpu_available() else np
        if xp is not np and xp is not cupy_module():
            raise TypeError(f"xp: expected numpy or cupy, got {xp!r}")
        self.xp = xp
        self.layout = layout
        fmt = None if kv_dtype is None else fp8_format(kv_dtype)
        if fmt is None and (k_scale is not None or v_scale is not None):
            raise ValueError("k_scale, v_scale: expected None without kv_dtype, got a scale")
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if is_host_scale(scale) or isinstance(scale, np.ndarray):
                check_scale(name, scale, self.num_kv_heads)
        self.kv_dtype = None if fmt is None else fmt.name
        self.k_scale, self.v_scale = k_scale, v_scale
        elements = self.dtype if fmt is None else cache_element_dtype(fmt, xp)
        k_shape, v_shape = cache_shapes(layout, self.num_blocks, self.block_size,
                                        self.num_kv_heads, self.head_dim,
                                        self.dtype if fmt is None else fmt.name)
        self.k = xp.zeros(k_shape, elements)
        self.v = xp.zeros(v_shape, elements)
        self.pool = BlockPool(self.num_blocks, self.block_size)

    @property
    def nbytes(self) -> int:
        """Bytes held by ``k`` and ``v`` (one byte an element in an fp8 cache)."""
        return int(self.k.nbytes + self.v.nbytes)

    def write(self, key, value, slots):
        """Write token rows into their slots (``cupaged.write_kv_cache`` in this layout).

        Parameters
        ----------
        key, value : array
            ``[num_tokens, num_kv_heads, head_dim]`` of the cache's dtype and array module
            (quantised with the cache's scales into an fp8 cache).
        slots : array
            int64 ``[num_tokens]`` slot mapping (``BlockTable.append``'s result), -1 skips;
            a NumPy mapping is uploaded for a CuPy cache.
        """
        if self.xp is not np and isinstance(slots, np.ndarray):
            slots = self.xp.asarray(slots)
        write_kv_cache(key, value, self, slots)

    def copy_blocks(self, block_mapping):
        """Copy blocks ``(src, dst)`` in ``k`` and ``v`` (``BlockTable.take_copies()``).

        Parameters
        ----------
        block_mapping : array-like
            Integer ``[n, 2]`` ``(src, dst)`` block ids, as :func:`cupaged.copy_blocks`.
        """
        copy_blocks(self.k, self.v, block_mapping)

    def __repr__(self):
        return (f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype}, layout={self.layout!r}, xp={self.xp.__name__}"
                + (f", kv_dtype={self.kv_dtype!r})" if self.kv_dtype else ")"))
