"""Timing with CUDA events, the bandwidth ceiling measured in the same run, and tables."""
from __future__ import annotations

import functools
import statistics
import sys
import time


WARM_SECONDS = 0.03


def settle(fn, sync, warmup=3, seconds=WARM_SECONDS):
    """Run ``fn()`` ``warmup`` times, then on until ``seconds`` have passed since the start
    (``sync()`` after each): right after a large allocation is freed and another made, the
    first milliseconds of GPU work can run markedly slower (benchmarks/NOTES.md, decode
    v9e), which a few short warm-up calls do not cover; long calls are not repeated."""
    start = time.perf_counter()
    for _ in range(warmup):
        fn()
    sync()
    while time.perf_counter() - start < seconds:
        fn()
        sync()


def time_gpu(fn, *, warmup=3, reps=20):
    """Median seconds of ``fn()`` over ``reps`` runs, each timed with CUDA events, after
    :func:`settle`.

    ``fn`` should rotate its inputs itself when they would fit in L2 (60 MB on an H200).
    """
    import cupy
    settle(fn, cupy.cuda.get_current_stream().synchronize, warmup)
    times = []
    for _ in range(reps):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e-3)
    return statistics.median(times)


def back_to_back_us(call, kind="cupy", n=50):
    """Device microseconds per call of ``n`` calls issued back to back (events on the
    caller's stream: torch's for torch calls, CuPy's current one else), after three warm-up
    calls: what a caller's loop sustains, the larger of host and device time."""
    import cupy
    for _ in range(3):
        call()
    cupy.cuda.Device().synchronize()
    if kind == "torch":
        torch = torch_or_none()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            call()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) * 1e3 / n
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(n):
        call()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) * 1e3 / n


@functools.lru_cache(maxsize=None)
def copy_bandwidth(nbytes=2 << 30):
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    import cupy
    a = cupy.empty(nbytes, dtype=cupy.uint8)
    a.fill(1)
    b = cupy.empty_like(a)
    t = time_gpu(lambda: b.__setitem__(Ellipsis, a), reps=20)
    del a, b
    return 2 * nbytes / t


# Streams a buffer with 16-byte loads, four in flight per thread, grid-stride; the running
# xor is stored only if it equals a value it practically never takes (so the loads stay).
_READ_SOURCE = r"""
extern "C" __global__ void read_probe(const uint4* __restrict__ a, long long n, uint4* sink) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  const long long step = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * step < n; i += 4 * step) {
    uint4 x[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] = __ldcs(a + i + j * step);
#pragma unroll
    for (int j = 0; j < 4; ++j) { acc.x ^= x[j].x; acc.y ^= x[j].y; acc.z ^= x[j].z; acc.w ^= x[j].w; }
  }
  for (; i < n; i += step) { uint4 x = __ldcs(a + i); acc.x ^= x.x; acc.y ^= x.y; acc.z ^= x.z; acc.w ^= x.w; }
  if (acc.x == 0x9e3779b9u && acc.y == 0x7f4a7c15u) *sink = acc;
}
"""


@functools.lru_cache(maxsize=None)
def read_bandwidth(nbytes=2 << 30):
    """Read-only streaming bandwidth in bytes/s (16-byte loads over ``nbytes``): the ceiling
    of kernels that read far more than they write, such as decode."""
    import cupy
    kernel = cupy.RawKernel(_READ_SOURCE, "read_probe")
    a = cupy.empty(nbytes // 16 * 16, dtype=cupy.uint8)
    a.fill(1)
    sink = cupy.empty(16, dtype=cupy.uint8)
    blocks = cupy.cuda.Device().attributes["MultiProcessorCount"] * 8
    t = time_gpu(lambda: kernel((blocks,), (256,), (a, cupy.int64(a.size // 16), sink)), reps=20)
    del a
    return nbytes // 16 * 16 / t


def rotating(make, nbytes_each, min_total=256 << 20):
    """Build enough input sets (``make()`` each) that cycling through them defeats L2.

    Returns a zero-argument function returning the next set on every call.
    """
    count = max(2, -(-min_total // max(nbytes_each, 1)))
    sets = [make() for _ in range(min(count, 16))]
    state = {"i": 0}

    def nxt():
        state["i"] = (state["i"] + 1) % len(sets)
        return sets[state["i"]]
    return nxt


def torch_or_none():
    """torch if importable with CUDA (for peer figures), else None."""
    try:
        import torch
    except Exception:
        return None
    return torch if torch.cuda.is_available() else None


def format_table(rows, columns=None):
    """Plain-text table of dict rows; floats to 3 significant digits."""
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}"
        return "" if v is None else str(v)
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def bench_main(run, argv=None, columns=None, copy_ceiling=False):
    """Command-line entry shared by the benchmark modules' ``main``.

    Parameters
    ----------
    run : callable
        ``run(quick: bool) -> list[dict]``, the module's benchmark rows.
    argv : list of str, optional
        Arguments (default ``sys.argv[1:]``); ``--quick`` selects the short sweep.
    columns : list of str, optional
        Table columns (default: the keys of the first row).
    copy_ceiling : bool
        Also print the copy and read bandwidths the rows' ``frac_copy`` / ``frac_read``
        refer to.
    """
    argv = sys.argv[1:] if argv is None else argv
    rows = run(quick="--quick" in argv)
    if copy_ceiling:
        print(f"copy bandwidth (read + write): {copy_bandwidth() / 1e12:.2f} TB/s; "
              f"read-only: {read_bandwidth() / 1e12:.2f} TB/s")
    print(format_table(rows, columns))
