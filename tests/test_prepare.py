"""What runs before the first byte (qstrat/execute/prepare.py): the one list of steps, the same in the docs,
run by every sink; each check made to fail in turn for each sink refuses the refit with that
check's error and nothing was written or sent (no checkpoint directory, no engine RPC, no
transfer RPC or collective)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import qstrat
import qstrat.execute.checkpoint
import qstrat.vllm.checks.engine_manifest
import qstrat.transport.send.sender
import qstrat.vllm
import qstrat.vllm.checks.sink_checks
from qstrat import NonFiniteError, PlanError, RefitDriver
from qstrat.errors import BackendUnavailableError, EngineManifestError, QstratError, WireManifestMismatchError
from qstrat.execute.prepare import STEPS, PreparedRefit
from qstrat.transport import RefitSender
from test_vllm_sink import RecordingLLM, driver, manifest_without_cross_check  # noqa: F401 (fixtures)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "concepts.md"

#: Every sink's checks, in the order it runs them (the ``ran`` of a refit that passes them all).
RAN = {
    "vllm": ["plan", "engine quantization", "engine format", "engine manifest", "ignore lists", "cpu experts", "backends", "values"],
    "checkpoint": ["plan", "config.json", "model tensors", "backends"],  # values while quantizing (values="inline")
    "sender": ["plan", "every layer", "model tensors", "wire manifest", "backends", "values"],
    "run": ["plan", "backends"],  # values while quantizing
}
#: A warm atomic RefitSender.refit (the driver's kept plan, matched by names and hf_config): the
#: plan's own checks (kept with it); shapes, dtypes, backends and values as the stream reads each input.
WARM_SENDER = ["plan", "every layer", "model tensors", "wire manifest"]
#: The doc's bullet for each sink's own checks.
DOC_SINK = {"vllm": "`qstrat.vllm.refit`", "checkpoint": "`write_checkpoint`", "sender": "`RefitSender.refit`",
            "run": "`RefitDriver.run`"}


@pytest.fixture()
def prepared(monkeypatch):
    """Every PreparedRefit that RefitDriver.prepare returned during the test."""
    seen: list[PreparedRefit] = []
    real = RefitDriver.prepare

    def spy(self, *a, **k):
        p = real(self, *a, **k)
        seen.append(p)
        return p

    monkeypatch.setattr(RefitDriver, "prepare", spy)
    return seen


def _section() -> str:
    text = DOCS.read_text()
    start = text.index("## What runs before the first byte")
    return text[start:text.index("\n## ", start + 1)]


def test_the_steps_are_the_documented_list_in_order():
    section = _section()
    documented = re.findall(r"^(\d)\. \*\*([\w.]+)\*\*", section, flags=re.M)
    assert documented == [(str(i + 1), s.name) for i, s in enumerate(STEPS)]
    assert [s.name for s in STEPS] == ["plan", "sink", "backends", "values"]
    assert [s.error for s in STEPS] == ["PlanError", "the sink's errors", "BackendUnavailableError",
                                        "NonFiniteError"]
    for step in STEPS:  # each step's error is the one the docs give it
        item = re.search(rf"^\d\. \*\*{step.name}\*\*(.*?)(?=^\d\. |\Z)", section, flags=re.M | re.S).group(1)
        if step.name != "sink":
            assert f"`{step.error}`" in item, step.name


@pytest.mark.parametrize("sink", sorted(RAN))
def test_each_sinks_own_checks_are_documented_in_its_order(sink):
    bullet = re.search(rf"^   - {re.escape(DOC_SINK[sink])}: (.*?)(?=^   - |^\d\. )", _section(),
                       flags=re.M | re.S).group(1)
    own = [n for n in RAN[sink] if n not in {s.name for s in STEPS}]
    assert re.findall(r"\*\*([\w. ]+)\*\*", bullet) == own


def _sender():
    """A RefitSender whose engines and group record every call: nothing may reach them."""
    calls: list[str] = []

    class Client:
        def __getattr__(self, method):
            return lambda *a, **k: calls.append(method)

    class Group:
        pg = object()
        device = torch.device("cpu")

        def wait(self, work):
            raise AssertionError("unreachable: the first collective raises")

        world_size, rank = 2, 0

        def broadcast(self, tensor):
            calls.append("collective")
            raise AssertionError("a collective after a refused check")

        def sum(self, tensor):  # the round's first collective: the receivers' challenge
            calls.append("collective")
            raise AssertionError("a collective after a refused check")

    sender = RefitSender([Client()], "127.0.0.1", 1)
    sender.group = Group()
    return sender, calls


def _refit(sink, driver, state, tmp_path, engine_config, reached):
    """Run ``sink`` on ``state``; what it reached (engine RPCs, transfer RPCs and collectives, the
    first emitted tensor) is appended to ``reached`` as it happens."""
    if sink == "vllm":
        llm = RecordingLLM(engine_config)
        reached.append(llm.calls)
        qstrat.vllm.refit(llm, driver, state)
    elif sink == "checkpoint":
        qstrat.execute.checkpoint.write_checkpoint(driver, state, tmp_path / "out")
    elif sink == "sender":
        sender, calls = _sender()
        reached.append(calls)
        sender.refit(driver, state)
    else:
        for name, _ in driver.run(state):
            reached.append([name])
            break


def test_every_sink_runs_its_checks_in_the_documented_order(tiny_model, driver, tmp_path, prepared):
    state = tiny_model.state_dict()
    qstrat.vllm.refit(RecordingLLM(driver.plan(state).vllm_quantization_config()), driver, state)
    qstrat.execute.checkpoint.write_checkpoint(driver, state, tmp_path / "out")
    next(driver.run(state))
    for _ in ("cold", "warm"):
        driver.plan_cache.clear() if _ == "cold" else None
        sender, calls = _sender()
        with pytest.raises(AssertionError, match="a collective after a refused check"):
            sender.refit(driver, state)  # every check passed: the round starts (and the stand-in stops it)
        assert sorted(calls) == ["collective", "start_weight_update", "update_weights"]
        assert calls[0] == "start_weight_update"
    assert [p.ran for p in prepared] == [RAN["vllm"], RAN["checkpoint"], RAN["run"], RAN["sender"], WARM_SENDER]
    assert [p.values_checked for p in prepared] == [True, False, False, True, False]
    assert [p.checked_in_stream for p in prepared] == [False] * 4 + [True]


def _fail(monkeypatch, target, name, error):
    def refuse(*a, **k):
        raise error(f"refused by {name}")

    monkeypatch.setattr(*target, refuse)


#: What makes each check refuse: (object, attribute) replaced by a function raising its error.
TARGETS = {
    "plan": ((RefitDriver, "plan"), PlanError),
    "engine quantization": ((qstrat.vllm.checks.sink_checks, "check_engine_online"), PlanError),
    "engine format": ((qstrat.vllm.checks.sink_checks, "check_engine_format"), PlanError),
    "engine manifest": ((qstrat.vllm.checks.sink_checks, "check_plan"), EngineManifestError),
    "ignore lists": ((qstrat.vllm.checks.sink_checks, "check_engine_compatible"), PlanError),
    "cpu experts": ((qstrat.vllm.checks.sink_checks, "check_cpu_expert_reload"), PlanError),
    "config.json": ((qstrat.execute.checkpoint, "output_hf_config"), QstratError),
    "every layer": ((qstrat.transport.send.sender, "check_every_layer"), PlanError),
    "model tensors": ((qstrat.vllm.checks.engine_manifest, "check_model_tensors"), PlanError),
    "wire manifest": ((qstrat.transport.send.sender, "wire_manifest_for_plan"), WireManifestMismatchError),
    "backends": ((RefitDriver, "check_backends"), BackendUnavailableError),
    "values": ((RefitDriver, "check_values"), NonFiniteError),
}


@pytest.mark.parametrize("sink,check", [(s, c) for s in sorted(RAN) for c in RAN[s]])
def test_each_check_refuses_before_the_first_byte(tiny_model, driver, tmp_path, monkeypatch, prepared,
                                                  sink, check):
    state = tiny_model.state_dict()
    engine_config = driver.plan(state).vllm_quantization_config()  # the stand-in engine's
    driver.plan_cache.clear()  # a cold refit: a warm sender checks shapes, backends, values in the stream
    target, error = TARGETS[check]
    _fail(monkeypatch, target, check, error)
    reached: list = []
    with pytest.raises(error, match=f"^refused by {re.escape(check)}$"):
        _refit(sink, driver, state, tmp_path, engine_config, reached)
    # no engine RPC, no transfer RPC or collective, no tensor emitted
    assert reached == ([[]] if sink in ("vllm", "sender") else [])
    assert list(tmp_path.iterdir()) == []  # no checkpoint directory, no temporary one
    assert prepared == []  # prepare never returned


def test_a_checkpoint_with_a_nan_leaves_nothing_written(tiny_model, driver, tmp_path):
    """write_checkpoint checks values while quantizing (values="inline"): the error removes the
    temporary directory, so nothing is left either."""
    state = dict(tiny_model.state_dict())
    bad = state["model.layers.2.self_attn.o_proj.weight"].clone()
    bad[1, 2] = float("inf")
    state["model.layers.2.self_attn.o_proj.weight"] = bad
    with pytest.raises(NonFiniteError, match=r"^model\.layers\.2\.self_attn\.o_proj\.weight: non-finite value inf"):
        qstrat.execute.checkpoint.write_checkpoint(driver, state, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_the_sender_refuses_an_unavailable_backend_before_sending(tiny_model, tiny_hf_config, monkeypatch):
    """Before prepare, RefitSender.refit did not check backends: a backend='triton' rule on CPU
    tensors started the round and failed inside the stream."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    drv = RefitDriver({"preset": "block-fp8", "rules": [{"select": "attention", "serializer": "block_fp8",
                                                         "options": {"backend": "triton"}}]},
                      hf_config=tiny_hf_config)
    sender, calls = _sender()
    with pytest.raises(BackendUnavailableError, match=r"^model\.layers\.0\.self_attn\.k_proj\.weight \(rules\[0\]\): "
                                                      r"block_fp8: backend='triton' needs CUDA tensors"):
        sender.refit(drv, tiny_model.state_dict())
    assert calls == []


def test_the_sender_refuses_a_nan_and_an_unusable_bucket_size_before_sending(tiny_model, driver):
    state = dict(tiny_model.state_dict())
    sender, calls = _sender()
    sender.bucket_bytes = 1000  # not a multiple of the 64-byte alignment
    with pytest.raises(WireManifestMismatchError, match="bucket_bytes 1000: must be a positive multiple"):
        sender.refit(driver, state)
    bad = state["model.layers.1.mlp.experts.down_proj"].clone()
    bad[2, 3, 4] = float("nan")
    state["model.layers.1.mlp.experts.down_proj"] = bad
    sender, calls = _sender()
    driver.plan_cache.clear()  # cold: up front (a warm atomic round finds it in the stream: test_transport_warm.py)
    with pytest.raises(NonFiniteError, match=r"model\.layers\.1\.mlp\.experts\.down_proj"):
        sender.refit(driver, state)
    assert calls == []


def test_a_stream_with_a_plan_defers_backends_and_values_to_its_arrival(tiny_model, driver):
    state = tiny_model.state_dict()
    plan = driver.plan(state)
    p = driver.prepare(iter(state.items()), plan, values="first", stream=True)
    assert p.ran == ["plan"] and p.streamed and p.plan_given and not p.values_checked
    assert [n for n, _ in p.execute()] == [n for n, _ in driver.run(state)]
    p = driver.prepare(iter(state.items()), plan)  # not a stream: collected, every step runs
    assert p.ran == ["plan", "backends", "values"] and not p.streamed and p.values_checked


def test_sender_refuses_a_refit_that_leaves_out_a_layer(tiny_model, driver):
    """Without plan=, a refit missing a decoder layer would leave the engines' old weights there
    (vLLM's reload keeps a layer that gets none): refused before anything is sent. Found by an
    adversarial run: the wire manifest passed the engine's check with 185 of 247 tensors."""
    from qstrat.transport.send.sender import check_every_layer

    state = {k: v for k, v in tiny_model.state_dict().items() if not k.startswith("model.layers.3.")}
    plan = driver.plan(state)
    with pytest.raises(PlanError, match=r"^the refit leaves out decoder layer\(s\) 3 of the model's 4 "
                                        r"\(hf_config.num_hidden_layers\): the engines would keep their old"):
        check_every_layer(plan, driver, plan_given=False)
    check_every_layer(plan, driver, plan_given=True)          # an explicit partial refit is fine
    check_every_layer(driver.plan(tiny_model.state_dict()), driver, plan_given=False)   # whole: fine


def test_sender_refuses_a_plan_that_is_not_the_models_tensors(tiny_model, driver):
    """RefitSender checks the plan against the tensors the driver's hf_config implies, as
    write_checkpoint does and qstrat.vllm.refit does against a live engine."""
    state = dict(tiny_model.state_dict())
    state["model.layers.0.input_layernorm.weight"] = torch.ones(255, dtype=torch.bfloat16)
    sender, calls = _sender()
    with pytest.raises(PlanError, match=r"^the refit does not match the model's tensors \(from its config; nothing "
                                        r"was written or sent\):\n  model\.layers\.0\.input_layernorm\.weight: shape "
                                        r"\[255\], the engine expects \[256\]"):
        sender.refit(driver, state)
    assert calls == []
