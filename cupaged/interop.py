"""Framework interop: CUDA arrays of torch, JAX and others as CuPy arrays, and back.

Every public op already does this itself (``_arrays.accepts_dlpack``); these helpers are
for callers who want to run their own CuPy code on framework tensors, or hold CuPy arrays
made by cupaged (a ``PagedKVCache``) as framework tensors. Nothing is copied: the arrays
share memory through DLPack. No framework is imported unless the caller passed its array.

Examples
--------
>>> k = interop.as_cupy(torch_tensor)            # same memory, cupy.ndarray
>>> t = interop.to_framework(k * 2, like=torch_tensor)
>>> with interop.caller_stream(torch_tensor):    # CuPy work on torch's current stream
...     k += 1
"""
from __future__ import annotations

import contextlib

import numpy as np

from .core.arrays import _caller_stream, _export_foreign, _foreign_root, _import_foreign, is_cupy

# DLPack device types (dlpack.h DLDeviceType) for messages
_DEVICE_NAMES = {1: "CPU", 2: "CUDA", 3: "CUDA host (pinned)", 4: "OpenCL", 7: "Vulkan",
                 8: "Metal", 9: "VPI", 10: "ROCm", 11: "ROCm host", 13: "CUDA managed",
                 14: "oneAPI"}
_CUDA_DEVICES = (2, 3, 13)


def as_cupy(x):
    """View a CUDA array of any framework as a ``cupy.ndarray`` without copying.

    Parameters
    ----------
    x : cupy.ndarray or object with ``__dlpack__`` on a CUDA device
        Any shape and dtype (float16, bfloat16 and float32 tensors keep their dtype;
        bfloat16 becomes ``ml_dtypes.bfloat16``).

    Returns
    -------
    cupy.ndarray
        Sharing ``x``'s memory (same data pointer), ``x`` itself if it is CuPy already.

    Raises
    ------
    TypeError
        If ``x`` is a NumPy array, exports no ``__dlpack__``, lives on a non-CUDA device,
        or CuPy with a CUDA device is not available.
    """
    if is_cupy(x):
        return x
    if isinstance(x, np.ndarray):
        raise TypeError("x: expected a CUDA array, got numpy.ndarray (host memory); "
                        "copy it with cupy.asarray(x) if a device copy is wanted")
    if not hasattr(x, "__dlpack__"):
        raise TypeError(f"x: expected an array exporting __dlpack__, got {type(x).__name__}")
    if hasattr(x, "__dlpack_device__"):
        kind = int(x.__dlpack_device__()[0])
        if kind not in _CUDA_DEVICES:
            raise TypeError(f"x: expected a CUDA array, got a {type(x).__name__} on DLPack "
                            f"device {_DEVICE_NAMES.get(kind, kind)}")
    return _import_foreign(x, _foreign_root(x))


def to_framework(y, like):
    """Hand a CuPy array back as an array of ``like``'s framework, without copying.

    Parameters
    ----------
    y : cupy.ndarray
        Result to hand back, any shape and dtype.
    like : array-like
        Decides the kind: a torch tensor gives a torch tensor, a JAX array a JAX array,
        a CuPy array (or any other kind) ``y`` itself.

    Returns
    -------
    array
        Sharing ``y``'s memory.

    Raises
    ------
    TypeError
        If ``y`` is not a CuPy array, or ``like`` is a NumPy array (host memory: use
        ``y.get()`` to copy instead).
    """
    if not is_cupy(y):
        raise TypeError(f"y: expected a cupy.ndarray, got {type(y).__module__}.{type(y).__name__}")
    if isinstance(like, np.ndarray):
        raise TypeError("like: expected a device array, got numpy.ndarray; "
                        "use y.get() for a host copy")
    root = _foreign_root(like)
    return y if root is None else _export_foreign(y, root)


@contextlib.contextmanager
def caller_stream(x):
    """Make CuPy work inside the block run on the caller's current stream for ``x``.

    For a torch tensor this is ``torch.cuda.current_stream(x.device)`` (wrapped as a
    ``cupy.cuda.ExternalStream``), so CuPy kernels queue behind the torch work that
    produced ``x`` and before torch work that follows. For other kinds (CuPy, JAX) the
    current CuPy stream is kept.

    Parameters
    ----------
    x : array-like
        An array of the caller's framework.

    Yields
    ------
    cupy.cuda.ExternalStream or None
        The stream entered, or None when nothing changed.
    """
    root = _foreign_root(x)
    stream = _caller_stream(root, x) if root is not None else None
    if stream is None:
        yield None
        return
    with stream:
        yield stream
