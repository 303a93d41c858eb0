#!/usr/bin/env bash
# The main job: `qstrat demo` on the built-in default model, in the project virtualenv.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
exec "${QSTRAT_VENV:-$root/.venv}/bin/qstrat" demo "$@"
