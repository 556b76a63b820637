"""cupaged: paged-attention kernels for LLM serving, compiled at run time by CuPy.

Every op dispatches on its inputs: CuPy arrays run the CUDA kernels, NumPy arrays run the
float64 reference backend (``cupaged.reference``), and CUDA arrays of other frameworks
(torch, JAX) are taken zero-copy through DLPack and returned in kind. ``import cupaged``
imports neither CuPy nor torch; names below load their module on first use.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    # block management
    "BlockPool": "engine.blocks", "BlockTable": "engine.blocks", "PoolExhausted": "engine.blocks",
    "PagedKVCache": "engine.kv_cache", "CacheView": "core.layouts",
    # cache kernels
    "write_kv_cache": "cache_ops.api", "copy_blocks": "cache_ops.api", "swap_blocks": "cache_ops.api",
    # attention
    "paged_decode": "decode.api", "PagedDecoder": "decode.api", "merge_states": "decode.api",
    "varlen_prefill": "prefill.api", "paged_prefill": "prefill.api",
    "paged_attention": "prefill.api", "PagedPrefiller": "prefill.api",
    "sink_softmax": "sink.api", "sink_attention": "sink.api",
    "apply_rope": "rope.api",
    "block_sparse_attention": "sparse.bsr", "varlen_block_sparse_attention": "sparse.bsr",
    "paged_block_sparse_attention": "sparse.bsr",
    # steps and device errors
    "BatchStep": "core.step", "check_errors": "core.errors", "DeviceIndexError": "core.errors",
    # arrays
    "gpu_available": "core.arrays", "bfloat16": "core.arrays",
}
# public submodule names and where they live
_SUBMODULES = {"sparse": "sparse", "layers": "engine.layers", "reference": "reference",
               "layouts": "core.layouts", "interop": "interop", "errors": "core.errors",
               "step": "core.step"}

__all__ = sorted(_EXPORTS) + list(_SUBMODULES)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{_SUBMODULES[name]}", __name__)
    raise AttributeError(f"module 'cupaged' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
