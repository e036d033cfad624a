#!/usr/bin/env bash
# What one call on a GPU machine without network runs (see ../shared/gpu/README.md), each part under
# its own timeout, results in $OUT:
#   1. the kernel tests (compiled on the card)                       -> tests-kernels.txt
#   2. bench/gpu_kernels.py: launch choices measured on this card     -> kernels.md, tuned/<card>.json
#   3. bench/gpu.py with those choices ($JITNEY_TUNED_CONFIGS)        -> gpu-bench.md
#   4. the other CUDA tests                                          -> tests.txt
#
# Here, before the call:  bash ../shared/gpu/prepare.sh && bash bench/gpu_kit.sh
# The call:               bash bench/gpu_run.sh   (carry: .device-kit)
# KERNELS_S=0 skips part 2 (the bench then runs the shipped worker/kernels/triton/tuned files); KTESTS_S=0 or TESTS_S=0
# skips those tests; PYTEST_N=N runs the tests on N pytest-xdist workers (the GPU image has xdist).
set -uo pipefail
OUT=${OUT:-/tmp/jitney-gpu-out}; mkdir -p "$OUT"
KTESTS_S=${KTESTS_S:-100}; KERNELS_S=${KERNELS_S:-190}; BENCH_S=${BENCH_S:-200}; TESTS_S=${TESTS_S:-120}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .device-kit/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> "$OUT/gpu.txt"
# The installed wheel is jitney (PYTHONSAFEPATH and no pytest pythonpath keep the checkout's bare
# jitney/ folder from hiding it); $PWD, later on PYTHONPATH, still serves bench/ and tests/.
pytests() {  # pytests SECONDS FILE TESTS...   (SECONDS 0: skipped; PYTEST_N=8: 8 xdist workers)
  local secs=$1 file=$2; shift 2
  [ "$secs" = 0 ] && return 0
  PYTHONSAFEPATH=1 timeout "$secs" python3 -m pytest -q -p no:cacheprovider -o pythonpath= -m "not slow" \
    ${PYTEST_N:+-n $PYTEST_N} "$@" \
    > "$OUT/$file" 2>&1; echo "tests exit $?" >> "$OUT/$file"; tail -3 "$OUT/$file"
}
pytests "$KTESTS_S" tests-kernels.txt ${KTESTS:-tests/worker/test_triton_skinny.py tests/worker/test_triton_fused.py tests/worker/test_triton_kernels.py}
if [ "$KERNELS_S" != 0 ]; then
  timeout "$KERNELS_S" python3 bench/gpu_kernels.py --budget-s $((KERNELS_S - 20)) \
    --out "$OUT/kernels.md" --json "$OUT/kernels.json" --tuned-dir "$OUT/tuned" > "$OUT/kernels-log.txt" 2>&1
  echo "kernels exit $?" >> "$OUT/kernels-log.txt"; tail -4 "$OUT/kernels-log.txt"
  export JITNEY_TUNED_CONFIGS=$OUT/tuned
fi
timeout "$BENCH_S" python3 bench/gpu.py --tokenizer .device-kit/tok --workload-dir .device-kit/bench \
  --out "$OUT/gpu-bench.md" --json "$OUT/gpu-bench.json" --workdir /tmp/gpu-work --budget-s $((BENCH_S - 15)) \
  ${BENCH_ARGS:-} > "$OUT/bench-log.txt" 2>&1
echo "bench exit $?" >> "$OUT/bench-log.txt"
tar czf "$OUT/gpu-work.tgz" -C /tmp gpu-work 2>/dev/null
tail -5 "$OUT/bench-log.txt"
pytests "$TESTS_S" tests.txt ${TESTS:-tests/worker/test_cuda.py tests/worker/test_triton_worker.py tests/worker/test_sampler.py}
