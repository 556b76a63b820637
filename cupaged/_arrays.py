"""Array modules, DLPack handoff and argument checks shared by every op.

Every public op accepts NumPy arrays (run by the reference backend), CuPy arrays (run by
the CUDA kernels) or any object exporting ``__dlpack__`` from a CUDA device (a torch or
JAX array), which is taken zero-copy and handed back in the caller's kind.
"""
from __future__ import annotations

import functools
import sys

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
FLOAT_DTYPES = (float16, bfloat16, float32)
HEAD_DIMS = (64, 80, 96, 112, 128, 256)

_DTYPE_NAMES = {"float16": float16, "half": float16, "fp16": float16,
                "bfloat16": bfloat16, "bf16": bfloat16,
                "float32": float32, "float": float32, "fp32": float32}


def as_dtype(dtype) -> np.dtype:
    """Normalise ``"bfloat16"``, ``np.float16``, ... to a NumPy dtype of FLOAT_DTYPES."""
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower()]
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype: expected one of float16, bfloat16, float32, got {dtype!r}") from None
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"dtype: expected one of float16, bfloat16, float32, got {dt}")
    return dt


# ----------------------------------------------------------------------------- modules
@functools.lru_cache(maxsize=None)
def cupy_module():
    """Return the ``cupy`` module, or None where CuPy is not installed or unusable."""
    try:
        import cupy
    except Exception:  # ImportError, or a broken CUDA install
        return None
    return cupy


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    cp = cupy_module()
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def is_cupy(x) -> bool:
    cp = sys.modules.get("cupy")
    return cp is not None and isinstance(x, cp.ndarray)


def array_module(*arrays):
    """The module (numpy or cupy) shared by every non-None array in ``arrays``.

    Raises
    ------
    TypeError
        If the arrays mix NumPy and CuPy, or one is neither.
    """
    mods = set()
    for a in arrays:
        if a is None:
            continue
        if isinstance(a, np.ndarray):
            mods.add("numpy")
        elif is_cupy(a):
            mods.add("cupy")
        else:
            raise TypeError(f"expected numpy.ndarray or cupy.ndarray, got {type(a).__name__}")
    if len(mods) > 1:
        raise TypeError("arguments mix NumPy (host) and CuPy (device) arrays; "
                        "expected all on one device")
    if mods == {"cupy"}:
        return cupy_module()
    return np


# ----------------------------------------------------------------------------- DLPack
def _foreign_root(x):
    """Top-level module name of a foreign array-like exporting ``__dlpack__``, else None."""
    if isinstance(x, np.ndarray) or is_cupy(x) or not hasattr(x, "__dlpack__"):
        return None
    return type(x).__module__.split(".")[0]


def _caller_stream(root, x):
    """A CuPy stream wrapping the caller's current stream for ``x``'s framework, or None."""
    cp = cupy_module()
    if root == "torch":
        torch = sys.modules["torch"]
        ptr = torch.cuda.current_stream(x.device).cuda_stream
        return cp.cuda.ExternalStream(ptr, x.device.index or 0)
    return None


def _import_foreign(x, root):
    cp = cupy_module()
    if cp is None or not gpu_available():
        raise TypeError(f"got a {type(x).__name__} exporting __dlpack__, but CuPy with a CUDA "
                        "device is needed to take it")
    device = x.__dlpack_device__() if hasattr(x, "__dlpack_device__") else None
    if device is not None and int(device[0]) not in (2, 3, 13):  # CUDA, CUDA host, CUDA managed
        raise TypeError(f"expected a CUDA array, got a {type(x).__name__} on DLPack "
                        f"device type {int(device[0])}")
    return cp.from_dlpack(x)


def _export_foreign(y, root):
    if root == "torch":
        return sys.modules["torch"].from_dlpack(y)
    if root in ("jax", "jaxlib"):
        import jax.dlpack
        return jax.dlpack.from_dlpack(y)
    return y


def _convert_out(result, root):
    cp = cupy_module()
    if cp is not None and isinstance(result, cp.ndarray):
        return _export_foreign(result, root)
    if isinstance(result, tuple):
        return tuple(_convert_out(r, root) for r in result)
    return result


def accepts_dlpack(fn):
    """Decorate a public op so foreign CUDA arrays go in zero-copy and come back in kind.

    Any argument exporting ``__dlpack__`` (torch, JAX) is wrapped as a CuPy array; the op
    runs on the caller's current stream (torch's, where the caller passed torch tensors);
    CuPy results are handed back through the caller's framework. Nothing foreign is
    imported unless the caller passed it in.
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        root = first = None
        for a in list(args) + list(kwargs.values()):
            r = _foreign_root(a)
            if r is not None:
                root, first = r, a
                break
        if root is None:
            return fn(*args, **kwargs)
        args = tuple(_import_foreign(a, root) if _foreign_root(a) else a for a in args)
        kwargs = {k: (_import_foreign(v, root) if _foreign_root(v) else v) for k, v in kwargs.items()}
        stream = _caller_stream(root, first)
        if stream is None:
            return _convert_out(fn(*args, **kwargs), root)
        with stream:
            return _convert_out(fn(*args, **kwargs), root)
    return wrapper


# ----------------------------------------------------------------------------- checks
def _shape_str(shape):
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def check_array(name, x, *, shape=None, ndim=None, dtypes=None, xp=None, contiguous=True):
    """Check one array argument; raise TypeError/ValueError naming it otherwise.

    Parameters
    ----------
    name : str
        Argument name used in messages.
    shape : tuple of int or None, optional
        Expected shape; ``None`` entries match any extent.
    ndim : int, optional
        Expected rank (implied by ``shape``).
    dtypes : dtype or sequence of dtypes, optional
        Accepted dtypes.
    xp : module, optional
        Array module the argument must belong to (numpy or cupy).
    contiguous : bool
        Require C-contiguity.
    """
    if x is None:
        raise TypeError(f"{name}: expected an array, got None")
    if xp is not None and array_module(x) is not xp:
        where = "CuPy (device)" if xp is not np else "NumPy (host)"
        raise TypeError(f"{name}: expected a {where} array like the other arguments, "
                        f"got {type(x).__module__}.{type(x).__name__}")
    if dtypes is not None:
        allowed = tuple(np.dtype(d) for d in (dtypes if isinstance(dtypes, (tuple, list)) else (dtypes,)))
        if x.dtype not in allowed:
            names = ", ".join(str(d) for d in allowed)
            raise TypeError(f"{name}: expected dtype {names}, got {x.dtype}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions"
                         + (f" {_shape_str(shape)}" if shape is not None else "")
                         + f", got shape {tuple(x.shape)}")
    if shape is not None and any(e is not None and e != s for e, s in zip(shape, x.shape)):
        raise ValueError(f"{name}: expected shape {_shape_str(shape)}, got {tuple(x.shape)}")
    if contiguous and not x.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {x.strides}")
    return x


def check_same_dtype(names, *arrays):
    dts = [a.dtype for a in arrays if a is not None]
    if len(set(dts)) > 1:
        raise TypeError(f"{', '.join(names)}: expected one dtype, got {', '.join(map(str, dts))}")


def check_head_dim(name, head_dim):
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{name}: head size {head_dim} is not supported; expected one of {HEAD_DIMS}")


def check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}: expected one of {tuple(choices)}, got {value!r}")


def host(x):
    """A NumPy copy (or view) of ``x`` for host-side checks and planning; syncs for CuPy."""
    if x is None or isinstance(x, np.ndarray):
        return x
    if is_cupy(x):
        return x.get()
    return np.asarray(x)


def check_range(name, values, lo, hi, *, allow=()):
    """Check every entry of host array ``values`` lies in ``[lo, hi)`` or in ``allow``."""
    v = np.asarray(values)
    if v.size == 0:
        return
    bad = (v < lo) | (v >= hi)
    for a in allow:
        bad &= v != a
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}: expected entries in [{lo}, {hi})"
                         + (f" or {list(allow)}" if allow else "")
                         + f", got {v[idx]} at index {idx if len(idx) > 1 else idx[0]}")
