"""Write docs/results.md from benchmark rows: the JSON files of ``cupaged bench NAME --json``.

    OUT=/tmp/gpu scripts/gpu_suite.sh                   # writes $OUT/bench-NAME.json
    python3 scripts/results_page.py /tmp/gpu/bench-*.json --machine "1x H200"

Each file's name gives its benchmark (``decode.json`` or ``bench-decode.json``). Needs no GPU.
"""
from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cupaged.bench import report  # noqa: E402


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--out", type=click.Path(dir_okay=False), default=str(ROOT / "docs" / "results.md"),
              show_default=True, help="The page to write ('-': stdout).")
@click.option("--commit", default=None, help="Commit the rows were measured at (default: HEAD).")
@click.option("--date", default=None, help="Date of the run (default: today).")
@click.option("--machine", default=None, help="The GPU and versions, e.g. '1x H200, CuPy 14.2'.")
def main(files, out, commit, date, machine):
    """Turn benchmark JSON FILES into the results page."""
    try:
        benches = report.load(files)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    text = report.page(benches, command="python3 scripts/results_page.py", machine=machine,
                       commit=commit or _commit(),
                       date=date or datetime.date.today().isoformat())
    if out == "-":
        click.echo(text, nl=False)
    else:
        Path(out).write_text(text)
        click.echo(f"wrote {out}: {', '.join(f'{n} ({len(r)} rows)' for n, r in benches.items())}")


if __name__ == "__main__":
    main()
