#!/bin/bash
# What ran on the lent GPU machine for docs/BENCH_GPU.md (issue 32), from the checkout's root.
# Beforehand, here: DataStates-LLM's repository (github DataStates/datastates-llm, 3296031)
# unpacked into .gpu/datastates-llm (an ignored folder carried to the machine) with one line
# added so that it compiles with GCC 13:
#   sed -i 's/#include <iostream>/#include <iostream>\n#include <cstdint>/' \
#       .gpu/datastates-llm/datastates/ckpt/src/common/mem_region.hpp
# Run 2: PHASES=d2h,load,train1 NAME=gpu_a BENCH_LIMIT=420 bash benchmarks/gpu_run.sh
# Run 3: TEST_SEL=tests/gpu/test_cuda_train.py TEST_LIMIT=120 ACCUM=16 \
#        PHASES=d2h,train10,train1 NAME=gpu_b BENCH_LIMIT=470 bash benchmarks/gpu_run.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD DATASTATES_LLM_DIR=$PWD/.gpu/datastates-llm
NAME=${NAME:-gpu}
PHASES=${PHASES:-d2h,load,train1}
if ! ls .gpu/datastates-llm/datastates/ckpt/src*.so >/dev/null 2>&1; then
  ( cd .gpu/datastates-llm && TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 setup.py build_ext --inplace ) > $OUT/ds_build.txt 2>&1
  so=$(ls .gpu/datastates-llm/datastates/ckpt/src*.so | head -1) && strip -g "$so" && cp "$so" $OUT/
fi
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_LIMIT:-240} python3 -m pytest ${TEST_SEL:-tests/gpu} -rA -p no:cacheprovider \
    tests/test_memory.py::test_peak_rss_of_save_and_in_place_load_is_bounded_by_pool \
    tests/test_async.py::test_exit_while_the_pool_is_still_faulting_in > $OUT/tests_gpu.txt 2>&1
fi
timeout ${BENCH_LIMIT:-400} python3 -m benchmarks.gpu --gb 2 --reps 3 --accum ${ACCUM:-32} \
  --phases $PHASES --dir /tmp/bench-gpu --shm-dir /dev/shm/bench-gpu \
  --json $OUT/$NAME.json --markdown $OUT/$NAME.md > $OUT/$NAME.log 2>&1
echo "bench rc=$?"
