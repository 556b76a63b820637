"""Run-time compilation of the CUDA C sources in ``kernels_cu``.

One path serves both launching and checking: a source ``kernels_cu/<stem>.cu`` (its local
``#include "x.cuh"`` lines inlined, so the text alone keys every cache) is compiled by NVRTC
to a cubin for one template specialisation (``name_expression``) and one architecture.
Cubins are kept in memory per (device arch, options) and on disk under
``$CUPAGED_CACHE_DIR`` (default ``~/.cache/cupaged``). Checking (``check-kernels``) needs
only NVRTC, no GPU and no driver.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import os
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ._arrays import bfloat16, float16, float32

KERNEL_DIR = Path(importlib.import_module("kernels_cu").__file__).parent
_CTYPES = {float16: "__half", bfloat16: "__nv_bfloat16", float32: "float"}
BASE_OPTIONS = ("--std=c++17", "-DNDEBUG")
MIN_ARCH = 80  # oldest architecture the kernels compile for (cp.async, bf16 mma.sync)
# modules whose kernel_specializations() list every kernel the library can launch
SPEC_MODULES = ("cupaged.cache_ops", "cupaged.decode", "cupaged.prefill", "cupaged.rope",
                "cupaged.sink", "cupaged.sparse.kernels")


class Spec(NamedTuple):
    """One launchable specialisation: source stem, template name expression, Hopper-only."""
    stem: str
    expr: str
    hopper: bool = False


class KernelReport(NamedTuple):
    expr: str
    arch: str
    registers: int
    spill_bytes: int
    stack_bytes: int
    smem_bytes: int


def ctype(dtype) -> str:
    """C type name of a float dtype in kernel templates (``__half``, ``__nv_bfloat16``, ``float``)."""
    return _CTYPES[np.dtype(dtype)]


def cache_dir() -> Path:
    return Path(os.environ.get("CUPAGED_CACHE_DIR", Path.home() / ".cache" / "cupaged"))


@functools.lru_cache(maxsize=None)
def cuda_include_dir() -> str | None:
    """A directory holding ``cuda_fp16.h``/``cuda_bf16.h`` for NVRTC, or None."""
    cands = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    try:
        import cupy
        cands.append(cupy.cuda.get_cuda_path())
    except Exception:
        pass
    dirs = [os.path.join(c, "include") for c in cands if c]
    try:
        import nvidia
        for root in nvidia.__path__:
            dirs += [os.path.join(root, sub, "include") for sub in ("cuda_runtime", "cu13", "cu12")]
    except ImportError:
        pass
    for d in dirs:
        if os.path.isfile(os.path.join(d, "cuda_bf16.h")):
            return d
    return None


@functools.lru_cache(maxsize=None)
def source(stem: str) -> str:
    """Text of ``kernels_cu/<stem>.cu`` with local includes inlined once each."""
    seen = set()

    def expand(path: Path) -> str:
        out = []
        for line in path.read_text().splitlines():
            m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
            if m:
                inc = KERNEL_DIR / m.group(1)
                if inc not in seen:
                    seen.add(inc)
                    out.append(expand(inc))
                continue
            out.append(line)
        return "\n".join(out)

    return expand(KERNEL_DIR / f"{stem}.cu")


def _nvrtc():
    from cupy_backends.cuda.libs import nvrtc
    return nvrtc


def nvrtc_unavailable() -> str | None:
    """Why kernels cannot be compiled here (no NVRTC library, no CUDA headers), or None."""
    try:
        _nvrtc().getVersion()
    except Exception as e:  # no CuPy, or libnvrtc not found
        return (f"NVRTC unavailable ({type(e).__name__}: {e}); install a CUDA toolkit or the "
                "gate extra (pip install -e '.[gate]')")
    if cuda_include_dir() is None:
        return ("CUDA headers (cuda_bf16.h) not found; set CUDA_PATH to a CUDA toolkit or "
                "install the gate extra (pip install -e '.[gate]')")
    return None


def check_arch(arch) -> int:
    """Raise ValueError unless ``arch`` names sm_80 or newer (``sm_86``, ``sm_90a``, ...);
    return its number (86, 90)."""
    m = re.fullmatch(r"sm_(\d{2,3})[af]?", str(arch))
    if not m:
        raise ValueError(f"arch: expected sm_<major><minor> such as sm_80 or sm_90a, got {arch!r}")
    number = int(m.group(1))
    if number < MIN_ARCH:
        raise ValueError(f"arch: sm_{MIN_ARCH} or newer is needed: the kernels use cp.async and "
                         f"bf16 tensor-core MMA (Ampere and later), got {arch}")
    return number


def compile_cubin(stem, exprs, arch, options=(), verbose=False):
    """Compile ``exprs`` of ``stem`` for ``arch`` (``"sm_80"``, ``"sm_90a"``) with NVRTC.

    Returns
    -------
    cubin : bytes
    lowered : dict
        Name expression -> mangled kernel name.
    log : str
        NVRTC and ptxas messages (register use when ``verbose``).
    """
    nvrtc = _nvrtc()
    inc = cuda_include_dir()
    opts = list(BASE_OPTIONS) + list(options) + [f"--gpu-architecture={arch}"]
    if inc:
        opts.append(f"-I{inc}")
    if verbose:
        opts.append("--ptxas-options=-v")
    prog = nvrtc.createProgram(source(stem), f"{stem}.cu", [], [])
    try:
        for e in exprs:
            nvrtc.addNameExpression(prog, e)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as err:
            raise RuntimeError(f"NVRTC failed on {stem}.cu for {arch}: {err}\n"
                               f"{_program_log(prog)}") from None
        log = _program_log(prog)
        lowered = {e: nvrtc.getLoweredName(prog, e) for e in exprs}
        return nvrtc.getCUBIN(prog), lowered, log
    finally:
        nvrtc.destroyProgram(prog)


def _program_log(prog) -> str:
    """NVRTC's log of ``prog`` without the C string's terminating NUL."""
    return _nvrtc().getProgramLog(prog).rstrip("\0")


def parse_ptxas(log, lowered, arch):
    """Per-kernel registers, spills, stack and shared memory from a ptxas ``-v`` log."""
    by_name = {v: k for k, v in lowered.items()}
    reports, cur = [], None
    stats = {}
    for line in log.splitlines():
        m = re.search(r"Function properties for (\S+)", line) or \
            re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            cur = m.group(1)
            stats.setdefault(cur, dict(regs=0, spill=0, stack=0, smem=0))
            continue
        if cur is None:
            continue
        s = stats[cur]
        if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            s["stack"] = int(m.group(1))
            s["spill"] = int(m.group(2)) + int(m.group(3))
        if m := re.search(r"Used (\d+) registers", line):
            s["regs"] = int(m.group(1))
        if m := re.search(r"(\d+) bytes smem", line):
            s["smem"] = int(m.group(1))
    for name, s in stats.items():
        if name in by_name:
            reports.append(KernelReport(by_name[name], arch, s["regs"], s["spill"], s["stack"], s["smem"]))
    return reports


# ----------------------------------------------------------------------------- device side
def device_arch(hopper=False) -> str:
    """NVRTC architecture of the current device (``sm_90a`` for Hopper-only specs)."""
    import cupy
    cc = cupy.cuda.Device().compute_capability
    return f"sm_{cc}a" if hopper and cc == "90" else f"sm_{cc}"


def _disk_cached_cubin(stem, expr, arch, options):
    nvrtc = _nvrtc()
    key = hashlib.sha256("\0".join([source(stem), expr, arch, *options, *BASE_OPTIONS,
                                    str(nvrtc.getVersion()), str(cuda_include_dir())]).encode()).hexdigest()
    path = cache_dir() / f"{stem}-{key[:24]}"
    cubin_path, name_path = path.with_suffix(".cubin"), path.with_suffix(".name")
    if cubin_path.exists() and name_path.exists():
        return cubin_path, name_path.read_text()
    cubin, lowered, _ = compile_cubin(stem, [expr], arch, options)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = cubin_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(cubin)
    os.replace(tmp, cubin_path)
    name_path.write_text(lowered[expr])
    return cubin_path, lowered[expr]


@functools.lru_cache(maxsize=None)
def _kernel(device_id, stem, expr, arch, options):
    import cupy
    cubin_path, name = _disk_cached_cubin(stem, expr, arch, options)
    return cupy.RawModule(path=str(cubin_path)).get_function(name)


_DYNAMIC_SMEM = {}  # id(kernel) -> the most dynamic shared memory asked for it so far


def allow_dynamic_smem(kernel, smem):
    """Let ``kernel`` (from :func:`get_kernel`, kept for the process) launch with ``smem``
    bytes of dynamic shared memory.

    Past the default (48 KiB less the kernel's static shared memory) the function's limit is
    raised to ``smem``. The limit belongs to the function, which launches of other sizes
    share, so it is only ever raised: a launch sized earlier with more still fits. Returns
    True when ``smem`` is more than any earlier call asked (callers set their carveout
    preference then); no driver call otherwise.
    """
    if smem <= _DYNAMIC_SMEM.get(id(kernel), 0):
        return False
    if smem + kernel.shared_size_bytes > 48 * 1024:
        kernel.max_dynamic_shared_size_bytes = smem
    _DYNAMIC_SMEM[id(kernel)] = smem
    return True


def get_kernel(stem, expr, *, hopper=False, options=()):
    """The ``cupy.RawKernel`` for template expression ``expr`` of ``kernels_cu/<stem>.cu``.

    Compiled once per (device, arch, options) and cached in memory and on disk.
    """
    import cupy
    return _kernel(cupy.cuda.Device().id, stem, expr, device_arch(hopper), tuple(options))


def all_specializations():
    """Every Spec the library can launch, gathered from SPEC_MODULES that exist."""
    specs = []
    for mod in SPEC_MODULES:
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and (mod == e.name or mod.startswith(e.name + ".")):
                continue  # that op family is not in this build
            raise
        specs.extend(m.kernel_specializations())
    return specs


def _check_work(arch, specs):
    """``(stem, arch, exprs)`` NVRTC programs of :func:`check_kernels`: the specs of one stem
    in chunks of up to 8 (several chunks a stem keep every worker busy); Hopper-only specs
    as ``sm_90a`` under ``sm_90``, left out for other archs."""
    specs = all_specializations() if specs is None else specs
    groups = {}
    for s in specs:
        a = arch
        if s.hopper:
            if arch != "sm_90":
                continue
            a = "sm_90a"
        groups.setdefault((s.stem, a), []).append(s.expr)
    work = []
    for (stem, a), exprs in groups.items():
        exprs = list(dict.fromkeys(exprs))
        work += [(stem, a, tuple(exprs[i:i + 8])) for i in range(0, len(exprs), 8)]
    return work


def kernel_count(arch, specs=None) -> int:
    """Kernels :func:`check_kernels` compiles for ``arch`` (its reports' length)."""
    return sum(len(exprs) for _, _, exprs in _check_work(arch, specs))


def check_kernels(arch, specs=None, jobs=None, progress=None):
    """Compile every spec for ``arch`` (``sm_80``, ``sm_90``) with NVRTC; return reports.

    Hopper-only specs are compiled for ``sm_90a`` under ``sm_90`` and skipped for other
    archs. Up to 8 specs of one stem compile in one NVRTC program; programs compile in
    parallel.

    Parameters
    ----------
    arch : str
        sm_80 or newer (:func:`check_arch`) that this NVRTC supports.
    specs : list of Spec, optional
        Default: :func:`all_specializations`.
    jobs : int, optional
        Worker processes (default: CPUs).
    progress : callable, optional
        Called with the number of kernels of each program as it finishes.

    Returns
    -------
    list of KernelReport
        One per kernel, the kernels of a stem together.

    Raises
    ------
    ValueError
        ``arch`` is malformed, older than sm_80 or unknown to NVRTC.
    RuntimeError
        NVRTC or the CUDA headers are missing, or a program fails to compile (the first
        failure ends the check; programs not started yet are cancelled).
    """
    from concurrent.futures import ProcessPoolExecutor, as_completed
    number = check_arch(arch)
    problem = nvrtc_unavailable()
    if problem:
        raise RuntimeError(problem)
    supported = _nvrtc().getSupportedArchs()
    if number not in supported:
        names = ", ".join(f"sm_{a}" for a in supported if a >= MIN_ARCH)
        version = ".".join(map(str, _nvrtc().getVersion()))
        raise ValueError(f"arch: {arch} is not supported by NVRTC {version} (it supports "
                         f"{names})")
    with ProcessPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as ex:
        futs = {ex.submit(_check_group, *w): len(w[2]) for w in _check_work(arch, specs)}
        try:
            for f in as_completed(futs):
                f.result()
                if progress is not None:
                    progress(futs[f])
        except BaseException:
            ex.shutdown(cancel_futures=True)
            raise
        return [r for f in futs for r in f.result()]


def _check_group(stem, arch, exprs):
    _, lowered, log = compile_cubin(stem, exprs, arch, verbose=True)
    return parse_ptxas(log, lowered, arch)
