"""pytest plugin for runs under compute-sanitizer: no pooled device allocations.

CuPy's memory pool carves arrays out of large blocks, so an out-of-bounds access that
stays inside a block goes unseen by memcheck. With the pool off every array is its own
``cudaMalloc`` and memcheck checks its exact bounds. (torch: PYTORCH_NO_CUDA_MEMORY_CACHING=1.)
Loaded by ``scripts/gpu_suite.sh`` with ``-p sanitize_plugin``.
"""


def pytest_configure(config):
    try:
        import cupy
    except ImportError:
        return
    cupy.cuda.set_allocator(None)
    cupy.cuda.set_pinned_memory_allocator(None)
