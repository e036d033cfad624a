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
mkdir -p .device-kit/bench && cp ../shared/bench/*.jsonl .device-kit/bench/
ls .device-kit/whl
