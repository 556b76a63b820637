"""Cache ops: write new keys/values into a paged cache, copy blocks, swap blocks.

NumPy inputs run ``cupaged.reference.cache``; CuPy inputs (and torch/JAX CUDA tensors,
taken zero-copy) run the kernels of ``kernels_cu/cache_ops.cu`` on the current stream
(the caller's torch stream for torch tensors). All three ops move bits: the kernels match
the reference exactly. Shapes, dtypes and strides are checked before anything runs, and so
are host index arrays; device index arrays (a CuPy slot mapping or block mapping) are
checked by the kernels (an entry out of range is skipped and reported to the error word,
``cupaged.errors``), or on the host first in strict mode (``validate=True``,
``CUPAGED_STRICT=1``), which also refuses duplicate slots; outside strict mode two tokens
with one slot write one of their rows, as vLLM's ``reshape_and_cache`` does.

Swaps between a device cache and a pinned host cache are asynchronous on the current
stream. Two mechanisms, chosen per call by ``method=``:

- ``"memcpy"``: one ``cudaMemcpyAsync`` per run of consecutive blocks (copy engines; best
  when runs are long, costs a host call per run);
- ``"kernel"``: one launch of the block-copy kernel over the mapped pinned memory (SMs
  read or write host memory directly; best for many scattered blocks);
- ``"auto"`` (default): ``memcpy`` when the runs average at least ``MEMCPY_MIN_RUN_BYTES``,
  else ``kernel``. ``cupaged.bench.cache`` measures both.
"""
from __future__ import annotations

import numpy as np

from ..core import abi, errors
from ..core.arrays import (FLOAT_DTYPES, CallCache, accepts_dlpack, array_module, bfloat16,
                           check_array, check_choice, check_range, float16, host, hot, is_cupy)
from ..core.checks import check_aligned, table_stride, token_stride
from ..core.compile import Spec, ctype, kv_types, launcher
from ..core.device import current
from ..core.fp8 import (KV_DTYPES, given_kv_dtype, is_host_scale, kernel_scales,
                        resolve_kv_dtype, scale_parts)
from ..core.launch import current_stream, ptr
from ..core.layouts import CACHE_DTYPES, LAYOUTS, accepts_cache, block_stride, cache_geometry
from ..reference import cache as ref

# the cache kernels' geometry (namespace cache of the generated abi.cuh: cpp())
THREADS = 256      # block of every cache kernel
WRITE_UNROLL = 2   # tokens a thread group of write_rows (staged in shared memory)
ROWS_UNROLL = 2    # 16-byte loads a thread and row in flight in gather_kv
VLLM_TILE = 32     # tokens a CTA of write_vllm: one a lane
COPY_UNROLL = 4    # vectors in flight a thread of copy_blocks_kernel
GATHER_CTAS_PER_SM = 8  # gather_kv's grid: CTAs an SM over the batch, whatever its lengths
GATHER_UNIT = 8  # elements a thread of gather_kv moves at a time (one 16-byte output vector)
MEMCPY_MIN_RUN_BYTES = 1 << 20
SWAP_METHODS = ("auto", "memcpy", "kernel")
_ELEMENT_TYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int"}
BITS = "cupaged::Bits"


def cpp() -> str:
    """C++ of the cache kernels' constants for the generated ``abi.cuh``."""
    return abi.constants("cache", dict(THREADS=THREADS, WRITE_UNROLL=WRITE_UNROLL,
                                       ROWS_UNROLL=ROWS_UNROLL,
                                       VLLM_TILE=VLLM_TILE, COPY_UNROLL=COPY_UNROLL,
                                       GATHER_UNIT=GATHER_UNIT))


def quantiser(in_dtype, kv_dtype):
    """The write kernels' Q of rows of ``in_dtype`` into a cache of format ``kv_dtype``
    (None: a plain cache, whose rows are copied as bits)."""
    if kv_dtype is None:
        return BITS
    return f"cupaged::Fp8Vec<{ctype(in_dtype)}, cupaged::{kv_dtype}>"


def write_expr(layout, cache_itemsize, q):
    """The write kernel of a layout, cache element size and quantiser ``q``."""
    if layout == "vllm":
        return f"cupaged::write_vllm<{_ELEMENT_TYPES[cache_itemsize]}, {q}>"
    return f"cupaged::write_rows<{'true' if layout == 'HND' else 'false'}, {q}>"


def kernel_specializations():
    """Every kernel specialisation this module can launch: the writes per layout, for
    plain caches (bits of 2- or 4-byte elements) and for each fp8 format from each input
    dtype, and the block copy."""
    exprs = [write_expr(layout, size, BITS) for layout in LAYOUTS
             for size in ((2, 4) if layout == "vllm" else (2,))]
    exprs += [write_expr(layout, 1, quantiser(dt, kv)) for layout in LAYOUTS
              for kv in KV_DTYPES for dt in FLOAT_DTYPES]
    exprs += [gather_expr(dt, kv, v_t) for dt in (float16, bfloat16)
              for kv in (None,) + KV_DTYPES for v_t in (False, True)]
    return [Spec("cache_ops", e) for e in exprs + ["cupaged::copy_blocks_kernel"]]


def gather_expr(dtype, kv_dtype, v_transposed):
    """The gather kernel into packed rows of ``dtype`` (16-bit) from caches of fp8 format
    ``kv_dtype`` (None: of ``dtype``); ``v_transposed``: values in the vllm layout."""
    return f"cupaged::gather_kv<{kv_types(dtype, kv_dtype)}, {str(bool(v_transposed)).lower()}>"


# ----------------------------------------------------------------------------- checks
def _check_row_bytes(name, head_dim, dtype):
    if (head_dim * np.dtype(dtype).itemsize) % 16:
        raise ValueError(f"{name}: expected head_dim * itemsize to be a multiple of 16 bytes, "
                         f"got head_dim {head_dim} of {np.dtype(dtype)}")


def _check_write(key, value, k_cache, v_cache, slot_mapping, layout, kv_dtype, k_scale,
                 v_scale, validate=None):
    """Validate write_kv_cache's arguments (the slots' contents on the host for a host
    mapping or in strict mode); return (array module, geometry, fp8 format or None, the
    kernels' scale fields or None on the NumPy path)."""
    check_choice("layout", layout, LAYOUTS)
    xp = array_module(key, value, k_cache, v_cache, slot_mapping)
    geo = cache_geometry(k_cache, v_cache, layout, CACHE_DTYPES)
    fmt = resolve_kv_dtype(kv_dtype, k_cache, v_cache)
    _check_row_bytes("k_cache", geo.head_dim, k_cache.dtype)
    hk, d = geo.num_kv_heads, geo.head_dim
    rows = FLOAT_DTYPES if fmt is not None else k_cache.dtype
    check_array("key", key, shape=(None, hk, d), dtypes=rows, contiguous=False)
    tokens = key.shape[0]
    check_array("value", value, shape=(tokens, hk, d), dtypes=key.dtype, contiguous=False)
    token_stride("key", key)
    token_stride("value", value)
    check_array("slot_mapping", slot_mapping, shape=(tokens,), dtypes=np.int64)
    scales = None
    if xp is not np:
        check_aligned(key=key, value=value, k_cache=k_cache, v_cache=v_cache)
        scales = kernel_scales(fmt, k_scale, v_scale, hk, errors.strict(validate))
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None and not is_host_scale(scale):
                check_array(name, scale, xp=xp, contiguous=False)
    if xp is not np and not errors.strict(validate):
        return xp, geo, fmt, scales
    slots = host(slot_mapping)
    check_range("slot_mapping", slots, 0, geo.num_blocks * geo.block_size, allow=(-1,))
    if errors.strict(validate):
        used = np.sort(slots[slots >= 0])
        dup = used[1:] == used[:-1]
        if dup.any():
            raise ValueError(f"slot_mapping: expected distinct slots (or -1), slot "
                             f"{used[1:][dup][0]} appears more than once")
    return xp, geo, fmt, scales


def _check_pairs(block_mapping, num_src, num_dst, disjoint, validate=None):
    """Validate ``(src, dst)`` pairs; return a host int64 ``[n, 2]`` copy, or for a device
    mapping outside strict mode the mapping itself (int64 ``[n, 2]``; the copy kernel
    checks its entries).

    Destinations must be distinct; with ``disjoint`` (both ends in one cache) no source may
    also be a destination, so that the copies are independent of their order.
    """
    if is_cupy(block_mapping) and not errors.strict(validate):
        if block_mapping.dtype.kind not in "iu":
            raise TypeError(f"block_mapping: expected an integer array, got dtype "
                            f"{block_mapping.dtype}")
        if block_mapping.ndim != 2 or block_mapping.shape[1] != 2:
            raise ValueError(f"block_mapping: expected shape [num_pairs, 2] of (src, dst), "
                             f"got {tuple(block_mapping.shape)}")
        return block_mapping.astype(np.int64, copy=False)  # on the device: no sync
    pairs = host(block_mapping) if is_cupy(block_mapping) else np.asarray(block_mapping)
    if pairs.size == 0:
        return np.zeros((0, 2), np.int64)
    if pairs.dtype.kind not in "iu":
        raise TypeError(f"block_mapping: expected an integer array, got dtype {pairs.dtype}")
    if pairs.ndim != 2 or pairs.shape[1] != 2:
        raise ValueError(f"block_mapping: expected shape [num_pairs, 2] of (src, dst), "
                         f"got {tuple(pairs.shape)}")
    pairs = pairs.astype(np.int64)
    check_range("block_mapping[:, 0] (source blocks)", pairs[:, 0], 0, num_src)
    check_range("block_mapping[:, 1] (destination blocks)", pairs[:, 1], 0, num_dst)
    dst = np.sort(pairs[:, 1])
    dup = dst[1:] == dst[:-1]
    if dup.any():
        raise ValueError(f"block_mapping: expected distinct destination blocks, block "
                         f"{dst[1:][dup][0]} appears more than once")
    if disjoint:
        both = np.intersect1d(pairs[:, 0], pairs[:, 1])
        if both.size:
            raise ValueError(f"block_mapping: block {both[0]} is both a source and a "
                             f"destination; expected disjoint sets")
    return pairs


def _check_blocks(names, a, b, same_shape):
    """Two caches ``[num_blocks, ...]`` of one dtype; return the bytes of one block.

    With ``same_shape`` their blocks must have one shape, else only one size (the key and
    value caches of the vllm layout).
    """
    for name, cache in zip(names, (a, b)):
        if not (isinstance(cache, np.ndarray) or is_cupy(cache)):
            raise TypeError(f"{name}: expected a numpy.ndarray or cupy.ndarray, "
                            f"got {type(cache).__name__}")
        if cache.ndim < 2:
            raise ValueError(f"{name}: expected a cache [num_blocks, ...] of 2 or more "
                             f"dimensions, got shape {tuple(cache.shape)}")
        check_array(name, cache)
    if a.dtype != b.dtype:
        raise TypeError(f"{names[1]}: expected dtype {a.dtype} like {names[0]}, got {b.dtype}")
    block_bytes = [int(np.prod(cache.shape[1:])) * cache.dtype.itemsize for cache in (a, b)]
    if same_shape and a.shape[1:] != b.shape[1:]:
        raise ValueError(f"{names[1]}: expected blocks of shape {tuple(a.shape[1:])} like "
                         f"{names[0]}, got {tuple(b.shape[1:])}")
    if block_bytes[0] != block_bytes[1]:
        raise ValueError(f"{names[1]}: expected blocks of {block_bytes[0]} bytes like "
                         f"{names[0]}, got {block_bytes[1]}")
    if is_cupy(a) or is_cupy(b):
        if block_bytes[0] % 16:
            raise ValueError(f"{names[0]}: expected blocks of a multiple of 16 bytes, "
                             f"got {block_bytes[0]}")
        check_aligned(**dict(zip(names, (a, b))))
    return block_bytes[0]


def _same_memory(a, b):
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return np.may_share_memory(a, b)
    return a.data.ptr < b.data.ptr + b.nbytes and b.data.ptr < a.data.ptr + a.nbytes


def _pinned_pointer(name, a):
    """Device pointer of a NumPy array in pinned (page-locked, mapped) host memory."""
    import cupy
    attrs = cupy.cuda.runtime.pointerGetAttributes(a.ctypes.data)
    if attrs.type != cupy.cuda.runtime.memoryTypeHost:
        raise ValueError(f"{name}: expected a NumPy array in pinned host memory (for example "
                         f"from cupyx.empty_pinned) to swap with a device cache, got pageable "
                         f"memory")
    return attrs.devicePointer


# ----------------------------------------------------------------------------- planning
def token_group_log2(row_vecs):
    """log2 of the threads a token of ``write_rows`` and ``gather_kv``: the power of two
    covering a token's ``row_vecs`` 16-byte vectors, at most the block."""
    return min(THREADS.bit_length() - 1, (row_vecs - 1).bit_length())


def write_launch_config(num_tokens, geo, itemsize, layout, cache_itemsize=None, q=BITS):
    """(kernel expression, grid, dynamic shared bytes, CACHE_WRITE fields) of a cache write
    of rows of ``itemsize``-byte elements into a cache of ``cache_itemsize``-byte ones
    (default the same) by quantiser ``q``."""
    cache_itemsize = cache_itemsize or itemsize
    head_vecs = geo.head_dim * itemsize // 16
    if layout == "vllm":
        smem = 2 * VLLM_TILE * ((geo.head_dim * cache_itemsize // 16) | 1) * 16
        grid = (-(-num_tokens // VLLM_TILE), geo.num_kv_heads)
        return (write_expr(layout, cache_itemsize, q), grid, smem,
                dict(num_tokens=num_tokens, num_kv_heads=geo.num_kv_heads, head_vecs=head_vecs,
                     block_size=geo.block_size, tpt_log2=0,
                     row_vecs=geo.num_kv_heads * head_vecs))
    row_vecs = geo.num_kv_heads * head_vecs
    tpt_log2 = token_group_log2(row_vecs)
    grid = (-(-num_tokens // (WRITE_UNROLL * (THREADS >> tpt_log2))), -(-row_vecs >> tpt_log2))
    smem = 2 * WRITE_UNROLL * THREADS * 16  # write_rows' staging slots
    return (write_expr(layout, cache_itemsize, q), grid, smem,
            dict(num_tokens=num_tokens, tpt_log2=tpt_log2, row_vecs=row_vecs,
                 head_vecs=head_vecs, num_kv_heads=geo.num_kv_heads, block_size=geo.block_size))


def copy_grid(num_pairs, block_bytes, num_caches):
    """Grid of copy_blocks_kernel: pairs x chunks of a block x caches."""
    chunks = -(-(block_bytes // 16) // (THREADS * COPY_UNROLL))
    return (num_pairs, min(chunks, 65535), num_caches)


def block_runs(pairs):
    """Runs of consecutive sources mapped to consecutive destinations.

    Returns
    -------
    numpy.ndarray
        int64 ``[num_runs, 3]`` of (first source, first destination, blocks in the run).
    """
    p = pairs[np.argsort(pairs[:, 0], kind="stable")]
    brk = np.flatnonzero((np.diff(p[:, 0]) != 1) | (np.diff(p[:, 1]) != 1)) + 1
    starts = np.concatenate([[0], brk])
    counts = np.diff(np.concatenate([starts, [len(p)]]))
    return np.stack([p[starts, 0], p[starts, 1], counts], axis=1)


def swap_method(pairs, block_bytes):
    """``"memcpy"`` when runs of consecutive blocks average ``MEMCPY_MIN_RUN_BYTES``, else
    ``"kernel"`` (many small copies cost more host time than one launch)."""
    runs = len(block_runs(pairs))
    return "memcpy" if len(pairs) * block_bytes >= MEMCPY_MIN_RUN_BYTES * runs else "kernel"


# ----------------------------------------------------------------------------- launches
def _write_setup(key, value, k_cache, v_cache, geo, layout, fmt, scales):
    """(launch, Bound) of a cache write of this shape, format and scale fields: everything
    but the arrays' addresses."""
    q = quantiser(key.dtype, None if fmt is None else fmt.name)
    expr, grid, smem, fields = write_launch_config(key.shape[0], geo, key.dtype.itemsize,
                                                   layout, k_cache.itemsize, q)
    vec = 16 // key.itemsize  # elements of a 16-byte input vector (of its image in the cache)
    block_vec = 16 // k_cache.itemsize if layout == "vllm" else vec
    head_vecs = fields["head_vecs"]
    args = abi.CACHE_WRITE.bind(
        err=ptr(errors.error_word()), num_slots=geo.num_blocks * geo.block_size,
        k_block=block_stride(k_cache) // block_vec, v_block=block_stride(v_cache) // block_vec,
        key_tok=token_stride("key", key) // vec, key_head=head_vecs,
        value_tok=token_stride("value", value) // vec, value_head=head_vecs, **scales,
        **fields)
    kernel = launcher("cache_ops", expr, abi.CACHE_WRITE, smem=smem, carveout=True)
    return kernel.at(grid, THREADS, smem), args


def _launch_write(setup, ptrs, stream):
    """The write of a setup; ``ptrs``: addresses of key, value, k_cache, v_cache,
    slot_mapping, k_scale and v_scale (0: none)."""
    go, args = setup
    key, value, k_cache, v_cache, slots, k_scale, v_scale = ptrs
    go(args.pack(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots,
                 k_scale=k_scale, v_scale=v_scale), stream)


_WRITES = CallCache()  # cache-write setups by signature


def _launch_copy(ptrs, pairs, block_bytes, num_caches, num_src, num_dst):
    """Block-copy kernel; ``ptrs`` = (src0, dst0, src1, dst1) arrays or device addresses;
    ``pairs`` host or device int64 ``[n, 2]``."""
    import cupy
    kernel = launcher("cache_ops", "cupaged::copy_blocks_kernel", abi.COPY_BLOCKS)
    src0, dst0, src1, dst1 = (p if isinstance(p, (int, np.integer)) else ptr(p) for p in ptrs)
    dev_pairs = pairs if is_cupy(pairs) else cupy.asarray(pairs)
    kernel(copy_grid(len(pairs), block_bytes, num_caches), THREADS, src0=int(src0),
           dst0=int(dst0), src1=int(src1), dst1=int(dst1), pairs=ptr(dev_pairs),
           err=ptr(errors.error_word()), block_vecs=block_bytes // 16, num_src=num_src,
           num_dst=num_dst)


def _swap_memcpy(src_cache, dst_cache, pairs, block_bytes):
    import cupy
    rt = cupy.cuda.runtime
    stream = cupy.cuda.get_current_stream().ptr
    src_base, dst_base = _address(src_cache), _address(dst_cache)
    for s, d, n in block_runs(pairs).tolist():
        rt.memcpyAsync(dst_base + d * block_bytes, src_base + s * block_bytes,
                       n * block_bytes, rt.memcpyDefault, stream)


def _address(a):
    return a.data.ptr if is_cupy(a) else a.ctypes.data


# ----------------------------------------------------------------------------- public ops
@accepts_cache(2)
def write_kv_cache(key, value, k_cache, v_cache, slot_mapping, layout="NHD", *, kv_dtype=None,
                   k_scale=None, v_scale=None, validate=None):
    """Write one key and one value row per token into its cache slot, in place.

    Parameters
    ----------
    key, value : array
        ``[num_tokens, num_kv_heads, head_dim]``, the caches' dtype (float16, bfloat16,
        float32; any of them, one for both, into an fp8 cache), heads dense, token rows
        16-byte multiples apart (views of a fused qkv tensor go in without a copy);
        ``head_dim * itemsize`` a multiple of 16 bytes.
    k_cache, v_cache : array
        Paged caches in ``layout`` (shapes from ``cupaged.layouts.cache_shapes``); or
        ``k_cache`` a CacheView or PagedKVCache, with its layout (``v_cache`` left out).
        fp8 caches are 1-byte arrays: uint8, or the format's float8 dtype.
    slot_mapping : array
        int64 ``[num_tokens]``: slot ``block * block_size + offset`` of each token, in
        ``[0, num_blocks * block_size)``, or ``-1`` to skip the token. Tokens sharing a slot
        write one of their rows (vLLM's rule; refused in strict mode).
    layout : {"NHD", "HND", "vllm"}
    kv_dtype : {None, "fp8_e4m3", "fp8_e5m2"}
        The caches' format; None: their own dtype (a float8 cache is in its format; a uint8
        cache needs a name). Rows written into an fp8 cache are quantised: the cache holds
        ``key / k_scale`` rounded to the format, saturated to its finite range (docs/design.md,
        fp8 caches; bit for bit as ``cupaged.reference.fp8.quantize``).
    k_scale, v_scale : float or array, optional
        fp8 only (default 1.0): a Python float, or a float32 array of shape ``[]`` or ``[1]``
        (one scale for every head) or ``[num_kv_heads]``, on the caches' device (its values,
        which must be finite and positive, are checked only in strict mode).
    validate : bool, optional
        Check a device slot mapping (and device scales) on the host first (range and
        duplicates; strict mode, default ``CUPAGED_STRICT``); otherwise the kernel skips and
        reports bad slots.

    Returns
    -------
    (k_cache, v_cache)
        The caches, modified in place (same memory; torch tensors for torch inputs).
    """
    kv_dtype = given_kv_dtype(kv_dtype, k_cache)
    scale_arrays, scale_values = scale_parts(k_scale, v_scale)
    arrays = (key, value, k_cache, v_cache, slot_mapping) + scale_arrays
    call = hot(errors.strict(validate), arrays, layout, kv_dtype, scale_values)
    if call is not None:
        setup = _WRITES.get(call.key)
        if setup is not None:  # checked and set up by an earlier call of this signature
            _launch_write(setup, call.ptrs, call.stream)
            return k_cache, v_cache
    return _write_checked(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, layout,
                          kv_dtype, validate, call.key if call is not None else None)


@accepts_dlpack
def _write_checked(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, layout,
                   kv_dtype, validate, cache_key):
    """write_kv_cache's checks, its setup (cached under ``cache_key``) and its launch."""
    xp, geo, fmt, scales = _check_write(key, value, k_cache, v_cache, slot_mapping, layout,
                                        kv_dtype, k_scale, v_scale, validate)
    if xp is np:
        ref.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, layout,
                           kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)
    elif key.shape[0]:
        setup = _WRITES.put(cache_key, _write_setup(key, value, k_cache, v_cache, geo, layout,
                                                    fmt, scales))
        scale_arrays = scale_parts(k_scale, v_scale)[0]
        _launch_write(setup, [ptr(a) for a in (key, value, k_cache, v_cache, slot_mapping,
                                               *scale_arrays)], current_stream())
    return k_cache, v_cache


@accepts_dlpack
def copy_blocks(k_cache, v_cache, block_mapping, *, validate=None):
    """Copy whole blocks ``src -> dst`` in a key and a value cache (copy-on-write).

    Parameters
    ----------
    k_cache, v_cache : array
        Caches of any layout, ``[num_blocks, ...]`` with blocks of one shape and dtype.
    block_mapping : array-like
        Integer ``[num_pairs, 2]`` of ``(src, dst)`` block ids (NumPy, CuPy or a list, e.g.
        ``BlockTable.take_copies()``); destinations distinct, no block both a source and a
        destination (a CuPy mapping, int64, is range-checked by the kernel, the rest only
        in strict mode).
    validate : bool, optional
        Check a device mapping on the host first (strict mode).

    Returns
    -------
    (k_cache, v_cache)
        The caches, modified in place.
    """
    xp = array_module(k_cache, v_cache)
    block_bytes = _check_blocks(("k_cache", "v_cache"), k_cache, v_cache, same_shape=False)
    if k_cache.shape[0] != v_cache.shape[0]:
        raise ValueError(f"v_cache: expected {k_cache.shape[0]} blocks like k_cache, "
                         f"got {v_cache.shape[0]}")
    pairs = _check_pairs(block_mapping, k_cache.shape[0], k_cache.shape[0], disjoint=True,
                         validate=validate)
    if xp is np:
        ref.copy_blocks(k_cache, v_cache, host(pairs))
    elif len(pairs):
        nb = k_cache.shape[0]
        _launch_copy((k_cache, k_cache, v_cache, v_cache), pairs, block_bytes, 2, nb, nb)
    return k_cache, v_cache


@accepts_dlpack
def swap_blocks(src_cache, dst_cache, block_mapping, *, method="auto"):
    """Copy blocks ``src_cache[src] -> dst_cache[dst]``: swap out to or in from the host.

    Parameters
    ----------
    src_cache, dst_cache : array
        ``[num_blocks_src, ...]`` and ``[num_blocks_dst, ...]``, one key or value cache
        each, with blocks of one shape and dtype. A CuPy cache pairs with a CuPy cache or
        with a NumPy cache in pinned host memory (``cupyx.empty_pinned``); two NumPy caches
        run the reference.
    block_mapping : array-like
        Integer ``[num_pairs, 2]`` of ``(src, dst)`` block ids; destinations distinct.
    method : {"auto", "memcpy", "kernel"}
        Transfer mechanism for device swaps (see the module notes).

    Returns
    -------
    dst_cache
        Modified in place. Device swaps are asynchronous on the current stream: synchronise
        it before reading a host destination or reusing a host source.
    """
    check_choice("method", method, SWAP_METHODS)
    block_bytes = _check_blocks(("src_cache", "dst_cache"), src_cache, dst_cache,
                                same_shape=True)
    pairs = _check_pairs(block_mapping, src_cache.shape[0], dst_cache.shape[0],
                         disjoint=_same_memory(src_cache, dst_cache))
    if is_cupy(pairs) and method == "memcpy":
        pairs = host(pairs)
    on_device = is_cupy(src_cache) or is_cupy(dst_cache)
    pinned = {name: _pinned_pointer(name, cache) for name, cache in
              (("src_cache", src_cache), ("dst_cache", dst_cache))
              if on_device and isinstance(cache, np.ndarray)}
    if not on_device:
        ref.swap_blocks(src_cache, dst_cache, pairs)
        return dst_cache
    if not len(pairs):
        return dst_cache
    if method == "auto":
        method = "kernel" if is_cupy(pairs) else swap_method(pairs, block_bytes)
    if method == "memcpy":
        _swap_memcpy(src_cache, dst_cache, pairs, block_bytes)
    else:
        src = pinned.get("src_cache", src_cache)
        dst = pinned.get("dst_cache", dst_cache)
        _launch_copy((src, dst, src, dst), pairs, block_bytes, 1, src_cache.shape[0],
                     dst_cache.shape[0])
    return dst_cache


# ----------------------------------------------------------------------------- gather
class GatherLaunch:
    """The gather of a batch's cached keys and values into packed rows (``gather_kv`` of
    ``kernels_cu/cache_ops.cu``), its fixed arguments packed once: sequence ``b``'s token
    ``t`` to row ``cu_k[b] + t`` of ``k_out`` / ``v_out`` (``[rows, num_kv_heads,
    head_dim]`` of the 16-bit ``dtype``), where the kernel writes ``cu_k`` as the prefix
    sums of the lengths it reads on the device (a bad one reported and counted as 0); an
    fp8 cache's codes widened exactly (the scales are left to the consumer). The grid covers
    ``batch`` sequences whatever their lengths (a captured launch replays for any lengths
    whose keys fit the output's rows).

    Parameters
    ----------
    dtype : dtype
        float16 or bfloat16: the packed rows' type (and a 16-bit cache's).
    kv_dtype : str or None
        The caches' fp8 format, or None.
    strides : cupaged.core.layouts.CacheStrides
        The caches' element strides (every offset a whole 16-byte chunk but the vllm
        value dims, ``v_dim != 1``).
    geometry : cupaged.core.layouts.CacheGeometry
    batch : int
        Sequences the launch covers (its grid's y).
    tables : array
        int32 device ``[batch, width]`` block tables (their row stride and width are fixed
        here).
    cu_k : array
        int32 device ``[batch + 1]``, written by each launch.
    k_out, v_out : array
        The packed rows, at least ``sum(seq_lens)`` of ``num_kv_heads * head_dim`` 16-bit
        elements each: device arrays at fixed addresses.
    """

    def __init__(self, dtype, kv_dtype, strides, geometry, batch, tables, cu_k, k_out, v_out):
        hk, d = geometry.num_kv_heads, geometry.head_dim
        units = d // GATHER_UNIT
        v_transposed = strides.v_dim != 1
        kernel = launcher("cache_ops", gather_expr(dtype, kv_dtype, v_transposed), abi.GATHER_KV)
        grid = (max(1, -(-GATHER_CTAS_PER_SM * current().sms // max(batch, 1))), batch)
        self.go = kernel.at(grid, THREADS)
        self.args = abi.GATHER_KV.bind(
            k_out=ptr(k_out), v_out=ptr(v_out), cu_k=ptr(cu_k), err=ptr(errors.error_word()),
            k_block=strides.k_block, v_block=strides.v_block, num_blocks=geometry.num_blocks,
            k_head=strides.k_head, k_chunk=strides.k_chunk, k_tok=strides.k_tok,
            v_head=strides.v_head, v_dim=strides.v_dim, v_tok=strides.v_tok,
            bt_stride=table_stride(tables), max_blocks=tables.shape[1], batch=batch,
            block_size=geometry.block_size, num_kv_heads=hk, units=units,
            tpt_log2=token_group_log2(hk * units))
        self._pack = self.args.packer("k_cache", "v_cache", "block_tables", "seq_lens")

    def __call__(self, k_cache, v_cache, block_tables, seq_lens, stream):
        """Launch on ``stream`` (a raw pointer), every array by its device address."""
        self.go(self._pack(k_cache, v_cache, block_tables, seq_lens), stream)
