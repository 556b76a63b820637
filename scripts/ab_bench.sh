#!/usr/bin/env bash
# Same-run A/B of one benchmark between two checkouts, e.g. an earlier commit's worktree
# carried to the GPU machine beside this one: the benchmark runs ROUNDS times (default 2),
# alternately in A and in B, each table headed by its tree, so that both see the same
# machine, clocks and neighbours.
#
#   git worktree add .ab/old <rev>      # once, here; keep .ab/ out of git (.git/info/exclude)
#   scripts/ab_bench.sh .ab/old . decode --quick      # on the GPU machine (carry .ab)
set -u
if [ $# -lt 3 ]; then
  echo "usage: $0 TREE_A TREE_B BENCH [ARGS...]" >&2
  exit 2
fi
a=$1 b=$2
shift 2
for round in $(seq "${ROUNDS:-2}"); do
  for tree in "$a" "$b"; do
    echo "== $tree (round $round)"
    (cd "$tree" && PYTHONPATH="$PWD" "${PYTHON:-python3}" -m cupaged.cli bench "$@") || exit 1
  done
done
