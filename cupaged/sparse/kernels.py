"""Kernel specialisations of the sparse ops and the launch details they share.

Sources: ``kernels_cu/sparse_estimate.cu`` (pattern estimate), ``sparse_index.cu`` (index
conversion), ``sparse_attention.cu`` (block-sparse attention); ``sparse_tile.cuh`` holds
the K/V tile gather and the Q.K^T tile all tensor-core kernels share. Kernels take fp16 or
bf16 and every head size of ``HEAD_DIMS``.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._arrays import HEAD_DIMS, bfloat16, float16
from .._compile import Spec, ctype, get_kernel

KERNEL_DTYPES = (float16, bfloat16)
NULL = np.uint64(0)          # a null pointer argument
ROWS = KEYS = 64             # query rows per CTA tile, keys per K/V tile
THREADS = 128
EST_MAX_TILES = 16           # key tiles per estimate CTA (sparse_estimate.cu)
LOG2E = 1.4426950408889634
INDEX_EXPR = "cupaged::vertical_slash_index_kernel"


def attention_expr(dtype, head_dim):
    return f"cupaged::sparse_attention<{ctype(dtype)}, {head_dim}>"


def estimate_expr(dtype, head_dim):
    return f"cupaged::vs_estimate<{ctype(dtype)}, {head_dim}>"


def column_parts(head_dim):
    """CTAs sharing one query tile's output columns (2 for head size 256)."""
    return 1 if head_dim <= 128 else head_dim // 128


def attention_smem(head_dim):
    """Dynamic shared memory of ``sparse_attention`` (matches its layout), bytes."""
    stages = 2 if head_dim <= 128 else 1
    dv = head_dim // column_parts(head_dim)
    elems = ROWS * (head_dim + 8) + stages * KEYS * (head_dim + 8) + stages * KEYS * (dv + 8)
    return elems * 2 + stages * KEYS * 4


def estimate_smem(head_dim):
    """Dynamic shared memory of ``vs_estimate``: Q tile and two K tiles, bytes."""
    return (ROWS + 2 * KEYS) * (head_dim + 8) * 2


_SMEM_SET = set()


def kernel(stem, expr, smem=0):
    """The compiled kernel, allowed ``smem`` bytes of dynamic shared memory."""
    kern = get_kernel(stem, expr)
    if smem and (id(kern), smem) not in _SMEM_SET:  # the default allows 48 KiB - static
        kern.max_dynamic_shared_size_bytes = smem
        kern.preferred_shared_memory_carveout = 100   # two CTAs per SM where they fit
        _SMEM_SET.add((id(kern), smem))
    return kern


class KVSource(NamedTuple):
    """Kernel arguments locating keys and values: dense packed rows or a paged cache."""
    k: object
    v: object
    cu_k: object          # int32 [B + 1] dense row starts, or NULL
    table: object         # int32 block tables, or NULL
    table_stride: int
    page_size: int
    page_stride: int      # elements
    tok_stride: int
    head_stride: int

    def args(self):
        return (self.table, np.int32(self.table_stride), np.int32(self.page_size),
                np.int64(self.page_stride), np.int64(self.tok_stride), np.int64(self.head_stride))


def dense_kv(k, v, cu_k=NULL):
    """Source of packed ``[tokens, Hk, D]`` keys and values."""
    _, hk, d = k.shape
    return KVSource(k, v, cu_k, NULL, 0, 1, 0, hk * d, d)


def paged_kv(k_cache, v_cache, block_tables, layout):
    """Source of an ``"NHD"`` or ``"HND"`` paged cache; ``block_tables`` 1-D or 2-D."""
    nb, a, b, d = k_cache.shape
    if layout == "NHD":       # [nb, bs, Hk, D]
        bs, hk = a, b
        tok, head = hk * d, d
    else:                     # "HND": [nb, Hk, bs, D]
        hk, bs = a, b
        tok, head = d, bs * d
    stride = block_tables.shape[-1] if block_tables.ndim == 2 else 0
    return KVSource(k_cache, v_cache, NULL, block_tables, stride, bs, bs * hk * d, tok, head)


def kernel_specializations():
    """Every sparse kernel the library can launch: index, estimate and attention per
    dtype (fp16, bf16) and head size."""
    specs = [Spec("sparse_index", INDEX_EXPR)]
    for dtype in KERNEL_DTYPES:
        for d in HEAD_DIMS:
            specs.append(Spec("sparse_estimate", estimate_expr(dtype, d)))
            specs.append(Spec("sparse_attention", attention_expr(dtype, d)))
    return specs
