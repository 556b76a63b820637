"""A stand-in CUDA device for the CuPy host path on a machine without a GPU.

Inside :func:`fake_device`, CuPy allocates at made-up addresses (no memory behind them),
copies are recorded, and the library's kernels are "compiled" to recorders of their launches
(kernel, grid, block, dynamic shared memory and the packed argument bytes). The library's
CuPy code paths (plans, checks, hot paths, argument packing) then run for real up to the
driver, so tests can compare what two paths would launch. Only library code is covered:
CuPy's own kernels (elementwise ops, ``set``) still need a driver and fail inside.

Never use it in a process that also uses a real GPU: on exit it clears the library's caches
(compiled kernels, launch setups, device facts), but CuPy's own state is only restored, not
isolated. The tests using it skip where a GPU is usable.
"""
from __future__ import annotations

import contextlib
import ctypes
import sys
import types
from typing import NamedTuple

import numpy as np


class Launch(NamedTuple):
    expr: str      # the kernel's template expression
    grid: tuple
    block: tuple
    smem: int
    stream: int
    args: bytes    # the packed argument record
    record: object  # its cupaged.core.launch.Record

    @property
    def name(self):
        """The kernel's name without namespace or template arguments."""
        return self.expr.split("<")[0].split("::")[-1]

    def fields(self):
        """The argument record's fields by name."""
        return {f.name: v for f, v in zip(self.record.fields,
                                           self.record.struct.unpack(self.args))}


class _Stream:
    ptr = 0x5000

    def record(self, *args):
        return _Event()

    def synchronize(self):
        pass


class _Event:
    def record(self, *args):
        pass

    def synchronize(self):
        pass


class _Device:
    compute_capability = "90"
    attributes = {"MultiProcessorCount": 132, "L2CacheSize": 50 << 20}

    def __init__(self, device_id=0):
        self.id = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


class FakeDevice:
    """What the code under :func:`fake_device` launched and copied, in order."""

    def __init__(self):
        self.record = True  # False: launches counted only (host-cost timing)
        self.count = 0
        self.launches = []
        self.copies = []
        self._saved = []
        self._next = 1 << 36

    def alloc(self, size):
        import cupy
        p = self._next
        self._next += -(-max(size, 1) // 512) * 512 + 512
        return cupy.cuda.MemoryPointer(
            cupy.cuda.UnownedMemory(p, max(size, 1), None, device_id=0), 0)

    def launcher(self, device_id, stem, expr, record, hopper, smem, carveout):
        from cupaged.core.launch import Kernel
        kernel = Kernel.__new__(Kernel)
        kernel.raw = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=id(expr)))
        kernel.record, kernel.ptr = record, id(expr)
        size = record.size

        def launch(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            self.count += 1
            if not self.record:
                return
            base = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))[0]
            self.launches.append(Launch(expr, (gx, gy, gz), (bx, by, bz), smem, stream,
                                        ctypes.string_at(base, size), record))
        kernel._launch = launch
        return kernel

    def patch(self, obj, name, value):
        """Set ``obj.name`` to ``value`` until the stand-in device is left."""
        self._saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def copy(self, *args):
        self.copies.append(args)

    def array(self, shape, dtype):
        """A CuPy array of ``shape`` and ``dtype`` at a new fake address."""
        import cupy
        dtype = np.dtype(dtype)
        return cupy.ndarray(shape, dtype, memptr=self.alloc(int(np.prod(shape)) * dtype.itemsize))


def _encode_tensor_map(at, dtype, rank, address, dims, strides, box, elem_strides, *flags):
    """cuTensorMapEncodeTiled's stand-in: the map's first 8 bytes hold the tensor's address."""
    ctypes.memmove(at, ctypes.byref(ctypes.c_uint64(address)), 8)
    return 0


def _clear_library_caches():
    from cupaged.core.arrays import CallCache
    from cupaged.core import errors
    errors._WORDS.clear()
    for name, mod in list(sys.modules.items()):
        if not name.startswith("cupaged") or mod is None:
            continue
        for value in list(vars(mod).values()):
            if isinstance(value, CallCache):
                value.clear()
            elif callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


@contextlib.contextmanager
def fake_device():
    """Run the library's CuPy paths against a :class:`FakeDevice` (yielded)."""
    import cupy
    import cupyx
    from cupy_backends.cuda.api import driver, runtime
    import cupaged.core.compile as compile_
    import cupaged.core.device as device
    from cupaged.core import errors, tma
    fake = FakeDevice()
    patch = fake.patch
    allocator = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(fake.alloc)
    for name in ("memcpyAsync", "memcpy2DAsync", "memsetAsync"):
        patch(runtime, name, fake.copy)
    patch(runtime, "getDevice", lambda: 0)
    patch(runtime, "getDeviceCount", lambda: 1)
    patch(runtime, "streamIsCapturing", lambda stream: False)
    patch(runtime, "deviceSynchronize", lambda: None)
    patch(driver, "occupancyMaxActiveBlocksPerMultiprocessor", lambda *args: 1)
    patch(cupy.cuda, "get_current_stream", lambda *args: _Stream())
    patch(cupy.cuda, "Device", _Device)
    patch(cupy.cuda, "Event", lambda *args, **kwargs: _Event())
    patch(cupy, "zeros", lambda shape, dtype=float: cupy.empty(shape, dtype))
    patch(cupyx, "empty_pinned", lambda n, dtype: np.empty(n, dtype))
    patch(compile_, "_launcher", fake.launcher)
    patch(device, "facts", lambda device_id: device.DeviceFacts(0, "90", 132, 50 << 20))
    patch(device, "owned_array", lambda size, dtype, zero=False: cupy.empty(size, dtype))
    patch(tma, "_ENCODE", [_encode_tensor_map])
    _clear_library_caches()
    errors._WORDS[0] = cupy.empty(errors.ERROR_WORDS, np.int64)
    try:
        yield fake
    finally:
        for obj, name, value in reversed(fake._saved):
            setattr(obj, name, value)
        cupy.cuda.set_allocator(allocator)
        _clear_library_caches()
