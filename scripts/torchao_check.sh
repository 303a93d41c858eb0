#!/usr/bin/env bash
# qstrat bench's torchao peer: torchao's MX cast (MXTensor.to_mx, RCEIL) gives qstrat's MXFP8
# reference bytes (tests/test_bench.py -k torchao). torchao is installed OUTSIDE the project's
# .venv, into its own folder put on PYTHONPATH for this run only: no torchao release imports
# quietly beside torch 2.13 on Python 3.11 (pyproject's bench extra), and the .venv is the
# environment a user's own scripts run in. Extra arguments go to pytest.
set -euo pipefail
root="$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCHAO=0.18.0
bash "$root/scripts/bootstrap.sh"
venv="${QSTRAT_VENV:-$root/.venv}"
target="$venv/opt/torchao-$TORCHAO"  # not on the .venv's sys.path
if [ ! -f "$target/.qstrat-installed" ]; then
  "$venv/bin/python" -m pip --disable-pip-version-check -q install --no-deps --target "$target" "torchao==$TORCHAO"
  touch "$target/.qstrat-installed"
fi
cd "$root"
QSTRAT_EXPECT_TORCHAO=$TORCHAO PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" \
  exec "$venv/bin/python" -m pytest -q -k torchao tests/test_bench.py "$@"
