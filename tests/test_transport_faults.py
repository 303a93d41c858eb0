"""The transport's promises when ONE peer fails or lies (issue 30), without an engine.

This process is the trainer (rank 0); two spawned StandaloneReceiver processes are ranks 1 and
2, over gloo on localhost (tests/transport_harness.py). Every fault is injected from OUTSIDE
the production path: a wrapped process group (``FaultyGroup``, as c10d's tests wrap theirs) on
the sender or on ONE receiver, a wrapped loader in one receiver, a wrapped RPC client, or a
source that raises. Checked, each against the receivers' actual tensors and flags:

* a round is committed everywhere, refused everywhere (nothing loaded anywhere), or MIXED:
  flagged on every rank holding anything new and MixedWeightsError on the sender naming them -
  one rank's seal failing while the other loads (bounded and atomic), a load raising inside
  ``finish_weight_update`` on one of two receivers, a malicious commit vote;
* a flagged receiver refuses a partial refit until a whole one loads;
* a keyed round recorded on the wire, replayed into RESTARTED receivers with the challenge
  all-reduce rewritten to the recorded vector, is refused (the receivers bind the challenge
  they drew);
* a source raising mid-stream (any class) aborts the round at once (not after the timeout),
  closes the group, and is raised as itself; in bounded mode it is a flagged mix;
* another protocol version is refused in the accept vote; an init without the secret's tag
  leaves the live group working; a hung RPC does not block the next call; a sender without a
  secret warns once.
"""
from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from qstrat.errors import MixedWeightsError, TransferAuthError, TransportError, WireManifestMismatchError
from qstrat.transport import RefitSender
from qstrat.transport.security.keys import ENV_SECRET
from qstrat.transport.wire_manifest import build_wire_manifest, reload_unit, wire_manifest_for_plan

from transport_harness import (EditingClient, free_port, sha256, standalone_receivers,
                               wrap_group)

SECRET = "a shared secret for the fault tests"
BUCKET = 64 << 10
TIMEOUT_S = 20


@pytest.fixture(scope="module")
def receivers(tiny):
    with standalone_receivers(tiny[3], env={ENV_SECRET: SECRET}) as rs:
        yield rs


def sender_for(receivers, mode="atomic", port=None, clients=None, **kw):
    s = RefitSender(clients or [r.rpc for r in receivers], "127.0.0.1", port or free_port(), timeout_s=TIMEOUT_S,
                    bucket_bytes=BUCKET, secret=kw.pop("secret", SECRET), mode=mode,
                    delta_min_bucket_bytes=kw.pop("delta_min_bucket_bytes", 0), **kw)  # delta: many buckets
    s.connect()
    return s


def want(driver, trainer):
    return {name: sha256(t) for name, t in driver.run(trainer)}


def state(receivers):
    return [(r.ctl.call("digests"), r.ctl.call("mixed")) for r in receivers]


def start_from(receivers, tiny, trainer):
    """Both receivers hold ``trainer``'s round, unflagged (a whole keyed round)."""
    s = sender_for(receivers)
    s.refit(tiny[0], trainer)
    s.close()
    assert state(receivers) == [(want(tiny[0], trainer), None)] * 2


def test_one_ranks_seal_fails_while_the_other_loads_bounded_is_a_flagged_mix(receivers, tiny):
    """Bounded mode: rank 2's first bucket fails its seal before it loads anything; rank 1 loads
    the whole round. Rank 1 holds new weights of a round that was not committed everywhere: it
    is flagged, the sender raises MixedWeightsError naming it; rank 2 (nothing new) is not. A
    partial refit is then refused, a whole one repairs and clears the flag."""
    driver, trainer_a, trainer_b, _ = tiny
    start_from(receivers, tiny, trainer_a)
    old, new = want(driver, trainer_a), want(driver, trainer_b)
    sender = sender_for(receivers, "bounded")
    receivers[1].ctl.call("inject", {"corrupt_bucket": 0})  # rank 2 only
    with pytest.raises(MixedWeightsError) as err:
        sender.refit(driver, trainer_b)
    msg = str(err.value)
    assert "rank 2 a bucket failed its checksum" in msg and "ranks 1 hold new weights" in msg, msg
    assert sender.mixed is not None and "ranks 1 hold new weights" in sender.mixed
    (got1, flag1), (got2, flag2) = state(receivers)
    assert got1 == new and got2 == old and flag2 is None
    assert flag1 is not None and "ranks holding new weights: 1" in flag1, flag1
    plan = driver.plan(trainer_b)
    with pytest.raises(WireManifestMismatchError, match=r"rank 1 rejected the wire manifest"):
        sender.refit(driver, trainer_b, plan=plan.only_layers([2, 3]))
    sender.close()
    whole = sender_for(receivers, "bounded")
    whole.refit(driver, trainer_b)
    assert state(receivers) == [(new, None)] * 2 and whole.mixed is None
    whole.close()


def test_one_ranks_seal_fails_while_the_other_verifies_atomic_loads_nothing_anywhere(receivers, tiny):
    driver, trainer_a, trainer_b, _ = tiny
    start_from(receivers, tiny, trainer_a)
    sender = sender_for(receivers, "atomic")
    receivers[1].ctl.call("inject", {"corrupt_bucket": 0})
    with pytest.raises(TransportError) as err:
        sender.refit(driver, trainer_b)
    assert type(err.value) is TransportError and "nothing loaded" in str(err.value)
    assert state(receivers) == [(want(driver, trainer_a), None)] * 2 and sender.mixed is None
    sender.close()


def test_a_load_raising_inside_finish_on_one_of_two_receivers_flags_it(receivers, tiny):
    """Atomic mode: the round is committed, then rank 1's load raises after 5 tensors (out of
    memory part-way). Rank 1 is flagged and refuses partial refits; the sender raises
    MixedWeightsError naming engine 0 (rank 1); rank 2 loaded the round. A whole refit repairs."""
    driver, trainer_a, trainer_b, _ = tiny
    start_from(receivers, tiny, trainer_a)
    old, new = want(driver, trainer_a), want(driver, trainer_b)
    sender = sender_for(receivers)
    receivers[0].ctl.call("fail_load", 5)
    with pytest.raises(MixedWeightsError) as err:
        sender.refit(driver, trainer_b)
    msg = str(err.value)
    assert "finish_weight_update failed on engine(s) [0] (ranks [1]); engine(s) [1] loaded the round" in msg, msg
    assert "simulated out of memory while loading" in msg, msg
    (got1, flag1), (got2, flag2) = state(receivers)
    names = [s.name for s in wire_manifest_for_plan(driver.plan(trainer_b), BUCKET).slots]
    assert got1 == {n: (new[n] if n in names[:5] else old[n]) for n in old}
    assert flag1 == "RuntimeError: simulated out of memory while loading" and (got2, flag2) == (new, None)
    with pytest.raises(WireManifestMismatchError, match=r"holds a MIX of two rounds \(RuntimeError: simulated"):
        sender.refit(driver, trainer_b, plan=driver.plan(trainer_b).only_layers([0]))
    sender.refit(driver, trainer_b)
    assert state(receivers) == [(new, None)] * 2 and sender.mixed is None
    sender.close()


def test_a_malicious_commit_vote_cannot_make_one_rank_keep_an_unflagged_round(receivers, tiny):
    """Bounded, keyed: rank 2 fails its first seal; the all-reduce rank 1 sees is rewritten so
    that every other rank's commit status reads OK. Rank 1's check of the votes' tags refuses
    the forged OK: it flags itself (it loaded the round), the sender names it."""
    driver, trainer_a, trainer_b, _ = tiny
    start_from(receivers, tiny, trainer_a)
    sender = sender_for(receivers, "bounded")
    receivers[0].ctl.call("inject", {"forge_commit": True})
    receivers[1].ctl.call("inject", {"corrupt_bucket": 0})
    with pytest.raises(MixedWeightsError, match="ranks 1 hold new weights"):
        sender.refit(driver, trainer_b)
    (got1, flag1), (got2, flag2) = state(receivers)
    assert got1 == want(driver, trainer_b) and flag1 is not None and "a rewritten all-reduce" in flag1, flag1
    assert (got2, flag2) == (want(driver, trainer_a), None)
    sender.close()
    start_from(receivers, tiny, trainer_a)  # a whole round repairs


def test_a_recorded_round_replayed_with_a_rewritten_challenge_sum_into_restarted_receivers_is_refused(tiny):
    """A peer without the secret records a keyed round on the wire (init infos, every broadcast,
    every all-reduce). The receivers restart (fresh processes: no counter remembered). It then
    plays the tape back as rank 0 on the same address, with the challenge all-reduce each
    receiver sees rewritten to the recorded vector: every receiver refuses (its own challenge is
    not in the round), nothing is loaded."""
    driver, _, trainer_b, ckpt = tiny
    port = free_port()
    with standalone_receivers(ckpt, env={ENV_SECRET: SECRET}) as rs:
        sender = sender_for(rs, port=port)
        infos = sender.init_infos()
        tap = wrap_group(sender.group, record=True)
        sender.refit(driver, trainer_b)
        sender.close()
        assert [r.ctl.call("digests") for r in rs] == [want(driver, trainer_b)] * 2
    tape = {(kind, bucket, piece): t for kind, bucket, piece, t in tap.posted}
    del tap  # it holds the recorded group's process group, whose store holds the port
    import gc

    gc.collect()
    vote_width = tape[("accept", -1, 0)].numel() // 3  # the sender's slot of a 3-rank vote
    with standalone_receivers(ckpt, env={ENV_SECRET: SECRET}) as rs:
        replay_infos = iter(infos)
        clients = [EditingClient(r.rpc, lambda m, a: (next(replay_infos),) if m == "init_weight_transfer_engine" else a)
                   for r in rs]
        attacker = sender_for(rs, port=port, clients=clients, secret=None)
        for r in rs:
            r.ctl.call("inject", {"challenge": tape[("challenge", -1, 0)].tolist()})

        def contribute(step, t):
            if step != "challenge":
                t[:vote_width] = tape[(step, -1, 0)][:vote_width]

        wrap_group(attacker.group, header=lambda t: tape[("round", -1, 0)],
                   wire=lambda bucket, piece, t: tape[("payload", bucket, piece)],
                   bucket_header=lambda bucket, t: tape[("bucket_header", bucket, 0)], contribute=contribute)
        with pytest.raises(TransferAuthError) as err:
            attacker.refit(driver, trainer_b)
        msg = str(err.value)
        assert msg.count("the round does not carry the challenge this receiver drew") == 2, msg
        assert [r.ctl.call("digests") for r in rs] == [{}, {}]
        attacker.close()


@pytest.mark.parametrize("error", [ValueError("a NaN scale in layer 2"),
                                   RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   type("CompilationError", (Exception,), {})("triton: at 12:4: unsupported")],
                         ids=["ValueError", "RuntimeError", "CompilationError"])
def test_a_source_exception_of_any_class_aborts_at_once_and_is_raised_as_itself(receivers, tiny, error):
    """The quantizing source raises mid-stream: the receivers hear ABORT at once (the round ends
    well inside the 20 s timeout), the group is closed, nothing is loaded anywhere, and the
    sender raises the source's own exception (not "a receiver died?")."""
    driver, trainer_a, trainer_b, _ = tiny
    start_from(receivers, tiny, trainer_a)
    sender = sender_for(receivers)
    plan = driver.plan(trainer_b)
    wm = wire_manifest_for_plan(plan, BUCKET)
    emitted = list(driver.execute(plan, trainer_b))

    def source():
        yield from emitted[:len(emitted) // 2]
        raise error

    t0 = time.perf_counter()
    with pytest.raises(type(error)) as err:
        sender.send(wm, source())
    elapsed = time.perf_counter() - t0
    print(f"[timing] source raised mid-stream -> the sender raised it, both receivers answered: {elapsed:.2f} s "
          f"(group timeout {TIMEOUT_S} s; half the round's quantization included)")
    assert err.value is error and elapsed < TIMEOUT_S / 2, elapsed
    notes = "\n".join(getattr(err.value, "__notes__", []))
    assert notes.count("the sender aborted the stream at bucket") == 2, notes
    assert sender.group is None
    assert state(receivers) == [(want(driver, trainer_a), None)] * 2


def test_a_source_exception_in_a_bounded_round_is_a_flagged_mix_caused_by_it(receivers, tiny):
    driver, trainer_a, trainer_b, _ = tiny
    start_from(receivers, tiny, trainer_a)
    sender = sender_for(receivers, "bounded")
    plan = driver.plan(trainer_b)
    wm = wire_manifest_for_plan(plan, BUCKET)
    emitted = list(driver.execute(plan, trainer_b))
    error = RuntimeError("CUDA out of memory while quantizing")

    def source():
        yield from emitted[:len(emitted) // 2]
        raise error

    with pytest.raises(MixedWeightsError) as err:
        sender.send(wm, source())
    assert err.value.__cause__ is error and "ranks 1, 2 hold new weights" in str(err.value)
    assert "the sender aborted the stream (bucket " in str(err.value) and sender.group is None
    old, new = want(driver, trainer_a), want(driver, trainer_b)
    for got, flag in state(receivers):
        assert flag is not None and got != old and got != new
        assert all(got[n] in (old[n], new[n]) for n in old)
        assert {reload_unit(n) for n in old if got[n] == new[n] != old[n]} <= {reload_unit(n) for n, _ in emitted[:len(emitted) // 2]}
    start_from(receivers, tiny, trainer_a)  # a whole round repairs and clears both flags


def test_another_protocol_version_is_refused_in_the_accept_vote(receivers, tiny):
    driver, trainer_a, trainer_b, _ = tiny
    start_from(receivers, tiny, trainer_a)

    def older(method, args):
        if method == "update_weights":
            args[0]["protocol"] = 1
        return args

    clients = [receivers[0].rpc, EditingClient(receivers[1].rpc, older)]
    sender = sender_for(receivers, clients=clients)
    t0 = time.perf_counter()
    with pytest.raises(TransportError) as err:
        sender.refit(driver, trainer_b)
    assert time.perf_counter() - t0 < TIMEOUT_S / 2
    msg = str(err.value)
    assert "round refused before any data: rank 2 speaks another transport protocol version (this qstrat: 3)" in msg
    assert "update_info names transport protocol 1, this engine speaks 3" in msg, msg
    assert state(receivers) == [(want(driver, trainer_a), None)] * 2
    sender.close()


def test_an_init_refused_over_http_is_a_transfer_auth_error():
    """Over HTTP (vLLM's server) the engine's exception class does not travel, only its words:
    an engine's refusal of an unsigned init still reaches the trainer as TransferAuthError."""
    from qstrat.transport.security.auth import INIT_REFUSED

    class HttpClient:  # what vLLM's HTTP client raises for the engine's refusal (HTTP 500)
        def init_weight_transfer_engine(self, info):
            raise RuntimeError(f"500 Server Error: the engine said: {INIT_REFUSED} (this engine holds a "
                               "transfer secret; the caller holds none or another key); the live group is kept")

    sender = RefitSender([HttpClient()], "127.0.0.1", free_port(), timeout_s=1)
    with pytest.raises(TransferAuthError, match="init_weight_transfer_engine refused: no valid authentication tag"):
        sender.connect()


def test_an_init_without_the_secrets_tag_leaves_the_live_group_working(receivers, tiny):
    driver, trainer_a, trainer_b, _ = tiny
    start_from(receivers, tiny, trainer_a)
    live = sender_for(receivers)
    intruder = RefitSender([r.rpc for r in receivers], "127.0.0.1", free_port(), timeout_s=60)
    began = time.monotonic()
    with pytest.raises(TransferAuthError) as err:
        intruder.connect()
    # reported as the engines answer, not after the 60 s rendezvous (it took 61-76 s)
    assert time.monotonic() - began < 5, f"the refusal took {time.monotonic() - began:.1f} s"
    assert str(err.value).count("init_weight_transfer_engine refused: no valid authentication tag") == 2
    assert "Timed out" not in str(err.value)
    live.refit(driver, trainer_b)  # the live group still works
    assert state(receivers) == [(want(driver, trainer_b), None)] * 2
    live.close()


def test_a_hung_rpc_neither_blocks_the_next_call_nor_the_interpreters_exit():
    release = threading.Event()

    class Client:
        calls = 0

        def start_weight_update(self):
            Client.calls += 1
            if Client.calls == 1:
                release.wait(60)  # a call that hangs (vLLM's HTTP client waits 300 s)

    sender = RefitSender([Client()], "127.0.0.1", 1, timeout_s=1)
    with pytest.raises(TransportError, match=r"start_weight_update failed: .*engine 0: no answer within 1 s"):
        sender.engines.call_all("start_weight_update")
    sender.engines.call_all("start_weight_update")  # answered, though the first call still hangs
    hung = [t for t in threading.enumerate() if t.name == "qstrat-rpc"]
    assert hung and all(t.daemon for t in hung)
    release.set()


def test_a_sender_without_a_secret_warns_once(caplog, monkeypatch):
    monkeypatch.delenv(ENV_SECRET, raising=False)

    class Group:
        pg, device, world_size, rank, timeout_s = object(), torch.device("cpu"), 2, 0, 1.0

        def sum(self, tensor):
            raise RuntimeError("no peers here")

        def close(self):
            pass

    class Client:
        def __getattr__(self, name):
            return lambda *a: None

    wm = build_wire_manifest([("x", "uint8", (4,))])
    with caplog.at_level(logging.WARNING, logger="qstrat.transport"):
        for _ in range(2):
            senders = [RefitSender([Client()], "127.0.0.1", 1, timeout_s=1) for _ in range(2)]
            for s in senders:
                for _ in range(2):
                    s.group = Group()
                    with pytest.raises(TransportError, match="no peers here"):
                        s.send(wm, iter([]))
    warned = [r for r in caplog.records if r.name == "qstrat.transport"]
    assert len(warned) == 4 and all("rounds without a secret" in r.getMessage() for r in warned)
