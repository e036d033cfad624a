#!/usr/bin/env bash
# What one call on a GPU machine without network runs (see ../shared/gpu/README.md):
# the CUDA tests, then bench/gpu.py, each under its own timeout; results land in $OUT.
#
# Here, before the call:  bash ../shared/gpu/prepare.sh && bash bench/gpu_kit.sh
# The call:               bash bench/gpu_run.sh   (carry: .device-kit)
set -uo pipefail
OUT=${OUT:-/tmp/jitney-gpu-out}; mkdir -p "$OUT"
TESTS_S=${TESTS_S:-150}; BENCH_S=${BENCH_S:-300}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .device-kit/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> "$OUT/gpu.txt"
# The installed wheel is jitney (PYTHONSAFEPATH and no pytest pythonpath keep the checkout's bare
# jitney/ folder from hiding it); $PWD, later on PYTHONPATH, still serves bench/ and tests/.
PYTHONSAFEPATH=1 timeout "$TESTS_S" python3 -m pytest -q -x -p no:cacheprovider -o pythonpath= -m "not slow" \
  ${TESTS:-tests/test_cuda.py tests/test_triton_fused.py tests/test_triton_kernels.py tests/test_sampler.py} \
  > "$OUT/tests.txt" 2>&1; echo "tests exit $?" >> "$OUT/tests.txt"
tail -3 "$OUT/tests.txt"
timeout "$BENCH_S" python3 bench/gpu.py --tokenizer .device-kit/tok --workload-dir .device-kit/bench \
  --out "$OUT/gpu-bench.md" --json "$OUT/gpu-bench.json" --workdir /tmp/gpu-work ${BENCH_ARGS:-} \
  > "$OUT/bench-log.txt" 2>&1
tar czf "$OUT/gpu-work.tgz" -C /tmp gpu-work 2>/dev/null
echo "bench exit $?" >> "$OUT/bench-log.txt"
tail -5 "$OUT/bench-log.txt"; cat "$OUT/gpu-bench.md" 2>/dev/null
