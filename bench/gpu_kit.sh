#!/usr/bin/env bash
# Add to .device-kit/ (made by ../shared/gpu/prepare.sh) what bench/gpu_run.sh needs besides
# it: Jitney's own wheel (the GPU machine installs it with the others; the checkout's
# scheduler/, worker/ and client/ become jitney.* only when installed) and the workloads.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rm -f .device-kit/whl/jitney-*.whl
rm -rf build
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w .device-kit/whl .
rm -rf build
# Runtime packages prepare.sh does not fetch (added since): the scheduler's grammar engine.
ver() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  -d .device-kit/whl "llguidance==$(ver llguidance)"
mkdir -p .device-kit/bench && cp bench/workloads/*.jsonl .device-kit/bench/
ls .device-kit/whl
