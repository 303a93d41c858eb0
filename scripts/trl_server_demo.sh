#!/usr/bin/env bash
# TRL's server mode on a CPU: TRL's own `trl vllm-serve` command (qstrat backend) serving a qstrat
# checkpoint, and TRL's GRPOTrainer (vllm_mode="server") syncing it through qstrat's transport
# (gloo, authenticated); after every sync the server must equal a fresh engine on the trainer's
# weights (python -m qstrat.integrations.trl_server_demo; --strategy mxfp8, --steps N, --peft; --stock: TRL's
# own trainer without qstrat, which refuses to sync a CPU trainer: shows the seam).
# About 1.5 min on a loaded 2-core machine (the server's start is most of it).
set -euo pipefail
root="$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # -P: physical, also when called through a link
bash "$root/scripts/bootstrap.sh"
exec "${QSTRAT_VENV:-$root/.venv}/bin/python" -m qstrat.integrations.trl_server_demo "$@"
