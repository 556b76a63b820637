"""scripts/suite_timeline.py: a suite's timeline (tests/conftest.py) summarised."""
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import suite_timeline  # noqa: E402


def test_busy_time_gaps_and_tests_that_never_ended(tmp_path, capsys):
    path = tmp_path / "timeline.txt"
    path.write_text("\n".join([
        "100.0 gw0 session ", "104.0 gw0 collected ",
        "104.0 gw0 start t.py::a", "105.5 gw0 end t.py::a",
        "108.5 gw0 start t.py::b[1]",
        "101.0 gw1 session ", "102.0 gw1 collected ",
        "102.0 gw1 start t.py::c", "110.0 gw1 end t.py::c"]) + "\n")
    suite_timeline.summarise(path)
    out = capsys.readouterr().out
    assert "2 processes, wall 10.0 s" in out
    assert "gw0: from +0.0 s, collected in 4.0 s, busy 1.5 of 8.5 s; longest gaps 3.0 s before t.py::b[1]" in out
    assert "never ended: t.py::b[1] (started +8.5 s)" in out
    assert "gw1: from +1.0 s, collected in 1.0 s, busy 8.0 of 9.0 s" in out
    assert "busy 9.5 of 20.0 process-seconds" in out


def test_conftest_writes_the_timeline(tmp_path):
    """The hooks append session, collection and per-test lines for this process."""
    path = tmp_path / "t.txt"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "CUPAGED_TEST_TIMELINE": str(path)}
    env.pop("PYTEST_XDIST_WORKER", None)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "tests/test_shard.py"], cwd=root, env=env, check=True, capture_output=True)
    events = [line.split(" ", 3) for line in path.read_text().splitlines()]
    assert [e[2] for e in events[:2]] == ["session", "collected"]
    assert {e[1] for e in events} == {"main"}
    starts = [e[3] for e in events if e[2] == "start"]
    assert starts and starts == [e[3] for e in events if e[2] == "end"]


def test_passed_tests_resume_a_suite(tmp_path):
    """A run's passed tests (its timeline's "passed" events, --done) deselected by
    --skip-done leave exactly the others."""
    root = Path(__file__).resolve().parents[1]
    path = tmp_path / "t.txt"
    env = {**os.environ, "CUPAGED_TEST_TIMELINE": str(path)}
    env.pop("PYTEST_XDIST_WORKER", None)
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    subprocess.run(run + ["tests/test_shard.py", "-k", "partition"], cwd=root, env=env,
                   check=True, capture_output=True)
    done = suite_timeline.passed([path])
    assert done and all(n.startswith("tests/test_shard.py::") and "partition" in n for n in done)
    (tmp_path / "done.txt").write_text("\n".join(done) + "\n")
    out = subprocess.run(run + ["--collect-only", "--skip-done", str(tmp_path / "done.txt"),
                                "tests/test_shard.py"], cwd=root, env=env, check=True,
                         capture_output=True, text=True).stdout
    left = [line for line in out.splitlines() if "::" in line]
    assert left and not set(left) & set(done)
    assert f"{len(done)} deselected" in out
