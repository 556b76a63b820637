"""The results page: benchmark rows (``cupaged bench NAME --json FILE``) as Markdown tables.

Each benchmark gets one table of its headline columns: what a row is (shape, variant), its
figure (time, rate) and its ratio to the ceiling or peer measured in the same run (``frac_*``,
``vs_*``), then whether it matched the float64 reference. Needs no GPU: it only reads JSON.
``scripts/results_page.py`` is the command line.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

# the columns a results table shows, in order, per benchmark (others: every column)
COLUMNS = {
    "decode": ["heads", "kv", "B", "L", "page", "layout", "path", "variant", "us", "TB/s",
               "frac_copy", "frac_read", "vs_bf16", "cudnn_TB/s", "vs_cudnn", "ok"],
    "prefill": ["op", "variant", "tile", "shape", "ms", "TFLOPs", "flash_TFLOPs",
                "cudnn_TFLOPs", "vs_flash", "vs_cudnn", "vs_default", "vs_ragged", "vs_bf16",
                "err_vs_bf16", "checked"],
    "cache": ["op", "variant", "shape", "ms", "TB/s", "frac_copy", "matches_ref"],
    "rope": ["op", "variant", "shape", "ms", "TBps", "frac_copy", "TFLOPs", "sink_overhead",
             "checked"],
    "sparse": ["S", "inputs", "budget", "B", "kept", "mass", "est_share", "sparse_ms", "bsr_ms",
               "quest_ms", "select_ms", "dense_ms", "vs_dense", "block_ratio", "step_vs_dense",
               "cudnn_ms", "vs_cudnn", "checked"],
    "overhead": ["op", "shape", "arrays", "host_us", "gpu_us", "graph_us", "vs_graph",
                 "peer_us", "TFLOP/s", "frac_copy"],
}
ORDER = ("decode", "prefill", "cache", "rope", "sparse", "overhead")
RATIO = re.compile(r"^(frac_|vs_)|ratio|overhead$")
CHECK = ("ok", "checked", "matches_ref")


def bench_name(path):
    """Benchmark name of a rows file: ``decode.json`` and ``bench-decode.json`` -> "decode"."""
    return Path(path).stem.removeprefix("bench-")


def load(paths):
    """``{name: rows}`` of the given JSON files (lists of row dicts), in ORDER first."""
    found = {}
    for path in paths:
        rows = json.loads(Path(path).read_text())
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{path}: expected a JSON list of rows (objects), as written "
                             f"by `cupaged bench NAME --json FILE`")
        found.setdefault(bench_name(path), []).extend(rows)
    order = [n for n in ORDER if n in found] + sorted(set(found) - set(ORDER))
    return {n: found[n] for n in order}


def columns(name, rows):
    """The columns of ``name``'s table that some row holds."""
    held = list(dict.fromkeys(k for r in rows for k in r))
    wanted = COLUMNS.get(name, held)
    return [c for c in wanted if any(r.get(c) is not None for r in rows)]


def cell(column, value):
    """One table cell: checks as ok / FAIL, ratios to 3 decimals, figures to 3-4 digits."""
    if value is None:
        return ""
    if column in CHECK or isinstance(value, bool):
        return "ok" if value else "**FAIL**"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if RATIO.search(column):
            return f"{value:.3f}"
        if value == 0 or abs(value) >= 100:
            return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.1f}"
        return f"{value:.3g}"
    return str(value).replace("|", "\\|")


def table(name, rows):
    """A Markdown table of ``rows`` of benchmark ``name``."""
    cols = columns(name, rows)
    lines = ["| " + " | ".join(c.replace("|", "\\|") for c in cols) + " |",
             "| " + " | ".join("---" for _ in cols) + " |"]
    lines += ["| " + " | ".join(cell(c, r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def summary(rows):
    """One line: rows, failed checks, and the range of each ratio column."""
    parts = [f"{len(rows)} rows"]
    failed = sum(any(r.get(c) is False for c in CHECK) for r in rows)
    parts.append(f"{failed} failed the reference check" if failed else "all checked ok")
    for c in dict.fromkeys(k for r in rows for k in r):
        if RATIO.search(c):
            vals = [r[c] for r in rows if isinstance(r.get(c), (int, float))
                    and not isinstance(r.get(c), bool) and not math.isnan(r[c])]
            if vals:
                parts.append(f"{c} {min(vals):.3f}-{max(vals):.3f}")
    return "; ".join(parts)


def _default(row, variant):
    """Whether ``row`` is the ragged ``varlen`` row of the kernel "auto" launches: on the
    mma.sync kernel (``variant`` "mma": the tile, sweep and mixed rows) or on wgmma
    (``variant`` "wgmma")."""
    if row.get("op") != "varlen" or not str(row.get("tile", "")).endswith(" default"):
        return False
    return row.get("variant") == "wgmma" if variant == "wgmma" else row.get("variant") != "wgmma"


def peers(rows):
    """The prefill headline (issue 20's table): per problem shape, TFLOP/s of the wgmma and the
    mma.sync kernels "auto" launches, of torch SDPA's flash and cuDNN backends in the same
    run, and the wgmma kernel's ratio to each peer; then the score options' cost (the wgmma
    kernel with a soft-cap, ALiBi or sinks against the plain one). Rows the run lacks stay
    empty; None without any default row."""
    shapes = {}
    for r in rows:
        for variant in ("mma", "wgmma"):
            if _default(r, variant):
                shapes.setdefault(r["shape"], {})[variant] = r
    if not shapes:
        return None
    cols = ["shape", "wgmma TFLOP/s", "mma.sync TFLOP/s", "flash TFLOP/s", "cuDNN TFLOP/s",
            "wgmma vs flash", "wgmma vs cuDNN"]
    lines = ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    for shape, got in shapes.items():
        mma, wgmma = got.get("mma", {}), got.get("wgmma", {})
        ours, flash, cudnn = wgmma.get("TFLOPs"), mma.get("flash_TFLOPs"), mma.get("cudnn_TFLOPs")
        ratio = lambda peer: None if ours is None or not peer else ours / peer  # noqa: E731
        cells = [shape, cell("TFLOPs", ours), cell("TFLOPs", mma.get("TFLOPs")),
                 cell("TFLOPs", flash), cell("TFLOPs", cudnn), cell("vs_flash", ratio(flash)),
                 cell("vs_cudnn", ratio(cudnn))]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    options = [r for r in rows if r.get("op") == "varlen"
               and str(r.get("variant", "")).startswith("wgmma ")
               and isinstance(r.get("vs_default"), (int, float))]
    if options:
        lines += ["", f"Cost of the score options on the wgmma kernel ({options[0]['shape']}): "
                  + ", ".join(f"{r['variant'].removeprefix('wgmma ')} "
                              f"{1 / r['vs_default'] - 1:+.1%}" for r in options) + "."]
    return "\n".join(lines)


def page(benches, *, command, commit=None, date=None, machine=None):
    """The whole results page (Markdown) of ``{name: rows}``."""
    meta = ", ".join(x for x in (machine, date, f"commit {commit}" if commit else None) if x)
    out = ["# Results", "",
           f"Generated by `{command}` from the rows of `cupaged bench NAME --json FILE`; do "
           "not edit by hand. Ratios (`frac_*`, `vs_*`) are to the ceiling or peer measured in "
           "the same run; how each figure is taken, and the history of every kernel, is in "
           "`benchmarks/NOTES.md`.", ""]
    if meta:
        out += [f"Run: {meta}.", ""]
    for name, rows in benches.items():
        out += [f"## {name} (`cupaged bench {name}`)", "", summary(rows) + ".", ""]
        headline = peers(rows) if name == "prefill" else None
        if headline:
            out += ["Against the peers (the kernels \"auto\" launches; ratios of the wgmma one):",
                    "", headline, "", "Every row:", ""]
        out += [table(name, rows), ""]
    return "\n".join(out)
