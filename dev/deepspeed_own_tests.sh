#!/usr/bin/env bash
# DeepSpeed's own checkpoint unit tests (tests/unit/checkpoint of a DeepSpeed checkout) on the
# CPU accelerator with gloo, run twice: every engine they build saving and loading through
# ckptio's checkpoint engine (SWAP=ckptio), then through DeepSpeed's own (SWAP=torch); the
# shim is dev/deepspeed_own_conftest.py (a pytest plugin: nothing is copied into the checkout).
#
#     DEEPSPEED_SRC=~/src/DeepSpeed dev/deepspeed_own_tests.sh            # the files below
#     DEEPSPEED_SRC=~/src/DeepSpeed dev/deepspeed_own_tests.sh unit/checkpoint/test_sparse.py
#     SWAPS=ckptio DEEPSPEED_SRC=... dev/deepspeed_own_tests.sh           # one engine only
#
# DEEPSPEED_SRC: a folder holding DeepSpeed's tests/ (a git checkout; PyPI's sdist has no
# tests). Run here with tag v0.19.5's tests against the installed DeepSpeed 0.19.8
# (docs/guides/deepspeed.md, "DeepSpeed's own checkpoint tests"). PYTHON: the interpreter with
# DeepSpeed and ckptio's dependencies (default: .venv/bin/python, else python). Each file runs
# in its own pytest (-n 0: DeepSpeed's harness forks its ranks itself); LOGS (default a temp
# folder) keeps each run's output; the summary prints each test's outcome with both engines,
# and the tests whose outcome differs.
set -euo pipefail
cd "$(dirname "$0")/.."
src=${DEEPSPEED_SRC:?set DEEPSPEED_SRC to a DeepSpeed checkout (its tests/ folder is used)}
python=${PYTHON:-$([ -x .venv/bin/python ] && echo "$PWD/.venv/bin/python" || echo python)}
logs=${LOGS:-$(mktemp -d)}
mkdir -p "$logs"
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
  files=(unit/checkpoint/test_latest_checkpoint.py unit/checkpoint/test_tag_validation.py
         unit/checkpoint/test_lr_scheduler.py unit/checkpoint/test_other_optimizer.py
         unit/checkpoint/test_sparse.py unit/checkpoint/test_shared_weights.py
         unit/checkpoint/test_convert_checkpoint.py unit/checkpoint/test_zero_optimizer.py
         unit/checkpoint/test_pipeline.py unit/checkpoint/test_moe_checkpoint.py
         unit/checkpoint/test_mics_optimizer.py unit/checkpoint/test_reshape_checkpoint.py
         unit/checkpoint/test_autotp_uc_checkpoint.py
         # 144 variants (dtype x stage x sub-group x optimizer x 2/4 ranks), each converting
         # with ds_to_universal (which torch.loads the files): fp32 with optimizer states, ZeRO 1 and 3
         "unit/checkpoint/test_universal_checkpoint.py::TestZeROUniversalCheckpointDP::test_dp_world_size_2to2[-1-False-True-1-dtype2]"
         "unit/checkpoint/test_universal_checkpoint.py::TestZeROUniversalCheckpointDP::test_dp_world_size_2to2[-1-False-True-3-dtype2]")
fi
export DS_ACCELERATOR=cpu DS_UNITTEST_TIMEOUT=${DS_UNITTEST_TIMEOUT:-300}
for swap in ${SWAPS:-ckptio torch}; do
  for f in "${files[@]}"; do
    log="$logs/$swap.$(basename "${f%%::*}" .py).log"
    [ "$f" != "${f%%::*}" ] && log="${log%.log}.$(echo "${f#*::}" | md5sum | cut -c1-8).log"
    echo "+ SWAP=$swap $f"
    (cd "$src/tests" && SWAP=$swap PYTHONPATH=$OLDPWD:$OLDPWD/dev:$src/tests \
      "$python" -m pytest -p deepspeed_own_conftest -p no:cacheprovider -q --tb=short -rA \
      "$f" >"$log" 2>&1) || true
    sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -E "^=+ .*(passed|failed|skipped|error).* in " || tail -3 "$log"
  done
done
echo "+ outcomes (logs in $logs)"
"$python" - "$logs" <<'EOF'
import collections, pathlib, re, sys
seen = collections.defaultdict(dict)
for log in sorted(pathlib.Path(sys.argv[1]).glob("*.log")):
    swap = log.name.split(".")[0]
    for line in re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace")).splitlines():
        m = re.search(r"(unit/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", line)
        if m:  # the verbose line of each test (DeepSpeed's conftest sets verbose)
            seen[m.group(1)].setdefault(swap, m.group(2))
per_file = collections.Counter()
for test, by in sorted(seen.items()):
    per_file[(test.split("::")[0], by.get("ckptio", "-"), by.get("torch", "-"))] += 1
print(f"{'file':60} {'ckptio':8} {'torch':8} tests")
for (name, c, t), n in sorted(per_file.items()):
    print(f"{name:60} {c:8} {t:8} {n}")
print("+ differing:")
for test, by in sorted(seen.items()):
    if by.get("ckptio") != by.get("torch"):
        print(f"  {test}: ckptio {by.get('ckptio', '-')}, torch {by.get('torch', '-')}")
EOF
