"""vLLM-style attention layers (the vLLM layer contract's layer contract) over cupaged's ops.

A layer takes flattened ``[num_tokens, heads * head_size]`` query, key and value rows of one
batch step, writes the new keys and values into the paged cache through ``slot_mapping`` and
attends every valid token to its sequence's cached keys. Unlike the vLLM layer contract
(docs/design.md), one batch may mix prompts, chunked-prefill pieces and decode tokens: sequence
``i`` owns query rows ``[cu_seqlens_q[i], cu_seqlens_q[i + 1])``, the last ``q_len_i`` of its
``seq_lens[i]`` positions. Rows past ``cu_seqlens_q[-1]`` are padding; their output rows are
zero.

``forward`` = (RoPE) -> ``write_kv_cache`` -> ``paged_attention``, on NumPy (reference) or
CuPy (kernels) alike. A layer built with ``kv_dtype`` (vLLM's ``kv_cache_dtype``) keeps its
cache in that fp8 format: the write quantises with the ``k_scale`` / ``v_scale`` that
``forward`` takes (or that a CacheView / PagedKVCache brings) and attention reads the cache
back through them. A sliding window of ``W`` tokens (the layer contract's ``sliding_window``,
xformers' local attention) lets a query at position ``p`` see keys ``p - W + 1 .. p``:
``window_left = W - 1``. Layers are plain objects, called like modules; CUDA tensors of torch
or JAX go in and come back as the ops take them (on the caller's stream).
"""
from __future__ import annotations

import math

import numpy as np

from ..core.arrays import accepts_dlpack, array_module, check_array, check_head_dim, check_range
from ..core.checks import check_block_tables, check_gqa
from ..core.fp8 import check_fp8_cache, fp8_format
from ..core.layouts import CACHE_DTYPES, LAYOUTS, accepts_cache, cache_geometry
from ..rope.api import check_scaling
from ..core.step import BatchStep


class AttentionMetadata(BatchStep):
    """Per-step description of a batch, shared by every layer of the step: a
    :class:`cupaged.step.BatchStep` (checked and uploaded once; no host sync).

    Parameters
    ----------
    cu_seqlens_q : array
        int32 ``[num_seqs + 1]``: sequence ``i`` owns query rows
        ``[cu_seqlens_q[i], cu_seqlens_q[i + 1])``; rows past ``cu_seqlens_q[-1]`` are
        padding.
    seq_lens : array
        int32 ``[num_seqs]``: keys of each sequence including its new tokens
        (``seq_lens[i] >= q_len_i``).
    block_tables : array
        int32 ``[num_seqs, max_blocks_per_seq]``, -1 padded.
    slot_mapping : array
        int64 ``[num_tokens]``: cache slot of each row of the layer inputs, -1 to skip
        (padding rows).
    positions, max_query_len, xp, validate
        As :class:`cupaged.step.BatchStep`.
    """


class PagedAttention:
    """GPT-style multi-head paged attention over flattened token rows (the vLLM layer
    contract of docs/design.md).

    Parameters
    ----------
    num_heads : int
        Query heads ``Hq``.
    head_size : int
        One of 64, 80, 96, 112, 128, 256.
    scale : float
        Score scale (``sm_scale``).
    num_kv_heads : int, optional
        Key/value heads ``Hk`` (default ``Hq``), dividing ``Hq``.
    sliding_window : int, optional
        ``W >= 1``: each query sees its last ``W`` positions (``window_left = W - 1``).
    layout : {"NHD", "HND", "vllm"}, optional
        Cache layout (``cupaged.layouts``); default "NHD", and then raw caches whose shape
        also reads validly as HND are refused (a CacheView or PagedKVCache brings its layout).
    kv_dtype : {None, "fp8_e4m3", "fp8_e5m2"}, optional
        The caches' fp8 format (1-byte caches: uint8 or the format's float8 dtype); None:
        caches of query's dtype. The kernels take fp8 caches under float16 / bfloat16 query
        and head sizes 64 and 128 (docs/design.md, fp8 caches).
    """

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, sliding_window=None,
                 layout=None, kv_dtype=None):
        self.num_heads = int(num_heads)
        self.head_size = int(head_size)
        self.num_kv_heads = self.num_heads if num_kv_heads is None else int(num_kv_heads)
        if not isinstance(scale, (int, float, np.floating)) or not math.isfinite(scale):
            raise ValueError(f"scale: expected a finite float, got {scale!r}")
        self.scale = float(scale)
        check_head_dim("head_size", self.head_size)
        check_gqa(self.num_heads, self.num_kv_heads, kv_name="num_kv_heads")
        if sliding_window is not None and (not isinstance(sliding_window, (int, np.integer))
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window: expected None or an int >= 1, got {sliding_window!r}")
        self.layout_given = layout is not None
        layout = "NHD" if layout is None else layout
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        self.sliding_window, self.layout = sliding_window, layout
        self.window_left = -1 if sliding_window is None else int(sliding_window) - 1
        self.kv_dtype = None if kv_dtype is None else fp8_format(kv_dtype).name

    def alibi_slopes(self, xp):
        """float32 ``[num_heads]`` ALiBi slopes in ``xp``, or None."""
        return None

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    @accepts_cache(4, owner=True, names=("key_cache", "value_cache"))
    def forward(self, query, key, value, key_cache, value_cache, metadata, *, k_scale=None,
                v_scale=None):
        """Cache write and attention of one batch step.

        Parameters
        ----------
        query : array
            ``[num_tokens, num_heads * head_size]`` (rows past the valid tokens are padding).
        key, value : array
            ``[num_tokens, num_kv_heads * head_size]``; strided slices of a fused qkv are
            taken as they are (no copy).
        key_cache, value_cache : array or None
            Paged caches in ``layout``; None for both skips the cache (prompt-only steps
            whose sequences have no past: ``seq_lens == q_lens``). ``key_cache`` may be a
            CacheView or PagedKVCache in the layer's layout and format (``value_cache``
            left out).
        metadata : AttentionMetadata
            The step (a :class:`cupaged.step.BatchStep`).
        k_scale, v_scale : float or array, optional
            fp8 layers only (default 1.0, or the CacheView's): a float, or float32 ``[]``
            or ``[num_kv_heads]`` in the caches' array module; the cache holds
            ``key / k_scale`` and ``value / v_scale``.

        Returns
        -------
        array
            ``[num_tokens, num_heads * head_size]`` in query's dtype; padding rows zero.
        """
        return self._forward(None, query, key, value, key_cache, value_cache, metadata,
                             k_scale, v_scale)

    # -- steps --
    def _rotate(self, positions, q, k):
        return q, k

    @accepts_dlpack
    def _forward(self, positions, query, key, value, key_cache, value_cache, metadata, k_scale,
                 v_scale):
        xp = array_module(query, key, value, key_cache, value_cache)
        scales = (k_scale, v_scale)
        if xp is not metadata.xp:
            raise TypeError(f"query: expected {metadata.xp.__name__} arrays like the metadata, "
                            f"got {xp.__name__} arrays")
        q, k, v = self._split_heads(query, key, value, xp)
        t = q.shape[0]
        if metadata.slot_mapping.shape[0] < t and key_cache is not None:
            raise ValueError(f"metadata: slot_mapping has {metadata.slot_mapping.shape[0]} "
                             f"entries, fewer than the {t} rows of query")
        if metadata.num_valid_tokens is not None and metadata.num_valid_tokens > t:
            raise ValueError(f"metadata: {metadata.num_valid_tokens} valid tokens, but query has "
                             f"only {t} rows")
        if positions is not None:
            check_array("positions", positions, shape=(t,), dtypes=(np.int32, np.int64), xp=xp)
        if (key_cache is None) != (value_cache is None):
            raise ValueError("key_cache, value_cache: expected both or neither, got only one")
        if self.kv_dtype is None and any(s is not None for s in scales):
            raise ValueError("k_scale, v_scale: expected None for a layer without kv_dtype, "
                             "got a scale")
        if key_cache is not None:
            self._check_cache(key_cache, value_cache, q.dtype, metadata, t)
        elif metadata.host is not None and (metadata.host["seq_lens"]
                                            != np.diff(metadata.host["cu_seqlens_q"])).any():
            raise ValueError("key_cache: None is only possible when every sequence is all new "
                             "(seq_lens == query lengths)")
        if positions is not None:
            q, k = self._rotate(positions, q, k)
        return self._attend(q, k, v, key_cache, value_cache, metadata, xp, scales).reshape(
            t, self.num_heads * self.head_size)

    def _split_heads(self, query, key, value, xp):
        """``[T, H * D]`` rows as ``[T, H, D]`` views (strided rows kept: no copy)."""
        views = []
        for name, x, heads in (("query", query, self.num_heads), ("key", key, self.num_kv_heads),
                               ("value", value, self.num_kv_heads)):
            check_array(name, x, shape=(query.shape[0], heads * self.head_size), contiguous=False)
            if x.shape[1] > 1 and x.strides[1] != x.itemsize:
                raise ValueError(f"{name}: expected a contiguous last dimension, got strides "
                                 f"{x.strides}")
            views.append(xp.lib.stride_tricks.as_strided(
                x, (x.shape[0], heads, self.head_size),
                (x.strides[0], self.head_size * x.itemsize, x.itemsize)))
        return views

    def _check_cache(self, key_cache, value_cache, dtype, metadata, rows):
        """The caches against the layer, and host metadata against the caches (block ids,
        lengths, slots: before anything is written)."""
        geo = cache_geometry(key_cache, value_cache, self.layout, CACHE_DTYPES)
        if (geo.num_kv_heads, geo.head_dim) != (self.num_kv_heads, self.head_size):
            raise ValueError(f"key_cache: expected {self.num_kv_heads} kv heads of size "
                             f"{self.head_size}, got {geo.num_kv_heads} of {geo.head_dim}")
        if self.kv_dtype is not None:
            fmt = fp8_format(self.kv_dtype)
            check_fp8_cache("key_cache", key_cache, fmt)
            check_fp8_cache("value_cache", value_cache, fmt)
        elif key_cache.dtype != dtype:
            raise TypeError(f"key_cache: expected dtype {dtype} like query, got {key_cache.dtype}"
                            + (" (an fp8 cache needs the layer's kv_dtype)"
                               if key_cache.dtype.itemsize == 1 else ""))
        h = metadata.host
        if h is not None:  # once per step and cache geometry, at its first layer
            def check():
                check_block_tables(h["block_tables"], h["seq_lens"], geo, np)
                check_range("slot_mapping", h["slot_mapping"][:rows], 0,
                            geo.num_blocks * geo.block_size, allow=(-1,))
                return True
            metadata.plan(("checked", geo, rows), check)
        return geo

    def _attend(self, q, k, v, key_cache, value_cache, metadata, xp, scales):
        """Cache write then attention of every row: the step's decode plan (one query a
        sequence) or its prefill plan, made at the first layer of the step; padding rows
        come out as zeros. ``scales`` are ``(k_scale, v_scale)`` of an fp8 cache; a step
        without a cache attends the new, unquantised keys and values."""
        from ..cache_ops.api import write_kv_cache
        from ..decode.api import PagedDecoder
        from ..prefill.api import PagedPrefiller, varlen_prefill
        if key_cache is None:
            cu = metadata.cu_seqlens_q
            return varlen_prefill(q, k, v, cu, cu, causal=True, sm_scale=self.scale,
                                  window_left=self.window_left,
                                  alibi_slopes=self.alibi_slopes(xp))
        fp8 = {} if self.kv_dtype is None else dict(k_scale=scales[0], v_scale=scales[1])
        write_kv_cache(k, v, key_cache, value_cache, metadata.slot_mapping[:q.shape[0]],
                       layout=self.layout, kv_dtype=self.kv_dtype, **fp8)
        geo = cache_geometry(key_cache, value_cache, self.layout, CACHE_DTYPES)
        key = (self.num_heads, self.num_kv_heads, self.head_size, geo.block_size, q.dtype,
               self.layout, self.window_left, self.scale, metadata.is_decode, self.kv_dtype)
        src = metadata.host if metadata.host is not None else dict(
            cu_seqlens_q=metadata.cu_seqlens_q, seq_lens=metadata.seq_lens,
            block_tables=metadata.block_tables)
        if metadata.is_decode and q.shape[0] >= metadata.num_seqs:
            dec = metadata.plan(key, lambda: PagedDecoder(
                self.num_heads, self.num_kv_heads, self.head_size, geo.block_size,
                dtype=q.dtype, layout=self.layout, window_left=self.window_left,
                sm_scale=self.scale, max_batch=max(metadata.num_seqs, 1), xp=xp,
                kv_dtype=self.kv_dtype).plan(
                    src["block_tables"], src["seq_lens"]))
            n = metadata.num_seqs
            out = xp.zeros(q.shape, q.dtype) if q.shape[0] > n else None
            o = dec.run(q[:n], key_cache, value_cache, alibi_slopes=self.alibi_slopes(xp),
                        out=None if out is None else out[:n], **fp8)
            return o if out is None else out
        pre = metadata.plan(key, lambda: PagedPrefiller(
            self.num_heads, self.num_kv_heads, self.head_size, geo.block_size, dtype=q.dtype,
            layout=self.layout, window_left=self.window_left, sm_scale=self.scale,
            kv_dtype=self.kv_dtype).plan(
                src["cu_seqlens_q"], src["block_tables"], src["seq_lens"]))
        n = metadata.num_valid_tokens
        if n is None or n == q.shape[0]:
            return pre.run(q, key_cache, value_cache, alibi_slopes=self.alibi_slopes(xp), **fp8)
        out = xp.zeros(q.shape, q.dtype)
        if n:
            pre.run(q[:n], key_cache, value_cache, alibi_slopes=self.alibi_slopes(xp),
                    out=out[:n], **fp8)
        return out


class PagedAttentionWithRoPE(PagedAttention):
    """PagedAttention with rotary embedding of queries and keys before the cache write.

    Parameters
    ----------
    num_heads, head_size, scale, num_kv_heads, sliding_window, layout, kv_dtype
        As :class:`PagedAttention`.
    rotary_dim : int
        Even number of rotated leading dimensions (``<= head_size``).
    max_position : int
        Original context length: positions must lie below ``int(max_position * factor)``.
    base : float
        RoPE base.
    is_neox_style : bool
        True: rotate halves; False: GPT-J interleaved pairs.
    rope_scaling : dict, optional
        ``{"type": "linear" | "dynamic", "factor": f}`` (see ``cupaged.apply_rope``).
    """

    def __init__(self, num_heads, head_size, scale, rotary_dim, max_position=8192, base=10000,
                 num_kv_heads=None, is_neox_style=True, rope_scaling=None, sliding_window=None,
                 layout=None, kv_dtype=None):
        super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window, layout,
                         kv_dtype)
        if not isinstance(rotary_dim, (int, np.integer)) or rotary_dim < 2 or rotary_dim % 2 \
                or rotary_dim > self.head_size:
            raise ValueError(f"rotary_dim: expected an even int in [2, {self.head_size}], got {rotary_dim!r}")
        self.rotary_dim, self.max_position, self.base = int(rotary_dim), int(max_position), float(base)
        self.is_neox_style = bool(is_neox_style)
        self.rope_scaling = check_scaling(rope_scaling, self.max_position, self.rotary_dim)

    @accepts_cache(5, owner=True, names=("key_cache", "value_cache"))
    def forward(self, positions, query, key, value, key_cache, value_cache, metadata, *,
                k_scale=None, v_scale=None):
        """As :meth:`PagedAttention.forward`, rotating by ``positions`` int32/int64
        ``[num_tokens]`` first (padding entries are not read)."""
        return self._forward(positions, query, key, value, key_cache, value_cache, metadata,
                             k_scale, v_scale)

    def _rotate(self, positions, q, k):
        from ..rope.api import apply_rope
        return apply_rope(positions, q, k, rotary_dim=self.rotary_dim, base=self.base,
                          is_neox=self.is_neox_style, scaling=self.rope_scaling,
                          max_position=self.max_position)


class PagedAttentionWithALiBi(PagedAttention):
    """PagedAttention with ALiBi: head ``h`` adds ``slopes[h] * (j - p)`` to its scores.

    Parameters
    ----------
    num_heads, head_size, scale, num_kv_heads, layout, kv_dtype
        As :class:`PagedAttention`.
    slopes : sequence of float
        ``[num_heads]`` ALiBi slopes.
    """

    def __init__(self, num_heads, head_size, scale, slopes, num_kv_heads=None, layout=None,
                 kv_dtype=None):
        super().__init__(num_heads, head_size, scale, num_kv_heads, layout=layout,
                         kv_dtype=kv_dtype)
        slopes = np.asarray(slopes, dtype=np.float32)
        if slopes.shape != (self.num_heads,) or not np.isfinite(slopes).all():
            raise ValueError(f"slopes: expected {self.num_heads} finite floats, got {slopes.tolist()}")
        self._slopes = {np: slopes}

    def alibi_slopes(self, xp):
        if xp not in self._slopes:
            self._slopes[xp] = xp.asarray(self._slopes[np])
        return self._slopes[xp]
