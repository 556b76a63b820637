"""The ``cupaged`` command line, the continuous-batching demo and the GPU suite scripts."""
import io
import json
import os
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cupaged.core import compile as _compile
from cupaged import cli
from cupaged.core.arrays import gpu_available
from cupaged.engine.blocks import BlockPool, BlockTable
from cupaged.engine.demo import DemoConfig, Scheduler, blocks_for, make_requests

ROOT = Path(__file__).resolve().parents[1]


def invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args], catch_exceptions=False)


# ----------------------------------------------------------------------------- info
def test_info_lists_versions_and_cache_dir():
    res = invoke("info")
    assert res.exit_code == 0, res.output
    for label in ("cupaged", "numpy", "ml_dtypes", "cupy", "NVRTC", "kernel cache dir", "GPU"):
        assert label in res.output
    assert str(_compile.cache_dir()) in res.output


def test_version():
    res = invoke("--version")
    assert res.exit_code == 0 and "0.1.0" in res.output


# ----------------------------------------------------------------------------- check-kernels
def _report(expr, arch, spill=0):
    return _compile.KernelReport(expr, arch, 96, spill, spill, 4096)


@pytest.fixture
def fake_check(monkeypatch):
    """Replace the NVRTC run by canned reports; record (arch, jobs) per call."""
    calls, spills = [], {}

    def check_kernels(arch, specs=None, jobs=None, progress=None):
        calls.append((arch, jobs))
        progress(2)
        return [_report("decode<__half, 128>", arch, spills.get(arch, 0)),
                _report("prefill<float, 64>", arch)]
    monkeypatch.setattr(_compile, "check_kernels", check_kernels)
    monkeypatch.setattr(_compile, "kernel_count", lambda arch, specs=None: 2)
    return calls, spills


def test_check_kernels_prints_a_summary(fake_check, tmp_path):
    calls, _ = fake_check
    res = invoke("check-kernels", "--arch", "sm_90", "--jobs", 3, "--json", tmp_path / "k.json")
    assert res.exit_code == 0, res.output
    assert calls == [("sm_90", 3)]
    assert res.output.splitlines() == [
        "sm_90: 2 kernels, registers 96-96, 0 spilling, stack up to 0 bytes, "
        "static smem up to 4096 bytes",
        "2 kernels compiled, 0 spilling"]
    rows = json.loads((tmp_path / "k.json").read_text())
    assert [r["kernel"] for r in rows] == ["decode<__half, 128>", "prefill<float, 64>"]
    assert rows[0] == {"kernel": "decode<__half, 128>", "arch": "sm_90", "registers": 96,
                       "spill bytes": 0, "stack bytes": 0, "static smem bytes": 4096}


def test_check_kernels_table_shows_every_kernel(fake_check):
    res = invoke("check-kernels", "--arch", "sm_90", "--table")
    assert res.exit_code == 0, res.output
    assert "decode<__half, 128>" in res.output and "prefill<float, 64>" in res.output
    assert "registers" in res.output and "spill bytes" in res.output
    assert res.output.splitlines()[-1] == "2 kernels compiled, 0 spilling"


def test_progress_bar_only_on_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True
    for stream, drawn in ((io.StringIO(), False), (Terminal(), True)):
        monkeypatch.setattr(sys, "stderr", stream)
        with cli.progress_bar(4, "kernels") as update:
            update(3)
            update(1)
        assert bool(stream.getvalue()) is drawn
        assert not drawn or ("kernels" in stream.getvalue() and "4/4" in stream.getvalue())


def test_check_kernels_output_has_no_progress_bar(fake_check):
    res = invoke("check-kernels", "--arch", "sm_80", "--arch", "sm_90")
    assert res.exit_code == 0, res.output
    assert res.output.startswith("sm_80: 2 kernels")


@pytest.mark.parametrize("arch, message", [
    ("sm_75", "sm_80 or newer is needed: the kernels use cp.async"),
    ("sm75", "expected sm_<major><minor> such as sm_80 or sm_90a, got 'sm75'"),
])
def test_check_kernels_refuses_bad_archs_up_front(fake_check, arch, message):
    calls, _ = fake_check
    res = invoke("check-kernels", "--arch", "sm_90", "--arch", arch)
    assert res.exit_code == 2 and message in res.output
    assert "Invalid value for '--arch'" in res.output
    assert calls == []


def test_check_kernels_default_archs(fake_check, monkeypatch):
    calls, _ = fake_check
    monkeypatch.setattr(cli, "gpu_available", lambda: False)
    assert invoke("check-kernels").exit_code == 0
    assert [a for a, _ in calls] == ["sm_80", "sm_90"]


def test_check_kernels_fails_on_a_spill(fake_check):
    _, spills = fake_check
    spills["sm_80"] = 64
    res = invoke("check-kernels", "--arch", "sm_80", "--arch", "sm_90")
    assert res.exit_code == 1
    header, row, *rest = res.output.splitlines()
    assert "spill bytes" in header and row.split()[:4] == ["decode<__half,", "128>", "sm_80", "96"]
    assert "2 kernels compiled, 0 spilling" not in res.output
    assert "4 kernels compiled, 1 spilling" in res.output and "sm_80: 2 kernels" in res.output
    assert "register spills in: decode<__half, 128> (sm_80, 64 bytes)" in res.output


def test_check_kernels_fails_on_a_compile_error(monkeypatch):
    def broken(arch, specs=None, jobs=None, progress=None):
        raise RuntimeError("NVRTC failed on decode.cu for sm_80: error: expected a ';'")
    monkeypatch.setattr(_compile, "check_kernels", broken)
    res = invoke("check-kernels", "--arch", "sm_80")
    assert res.exit_code == 1
    assert res.output == "Error: NVRTC failed on decode.cu for sm_80: error: expected a ';'\n"


@pytest.mark.parametrize("command", ["info", "check-kernels", "demo", "bench"])
def test_help_is_plain_text(command):
    res = invoke(command, "--help")
    assert res.exit_code == 0 and "Usage" in res.output
    assert "``" not in res.output and ":func:" not in res.output


# ----------------------------------------------------------------------------- bench
ROWS = [{"layout": "NHD", "tokens": 65536, "TB/s": 3.5, "frac copy": 0.82},
        {"layout": "vllm", "tokens": 65536, "TB/s": np.float64(3.1), "frac copy": 0.73}]


@pytest.fixture
def fake_bench(monkeypatch):
    """A ``cupaged.bench.decode`` module returning ROWS; the GPU check passes."""
    calls = []
    mod = types.ModuleType("cupaged.bench.decode")
    mod.run = lambda quick=False: calls.append(quick) or ROWS
    monkeypatch.setitem(sys.modules, "cupaged.bench.decode", mod)
    monkeypatch.setattr(cli, "gpu_available", lambda: True)
    return calls


def test_bench_prints_rows_and_saves_json(fake_bench, tmp_path):
    out = tmp_path / "rows.json"
    res = invoke("bench", "decode", "--quick", "--json", out)
    assert res.exit_code == 0, res.output
    assert fake_bench == [True]
    header, *lines = res.output.strip().splitlines()
    assert header.split() == ["layout", "tokens", "TB/s", "frac", "copy"]
    assert lines[1].split() == ["vllm", "65536", "3.1", "0.73"]
    assert json.loads(out.read_text()) == [{k: float(v) if k == "TB/s" else v
                                            for k, v in r.items()} for r in ROWS]


def test_bench_missing_module_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupaged.bench.sparse", None)  # import fails
    res = invoke("bench", "sparse")
    assert res.exit_code == 1
    assert "benchmark 'sparse' is not available" in res.output


def test_bench_needs_a_gpu(fake_bench, monkeypatch):
    monkeypatch.setattr(cli, "gpu_available", lambda: False)
    res = invoke("bench", "decode")
    assert res.exit_code == 1 and "needs a CUDA device" in res.output
    assert fake_bench == []


def test_bench_unknown_name_is_refused():
    res = invoke("bench", "everything")
    assert res.exit_code == 2 and "everything" in res.output


def test_bench_plot_without_matplotlib(fake_bench, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    res = invoke("bench", "decode", "--plot", tmp_path / "p.png")
    assert res.exit_code == 1 and "--plot needs matplotlib" in res.output
    assert "vllm" in res.output  # the table is printed first


def test_bench_plot(fake_bench, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "p.png"
    res = invoke("bench", "decode", "--plot", path, "--plot-column", "TB/s")
    assert res.exit_code == 0, res.output
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_headline_summarises_ratios_then_rates():
    assert cli.headline(ROWS) == "2 rows; frac copy 0.73..0.82; TB/s 3.1..3.5"
    assert cli.headline([{"name": "a", "us": 5.0}]) == "1 row; us 5"
    mixed = [{"op": "varlen", "TFLOPs": 300.0, "vs_flash": None, "checked": True},
             {"op": "varlen", "TFLOPs": 350.0, "vs_flash": 1.1, "checked": False},
             {"op": "paged", "TFLOPs": 310.0, "vs_ragged": 0.93, "checked": True}]
    assert cli.headline(mixed) == ("3 rows; checked FALSE in 1; vs_flash 1.1; vs_ragged 0.93; "
                                   "TFLOPs 300..350")


def test_bench_table_shows_every_column(fake_bench, monkeypatch):
    rows = [{"op": "a", "ms": 1.0}, {"op": "b", "ms": 2.0, "vs_ragged": 0.9}]
    monkeypatch.setattr(sys.modules["cupaged.bench.decode"], "run", lambda quick=False: rows)
    res = invoke("bench", "decode")
    assert res.output.splitlines()[0].split() == ["op", "ms", "vs_ragged"]
    assert res.output.splitlines()[2].split() == ["b", "2", "0.9"]


# ----------------------------------------------------------------------------- demo: scheduler
def _drive(cfg):
    """Run the scheduler alone (no kernels); check its invariants every step."""
    pool = BlockPool(cfg.num_blocks, cfg.block_size)
    table = BlockTable(pool, cfg.max_seqs, blocks_for(cfg.max_seq_len, cfg.block_size))
    reqs = make_requests(cfg, np.random.default_rng(cfg.seed))
    sched, step, steps = Scheduler(cfg, reqs, table), 0, 0
    while not sched.finished:
        step = sched.arrive(step) + 1
        sched.admit()
        reserved = sum(blocks_for(r.final_len, cfg.block_size) for r in sched.running)
        assert reserved <= cfg.num_blocks and len(sched.running) <= cfg.max_seqs
        plan = sched.plan()
        q_lens = np.diff(plan.cu_seqlens_q)
        assert plan.num_tokens <= cfg.max_batch_tokens and (q_lens > 0).all()
        assert (q_lens[:plan.num_decode] == 1).all()
        assert plan.slot_mapping.dtype == np.int64 and plan.slot_mapping.size == plan.num_tokens
        ids = [r.seq_id for r, _ in plan.rows]
        assert len(set(ids)) == len(ids)
        np.testing.assert_array_equal(plan.seq_lens, table.seq_lens[ids])
        for (r, n), kv in zip(plan.rows, plan.seq_lens):
            assert kv == r.prefilled + max(r.generated - 1, 0) + n
            assert r.arrival < step
        sched.complete(plan)
        steps += 1
    assert pool.num_free == cfg.num_blocks
    assert all(r.done and r.generated == r.output_len and r.prefilled == r.prompt_len
               for r in reqs)
    return steps


@pytest.mark.parametrize("cfg", [
    DemoConfig(requests=40, seed=3),
    DemoConfig(requests=30, num_blocks=40, block_size=8, max_prompt=200, max_output=9,
               max_seqs=5, max_batch_tokens=7, arrival_rate=5.0),   # tight pool and budget
    DemoConfig(requests=12, min_prompt=1, max_prompt=1, min_output=1, max_output=1),
], ids=["default", "tight", "single-token"])
def test_scheduler_invariants(cfg):
    assert _drive(cfg) > 0


def test_demo_config_errors_name_the_field():
    for bad, field in [(dict(num_blocks=2), "num_blocks"), (dict(max_seqs=300), "max_seqs"),
                       (dict(num_kv_heads=3), "num_kv_heads"), (dict(head_dim=65), "head_dim"),
                       (dict(max_prompt=4), "max_prompt"), (dict(dtype="int8"), "dtype"),
                       (dict(layout="NDH"), "layout"), (dict(requests=0), "requests")]:
        with pytest.raises((ValueError, TypeError), match=field):
            DemoConfig(**bad).validate()


# ----------------------------------------------------------------------------- demo: CLI
def summary_rows(output):
    """The demo's ``label  value`` lines as a dict (no label holds a double space)."""
    rows = {}
    for line in output.splitlines():
        label, sep, value = line.partition("  ")
        if sep:
            rows[label] = value.strip()
    return rows


def test_demo_on_cpu():
    res = invoke("demo", "--device", "cpu", "--requests", 10, "--seed", 5, "--layout", "vllm",
                 "--dtype", "bfloat16")
    assert res.exit_code == 0, res.output
    cfg = DemoConfig(requests=10, seed=5)
    reqs = make_requests(cfg, np.random.default_rng(5))
    assert res.output.startswith("backend  ")            # no progress bar label off a terminal
    rows = summary_rows(res.output)
    assert rows["backend"] == "numpy (reference)" and "tokens/s" in rows
    assert "pool occupancy" in rows
    assert rows["prefill tokens"] == str(sum(r.prompt_len for r in reqs))
    assert rows["decode tokens"] == str(sum(r.output_len - 1 for r in reqs))
    assert rows["requests finished"] == "10"
    assert rows["first step"].endswith(" s") and "kernel" not in res.output


def test_demo_bad_options_are_click_errors():
    res = invoke("demo", "--device", "cpu", "--num-blocks", 3)
    assert res.exit_code == 1
    assert res.output == ("Error: num_blocks: the longest request needs 23 blocks of 16 tokens, "
                          "got 3\n")
    res = invoke("demo", "--layout", "NDH")
    assert res.exit_code == 2


@pytest.mark.parametrize("model, layers", [("none", 1), ("tiny", 3)])
def test_demo_pool_larger_than_memory_is_refused_before_allocating(model, layers, monkeypatch):
    from cupaged.engine import demo
    monkeypatch.setattr(demo, "free_memory", lambda xp: (2**30, "available host memory"))
    res = invoke("demo", "--device", "cpu", "--model", model, "--layers", layers,
                 "--num-blocks", 100_000_000)
    per_block = 2 * 16 * 2 * 64 * 2 * layers                # K and V, fp16, 2 kv heads, d64
    assert res.exit_code == 1, res.output
    assert res.output == (f"Error: num_blocks: 100000000 blocks need "
                          f"{100_000_000 * per_block / 2**30:,.1f} GiB of K/V cache, but "
                          f"available host memory is 1.0 GiB: at most "
                          f"{2**30 // per_block:,} blocks of 16 tokens fit\n")


def test_free_host_memory_is_known(monkeypatch):
    from cupaged.engine import demo
    free, where = demo.free_memory(np)
    assert free > 2**20 and "host memory" in where
    monkeypatch.setattr(demo, "free_memory", lambda xp: (None, "host memory"))
    demo.check_run(DemoConfig(num_blocks=10**12), np)     # unknown: nothing to compare


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU")
def test_demo_gpu_without_device():
    res = invoke("demo", "--device", "gpu")
    assert res.exit_code == 1 and "no CUDA device" in res.output


def test_demo_tiny_model_on_cpu():
    res = invoke("demo", "--device", "cpu", "--model", "tiny", "--requests", 3, "--seed", 1,
                 "--max-prompt", 30, "--max-output", 5, "--num-q-heads", 4, "--layers", 1,
                 "--check")
    assert res.exit_code == 0, res.output
    out = res.output
    assert "tiny llama (1 layers, hidden 256, vocab 512, greedy)" in out
    assert "batch occupancy" in out and "requests running" in out and "tokens/s" in out
    assert summary_rows(out)["requests finished"] == "3"
    assert "nothing to compare on the CPU" in out


def test_demo_model_defaults_by_backend():
    from cupaged.engine.demo import resolve_model
    assert resolve_model(DemoConfig(), np) == "none"
    assert resolve_model(DemoConfig(), object()) == "tiny"
    assert resolve_model(DemoConfig(model="none"), object()) == "none"
    res = invoke("demo", "--device", "cpu", "--model", "big")
    assert res.exit_code == 2


def test_demo_fp8_cache_on_cpu():
    res = invoke("demo", "--device", "cpu", "--requests", 6, "--kv-dtype", "fp8_e4m3",
                 "--max-prompt", 60, "--max-output", 8)
    assert res.exit_code == 0, res.output
    rows = summary_rows(res.output)
    assert rows["requests finished"] == "6" and rows["model"].startswith("none")
    assert rows["kv cache"] == "fp8_e4m3 (1 byte; k_scale = v_scale = 0.03125), 0.8 MiB"
    with pytest.raises(ValueError, match="kv_dtype: expected one of"):
        DemoConfig(kv_dtype="fp8").validate()
    from cupaged.engine.demo import resolve_model
    assert resolve_model(DemoConfig(kv_dtype="fp8_e4m3"), object()) == "tiny"


def test_demo_tiny_model_fp8_cache_on_cpu():
    """The tiny model on an fp8 cache prints the cache and how its logits and greedy tokens
    compare with the same model on a cache of --dtype."""
    res = invoke("demo", "--device", "cpu", "--model", "tiny", "--kv-dtype", "fp8_e5m2",
                 "--dtype", "bfloat16", "--layout", "vllm", "--requests", 3, "--seed", 1,
                 "--max-prompt", 30, "--max-output", 5, "--num-q-heads", 4, "--layers", 1)
    assert res.exit_code == 0, res.output
    rows = summary_rows(res.output)
    assert rows["kv cache"] == ("fp8_e5m2 (1 byte; scales per layer and kv head, from the "
                                "weights), 0.8 MiB")
    diff, rel = rows["logits vs bfloat16 cache"].removeprefix("max |diff| ").split(", rel. ")
    assert 0 < float(diff) < 1 and 0 < float(rel) < 6e-2
    agree, total = rows["argmax vs bfloat16 cache"].split(" tokens agree")[0].split(" of ")
    assert int(total) == int(rows["decode tokens"]) + 3     # a token per prompt, per decode
    assert int(agree) >= int(total) - 1
    plain = summary_rows(invoke("demo", "--device", "cpu", "--model", "tiny", "--requests", 2,
                                "--max-prompt", 20, "--max-output", 4, "--layers", 1).output)
    assert plain["kv cache"] == "float16, 1.5 MiB" and "logits vs float16 cache" not in plain


def test_demo_fp8_cache_limits_on_the_gpu_are_refused_up_front():
    from cupaged.engine.demo import check_run
    gpu = object()  # any module but numpy runs the kernels
    with pytest.raises(ValueError, match="dtype: expected float16 or bfloat16 with kv_dtype "
                                         "'fp8_e4m3' on the GPU, got 'float32'"):
        check_run(DemoConfig(kv_dtype="fp8_e4m3", dtype="float32"), gpu)
    with pytest.raises(ValueError, match=r"head_dim: expected one of \(64, 128\) with kv_dtype "
                                         r"'fp8_e5m2' on the GPU, got 96"):
        check_run(DemoConfig(kv_dtype="fp8_e5m2", head_dim=96), gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype, dtype", [("fp8_e4m3", "bfloat16"), ("fp8_e5m2", "float16")])
def test_demo_fp8_cache_on_gpu_matches_reference(kv_dtype, dtype):
    res = invoke("demo", "--device", "gpu", "--model", "none", "--requests", 12, "--kv-dtype",
                 kv_dtype,
                 "--dtype", dtype, "--head-dim", 128, "--max-prompt", 120, "--max-output", 24,
                 "--check")
    assert res.exit_code == 0, res.output
    assert "cupy (CUDA kernels)" in res.output and "max rel. error vs reference" in res.output


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype, dtype, layout", [("fp8_e4m3", "bfloat16", "NHD"),
                                                     ("fp8_e5m2", "float16", "vllm")])
def test_demo_tiny_model_fp8_cache_on_gpu(kv_dtype, dtype, layout):
    """The default GPU model on an fp8 cache: checked against the NumPy model on the same
    format, and compared with a cache of --dtype on the GPU."""
    res = invoke("demo", "--device", "gpu", "--requests", 12, "--kv-dtype", kv_dtype,
                 "--dtype", dtype, "--layout", layout, "--max-prompt", 120, "--max-output", 24,
                 "--check")
    assert res.exit_code == 0, res.output
    rows = summary_rows(res.output)
    assert rows["model"].startswith("tiny llama") and rows["kv cache"].startswith(kv_dtype)
    assert "max rel. error vs reference" in rows and f"logits vs {dtype} cache" in rows


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND", "vllm"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_demo_on_gpu_matches_reference(layout, dtype):
    res = invoke("demo", "--device", "gpu", "--model", "none", "--requests", 12, "--layout",
                 layout, "--dtype", dtype, "--head-dim", 128 if dtype == "bfloat16" else 64,
                 "--max-prompt", 120, "--max-output", 24, "--check")
    assert res.exit_code == 0, res.output
    assert "cupy (CUDA kernels)" in res.output and "max rel. error vs reference" in res.output


@pytest.mark.gpu
@pytest.mark.parametrize("layout, dtype", [("NHD", "float16"), ("vllm", "bfloat16"),
                                           ("HND", "float32")])
def test_demo_tiny_model_on_gpu_matches_reference(layout, dtype):
    """The default GPU demo (tiny model) with its teacher-forced check against NumPy."""
    res = invoke("demo", "--device", "gpu", "--requests", 12, "--layout", layout, "--dtype",
                 dtype, "--max-prompt", 120, "--max-output", 24, "--check")
    assert res.exit_code == 0, res.output
    assert "tiny llama" in res.output and "max rel. error vs reference" in res.output
    matches, total = res.output.split("reference argmax matches")[1].split()[:3:2]
    # the reference's closest top-2 logits differ by ~2e-3 here: 16-bit runs may flip a tie
    assert int(total) > 12 and int(matches) >= int(total) - (0 if dtype == "float32" else 2)


# ----------------------------------------------------------------------------- scripts
def _script(*args, env=None, timeout=120):
    return subprocess.run(list(args), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("script", ["demo.py", "bench.py"])
def test_scripts_run_from_a_checkout(script):
    res = _script(sys.executable, f"scripts/{script}", "--help")
    assert res.returncode == 0 and "Usage" in res.stdout


@pytest.mark.parametrize("pack", [False, True], ids=["logs", "packed"])
def test_gpu_suite_degrades_gracefully(tmp_path, pack):
    """Tests of one file, a missing benchmark, no kernel check: summary last, status 0. The
    suite runs this interpreter (PYTHON), whatever python3 is first on PATH. With PACK=1 the
    output folder holds the summary and one archive of the logs."""
    stub = tmp_path / "bin" / "python3"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\necho 'not the interpreter of the tests' >&2\nexit 1\n")
    stub.chmod(0o755)
    out = tmp_path / "out"
    res = _script("bash", "scripts/gpu_suite.sh", env={
        "OUT": str(out), "TESTS": "tests/test_interop.py", "CHECK": "0",
        "BENCHES": "no_such_bench", "QUICK": "1", "PYTHON": sys.executable,
        "PACK": "1" if pack else "0", "PATH": f"{stub.parent}{os.pathsep}{os.environ['PATH']}"})
    assert res.returncode == 0, res.stdout + res.stderr
    summary = res.stdout.split("summary")[-1]
    assert "tests/test_interop.py" in summary and "no_such_bench  missing" in summary
    assert (out / "summary.txt").exists()
    if not pack:
        assert (out / "junit-gpu.xml").exists()
        return
    assert sorted(p.name for p in out.iterdir()) == ["logs.tgz", "summary.txt"]
    with tarfile.open(out / "logs.tgz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"junit-gpu.xml", "pytest.log", "summary.txt", "bench-no_such_bench.status"} <= names


def test_suite_summary_counts_outcomes(tmp_path):
    (tmp_path / "junit-gpu.xml").write_text("""<testsuites><testsuite>
      <testcase classname="tests.test_decode" name="a"/>
      <testcase classname="tests.test_decode" name="b"><failure message="x"/></testcase>
      <testcase classname="tests.test_decode.TestPlan" name="c"><skipped/></testcase>
      <testcase classname="tests.test_prefill" name="d"><error message="y"/></testcase>
      </testsuite></testsuites>""")
    (tmp_path / "sanitize-memcheck.log").write_text("...\n========= ERROR SUMMARY: 3 errors\n")
    (tmp_path / "check-kernels.log").write_text("table\n12 kernels compiled, 0 spilling\n")
    (tmp_path / "bench-cache.status").write_text("ok\n")
    (tmp_path / "bench-cache.json").write_text(json.dumps([{"layout": "NHD", "TB/s": 3.9}]))
    (tmp_path / "bench-rope.status").write_text("missing\n")
    res = _script(sys.executable, "scripts/suite_summary.py", str(tmp_path))
    lines = [line.split() for line in res.stdout.splitlines()]
    assert res.returncode == 0, res.stderr
    assert ["tests/test_decode.py", "1", "1", "0", "1"] in lines
    assert ["tests/test_prefill.py", "0", "0", "1", "0"] in lines
    assert ["total", "1", "1", "1", "1"] in lines
    assert "sanitize-memcheck: 3 errors reported" in res.stdout
    assert "check-kernels: 12 kernels compiled, 0 spilling" in res.stdout
    assert ["cache", "ok", "1", "row;", "TB/s", "3.9"] in lines and ["rope", "missing"] in lines


PLATFORMS = {"linux-x86_64": ("Linux", "x86_64"), "linux-aarch64": ("Linux", "aarch64"),
             "windows": ("Windows", "AMD64"), "macos-arm64": ("Darwin", "arm64"),
             "macos-x86_64": ("Darwin", "x86_64"), "linux-ppc64le": ("Linux", "ppc64le")}


def requirements(section, key):
    """``packaging`` Requirements of one setup.cfg list (install_requires, an extra)."""
    import configparser
    from packaging.requirements import Requirement
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return [Requirement(line) for line in cfg[section][key].strip().splitlines()]


def installed_on(reqs, platform):
    system, machine = PLATFORMS[platform]
    env = {"platform_system": system, "platform_machine": machine}
    return {r.name for r in reqs if r.marker is None or r.marker.evaluate(env)}


@pytest.mark.parametrize("platform", PLATFORMS)
def test_cupy_is_installed_only_where_it_has_wheels(platform):
    base = installed_on(requirements("options", "install_requires"), platform)
    gate = installed_on(requirements("options.extras_require", "gate"), platform)
    assert {"numpy", "ml_dtypes", "click"} <= base
    assert ("cupy-cuda12x" in base) is (platform in ("linux-x86_64", "linux-aarch64", "windows"))
    assert bool(gate) is (platform in ("linux-x86_64", "linux-aarch64"))
    test = installed_on(requirements("options.extras_require", "test"), platform)
    assert not any(name.startswith(("nvidia", "cupy")) for name in test)


def test_demo_without_cupy(tmp_path):
    """A CPU-only install (no CuPy, as on macOS) runs the demo on the NumPy reference."""
    for name in ("cupy", "cupy_backends"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise ImportError('no CuPy here')\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    res = _script(sys.executable, "-m", "cupaged.cli", "demo", "--requests", "3", env=env)
    assert res.returncode == 0, res.stderr
    assert "numpy (reference)" in res.stdout and res.stderr == ""


def test_readme_commands_and_ci_agree():
    """README's first block runs the demo, its second the tests, its third the compile gate;
    .ci/run runs the tests, then the gate."""
    readme = (ROOT / "README.md").read_text()
    first, second, third = (b.split("```")[0] for b in readme.split("```bash\n")[1:4])
    assert "pip install -e . && cupaged demo" in first
    assert "pip install -e '.[test]' && python3 -m pytest -q" in second
    gate = "check-kernels --arch sm_80 --arch sm_90"
    assert "pip install -e '.[gate]'" in third and gate in third
    ci = (ROOT / ".ci" / "run").read_text()
    tests = ci.index("python3 -m pip install -q -e '.[test]'\npython3 -m pytest -q\n")
    assert ci.index(f"python3 -m cupaged.cli {gate}") > tests
