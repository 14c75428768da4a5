#!/usr/bin/env bash
# Run HERE (any machine with pip and internet access to PyPI), before lending a GPU machine
# the check: downloads the wheels tools/gpu_check.sh installs there, for its Python 3.12 on
# x86-64 Linux, into .whl/ (git-ignored via info/exclude; pass carry=[".whl"] to the device
# tool). ~21 MB in all, under the 64 MiB a device call may carry. megarl itself needs no
# wheel: it runs from the repository root (PYTHONPATH), and its pyproject pins Python 3.11.
#
# Wheels: megatron-core (compiled: a cp312 wheel; always installed), what megarl + megatron
# import beyond torch (numpy, packaging, PyYAML, setuptools: installed only when missing on
# the device), and what the pytest check needs (pytest, pluggy, iniconfig, Pygments,
# safetensors). Versions are the ones this project's CPU venv runs.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
PY=${PYTHON:-python3}
mkdir -p "$DEST"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DEST" \
  megatron-core==0.16.1 numpy==2.3.5 packaging==26.4 PyYAML==6.0.4 setuptools==78.1.1 \
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 Pygments==2.21.0 safetensors==0.8.0
ls -l "$DEST"
du -sh "$DEST"
if [ -n "$(git status --porcelain -- "$DEST")" ]; then
  echo "gpu_check_prepare: $DEST is not ignored by git ($exclude)" >&2
  exit 1
fi
echo "gpu_check_prepare: ready. Device tool: carry=[\".whl\"], command 'bash tools/gpu_check.sh', timeout_s=540"
