#!/usr/bin/env python3
"""Run several benchmarks (default: every one that exists), save their rows, print tables.

    python3 scripts/bench.py decode prefill --quick --out "$OUT"

Each NAME is ``cupaged.bench.NAME.run(quick)``, as ``cupaged bench NAME``; a missing
module is reported and skipped. Needs a CUDA device.
"""
import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from cupaged.bench.timing import format_table  # noqa: E402
from cupaged.cli import (BENCHES, columns_of, headline, quick_option, run_bench,  # noqa: E402
                         save_rows)


@click.command()
@click.argument("names", nargs=-1, type=click.Choice(BENCHES))
@quick_option
@click.option("--out", type=click.Path(file_okay=False), help="Directory for NAME.json files.")
def main(names, quick, out):
    """Time the op families NAMES on the GPU; print one table each, then a summary."""
    summary = []
    for name in names or BENCHES:
        try:
            rows = run_bench(name, quick)
        except click.ClickException as e:
            summary.append({"bench": name, "result": f"skipped: {e.message}"})
            continue
        click.echo(f"== {name}\n{format_table(rows, columns_of(rows))}\n")
        summary.append({"bench": name, "result": headline(rows)})
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            save_rows(rows, Path(out) / f"{name}.json")
    click.echo(format_table(summary))


if __name__ == "__main__":
    main()
