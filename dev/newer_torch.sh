#!/usr/bin/env bash
# Run the DCP, format, conversion, round-trip and distributed tests against another torch (by
# hand, at each change of ckptio/dcp, ckptio/format, ckptio/convert.py or ckptio/planning/
# sharding.py, and at each new torch release; CI pins torch 2.13: docs/TESTS.md, "Newer torch").
#
#     dev/newer_torch.sh                 # torch 2.15.0
#     dev/newer_torch.sh 2.14.1          # another version
#     FIXTURE=1 dev/newer_torch.sh 2.16.0   # also write tests/fixtures/dcp/torch-2.16.0
#
# The venv is made once, outside the checkout (VENV, default ~/.cache/ckptio/venv-torch-<v>),
# with that torch (PyPI's Linux wheels are CUDA builds of about 5 GB; they run on the CPU) and
# ckptio's test dependencies, not ckptio itself: the tests import this checkout through
# PYTHONPATH. A pip constraint file capping torch (PIP_CONSTRAINT, or the machine's pip
# configuration) is lifted for this one install.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-2.15.0}
venv=${VENV:-$HOME/.cache/ckptio/venv-torch-$version}
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch, xxhash, pytest, xdist" 2>/dev/null; then
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
  empty=$(mktemp)
  start=$(date +%s)
  PIP_CONSTRAINT=$empty "$venv/bin/pip" install -q "torch==$version" numpy xxhash tqdm pytest pytest-xdist \
    hypothesis zstandard isal safetensors
  rm -f "$empty"
  echo "+ installed torch $version in $venv in $(( $(date +%s) - start )) s"
fi
"$venv/bin/python" -c "import torch; print('+ torch', torch.__version__)"
if [ "${FIXTURE:-0}" = 1 ]; then
  "$venv/bin/python" tests/fixtures/dcp/make.py
fi
tests=(tests/test_dcp_fixtures.py tests/test_dcpmeta.py tests/test_dcp_open.py tests/test_dcp_in.py
       tests/test_dcp_reader.py tests/test_dcp_writer.py tests/test_dcp_patterns.py
       tests/test_checkpointable.py tests/test_manifest.py tests/test_roundtrip.py
       tests/test_convert_targets.py tests/test_convert_dcp_optim.py tests/test_dist.py)
echo "+ PYTHONPATH=$PWD $venv/bin/python -m pytest -q -p no:cacheprovider ${tests[*]}"
PYTHONPATH=$PWD "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" "${@:2}"
