"""TMA tensor maps (``CUtensorMap``) for the Hopper prefill kernel's K/V tiles.

A tensor map describes a global tensor to the Tensor Memory Accelerator: its base address,
dimensions and byte strides, the box one copy moves and how the box lands in shared memory.
Maps are encoded on the host by the CUDA driver's ``cuTensorMapEncodeTiled`` (CUDA 12, called
through ctypes from ``libcuda.so.1``) and passed to kernels by value
(``core.launch.TENSOR_MAP``). A map holds the base address, so each call's K and V get their
own; the encoded bytes are cached per (address, geometry), as the driver's format is opaque.

K (V alike) is a 4-d map over (dim, key in block, kv head, block), innermost first, of
16-bit elements with contiguous dims, a box of (64 dims, ``rows`` keys, 1 head, 1 block)
swizzled 128 bytes: ragged rows ``[total_k, Hk, D]`` are one block of ``total_k`` keys
(boxes of a whole tile of ``block_n`` keys), an NHD or HND cache has ``num_blocks`` blocks of
``block_size`` keys (boxes of ``min(block_size, block_n)`` keys, a cache block's part of a
tile). One copy lands ``rows`` rows of 128 bytes, 16-byte chunk c of row r at chunk
``c ^ (r % 8)`` of its 1024-byte-aligned destination: part of one column block of the
``swizzled<BN, 128>`` tile of kernels_cu/wgmma.cuh (rows in whole 8-row swizzle atoms); a
tile of head size D is D / 64 column blocks at dims 0, 64, ... Keys past a block's end land
as zeros.

An fp8 cache's maps are over its 1-byte codes: a box of a whole row (``D`` codes, ``rows``
keys) unswizzled, row r at ``r * D`` bytes of its destination, a staging slot that the
kernel widens into the swizzled 16-bit tile.
"""
from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

from .launch import TENSOR_MAP_ALIGN, TENSOR_MAP_BYTES

BOX_DIMS = 64      # dims of a box row: the 128-byte swizzle span of 16-bit elements
HEAD_DIMS = (64, 128)  # head sizes whose rows are whole 128-byte column blocks

# driver enums (cuda.h)
_UINT8 = 0                  # CU_TENSOR_MAP_DATA_TYPE_UINT8: fp8 codes, copied as they are
_UINT16 = 1                 # CU_TENSOR_MAP_DATA_TYPE_UINT16: fp16 / bf16 bits, copied as they are
_INTERLEAVE_NONE = 0
_SWIZZLE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_128B = 2
_OOB_FILL_ZEROS = 0         # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: out-of-range elements read 0


class MapGeometry(NamedTuple):
    """What ``cuTensorMapEncodeTiled`` takes besides the address: ``dims`` (innermost first),
    byte ``strides`` of dims 1.. and the ``box``, all in elements but the strides; the
    element ``dtype`` and the ``swizzle`` mode (driver enums)."""
    dims: tuple
    strides: tuple
    box: tuple
    dtype: int = _UINT16
    swizzle: int = _SWIZZLE_128B


def kv_geometry(head_dim, num_kv_heads, tok_stride, head_stride, block_stride, keys, blocks,
                rows, itemsize=2):
    """The map geometry of K or V: ``blocks`` blocks of ``keys`` keys.

    Parameters
    ----------
    head_dim, num_kv_heads : int
        ``D`` (in :data:`HEAD_DIMS`) and ``Hk``.
    tok_stride, head_stride, block_stride : int
        Element strides of a key, a kv head and a block (a dim's is 1).
    keys, blocks : int
        Keys per block and blocks, at least 1 each (ragged rows: ``total_k`` keys, one block).
    rows : int
        Keys per box, at most 256 and a multiple of 8 (whole swizzle atoms).
    itemsize : int
        Bytes of an element: 2 (boxes of :data:`BOX_DIMS` dims, swizzled 128 bytes) or 1
        (fp8 codes: boxes of whole rows, unswizzled).

    Returns
    -------
    MapGeometry

    Raises
    ------
    ValueError
        A head size other than :data:`HEAD_DIMS`, sizes out of range, or strides TMA
        cannot take (byte strides must be positive multiples of 16).
    """
    if head_dim not in HEAD_DIMS or itemsize not in (1, 2):
        raise ValueError(f"tma: 16-bit or 1-byte rows of head_dim {HEAD_DIMS} only, got "
                         f"head_dim {head_dim}, itemsize {itemsize}")
    if not (0 < rows <= 256 and rows % 8 == 0) or keys < 1 or blocks < 1:
        raise ValueError(f"tma: box rows {rows}, keys {keys} and blocks {blocks} out of range")
    strides = tuple(x * itemsize for x in (tok_stride, head_stride, block_stride))
    if any(s % 16 or s <= 0 for s in strides):
        raise ValueError(f"tma: K/V byte strides {strides} must be positive multiples of 16")
    dims = (head_dim, keys, num_kv_heads, blocks)
    if itemsize == 1:
        return MapGeometry(dims, strides, (head_dim, rows, 1, 1), _UINT8, _SWIZZLE_NONE)
    return MapGeometry(dims, strides, (BOX_DIMS, rows, 1, 1))


def _driver():
    """``cuTensorMapEncodeTiled`` of the loaded CUDA driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
    except (OSError, AttributeError) as e:
        raise RuntimeError("tma: the TMA prefill needs a CUDA 12 driver (libcuda.so.1 with "
                           f"cuTensorMapEncodeTiled): {e}") from None
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p,
                   u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_ENCODE = []  # the driver entry, looked up on first use


@functools.lru_cache(maxsize=256)
def encode(address, geometry):
    """The 128 bytes of the tensor map of ``geometry`` (:class:`MapGeometry`) over the
    tensor at device ``address`` (16-byte aligned), boxes swizzled as it says, zeros out of
    range. Cached per (address, geometry)."""
    if address % 16:
        raise ValueError(f"tma: the tensor's address {address:#x} is not 16-byte aligned")
    if not _ENCODE:
        _ENCODE.append(_driver())
    rank = len(geometry.dims)
    buf = ctypes.create_string_buffer(TENSOR_MAP_BYTES + TENSOR_MAP_ALIGN)
    at = -(-ctypes.addressof(buf) // TENSOR_MAP_ALIGN) * TENSOR_MAP_ALIGN  # 64-byte aligned
    err = _ENCODE[0](at, geometry.dtype, rank, address, (ctypes.c_uint64 * rank)(*geometry.dims),
                     (ctypes.c_uint64 * (rank - 1))(*geometry.strides),
                     (ctypes.c_uint32 * rank)(*geometry.box), (ctypes.c_uint32 * rank)(*[1] * rank),
                     _INTERLEAVE_NONE, geometry.swizzle, _L2_PROMOTION_128B, _OOB_FILL_ZEROS)
    if err:
        raise RuntimeError(f"tma: cuTensorMapEncodeTiled failed (CUresult {err}) for {geometry}")
    return ctypes.string_at(at, TENSOR_MAP_BYTES)


class KVMaps:
    """The K and V tensor maps of a prefill call shape: ``maps(k_address, v_address)``
    gives their bytes (all zeros without keys, where the kernel reads none).

    Parameters
    ----------
    num_kv_heads, head_dim, block_n : int
        ``Hk``, ``D`` and the keys of a K/V tile.
    strides : cupaged.core.layouts.CacheStrides
        The call's K/V element strides (``k_tok``, ``k_head``, ``k_block`` and V's alike;
        dims contiguous: ``k_chunk`` ``16 // itemsize`` and ``v_dim`` 1).
    total_k : int, optional
        Ragged K/V: its rows (one block, boxes of ``block_n`` keys).
    block_size, num_blocks : int, optional
        A paged cache's (boxes of ``min(block_size, block_n)`` keys).
    itemsize : int
        Bytes of an element: 2, or 1 for an fp8 cache's codes.
    """

    def __init__(self, num_kv_heads, head_dim, strides, block_n, total_k=None, block_size=None,
                 num_blocks=None, itemsize=2):
        if strides.k_chunk != 16 // itemsize or strides.v_dim != 1:
            raise ValueError("tma: K and V need contiguous dims")
        if block_size is None:
            keys, blocks, rows = total_k, 1, block_n
            block = (strides.k_tok * total_k, strides.v_tok * total_k)  # one block: any stride
        else:
            keys, blocks, rows = block_size, num_blocks, min(block_size, block_n)
            block = (strides.k_block, strides.v_block)
        self._geo = None
        if keys > 0 and blocks > 0:
            self._geo = tuple(kv_geometry(head_dim, num_kv_heads, tok, head, blk, keys, blocks,
                                          rows, itemsize)
                              for tok, head, blk in ((strides.k_tok, strides.k_head, block[0]),
                                                     (strides.v_tok, strides.v_head, block[1])))

    def __call__(self, k_address, v_address):
        if self._geo is None:
            return bytes(TENSOR_MAP_BYTES), bytes(TENSOR_MAP_BYTES)
        return encode(k_address, self._geo[0]), encode(v_address, self._geo[1])
