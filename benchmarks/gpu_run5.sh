#!/bin/bash
# GPU run 10 (issue 65, docs/BENCH_GPU.md "Run 10"): the one command run on the lent machine
# from the checkout's root, with .gpu carried (DataStates-LLM unpacked there as gpu_run.sh says).
# DataStates-LLM builds in the background while the CUDA tests run (nothing timed beside the
# compiler); then every step into the memory tier with its slots made ahead at prepare() (in
# the background, and waited for), and one more repetition of every 10 steps to disk.
# Keeps to LIMIT seconds (default 360); at most 8 files into $OUT.
#   LIMIT=360 bash benchmarks/gpu_run5.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD DATASTATES_LLM_DIR=$PWD/.gpu/datastates-llm
T0=$SECONDS
LIMIT=${LIMIT:-360}
left() { echo $((LIMIT - (SECONDS - T0))); }
log() { echo "$* at $((SECONDS - T0)) s" | tee -a "$OUT/bench.log"; }
{ date -u; git log --oneline -1 2>/dev/null; git status --short 2>/dev/null | head -20
  nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; } \
  > "$OUT/setup.txt" 2>&1
( cd .gpu/datastates-llm && TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=12 \
    python3 setup.py build_ext --inplace ) > /tmp/ds_build.txt 2>&1 &
BUILD=$!
timeout 100 python3 -m pytest -p no:cacheprovider -n 4 -rA tests/gpu tests/test_mapped_save.py \
  tests/test_examples.py tests/test_docs_blocks.py -k "cuda or prepare_makes" \
  > "$OUT/tests_gpu.txt" 2>&1
log "tests rc=$?"
wait $BUILD
log "datastates build rc=$?"

bench() {  # name seconds args...: one benchmarks.gpu run, cut to the time left
  local name=$1 limit=$2
  shift 2
  if [ "$(left)" -lt 35 ]; then log "skipped $name: $(left) s left"; return; fi
  if [ "$limit" -gt "$(left)" ]; then limit=$(left); fi
  timeout "$limit" python3 -m benchmarks.gpu --gb 2 --dir /tmp/bench-gpu \
    --shm-dir /dev/shm/bench-gpu --json "$OUT/$name.json" "$@" >> "$OUT/bench.log" 2>&1
  log "$name rc=$?"
}
bench train1 170 --phases train1 --reps 2 --steps 30 --accum 32 \
  --engines none,ckptio_tiers,ckptio_tiers_ready
bench train10 140 --phases train10 --reps 1 --steps 22 --accum 16 \
  --engines none,ckptio_lazy,ckptio_lazy_sized,dcp_async_best,datastates
rm -rf /tmp/bench-gpu /dev/shm/bench-gpu
log "done"
