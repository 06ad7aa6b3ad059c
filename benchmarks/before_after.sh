#!/usr/bin/env bash
# The save-load and training benchmarks on two revisions of the code, back to back in one run
# (docs/BENCH_RESTRUCTURE.md: issue 12's restructuring, 04cdd5b -> 82502c4; issue 25's storage
# contract: BEFORE_REV=340d718 AFTER_REV=<its commit>; issue 44's one manager: TIERS=1 adds the
# every-step tiered training loop, docs/BENCH_RESTRUCTURE.md). BEFORE and AFTER are worktrees; a
# revision with a benchmarks/ folder runs them as benchmarks.*, an older one as ckptio.bench.*.
# From a checkout; worktrees missing at BEFORE/AFTER are added (git worktree add --detach), by
# default in a new temporary directory, which also receives OUT (printed at the end):
#   bash benchmarks/before_after.sh [BEFORE] [AFTER] [OUT]
# The benchmarks' scratch data goes to this checkout's bench-data/ and bench-train/
# (git-ignored, on its disk); PY (default: this checkout's .venv) runs both sides.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TMP=""; if [ $# -lt 3 ]; then TMP=$(mktemp -d); fi
BEFORE=${1:-$TMP/before} AFTER=${2:-$TMP/after} OUT=${3:-$TMP/out}
PY=${PY:-$ROOT/.venv/bin/python}
[ -e "$BEFORE" ] || git -C "$ROOT" worktree add --detach "$BEFORE" "${BEFORE_REV:-04cdd5b}"
[ -e "$AFTER" ] || git -C "$ROOT" worktree add --detach "$AFTER" "${AFTER_REV:-82502c4}"
mkdir -p "$OUT"
run() {  # side, benchmark, output name, arguments...
  local side=$1 bench=$2 name=$3; shift 3
  local root=$AFTER mod=benchmarks
  if [ "$side" = before ]; then root=$BEFORE; fi
  [ -d "$root/benchmarks" ] || mod=ckptio.bench
  (cd "$root" && PYTHONPATH="$root" "$PY" -m "$mod.$bench" "$@" \
     --json "$OUT/$name.json" --markdown "$OUT/$name.md")
}
for round in $(seq 1 "${ROUNDS:-3}"); do
  for side in before after; do
    run $side save_load "save_load_${side}_$round" --gb 1 --reps 3 --engines torch_save,ckptio \
      --dir "$ROOT/bench-data"
  done
done
for side in before after; do
  run $side train "train_$side" --gb 0.5 --steps 30 --every 5 --reps 3 \
    --engines none,ckptio_eager,ckptio_lazy --dir "$ROOT/bench-train"
done
if [ "${TIERS:-0}" = 1 ]; then  # every step into host memory (shm://), drained every 10th to disk
  for side in before after; do
    run $side tiers "tiers_$side" --gb 0.1 --steps 40 --every 10 --reps 3 --kills 0 \
      --restores 0 --flat-saves 0 --engines none,tiers_eager,tiers_lazy --dir "$ROOT/bench-tiers"
  done
fi
echo "tables and JSON in $OUT (the committed ones: docs/results/restructure/); the worktrees" \
  "go with: git -C $ROOT worktree remove $BEFORE; git -C $ROOT worktree remove $AFTER" >&2
