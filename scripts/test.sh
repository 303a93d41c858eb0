#!/usr/bin/env bash
# The full test suite, in the project virtualenv.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
cd "$root"
exec "${QSTRAT_VENV:-$root/.venv}/bin/python" -m pytest "$@"
