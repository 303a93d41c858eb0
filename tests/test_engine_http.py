"""Refit of a vLLM HTTP server (``python -m vllm.entrypoints.openai.api_server``, the command
docs/transport.md gives) through vLLM's ``HTTPVLLMWeightSyncClient`` and qstrat's
weight-transfer backend: a refused round's REASON reaches the trainer's exception (it used to be
only "HTTPError: 500 Server Error" there, the reason in the server's log), and a valid round
then loads, and every weight of the refit engine, routers included, equals the fresh engine's
(read back by qstrat's own means: :mod:`qstrat.vllm.engine.weight_digests`, a worker extension the
test adds to the server command; vLLM's ``/weight_checker`` is not used).

The server runs in its own process group with vLLM 0.32's weight-transfer routes, which exist
only with ``VLLM_SERVER_DEV_MODE=1``; it starts on qstrat's block-FP8 checkpoint of model B.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ENGINE_MARKS
from transport_harness import free_port

pytestmark = ENGINE_MARKS

START_S = 420.0
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver

    model_a, model_b = build_tiny_qwen3_moe(seed=0), build_tiny_qwen3_moe(seed=1)
    cfg = hf_config(model_b)
    root = tmp_path_factory.mktemp("engine-http")
    write_checkpoint(RefitDriver("block-fp8", hf_config=cfg), model_b.state_dict(), root / "b-fp8")
    return dict(root=root, cfg=cfg, a=model_a.state_dict(), b=model_b.state_dict())


SECRET = "the recipe's shared secret, 32 bytes"


DIGESTS = "qstrat.vllm.engine.weight_digests.WeightDigests"


def server_command(model_dir, port: int) -> list[str]:
    """docs/transport.md's server command ("A recipe on a CPU"), on ``port``, with qstrat's
    weight-digest worker extension (docs/transport.md: "Reading the weights back")."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--weight-transfer-config", json.dumps({"backend": "qstrat"}),
            "--port", str(port), "--host", "127.0.0.1", "--skip-tokenizer-init", "--enforce-eager",
            "--max-model-len", "256", "--max-num-seqs", "4", "--dtype", "bfloat16",
            "--worker-extension-cls", DIGESTS]


@pytest.fixture(scope="module")
def server(ckpts):
    from qstrat.vllm.engine.http_server import CPU_SERVER_ENV, serving

    port = free_port()
    env = {**os.environ, **CPU_SERVER_ENV, "QSTRAT_TRANSFER_SECRET": SECRET}
    with serving(server_command(ckpts["root"] / "b-fp8", port), port, ckpts["root"] / "server.log", env,
                 START_S) as url:
        yield url


@pytest.fixture(scope="module")
def b_at_start(server):
    """The fresh engine's digest of every weight, before any refit (the engine on B)."""
    return digests(server)


def test_the_recipes_trainer_script_refits_the_fresh_server_and_back(server, b_at_start, ckpts):
    """FIRST in this module, on the fresh server: examples/trainers/transport_refit.py, run as
    docs/transport.md says (the secret in its environment), refits the server to A and back to B
    over the transport and finds every completion equal to the fresh server's."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "trainers" / "transport_refit.py"
    run = subprocess.run([sys.executable, str(script), "refit", server, "--port", str(free_port())],
                         env=dict(os.environ, QSTRAT_TRANSFER_SECRET=SECRET), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    lines = run.stdout.splitlines()
    assert lines[0] == "fresh server: 3 greedy completions read" and lines[1].startswith("refit to A: TransferReport(")
    assert lines[-1] == "back on B: every completion equals the fresh server's (tokens and logprobs)", run.stdout


def test_the_recipes_delta_step_refits_the_server_with_a_delta_round(server, b_at_start):
    """SECOND, before this module's sender joins: the recipe's step 3 with ``--mode delta``
    (docs/transport.md, "Delta rounds: the recipe"): the round to A is whole (no base yet), the
    round back to B a delta round against it, and every completion then equals the fresh
    server's."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "trainers" / "transport_refit.py"
    run = subprocess.run([sys.executable, str(script), "refit", server, "--port", str(free_port()), "--mode", "delta"],
                         env=dict(os.environ, QSTRAT_TRANSFER_SECRET=SECRET), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    lines = run.stdout.splitlines()
    assert lines[2].startswith("refit to B: delta kind=delta, wire "), run.stdout
    assert lines[-1] == "back on B: every completion equals the fresh server's (tokens and logprobs)", run.stdout
    assert digests(server) == b_at_start


@pytest.fixture(scope="module")
def sender(server, b_at_start):
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    from qstrat.transport import RefitSender

    s = RefitSender([HTTPVLLMWeightSyncClient(server, timeout=TIMEOUT_S)], "127.0.0.1", free_port(),
                    timeout_s=TIMEOUT_S, secret=SECRET)
    s.connect()
    yield s
    s.close()


def test_refused_round_carries_the_engines_reason_to_the_trainer(sender, ckpts):
    """An MXFP8 round to a block-FP8 engine: refused before any data; the trainer's exception
    names the engine's reason (the wire manifest against the engine's tensors), not only the
    HTTP status."""
    from qstrat.execute.driver import RefitDriver
    from qstrat.errors import WireManifestMismatchError

    with pytest.raises(WireManifestMismatchError) as err:
        sender.refit(RefitDriver("mxfp8", hf_config=ckpts["cfg"]), ckpts["a"])
    msg = str(err.value)
    assert "rank 1 rejected the wire manifest" in msg
    assert "HTTPError: 500 Server Error" in msg
    (said,) = [part for part in msg.split("; the engine said: ")[1:]]
    # the format first, in the in-process sink's words (qstrat.vllm.check_engine_format)
    assert "the round's format does not match the engine: " in said, said
    assert "(the engine does not serve the plan's format mxfp8)" in said and "weight_scale_inv" not in said, said


def digests(url) -> dict[str, str]:
    """The engine's SHA-256 of every parameter and buffer (:func:`qstrat.vllm.engine.weight_digests.tensor_digests`
    in the one worker, through vLLM's dev-mode ``/collective_rpc``)."""
    import requests

    out = requests.post(f"{url}/collective_rpc", json={"method": "qstrat_weight_digests"}, timeout=TIMEOUT_S)
    out.raise_for_status()
    (worker,) = out.json()["results"]
    return worker


def is_router(name: str) -> bool:
    return name.endswith(".mlp.gate.weight")


def test_valid_rounds_load_and_refit_back_restores_the_start(sender, ckpts, server, b_at_start):
    """After the refused round the engine's weights are B's at start-up; a round to A changes
    every quantized weight and every router; a plan of B without the routers is refused before
    sending; a round of B whose routers are not updated (A's sent again) leaves exactly the
    routers differing from the fresh engine (the check sees a router not updated); a whole round
    of B restores every weight bit for bit."""
    from qstrat.execute.driver import RefitDriver
    from qstrat.vllm.engine.weight_digests import tensor_digest
    from qstrat.errors import PlanError

    driver = RefitDriver("block-fp8", hf_config=ckpts["cfg"])
    routers = {k for k in b_at_start if is_router(k)}
    assert len(routers) == ckpts["cfg"]["num_hidden_layers"], sorted(b_at_start)
    # the routers as the engine computes with them are B's BF16 tensors exactly
    assert {k: b_at_start[k] for k in routers} == {k: tensor_digest(ckpts["b"][k]) for k in routers}
    assert digests(server) == b_at_start, "the refused round changed the engine"
    sender.refit(driver, ckpts["a"])
    on_a = digests(server)
    assert on_a.keys() == b_at_start.keys()
    changed = {k for k in on_a if on_a[k] != b_at_start[k]}
    assert {k: on_a[k] for k in routers} == {k: tensor_digest(ckpts["a"][k]) for k in routers}
    assert any(k.endswith("qkv_proj.weight") for k in changed) and any(k.endswith("weight_scale_inv") for k in changed)
    # a sender that leaves the routers out is refused before anything is sent ...
    skip_routers = driver.plan(ckpts["b"]).subset(lambda e: not is_router(e.name))
    with pytest.raises(PlanError, match="the plan sends nothing for model.layers.0.mlp.gate "):
        sender.refit(driver, ckpts["b"], plan=skip_routers)
    # ... so one that does not update them sends their current (A) values: the digests see it
    sender.refit(driver, {**ckpts["b"], **{k: v for k, v in ckpts["a"].items() if is_router(k)}})
    now = digests(server)
    assert {k for k in now if now[k] != b_at_start[k]} == routers, "only the routers must differ"
    assert all(now[k] == on_a[k] for k in routers)
    sender.refit(driver, ckpts["b"])
    assert digests(server) == b_at_start, "refit back to B vs the fresh engine on B"


def test_the_recipes_script_with_another_secret_says_so_in_one_line(server):
    """docs/transport.md's step 3 run with another secret than the server's: one line on stderr
    naming TransferAuthError and the engine's refusal, exit status 2, no traceback."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "trainers" / "transport_refit.py"
    run = subprocess.run([sys.executable, str(script), "refit", server, "--port", str(free_port())],
                         env=dict(os.environ, QSTRAT_TRANSFER_SECRET="another secret, 32 bytes or more...."),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 2, run.stdout + run.stderr[-4000:]
    assert "Traceback" not in run.stderr, run.stderr[-4000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("transport_refit.py: TransferAuthError: init_weight_transfer_engine failed before the "
                           "transfer group formed"), run.stderr[-4000:]
    assert "no valid authentication tag" in last and "Timed out" not in last, last
    assert run.stdout.splitlines() == ["fresh server: 3 greedy completions read"], run.stdout


def test_the_recipes_script_before_the_server_answers_says_so_in_one_line():
    """Step 3 run while no server answers at the URL (not started yet: the newcomer's first try):
    one line naming the URL and the step that starts it, exit status 2, no traceback. No engine."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "trainers" / "transport_refit.py"
    url = f"http://127.0.0.1:{free_port()}"
    run = subprocess.run([sys.executable, str(script), "refit", url], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stdout + run.stderr[-4000:]
    assert "Traceback" not in run.stderr, run.stderr[-4000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"transport_refit.py: no server at {url}/v1/models (is it started"), last
    assert last.endswith("step 2): ConnectionError"), last


def test_a_trainer_with_another_secret_is_refused_within_seconds(server):
    """The engine refuses an init signed with another secret at once; the trainer reports that
    refusal as it arrives, not after its rendezvous timed out (it took 61-76 s: the refusal came
    last in a "Timed out ... waiting for clients" message)."""
    import time

    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    from qstrat.errors import TransferAuthError
    from qstrat.transport import RefitSender

    intruder = RefitSender([HTTPVLLMWeightSyncClient(server, timeout=TIMEOUT_S)], "127.0.0.1", free_port(),
                           timeout_s=TIMEOUT_S, secret="another secret, 32 bytes or more....")
    began = time.monotonic()
    with pytest.raises(TransferAuthError) as err:
        intruder.connect()
    took = time.monotonic() - began
    assert took < 5, f"the refusal took {took:.1f} s"
    msg = str(err.value)
    assert msg.startswith("init_weight_transfer_engine failed before the transfer group formed"), msg
    assert "init_weight_transfer_engine refused: no valid authentication tag" in msg and "Timed out" not in msg, msg
