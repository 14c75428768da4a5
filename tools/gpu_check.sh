#!/usr/bin/env bash
# Run ON the lent GPU machine from the repository root (the device tool's command):
#   bash tools/gpu_check.sh [gpu_check.py options]
#   bash tools/gpu_check.sh --script gpu_clock_check.py [its options]   # another tools/ script, same setup
# Installs the wheels tools/gpu_check_prepare.sh put in .whl/ (megatron-core always, --no-deps;
# the others only when their module is missing) into a private folder on PYTHONPATH, then runs
# tools/gpu_check.py with megarl from this checkout. Output: stdout, $OUT/gpu_check.log and
# $OUT/gpu_check.json. Exit code: gpu_check.py's (0 ok, 1 a check failed, 2 a module missing,
# 3 no CUDA device).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$SITE" "$OUT"
module_of() {  # wheel file → the module that tells whether it is installed
  case "$(basename "$1" | cut -d- -f1 | tr 'A-Z' 'a-z')" in
    megatron_core) echo "" ;;  # always install: the device's own copy (if any) is not the pinned one
    pyyaml) echo yaml ;;
    *) basename "$1" | cut -d- -f1 | tr 'A-Z' 'a-z' ;;
  esac
}
todo=()
for whl in .whl/*.whl; do
  [ -e "$whl" ] || { echo "gpu_check.sh: no wheels in .whl/ (run tools/gpu_check_prepare.sh and carry .whl)"; break; }
  mod=$(module_of "$whl")
  if [ -z "$mod" ] || ! "$PY" -c "import $mod" 2>/dev/null; then todo+=("$whl"); fi
done
if [ ${#todo[@]} -gt 0 ]; then
  echo "gpu_check.sh: installing into $SITE: ${todo[*]}"
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${todo[@]}" ||
      { echo "gpu_check.sh: pip could not install ${todo[*]} into $SITE"; exit 2; }
  else  # a wheel is a zip of the installed tree
    for whl in "${todo[@]}"; do "$PY" -m zipfile -e "$whl" "$SITE"; done
  fi
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore OUT
SCRIPT=gpu_check.py
if [ "${1:-}" = "--script" ]; then SCRIPT=$(basename "${2:?--script needs a tools/ file name}"); shift 2; fi
"$PY" "tools/$SCRIPT" "$@" 2>&1 | tee "$OUT/${SCRIPT%.py}.log"
exit "${PIPESTATUS[0]}"
