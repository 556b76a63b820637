"""The compile gate: every kernel specialisation compiles with NVRTC for sm_80 and sm_90
without register spills (marked ``compile_gate``, minutes: deselected by default, run by
``pytest -m compile_gate``; CI runs the same check as ``cupaged check-kernels``); one real
kernel compiled on every run; plus include inlining, the spill detector, the disk cache key,
arch checks and the dynamic shared-memory limit rule.

Compiling needs NVRTC and the CUDA headers (no GPU): skipped only where either is missing.
"""
import importlib
import multiprocessing

import pytest

from cupaged.core import compile as _compile


def _nvrtc_or_skip():
    problem = _compile.nvrtc_unavailable()
    if problem:
        pytest.skip(problem)


SPECS = _compile.all_specializations()
STEMS = sorted({s.stem for s in SPECS})


# ----------------------------------------------------------------------------- the gate
@pytest.mark.compile_gate
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("stem", STEMS)
def test_every_specialisation_compiles_without_spills(stem, arch):
    _nvrtc_or_skip()
    specs = [s for s in SPECS if s.stem == stem]
    reports = _compile.check_kernels(arch, specs)
    want = {(s.expr, "sm_90a" if s.hopper else arch) for s in specs
            if not s.hopper or arch == "sm_90"}
    assert {(r.expr, r.arch) for r in reports} == want
    spilling = [(r.expr, r.arch, r.spill_bytes) for r in reports if r.spill_bytes]
    assert not spilling, f"register spills: {spilling}"


def test_one_real_kernel_compiles():
    """The gate's path (sources with their includes, the worker pool, ptxas parsing,
    progress) on the smallest real stem, so that it is exercised on every run."""
    _nvrtc_or_skip()
    specs = [s for s in SPECS if s.stem == "cache_ops"][:2]
    done = []
    reports = _compile.check_kernels("sm_80", specs, jobs=1, progress=done.append)
    assert sorted((r.expr, r.arch) for r in reports) == sorted((s.expr, "sm_80") for s in specs)
    assert all(r.registers > 0 and r.spill_bytes == 0 for r in reports)
    assert sum(done) == len(specs) == _compile.kernel_count("sm_80", specs)


def test_kernel_count_matches_the_gate():
    hopper = sum(s.hopper for s in SPECS)
    assert _compile.kernel_count("sm_80") == len(SPECS) - hopper
    assert _compile.kernel_count("sm_90") == len(SPECS)


@pytest.mark.parametrize("arch, message", [
    ("sm_75", "arch: sm_80 or newer is needed: .*got sm_75"),
    ("sm_8", "arch: expected sm_<major><minor>"),
    ("ampere", "arch: expected sm_<major><minor>"),
    ("compute_80", "arch: expected sm_<major><minor>"),
])
def test_bad_archs_are_refused_before_compiling(arch, message, monkeypatch):
    monkeypatch.setattr(_compile, "_check_group", lambda *a: pytest.fail("compiled"))
    with pytest.raises(ValueError, match=message):
        _compile.check_kernels(arch, SPECS[:1])


def test_arch_unknown_to_nvrtc_is_refused():
    _nvrtc_or_skip()
    with pytest.raises(ValueError, match=r"arch: sm_99 is not supported by NVRTC .*sm_80"):
        _compile.check_kernels("sm_99", SPECS[:1])


def test_archs_accepted():
    assert [_compile.check_arch(a) for a in ("sm_80", "sm_86", "sm_90a", "sm_100", "sm_120f")] \
        == [80, 86, 90, 100, 120]


def test_spec_modules_list_their_kernels():
    for mod in _compile.SPEC_MODULES:
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if mod.startswith(e.name or "\0"):
                continue  # not written yet
            raise
        specs = m.kernel_specializations()
        assert specs, f"{mod}.kernel_specializations() is empty"
        for s in specs:
            assert isinstance(s, _compile.Spec), f"{mod}: {s!r} is not a Spec"
            assert (_compile.KERNEL_DIR / f"{s.stem}.cu").is_file(), f"{mod}: no {s.stem}.cu"


def test_every_source_is_compiled_by_the_gate():
    sources = {p.stem for p in _compile.KERNEL_DIR.glob("*.cu")}
    assert sources <= set(STEMS), f"sources no spec compiles: {sorted(sources - set(STEMS))}"


# ----------------------------------------------------------------------------- unit tests
@pytest.fixture
def kernel_dir(tmp_path, monkeypatch):
    """A private kernels directory and disk cache; the source cache is reset around it."""
    src = tmp_path / "kernels"
    src.mkdir()
    monkeypatch.setattr(_compile, "KERNEL_DIR", src)
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path / "cache"))
    _compile.source.cache_clear()
    yield src
    _compile.source.cache_clear()


def test_local_includes_are_inlined_once(kernel_dir):
    (kernel_dir / "a.cuh").write_text('#pragma once\n#include "b.cuh"\nint a_marker;')
    (kernel_dir / "b.cuh").write_text("int b_marker;")
    (kernel_dir / "k.cu").write_text(
        '#include <cuda_fp16.h>\n#include "a.cuh"\n  #  include "b.cuh"\nint k_marker;')
    text = _compile.source("k")
    assert text.count("b_marker") == 1 and "a_marker" in text and "k_marker" in text
    assert text.index("b_marker") < text.index("a_marker") < text.index("k_marker")
    assert "#include <cuda_fp16.h>" in text
    assert '#include "' not in text and "include \"" not in text


def test_real_sources_have_no_local_includes_left():
    for stem in STEMS:
        text = _compile.source(stem)
        assert "namespace cupaged" in text            # common.cuh inlined
        assert '#include "' not in text


def test_generated_constants_have_no_second_home_in_the_sources():
    """Every constant the families' cpp() put in the generated abi.cuh is defined there
    alone: no kernel source or header restates it at namespace scope (Python is its one
    source; a struct's own member of the same name is another constant)."""
    import re
    names = set()
    for module in _compile.HEADER_MODULES:
        names |= set(re.findall(r"constexpr int (\w+) =", importlib.import_module(module).cpp()))
    assert {"ROWS_UNROLL", "WS_THREADS", "SP_THREADS", "TILE_GATHER", "ROPE_THREADS",
            "SINK_THREADS", "NTHREADS"} <= names
    for path in sorted(_compile.KERNEL_DIR.glob("*.cu*")):
        defined = set(re.findall(r"^constexpr int (\w+) =", path.read_text(), re.M))
        assert not defined & names, f"{path.name} restates {sorted(defined & names)}"


TINY = """
template <typename T> __global__ void scale(T* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = x[i] * T(2);
}
"""

HUNGRY = """
__global__ void hungry(const float* __restrict__ in, float* __restrict__ out) {
  float r[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) r[i] = in[threadIdx.x * 64 + i];
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc += r[i] * r[(i * 7 + j) % 64];
  out[threadIdx.x] = acc;
}
"""


def test_spill_detector_sees_spills(kernel_dir):
    _nvrtc_or_skip()
    (kernel_dir / "hungry.cu").write_text(HUNGRY)
    _, lowered, log = _compile.compile_cubin("hungry", ["hungry"], "sm_80",
                                             options=("--maxrregcount=32",), verbose=True)
    (report,) = _compile.parse_ptxas(log, lowered, "sm_80")
    assert report.expr == "hungry" and report.registers <= 32
    assert report.spill_bytes > 0 and report.stack_bytes > 0


def test_disk_cache_key(kernel_dir, monkeypatch):
    _nvrtc_or_skip()
    (kernel_dir / "tiny.cu").write_text(TINY)
    calls = []
    real = _compile.compile_cubin
    monkeypatch.setattr(_compile, "compile_cubin",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    path, name = _compile._disk_cached_cubin("tiny", "scale<float>", "sm_80", ())
    assert path.is_file() and path.parent == kernel_dir.parent / "cache"
    assert name.startswith("_Z") and "scale" in name
    assert _compile._disk_cached_cubin("tiny", "scale<float>", "sm_80", ()) == (path, name)
    assert len(calls) == 1                                   # second call: from disk
    variants = [("tiny", "scale<double>", "sm_80", ()),      # expression
                ("tiny", "scale<float>", "sm_90", ()),       # architecture
                ("tiny", "scale<float>", "sm_80", ("-DX=1",))]  # options
    paths = {_compile._disk_cached_cubin(*v)[0] for v in variants}
    assert len(paths | {path}) == 4 and len(calls) == 4
    (kernel_dir / "tiny.cu").write_text(TINY + "\n// edited\n")  # source text
    _compile.source.cache_clear()
    assert _compile._disk_cached_cubin("tiny", "scale<float>", "sm_80", ())[0] != path
    assert len(calls) == 5


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path))
    assert _compile.cache_dir() == tmp_path


def test_compile_error_names_the_source(kernel_dir):
    _nvrtc_or_skip()
    (kernel_dir / "broken.cu").write_text("__global__ void k() { undeclared(); }")
    with pytest.raises(RuntimeError, match=r"broken\.cu.*sm_80") as err:
        _compile.compile_cubin("broken", ["k"], "sm_80")
    assert "undeclared" in str(err.value) and "\0" not in str(err.value)


@pytest.mark.skipif(multiprocessing.get_start_method() != "fork",
                    reason="worker processes must inherit the patched kernel directory")
def test_check_kernels_stops_at_a_compile_error(kernel_dir):
    _nvrtc_or_skip()
    (kernel_dir / "tiny.cu").write_text(TINY)
    (kernel_dir / "broken.cu").write_text("__global__ void k() { undeclared(); }")
    specs = [_compile.Spec("broken", "k")] + [_compile.Spec("tiny", f"scale<{t}>")
                                              for t in ("float", "double", "int")]
    done = []
    with pytest.raises(RuntimeError, match=r"NVRTC failed on broken\.cu for sm_80"):
        _compile.check_kernels("sm_80", specs, jobs=1, progress=done.append)
    assert done == []                     # the failing program ran first: nothing reported


@pytest.mark.skipif(multiprocessing.get_start_method() != "fork",
                    reason="worker processes must inherit the patched kernel directory")
def test_check_kernels_skips_hopper_specs_off_sm90(kernel_dir):
    _nvrtc_or_skip()
    (kernel_dir / "tiny.cu").write_text(TINY)
    specs = [_compile.Spec("tiny", "scale<float>"),
             _compile.Spec("tiny", "scale<double>", hopper=True)]
    on80 = _compile.check_kernels("sm_80", specs, jobs=1)
    on90 = _compile.check_kernels("sm_90", specs, jobs=1)
    assert [(r.expr, r.arch) for r in on80] == [("scale<float>", "sm_80")]
    assert sorted((r.expr, r.arch) for r in on90) == [("scale<double>", "sm_90a"),
                                                     ("scale<float>", "sm_90")]


def test_dynamic_smem_limit_is_only_raised():
    """The limit is the function's: raised past the default (48 KiB less the static), kept
    when a later launch asks for less, and no driver attribute is touched again for it."""
    class Kernel:
        shared_size_bytes = 128

        def __init__(self):
            self.sets = []

        @property
        def max_dynamic_shared_size_bytes(self):
            raise AssertionError("not read")

        @max_dynamic_shared_size_bytes.setter
        def max_dynamic_shared_size_bytes(self, v):
            self.sets.append(v)

    k = Kernel()
    assert _compile.allow_dynamic_smem(k, 48 * 1024 - 128)        # fits the default: no set
    assert k.sets == []
    assert _compile.allow_dynamic_smem(k, 48 * 1024)              # with the static, past it
    assert _compile.allow_dynamic_smem(k, 196608)
    assert not _compile.allow_dynamic_smem(k, 49152)              # less than before: kept
    assert not _compile.allow_dynamic_smem(k, 196608)
    assert k.sets == [48 * 1024, 196608]
    assert not _compile.allow_dynamic_smem(Kernel(), 0)
