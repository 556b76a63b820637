"""vLLM-style attention layers (seed 002's layer contract) over cupaged's ops.

A layer takes flattened ``[num_tokens, heads * head_size]`` query, key and value rows of one
batch step, writes the new keys and values into the paged cache through ``slot_mapping``
and attends every valid token to its sequence's cached keys. Unlike seed 002, one batch may
mix prompts, chunked-prefill pieces and decode tokens: sequence ``i`` owns query rows
``[cu_seqlens_q[i], cu_seqlens_q[i + 1])``, the last ``q_len_i`` of its ``seq_lens[i]``
positions. Rows past ``cu_seqlens_q[-1]`` are padding; their output rows are zero.

``forward`` = (RoPE) -> ``write_kv_cache`` -> ``paged_attention``, on NumPy (reference) or
CuPy (kernels) alike. A sliding window of ``W`` tokens (seed 002's ``sliding_window``,
xformers' local attention) lets a query at position ``p`` see keys ``p - W + 1 .. p``:
``window_left = W - 1``. No torch: layers are plain objects, called like modules.
"""
from __future__ import annotations

import math

import numpy as np

from ._arrays import array_module, check_array, check_head_dim, check_range, host
from ._checks import check_block_tables, check_cu_seqlens, check_gqa
from .layouts import LAYOUTS, cache_geometry
from .rope import check_scaling



class AttentionMetadata:
    """Per-step description of a batch, shared by every layer of the step.

    Parameters
    ----------
    cu_seqlens_q : array
        int32 ``[num_seqs + 1]``: sequence ``i`` owns query rows
        ``[cu_seqlens_q[i], cu_seqlens_q[i + 1])``; ``cu_seqlens_q[-1]`` is the number of
        valid tokens (the rest of the inputs is padding).
    seq_lens : array
        int32 ``[num_seqs]``: keys of each sequence including its new tokens
        (``seq_lens[i] >= q_len_i``).
    block_tables : array
        int32 ``[num_seqs, max_blocks_per_seq]``, -1 padded.
    slot_mapping : array
        int64 ``[num_valid_tokens]`` (or longer; extra entries are ignored): cache slot of
        each new token, -1 to skip.

    All four live in the array module of the layer inputs (NumPy or CuPy). Host copies of
    the lengths are taken once here (one sync on CuPy), not per layer.
    """

    def __init__(self, cu_seqlens_q, seq_lens, block_tables, slot_mapping):
        xp = array_module(cu_seqlens_q, seq_lens, block_tables, slot_mapping)
        self.cu_host = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, xp)
        num_seqs = len(self.cu_host) - 1
        check_array("seq_lens", seq_lens, shape=(num_seqs,), dtypes=np.int32, xp=xp)
        check_array("block_tables", block_tables, shape=(num_seqs, None), dtypes=np.int32, xp=xp)
        check_array("slot_mapping", slot_mapping, ndim=1, dtypes=np.int64, xp=xp)
        self.seq_lens_host = host(seq_lens).astype(np.int64)
        short = self.seq_lens_host < np.diff(self.cu_host)
        if short.any():
            i = int(np.argmax(short))
            raise ValueError(f"seq_lens: sequence {i} has {int(self.seq_lens_host[i])} keys, "
                             f"fewer than its {int(np.diff(self.cu_host)[i])} new tokens")
        if slot_mapping.shape[0] < self.num_valid_tokens:
            raise ValueError(f"slot_mapping: expected at least {self.num_valid_tokens} entries, "
                             f"got {slot_mapping.shape[0]}")
        self.xp = xp
        self.cu_seqlens_q, self.seq_lens = cu_seqlens_q, seq_lens
        self.block_tables, self.slot_mapping = block_tables, slot_mapping

    @property
    def num_seqs(self) -> int:
        return len(self.cu_host) - 1

    @property
    def num_valid_tokens(self) -> int:
        return int(self.cu_host[-1])

    @property
    def query_lens(self) -> np.ndarray:
        """Host int64 ``[num_seqs]`` new tokens per sequence."""
        return np.diff(self.cu_host).astype(np.int64)

    def positions(self):
        """int32 ``[num_valid_tokens]`` absolute positions ``seq_len - q_len + i`` of the rows."""
        q_lens = self.query_lens
        starts = np.repeat(self.seq_lens_host - q_lens - self.cu_host[:-1], q_lens)
        pos = (np.arange(self.num_valid_tokens) + starts).astype(np.int32)
        return self.xp.asarray(pos)


class PagedAttention:
    """GPT-style multi-head paged attention over flattened token rows (seed 002).

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
    layout : {"NHD", "HND", "vllm"}
        Cache layout (``cupaged.layouts``).
    """

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, sliding_window=None,
                 layout="NHD"):
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
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        self.sliding_window, self.layout = sliding_window, layout
        self.window_left = -1 if sliding_window is None else int(sliding_window) - 1

    def alibi_slopes(self, xp):
        """float32 ``[num_heads]`` ALiBi slopes in ``xp``, or None."""
        return None

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, query, key, value, key_cache, value_cache, metadata):
        """Cache write and attention of one batch step.

        Parameters
        ----------
        query : array
            ``[num_tokens, num_heads * head_size]`` (rows past the valid tokens are padding).
        key, value : array
            ``[num_tokens, num_kv_heads * head_size]``; strided slices of a fused qkv are
            copied to contiguous rows first.
        key_cache, value_cache : array or None
            Paged caches in ``layout``; None for both skips the cache (prompt-only steps
            whose sequences have no past: ``seq_lens == q_lens``).
        metadata : AttentionMetadata

        Returns
        -------
        array
            ``[num_tokens, num_heads * head_size]`` in query's dtype; padding rows zero.
        """
        return self._forward(None, query, key, value, key_cache, value_cache, metadata)

    # -- steps --
    def _rotate(self, positions, q, k):
        return q, k

    def _forward(self, positions, query, key, value, key_cache, value_cache, metadata):
        xp = array_module(query, key, value, key_cache, value_cache, metadata.cu_seqlens_q)
        q, k, v = self._split_heads(query, key, value, xp)
        n = metadata.num_valid_tokens
        if n > q.shape[0]:
            raise ValueError(f"metadata: {n} valid tokens, but query has only {q.shape[0]} rows")
        if positions is not None:
            check_array("positions", positions, shape=(q.shape[0],), dtypes=(np.int32, np.int64), xp=xp)
        if (key_cache is None) != (value_cache is None):
            raise ValueError("key_cache, value_cache: expected both or neither, got only one")
        if key_cache is not None:
            self._check_cache(key_cache, value_cache, q.dtype, metadata, xp)
        elif (metadata.seq_lens_host != metadata.query_lens).any():
            raise ValueError("key_cache: None is only possible when every sequence is all new "
                             "(seq_lens == query lengths)")
        out = xp.zeros_like(q)
        if n:
            q, k, v = q[:n], k[:n], v[:n]
            if positions is not None:
                q, k = self._rotate(positions[:n], q, k)
            self._attend(q, k, v, key_cache, value_cache, metadata, xp, out[:n])
        return out.reshape(query.shape[0], self.num_heads * self.head_size)

    def _split_heads(self, query, key, value, xp):
        views = []
        for name, x, heads in (("query", query, self.num_heads), ("key", key, self.num_kv_heads),
                               ("value", value, self.num_kv_heads)):
            check_array(name, x, shape=(query.shape[0], heads * self.head_size), contiguous=False)
            views.append(xp.ascontiguousarray(x).reshape(x.shape[0], heads, self.head_size))
        return views

    def _check_cache(self, key_cache, value_cache, dtype, metadata, xp):
        geo = cache_geometry(key_cache, value_cache, self.layout)
        if (geo.num_kv_heads, geo.head_dim) != (self.num_kv_heads, self.head_size):
            raise ValueError(f"key_cache: expected {self.num_kv_heads} kv heads of size "
                             f"{self.head_size}, got {geo.num_kv_heads} of {geo.head_dim}")
        if key_cache.dtype != dtype:
            raise TypeError(f"key_cache: expected dtype {dtype} like query, got {key_cache.dtype}")
        check_block_tables(metadata.block_tables, metadata.seq_lens, geo, xp)
        slots = host(metadata.slot_mapping[:metadata.num_valid_tokens])
        check_range("slot_mapping", slots, 0, geo.num_blocks * geo.block_size, allow=(-1,))

    def _attend(self, q, k, v, key_cache, value_cache, metadata, xp, out):
        from .prefill import paged_attention, varlen_prefill
        opts = dict(causal=True, sm_scale=self.scale, window_left=self.window_left,
                    alibi_slopes=self.alibi_slopes(xp), out=out)
        if key_cache is None:
            cu = metadata.cu_seqlens_q
            return varlen_prefill(q, k, v, cu, cu, **opts)
        from .cache_ops import write_kv_cache
        write_kv_cache(k, v, key_cache, value_cache, metadata.slot_mapping[:q.shape[0]],
                       layout=self.layout)
        return paged_attention(q, key_cache, value_cache, metadata.cu_seqlens_q,
                               metadata.block_tables, metadata.seq_lens, layout=self.layout, **opts)


class PagedAttentionWithRoPE(PagedAttention):
    """PagedAttention with rotary embedding of queries and keys before the cache write.

    Parameters
    ----------
    num_heads, head_size, scale, num_kv_heads, sliding_window, layout
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
                 layout="NHD"):
        super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window, layout)
        if not isinstance(rotary_dim, (int, np.integer)) or rotary_dim < 2 or rotary_dim % 2 \
                or rotary_dim > self.head_size:
            raise ValueError(f"rotary_dim: expected an even int in [2, {self.head_size}], got {rotary_dim!r}")
        self.rotary_dim, self.max_position, self.base = int(rotary_dim), int(max_position), float(base)
        self.is_neox_style = bool(is_neox_style)
        self.rope_scaling = check_scaling(rope_scaling, self.max_position, self.rotary_dim)

    def forward(self, positions, query, key, value, key_cache, value_cache, metadata):
        """As :meth:`PagedAttention.forward`, rotating by ``positions`` int32/int64
        ``[num_tokens]`` first (padding entries are not read)."""
        return self._forward(positions, query, key, value, key_cache, value_cache, metadata)

    def _rotate(self, positions, q, k):
        from .rope import apply_rope
        return apply_rope(positions, q, k, rotary_dim=self.rotary_dim, base=self.base,
                          is_neox=self.is_neox_style, scaling=self.rope_scaling,
                          max_position=self.max_position)


class PagedAttentionWithALiBi(PagedAttention):
    """PagedAttention with ALiBi: head ``h`` adds ``slopes[h] * (j - p)`` to its scores.

    Parameters
    ----------
    num_heads, head_size, scale, num_kv_heads
        As :class:`PagedAttention`.
    slopes : sequence of float
        ``[num_heads]`` ALiBi slopes.
    """

    def __init__(self, num_heads, head_size, scale, slopes, num_kv_heads=None, layout="NHD"):
        super().__init__(num_heads, head_size, scale, num_kv_heads, layout=layout)
        slopes = np.asarray(slopes, dtype=np.float32)
        if slopes.shape != (self.num_heads,) or not np.isfinite(slopes).all():
            raise ValueError(f"slopes: expected {self.num_heads} finite floats, got {slopes.tolist()}")
        self._slopes = {np: slopes}

    def alibi_slopes(self, xp):
        if xp not in self._slopes:
            self._slopes[xp] = xp.asarray(self._slopes[np])
        return self._slopes[xp]
