#!/usr/bin/env bash
# A Python whose `jitney` is another revision's, for side-by-side benchmarks:
#   bash bench/baseline_env.sh REV DIR   ->  DIR/venv/bin/python
# It builds REV's wheel and installs it --no-deps into a venv that sees this
# checkout's .venv packages as a plain path (so REV's jitney, not this one's).
set -euo pipefail
rev=${1:?revision}; dir=${2:?folder}
root=$(cd "$(dirname "$0")/.." && pwd)
py=$root/.venv/bin/python
rm -rf "$dir" && mkdir -p "$dir/src"
git -C "$root" archive "$rev" pyproject.toml README.md jitney scheduler worker client protos | tar -x -C "$dir/src"
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dir/dist" "$dir/src"
"$py" -m venv --without-pip "$dir/venv"
"$py" -m pip --python "$dir/venv/bin/python" install -q --no-deps "$dir"/dist/jitney-*.whl
site=$("$dir/venv/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
"$py" -c "import sysconfig; print(sysconfig.get_path('purelib'))" > "$site/project-venv.pth"
echo "$dir/venv/bin/python"
