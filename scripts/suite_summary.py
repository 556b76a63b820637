#!/usr/bin/env python3
"""Short summary of a ``scripts/gpu_suite.sh`` output directory (printed last by the suite).

    python3 scripts/suite_summary.py "$OUT"

Reads ``junit-*.xml`` (pass/fail/skip/error per test file), ``sanitize-*.log`` (the
compute-sanitizer error summary), ``check-kernels.log`` and ``bench-NAME.{status,json}``.
"""
import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from cupaged.bench.timing import format_table  # noqa: E402
from cupaged.cli import headline  # noqa: E402

OUTCOMES = ("passed", "failed", "error", "skipped")


def file_of(case):
    """``tests/test_x.py`` from a junit testcase's classname (``tests.test_x[.TestClass]``)."""
    parts = (case.get("classname") or case.get("name", "?")).split(".")
    for i, p in enumerate(parts):
        if p.startswith("test_"):
            return "/".join(parts[:i + 1]) + ".py"
    return ".".join(parts)


def outcome(case):
    for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
        if case.find(tag) is not None:
            return name
    return "passed"


def junit_rows(path):
    """Per-file outcome counts of one junit file, plus a total row."""
    counts = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        counts.setdefault(file_of(case), Counter())[outcome(case)] += 1
    rows = [{"file": f, **{o: c[o] for o in OUTCOMES}} for f, c in sorted(counts.items())]
    total = sum(counts.values(), Counter())
    return rows + [{"file": "total", **{o: total[o] for o in OUTCOMES}}]


def sanitizer_line(log):
    text = log.read_text(errors="replace")
    m = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    if m:
        return f"{log.stem}: {m[-1]} errors reported"
    last = (text.strip().splitlines() or ["(empty log)"])[-1]
    return f"{log.stem}: no error summary (cut short?); last line: {last}"


def bench_rows(out):
    rows = []
    for status in sorted(out.glob("bench-*.status")):
        name = status.stem[len("bench-"):]
        state = status.read_text().strip()
        data = out / f"bench-{name}.json"
        info = headline(json.loads(data.read_text())) if state == "ok" and data.exists() else ""
        rows.append({"bench": name, "status": state, "headline": info})
    return rows


@click.command()
@click.argument("out", type=click.Path(exists=True, file_okay=False, path_type=Path))
def main(out):
    """Print test counts, sanitizer results, the kernel check and benchmark headlines."""
    for junit in sorted(out.glob("junit-*.xml")):
        click.echo(f"== {junit.stem[len('junit-'):]} ({junit.name})")
        click.echo(format_table(junit_rows(junit)))
    for log in sorted(out.glob("sanitize-*.log")):
        click.echo("== " + sanitizer_line(log))
    check = out / "check-kernels.log"
    if check.exists():
        lines = check.read_text(errors="replace").strip().splitlines() or ["(empty)"]
        click.echo(f"== check-kernels: {lines[-1]}")
    benches = bench_rows(out)
    if benches:
        click.echo("== bench")
        click.echo(format_table(benches))


if __name__ == "__main__":
    main()
