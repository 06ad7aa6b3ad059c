#!/usr/bin/env bash
# The venv of benchmarks/s3.py's peers: DCP over s3fs, DCP over s3torchconnector, TorchSnapshot.
# They live apart from ckptio's venv: s3fs -> aiobotocore pins botocore <1.43.118, which would
# drag ckptio's boto3 (1.44) back. Same torch as the main venv; nothing may pull another torch
# (checked with --dry-run before installing). s3torchconnector is an sdist that depends on torch:
# installed with --no-deps next to its client wheel (which has no dependencies).
#
#   benchmarks/s3_setup.sh [VENV]          # default /work/bench-venvs/dcp-s3
set -euo pipefail
VENV=${1:-/work/bench-venvs/dcp-s3}
MAIN_PY=${MAIN_PY:-$(dirname "$0")/../.venv/bin/python}
TORCH=$("$MAIN_PY" -c 'import torch; print(torch.__version__)')
python3 -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q)
if [ -e "/opt/wheels/torch-${TORCH}-cp311-cp311-manylinux_2_28_x86_64.whl" ]; then
  "${PIP[@]}" "/opt/wheels/torch-${TORCH}-cp311-cp311-manylinux_2_28_x86_64.whl"
else
  "${PIP[@]}" "torch==${TORCH}" --index-url https://download.pytorch.org/whl/cpu
fi
PEERS=(s3fs torchsnapshot tenacity xxhash tqdm numpy)
plan=$("$VENV/bin/pip" install --dry-run "${PEERS[@]}" 2>/dev/null | grep '^Would install' || true)
echo "$plan"
if grep -qiE '(^| )torch-[0-9]' <<<"$plan"; then
  echo "refusing: installing ${PEERS[*]} would replace torch ${TORCH}" >&2
  exit 1
fi
"${PIP[@]}" "${PEERS[@]}"
"${PIP[@]}" --no-deps s3torchconnectorclient==1.5.0 s3torchconnector==1.5.0
"$VENV/bin/python" -c 'import torch, s3fs, torchsnapshot, s3torchconnector.dcp; print("peer venv ok: torch", torch.__version__)'
