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


PEER_ROWS = [
    {"op": "varlen", "variant": "tiles", "tile": "4w x32r n64 s2 2cta default",
     "shape": "B2 S8192 H32 d128 causal", "TFLOPs": 316.7, "flash_TFLOPs": 332.8,
     "cudnn_TFLOPs": 622.7},
    {"op": "varlen", "variant": "tiles", "tile": "4w x32r n64 s1 2cta",
     "shape": "B2 S8192 H32 d128 causal", "TFLOPs": 311.4},
    {"op": "varlen", "variant": "wgmma", "tile": "ws 1+2wg x64r n128 s2 tma",
     "shape": "B2 S8192 H32 d128 causal", "TFLOPs": 560.0},
    {"op": "varlen", "variant": "wgmma", "tile": "ws 1+2wg x64r n128 s3 tma default",
     "shape": "B2 S8192 H32 d128 causal", "TFLOPs": 551.9},
    {"op": "paged", "variant": "wgmma NHD page16", "tile": "ws 1+2wg x64r n128 s3 tma",
     "shape": "B2 S8192 H32 d128 causal", "TFLOPs": 473.2, "vs_ragged": 0.857},
    {"op": "varlen", "variant": "wgmma soft-cap", "tile": "ws 1+2wg x64r n128 s3 tma",
     "shape": "B2 S8192 H32 d128 causal", "TFLOPs": 437.6, "vs_default": 0.8},
    {"op": "varlen", "variant": "wgmma sinks", "tile": "ws 1+2wg x64r n128 s3 tma",
     "shape": "B2 S8192 H32 d128 causal", "TFLOPs": 549.8, "vs_default": 1.0},
    {"op": "varlen", "variant": "tiles", "tile": "4w x32r n64 s2 2cta default",
     "shape": "B2 S8192 H32 d96 causal", "TFLOPs": 273.8},
]


def test_peers_table_takes_the_default_rows_and_the_option_costs():
    text = report.peers(PEER_ROWS)
    lines = text.splitlines()
    assert lines[0] == ("| shape | wgmma TFLOP/s | mma.sync TFLOP/s | flash TFLOP/s | cuDNN TFLOP/s "
                        "| wgmma vs flash | wgmma vs cuDNN |")
    # the wgmma default row (not the faster 2-stage variant), ratios to the peers of the run
    assert lines[2] == ("| B2 S8192 H32 d128 causal | 551.9 | 316.7 | 332.8 | 622.7 | "
                        f"{551.9 / 332.8:.3f} | {551.9 / 622.7:.3f} |")
    assert lines[3] == "| B2 S8192 H32 d96 causal |  | 273.8 |  |  |  |  |"   # no wgmma row, no peers
    assert lines[-1] == ("Cost of the score options on the wgmma kernel (B2 S8192 H32 d128 causal): "
                         "soft-cap +25.0%, sinks +0.0%.")
    assert report.peers([r for r in PEER_ROWS if "default" not in r["tile"]]) is None


def test_page_shows_the_prefill_peers_before_its_rows():
    text = report.page({"prefill": PEER_ROWS}, command="x")
    assert text.index("Against the peers") < text.index("| wgmma vs cuDNN |") < text.index("Every row:")
    assert "Against the peers" not in report.page({"decode": [{"us": 1.0}]}, command="x")


def test_sparse_table_reports_the_kept_fraction_mass_and_block_ratio():
    rows = [{"S": 131072, "inputs": "random", "budget": "fixed 1000/6096", "kept": 0.97,
             "mass": 0.99, "est_share": 0.05, "sparse_ms": 250.0, "cudnn_ms": 252.0,
             "vs_cudnn": 1.008, "checked": True, "kernel_ms": 240.0},
            {"S": 8192, "budget": "bsr", "B": 4, "kept": 0.1, "bsr_ms": 1.4, "dense_ms": 4.0,
             "vs_dense": 2.86, "block_ratio": 0.286}]
    header = report.table("sparse", rows).splitlines()[0]
    assert header == ("| S | inputs | budget | B | kept | mass | est_share | sparse_ms | bsr_ms | "
                      "dense_ms | vs_dense | block_ratio | cudnn_ms | vs_cudnn | checked |")
