#!/usr/bin/env bash
# GPU check of the Triton kernels: parity tests on the GPU, copy-bandwidth ceiling, achieved
# bandwidth per format (see scripts/gpu_check.py). Run it in an environment with CUDA torch,
# triton and qstrat installed (PYTHON=/path/to/python, default python3); without a GPU it runs
# the CPU interpreter smoke mode. Extra arguments pass through (--json PATH, --formats a,b, ...).
set -euo pipefail
root="$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # -P: physical, also when called through a link
cd "$root"
exec "${PYTHON:-python3}" "$root/scripts/gpu_check.py" "$@"
