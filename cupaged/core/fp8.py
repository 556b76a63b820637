"""fp8 KV-cache formats and their host checks: the facts both backends share.

A cache in an fp8 format is a 1-byte array (``uint8`` raw bytes, or the array module's float8
dtype where it has one: ``ml_dtypes.float8_e4m3fn`` / ``float8_e5m2`` in NumPy) holding
``x / scale`` rounded to the format and saturated to its finite range; ``k_scale`` and
``v_scale`` are float32, one value (per tensor) or one per kv head ``[num_kv_heads]``. The
quantisation rule itself is written out in ``cupaged.reference.fp8``.
"""
from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np

from .arrays import FLOAT8_DTYPES, check_array, check_choice
from .errors import strict


class Fp8Format(NamedTuple):
    """One fp8 storage format.

    ``dtype`` is its ml_dtypes NumPy dtype; ``max`` the largest finite magnitude (where
    writes saturate); ``mantissa_bits`` the stored fraction bits; ``min_normal`` and
    ``min_subnormal`` the smallest normal and subnormal magnitudes.
    """
    name: str
    dtype: np.dtype
    max: float
    mantissa_bits: int
    min_normal: float
    min_subnormal: float


def _format(name, dtype):
    info = ml_dtypes.finfo(dtype)
    return Fp8Format(name, np.dtype(dtype), float(info.max), int(info.nmant),
                     float(info.smallest_normal), float(info.smallest_subnormal))


FP8_FORMATS = {
    "fp8_e4m3": _format("fp8_e4m3", FLOAT8_DTYPES[0]),   # float8_e4m3fn: no inf; max 448
    "fp8_e5m2": _format("fp8_e5m2", FLOAT8_DTYPES[1]),   # float8_e5m2: IEEE-like; max 57344
}
KV_DTYPES = tuple(FP8_FORMATS)
uint8 = np.dtype(np.uint8)
BYTE_DTYPES = (uint8,) + FLOAT8_DTYPES
"""Element dtypes of an fp8 cache: raw bytes, or a float8 dtype."""


_FLOAT8_NAMES = {f.dtype.name: f.name for f in FP8_FORMATS.values()}
_FORMAT_OF_DTYPE = {}  # dtype object (NumPy's, CuPy's or torch's) -> format name or None


def given_kv_dtype(kv_dtype, k_cache):
    """``kv_dtype``, or where None the format of a float8 cache of any array kind (an
    ml_dtypes float8 array, or a torch float8 tensor, which reaches the kernels as uint8
    bytes: its format is taken here, before the view), else None. No check."""
    if kv_dtype is not None:
        return kv_dtype
    dt = getattr(k_cache, "dtype", None)
    try:
        return _FORMAT_OF_DTYPE[dt]
    except KeyError:
        name = _FORMAT_OF_DTYPE[dt] = _FLOAT8_NAMES.get(str(dt).rpartition(".")[2])
        return name
    except TypeError:  # an unhashable dtype attribute
        return None


def cpp() -> str:
    """C++ of the formats' constants for the generated ``abi.cuh`` (``kernels_cu/fp8.cuh``'s
    Fp8Traits): per format its mantissa bits, exponent bias, largest finite value and the
    low 7 bits of the code ml_dtypes' cast gives NaN (the sign bit is the value's)."""
    lines = []
    for f in FP8_FORMATS.values():
        tag = f.name.upper()
        bias = 1 - int(ml_dtypes.finfo(f.dtype).minexp)
        nan = int(np.array(np.nan, np.float32).astype(f.dtype).view(uint8)) & 0x7F
        lines += [f"constexpr int {tag}_MANT = {f.mantissa_bits}, {tag}_BIAS = {bias};",
                  f"constexpr unsigned {tag}_NAN = {nan:#x};",
                  f"constexpr float {tag}_MAX = {f.max!r}f;"]
    return "\n".join(lines)


def fp8_format(kv_dtype, name="kv_dtype") -> Fp8Format:
    """The format called ``kv_dtype`` (one of :data:`KV_DTYPES`); ValueError otherwise."""
    check_choice(name, kv_dtype, KV_DTYPES)
    return FP8_FORMATS[kv_dtype]


def cache_element_dtype(fmt, xp) -> np.dtype:
    """Element dtype of a new fp8 cache of format ``fmt`` in array module ``xp``: the
    format's float8 dtype in NumPy, ``uint8`` elsewhere (CuPy has no float8 dtype)."""
    return fmt.dtype if xp is np else uint8


def check_fp8_cache(name, cache, fmt):
    """An fp8 cache must have a 1-byte dtype: uint8, or ``fmt``'s own float8 dtype."""
    if cache.dtype not in (uint8, fmt.dtype):
        raise TypeError(f"{name}: expected dtype uint8 or {fmt.dtype} for kv_dtype "
                        f"{fmt.name!r}, got {cache.dtype}")


def resolve_kv_dtype(kv_dtype, k_cache, v_cache):
    """The fp8 format of a cache pair, or None for a plain (16/32-bit) cache.

    ``kv_dtype=None`` means the caches' own dtype: a float8 cache is in its format, a
    uint8 cache (bytes of no stated format) is refused, any other cache is plain (its dtype
    is checked where it is used). A named format requires 1-byte caches (:func:`check_fp8_cache`).
    """
    if kv_dtype is None:
        for fmt in FP8_FORMATS.values():
            if k_cache.dtype == fmt.dtype:
                check_fp8_cache("v_cache", v_cache, fmt)
                return fmt
        if k_cache.dtype == uint8:
            raise ValueError("kv_dtype: expected one of ('fp8_e4m3', 'fp8_e5m2') for uint8 "
                             "caches, got None")
        return None
    fmt = fp8_format(kv_dtype)
    check_fp8_cache("k_cache", k_cache, fmt)
    check_fp8_cache("v_cache", v_cache, fmt)
    return fmt


def check_scale(name, scale, num_kv_heads) -> np.ndarray:
    """Check one fp8 scale and return it as float32 ``[num_kv_heads]``.

    Parameters
    ----------
    name : str
        Argument name used in messages (``"k_scale"``, ``"v_scale"``).
    scale : float or numpy.ndarray
        A Python float (rounded to float32), or a float32 array of shape ``[]`` or ``[1]``
        (one value for every head) or ``[num_kv_heads]``. Every value must be finite and
        positive.
    num_kv_heads : int

    Raises
    ------
    TypeError
        For None, a non-number, or an array not of dtype float32.
    ValueError
        For a wrong shape, or a value that is not finite and positive.
    """
    if isinstance(scale, (np.ndarray, np.generic)):
        if scale.dtype != np.float32:
            raise TypeError(f"{name}: expected dtype float32, got {scale.dtype}")
        values = np.asarray(scale)
    elif isinstance(scale, (float, int)) and not isinstance(scale, bool):
        values = np.asarray(scale, dtype=np.float32)
    else:
        raise TypeError(f"{name}: expected a float or a float32 array, got "
                        f"{type(scale).__name__}")
    if values.shape not in ((), (1,), (num_kv_heads,)):
        raise ValueError(f"{name}: expected shape [], [1] or [{num_kv_heads}] (num_kv_heads), "
                         f"got {list(values.shape)}")
    bad = ~(np.isfinite(values) & (values > 0))
    if bad.any():
        where = "" if values.ndim == 0 else f" at index {int(np.argmax(bad))}"
        raise ValueError(f"{name}: expected finite positive values, got "
                         f"{values[bad].ravel()[0]}{where}")
    return np.broadcast_to(values.reshape(-1)[:1] if values.size == 1 else values,
                           (num_kv_heads,)).astype(np.float32)


def check_kv_scales(fmt, k_scale, v_scale, num_kv_heads):
    """The scales of a cache pair, float32 ``[num_kv_heads]`` each (None for a plain cache).

    With an fp8 ``fmt`` a missing scale is 1.0 (vLLM's default); a plain cache (``fmt``
    None) takes no scales.
    """
    if fmt is None:
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None:
                raise ValueError(f"{name}: expected None for caches that are not fp8 "
                                 f"(kv_dtype None), got {scale!r}")
        return None, None
    one = np.float32(1.0)
    return (check_scale("k_scale", one if k_scale is None else k_scale, num_kv_heads),
            check_scale("v_scale", one if v_scale is None else v_scale, num_kv_heads))


def is_host_scale(scale):
    """A scale the host holds (a Python float or int), as opposed to an array."""
    return isinstance(scale, (float, int, np.floating)) and not isinstance(scale, bool)


def scale_parts(k_scale, v_scale):
    """``(arrays, values)`` of a call's scales for its hot-path key: each scale an array
    (whose address a launch takes; None otherwise) or a host number (None otherwise)."""
    k_host, v_host = is_host_scale(k_scale), is_host_scale(v_scale)
    return ((None if k_host else k_scale, None if v_host else v_scale),
            (float(k_scale) if k_host else None, float(v_scale) if v_host else None))


def kernel_scales(fmt, k_scale, v_scale, num_kv_heads, check_values):
    """Check a device call's scales and return the kernels' scale fields
    (``cupaged.core.abi.SCALES``) but the pointers: ``k_scale_stride``, ``v_scale_stride``
    (0: one value for every head, 1: one per head), ``k_scale_value``, ``v_scale_value``
    (the value where no array is passed: 1.0 for a missing scale, a host number's float32).

    Parameters
    ----------
    fmt : Fp8Format or None
        The caches' format; a plain cache takes no scales (ValueError otherwise).
    k_scale, v_scale : None, float or array
        A host number, or a float32 device array of shape ``[]``, ``[1]`` or
        ``[num_kv_heads]`` (its values are not read: that would sync the device).
    num_kv_heads : int
    check_values : bool
        Read device arrays back and check their values too (strict mode).

    Raises
    ------
    TypeError
        A scale that is neither a number nor a float32 device array (NumPy arrays
        included: a launch cannot take their address).
    ValueError
        A wrong shape, or a host value (or, with ``check_values``, a device value) that is
        not finite and positive.
    """
    if fmt is None:
        check_kv_scales(None, k_scale, v_scale, num_kv_heads)  # raises for a given scale
    fields = {}
    for op, name, scale in (("k", "k_scale", k_scale), ("v", "v_scale", v_scale)):
        stride, value = 0, 1.0
        if scale is None:
            pass
        elif is_host_scale(scale):
            value = float(check_scale(name, scale, num_kv_heads)[0])
        elif isinstance(scale, np.ndarray) or not hasattr(scale, "dtype"):
            raise TypeError(f"{name}: expected a float or a float32 device array like the "
                            f"caches, got {type(scale).__module__}.{type(scale).__name__}")
        else:
            if scale.dtype != np.float32:
                raise TypeError(f"{name}: expected dtype float32, got {scale.dtype}")
            shape = tuple(scale.shape)
            if shape not in ((), (1,), (num_kv_heads,)):
                raise ValueError(f"{name}: expected shape [], [1] or [{num_kv_heads}] "
                                 f"(num_kv_heads), got {list(shape)}")
            if scale.size > 1 and scale.strides[0] != 4:
                raise ValueError(f"{name}: expected a contiguous array, got strides "
                                 f"{scale.strides}")
            stride = int(scale.size > 1)
            if check_values:
                check_scale(name, scale.get(), num_kv_heads)
        fields[f"{op}_scale_stride"] = stride
        fields[f"{op}_scale_value"] = value
    return fields


def check_scale_arrays(fmt, k_scale, v_scale, num_kv_heads, xp, validate=None):
    """A call's scales, checked before anything runs (:func:`kernel_scales` for a
    device call: device arrays' values read only in strict mode); the kernels' scale
    fields, or None on the NumPy path."""
    if xp is np:
        check_kv_scales(fmt, k_scale, v_scale, num_kv_heads)
        return None
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None and not (is_host_scale(scale) or isinstance(scale, np.ndarray)):
            check_array(name, scale, xp=xp, contiguous=False)
    return kernel_scales(fmt, k_scale, v_scale, num_kv_heads, strict(validate))
