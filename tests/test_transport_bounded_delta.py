"""Bounded delta rounds (``RefitSender(mode="bounded-delta")``, issue 45), without an engine.

In process: the sender's real bucket stream (:func:`~qstrat.transport.delta.stream.send_patches`
into a recording group) replayed into the receiver's (:func:`~qstrat.transport.delta.receive.
receive_patches` with :class:`~qstrat.transport.receive.handoff.StreamUnits`): each reload unit is
handed right after the digest of the bucket holding its last byte verified - not before, not
later - holding the trainer's bytes; a corrupted bucket k stops the hand at k; a sender lost
after a unit was handed is a MIX.

Over the transport: this process is the trainer (rank 0), two spawned StandaloneReceivers are
ranks 1 and 2 over gloo (tests/transport_harness.py), keyed rounds; each receiver's load calls
are recorded by name. Checked against the receivers' actual tensors (SHA-256 of every tensor
equal to ``RefitDriver.run``'s output) and the reason the sender reports.
"""
from __future__ import annotations

import pytest
import torch

from qstrat.errors import MixedWeightsError
from qstrat.transport.delta import encoding as delta
from qstrat.transport.security.keys import ENV_SECRET
from qstrat.transport.wire_manifest import reload_unit

from transport_harness import adam_trajectory, connected_sender, counting_receivers, sha256, standalone_receivers
from transport_harness import held_digests as held, run_digests as want, sign_step as stepped

SECRET = "a shared secret for the bounded delta tests"
BUCKET = 64 << 10
TIMEOUT_S = 20
T = delta.TILE


# ---- the hand, in process ----------------------------------------------------------------------
class Recording:
    """Rank 0's group: keeps a copy of every broadcast, in order."""
    rank, world_size, device, timeout_s = 0, 2, torch.device("cpu"), 1.0

    def __init__(self):
        self.sent = []

    def broadcast(self, t):
        self.sent.append(t.clone())

    def wait(self, work):
        pass


class Replaying:
    """Rank 1's group: each broadcast receives the next recorded one; the wait for message
    ``lose_at`` raises as c10d does when the sender is gone."""
    rank, world_size, device, timeout_s = 1, 2, torch.device("cpu"), 1.0

    def __init__(self, sent, lose_at=None):
        self.sent, self.lose_at, self.n, self.closed = sent, lose_at, 0, False

    def broadcast(self, t):
        t.copy_(self.sent[self.n])
        self.n += 1
        return self.n - 1

    def wait(self, work):
        if work == self.lose_at:
            raise RuntimeError("Connection closed by peer")

    def close(self):
        self.closed = True


def _layers(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = {}
    for i in range(6):  # units straddling bucket and tile edges, two tensors per layer
        shapes[f"model.layers.{i}.mlp.weight"] = (2 * T + 3001 * i,)
        shapes[f"model.layers.{i}.norm.weight"] = (T // 3 + 17 * i,)
    shapes["lm_head.weight"] = (T + 5,)
    return {n: torch.randint(0, 256, s, dtype=torch.uint8, generator=g) for n, s in shapes.items()}


def test_a_unit_is_handed_right_after_the_digest_of_the_bucket_holding_its_last_byte():
    from qstrat.transport.delta.receive import PatchDecoder, receive_patches
    from qstrat.transport.delta.stream import PatchEncoder, encode_round, send_patches
    from qstrat.transport.receive.handoff import StreamUnits
    from qstrat.transport.security.seal import Sealer
    from qstrat.transport.timing import Phases
    from qstrat.transport.wire_manifest import build_wire_manifest
    from qstrat.transport.protocol import DELTA

    old = _layers(1)
    new = {n: t.clone() for n, t in old.items()}
    for i, t in enumerate(new.values()):
        t[(torch.arange(0, t.numel(), 997) + i) % t.numel()] ^= 0x11
    target = build_wire_manifest([(n, "uint8", tuple(t.shape)) for n, t in new.items()], 2 * T, 16)
    cuts = delta.cuts(target)
    assert any(0 < (b.stream_offset + b.nbytes) % T for b in target.buckets)  # tiles straddle buckets
    base = encode_round(target, iter(old.items()), None)[0].new_base()
    # the oracle: a unit's last byte in the stream, and the first bucket whose patch covers it
    starts = [b.stream_offset for b in target.buckets]
    ends = {}
    for s in target.slots:
        u = reload_unit(s.name)
        ends[u] = max(ends.get(u, 0), starts[s.bucket] + s.offset + s.nbytes)
    last = {u: min(k for k in range(len(target.buckets)) if e - 1 < cuts[k + 1]) for u, e in ends.items()}
    assert len(set(last.values())) > 2 and len(target.buckets) > 4
    mac = b"r" * 32
    sealer = Sealer(None, mac, torch.device("cpu"))

    def run(corrupt=None, lose_at=None):
        enc = PatchEncoder(target, iter(new.items()), base)
        rec = Recording()
        assert send_patches(rec, target, enc, sealer, Phases("source_s", "pack_s", "seal_s", "wait_s")) is None
        held = base
        if corrupt is not None:  # the receiver's base, a byte under bucket ``corrupt``'s tiles
            held = delta.Base(base.round_id, base.target, base.stream.clone())
            held.stream[cuts[corrupt] + 7] ^= 1
        decoder = PatchDecoder(enc.info, target, held, None, mac)
        verified, handed = [], []
        apply = decoder.apply

        def checked(k, payload):
            apply(k, payload)
            verified.append(k)

        def on_unit(u, tensors):
            assert verified and verified[-1] == last[u], (u, verified, last[u])  # right after its bucket
            assert {n: sha256(t) for n, t in tensors} == {n: sha256(new[n]) for n, _ in tensors}
            handed.append(u)

        decoder.apply = checked
        group = Replaying(rec.sent, lose_at)
        units = StreamUnits(target, decoder.cuts, on_unit)
        out = receive_patches(group, target, Sealer(None, mac, torch.device("cpu")), decoder, {}, units)
        return out, handed, units, group, rec

    (staged, failure), handed, units, _, _ = run()
    assert failure is None and handed == units.handed == list(ends)  # every unit, in wire order
    assert {n: sha256(t) for n, t in staged} == {n: sha256(t) for n, t in new.items()}
    k = next(k for k in range(3, len(cuts) - 1) if cuts[k + 1] > cuts[k])  # a bucket with tiles
    (staged, failure), handed, _, _, _ = run(corrupt=k)
    assert staged == [] and failure[0] == DELTA and f"bucket {k} (" in failure[1]
    assert handed == [u for u in ends if last[u] < k] and handed  # the units before k, none after
    # the sender lost while bucket k's prelude was awaited: the units before it were loaded - a MIX
    _, _, _, _, rec = run()
    prelude_k = next(i for i, m in enumerate(rec.sent) if m.dtype == torch.int64 and m.numel() == 4 and int(m[1]) == k)
    with pytest.raises(MixedWeightsError, match=rf"rank 1: delta stream: stream truncated at delta bucket {k}/"
                                                rf".*loading had begun: {len(handed)} of {len(ends)} reload units "
                                                r"are new .*this receiver holds a MIX"):
        run(lose_at=prelude_k)


# ---- rounds over the transport ----------------------------------------------------------------
@pytest.fixture(scope="module")
def receivers(tiny):
    with counting_receivers(tiny[3], SECRET) as rs:
        yield rs


def calls(receivers):
    """Per receiver, the reload units of each load call since the last query."""
    return [[sorted({reload_unit(n) for n in names}) for names in r.ctl.call("load_calls")] for r in receivers]


def units_of(wire_manifest):
    out = []
    for s in wire_manifest.slots:
        if reload_unit(s.name) not in out:
            out.append(reload_unit(s.name))
    return out


def sender_for(receivers):
    """A connected bounded-delta sender to ``receivers``."""
    return connected_sender(receivers, "bounded-delta", SECRET, BUCKET, TIMEOUT_S)


def test_a_corrupted_bucket_k_mixes_the_units_before_k_and_the_round_is_sent_again_whole(receivers, tiny):
    """Rank 1's base has a flipped byte under bucket k: the units whose bytes end before bucket
    k were loaded (each verified), bucket k's digest fails - a MIX (not a quiet fallback: rank 1
    votes DELTA holding new weights, both sides drop their bases) - and the sender sends the
    same round again whole, in bounded mode, at once: every unit loaded again, both receivers
    exact, the flag cleared, the new base shared."""
    driver, trainer, _, _ = tiny
    sender = sender_for(receivers)
    target = sender.refit(driver, trainer).wire_manifest
    calls(receivers)
    k = len(target.buckets) // 2
    cuts = delta.cuts(target)
    receivers[0].ctl.call("corrupt_base", cuts[k] + 7)
    trainer = stepped(trainer, 1e-5, 11)
    report = sender.refit(driver, trainer)
    d = report.delta
    assert d.kind == "full" and d.attempts == 2, d
    assert d.reason.startswith("the engines hold a MIX after the delta: round not committed: rank 1 did not "
                               "reconstruct the delta round to the trainer's digests"), d.reason
    assert "ranks 1, 2 hold new weights" in d.reason and f"bucket {k} (" in d.reason, d.reason
    starts = [b.stream_offset for b in target.buckets]
    ends = {}
    for s in target.slots:
        ends[reload_unit(s.name)] = max(ends.get(reload_unit(s.name), 0), starts[s.bucket] + s.offset + s.nbytes)
    before_k = [[u] for u in units_of(target) if ends[u] <= cuts[k]]
    every = [[u] for u in units_of(target)]
    assert before_k and len(before_k) < len(every)
    assert calls(receivers) == [before_k + every, every + every]
    assert held(receivers) == [want(driver, trainer)] * 2
    assert [r.ctl.call("mixed") for r in receivers] == [None, None] and sender.mixed is None
    assert [r.ctl.call("delta_base") for r in receivers] == [sender.base.round_id] * 2
    d = sender.refit(driver, stepped(trainer, 1e-5, 12)).delta  # and the next round is a delta again
    assert d.kind == "delta" and d.attempts == 1, d
    assert held(receivers) == [want(driver, stepped(trainer, 1e-5, 12))] * 2
    sender.close()


def test_a_corrupted_bucket_on_the_wire_after_units_loaded_is_a_mix_and_the_next_round_is_whole(receivers, tiny):
    """A bucket failing its seal (not the delta: the wire) after units were loaded: a MIX the
    sender raises (MixedWeightsError, no resend), both bases dropped, rank 1 flagged; the next
    round is whole ("no base") and repairs it."""
    driver, trainer, _, _ = tiny
    sender = sender_for(receivers)
    target = sender.refit(driver, trainer).wire_manifest
    k = len(target.buckets) // 2
    receivers[0].ctl.call("inject", {"corrupt_bucket": k})
    with pytest.raises(MixedWeightsError, match=r"rank 1 failed after loading began \(holds a mix\)"):
        sender.refit(driver, stepped(trainer, 1e-5, 14))
    assert sender.base is None and sender.mixed and "ranks 1, 2 hold new weights" in sender.mixed
    assert [r.ctl.call("delta_base") for r in receivers] == [None, None]
    assert receivers[0].ctl.call("mixed") and receivers[1].ctl.call("mixed")
    sender.connect()  # a new group (the wrapped one is dropped)
    trainer = stepped(trainer, 1e-5, 15)
    d = sender.refit(driver, trainer).delta
    assert d.kind == "full" and d.reason.startswith("no base") and d.attempts == 1, d
    assert held(receivers) == [want(driver, trainer)] * 2
    assert [r.ctl.call("mixed") for r in receivers] == [None, None]
    sender.close()


FORMATS = {"block-fp8": "block-fp8", "mxfp8": "mxfp8",
           "nvfp4": {"rules": [{"select": "linear", "serializer": "nvfp4"}]}}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_bounded_delta_is_exact_every_adam_step_per_format(fmt, tiny):
    """Per format (block FP8, MXFP8, NVFP4): a whole round, then four real Adam steps (lr 1e-6,
    tests/transport_harness.adam_trajectory) as bounded delta rounds: each a delta, each loaded
    unit by unit, the receiver's tensors equal ``RefitDriver.run``'s after every step."""
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver

    model = build_tiny_qwen3_moe(seed=1)
    driver = RefitDriver(FORMATS[fmt], hf_config=hf_config(model))
    with standalone_receivers("", n=1, env={ENV_SECRET: SECRET}) as rs:
        rs[0].ctl.call("count_loads")
        sender = sender_for(rs)
        kinds = []
        for step, state in enumerate(adam_trajectory(model, 1e-6, 4)):
            report = sender.refit(driver, state)
            kinds.append(report.delta.kind)
            assert held(rs) == [want(driver, state)], f"step {step}"
            assert calls(rs) == [[[u] for u in units_of(report.wire_manifest)]]
        sender.close()
    assert kinds == ["full"] + ["delta"] * 4
