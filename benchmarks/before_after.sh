#!/usr/bin/env bash
# Issue 12 (restructuring): the save-load and training benchmarks on the code before it and
# after it, back to back in one run (docs/BENCH_RESTRUCTURE.md). BEFORE and AFTER are
# worktrees: the code before ran its benchmarks as ckptio.bench.*, after as benchmarks.*.
#   git worktree add /tmp/before 04cdd5b && git worktree add /tmp/after 82502c4
#   bash benchmarks/before_after.sh [/tmp/before] [/tmp/after] [/tmp/ba2]
set -euo pipefail
BEFORE=${1:-/tmp/before} AFTER=${2:-/tmp/after} OUT=${3:-/tmp/ba2}
PY=${PY:-$(pwd)/.venv/bin/python}
mkdir -p "$OUT"
run() {  # side, benchmark, output name, arguments...
  local side=$1 bench=$2 name=$3; shift 3
  local root=$AFTER mod=benchmarks
  if [ "$side" = before ]; then root=$BEFORE; mod=ckptio.bench; fi
  (cd "$root" && PYTHONPATH="$root" "$PY" -m "$mod.$bench" "$@" \
     --json "$OUT/$name.json" --markdown "$OUT/$name.md")
}
for round in 1 2 3; do
  for side in before after; do
    run $side save_load "save_load_${side}_$round" --gb 1 --reps 3 --engines torch_save,ckptio \
      --dir /work/bench-data
  done
done
for side in before after; do
  run $side train "train_$side" --gb 0.5 --steps 30 --every 5 --reps 3 \
    --engines none,ckptio_eager,ckptio_lazy --dir /work/bench-train
done
