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
    "BlockPool": "blocks", "BlockTable": "blocks", "PoolExhausted": "blocks",
    "PagedKVCache": "kv_cache",
    # cache kernels
    "write_kv_cache": "cache_ops", "copy_blocks": "cache_ops", "swap_blocks": "cache_ops",
    # attention
    "paged_decode": "decode", "PagedDecoder": "decode", "merge_states": "decode",
    "varlen_prefill": "prefill", "paged_prefill": "prefill", "paged_attention": "prefill",
    "PagedPrefiller": "prefill",
    "sink_softmax": "sink", "sink_attention": "sink",
    "apply_rope": "rope",
    # steps and device errors
    "BatchStep": "step", "check_errors": "errors", "DeviceIndexError": "errors",
    # arrays
    "gpu_available": "_arrays", "bfloat16": "_arrays",
}
_SUBMODULES = ("sparse", "layers", "reference", "layouts", "interop", "errors", "step")

__all__ = sorted(_EXPORTS) + list(_SUBMODULES)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'cupaged' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
