"""Summarise a test suite's timeline (tests/conftest.py, ``$CUPAGED_TEST_TIMELINE``): per
process its start, collection and busy time against the wall time, its longest gaps
between tests, and tests that started and never ended (a hang, or the run's limit).

    CUPAGED_TEST_TIMELINE=$OUT/timeline.txt python3 -m pytest -n 15 ...
    python3 scripts/suite_timeline.py $OUT/timeline.txt

With ``--done``: the node ids of the tests the timelines record as passed, one a line, for
``pytest --skip-done FILE`` to resume a suite that a call's time limit stopped:

    python3 scripts/suite_timeline.py --done call1/timeline.txt > done.txt
"""
import sys
from pathlib import Path


def summarise(path):
    events = {}
    for line in Path(path).read_text().splitlines():
        t, name, e, *n = line.split(" ", 3)
        events.setdefault(name, []).append((float(t), e, n))
    t0 = min(ev[0][0] for ev in events.values() if ev)
    t1 = max(ev[-1][0] for ev in events.values() if ev)
    print(f"{len(events)} processes, wall {t1 - t0:.1f} s")
    total_busy = 0.0
    for name, ev in events.items():
        started, busy, gaps, last_end = {}, 0.0, [], None
        collected = next((t for t, e, _ in ev if e == "collected"), ev[0][0])
        for t, e, n in ev:
            node = n[0].strip() if n else ""
            if e == "start":
                if last_end is not None:
                    gaps.append((t - last_end, node))
                started[node] = t
            elif e == "end" and node in started:
                busy += t - started.pop(node)
                last_end = t
        total_busy += busy
        span = ev[-1][0] - ev[0][0]
        gaps.sort(reverse=True)
        print(f"{name}: from +{ev[0][0] - t0:.1f} s, collected in {collected - ev[0][0]:.1f} s, "
              f"busy {busy:.1f} of {span:.1f} s; longest gaps "
              + ", ".join(f"{g:.1f} s before {node}" for g, node in gaps[:2]))
        for node, t in started.items():
            print(f"    never ended: {node} (started +{t - t0:.1f} s)")
    print(f"busy {total_busy:.1f} of {len(events) * (t1 - t0):.1f} process-seconds")


def passed(paths):
    """Node ids of the tests that a "passed" event of any of the timelines records."""
    done = set()
    for path in paths:
        for line in Path(path).read_text().splitlines():
            parts = line.split(" ", 3)
            if len(parts) == 4 and parts[2] == "passed":
                done.add(parts[3].strip())
    return sorted(done)


if __name__ == "__main__":
    if sys.argv[1] == "--done":
        print("\n".join(passed(sys.argv[2:])))
    else:
        summarise(sys.argv[1])
