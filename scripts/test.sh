#!/usr/bin/env bash
# The full test suite, in the project virtualenv.
set -euo pipefail
root="$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # -P: physical, also when called through a link
bash "$root/scripts/bootstrap.sh"
cd "$root"
exec "${QSTRAT_VENV:-$root/.venv}/bin/python" -m pytest "$@"
