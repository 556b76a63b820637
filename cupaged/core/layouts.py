"""Paged KV-cache layouts: shapes, geometry checks, strides and NHD views.

This module is the one home of what a layout means: the shapes (:func:`cache_shapes`), the
sizes read back from arrays (:func:`cache_geometry`, :func:`key_geometry`) and the element
strides every kernel takes (:class:`CacheStrides`, from :func:`layout_strides` or
:func:`cache_strides`). Adding a layout touches this module only, on the Python side.

Layouts (``layout=``):

- ``"NHD"`` (default): k and v ``[num_blocks, block_size, num_kv_heads, head_dim]``
- ``"HND"``: k and v ``[num_blocks, num_kv_heads, block_size, head_dim]``
- ``"vllm"``: k ``[num_blocks, num_kv_heads, head_dim // x, block_size, x]`` with
  ``x = 16 // itemsize``; v ``[num_blocks, num_kv_heads, head_dim, block_size]``
"""
from __future__ import annotations

import functools
import inspect
from typing import NamedTuple

import numpy as np

from .arrays import FLOAT_DTYPES, check_choice
from .checks import check_int
from .fp8 import BYTE_DTYPES, FP8_FORMATS, fp8_format

LAYOUTS = ("NHD", "HND", "vllm")
CACHE_DTYPES = FLOAT_DTYPES + BYTE_DTYPES
"""Element dtypes a cache may have: 16/32-bit floats, or 1-byte fp8 (uint8 or float8)."""


class CacheGeometry(NamedTuple):
    """Sizes read off a (k_cache, v_cache) pair."""
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int


class CacheView:
    """A paged cache pair with its layout, taken by the attention ops in place of
    ``(k_cache, v_cache)`` so that the layout travels with the arrays.

    ``paged_decode(q, CacheView(k, v, layout="HND"), block_tables, seq_lens)`` is
    ``paged_decode(q, k, v, block_tables, seq_lens, layout="HND")``; a
    :class:`cupaged.PagedKVCache` is a CacheView too. An fp8 view brings its format and
    scales the same way (``kv_dtype=``, ``k_scale=``, ``v_scale=``; a call then gives none
    of them), and ops without fp8 support refuse it.

    Parameters
    ----------
    k, v : array
        Key and value caches, shapes ``cache_shapes(layout, ...)``.
    layout : {"NHD", "HND", "vllm"}
    block_size : int, optional
        Checked against k's shape read in ``layout`` when given.
    kv_dtype : {None, "fp8_e4m3", "fp8_e5m2"}
        The caches' fp8 format (None: their own dtype).
    k_scale, v_scale : float or array, optional
        fp8 scales (as ``cupaged.paged_decode`` takes them; None: 1.0).
    """
    __slots__ = ("k", "v", "layout", "block_size", "kv_dtype", "k_scale", "v_scale")

    def __init__(self, k, v, *, layout="NHD", block_size=None, kv_dtype=None, k_scale=None,
                 v_scale=None):
        geo = key_geometry(k, layout)
        if block_size is not None and check_int("block_size", block_size) != geo.block_size:
            raise ValueError(f"block_size: expected {geo.block_size} (k's shape "
                             f"{tuple(k.shape)} read as {layout}), got {block_size}")
        if kv_dtype is not None:
            kv_dtype = fp8_format(kv_dtype).name
        elif k_scale is not None or v_scale is not None:
            raise ValueError("k_scale, v_scale: expected None for a view without kv_dtype, "
                             "got a scale")
        self.k, self.v, self.layout, self.block_size = k, v, layout, geo.block_size
        self.kv_dtype, self.k_scale, self.v_scale = kv_dtype, k_scale, v_scale

    def __repr__(self):
        fp8 = f", kv_dtype={self.kv_dtype!r}" if self.kv_dtype else ""
        return (f"CacheView(k={tuple(self.k.shape)}, v={tuple(self.v.shape)}, "
                f"layout={self.layout!r}, block_size={self.block_size}{fp8})")


def resolve_layout(layout, k_cache, q=None, num_kv_heads=None, name="k_cache"):
    """The layout of raw cache arrays: ``layout`` when given, else "NHD" unless k_cache's
    shape also reads validly as HND, which is refused (the two readings would give
    different numbers). A reading is valid when its kv-head count divides q's heads and
    equals ``num_kv_heads`` where known (the caller's k_new, or a wrapper's heads)."""
    if layout is not None:
        return layout
    shape = tuple(getattr(k_cache, "shape", ()))
    if len(shape) != 4 or not shape[1] or not shape[2]:
        return "NHD"

    def valid(heads):
        if num_kv_heads is not None and heads != num_kv_heads:
            return False
        q_shape = tuple(getattr(q, "shape", ()))
        return len(q_shape) != 3 or q_shape[1] % heads == 0

    if valid(shape[2]) and valid(shape[1]):
        raise ValueError(
            f"{name}: shape {shape} reads as NHD (block_size {shape[1]}, {shape[2]} kv heads) "
            f"and as HND ({shape[1]} kv heads, block_size {shape[2]}); pass layout='NHD' or "
            f"layout='HND', or the cache as a cupaged.CacheView or PagedKVCache")
    return "NHD"


def _view_fp8(fn, owner, takes_fp8, cache, args, kwargs):
    """An fp8 view's format and scales into ``kwargs`` (an owner's format must be the
    view's; an op without ``kv_dtype`` refuses the view)."""
    if cache.kv_dtype is None:
        return
    name = f"{type(args[0]).__name__}.{fn.__name__}" if owner else fn.__name__
    if owner:
        want = getattr(args[0], "kv_dtype", None)
        if want != cache.kv_dtype:
            raise ValueError(f"kv_dtype: expected a cache of the {type(args[0]).__name__}'s "
                             f"kv_dtype {want!r}, got a {cache.kv_dtype!r} "
                             f"{type(cache).__name__}")
    elif not takes_fp8:
        raise ValueError(f"kv_dtype: {cache.kv_dtype!r} caches are not supported by {name} "
                         f"yet, got a {type(cache).__name__} of them")
    elif kwargs.get("kv_dtype") not in (None, cache.kv_dtype):
        raise ValueError(f"kv_dtype: expected {cache.kv_dtype!r} like the "
                         f"{type(cache).__name__}, got {kwargs['kv_dtype']!r}")
    else:
        kwargs["kv_dtype"] = cache.kv_dtype
    for key in ("k_scale", "v_scale"):
        view_scale = getattr(cache, key)
        if view_scale is None:
            continue
        if kwargs.get(key) is not None:
            raise ValueError(f"{key}: expected None with a {type(cache).__name__} that has "
                             f"its own, got {kwargs[key]!r}")
        kwargs[key] = view_scale


def accepts_cache(position, owner=False, names=("k_cache", "v_cache")):
    """Decorate an op whose ``k_cache, v_cache`` arguments sit at ``position`` so that a
    :class:`CacheView` (or PagedKVCache) may stand in for both: its k and v go in as
    k_cache and v_cache (``names``) and its layout as ``layout=`` (an explicit different layout is
    refused); an fp8 view's format and scales as ``kv_dtype=``, ``k_scale=``, ``v_scale=``
    (refused by an op without ``kv_dtype``). With ``owner`` (a method of an object with a
    ``layout``, ``num_kv_heads``, ``layout_given`` and ``kv_dtype``), the view's layout and
    format must be the owner's, and raw caches whose shape reads as both NHD and HND are
    refused when the owner was given no layout."""
    def decorate(fn):
        takes_fp8 = "kv_dtype" in inspect.signature(fn).parameters

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if len(args) > position:
                cache, rest = args[position], args[position + 1:]
            else:
                cache, rest = kwargs.get(names[0]), None
            if not isinstance(cache, CacheView):
                if owner and not args[0].layout_given and cache is not None:
                    resolve_layout(None, cache, num_kv_heads=args[0].num_kv_heads,
                                   name=names[0])
                return fn(*args, **kwargs)
            want = args[0].layout if owner else kwargs.get("layout")
            if want is not None and want != cache.layout:
                where = (f"the {type(args[0]).__name__}'s layout" if owner
                         else "the layout= given")
                raise ValueError(f"{names[0]}: expected a cache in {where} {want!r}, got a "
                                 f"{cache.layout!r} {type(cache).__name__}")
            if not owner:
                kwargs["layout"] = cache.layout
            _view_fp8(fn, owner, takes_fp8, cache, args, kwargs)
            if rest is None:
                kwargs.update({names[0]: cache.k, names[1]: cache.v})
                return fn(*args, **kwargs)
            return fn(*args[:position], cache.k, cache.v, *rest, **kwargs)
        return call
    return decorate


def vllm_x(dtype) -> int:
    """Elements per 16 bytes: the innermost key extent of the vllm layout. ``dtype`` is a
    NumPy dtype (1-byte ``uint8`` and float8 included) or an fp8 format name
    (``"fp8_e4m3"``, ``"fp8_e5m2"``: 1-byte elements, so 16)."""
    if isinstance(dtype, str) and dtype in FP8_FORMATS:
        return 16
    return 16 // np.dtype(dtype).itemsize


def head_axis(layout) -> int:
    """The kv-head axis of both caches in ``layout`` (where per-head fp8 scales apply)."""
    check_choice("layout", layout, LAYOUTS)
    return 2 if layout == "NHD" else 1


def cache_shapes(layout, num_blocks, block_size, num_kv_heads, head_dim, dtype):
    """Shapes ``(k_shape, v_shape)`` of a cache in ``layout`` of ``dtype`` elements (any
    dtype :func:`vllm_x` takes; only the vllm key shape depends on it)."""
    check_choice("layout", layout, LAYOUTS)
    if layout == "NHD":
        s = (num_blocks, block_size, num_kv_heads, head_dim)
        return s, s
    if layout == "HND":
        s = (num_blocks, num_kv_heads, block_size, head_dim)
        return s, s
    x = vllm_x(dtype)
    if head_dim % x:
        raise ValueError(f"head_dim: expected a multiple of {x} for the vllm layout, got {head_dim}")
    return ((num_blocks, num_kv_heads, head_dim // x, block_size, x),
            (num_blocks, num_kv_heads, head_dim, block_size))


class CacheStrides(NamedTuple):
    """Element strides of a key/value cache pair, the one strides record kernels take.

    With ``x = 16 // itemsize`` (elements of a 16-byte chunk), key element (block, head,
    token, dim) sits at ``k_block*block + k_head*head + k_tok*token + (dim // x)*k_chunk +
    dim % x`` and value element at ``v_block*block + v_head*head + v_tok*token + dim*v_dim``
    (``v_chunk = x * v_dim``: from one 16-byte chunk of a value row to the next). Packed
    ``[tokens, Hk, D]`` rows (layout ``"ragged"``) have block strides 0.
    """
    k_block: int
    k_head: int
    k_chunk: int
    k_tok: int
    v_block: int
    v_head: int
    v_dim: int
    v_tok: int
    v_chunk: int


def layout_strides(layout, block_size, num_kv_heads, head_dim, itemsize) -> CacheStrides:
    """Strides of a dense cache in ``layout`` (one of ``("ragged",) + LAYOUTS``) of
    ``itemsize``-byte elements."""
    x = 16 // int(itemsize)
    hd = num_kv_heads * head_dim
    if layout == "ragged":
        return CacheStrides(0, head_dim, x, hd, 0, head_dim, 1, hd, x)
    check_choice("layout", layout, LAYOUTS)
    if layout == "NHD":
        return CacheStrides(block_size * hd, head_dim, x, hd, block_size * hd, head_dim, 1, hd, x)
    blocks, heads = block_size * hd, block_size * head_dim
    if layout == "HND":
        return CacheStrides(blocks, heads, x, head_dim, blocks, heads, 1, head_dim, x)
    # vllm: key [nb, hk, d // x, bs, x], value [nb, hk, d, bs]
    return CacheStrides(blocks, heads, block_size * x, x, blocks, heads, block_size, 1,
                        block_size * x)


def cache_strides(k_cache, v_cache, layout, geometry=None) -> CacheStrides:
    """Strides of a cache pair in ``layout``, its block strides as the arrays have them
    (strided blocks: :func:`block_stride`); ``geometry`` when already read. Any of
    :data:`CACHE_DTYPES`."""
    geo = geometry or cache_geometry(k_cache, v_cache, layout, CACHE_DTYPES)
    return layout_strides(layout, *geo[1:], k_cache.itemsize)._replace(
        k_block=block_stride(k_cache), v_block=block_stride(v_cache))


def key_geometry(k_cache, layout) -> CacheGeometry:
    """Sizes read off a key cache's shape in ``layout`` (rank and layout checked)."""
    check_choice("layout", layout, LAYOUTS)
    want = 5 if layout == "vllm" else 4
    if k_cache.ndim != want:
        raise ValueError(f"k_cache: expected {want} dimensions for layout {layout!r}, "
                         f"got shape {tuple(k_cache.shape)}")
    if layout == "NHD":
        nb, bs, hk, d = k_cache.shape
    elif layout == "HND":
        nb, hk, bs, d = k_cache.shape
    else:
        nb, hk, dx, bs, x = k_cache.shape
        d = dx * x
    return CacheGeometry(int(nb), int(bs), int(hk), int(d))


def cache_geometry(k_cache, v_cache, layout="NHD", dtypes=FLOAT_DTYPES) -> CacheGeometry:
    """Validate a cache pair in ``layout`` and return its geometry.

    Caches may have strided blocks (K and V as views of one ``[num_blocks, 2, ...]``
    allocation: :func:`block_stride`); within a block they are dense. ``dtypes`` are the
    element dtypes accepted (:data:`CACHE_DTYPES` for 1-byte fp8 caches too); K and V
    must share theirs.

    Raises
    ------
    ValueError, TypeError
        On an unknown layout, wrong ranks, shapes that disagree, mixed or unsupported
        dtypes, or caches whose blocks are not dense.
    """
    check_choice("layout", layout, LAYOUTS)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype not in dtypes:
            names = ("float16, bfloat16 or float32" if dtypes == FLOAT_DTYPES
                     else ", ".join(str(np.dtype(d)) for d in dtypes))
            raise TypeError(f"{name}: expected dtype {names}, got {cache.dtype}")
        check_dense_blocks(name, cache)
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"v_cache: expected dtype {k_cache.dtype} like k_cache, got {v_cache.dtype}")
    geo = key_geometry(k_cache, layout)
    if v_cache.ndim != 4:
        raise ValueError(f"v_cache: expected 4 dimensions for layout {layout!r}, "
                         f"got shape {tuple(v_cache.shape)}")
    if layout == "vllm" and k_cache.shape[-1] != vllm_x(k_cache.dtype):
        raise ValueError(f"k_cache: expected innermost extent {vllm_x(k_cache.dtype)} "
                         f"(16 bytes) for layout 'vllm', got {k_cache.shape[-1]}")
    want_v = cache_shapes(layout, *geo, k_cache.dtype)[1]
    if tuple(v_cache.shape) != want_v:
        raise ValueError(f"v_cache: expected shape {list(want_v)} to match k_cache, "
                         f"got {tuple(v_cache.shape)}")
    return geo


def check_dense_blocks(name, cache):
    """A cache's blocks must be dense (C-contiguous past the block axis), a block stride of
    at least one block and a multiple of 16 bytes apart."""
    dense = cache.itemsize
    for n, stride in zip(reversed(cache.shape[1:]), reversed(cache.strides[1:])):
        if n > 1 and stride != dense:
            raise ValueError(f"{name}: expected dense blocks (C-contiguous past the block "
                             f"axis), got strides {cache.strides}")
        dense *= n
    if cache.shape[0] > 1 and (cache.strides[0] < dense or cache.strides[0] % 16):
        raise ValueError(f"{name}: expected blocks at least {dense} bytes and a multiple of 16 "
                         f"bytes apart, got a block stride of {cache.strides[0]} bytes")


def block_stride(cache):
    """Elements from one block of a cache to the next (a block's size when dense)."""
    if cache.shape[0] > 1:
        return cache.strides[0] // cache.itemsize
    return int(np.prod(cache.shape[1:]))


def k_as_nhd(k_cache, layout):
    """View (or copy, for vllm) of a key cache as ``[num_blocks, block_size, Hk, D]``."""
    if layout == "NHD":
        return k_cache
    if layout == "HND":
        return k_cache.transpose(0, 2, 1, 3)
    nb, hk, dx, bs, x = k_cache.shape
    return k_cache.transpose(0, 3, 1, 2, 4).reshape(nb, bs, hk, dx * x)


def v_as_nhd(v_cache, layout):
    """View of a value cache as ``[num_blocks, block_size, Hk, D]``."""
    if layout == "NHD":
        return v_cache
    if layout == "HND":
        return v_cache.transpose(0, 2, 1, 3)
    return v_cache.transpose(0, 3, 1, 2)
