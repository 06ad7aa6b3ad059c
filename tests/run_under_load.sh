#!/usr/bin/env bash
# The whole test suite N times in a row (default 3) while a CPU hog keeps every core busy, as a
# busy CI machine would: the tests must assert behaviour, not speed. Stops at the first failing
# round. From a checkout with the test venv (README's second command):
#   bash tests/run_under_load.sh [ROUNDS] [pytest args...]
# Each round's output goes to $OUT (default: a new temporary directory), printed at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}; shift || true
OUT=${OUT:-$(mktemp -d)}
PY=${PY:-.venv/bin/python}
hogs=()
for _ in $(seq "$(nproc)"); do
  "$PY" -c 'while True: pass' & hogs+=($!)
done
trap 'kill "${hogs[@]}" 2>/dev/null' EXIT
status=0
for round in $(seq "$rounds"); do
  start=$(date +%s)
  "$PY" -m pytest -q -p no:cacheprovider "$@" > "$OUT/round-$round.log" 2>&1
  status=$?
  echo "round $round: exit $status in $(( $(date +%s) - start )) s under $(nproc) hogs:" \
       "$(tail -1 "$OUT/round-$round.log")"
  [ "$status" -eq 0 ] || break
done
echo "logs in $OUT"
exit "$status"
