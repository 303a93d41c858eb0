"""qstrat.integrations.trl's sync and engine start, without an engine: a recording stand-in for the
engine (tests/test_vllm_sink.py) behind a stand-in of TRL's ``VLLMGeneration``.

- Each sync copies TRL's items one at a time and quantizes them as they arrive: the copies alive
  at once are the payload's BF16 tensors plus about one decoder layer, never the whole model
  (before: a copy of every tensor, then the payload on top).
- A sync whose fidelity probe fails still resets the engine's prefix cache and logs its metrics.
- An engine refused right after start (vLLM built a module in another format) is released.
"""
from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch

import qstrat.vllm
import qstrat.vllm.checks.plan_fit
from qstrat import RefitDriver
from qstrat.integrations import trl as qtrl
from qstrat.integrations import trl_sync

from test_vllm_sink import RecordingLLM, manifest_without_cross_check  # noqa: F401 (autouse fixture)

pytest.importorskip("trl", reason="TRL is installed by scripts/bootstrap.sh (the trl extra)")


class ResettingLLM(RecordingLLM):
    """The recording engine, counting prefix-cache resets."""

    def __init__(self, quantization_config):
        super().__init__(quantization_config)
        self.resets = 0

    def reset_prefix_cache(self):
        self.resets += 1


def _sync(tiny_model, preset="block-fp8", verify_every=0):
    from collections import defaultdict

    from qstrat.cli.demo.tiny_model import hf_config

    driver = RefitDriver(preset, hf_config=hf_config(tiny_model))
    plan = driver.plan(tiny_model.state_dict())
    llm = ResettingLLM(plan.vllm_quantization_config())
    gen = SimpleNamespace(llm=llm, model=tiny_model,
                          _iter_named_params=lambda: iter(list(tiny_model.state_dict().items())))
    sync = qtrl.QstratWeightSync(gen, driver, plan, checkpoint=None, verify_every=verify_every)
    sync.metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    return sync, llm, plan


def test_a_sync_copies_one_item_at_a_time(tiny_model, monkeypatch):
    """Peak bytes of TRL-item copies alive at once, measured: at most the payload's unquantized
    tensors (sent as they are: the copy IS the payload) plus the largest decoder layer's inputs."""
    alive = {"now": 0, "peak": 0}
    real = qtrl.copied_each

    def counted(pairs):
        for name, t in real(pairs):
            n = t.numel() * t.element_size()
            alive["now"] += n
            alive["peak"] = max(alive["peak"], alive["now"])
            weakref.finalize(t, lambda n=n: alive.__setitem__("now", alive["now"] - n))
            yield name, t

    monkeypatch.setattr(trl_sync, "copied_each", counted)  # where QstratWeightSync reads it
    sync, llm, plan = _sync(tiny_model)
    report = sync()
    total = sum(t.numel() * t.element_size() for t in tiny_model.state_dict().values())
    unquantized = sum(e.nbytes_out for e in plan.entries if e.serializer in ("passthrough", "bf16"))
    per_layer: dict[int, int] = {}
    for e in plan.entries:
        if e.layer is not None and e.serializer not in ("passthrough", "bf16"):
            per_layer[e.layer] = per_layer.get(e.layer, 0) + torch.Size(e.shape).numel() * 2
    print(f"[trl sync] inputs {total} B; payload {report.bytes} B; copies alive at most {alive['peak']} B "
          f"(unquantized payload {unquantized} B + largest layer {max(per_layer.values())} B); before: "
          f"{total} B of copies + the payload")
    assert alive["peak"] <= unquantized + max(per_layer.values()) < total
    assert report.tensors == len(plan.outputs()) and llm.resets == 1
    (_, sent, _), = llm.calls
    assert [n for n, _ in sent] == [o.name for o in plan.outputs()]


def test_a_failed_probe_still_resets_the_cache_and_logs(tiny_model, monkeypatch):
    from qstrat.errors import FidelityError

    probe_report = SimpleNamespace(mean_kl=9.0, max_dlogprob=7.0, bf16_kl=0.5,
                                   threshold=SimpleNamespace(mean_kl=1e-3), ratio=9e3, passed=False, seconds=0.25)

    class FailingVerify:
        def __init__(self, model):
            self.model = model

        def __call__(self, llm, driver):
            raise FidelityError("fidelity block_fp8: max |dlogprob| 7 above its limit 1", probe_report)

    monkeypatch.setattr("qstrat.vllm.fidelity.probe.Verify", FailingVerify)
    sync, llm, _ = _sync(tiny_model, verify_every=1)
    with pytest.raises(FidelityError, match="above its limit"):
        sync()
    assert llm.resets == 1, "the reloaded engine kept its prefix cache"
    (report,) = sync.reports
    assert report.fidelity is probe_report
    store = sync.metrics["train" if tiny_model.training else "eval"]
    assert store["qstrat/refit/bytes"] == [float(report.bytes)]
    assert store["qstrat/fidelity/max_dlogprob"] == [7.0] and len(store["qstrat/sync/seconds"]) == 1
    assert store["qstrat/fidelity/limit"] == [1e-3] and store["qstrat/fidelity/ratio"] == [9e3]
    assert store["qstrat/fidelity/ok"] == [0.0] and store["qstrat/fidelity/seconds"] == [0.25]


def test_a_refused_refit_logs_the_sync_and_sends_nothing(tiny_model, monkeypatch):
    sync, llm, _ = _sync(tiny_model)
    gen = sync.generation
    gen._iter_named_params = lambda: iter([(n, t * float("nan")) if n.endswith("o_proj.weight") else (n, t)
                                           for n, t in tiny_model.state_dict().items()])
    from qstrat.errors import NonFiniteError

    with pytest.raises(NonFiniteError):
        sync()
    assert llm.calls == [] and sync.reports == []
    store = sync.metrics["train" if tiny_model.training else "eval"]
    assert len(store["qstrat/sync/seconds"]) == 1 and "qstrat/refit/bytes" not in store


def test_an_engine_refused_after_start_is_released(tiny_model, tmp_path, monkeypatch):
    """TRL's _init_vllm starts the engine; the check right after it fails (as for an engine vLLM
    built in another format): the engine is released and the generation holds none."""
    import importlib

    from qstrat.errors import EngineBuildError

    module = importlib.import_module("trl.generation.vllm_generation")
    released = []
    monkeypatch.setattr("qstrat.vllm.engine.local.release", released.append)

    def refuse(llm, driver=None):
        raise EngineBuildError("vLLM built modules in another format than the engine's quantization_config says")

    monkeypatch.setattr(qstrat.vllm.checks.plan_fit, "check_engine_built", refuse)  # the plan-vs-engine check's call
    monkeypatch.setattr(qtrl, "_cpu_engine", lambda: True)
    tokenizer = SimpleNamespace(save_pretrained=lambda d: None)
    tiny_model.config.architectures = ["Qwen3MoeForCausalLM"]
    gen = module.VLLMGeneration.__new__(module.VLLMGeneration)
    params = list(tiny_model.state_dict().items())
    for k, v in dict(mode="colocate", model=tiny_model, accelerator=SimpleNamespace(process_index=0),
                     processing_class=tokenizer, enable_sleep_mode=False,
                     _iter_named_params=lambda: iter(params)).items():
        setattr(gen, k, v)

    def init_vllm(g):  # what TRL's _init_vllm does: build the engine through the module's LLM
        g.llm = module.LLM(model="policy")

    def engine(**kwargs):  # the stand-in engine, on the checkpoint's quantization_config
        import json
        from pathlib import Path

        return ResettingLLM(json.loads((Path(kwargs["model"]) / "config.json").read_text())["quantization_config"])

    monkeypatch.setattr(module, "LLM", engine)
    handle = qtrl.QstratRollouts("block-fp8", tmp_path / "ckpt", None, "1.16.0")
    with pytest.raises(EngineBuildError, match="another format"):
        handle.start(gen, init_vllm, module)
    assert len(released) == 1 and isinstance(released[0], ResettingLLM)
    assert not hasattr(gen, "llm") and handle.syncs == []
