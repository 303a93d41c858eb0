"""What a failed fidelity verdict does in a training loop (qstrat.vllm.fidelity.verdict) and the
probe's HTTP engine refusing a bad address, without an engine: the verdict's rule and StepProbe's
cadence. The live probes of each framework: tests/test_integration_trl.py,
tests/test_integration_trl_server.py, tests/verl091, tests/skyrl312."""
from __future__ import annotations

import warnings

import pytest

from qstrat.errors import ConfigError, FidelityError


def _report(mean_kl):
    from qstrat.vllm.fidelity.limits import Threshold
    from qstrat.vllm.fidelity.probe import FidelityReport

    return FidelityReport("block_fp8", 124, 20, 0.1, mean_kl, 10 * mean_kl, (0, 1), 1e-4, Threshold(1.0, 1e-4), 0.5, 0)


class _Verdicts:
    """Stands in for Verify's result per call: a passed report, or the FidelityError probe raises."""

    def __init__(self, *mean_kls):
        self.reports = [_report(k) for k in mean_kls]
        self.calls = 0

    def __call__(self, llm, driver):
        r = self.reports[self.calls]
        self.calls += 1
        if not r.passed:
            raise FidelityError(f"the engine does not serve what was sent: {r}", r)
        return r


def test_judged_raises_or_warns_with_the_errors_text():
    from qstrat.vllm.fidelity.verdict import FidelityWarning, judged

    with pytest.raises(FidelityError, match=r"^the engine does not serve what was sent: fidelity block_fp8: "
                                            r"mean KL 0.001 \(limit 0.0001, 10x\)"):
        judged(_Verdicts(1e-3), None, None, "raise")
    with pytest.warns(FidelityWarning, match=r"^the engine does not serve what was sent: fidelity block_fp8: "
                                             r"mean KL 0.001 \(limit 0.0001, 10x\)"):
        r = judged(_Verdicts(1e-3), None, None, "warn")
    assert not r.passed and r.mean_kl == 1e-3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a passed verdict warns nothing
        assert judged(_Verdicts(1e-5), None, None, "warn").passed


def test_step_probe_probes_every_nth_sync_and_returns_its_metrics(tiny_model):
    from qstrat.vllm.fidelity.metrics import fidelity_metrics
    from qstrat.vllm.fidelity.verdict import FidelityWarning, StepProbe

    probe = StepProbe(tiny_model, every=2, on_failure="warn")
    probe.verify = _Verdicts(1e-5, 2e-3)
    logged = [probe(None, None) for _ in range(2)]
    with pytest.warns(FidelityWarning):
        logged.append(probe(None, None))
    logged.append(probe(None, None))
    assert [bool(m) for m in logged] == [True, False, True, False] and probe.verify.calls == 2
    assert logged[0] == fidelity_metrics(probe.reports[0]) and logged[0]["qstrat/fidelity/ok"] == 1.0
    assert logged[2]["qstrat/fidelity/ok"] == 0.0 and logged[2]["qstrat/fidelity/ratio"] == pytest.approx(20.0)
    raising = StepProbe(tiny_model)
    raising.verify = _Verdicts(3e-3)
    with pytest.raises(FidelityError) as err:
        raising(None, None)
    assert raising.reports == [err.value.report]  # a failed probe's report is kept too


@pytest.mark.parametrize("kwargs, message", [
    ({"every": -1}, r"^every: a sync count >= 0 \(0: never probe\), got -1$"),
    ({"every": True}, r"^every: a sync count >= 0 \(0: never probe\), got True$"),
    ({"on_failure": "stop"}, r"^on_failure: what a failed fidelity verdict does, 'raise' \(stop the run\) or 'warn' "
                             r"\(log qstrat/fidelity/ok 0 and go on\), got 'stop'$"),
])
def test_step_probe_refuses_a_bad_option(tiny_model, kwargs, message):
    from qstrat.vllm.fidelity.verdict import StepProbe

    with pytest.raises(ConfigError, match=message):
        StepProbe(tiny_model, **kwargs)


@pytest.mark.parametrize("url", ["localhost:8000", None, "ftp://x"])
def test_served_engine_refuses_an_address_that_is_not_an_http_url(url):
    from qstrat.vllm.fidelity.served import ServedEngine

    with pytest.raises(ValueError, match=r"^ServedEngine: base_url must be a server's http\(s\) URL, got "):
        ServedEngine(url)
