#!/bin/bash
# Interleaved before/after of dev/restore_profile.py: dev/restore_compare.sh BEFORE_DIR REPS
# (BEFORE_DIR holds an older ckptio/ package; this worktree is "after"). One JSON line per run.
before=$1; reps=${2:-5}; here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-/work/main/.venv/bin/python}
for rep in $(seq "$reps"); do
  for side in before after; do
    dir=$here; [ "$side" = before ] && dir=$before
    for what in mgr big mlp small-unprepared; do
      echo "{\"side\": \"$side\", \"what\": \"$what\", \"r\": $(PYTHONPATH=$dir $py "$here/dev/restore_profile.py" run $what | tail -1)}"
    done
  done
  for what in memcpy-big memcpy-mlp; do
    echo "{\"side\": \"-\", \"what\": \"$what\", \"r\": $(PYTHONPATH=$here $py "$here/dev/restore_profile.py" run $what | tail -1)}"
  done
done
