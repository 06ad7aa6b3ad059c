#!/bin/bash
# GPU round two (docs/BENCH_GPU.md, second section): the one command that ran on the lent
# machine, from the checkout's root, with .gpu carried. Beforehand, here: DataStates-LLM (github
# DataStates/datastates-llm at 3296031) unpacked into .gpu/datastates-llm with
# `#include <cstdint>` added to common/mem_region.hpp (gpu_run.sh says how). It keeps to
# LIMIT seconds (default 560) and writes at most 6 files into $OUT: setup.txt (machine, build),
# tests_gpu.txt, bench.log and one JSON per phase (the tables: benchmarks.gpu --merge).
# Run 1: LIMIT=560 bash benchmarks/gpu_run2.sh; run 2 (no tests, no DataStates build):
# PART=2 LIMIT=330 bash benchmarks/gpu_run2.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD DATASTATES_LLM_DIR=$PWD/.gpu/datastates-llm
T0=$SECONDS
LIMIT=${LIMIT:-560}
left() { echo $((LIMIT - (SECONDS - T0))); }
log() { echo "$* at $((SECONDS - T0)) s" | tee -a "$OUT/bench.log"; }
{
  date -u; git log --oneline -1 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
    --format=csv
  python3 -VV; python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
  nproc; free -g; df -h /tmp /dev/shm; uname -r
} > "$OUT/setup.txt" 2>&1
[ "${PART:-1}" = 1 ] && ( cd .gpu/datastates-llm && time TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=12 \
    python3 setup.py build_ext --inplace ) > "$OUT/ds_build.tmp" 2>&1 &
BUILD=$!
if [ "${PART:-1}" = 1 ]; then
  timeout 80 python3 -m pytest -q -rA -p no:cacheprovider tests/gpu > "$OUT/tests_gpu.txt" 2>&1
  log "tests/gpu rc=$?"
fi
wait $BUILD
log "datastates build rc=$?"
tail -40 "$OUT/ds_build.tmp" >> "$OUT/setup.txt" 2>/dev/null; rm -f "$OUT/ds_build.tmp"

bench() {  # name seconds args...: one benchmarks.gpu run, cut to the time left
  local name=$1 limit=$2
  shift 2
  if [ "$(left)" -lt 35 ]; then log "skipped $name: $(left) s left"; return; fi
  if [ "$limit" -gt "$(left)" ]; then limit=$(left); fi
  timeout "$limit" python3 -m benchmarks.gpu --gb 2 --dir /tmp/bench-gpu \
    --shm-dir /dev/shm/bench-gpu --json "$OUT/$name.json" "$@" >> "$OUT/bench.log" 2>&1
  log "$name rc=$?"
}
if [ "${PART:-1}" = 1 ]; then
# every 10 steps to local disk, durable: the loop's overhead against DataStates-LLM and DCP
bench train10 330 --phases train10 --reps 3 --steps 22 --accum 16 \
  --engines none,ckptio_lazy,dcp_async_best,datastates
# device to host: the ceilings, ckptio (pool and memory tier), DCP's stager, DataStates
bench d2h 60 --phases d2h --reps 1 --accum 16
# every step into the memory tier (a 0.5 s step: 32 micro-batches)
bench train1 100 --phases train1 --reps 2 --steps 30 --accum 32 --engines none,ckptio_tiers
else  # part 2: the memory tier past its ring's warm-up, the pool sized at startup, cold loads
bench train1b 170 --phases train1 --reps 3 --steps 75 --accum 32 --engines none,ckptio_tiers
bench train10b 110 --phases train10 --reps 3 --steps 22 --accum 16 \
  --engines none,ckptio_lazy_sized
bench load 90 --phases load --reps 1 --accum 16
fi
rm -rf /tmp/bench-gpu /dev/shm/bench-gpu
log "done"
