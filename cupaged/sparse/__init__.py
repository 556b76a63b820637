"""Block-sparse attention: MInference vertical+slash prefill, BSR, sparse policies.

- :func:`estimate_vertical_slash` / :func:`paged_estimate_vertical_slash`: pattern of one
  sequence from its last queries (docs/design.md, MInference contract).
- :func:`vertical_slash_index`: MInference's index conversion to key blocks and columns.
- :func:`vertical_slash_attention` (one sequence or a packed batch),
  :func:`paged_vertical_slash_attention` (paged cache, chunked prefill); a (sequence, head)
  keeping more than :data:`DENSE_THRESHOLD` of its causal blocks runs dense.
- :func:`varlen_block_sparse_attention`, :func:`paged_block_sparse_attention` (batched BSR,
  FlashInfer's ``indptr``/``indices``), :func:`block_sparse_attention` (one sequence).
- :class:`SparsePolicy`, :class:`MInferencePolicy`, :class:`QuestPolicy`; Quest decode
  as kernels: :func:`quest_decode`, :class:`QuestDecoder` (``cupaged.sparse.quest``).

NumPy inputs run the float64 reference (``cupaged.reference.sparse``); CuPy inputs run the
kernels of ``kernels_cu/sparse_*.cu``. Importing this package imports no CuPy.
"""
from .attention import DENSE_THRESHOLD, paged_vertical_slash_attention, \
    vertical_slash_attention
from .bsr import block_sparse_attention, paged_block_sparse_attention, \
    varlen_block_sparse_attention
from .estimate import estimate_vertical_slash, paged_estimate_vertical_slash
from .index import PAD, pad_indices, vertical_slash_index
from .policy import MInferencePolicy, PolicyContext, QuestPolicy, SparsePolicy
from .quest_decode import QuestDecoder, quest_decode

__all__ = ["DENSE_THRESHOLD", "PAD", "MInferencePolicy", "PolicyContext", "QuestDecoder",
           "QuestPolicy",
           "SparsePolicy", "quest_decode",
           "block_sparse_attention", "estimate_vertical_slash", "pad_indices",
           "paged_block_sparse_attention", "paged_estimate_vertical_slash",
           "paged_vertical_slash_attention", "varlen_block_sparse_attention",
           "vertical_slash_attention", "vertical_slash_index"]
