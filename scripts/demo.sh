#!/usr/bin/env bash
# The main job: `qstrat demo` on the built-in default model, in the project virtualenv.
set -euo pipefail
root="$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # -P: physical, also when called through a link
bash "$root/scripts/bootstrap.sh"
exec "${QSTRAT_VENV:-$root/.venv}/bin/qstrat" demo "$@"
