#!/usr/bin/env bash
# The TRL integration on a CPU: GRPO with qstrat rollouts (colocated vLLM engine), checked every step.
set -euo pipefail
root="$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # -P: physical, also when called through a link
bash "$root/scripts/bootstrap.sh"
exec "${QSTRAT_VENV:-$root/.venv}/bin/python" -m qstrat.integrations.trl_demo "$@"
