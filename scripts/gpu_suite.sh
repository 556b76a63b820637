#!/usr/bin/env bash
# GPU suite for a CUDA machine: the GPU tests (optionally under compute-sanitizer), the
# kernel compile report for the local GPU, and the benchmarks. Logs go to $OUT (with PACK=1
# to a scratch folder, packed into $OUT/logs.tgz after every step); a short summary
# (pass/fail/skip per test file, sanitizer errors, spills, bench headlines) is printed last
# and saved as $OUT/summary.txt. Needs no install: runs `$PYTHON -m cupaged.cli` from this
# checkout.
#
#   OUT=/tmp/out scripts/gpu_suite.sh
#   QUICK=1 TESTS="tests/test_decode.py" BENCHES="decode" scripts/gpu_suite.sh
#   RUN_TESTS=0 CHECK=0 BENCHES= SANITIZE=1 scripts/gpu_suite.sh    # sanitizers only
#
# Environment (all optional):
#   PYTHON           the interpreter (default: python3 on PATH), e.g. .venv/bin/python for a
#                    virtual environment that is not activated
#   OUT              output directory (default: $TMPDIR/cupaged-gpu-suite)
#   PACK=1           leave two files in $OUT: logs.tgz (every log so far, re-packed after each
#                    step, so a call stopped at its time limit still returns them) and
#                    summary.txt (for a device tool that returns only a few files)
#   TESTS            pytest paths or node ids (default: tests)
#   PYTEST_ARGS      extra pytest arguments, e.g. "-x -k decode", or "--shard 1/2" (half
#                    the tests, each by its node id; then "--shard 2/2": the suite in two calls),
#                    or "--skip-done done.txt" (the tests a stopped call's timeline records as
#                    passed: scripts/suite_timeline.py --done timeline.txt > done.txt)
#   RUN_TESTS=0      skip the plain GPU test run
#   SANITIZE=1       also run SANITIZE_TESTS (default: $TESTS) under compute-sanitizer
#                    memcheck and RACECHECK_TESTS (default: the decode and prefill tests)
#                    under racecheck, with CuPy's and torch's memory pools off
#   SANITIZE_ARGS    extra pytest arguments for the sanitizer runs only, e.g. "-k 'not 2_31'"
#   SANITIZER        compute-sanitizer binary (default: PATH, then /usr/local/cuda/bin)
#   CHECK=0          skip `cupaged check-kernels` (local architecture)
#   BENCHES          benchmark names (default: "decode prefill cache sparse rope"; set
#                    empty for none); missing modules are reported, not failed
#   QUICK=1          pass --quick to the benchmarks
#   TEST_TIMEOUT, SANITIZE_TIMEOUT, BENCH_TIMEOUT   seconds per step (default 900, 1800, 600)
# Exit status: 1 if a test, a sanitizer run, the kernel check or a present benchmark failed.
set -u
PYTHON=${PYTHON:-python3}
OUT=${OUT:-${TMPDIR:-/tmp}/cupaged-gpu-suite}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)   # absolute: the suite runs from the repo root
LOGS=$OUT
[ "${PACK:-0}" = 1 ] && LOGS=$(mktemp -d)
# pack: with PACK=1, every log so far into $OUT/logs.tgz (also every minute meanwhile, so
# that a call killed mid-step still returns the step's log so far)
pack() {
  [ "$LOGS" = "$OUT" ] && return 0
  local part="$OUT/.logs.tgz.$BASHPID"  # one per packer: the background one may overlap
  tar czf "$part" -C "$LOGS" . 2>/dev/null && mv -f "$part" "$OUT/logs.tgz"
  return 0
}
if [ "$LOGS" != "$OUT" ]; then
  # not holding the caller's output open; its sleep ends with it
  ( trap 'kill $nap 2>/dev/null; exit 0' TERM
    while :; do sleep 60 & nap=$!; wait $nap; pack; done ) >/dev/null 2>&1 &
  packer=$!
  trap 'kill $packer 2>/dev/null' EXIT
fi
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
BENCHES=${BENCHES-decode prefill cache sparse rope overhead}
quick_flag=""
[ "${QUICK:-0}" = 1 ] && quick_flag=--quick
# word lists as arrays, shell quoting honoured: PYTEST_ARGS="-k 'decode and not slow'"
eval "tests=(${TESTS:-tests})"
eval "pytest_args=(${PYTEST_ARGS:-})"
eval "sanitize_args=(${SANITIZE_ARGS:-})"
status=0

# run LOG TIMEOUT CMD...: CMD's output to LOG (and the terminal), killed after TIMEOUT s
run() {
  local log=$1 limit=$2
  shift 2
  echo "+ $*" | tee "$log"
  timeout -s INT -k 30 "$limit" "$@" 2>&1 | tee -a "$log"
  return "${PIPESTATUS[0]}"
}

"$PYTHON" -m cupaged.cli info > "$LOGS/info.txt" 2>&1
cat "$LOGS/info.txt"

if [ "${RUN_TESTS:-1}" != 0 ]; then
  rm -f "$LOGS/timeline.txt"
  CUPAGED_TEST_TIMELINE="$LOGS/timeline.txt" run "$LOGS/pytest.log" "${TEST_TIMEOUT:-900}" \
    "$PYTHON" -m pytest -m gpu -q -rfE --durations=30 --junitxml="$LOGS/junit-gpu.xml" \
    "${pytest_args[@]}" "${tests[@]}" || status=1
  "$PYTHON" scripts/suite_timeline.py "$LOGS/timeline.txt" > "$LOGS/timeline-summary.txt" 2>&1
  pack
fi

if [ "${SANITIZE:-0}" = 1 ]; then
  sanitizer=${SANITIZER:-$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)}
  if [ -n "$sanitizer" ]; then
    racecheck_default=$(ls tests/test_decode.py tests/test_prefill.py 2>/dev/null | tr '\n' ' ')
    for tool in memcheck racecheck; do
      if [ $tool = memcheck ]; then eval "files=(${SANITIZE_TESTS:-${TESTS:-tests}})"
      else eval "files=(${RACECHECK_TESTS:-$racecheck_default})"; fi
      [ ${#files[@]} -gt 0 ] || continue
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 run "$LOGS/sanitize-$tool.log" "${SANITIZE_TIMEOUT:-1800}" \
        "$sanitizer" --tool $tool --error-exitcode 99 \
        "$PYTHON" -m pytest -m gpu -q -p sanitize_plugin --junitxml="$LOGS/junit-$tool.xml" \
        "${pytest_args[@]}" "${sanitize_args[@]}" "${files[@]}" || status=1
      pack
    done
  else
    echo "compute-sanitizer not found (PATH, /usr/local/cuda/bin, \$SANITIZER)" \
      | tee "$LOGS/sanitize-missing.log"
    status=1
  fi
fi

if [ "${CHECK:-1}" != 0 ]; then
  run "$LOGS/check-kernels.log" 900 "$PYTHON" -m cupaged.cli check-kernels --table || status=1
fi

for name in $BENCHES; do
  if ! "$PYTHON" -c "import importlib.util, sys; \
sys.exit(importlib.util.find_spec('cupaged.bench.$name') is None)" 2>/dev/null; then
    echo "missing" > "$LOGS/bench-$name.status"
    continue
  fi
  # shellcheck disable=SC2086
  if run "$LOGS/bench-$name.log" "${BENCH_TIMEOUT:-600}" "$PYTHON" -m cupaged.cli bench "$name" \
       $quick_flag --json "$LOGS/bench-$name.json"; then
    echo "ok" > "$LOGS/bench-$name.status"
  else
    echo "failed (exit $?, see bench-$name.log)" > "$LOGS/bench-$name.status"
    status=1
  fi
  pack
done

echo
echo "================================ summary ================================"
"$PYTHON" scripts/suite_summary.py "$LOGS" | tee "$LOGS/summary.txt"
[ "$LOGS" = "$OUT" ] || cp "$LOGS/summary.txt" "$OUT/summary.txt"
pack
exit $status
