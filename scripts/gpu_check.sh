#!/usr/bin/env bash
# One-shot GPU check of the Triton kernels (scripts/gpu_check.py): parity with the torch reference
# on the GPU and against the CPU reference on every test-vector class, achieved bandwidth per format
# beside a device-to-device copy of the same bytes, vLLM's and torchao's quantizers where installed,
# and the static issue-bound ceiling of each compiled launch. Sized for one call under 8 minutes
# (--budget). Without a GPU it runs the CPU interpreter smoke mode.
#
# Needs only a Python with CUDA torch and triton (a stock `pip install torch triton`; PYTHON=/path,
# default python3). qstrat runs from this source tree: where `import qstrat` is not this tree (not
# installed, or another copy; QSTRAT_FROM_SOURCE=1 forces it), a link farm maps qstrat.serializers
# and qstrat.strategies as pyproject's package-dir does. qstrat's pure-Python dependencies and
# pytest/hypothesis (the parity tests) are installed when missing: from QSTRAT_WHEELHOUSE (a folder
# of wheels, for a machine without network: `pip download -d DIR pydantic pluggy ...` elsewhere) or
# else from the package index. Extra arguments pass through (--json PATH, --formats a,b, --no-pytest, ...).
set -euo pipefail
root="$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # -P: physical, also when called through a link
cd "$root"
py="${PYTHON:-python3}"
if ! "$py" -c "import torch, triton" 2>/dev/null; then
  echo "gpu_check: $py cannot import torch and triton (pip install torch triton)" >&2
  exit 2
fi
need="$("$py" - <<'PY'
import importlib.util
wanted = {"pydantic": "pydantic>=2.6", "pluggy": "pluggy>=1.3", "safetensors": "safetensors>=0.4",
          "yaml": "PyYAML>=6", "rich": "rich>=13", "packaging": "packaging>=23", "pytest": "pytest>=8",
          "hypothesis": "hypothesis>=6.100"}
print(" ".join(req for mod, req in wanted.items() if importlib.util.find_spec(mod) is None))
PY
)"
if [ -n "$need" ]; then
  echo "gpu_check: installing $need" >&2
  if [ -n "${QSTRAT_WHEELHOUSE:-}" ]; then
    # shellcheck disable=SC2086  # one requirement per word
    "$py" -m pip install -q --no-index --find-links "$QSTRAT_WHEELHOUSE" $need
  else
    # shellcheck disable=SC2086
    "$py" -m pip install -q $need
  fi
fi
here="$("$py" -c 'import os, qstrat; print(os.path.dirname(os.path.realpath(qstrat.__file__)))' 2>/dev/null || true)"
if [ "${QSTRAT_FROM_SOURCE:-0}" = 1 ] || [ "$here" != "$root/qstrat" ]; then
  farm="$(mktemp -d)"
  trap 'rm -rf "$farm"' EXIT
  mkdir "$farm/qstrat"
  for f in "$root"/qstrat/*; do ln -s "$f" "$farm/qstrat/"; done
  ln -s "$root/serializers" "$farm/qstrat/serializers"
  ln -s "$root/strategies" "$farm/qstrat/strategies"
  export PYTHONPATH="$farm${PYTHONPATH:+:$PYTHONPATH}"
fi
rc=0
"$py" "$root/scripts/gpu_check.py" "$@" || rc=$?
exit "$rc"
