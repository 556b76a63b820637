"""Array modules, DLPack handoff and argument checks shared by every op.

Every public op accepts NumPy arrays (run by the reference backend), CuPy arrays (run by
the CUDA kernels) or any object exporting ``__dlpack__`` from a CUDA device (a torch or
JAX array), which is taken zero-copy and handed back in the caller's kind.
"""
from __future__ import annotations

import functools
import sys
import threading
import weakref

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
    """True when CuPy imports and sees at least one CUDA device.

    Returns
    -------
    bool
        False on a machine without CuPy, a driver or a device (never raises): the ops then
        take NumPy arrays only, run by the reference.
    """
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


# ----------------------------------------------------------------------------- foreign arrays
# torch tensors are viewed directly (their address, shape and strides: several times cheaper
# than DLPack, benchmarks/NOTES.md public calls), views of tensors seen before are reused, and
# results of a torch call are allocated by torch (outputs come back as the very tensors
# the op wrote). Other frameworks (JAX) go through DLPack. Kernels run on the caller's
# current stream and device.
_KINDS = {}   # type -> "torch", "dlpack" (another framework) or None (NumPy, CuPy, scalars)
_VIEWS = {}   # id(tensor) -> (weakref, data_ptr, shape, strides, cupy view)
_STREAMS = {}  # (device, raw stream) -> cupy Stream
_CALL = threading.local()  # .made: {id(cupy array): (array, tensor)} during a torch call


def _kind(x):
    t = type(x)
    k = _KINDS.get(t, False)
    if k is False:
        if t is np.ndarray or is_cupy(x) or not hasattr(t, "__dlpack__"):
            k = None
        else:
            k = "torch" if t.__module__.split(".")[0] == "torch" else "dlpack"
        _KINDS[t] = k
    return k


def _foreign_root(x):
    """Top-level module name of a foreign array-like exporting ``__dlpack__``, else None."""
    k = _kind(x)
    if k is None:
        return None
    return "torch" if k == "torch" else type(x).__module__.split(".")[0]


FLOAT8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
"""ml_dtypes' float8 dtypes of fp8 caches; CuPy, which has none, views such arrays as uint8."""


@functools.lru_cache(maxsize=None)
def _torch_dtypes():
    torch = sys.modules["torch"]
    pairs = {torch.float16: float16, torch.bfloat16: bfloat16, torch.float32: float32,
             torch.float64: np.dtype(np.float64), torch.int8: np.dtype(np.int8),
             torch.uint8: np.dtype(np.uint8), torch.int16: np.dtype(np.int16),
             torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64),
             torch.bool: np.dtype(np.bool_)}
    for name, dt in zip(("float8_e4m3fn", "float8_e5m2"), FLOAT8_DTYPES):
        if hasattr(torch, name):
            pairs[getattr(torch, name)] = dt
    return pairs, {v: k for k, v in pairs.items()}


def _need_gpu(x):
    cp = cupy_module()
    if cp is None or not gpu_available():
        raise TypeError(f"got a {type(x).__name__} exporting __dlpack__, but CuPy with a CUDA "
                        "device is needed to take it")
    return cp


def _drop_view(key):
    return lambda _ref: _VIEWS.pop(key, None)


def _torch_view(t):
    """A CuPy array over a CUDA tensor's memory (cached while the tensor lives)."""
    key = id(t)
    entry = _VIEWS.get(key)
    if entry is not None and entry[0]() is t:
        if t.data_ptr() == entry[1] and t.shape == entry[2] and t.stride() == entry[3]:
            return entry[4]
    cp = _need_gpu(t)
    if not t.is_cuda:
        raise TypeError(f"expected a CUDA array, got a torch.Tensor on {t.device}")
    dt = _torch_dtypes()[0].get(t.dtype)
    if dt is None:
        return cp.from_dlpack(t)
    if dt in FLOAT8_DTYPES:  # the bytes (the ops take the format from the tensor's dtype)
        dt = np.dtype(np.uint8)
    shape, strides = tuple(t.shape), t.stride()
    item = dt.itemsize
    if t.numel() == 0:
        view = cp.empty(shape, dt)
    else:
        span = (1 + sum((n - 1) * s for n, s in zip(shape, strides))) * item
        mem = cp.cuda.UnownedMemory(t.data_ptr(), span, None, t.get_device())
        view = cp.ndarray(shape, dt, cp.cuda.MemoryPointer(mem, 0),
                          tuple(s * item for s in strides))
    _VIEWS[key] = (weakref.ref(t, _drop_view(key)), t.data_ptr(), t.shape, strides, view)
    return view


def _import_foreign(x, root):
    if root == "torch":
        view = _torch_view(x)
        made = getattr(_CALL, "made", None)
        if made is not None:
            made[id(view)] = (view, x)
        return view
    cp = _need_gpu(x)
    device = x.__dlpack_device__() if hasattr(x, "__dlpack_device__") else None
    if device is not None and int(device[0]) not in (2, 3, 13):  # CUDA, CUDA host, CUDA managed
        raise TypeError(f"expected a CUDA array, got a {type(x).__name__} on DLPack "
                        f"device type {int(device[0])}")
    return cp.from_dlpack(x)


class _StreamHandle:
    """A raw stream pointer in the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, ptr):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def _cupy_stream(device, raw):
    s = _STREAMS.get((device, raw))
    if s is None:
        cp = cupy_module()
        with cp.cuda.Device(device):
            if hasattr(cp.cuda.Stream, "from_external"):
                s = cp.cuda.Stream.from_external(_StreamHandle(raw))
            else:  # CuPy 13
                s = cp.cuda.ExternalStream(raw, device)
        _STREAMS[(device, raw)] = s
    return s


def _caller_stream(root, x):
    """A CuPy stream wrapping the caller's current stream for ``x``'s framework, or None."""
    if root == "torch":
        torch = sys.modules["torch"]
        device = x.get_device()
        raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        raw = (raw_stream(device) if raw_stream is not None
               else torch.cuda.current_stream(device).cuda_stream)
        return _cupy_stream(device, raw)
    return None


def _export_foreign(y, root):
    if root == "torch":
        made = getattr(_CALL, "made", None)
        entry = made.get(id(y)) if made is not None else None
        if entry is not None and entry[0] is y:
            return entry[1]
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


def empty(xp, shape, dtype):
    """An uninitialised array of ``xp``; during a call made with torch tensors, memory of
    torch's allocator (the result goes back as that tensor, without a conversion)."""
    made = getattr(_CALL, "made", None)
    if made is None or xp is np:
        return xp.empty(shape, dtype)
    torch = sys.modules["torch"]
    t = torch.empty(shape, dtype=_torch_dtypes()[1][np.dtype(dtype)], device=_CALL.device)
    view = _torch_view(t)
    made[id(view)] = (view, t)
    return view


def zeros(xp, shape, dtype):
    """As :func:`empty`, zero-filled (on the current stream)."""
    a = empty(xp, shape, dtype)
    a.fill(0)
    return a


class _ForeignCall:
    """The context of one public call made with foreign arrays: the caller's stream (and
    device) current, and torch outputs tracked."""

    def __init__(self, root, first):
        self.root, self.first = root, first

    def __enter__(self):
        self.outer = getattr(_CALL, "made", None)
        self.outer_device = getattr(_CALL, "device", None)
        if self.root == "torch":
            _CALL.made = {} if self.outer is None else self.outer
            _CALL.device = self.first.device
        self.stream = _caller_stream(self.root, self.first)
        self.device = None
        if self.stream is not None:
            cp = cupy_module()
            device_id = self.first.get_device()
            if cp.cuda.runtime.getDevice() != device_id:
                self.device = cp.cuda.Device(device_id)
                self.device.__enter__()
            self.stream.__enter__()
        return self

    def __exit__(self, *exc):
        if self.stream is not None:
            self.stream.__exit__(*exc)
            if self.device is not None:
                self.device.__exit__(*exc)
        _CALL.made, _CALL.device = self.outer, self.outer_device
        return False


def accepts_dlpack(fn):
    """Decorate a public op so foreign CUDA arrays go in zero-copy and come back in kind.

    Any argument exporting ``__dlpack__`` (torch, JAX) is taken as a CuPy array over the
    same memory; the op runs on the caller's current stream and device (torch's, where the
    caller passed torch tensors); results come back through the caller's framework (torch:
    tensors allocated by torch). Nothing foreign is imported unless the caller passed it.
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        root = first = None
        for a in args:
            if _kind(a) is not None:
                root, first = _foreign_root(a), a
                break
        if root is None:
            for a in kwargs.values():
                if _kind(a) is not None:
                    root, first = _foreign_root(a), a
                    break
        if root is None:
            return fn(*args, **kwargs)
        with _ForeignCall(root, first):
            args = tuple(_import_foreign(a, root) if _kind(a) else a for a in args)
            kwargs = {k: (_import_foreign(v, root) if _kind(v) else v) for k, v in kwargs.items()}
            return _convert_out(fn(*args, **kwargs), root)
    return wrapper


# ----------------------------------------------------------------------------- hot calls
# A public op checks and sets up its launches once per call signature: what the checks and
# the setup depend on, for each array its shape, byte strides, dtype and address modulo 16,
# with the op's options and the device and stream. A later call of the same signature (the
# "hot" call of an engine's loop) takes only its arrays' addresses, packs them and launches,
# on the caller's stream: torch tensors are read directly (no CuPy view is made) and torch
# outputs are allocated by torch.
_TORCH = {}        # "dtypes": torch dtype -> numpy dtype, "np": the reverse
_BYTE_STRIDES = {}  # (shape, -itemsize) -> C-order byte strides


def _torch_tables():
    if not _TORCH:
        pairs, back = _torch_dtypes()
        # outputs are asked for by dtype or by scalar type (np.float32): both look up
        _TORCH.update(dtypes=pairs, np={**back, **{dt.type: t for dt, t in back.items()}})
    return _TORCH


class Hot:
    """A call that may take a cached launch setup: its cache key, its arrays' device
    addresses (0 for None) and the stream to launch on (a raw pointer), and outputs in the
    caller's kind (:meth:`empty`).

    Built by :func:`hot`; a call that misses takes the checked path, which caches its
    setup under this ``key`` (made from the caller's own arrays: CuPy's or torch's shapes,
    strides and dtypes), where the next call of the same signature finds it.
    """

    __slots__ = ("key", "ptrs", "stream", "_tensor", "_root")

    def __init__(self, key, ptrs, stream, tensor=None, root=None):
        self.key, self.ptrs, self.stream = key, ptrs, stream
        self._tensor, self._root = tensor, root

    def empty(self, shape, dtype):
        """``(array, address)`` of a new uninitialised output (a torch tensor for torch
        callers: ``new_empty`` of the call's first tensor, on its device)."""
        if self._tensor is None:
            a = sys.modules["cupy"].empty(shape, dtype)
            return a, a.data.ptr
        t = self._tensor.new_empty(shape, dtype=_TORCH["np"][dtype])
        return t, t.data_ptr()

    def done(self, result):
        """The call's result in the caller's kind: outputs of :meth:`empty` handed to the
        caller's framework where it is neither CuPy nor torch (JAX, after the launch)."""
        return result if self._root is None else _convert_out(result, self._root)


def _describe_cupy(a, stream):
    p = a.data.ptr
    return (a.shape, a.strides, a.dtype, p & 15), p


def _describe_torch(a, stream):
    """A CUDA tensor by torch's own shape, strides, dtype and device (a checked call caches
    its setup under the key these make, so they need not be NumPy's)."""
    p = a.data_ptr()
    return (a.shape, a.stride(), a.dtype, a.get_device(), p & 15), p


def _describe_dlpack(a, stream):
    """A single-device array of another framework (JAX) by its buffer address; one still
    being computed is ordered before ``stream`` through ``__dlpack__`` (its producer makes
    the stream wait for it); a dense (C-order) layout."""
    if not hasattr(a, "is_ready"):
        return None
    try:
        p = a.unsafe_buffer_pointer()
        if not a.is_ready():
            a.__dlpack__(stream=stream)
    except Exception:  # sharded, deleted or on the host: the checked path says why
        return None
    dt = np.dtype(a.dtype)
    shape = tuple(a.shape)
    return (shape, _contiguous_strides(shape, dt.itemsize), dt, p & 15), p


def _contiguous_strides(shape, itemsize):
    key = (shape, -itemsize)
    b = _BYTE_STRIDES.get(key)
    if b is None:
        out, step = [], itemsize
        for n in reversed(shape):
            out.append(step)
            step *= n
        b = _BYTE_STRIDES[key] = tuple(reversed(out))
    return b


def hot(strict, arrays, *options):
    """The :class:`Hot` view of a call on ``arrays`` (its first a CuPy array, a CUDA torch
    tensor or a JAX GPU array; None entries allowed) with ``options`` (hashable), or None
    where the call must take the checked path: strict mode, NumPy or other arrays, kinds
    mixed, or an array on a device other than CuPy's current one."""
    cp = sys.modules.get("cupy")
    if strict or cp is None:
        return None
    first = arrays[0]
    cls = type(first)
    tensor = root = None
    if cls is cp.ndarray:
        kind, describe, stream = "cupy", _describe_cupy, cp.cuda.get_current_stream().ptr
        device = cp.cuda.runtime.getDevice()
    else:
        kind = _kind(first)
        if kind is None:
            return None
        device = cp.cuda.runtime.getDevice()
        if kind == "torch":
            if first.get_device() != device:
                return None
            _torch_tables()
            tensor, describe = first, _describe_torch
            stream = sys.modules["torch"]._C._cuda_getCurrentRawStream(device)
        else:
            describe, stream = _describe_dlpack, cp.cuda.get_current_stream().ptr
            root = _foreign_root(first)
    sig, ptrs = [], []
    for a in arrays:
        if a is None:
            sig.append(None)
            ptrs.append(0)
            continue
        if type(a) is not cls and (kind == "cupy" or _kind(a) != kind):
            return None
        entry = describe(a, stream)
        if entry is None:
            return None
        sig.append(entry[0])
        ptrs.append(entry[1])
    return Hot((tuple(sig), options, device, stream), ptrs, stream, tensor, root)


class CallCache(dict):
    """Launch setups of calls by :attr:`Hot.key` (bounded: cleared when it grows past
    ``limit``)."""

    def __init__(self, limit=512):
        super().__init__()
        self.limit = limit

    def put(self, key, value):
        if key is None:
            return value
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value


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
        allowed = _allowed_dtypes(dtypes)
        if x.dtype not in allowed:
            names = ", ".join(str(d) for d in allowed)
            raise TypeError(f"{name}: expected dtype {names}, got {x.dtype}")
    if shape is not None:
        if x.shape == shape:  # the common case: no extent to compare one by one
            shape = ndim = None
        else:
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


_ALLOWED = {}  # a check's dtypes argument -> tuple of NumPy dtypes


def _allowed_dtypes(dtypes):
    key = tuple(dtypes) if isinstance(dtypes, list) else dtypes
    allowed = _ALLOWED.get(key)
    if allowed is None:
        allowed = _ALLOWED[key] = tuple(
            np.dtype(d) for d in (dtypes if isinstance(dtypes, (tuple, list)) else (dtypes,)))
    return allowed


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
