"""Reference fp8 quantisation: what an fp8 cache holds, and how it is read back.

The specification every fp8 kernel matches (the format facts and scale checks live in
``cupaged.core.fp8``). For a value ``x`` of kv head ``h`` with scale ``s = scale[h]``
(float32, finite, positive):

1. ``y = float32(x) / s``, one correctly rounded float32 division;
2. ``y`` is clamped to ``[-max, max]`` of the format (saturation: finite inputs, and
   infinities, never give inf or NaN; NaN stays NaN);
3. the cache byte is ``y`` rounded to the format, round to nearest, ties to even
   (ml_dtypes' cast; the hardware's ``cvt.rn.satfinite``).

Reading back (dequantisation) is ``float64(byte) * float64(s)``, exact in float64. The write
is bit-exact reproducible by a kernel (steps 1-3 are each one correctly rounded operation);
the read is exact, so a kernel that multiplies in float32 differs from it by at most one
float32 rounding per element.
"""
from __future__ import annotations

import numpy as np

from ..core.fp8 import check_scale, fp8_format, uint8


def _head_scale(name, scale, x, head_axis):
    """``scale`` as float32, shaped to broadcast against ``x`` along ``head_axis``."""
    axis = head_axis % x.ndim
    per_head = check_scale(name, scale, x.shape[axis])
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    return per_head.reshape(shape)


def as_bytes(cache, fmt):
    """View an fp8 array (uint8, or ``fmt``'s float8 dtype) as uint8, sharing memory."""
    if cache.dtype not in (uint8, fmt.dtype):
        raise TypeError(f"codes: expected dtype uint8 or {fmt.dtype} for {fmt.name!r}, "
                        f"got {cache.dtype}")
    return cache.view(uint8)


def quantize(x, scale, fmt, head_axis=-2, name="scale"):
    """Quantise values to fp8 bytes: ``round(clamp(float32(x) / scale, -max, max))``.

    Parameters
    ----------
    x : numpy.ndarray
        Values of any float dtype, e.g. token rows ``[num_tokens, num_kv_heads, head_dim]``
        or a whole cache in any layout.
    scale : float or numpy.ndarray
        float32 ``[]`` (per tensor) or ``[num_kv_heads]`` (per head, along ``head_axis``).
    fmt : {"fp8_e4m3", "fp8_e5m2"}
        The format (``cupaged.core.fp8.KV_DTYPES``).
    head_axis : int
        The kv-head axis of ``x`` (``-2`` for token rows and NHD caches; see
        ``cupaged.core.layouts.head_axis``).
    name : str
        Name of the scale argument in error messages.

    Returns
    -------
    numpy.ndarray
        uint8, ``x``'s shape: the format's bit patterns.
    """
    fmt = fp8_format(fmt, "fmt")
    x = np.asarray(x)
    s = _head_scale(name, scale, x, head_axis)
    with np.errstate(over="ignore", invalid="ignore"):
        y = x.astype(np.float32) / s
    y = np.clip(y, -fmt.max, fmt.max)   # before rounding: the cast itself gives inf or NaN
    return y.astype(fmt.dtype).view(uint8)


def dequantize(codes, scale, fmt, head_axis=-2, name="scale"):
    """Read fp8 bytes back: ``float64(value) * float64(scale)``.

    Parameters
    ----------
    codes : numpy.ndarray
        uint8 bit patterns, or an array of ``fmt``'s float8 dtype, any shape.
    scale : float or numpy.ndarray
        float32 ``[]`` or ``[num_kv_heads]`` along ``head_axis``.
    fmt : {"fp8_e4m3", "fp8_e5m2"}
    head_axis : int
        The kv-head axis of ``codes``.
    name : str
        Name of the scale argument in error messages.

    Returns
    -------
    numpy.ndarray
        float64, ``codes``' shape; exact (an fp8 value times a float32 fits in float64).
    """
    fmt = fp8_format(fmt, "fmt")
    codes = np.asarray(codes)
    values = as_bytes(codes, fmt).view(fmt.dtype).astype(np.float64)
    return values * _head_scale(name, scale, codes, head_axis).astype(np.float64)


def half_ulp(y, fmt):
    """Largest rounding error of step 3 for float32 quotients ``y`` (before saturation):
    half the spacing of the format's values at ``|y|``, ``min_subnormal / 2`` below the
    normal range. float64, ``y``'s shape."""
    fmt = fp8_format(fmt, "fmt")
    a = np.abs(np.asarray(y, dtype=np.float64))
    exponent = np.floor(np.log2(np.maximum(a, fmt.min_normal)))
    return np.exp2(exponent - fmt.mantissa_bits) / 2
