"""Device facts and device memory the ops keep between calls.

- :func:`current` / :func:`facts` - the current (or a given) device's id, compute capability,
  multiprocessor count and L2 size (read once per device).
- :func:`owned_array` - device memory the library keeps (scratch, the error word): owned
  by the array itself, never by the allocator in use when it was made.
- :func:`scratch` - per-stream buffers an op reuses from call to call (a device plan's
  work list, split-KV partial rows, counters its kernels re-arm). Calls on one stream run
  in order, so they can share; calls on another stream get their own. A buffer that has
  to grow is replaced, and the old one is kept alive (a CUDA graph captured earlier may
  still point at it).
- :class:`Uploader` - host-to-device copies of host plans through pinned staging memory,
  so that an upload never waits for the device (and a step's tables and lengths copied
  into a plan's buffers, from either side).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np


SM90_SMEM_PER_CTA = 227 * 1024  # opt-in dynamic shared memory of an sm_90 CTA (H100 / H200)


class DeviceFacts(NamedTuple):
    id: int
    compute_capability: str  # "90"
    sms: int
    l2_bytes: int


@functools.lru_cache(maxsize=None)
def facts(device_id):
    """Facts of device ``device_id`` (read once)."""
    import cupy
    device = cupy.cuda.Device(device_id)
    attributes = device.attributes
    return DeviceFacts(device_id, device.compute_capability, attributes["MultiProcessorCount"],
                       attributes["L2CacheSize"])


def current():
    """Facts of CuPy's current device."""
    import cupy
    return facts(cupy.cuda.runtime.getDevice())


def owned_array(size, dtype, zero=False):
    """A 1-D device array of ``size`` elements of ``dtype`` on its own ``cudaMalloc``.

    Buffers the library keeps across calls must not come from the allocator current when
    they are first needed: a caller may set one for a while (a CUDA graph's private memory
    pool, ``cupy.cuda.using_allocator``), and CuPy's pools free their memory when they go,
    whatever arrays still point into it. ``zero``: zero-filled on the current stream.
    """
    import cupy
    dtype = np.dtype(dtype)
    mem = cupy.cuda.Memory(max(int(size), 1) * dtype.itemsize)
    a = cupy.ndarray((int(size),), dtype, cupy.cuda.MemoryPointer(mem, 0))
    if zero:
        a.fill(0)
    return a


_SCRATCH = {}
_RETIRED = []  # replaced buffers, kept for graphs that captured them


def scratch(name, size, dtype=np.int32, zero=False):
    """A device array of at least ``size`` elements of ``dtype`` for op ``name`` on the
    current stream, kept for later calls.

    Parameters
    ----------
    name : str
        The use (one buffer per name, device and stream).
    size : int
        Elements needed now.
    zero : bool
        Zero-filled when (re)allocated: counters the kernels re-arm to zero after use.
    """
    import cupy
    key = (cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream().ptr, name)
    buf = _SCRATCH.get(key)
    if buf is None or buf.size < size:
        if buf is not None:
            _RETIRED.append(buf)
        n = max(int(size), 2 * buf.size if buf is not None else 0, 1)
        buf = owned_array(n, dtype, zero)
        _SCRATCH[key] = buf
    return buf


class Uploader:
    """Copies host arrays into device buffers on the current stream without waiting.

    Each upload goes through a slot of a ring of pinned host buffers: the host image is
    written there and copied asynchronously; a slot is reused only after the copy that last
    read it has run (an event), which waits only when ``slots`` uploads are still queued.
    """

    def __init__(self, slots=4):
        self._slots = [None] * slots
        self._events = [None] * slots
        self._next = 0

    def upload(self, dst, host):
        """Copy the host array ``host`` into the start of device array ``dst``."""
        flat = host.reshape(-1)
        self.upload_rows([(dst.data.ptr, flat.nbytes, flat)])

    def upload_rows(self, parts):
        """Copy host arrays into device memory: ``parts`` of ``(address, pitch, host)``,
        each ``host`` array's rows (its last dimension; 1-D: one row) landing ``pitch``
        bytes apart from ``address``. One staging slot and one event for all parts; parts
        that land back to back in device memory (rows ``pitch`` apart and each starting
        where the one before ends) go in one copy."""
        import cupy
        sizes = [h.nbytes for _, _, h in parts]
        n = sum(-(-s // 16) * 16 for s in sizes)
        if n == 0:
            return
        i = self._next
        self._next = (i + 1) % len(self._slots)
        if self._events[i] is not None:
            self._events[i].synchronize()  # its last copy has been read (normally long ago)
        slot = self._slots[i]
        if slot is None or slot[0].nbytes < n:
            import cupyx
            buf = cupyx.empty_pinned(max(n, 4096), np.uint8)
            slot = self._slots[i] = (buf, buf.ctypes.data, {})
        buf, base, views = slot
        copies = []  # [device address, staged offset, row bytes, rows, pitch]
        at = 0
        for (address, pitch, h), size in zip(parts, sizes):
            if not size:
                continue
            rows = 1 if h.ndim < 2 else size // (h.shape[-1] * h.itemsize)
            row = size // rows
            last = copies[-1] if copies else None
            if (rows == 1 or pitch == row) and last is not None and last[3] == 1 \
                    and last[0] + last[2] == address and last[1] + last[2] == at:
                last[2] += size  # continues the previous copy in both memories
            else:
                at = -(-at // 16) * 16
                copies.append([address, at, size, 1, size] if rows == 1 or pitch == row
                              else [address, at, row, rows, pitch])
            key = (at, h.dtype, h.shape)  # a plan's images repeat: their staging views too
            view = views.get(key)
            if view is None:
                if len(views) > 64:
                    views.clear()
                view = views[key] = buf[at:at + size].view(h.dtype).reshape(h.shape)
            np.copyto(view, h)
            at += size
        stream = cupy.cuda.get_current_stream()
        rt = cupy.cuda.runtime
        for address, offset, row, rows, pitch in copies:
            if rows == 1:
                rt.memcpyAsync(address, base + offset, row, rt.memcpyHostToDevice, stream.ptr)
            else:
                rt.memcpy2DAsync(address, pitch, base + offset, row, row, rows,
                                 rt.memcpyHostToDevice, stream.ptr)
        event = self._events[i] or cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        self._events[i] = event

    def copy_step(self, tables, pitch, lens, block_tables, seq_lens):
        """A step's int32 ``block_tables [B, W]`` and ``seq_lens [B]`` into device memory at
        ``tables`` (rows ``pitch`` bytes apart) and ``lens``, on the current stream without
        waiting: host arrays uploaded (one staged copy), device arrays copied on the
        device."""
        from .checks import table_stride
        if isinstance(block_tables, np.ndarray):
            self.upload_rows([(tables, pitch, block_tables), (lens, seq_lens.nbytes, seq_lens)])
            return
        import cupy
        batch, width = block_tables.shape
        stream = cupy.cuda.get_current_stream().ptr
        rt = cupy.cuda.runtime
        rt.memcpy2DAsync(tables, pitch, block_tables.data.ptr, table_stride(block_tables) * 4,
                         width * 4, batch, rt.memcpyDeviceToDevice, stream)
        rt.memcpyAsync(lens, seq_lens.data.ptr, batch * 4, rt.memcpyDeviceToDevice, stream)


_SHARED = []


def uploader():
    """The process's shared :class:`Uploader` for small per-call or per-step host arrays
    (objects that plan repeatedly, such as the decoders, own theirs)."""
    if not _SHARED:
        _SHARED.append(Uploader(slots=8))
    return _SHARED[0]
