"""Attention sinks: ``sink_softmax`` and the sink-attention contract's unified ``sink_attention``.

A sink is one raw logit per query head that joins every softmax row's denominator and nothing
else (docs/design.md). ``sink_softmax`` is a kernel of its own (``kernels_cu/sink.cu``);
``sink_attention`` keeps the sink-attention contract's API, shapes, mode detection and errors
and runs on the ragged prefill kernel (``cupaged.varlen_prefill`` with ``sinks=``). NumPy inputs
run the reference (:mod:`cupaged.reference.sink`), which defines every mask, quirks included.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ..core import abi
from ..core.arrays import FLOAT_DTYPES, accepts_dlpack, array_module, check_array, check_head_dim
from ..core.checks import check_cu_seqlens, check_gqa, check_int
from ..core.compile import Spec, ctype, launcher
from ..core.device import current, uploader
from ..core.errors import strict
from ..core.launch import ptr
from ..reference import sink as ref

MODES = ref.MODES
_WARP_ROW_MAX = 1024     # rows up to this length: one warp per row
_CHUNK_MIN = 8192        # elements per CTA before a row is split over several CTAs
_MAX_CHUNKS = 1024
# the kernels' geometry (the generated abi.cuh: cpp()): rows of a warp-rows CTA, and the block
# of a CTA-row kernel and of the split kernels
WARP_ROWS = 4
CTA_THREADS = 256


def cpp() -> str:
    """C++ of the sink kernels' constants for the generated ``abi.cuh``."""
    return abi.constants(None, dict(SINK_WARP_ROWS=WARP_ROWS, SINK_THREADS=CTA_THREADS))


# ----------------------------------------------------------------------------- sink_softmax
class SoftmaxPlan(NamedTuple):
    """Launch shape of ``sink_softmax``: ``path`` is "warp", "cta" or "split"."""
    path: str
    num_rows: int
    n: int
    chunks: int
    chunk: int


def plan_softmax(num_rows, n, num_sms):
    """Pick one warp per row (short rows), one CTA per row, or ``chunks`` CTAs per row.

    Rows longer than ``_CHUNK_MIN`` are split when there are too few of them to give every
    SM four CTAs; chunks are multiples of 2048 elements (16-byte aligned in every dtype).
    """
    if n <= _WARP_ROW_MAX:
        return SoftmaxPlan("warp", num_rows, n, 1, n)
    chunks = min(-(-n // _CHUNK_MIN), -(-4 * num_sms // max(num_rows, 1)), _MAX_CHUNKS)
    if chunks <= 1:
        return SoftmaxPlan("cta", num_rows, n, 1, n)
    per_chunk = -(-n // chunks)
    chunk = -(-per_chunk // 2048) * 2048
    return SoftmaxPlan("split", num_rows, n, -(-n // chunk), chunk)


def _softmax_launch(plan, logits, sinks, out):
    import cupy
    t = ctype(logits.dtype)
    rows = dict(x=ptr(logits), sinks=ptr(sinks), y=ptr(out), num_rows=plan.num_rows, n=plan.n,
                heads=logits.shape[-3], rows_per_head=logits.shape[-2],
                vec=int(logits.data.ptr % 16 == 0 and out.data.ptr % 16 == 0))
    if plan.path != "split":
        group, per_cta = (32, WARP_ROWS) if plan.path == "warp" else (CTA_THREADS, 1)
        launcher("sink", f"cupaged::sink_softmax_rows<{t}, {group}>", abi.SINK_SOFTMAX)(
            -(-plan.num_rows // per_cta), group * per_cta, **rows)
        return
    blocks = plan.num_rows * plan.chunks
    stats = cupy.empty(2 * blocks, dtype=cupy.float32)
    split = dict(rows, stats=ptr(stats), chunk=plan.chunk, chunks=plan.chunks)
    for step in ("stats", "write"):
        launcher("sink", f"cupaged::sink_softmax_chunk_{step}<{t}>", abi.SINK_SOFTMAX)(
            blocks, CTA_THREADS, **split)


def kernel_specializations():
    """Every sink kernel: dtype x (warp rows, CTA rows, split stats, split write)."""
    specs = []
    for dt in FLOAT_DTYPES:
        t = ctype(dt)
        specs += [Spec("sink", f"cupaged::sink_softmax_rows<{t}, 32>"),
                  Spec("sink", f"cupaged::sink_softmax_rows<{t}, {CTA_THREADS}>"),
                  Spec("sink", f"cupaged::sink_softmax_chunk_stats<{t}>"),
                  Spec("sink", f"cupaged::sink_softmax_chunk_write<{t}>")]
    return specs


@accepts_dlpack
def sink_softmax(logits, sinks):
    """Softmax over the last axis with a per-head sink in the denominator (the
    sink-attention contract of docs/design.md).

    ``p_j = exp(x_j - M) / (sum_j exp(x_j - M) + exp(sink_h - M))`` with
    ``M = max(max_j x_j, sink_h)``: the probabilities of the logits when a sink column is
    appended and then dropped. ``-inf`` logits give 0; a row of only ``-inf`` gives zeros
    (its mass all goes to the sink).

    Parameters
    ----------
    logits : array
        ``[..., heads, rows, n]`` float16, bfloat16 or float32, C-contiguous; any ``n``.
    sinks : array
        float32 ``[heads]`` raw sink logits.

    Returns
    -------
    array
        ``[..., heads, rows, n]`` probabilities in logits' dtype (float32 math on CuPy).

    Raises
    ------
    ValueError, TypeError
        On a rank below 3, an unsupported dtype, non-contiguous input, mixed array
        modules or a sinks shape other than ``[heads]``.
    """
    xp = array_module(logits, sinks)
    check_array("logits", logits, dtypes=FLOAT_DTYPES, xp=xp)
    if logits.ndim < 3:
        raise ValueError(f"logits: expected [..., heads, rows, n] (3 or more dimensions), "
                         f"got shape {tuple(logits.shape)}")
    check_array("sinks", sinks, shape=(logits.shape[-3],), dtypes=np.float32, xp=xp)
    if xp is np:
        return ref.sink_softmax(logits, sinks)
    out = xp.empty_like(logits)
    n = int(logits.shape[-1])
    if out.size == 0:
        return out
    _softmax_launch(plan_softmax(out.size // n, n, current().sms), logits, sinks, out)
    return out


# ----------------------------------------------------------------------------- sink_attention
class SinkPlan(NamedTuple):
    """Mode of one ``sink_attention`` call and its ragged form for the prefill kernel."""
    mode: str
    cu_q: object            # int32 [batch + 1]: host, or the caller's device indptr
    cu_k: object            # int32 [batch + 1]
    max_q: object           # int, None with device indptrs
    max_k: object
    row_window: bool        # prefill mode, window, qo_len != kv_len: the contract's row window


def _check_scalars(window_left, causal, sm_scale, batch_size):
    if not isinstance(window_left, (int, np.integer)) or window_left < -1:
        raise ValueError(f"window_left: expected an int >= -1 (-1: no window), got {window_left!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal: expected a bool, got {causal!r}")
    if sm_scale is not None and (not isinstance(sm_scale, (int, float, np.floating))
                                 or not math.isfinite(sm_scale)):
        raise ValueError(f"sm_scale: expected None or a finite float, got {sm_scale!r}")
    if batch_size is not None:
        check_int("batch_size", batch_size)


def _check_arrays(q, k, v, sink, xp):
    check_array("q", q, ndim=3, dtypes=FLOAT_DTYPES, xp=xp)
    check_head_dim("q.shape[-1]", q.shape[-1])
    for name, x in (("k", k), ("v", v)):
        check_array(name, x, dtypes=q.dtype, xp=xp)
        if x.ndim not in (3, 4) or x.shape[-1] != q.shape[-1]:
            raise ValueError(f"{name}: expected [tokens, num_kv_heads, {q.shape[-1]}] or "
                             f"[batch, kv_len, num_kv_heads, {q.shape[-1]}], got {tuple(x.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected shape {tuple(k.shape)} like k, got {tuple(v.shape)}")
    check_gqa(q.shape[1], k.shape[-2])
    check_array("sink", sink, shape=(q.shape[1],), dtypes=np.float32, xp=xp)


def plan_sink_attention(q, k, v, sink, mode, batch_size, window_left, qo_indptr, kv_indptr, xp,
                        validate=None):
    """Resolve the mode (the sink-attention contract's rules and messages first), check the
    arrays and build the ragged lengths."""
    if mode not in MODES:
        raise ValueError(f"Unknown mode: {mode}. Supported modes: " + ", ".join(repr(m) for m in MODES))
    if mode == "auto":
        mode = ref.detect_mode(q, k, batch_size, qo_indptr, kv_indptr)
    _check_arrays(q, k, v, sink, xp)
    if mode == "incremental":
        batch = q.shape[0]
        if k.ndim == 3:
            kv_len = ref.uniform_length("k", k.shape[0], batch)
        elif k.shape[0] != batch:
            raise ValueError(f"k: expected [{batch}, kv_len, num_kv_heads, head_dim] for "
                             f"incremental mode, got {tuple(k.shape)}")
        else:
            kv_len = k.shape[1]
        return SinkPlan(mode, ref.uniform_indptr(batch, 1), ref.uniform_indptr(batch, kv_len), 1,
                        kv_len, False)
    if k.ndim != 3:
        raise ValueError(f"k: expected [total_kv, num_kv_heads, head_dim] for {mode} mode, "
                         f"got {tuple(k.shape)}")
    if mode == "varlen":
        if qo_indptr is None or kv_indptr is None:
            raise ValueError("qo_indptr and kv_indptr are required for varlen mode")
        # device indptrs are checked by the prefill plan kernel (strict mode: here)
        contents = xp is np or strict(validate)
        cu_q = check_cu_seqlens("qo_indptr", qo_indptr, xp, total=q.shape[0], padding=False,
                                contents=contents)
        cu_k = check_cu_seqlens("kv_indptr", kv_indptr, xp, total=k.shape[0], padding=False,
                                contents=contents)
        if qo_indptr.shape != kv_indptr.shape:
            raise ValueError(f"kv_indptr: expected shape {tuple(qo_indptr.shape)} like "
                             f"qo_indptr, got {tuple(kv_indptr.shape)}")
        if not contents:
            return SinkPlan(mode, qo_indptr, kv_indptr, None, None, False)
        return SinkPlan(mode, cu_q, cu_k, int(np.diff(cu_q).max(initial=0)),
                        int(np.diff(cu_k).max(initial=0)), False)
    if batch_size is None:
        raise ValueError(f"batch_size is required for {mode} mode")
    qo_len = ref.uniform_length("q", q.shape[0], batch_size)
    kv_len = ref.uniform_length("k", k.shape[0], batch_size)
    row_window = mode == "prefill" and window_left >= 0 and qo_len != kv_len
    return SinkPlan(mode, ref.uniform_indptr(batch_size, qo_len),
                    ref.uniform_indptr(batch_size, kv_len), qo_len, kv_len, row_window)


def _row_window_attention(q, k, v, sink, plan, causal, window_left, sm_scale):
    """The sink-attention contract's prefill-mode mask for ``qo_len != kv_len``: ``j >= i - w`` from the row
    index ``i`` (and ``j <= i + kv_len - qo_len`` when causal), dense, with ``sink_softmax``."""
    import cupy
    batch, qo, kv = len(plan.cu_q) - 1, plan.max_q, plan.max_k
    hq, hk, d = q.shape[1], k.shape[-2], q.shape[2]
    scale = d ** -0.5 if sm_scale is None else float(sm_scale)
    qf = q.reshape(batch, qo, hq, d).astype(cupy.float32).transpose(0, 2, 1, 3)
    kf, vf = (cupy.repeat(x.reshape(batch, kv, hk, d).astype(cupy.float32), hq // hk, axis=2)
              .transpose(0, 2, 1, 3) for x in (k, v))
    i, j = cupy.arange(qo)[:, None], cupy.arange(kv)[None, :]
    visible = j >= i - window_left
    if causal:
        visible &= j <= i + (kv - qo)
    s = cupy.where(visible, scale * (qf @ kf.transpose(0, 1, 3, 2)), -cupy.inf).astype(cupy.float32)
    out = sink_softmax(cupy.ascontiguousarray(s), sink) @ vf
    return out.transpose(0, 2, 1, 3).reshape(batch * qo, hq, d).astype(q.dtype)


@accepts_dlpack
def sink_attention(q, k, v, sink, window_left, causal, sm_scale, batch_size=None, mode="auto",
                   qo_indptr=None, kv_indptr=None, *, validate=None):
    """The sink-attention contract's unified sink attention: prefill, incremental, chunk and varlen modes.

    Parameters
    ----------
    q : array
        ``[total_q, Hq, D]`` (prefill, chunk, varlen) or ``[batch, Hq, D]`` (incremental);
        float16, bfloat16 or float32; ``D`` in 64, 80, 96, 112, 128, 256.
    k, v : array
        ``[total_kv, Hk, D]``, or ``[batch, kv_len, Hk, D]`` in incremental mode; q's dtype;
        ``Hq % Hk == 0`` (query head ``h`` reads kv head ``h // (Hq // Hk)``).
    sink : array
        float32 ``[Hq]`` raw sink logits.
    window_left : int
        ``w >= 0`` hides keys ``j < p - w`` (prefill mode: ``j < i - w``, the sink-attention
        contract's row-index window); -1 for none. Non-causal windows bound the left side only.
    causal : bool
        Hide keys ``j > p``; ``p = kv_len - q_len + i`` (bottom-right aligned).
    sm_scale : float or None
        Score scale; None means ``D ** -0.5``.
    batch_size : int, optional
        Equal-length sequences in prefill and chunk modes (and to auto-detect them).
    mode : {"auto", "prefill", "incremental", "chunk", "varlen"}
        ``"auto"``: varlen if an indptr is given, incremental for 3-D ``q`` with 4-D ``k``,
        otherwise from ``q.shape[0] // batch_size`` vs ``k.shape[0] // batch_size``: equal ->
        prefill, 1 -> incremental, else chunk.
    qo_indptr, kv_indptr : array, optional
        int32 ``[batch + 1]`` prefix sums of query and kv lengths (varlen mode). Device
        indptrs are not read by the host: the prefill plan kernel checks them.
    validate : bool, optional
        Check device indptrs on the host first (strict mode; default ``CUPAGED_STRICT``).

    Returns
    -------
    array
        ``[total_q, Hq, D]`` (incremental: ``[batch, Hq, D]``) in q's dtype.

    Raises
    ------
    ValueError, TypeError
        The sink-attention contract's errors (unknown mode, missing ``batch_size`` or indptrs, undetectable
        shapes) and bad shapes, dtypes, head sizes, lengths or array modules.
    """
    xp = array_module(q, k, v, sink, qo_indptr, kv_indptr)
    _check_scalars(window_left, causal, sm_scale, batch_size)
    plan = plan_sink_attention(q, k, v, sink, mode, batch_size, window_left, qo_indptr,
                               kv_indptr, xp, validate)
    if xp is np:
        return ref.sink_attention(q, k, v, sink, window_left, causal, sm_scale,
                                  batch_size=batch_size, mode=plan.mode,
                                  qo_indptr=qo_indptr, kv_indptr=kv_indptr)
    if plan.row_window:
        return _row_window_attention(q, k, v, sink, plan, causal, window_left, sm_scale)
    from ..prefill.api import varlen_prefill
    d = q.shape[-1]
    cu_q, cu_k = (c if c is not None and not isinstance(c, np.ndarray) else _upload(c)
                  for c in (plan.cu_q, plan.cu_k))
    return varlen_prefill(q, k.reshape(-1, k.shape[-2], d), v.reshape(-1, v.shape[-2], d),
                          cu_q, cu_k, plan.max_q, plan.max_k, causal=bool(causal),
                          sm_scale=sm_scale, window_left=int(window_left), sinks=sink,
                          validate=validate)


def _upload(host_array):
    """A device copy of a small host array, made without waiting for the device (pinned
    staging; a new device array each call, as the caller may keep the result)."""
    import cupy
    device_array = cupy.empty(host_array.shape, host_array.dtype)
    uploader().upload(device_array, np.ascontiguousarray(host_array))
    return device_array
