"""qstrat.integrations.nemo_rl's own logic without NeMo-RL: buckets collected until every tensor
``prepare_refit_info`` named has arrived, one refit per step, copies of NeMo-RL's reused buffers,
refusals (no refit info, a name it did not announce).

NeMo-RL is not installable here (PyPI's ``nemo-rl`` is a 0.0.0 placeholder; its source, github
NVIDIA-NeMo/RL, imports vLLM's GPU worker at module import), so its base class
``nemo_rl.models.generation.vllm.vllm_backend.VllmInternalWorkerExtension`` is a stand-in module
here: the extension only relies on it for ``state_dict_info`` (set by NeMo-RL's
``prepare_refit_info``) and for calling ``_load_weights(weights)`` per bucket. qstrat's
``refit_worker`` is replaced by a recorder (the real one is tested with live engines in
tests/test_engine_refit.py and the transport tests).
"""
from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from qstrat.errors import ConfigError, PlanError

BACKEND = "nemo_rl.models.generation.vllm.vllm_backend"


class _StandInExtension:
    """NeMo-RL's VllmInternalWorkerExtension as far as the qstrat extension uses it."""

    def prepare_refit_info(self, state_dict_info):
        self.state_dict_info = state_dict_info


@pytest.fixture
def nemo_rl(monkeypatch):
    """qstrat.integrations.nemo_rl imported against the stand-in; refit_worker records its calls."""
    parts = BACKEND.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    sys.modules[BACKEND].VllmInternalWorkerExtension = _StandInExtension
    monkeypatch.delitem(sys.modules, "qstrat.integrations.nemo_rl", raising=False)
    mod = importlib.import_module("qstrat.integrations.nemo_rl")
    calls = []

    def refit_worker(worker, state):
        calls.append({n: t.clone() for n, t in state.items()})
        return f"report {len(calls)}"

    monkeypatch.setattr(mod, "refit_worker", refit_worker)
    yield mod, calls
    sys.modules.pop("qstrat.integrations.nemo_rl", None)


INFO = {"a": ((2, 2), torch.bfloat16), "b": ((3,), torch.bfloat16), "c": ((1,), torch.bfloat16)}


def _tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g).to(dt) for n, (shape, dt) in INFO.items()}


def test_buckets_collect_until_the_last_announced_tensor_then_refit_once(nemo_rl):
    mod, calls = nemo_rl
    assert issubclass(mod.QstratWorkerExtension, _StandInExtension)
    w = mod.QstratWorkerExtension()
    w.prepare_refit_info(INFO)
    t = _tensors(0)
    a_view = t["a"]  # NeMo-RL hands out views of a buffer it reuses
    w._load_weights([("a", a_view)])
    assert calls == []  # one bucket of three tensors: nothing refit yet
    a_view.fill_(7.0)  # NeMo-RL reuses its buffer for the next bucket ...
    w._load_weights([("b", t["b"]), ("c", t["c"])])
    assert len(calls) == 1 and set(calls[0]) == set(INFO)
    assert torch.equal(calls[0]["a"], _tensors(0)["a"])  # ... the extension had copied the bucket
    assert torch.equal(calls[0]["b"], t["b"]) and torch.equal(calls[0]["c"], t["c"])
    assert w.qstrat_reports == ["report 1"]
    # the next step starts empty: one refit per complete step, with that step's tensors
    t2 = _tensors(1)
    w._load_weights([("c", t2["c"]), ("b", t2["b"])])
    w._load_weights([("a", t2["a"])])
    assert len(calls) == 2 and all(torch.equal(calls[1][n], t2[n]) for n in INFO)
    assert w.qstrat_reports == ["report 1", "report 2"]


def test_without_refit_info_nothing_is_received(nemo_rl):
    mod, calls = nemo_rl
    w = mod.QstratWorkerExtension()
    with pytest.raises(ConfigError, match="no refit info; NeMo-RL calls prepare_refit_info"):
        w._load_weights([("a", torch.zeros(2, 2))])
    w.prepare_refit_info({})
    with pytest.raises(ConfigError, match="nothing was received"):
        w._load_weights([("a", torch.zeros(2, 2))])
    assert calls == []


def test_an_unannounced_name_drops_the_step_and_reloads_nothing(nemo_rl):
    mod, calls = nemo_rl
    w = mod.QstratWorkerExtension()
    w.prepare_refit_info(INFO)
    t = _tensors(2)
    w._load_weights([("a", t["a"])])
    with pytest.raises(PlanError, match=r"sent \['model.extra'\] not in prepare_refit_info's 3 tensors; "
                                        r"this step's tensors were dropped, nothing was reloaded"):
        w._load_weights([("b", t["b"]), ("model.extra", torch.zeros(1))])
    assert calls == []
    # the dropped "a" does not count toward the next step: b and c alone do not complete it
    w._load_weights([("b", t["b"]), ("c", t["c"])])
    assert calls == []
    w._load_weights([("a", t["a"])])
    assert len(calls) == 1 and set(calls[0]) == set(INFO)


def test_a_failed_refit_propagates_and_leaves_nothing_pending(nemo_rl, monkeypatch):
    mod, calls = nemo_rl
    w = mod.QstratWorkerExtension()
    w.prepare_refit_info(INFO)
    boom = RuntimeError("engine refused the refit")

    def failing(worker, state):
        raise boom

    monkeypatch.setattr(mod, "refit_worker", failing)
    t = _tensors(3)
    with pytest.raises(RuntimeError, match="engine refused the refit"):
        w._load_weights(list(t.items()))
    assert getattr(w, "qstrat_reports", []) == []
    monkeypatch.setattr(mod, "refit_worker", lambda worker, state: calls.append(dict(state)) or "ok")
    w._load_weights([("a", t["a"])])
    assert calls == []  # the failed step's b and c are gone: a alone does not complete a step
