#!/bin/bash
# GPU run 7 (issue 65's GPU baseline, docs/BENCH_GPU.md "Run 7"): the one command that ran on the
# lent machine, from the checkout's root, with .gpu carried (DataStates-LLM unpacked there as
# gpu_run.sh says). Builds DataStates-LLM first (in the foreground: nothing timed runs beside the
# compiler), then: device-to-host copies; torch.profiler traces of a checkpointed step (ckptio's
# lazy save with defaults, the memory tier); every 10 steps to disk with defaults, prepared,
# DCP at its best and DataStates-LLM; every step into the memory tier from the first save.
# Keeps to LIMIT seconds (default 430); at most 6 files into $OUT.
#   LIMIT=430 bash benchmarks/gpu_run3.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD DATASTATES_LLM_DIR=$PWD/.gpu/datastates-llm
T0=$SECONDS
LIMIT=${LIMIT:-430}
left() { echo $((LIMIT - (SECONDS - T0))); }
log() { echo "$* at $((SECONDS - T0)) s" | tee -a "$OUT/bench.log"; }
{
  date -u; git log --oneline -1 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
    --format=csv
  python3 -VV; python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
  nproc; free -g; df -h /tmp /dev/shm; uname -r
} > "$OUT/setup.txt" 2>&1
( cd .gpu/datastates-llm && time TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
    python3 setup.py build_ext --inplace ) > /tmp/ds_build.txt 2>&1
log "datastates build rc=$?"
tail -5 /tmp/ds_build.txt >> "$OUT/setup.txt"

bench() {  # name seconds args...: one benchmarks.gpu run, cut to the time left
  local name=$1 limit=$2
  shift 2
  if [ "$(left)" -lt 35 ]; then log "skipped $name: $(left) s left"; return; fi
  if [ "$limit" -gt "$(left)" ]; then limit=$(left); fi
  timeout "$limit" python3 -m benchmarks.gpu --gb 2 --dir /tmp/bench-gpu \
    --shm-dir /dev/shm/bench-gpu --json "$OUT/$name.json" "$@" >> "$OUT/bench.log" 2>&1
  log "$name rc=$?"
}
prof() {  # engine every: one profiled process
  if [ "$(left)" -lt 60 ]; then log "skipped profile $1: $(left) s left"; return; fi
  timeout 60 python3 -m benchmarks.gpu_profile --engine "$1" --every "$2" --out /tmp/prof \
    >> /tmp/prof/log.txt 2>&1
  log "profile $1 rc=$?"
}
mkdir -p /tmp/prof
bench d2h 50 --phases d2h --reps 1 --accum 16
prof ckptio_lazy 5
prof ckptio_tiers 2
tar -czf "$OUT/profiles.tar.gz" -C /tmp prof
bench train10 210 --phases train10 --reps 2 --steps 22 --accum 16 \
  --engines none,ckptio_lazy,ckptio_lazy_sized,dcp_async_best,datastates
bench train1 60 --phases train1 --reps 1 --steps 45 --accum 32 --engines none,ckptio_tiers
rm -rf /tmp/bench-gpu /dev/shm/bench-gpu
log "done"
