#!/usr/bin/env bash
# Run tests/test_megatron.py (ckptio's Megatron-Core dist_checkpointing strategies) in a Python
# 3.12 venv that has megatron-core 0.19.2; CI's venv is Python 3.11, where megatron-core 0.19
# does not install and the test extra gives it 0.16.1 (docs/guides/megatron.md).
#
#     dev/megatron_tests.sh                      # the tests
#     dev/megatron_tests.sh -k kill              # pytest's arguments pass through
#     BENCH=1 dev/megatron_tests.sh              # also benchmarks/megatron_strategy.py
#     MEGATRON_LM=~/src/Megatron-LM dev/megatron_tests.sh   # also Megatron's own
#         test_serialization.py (tag core_v0.19.0) in one CPU process, with its default
#         strategies swapped for ckptio's (dev/megatron_own_conftest.py), then with torch_dist
#
# The venv is made once, outside the checkout (VENV, default ~/.cache/ckptio/venv-megatron),
# from a Python 3.12 (PYTHON312, default python3.12; pyenv's where it is not on PATH) with
# PyPI's torch (a CUDA build of about 5 GB; it runs on the CPU), megatron-core 0.19.2 and
# ckptio's runtime and test dependencies (pytest-xdist: pyproject's addopts), not ckptio
# itself: the tests import this checkout through PYTHONPATH. A pip constraint file capping
# torch (PIP_CONSTRAINT, or the machine's pip configuration) is lifted for this one install.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-$HOME/.cache/ckptio/venv-megatron}
python312=${PYTHON312:-}
if [ -z "$python312" ]; then  # a pyenv shim answers command -v and then refuses to run
  if python3.12 -c "" 2>/dev/null; then python312=python3.12
  else python312=$(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1); fi
fi
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import megatron.core, torch, xxhash, pytest, xdist, psutil" 2>/dev/null; then
  mkdir -p "$(dirname "$venv")"
  "$python312" -m venv "$venv"
  empty=$(mktemp)
  start=$(date +%s)
  PIP_CONSTRAINT=$empty "$venv/bin/pip" install -q "torch==2.13.0" "megatron-core==0.19.2" numpy psutil \
    xxhash tqdm pytest pytest-xdist
  rm -f "$empty"
  echo "+ installed torch and megatron-core in $venv in $(( $(date +%s) - start )) s"
fi
"$venv/bin/python" -c "import sys, torch, megatron.core as m; print('+ python', sys.version.split()[0], 'torch', torch.__version__, 'megatron-core', m.__version__)"
echo "+ PYTHONPATH=$PWD $venv/bin/python -m pytest -q -p no:cacheprovider tests/test_megatron.py $*"
PYTHONPATH=$PWD "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_megatron.py "$@"
if [ "${BENCH:-0}" = 1 ]; then
  PYTHONPATH=$PWD "$venv/bin/python" benchmarks/megatron_strategy.py
fi
if [ -n "${MEGATRON_LM:-}" ]; then
  own=$(mktemp -d)
  git -C "$MEGATRON_LM" archive core_v0.19.0 tests/__init__.py tests/unit_tests/__init__.py \
    tests/unit_tests/test_utilities.py tests/unit_tests/dist_checkpointing | tar x -C "$own"
  cp dev/megatron_own_conftest.py "$own/tests/unit_tests/conftest.py"
  for swap in ckptio torch_dist; do
    echo "+ Megatron's test_serialization.py, default strategies: $swap"
    (cd "$own" && SWAP=$swap PYTHONPATH=$OLDPWD:$own WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 \
      "$venv/bin/python" -m pytest -q -p no:cacheprovider --tb=no -rp \
      tests/unit_tests/dist_checkpointing/test_serialization.py | grep -E "^PASSED|passed|failed" || true)
  done
  rm -rf "$own"
fi
