"""The ``cupaged`` command line: ``info``, ``check-kernels``, ``demo`` and ``bench``.

Each command is a thin wrapper over the library; library errors (bad arguments, failed
compiles) become ``click.ClickException`` (a message and exit status 1, no traceback).
Run it installed (``cupaged ...``) or from a checkout (``python3 -m cupaged.cli ...``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import platform
import re
import sys

import click

from . import __version__
from .core.arrays import cupy_module, gpu_available
from .bench.timing import format_table

BENCHES = ("decode", "prefill", "cache", "sparse", "rope", "overhead")
# benchmark columns worth a line in summaries: ratios to a ceiling or a peer, then rates
RATIO_COLUMN = re.compile(r"frac|vs_|ratio|speedup", re.IGNORECASE)
RATE_COLUMN = re.compile(r"TB/s|TBps|GB/s|TFLOP", re.IGNORECASE)


# ----------------------------------------------------------------------------- shared
def library_errors(fn):
    """Turn library errors into ``click.ClickException`` (exit status 1, one line).

    Argument and run-time errors print their message alone (it names the argument);
    import and OS errors keep their class name, which says what is missing.
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError, RuntimeError) as e:
            raise click.ClickException(str(e)) from e
        except (ImportError, OSError) as e:
            raise click.ClickException(f"{type(e).__name__}: {e}") from e
    return wrapper


@contextlib.contextmanager
def progress_bar(length, label):
    """Yield ``update(n)`` of a click progress bar drawn on stderr while stderr is a
    terminal; elsewhere (pipes, logs, tests) ``update`` does nothing and nothing is printed."""
    if not sys.stderr.isatty():
        yield lambda n=1: None
        return
    with click.progressbar(length=length, label=label, file=sys.stderr, show_pos=True) as bar:
        yield bar.update


def _archs(ctx, param, archs):
    """Validate ``--arch`` values up front (format, sm_80 or newer)."""
    from .core.compile import check_arch
    for arch in archs:
        try:
            check_arch(arch)
        except ValueError as e:
            raise click.BadParameter(str(e).removeprefix("arch: "), ctx, param) from None
    return archs


quick_option = click.option("--quick", is_flag=True, help="Small sizes and few repetitions.")
json_option = click.option("--json", "json_path", type=click.Path(dir_okay=False),
                           help="Also write the rows to this JSON file.")
device_option = click.option("--device", type=click.Choice(["auto", "cpu", "gpu"]),
                             default="auto", show_default=True,
                             help="gpu: CUDA kernels (CuPy); cpu: NumPy reference; "
                                  "auto: gpu when CuPy sees a device.")
arch_option = click.option("--arch", "archs", multiple=True, metavar="SM", callback=_archs,
                           help="Target architecture (repeatable), sm_80 or newer, e.g. "
                                "sm_80, sm_90. Default: the local GPU's, else sm_80 and sm_90.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cupaged")
def main():
    """Paged-attention kernels for LLM serving, compiled at run time by CuPy."""


# ----------------------------------------------------------------------------- info
def environment():
    """``(label, value)`` rows describing the installation and the GPU."""
    import ml_dtypes
    import numpy
    from .core import compile as _compile
    rows = [("cupaged", __version__), ("python", platform.python_version()),
            ("numpy", numpy.__version__), ("ml_dtypes", ml_dtypes.__version__)]
    cp = cupy_module()
    rows.append(("cupy", cp.__version__ if cp is not None else "not importable"))
    try:
        rows.append(("NVRTC", ".".join(map(str, _compile._nvrtc().getVersion()))))
    except Exception as e:  # no CuPy, or no NVRTC library
        rows.append(("NVRTC", f"unavailable ({type(e).__name__}: {e})"))
    rows.append(("CUDA include dir", _compile.cuda_include_dir() or "not found"))
    rows.append(("kernel cache dir", str(_compile.cache_dir())))
    if gpu_available():
        for i in range(cp.cuda.runtime.getDeviceCount()):
            props = cp.cuda.runtime.getDeviceProperties(i)
            cc = cp.cuda.Device(i).compute_capability
            rows.append((f"GPU {i}", f"{props['name'].decode()} (sm_{cc}, "
                                     f"{props['totalGlobalMem'] / 2**30:.0f} GiB)"))
        rows.append(("CUDA driver / runtime", f"{cp.cuda.runtime.driverGetVersion()} / "
                                              f"{cp.cuda.runtime.runtimeGetVersion()}"))
    else:
        rows.append(("GPU", "none (NumPy reference backend only)"))
    return rows


@main.command()
def info():
    """Versions, GPU, NVRTC and the kernel cache directory."""
    rows = environment()
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        click.echo(f"{label.ljust(width)}  {value}")


# ----------------------------------------------------------------------------- check-kernels
def default_archs():
    """The local GPU's architecture, else ``("sm_80", "sm_90")``."""
    if gpu_available():
        from .core.compile import device_arch
        return (device_arch(),)
    return ("sm_80", "sm_90")


def arch_line(arch, reports):
    """One line for the kernels of ``arch``: count, register range, spills, largest stack and
    static shared memory."""
    regs = [r.registers for r in reports]
    spilling = sum(r.spill_bytes > 0 for r in reports)
    return (f"{arch}: {len(reports)} kernels, registers {min(regs, default=0)}-"
            f"{max(regs, default=0)}, {spilling} spilling, stack up to "
            f"{max((r.stack_bytes for r in reports), default=0)} bytes, static smem up to "
            f"{max((r.smem_bytes for r in reports), default=0)} bytes")


@main.command("check-kernels")
@arch_option
@click.option("--jobs", type=int, default=None, help="Parallel NVRTC processes (default: CPUs).")
@click.option("--table", "full_table", is_flag=True,
              help="Print every kernel's row (default: only the kernels that spill).")
@json_option
@library_errors
def check_kernels(archs, jobs, full_table, json_path):
    """Compile every kernel specialisation with NVRTC; report registers, spills, stack, smem.

    Prints the kernels that spill (every kernel with --table), a line per architecture and
    the totals; --json saves every kernel's row. Shared memory is the static part only
    (dynamic shared memory is sized at launch). A progress bar goes to stderr on a terminal.

    Exits with status 1 on a compile error or when any kernel spills registers.
    """
    from .core import compile as _compile
    archs = archs or default_archs()
    reports = []
    with progress_bar(sum(_compile.kernel_count(a) for a in archs), "kernels") as update:
        for arch in archs:
            reports += sorted(_compile.check_kernels(arch, jobs=jobs, progress=update))
    rows = [{"kernel": r.expr, "arch": r.arch, "registers": r.registers,
             "spill bytes": r.spill_bytes, "stack bytes": r.stack_bytes,
             "static smem bytes": r.smem_bytes} for r in reports]
    if json_path:
        save_rows(rows, json_path)
    spilling = [r for r in reports if r.spill_bytes]
    shown = rows if full_table else [row for row in rows if row["spill bytes"]]
    if shown:
        click.echo(format_table(shown))
    for arch in dict.fromkeys(r.arch for r in reports):
        click.echo(arch_line(arch, [r for r in reports if r.arch == arch]))
    click.echo(f"{len(reports)} kernels compiled, {len(spilling)} spilling")
    if spilling:
        raise click.ClickException("register spills in: " + ", ".join(
            f"{r.expr} ({r.arch}, {r.spill_bytes} bytes)" for r in spilling))


# ----------------------------------------------------------------------------- demo
def _demo_options(fn):
    """One ``--option`` per DemoConfig field, typed and documented from the field."""
    from .engine.demo import DemoConfig
    for f in reversed(dataclasses.fields(DemoConfig)):
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(f.default, bool):
            decl, kind = (f"{flag}/--no-{f.name.replace('_', '-')}",), None
        else:
            choices = f.metadata["choices"]
            decl, kind = (flag,), (click.Choice(choices) if choices else type(f.default))
        fn = click.option(*decl, type=kind, default=f.default, show_default=True,
                          help=f.metadata["help"])(fn)
    return fn


@main.command()
@device_option
@_demo_options
@library_errors
def demo(device, **options):
    """Continuous batching over the paged cache: a tiny random-weight Llama-style model
    (or random q/k/v with --model none) serving random requests; greedy tokens. With
    --kv-dtype the cache is fp8, and the tiny model's logits and tokens are compared with
    the same model on a cache of --dtype."""
    from .engine.demo import (CHECK_TOLERANCE, DemoConfig, array_module_for, check_run,
        resolve_model, run_demo)
    cfg = DemoConfig(**options)
    xp = array_module_for(device)
    check_run(cfg, xp)  # bad options fail before the progress bar is drawn
    with progress_bar(cfg.requests, "requests") as update:
        stats = run_demo(cfg, xp, progress=update)
    rows = stats.summary(cfg)
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        click.echo(f"{label.ljust(width)}  {value}")
    tolerance = CHECK_TOLERANCE[cfg.dtype]
    if cfg.check and stats.max_rel_error is None:
        click.echo("check: nothing to compare on the CPU (the reference runs the demo)")
    elif cfg.check and stats.max_rel_error > tolerance:
        what = "logits" if resolve_model(cfg, xp) == "tiny" else "attention output"
        raise click.ClickException(f"kernel {what} differs from the reference: relative error "
                                   f"{stats.max_rel_error:.2e} > {tolerance:g}")


# ----------------------------------------------------------------------------- bench
def load_bench(name):
    """The module ``cupaged.bench.<name>``; ClickException if it does not exist."""
    module = f"cupaged.bench.{name}"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise click.ClickException(f"benchmark {name!r} is not available: {module} "
                                   "does not exist in this installation") from None


def run_bench(name, quick):
    """Rows (dicts) of ``cupaged.bench.<name>.run(quick)``; needs a CUDA device."""
    module = load_bench(name)
    if not gpu_available():
        raise click.ClickException(f"benchmark {name!r} needs a CUDA device (CuPy sees none)")
    return list(module.run(quick))


def columns_of(rows):
    """Every key of ``rows`` in first-seen order (rows of one benchmark may differ)."""
    return list(dict.fromkeys(k for r in rows for k in r))


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _numeric_columns(rows):
    """Columns whose values are numbers wherever they are set."""
    return [column for column in columns_of(rows)
            if any(_is_number(r.get(column)) for r in rows)
            and all(_is_number(r.get(column)) or r.get(column) is None for r in rows)]


def headline(rows, max_columns=4):
    """One line summarising benchmark rows: failed checks (boolean columns that are
    False somewhere), then the range of ratio columns, then of rate columns."""
    if not rows:
        return "no rows"
    parts = [f"{len(rows)} row{'s' * (len(rows) != 1)}"]
    for column in columns_of(rows):
        bad = sum(r.get(column) is False for r in rows)
        if bad:
            parts.append(f"{column} FALSE in {bad}")
    numeric = _numeric_columns(rows)
    picked = ([column for column in numeric if RATIO_COLUMN.search(column)]
              + [column for column in numeric if RATE_COLUMN.search(column)]) or numeric[-1:]
    for column in picked[:max_columns]:
        values = [r[column] for r in rows if _is_number(r.get(column))]
        lo, hi = min(values), max(values)
        parts.append(f"{column} {lo:.3g}" + ("" if lo == hi else f"..{hi:.3g}"))
    return "; ".join(parts)


def _jsonable(value):
    return value.item() if hasattr(value, "item") else str(value)


def save_rows(rows, path):
    """Write benchmark rows to ``path`` as JSON (NumPy scalars as numbers)."""
    with open(path, "w") as f:
        json.dump(rows, f, indent=1, default=_jsonable)


def plot_rows(rows, path, title, column=None):
    """Horizontal bar chart of one numeric column of ``rows`` (default: the last numeric)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.ClickException("--plot needs matplotlib (pip install matplotlib)") from None
    numeric = _numeric_columns(rows)
    if column is None and not numeric:
        raise click.ClickException("--plot: the rows have no numeric column")
    column = column or numeric[-1]
    if column not in numeric:
        raise click.ClickException(f"--plot-column: expected one of {numeric}, got {column!r}")
    labels = [" ".join(str(r[column]) for column in columns_of(rows)
                       if column not in numeric and isinstance(r.get(column), str)) for r in rows]
    fig, ax = plt.subplots(figsize=(8, 1 + 0.35 * len(rows)))
    ax.barh(range(len(rows)), [r.get(column) or 0.0 for r in rows])
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(column)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@main.command()
@click.argument("name", type=click.Choice(BENCHES))
@quick_option
@json_option
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="Also draw a bar chart to this image file (needs matplotlib).")
@click.option("--plot-column", default=None, help="Column to plot (default: last numeric).")
@library_errors
def bench(name, quick, json_path, plot_path, plot_column):
    """Time one op family on the GPU and print its table (module cupaged.bench.NAME)."""
    rows = run_bench(name, quick)
    click.echo(format_table(rows, columns_of(rows)))
    if json_path:
        save_rows(rows, json_path)
    if plot_path and rows:
        plot_rows(rows, plot_path, f"cupaged bench {name}", plot_column)


if __name__ == "__main__":
    main(prog_name="cupaged")
