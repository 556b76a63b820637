"""Bad device index entries, found by the kernels, and strict mode.

Index arrays that live on the device (block tables, lengths, ``cu_seqlens``, slot
mappings, positions, block mappings) are not read by the host in a default call: that
would wait for the device on every layer. The kernels check every entry they use; a bad
one is never followed (nothing outside an array is read or written, whatever it holds),
the rows it concerns come out as zeros, and the first bad entry is recorded in the
device's error word. :func:`check_errors` raises it as a :class:`DeviceIndexError` (a
``ValueError``) naming the argument, the entry and its value.

Strict mode (``CUPAGED_STRICT=1`` in the environment, or ``validate=True`` on a call or a
plan) checks device index contents on the host before anything runs, as for host arrays:
one device-to-host copy per call, and a ``ValueError`` with nothing changed.
"""
from __future__ import annotations

import os

import numpy as np

from .abi import ERROR_WORDS, decode_error
from .device import owned_array

__all__ = ["DeviceIndexError", "check_errors", "error_word", "strict"]

_WORDS = {}  # device id -> int64 [ERROR_WORDS] on that device


class DeviceIndexError(ValueError):
    """A bad entry of a device index array, found by a kernel."""


def strict(validate=None):
    """Whether a call checks device index contents on the host: ``validate`` when given,
    else the ``CUPAGED_STRICT`` environment variable (``1``: on)."""
    if validate is not None:
        return bool(validate)
    if _ENV is not None:  # the environment's own mapping: a dict lookup, no str conversions
        return _ENV.get(_STRICT_KEY, b"0") not in _OFF
    return os.environ.get("CUPAGED_STRICT", "0") not in ("", "0")


# os.environ keeps its entries encoded in ``_data`` (POSIX: bytes keys and values), which
# setenv/putenv and monkeypatching go through; elsewhere strict() reads os.environ.
_ENV = getattr(os.environ, "_data", None)
try:
    _STRICT_KEY = os.environ.encodekey("CUPAGED_STRICT")
    _OFF = (os.environ.encodevalue(""), os.environ.encodevalue("0"))
except AttributeError:
    _ENV = None


def error_word():
    """The current device's error word (int64 ``[ERROR_WORDS]``), zeroed when first made;
    kernels that check device indices take its address."""
    import cupy
    device_id = cupy.cuda.runtime.getDevice()
    word = _WORDS.get(device_id)
    if word is None:
        word = owned_array(ERROR_WORDS, np.int64, zero=True)
        cupy.cuda.runtime.deviceSynchronize()  # zeroed before any stream's kernel reads it
        _WORDS[device_id] = word
    return word


def message(words):
    """The ``ValueError`` text of an error record ``(code, row, col, value, bound, ...)``."""
    code, row, col, value, bound = (int(w) for w in words[:5])
    argument, check = decode_error(code)
    where = f"({row}, {col})" if col >= 0 else f"{row}"
    found = " (found on the device; CUPAGED_STRICT=1 checks on the host before launch)"
    if check == "range":
        return f"{argument}: expected entries in [0, {bound}), got {value} at index {where}{found}"
    if check == "order":
        return (f"{argument}: expected non-decreasing entries, got {bound} then {value} at "
                f"index {row}{found}")
    if check == "start":
        return f"{argument}: expected {argument}[0] == 0, got {value}{found}"
    if check == "increasing":
        return (f"{argument}: expected strictly increasing entries within each CSR row, got "
                f"{bound} then {value} at index {row}{found}")
    if check == "size":
        return (f"{argument}: expected {bound} entries (pattern_heads * sum(ceil(q_len / "
                f"block_m)) + 1, from cu_seqlens_q), got {value}{found}")
    if check == "last":
        return f"{argument}: expected the last entry {bound}, got {value} at index {row}{found}"
    if check == "end":
        return (f"{argument}: expected entries at most {bound} (the rows of the packed "
                f"tensor), got {value} at index {row}{found}")
    return (f"seq_lens: sequence {row} needs {value} tokens, but block_tables holds "
            f"{bound} per sequence{found}")


def check_errors():
    """Raise the first bad device index entry recorded since the last check, if any.

    Waits for every device that has an error word (this is the one call that does), then
    clears the word.

    Raises
    ------
    DeviceIndexError
        Naming the argument, the entry's index and value, and the range expected.
    """
    if not _WORDS:
        return
    import cupy
    for device_id, word in _WORDS.items():
        with cupy.cuda.Device(device_id):
            cupy.cuda.runtime.deviceSynchronize()
            words = word.get()
            if words[0]:
                word.fill(0)
                cupy.cuda.runtime.deviceSynchronize()
                raise DeviceIndexError(message(words))
