#!/usr/bin/env bash
# The venv of benchmarks/dlio_run.py: DLIO (argonne-lcf/dlio_benchmark, the source at commit
# e1919d7b6ccffbe15143cd616517da9e5d7b26a7: PyPI's dlio_benchmark 2.0.0 lacks the LLM checkpoint
# workload) with mpi4py over Open MPI, and s3torchconnector 1.5.0 for DLIO's S3 engine. Apart
# from ckptio's venv: DLIO pins hydra/omegaconf and pulls pandas, h5py, pydftracer.
# Torch is installed as README.md installs it, `pip install torch==X`, X the main venv's torch
# less any local tag (+cpu); TORCH=X overrides. DLIO's own list also names tensorflow, DALI,
# torchvision and torchaudio, which its PyTorch checkpoint workload never imports: DLIO is
# installed with --no-deps after its core needs (setup.py's core_deps plus hydra-core), and
# s3torchconnector (an sdist declaring torch) --no-deps after its client, so that nothing may
# pull another torch (checked with --dry-run first). DLIO's workers import this checkout's
# ckptio (PYTHONPATH), hence its own needs (xxhash, tqdm, numpy) too. mpirun comes from Debian's
# openmpi-bin (installed here when missing, as root).
#
#   benchmarks/dlio_setup.sh [VENV]   # default /work/cache/dlio-venv
#   DLIO_SRC=DIR                      # a checkout of DLIO; default /work/cache/dlio_benchmark,
#                                     # cloned at the commit above when missing
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-/work/cache/dlio-venv}
DLIO_SRC=${DLIO_SRC:-/work/cache/dlio_benchmark}
DLIO_COMMIT=e1919d7b6ccffbe15143cd616517da9e5d7b26a7
MAIN_PY=${MAIN_PY:-$ROOT/.venv/bin/python}
TORCH=${TORCH:-$("$MAIN_PY" -c 'import torch; print(torch.__version__.split("+")[0])')}
if ! command -v mpirun >/dev/null || ! command -v mpicc >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev
fi
if [ ! -f "$DLIO_SRC/setup.py" ]; then
  git clone -q https://github.com/argonne-lcf/dlio_benchmark "$DLIO_SRC"
  git -C "$DLIO_SRC" checkout -q "$DLIO_COMMIT"
fi
python3 -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q)
"${PIP[@]}" "torch==${TORCH}"
NEEDS=("Pillow>=9.3.0" "PyYAML>=6.0.0" "h5py>=3.11.0" "mpi4py>=3.1.4" "numpy>=1.23.5"
       "omegaconf>=2.2.0" "pandas>=1.5.1" "psutil>=5.9.8" "pydftracer>=2.0.2" "hydra-core>=1.3.2"
       s3torchconnectorclient==1.5.0 xxhash tqdm)
plan=$("$VENV/bin/pip" install --dry-run "${NEEDS[@]}" 2>/dev/null | grep '^Would install' || true)
echo "$plan"
if grep -qiE '(^| )torch-[0-9]' <<<"$plan"; then
  echo "refusing: installing ${NEEDS[*]} would replace torch ${TORCH}" >&2
  exit 1
fi
"${PIP[@]}" "${NEEDS[@]}"
"${PIP[@]}" --no-deps "$DLIO_SRC" s3torchconnector==1.5.0
cd /tmp && mpirun --allow-run-as-root --oversubscribe -np 2 "$VENV/bin/python" -c \
  'from mpi4py import MPI; import torch, dlio_benchmark.main, s3torchconnector; c = MPI.COMM_WORLD; print(f"rank {c.rank}/{c.size} ok: torch", torch.__version__)'
