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


# ---- the attacker's findings --------------------------------------------------------------------

@pytest.mark.parametrize("value", ["rasie", "Raise", None, "stop"])
def test_a_misspelled_on_failure_is_refused_not_turned_into_a_warning(value):
    """Anything but exactly "raise" used to warn: a typo let training go on with a wrong engine."""
    from qstrat.integrations.trl_sync import QstratWeightSync
    from qstrat.vllm.fidelity.verdict import judged

    with pytest.raises(ConfigError, match=rf"^on_failure: .* got {value!r}$"):
        judged(_Verdicts(1e-3), None, None, value)
    with pytest.raises(ConfigError, match=rf"^on_fidelity_failure: .* got {value!r}$"):
        QstratWeightSync(None, None, None, None, on_fidelity_failure=value)


@pytest.mark.parametrize("timeout", [None, 0, -1, "5", True, float("inf")])
def test_served_engine_refuses_a_timeout_that_is_not_a_positive_number(timeout):
    """None waited forever on a server that accepted the connection and never answered."""
    from qstrat.vllm.fidelity.served import ServedEngine

    with pytest.raises(ValueError, match=r"^ServedEngine: timeout must be a positive number of seconds"):
        ServedEngine("http://127.0.0.1:1", timeout=timeout)


class _Answer:
    def __init__(self, doc, status=200):
        self.doc, self.status_code, self.text = doc, status, str(doc)

    def json(self):
        if isinstance(self.doc, Exception):
            raise self.doc
        return self.doc


def _choice(i, positions):
    return {"index": i, "prompt_logprobs": [None] + [{"5": {"logprob": -0.5}} for _ in range(positions)]}


@pytest.mark.parametrize("doc,message", [
    ({"choices": [_choice(0, 2)]}, r"returned prompt logprobs for 1 sequences of \[2\] positions; the probe sent "
                                   r"2 of \[2, 2\]$"),
    ({"choices": [_choice(0, 2), _choice(1, 1)]}, r"returned prompt logprobs for 2 sequences of \[2, 1\] positions"),
    ({"choices": [{"index": 0, "prompt_logprobs": None}]}, r"answered /v1/completions without vLLM's prompt_logprobs"),
    (ValueError("Expecting value"), r"answered /v1/completions without vLLM's prompt_logprobs \(ValueError"),
])
def test_a_short_or_foreign_server_answer_is_refused_naming_the_server(monkeypatch, doc, message):
    """compare() zipped what came back: 1 of 2 sequences scored passed on partial data."""
    import requests

    from qstrat.vllm.fidelity.served import ServedEngine

    monkeypatch.setattr(requests, "post", lambda *a, **k: _Answer(doc))
    engine = ServedEngine("http://10.0.0.9:8000", model="m")
    with pytest.raises(ValueError, match=r"^fidelity: the server at http://10.0.0.9:8000 " + message):
        engine.read_prompt_logprobs([[1, 2, 3], [4, 5, 6]], 2)
