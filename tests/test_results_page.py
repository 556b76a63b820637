"""The results page (cupaged.bench.report, scripts/results_page.py) from small row fixtures."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cupaged.bench import report

FIXTURES = Path(__file__).parent / "fixtures" / "bench"
ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "scripts" / "results_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_load_names_benchmarks_by_file_and_orders_them():
    benches = report.load([FIXTURES / "prefill.json", FIXTURES / "bench-decode.json"])
    assert list(benches) == ["decode", "prefill"]
    assert len(benches["decode"]) == 2 and len(benches["prefill"]) == 2


def test_table_keeps_headline_columns_and_formats_cells():
    rows = report.load([FIXTURES / "bench-decode.json"])["decode"]
    text = report.table("decode", rows)
    header, rule, first, second = text.splitlines()
    assert header == ("| heads | B | L | page | layout | path | variant | us | TB/s | "
                      "frac_copy | frac_read | cudnn_TB/s | vs_cudnn | ok |")
    assert rule.count("---") == 14
    assert "| 491.0 |" in first and "| 0.998 |" in first and first.endswith("| ok |")
    assert second.endswith("| **FAIL** |") and "|  |" in second   # no cuDNN figure
    assert "eager_us" not in header and "err" not in header


def test_unknown_benchmark_shows_every_column():
    assert report.columns("new", [{"a": 1, "b": None}, {"c": "x"}]) == ["a", "c"]


def test_summary_counts_failures_and_ratio_ranges():
    rows = report.load([FIXTURES / "bench-decode.json"])["decode"]
    line = report.summary(rows)
    assert "2 rows" in line and "1 failed the reference check" in line
    assert "frac_copy 0.180-1.056" in line and "vs_cudnn 0.998-0.998" in line


def test_load_refuses_what_is_not_rows(tmp_path):
    bad = tmp_path / "decode.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="expected a JSON list of rows"):
        report.load([bad])


def test_script_writes_the_page(tmp_path):
    out = tmp_path / "results.md"
    res = CliRunner().invoke(_script().main, [str(FIXTURES / "bench-decode.json"),
                                             str(FIXTURES / "prefill.json"), "--out", str(out),
                                             "--commit", "abc1234", "--date", "2026-12-01",
                                             "--machine", "1x H200"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert text.startswith("# Results\n")
    assert "`python3 scripts/results_page.py`" in text
    assert "Run: 1x H200, 2026-12-01, commit abc1234." in text
    assert text.index("## decode") < text.index("## prefill")
    assert "| 395.4 |" in text and "| 1.184 |" in text and "| 0.900 |" in text


def test_script_reports_bad_input(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    res = CliRunner().invoke(_script().main, [str(bad), "--out", "-"])
    assert res.exit_code == 1 and "expected a JSON list of rows" in res.output
