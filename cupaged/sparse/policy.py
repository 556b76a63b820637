"""Sparse attention policies: the MInference contract's interface, MInference prefill, Quest decode.

A policy says whether it sparsifies prefill or decode, estimates a pattern, selects the
cache blocks worth reading, runs sparse prefill attention, and resets its state. Arrays
may be NumPy (reference) or CuPy (kernels), as everywhere in cupaged.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core.arrays import array_module, check_choice, host
from ..core.checks import check_int
from ..core.layouts import key_geometry, resolve_layout
from . import quest
from .attention import paged_vertical_slash_attention, vertical_slash_attention
from .estimate import estimate_vertical_slash, paged_estimate_vertical_slash
from .index import pad_indices
from .quest_decode import quest_decode


class PolicyContext(NamedTuple):
    """What a policy may look at when choosing the blocks of one sequence."""
    query: object = None   # [Hq, D] the sequence's current query (decode)
    seq_len: int = 0       # keys of the sequence in the cache
    layer_id: int = 0


class SparsePolicy:
    """Interface of a sparse attention policy (docs/design.md, MInference contract).

    Attributes
    ----------
    supports_prefill, supports_decode : bool
        Phases the policy sparsifies.
    """
    supports_prefill = False
    supports_decode = False

    def estimate_pattern(self, q, k, layer_id=0):
        """The policy's pattern for one sequence's ``q [L, Hq, D]`` and ``k [L, Hk, D]``."""
        raise NotImplementedError(f"{type(self).__name__} estimates no prefill pattern")

    def select_blocks(self, available_blocks, ctx=None):
        """The blocks (ids in position order) worth reading; default: all of them."""
        return list(available_blocks)

    def sparse_prefill_attention(self, q, k, v, layer_id=0):
        """Prefill attention ``[L, Hq, D]`` of one sequence under the policy."""
        raise NotImplementedError(f"{type(self).__name__} has no sparse prefill")

    def reset(self):
        """Forget per-request state."""


class MInferencePolicy(SparsePolicy):
    """MInference vertical+slash sparse prefill (the MInference contract's defaults).

    Parameters
    ----------
    vertical_size, slash_size : int
        Vertical columns and slash diagonals to keep, unless ``adaptive_budget`` is set.
    adaptive_budget : float or None
        Fraction of the sequence length kept: 20 % verticals, 80 % slashes.
    num_sink_tokens, num_recent_diags : int
        First keys and diagonals always kept.
    last_q : int
        Queries the estimate uses (<= 64).
    """
    supports_prefill = True
    supports_decode = False

    def __init__(self, vertical_size=1000, slash_size=6096, adaptive_budget=0.3,
                 num_sink_tokens=30, num_recent_diags=100, last_q=64):
        self.vertical_size = check_int("vertical_size", vertical_size)
        self.slash_size = check_int("slash_size", slash_size)
        if adaptive_budget is not None and not 0 < adaptive_budget <= 1:
            raise ValueError(f"adaptive_budget: expected None or a float in (0, 1], got {adaptive_budget!r}")
        self.adaptive_budget = adaptive_budget
        self.num_sink_tokens = check_int("num_sink_tokens", num_sink_tokens, minimum=0)
        self.num_recent_diags = check_int("num_recent_diags", num_recent_diags, minimum=0)
        self.last_q = check_int("last_q", last_q)

    def _estimate_options(self):
        return dict(vertical_size=self.vertical_size, slash_size=self.slash_size,
                    last_q=self.last_q, num_sink_tokens=self.num_sink_tokens,
                    num_recent_diags=self.num_recent_diags, adaptive_budget=self.adaptive_budget)

    def estimate_pattern(self, q, k, layer_id=0):
        """``(v_idx [Hq, nv], s_idx [Hq, ns])`` int32 from the last queries of ``q``."""
        return estimate_vertical_slash(q, k, **self._estimate_options())

    def sparse_prefill_attention(self, q, k, v, layer_id=0, *, sm_scale=None, sinks=None):
        """Causal vertical+slash attention of one sequence, ``[L, Hq, D]`` in q's dtype."""
        v_idx, s_idx = self.estimate_pattern(q, k, layer_id)
        return vertical_slash_attention(q, k, v, v_idx, s_idx, sm_scale=sm_scale, sinks=sinks)

    def paged_prefill_attention(self, q, k_cache, v_cache, block_table, seq_len, layer_id=0, *,
                                layout=None, sm_scale=None, sinks=None):
        """One prefill chunk ``q [q_len, Hq, D]`` of a sequence whose first ``seq_len``
        keys (the chunk's included) are in the paged cache; ``block_table`` int32
        ``[max_blocks]``. Estimates on the cached keys, then attends sparsely."""
        xp = array_module(q, block_table)
        v_idx, s_idx = paged_estimate_vertical_slash(q, k_cache, block_table, seq_len,
                                                     layout=layout, **self._estimate_options())
        cu_q = xp.asarray([0, q.shape[0]], dtype=np.int32)
        lens = xp.asarray([seq_len], dtype=np.int32)
        return paged_vertical_slash_attention(
            q, k_cache, v_cache, pad_indices([v_idx]), pad_indices([s_idx]), cu_q,
            block_table[None], lens, layout=layout, sm_scale=sm_scale, sinks=sinks)

    def __repr__(self):
        return (f"MInferencePolicy(adaptive_budget={self.adaptive_budget}, "
                f"vertical_size={self.vertical_size}, slash_size={self.slash_size})")


class QuestPolicy(SparsePolicy):
    """Quest-style decode: per-page key bounds pick the pages each kv head reads.

    For each cache page and kv head the policy keeps the elementwise min and max of its
    keys (:meth:`update_bounds`). A decode query ``q`` scores page ``P`` by the upper bound
    ``sum_d max(q_d min_d, q_d max_d) >= q . k`` for every key of the page; a kv head takes
    the maximum over its query heads. Each (sequence, kv head) keeps its ``top_k_pages``
    best pages, always including its last (current) page and its ``first_pages`` first
    ones, in position order; ties go to the earlier page. The rules and their kernels:
    ``cupaged.sparse.quest`` (CuPy arrays run ``kernels_cu/quest.cu`` with no host read of
    device data; NumPy arrays the float64 reference); the planned form an engine runs per
    step: :class:`QuestDecoder`.

    Parameters
    ----------
    top_k_pages : int
        Pages read per (sequence, kv head).
    first_pages : int
        Pages at the start of each sequence always read (attention sinks).
    bounds_dtype : {"float32", "bfloat16", "fp8_e4m3"}
        Of the bounds (bfloat16 and fp8 e4m3 rounded outward: a half or a quarter of the
        bytes a decode step reads, looser scores; e4m3 bounds past +-448 are unknown and
        score as infinite).
    """
    supports_prefill = False
    supports_decode = True

    def __init__(self, top_k_pages, first_pages=0, bounds_dtype="float32"):
        self.top_k_pages = check_int("top_k_pages", top_k_pages)
        self.first_pages = check_int("first_pages", first_pages, minimum=0)
        check_choice("bounds_dtype", str(bounds_dtype), tuple(quest.BOUND_NAMES))
        self.bounds_dtype = str(bounds_dtype)
        self.reset()

    def reset(self):
        self.k_min = self.k_max = None   # [num_blocks, Hk, D] of bounds_dtype
        self.block_size = None

    def update_bounds(self, k_cache, block_tables, seq_lens, *, layout=None, last_page_only=False):
        """Recompute the bounds of the pages holding each sequence's keys (on the device for
        CuPy arrays: lengths and block ids checked there).

        Parameters
        ----------
        k_cache : array
            Key cache in ``layout`` (see ``cupaged.layouts``).
        layout : {"NHD", "HND", "vllm"}, optional
            Default "NHD", refused (ValueError) when k_cache's shape also reads as HND, as
            in :func:`cupaged.paged_decode`.
        block_tables : array
            int32 ``[B, max_blocks]``.
        seq_lens : array
            int32 ``[B]`` keys per sequence.
        last_page_only : bool
            Only each sequence's last page (after a decode step appended to it).
        """
        xp = array_module(k_cache, block_tables, seq_lens)
        layout = resolve_layout(layout, k_cache)
        geo = key_geometry(k_cache, layout)
        shape = (geo.num_blocks, geo.num_kv_heads, geo.head_dim)
        if self.k_min is None or self.k_min.shape != shape or array_module(self.k_min) is not xp:
            k_min, k_max = quest.empty_bounds(shape, self.bounds_dtype, xp)
        else:
            k_min, k_max = self.k_min, self.k_max
        quest.update_page_bounds(k_cache, block_tables, seq_lens, k_min, k_max, layout=layout,
                                 last_page_only=last_page_only)
        self.k_min, self.k_max, self.block_size = k_min, k_max, geo.block_size

    def _bounds(self):
        if self.k_min is None:
            raise ValueError("QuestPolicy: call update_bounds() before scoring pages")
        return self.k_min, self.k_max

    def page_scores(self, q, block_tables, seq_lens):
        """Upper bounds per (sequence, kv head, page position), float32 ``[B, Hk, max_blocks]``;
        pages past a sequence are ``-inf``, its last page ``+inf``."""
        return quest.page_scores(q, *self._bounds(), block_tables, seq_lens, self.block_size)

    def select_pages(self, q, block_tables, seq_lens):
        """Chosen page positions per (sequence, kv head).

        Returns
        -------
        positions : array
            int32 ``[B, Hk, k]``, ascending, ``k = min(top_k_pages, max_blocks)``; entries
            past a sequence's page count are -1.
        counts : array
            int32 ``[B]`` pages kept per sequence (the same for each kv head), in q's array
            module (computed on the device for CuPy arrays).
        """
        sel = quest.select_pages(q, *self._bounds(), block_tables, seq_lens, self.block_size,
                                 self.top_k_pages, first_pages=self.first_pages)
        return sel.positions, (sel.positions[:, 0] >= 0).sum(axis=-1).astype(np.int32)

    def select_blocks(self, available_blocks, ctx=None):
        """Blocks of one sequence worth reading: the union over its kv heads of the top pages.

        ``available_blocks`` are its block ids in position order; ``ctx.query`` ``[Hq, D]``.
        Returns a host list (a CuPy query's selection is read back).
        """
        if ctx is None or ctx.query is None:
            return list(available_blocks)
        xp = array_module(ctx.query)
        table = xp.asarray([list(available_blocks)], dtype=np.int32)
        lens = xp.asarray([ctx.seq_len], dtype=np.int32)
        pos, _ = self.select_pages(ctx.query[None], table, lens)
        keep = sorted(set(host(pos)[0].ravel().tolist()) - {-1})
        return [int(available_blocks[i]) for i in keep]

    def decode(self, q, k_cache, v_cache, block_tables, seq_lens, *, layout=None, sm_scale=None,
               sinks=None):
        """Decode attention ``[B, Hq, D]`` reading, for each kv head, only its selected pages
        (``layout`` as in :meth:`update_bounds`; no host round trip for CuPy arrays).

        The caches' blocks must be dense and one after the other: the decode runs on a view
        with one kv head a block (``cupaged.sparse.quest.decode_view``).
        """
        layout = resolve_layout(layout, k_cache, q)
        bs = key_geometry(k_cache, layout).block_size
        if bs != self.block_size:
            raise ValueError(f"k_cache: expected block size {self.block_size} as in "
                             f"update_bounds(), got {bs}")
        return quest_decode(q, k_cache, v_cache, *self._bounds(), block_tables, seq_lens,
                            self.top_k_pages, layout=layout, first_pages=self.first_pages,
                            sm_scale=sm_scale, sinks=sinks)
