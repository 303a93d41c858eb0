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
#
# Exit code (scripts/gpu_check_verdict.py): 0 when every check passed, else the OR of the failed
# checks' bits - 1 parity (kernel vs reference, test vectors, the kernel pytest), 2 static compile,
# 4 native-cast proof, 8 bandwidth target - each named in the last lines printed; 64 when this
# script refuses to run (unsupported Python, no torch/triton). Works with CI=true set (the kernel
# pytest child is strict but needs no vLLM). --dry-run prints what it would do and runs nothing.
set -euo pipefail
root="$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # -P: physical, also when called through a link
cd "$root"
py="${PYTHON:-python3}"
dry=0
for a in "$@"; do [ "$a" = "--dry-run" ] && dry=1; done
args=()
for a in "$@"; do [ "$a" != "--dry-run" ] && args+=("$a"); done
# pyproject.toml's requires-python (>=3.11): refuse anything older, by name, before importing.
if ! ver="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2]); sys.exit(sys.version_info < (3, 11))' 2>/dev/null)"; then
  echo "gpu_check: refusing to run: Python ${ver:-?} at $py is not supported (qstrat needs Python >= 3.11, pyproject.toml requires-python); set PYTHON=/path/to/python3.11+" >&2
  exit 64
fi
if ! "$py" -c "import torch, triton" 2>/dev/null; then
  echo "gpu_check: refusing to run: $py (Python $ver) cannot import torch and triton (pip install torch triton)" >&2
  exit 64
fi
need="$("$py" - <<'PY'
import importlib.util
wanted = {"pydantic": "pydantic>=2.6", "pluggy": "pluggy>=1.3", "safetensors": "safetensors>=0.4",
          "yaml": "PyYAML>=6", "rich": "rich>=13", "packaging": "packaging>=23", "pytest": "pytest>=8",
          "hypothesis": "hypothesis>=6.100"}
print(" ".join(req for mod, req in wanted.items() if importlib.util.find_spec(mod) is None))
PY
)"
if [ "$dry" = 1 ]; then
  cuda="$("$py" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "none")')"
  echo "gpu_check: dry run (nothing installed, nothing run)"
  echo "  python: $py (Python $ver); GPU: $cuda"
  echo "  would install: ${need:-nothing}${need:+ (from ${QSTRAT_WHEELHOUSE:-the package index})}"
  echo "  qstrat from: $root (link farm unless this tree is the installed qstrat)"
  if [ "$cuda" = none ]; then mode="CPU smoke (Triton interpreter, tiny shapes)"; else mode="GPU"; fi
  echo "  would run: $py $root/scripts/gpu_check.py ${args[*]:-} [$mode]"
  echo "  checks (exit bit): parity (1): kernel vs reference, test vectors, kernel pytest;"
  echo "    static compile (2); native-cast proof (4, GPU only); bandwidth target (8, GPU only:"
  echo "    >= 85% of copy on the largest slab, per-expert loop >= 5x one launch)"
  exit 0
fi
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
  # qstrat/serializers and qstrat/strategies are links to directories: linked once, below (ln -s
  # onto an existing link to a directory would write a link INTO the source tree)
  for f in "$root"/qstrat/*; do
    case "$(basename "$f")" in serializers|strategies) continue ;; esac
    ln -s "$f" "$farm/qstrat/"
  done
  ln -s "$root/serializers" "$farm/qstrat/serializers"
  ln -s "$root/strategies" "$farm/qstrat/strategies"
  export PYTHONPATH="$farm${PYTHONPATH:+:$PYTHONPATH}"
fi
rc=0
"$py" "$root/scripts/gpu_check.py" ${args[@]+"${args[@]}"} || rc=$?
exit "$rc"
