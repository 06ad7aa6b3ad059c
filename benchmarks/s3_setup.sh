#!/usr/bin/env bash
# The venv of benchmarks/s3.py's peers: DCP over s3fs, DCP over s3torchconnector, TorchSnapshot.
# They live apart from ckptio's venv: s3fs -> aiobotocore pins botocore <1.43.118, which would
# drag ckptio's boto3 (1.44) back. Torch is installed as README.md installs it, `pip install
# torch==X`, X the main venv's torch less any local tag (+cpu); TORCH=X overrides. The two peers
# that declare a torch dependency, torchsnapshot 0.1.0 and s3torchconnector 1.5.0 (an sdist), are
# installed with --no-deps after their listed needs, so that nothing may pull another torch
# (checked with --dry-run before installing). The peers' workers import this checkout's ckptio,
# hence its own needs (xxhash, tqdm, numpy) too.
#
#   benchmarks/s3_setup.sh [VENV]     # default .venv/peers/dcp-s3 in this checkout (git-ignored),
#                                     # where benchmarks/s3.py looks for it (--peer-python)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-$ROOT/.venv/peers/dcp-s3}
MAIN_PY=${MAIN_PY:-$ROOT/.venv/bin/python}
TORCH=${TORCH:-$("$MAIN_PY" -c 'import torch; print(torch.__version__.split("+")[0])')}
python3 -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q)
"${PIP[@]}" "torch==${TORCH}"
# torchsnapshot 0.1.0 needs (less torch): PyYAML aiofiles aiohttp importlib-metadata nest-asyncio
# psutil typing-extensions; s3torchconnector 1.5.0 [dcp]: s3torchconnectorclient==1.5.0 tenacity.
NEEDS=(s3fs PyYAML aiofiles aiohttp importlib-metadata nest-asyncio psutil typing-extensions
       s3torchconnectorclient==1.5.0 tenacity xxhash tqdm numpy)
plan=$("$VENV/bin/pip" install --dry-run "${NEEDS[@]}" 2>/dev/null | grep '^Would install' || true)
echo "$plan"
if grep -qiE '(^| )torch-[0-9]' <<<"$plan"; then
  echo "refusing: installing ${NEEDS[*]} would replace torch ${TORCH}" >&2
  exit 1
fi
"${PIP[@]}" "${NEEDS[@]}"
"${PIP[@]}" --no-deps torchsnapshot==0.1.0 s3torchconnector==1.5.0
"$VENV/bin/python" -c 'import torch, s3fs, torchsnapshot, s3torchconnector.dcp; print("peer venv ok: torch", torch.__version__)'
