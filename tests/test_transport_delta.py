"""Delta rounds (``RefitSender(mode="delta")``, issue 34), without an engine.

Unit part (in process): every encoding decodes to the exact bytes, at densities from none to
all, for 1-, 2- and 4-byte words and run lengths past the uint16 escape; the encoding chosen is
the smallest; a blob that does not fit its tensor, or a sparse blob without a base, is refused
naming the tensor.

Transport part: this process is the trainer (rank 0), two spawned StandaloneReceivers are ranks
1 and 2 over gloo (tests/transport_harness.py), keyed rounds. Faults are injected from OUTSIDE
the production path: another sender (a restarted trainer), restarted receiver processes, a
receiver's base bytes flipped under its session (memory corruption), a wrapped process group
corrupting a bucket. Checked each time against the receivers' actual tensors (SHA-256 of every
tensor equal to ``RefitDriver.run``'s output) and the reason the sender reports.
"""
from __future__ import annotations

import pytest
import torch

from qstrat.errors import TransportError
from qstrat.transport import RefitSender, delta
from qstrat.transport.keys import ENV_SECRET

from transport_harness import free_port, sha256, standalone_receivers

SECRET = "a shared secret for the delta tests"
BUCKET = 64 << 10
TIMEOUT_S = 20


# ---- encodings (in process) -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("density", [0.0, 1e-5, 4e-3, 0.05, 0.3, 1.0])
def test_every_density_decodes_to_the_exact_bytes_with_the_smallest_encoding(dtype, density):
    g = torch.Generator().manual_seed(7)
    n = 100_003
    old = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    new = old.clone()
    w = delta.words(new, dtype.itemsize)
    w[torch.rand(n, generator=g) < density] ^= 1
    enc, blob = delta.encode(new, old, dtype.itemsize)
    assert torch.equal(delta.decode(blob, old, new.numel(), dtype.itemsize, "t"), new)
    changed = int((delta.words(new, dtype.itemsize) != delta.words(old, dtype.itemsize)).sum())
    pos = torch.nonzero(delta.words(new, dtype.itemsize) != delta.words(old, dtype.itemsize)).reshape(-1)
    sizes = delta.encoded_sizes(n, changed, delta.rle_tokens(pos).numel(), dtype.itemsize)
    assert blob.numel() == 32 + min(sizes.values()) and sizes[enc] == min(sizes.values())


@pytest.mark.parametrize("positions", [[0], [65534], [65535], [65536], [131070], [131071, 131072],
                                       [5, 6, 7, 200_000, 299_999]])
def test_run_lengths_past_the_escape_decode_exactly(positions):
    p = torch.tensor(positions)
    tokens = delta.rle_tokens(p)
    assert torch.equal(delta.rle_positions(tokens), p)
    assert int(tokens.max()) <= delta.RLE_ESCAPE
    old = torch.zeros(300_000, dtype=torch.uint8)
    new = old.clone()
    new[p] = 9
    enc, blob = delta.encode(new, old, 1)
    assert torch.equal(delta.decode(blob, old, 300_000, 1, "t"), new)


def test_a_blob_that_does_not_fit_or_lacks_its_base_is_refused_naming_the_tensor():
    old = torch.zeros(4096, dtype=torch.uint8)
    new = old.clone()
    new[[3, 100]] = 1
    enc, blob = delta.encode(new, old, 1)
    assert enc == "rle"
    with pytest.raises(delta.DeltaError, match=r"blob of layers.0.w: a sparse blob, and this receiver holds no base"):
        delta.decode(blob, None, 4096, 1, "layers.0.w")
    with pytest.raises(delta.DeltaError, match=r"blob of w: header .* does not fit a tensor of 4095 bytes"):
        delta.decode(blob, old, 4095, 1, "w")
    with pytest.raises(delta.DeltaError, match=r"blob of w: body of \d+ bytes, its header says"):
        delta.decode(blob[:-1], old, 4096, 1, "w")
    bad = blob.clone()
    bad[32:34] = torch.tensor([255, 255], dtype=torch.uint8)  # first token: an escape -> position past the end
    bad[34:36] = torch.tensor([255, 255], dtype=torch.uint8)
    with pytest.raises(delta.DeltaError, match=r"blob of w: positions do not fit"):
        delta.decode(bad, old, 4096, 1, "w")


# ---- rounds over the transport ----------------------------------------------------------------
@pytest.fixture(scope="module")
def receivers(tiny):
    with standalone_receivers(tiny[3], env={ENV_SECRET: SECRET}) as rs:
        for r in rs:
            r.ctl.call("count_loads")
        yield rs


def sender_for(receivers, mode="delta"):
    s = RefitSender([r.rpc for r in receivers], "127.0.0.1", free_port(), timeout_s=TIMEOUT_S,
                    bucket_bytes=BUCKET, secret=SECRET, mode=mode)
    s.connect()
    return s


def stepped(trainer, lr, seed):
    """A sign-like Adam update of size ``lr`` on every floating tensor (the issue's model)."""
    g = torch.Generator().manual_seed(seed)
    return {n: (t.float() + lr * torch.randn(t.shape, generator=g).sign()).to(t.dtype)
            if t.is_floating_point() else t for n, t in trainer.items()}


def want(driver, trainer):
    return {name: sha256(t) for name, t in driver.run(trainer)}


def held(receivers):
    return [r.ctl.call("digests") for r in receivers]


def loads(receivers):
    return [r.ctl.call("loads") for r in receivers]


def test_first_round_is_whole_then_deltas_give_the_exact_tensors_in_fewer_bytes(receivers, tiny):
    driver, _, trainer, _ = tiny
    sender = sender_for(receivers)
    first = sender.refit(driver, trainer)
    assert first.delta.kind == "full" and first.delta.reason.startswith("no base")
    assert held(receivers) == [want(driver, trainer)] * 2
    base_ids = {r.ctl.call("delta_base")[0] for r in receivers}
    assert base_ids == {sender.base.round_id}
    for step in range(2):
        trainer = stepped(trainer, 1e-5, step)
        report = sender.refit(driver, trainer)
        d = report.delta
        assert d.kind == "delta" and d.reason is None and d.attempts == 1, d
        assert d.wire_bytes == report.bytes < d.full_bytes / 2, d
        assert held(receivers) == [want(driver, trainer)] * 2
        assert [r.ctl.call("delta_base")[1] for r in receivers] == [want(driver, trainer)] * 2
    sender.close()


def test_a_base_from_another_trainer_turns_the_round_whole_with_the_reason(receivers, tiny):
    """Trainer 1 holds base r1; a restarted trainer 2 refits (whole: no base) -> the engines hold
    r2. Trainer 1's next delta (against r1) is refused in the accept vote, before any data, and
    sent again whole; the engines hold exactly its round."""
    driver, trainer_a, trainer_b, _ = tiny
    one = sender_for(receivers)
    one.refit(driver, trainer_a)
    one.close()
    two = sender_for(receivers)
    assert two.refit(driver, trainer_b).delta.reason.startswith("no base")
    two.close()
    before = loads(receivers)
    one.connect()
    report = one.refit(driver, stepped(trainer_a, 1e-5, 1))
    d = report.delta
    assert d.kind == "full" and d.attempts == 2, d
    assert "the engines refused the delta: delta refused before any data" in d.reason, d.reason
    assert "rank 1 does not hold the delta round's base" in d.reason and "rank 2 does not hold" in d.reason
    assert held(receivers) == [want(driver, stepped(trainer_a, 1e-5, 1))] * 2
    assert [a - b for a, b in zip(loads(receivers), before)] == [1, 1]  # the whole round only
    one.close()


def test_a_round_in_another_mode_in_between_drops_the_base(receivers, tiny):
    """A partial atomic refit between two delta rounds: the engines' weights moved outside the
    delta's bookkeeping, so they drop their base and the next delta round goes whole."""
    driver, trainer_a, trainer_b, _ = tiny
    sender = sender_for(receivers)
    sender.refit(driver, trainer_a)
    sender.close()
    partial = sender_for(receivers, "atomic")
    partial.refit(driver, trainer_b, plan=driver.plan(trainer_b).only_layers([0]))
    partial.close()
    assert [r.ctl.call("delta_base") for r in receivers] == [None, None]
    sender.connect()
    trainer = stepped(trainer_a, 1e-5, 5)
    d = sender.refit(driver, trainer).delta
    assert d.kind == "full" and d.attempts == 2, d
    assert "rank 1 does not hold the delta round's base" in d.reason, d.reason
    assert held(receivers) == [want(driver, trainer)] * 2
    sender.close()


def test_a_corrupted_base_is_refused_before_loading_and_the_round_sent_whole(receivers, tiny):
    """Rank 2's base copy of one tensor has a flipped bit: its reconstruction's digest differs
    from the trainer's, so rank 2 refuses in the commit vote, NOTHING is loaded anywhere (the
    load counters move by one: the whole round that follows), and the engines end exact."""
    driver, trainer_a, _, _ = tiny
    sender = sender_for(receivers)
    sender.refit(driver, trainer_a)
    name = next(n for n, _ in driver.run(trainer_a) if n.endswith("q_proj.weight"))
    receivers[1].ctl.call("corrupt_base", name)
    before = loads(receivers)
    trainer = stepped(trainer_a, 1e-5, 2)
    d = sender.refit(driver, trainer).delta
    assert d.kind == "full" and d.attempts == 2, d
    assert "delta refused, nothing loaded: rank 2 did not reconstruct the delta round to the trainer's digests" \
        in d.reason, d.reason
    assert [a - b for a, b in zip(loads(receivers), before)] == [1, 1]
    assert held(receivers) == [want(driver, trainer)] * 2
    sender.close()


def test_a_corrupted_bucket_in_a_delta_round_loads_nothing_and_the_next_round_is_whole(receivers, tiny):
    driver, trainer_a, _, _ = tiny
    sender = sender_for(receivers)
    sender.refit(driver, trainer_a)
    receivers[0].ctl.call("inject", {"corrupt_bucket": 0})
    before = loads(receivers)
    with pytest.raises(TransportError, match=r"rank 1 a bucket failed its checksum.*nothing loaded"):
        sender.refit(driver, stepped(trainer_a, 1e-5, 3))
    assert loads(receivers) == before and held(receivers) == [want(driver, trainer_a)] * 2
    assert sender.base is None
    sender.connect()  # a new group (the wrapped one is dropped)
    d = sender.refit(driver, stepped(trainer_a, 1e-5, 3)).delta
    assert d.kind == "full" and d.reason.startswith("no base") and d.attempts == 1
    assert held(receivers) == [want(driver, stepped(trainer_a, 1e-5, 3))] * 2
    sender.close()


def test_restarted_receivers_get_a_whole_round(tiny):
    driver, trainer_a, _, ckpt = tiny
    with standalone_receivers(ckpt, n=1, env={ENV_SECRET: SECRET}) as first:
        sender = sender_for(first)
        sender.refit(driver, trainer_a)
        sender.close()
    with standalone_receivers(ckpt, n=1, env={ENV_SECRET: SECRET}) as restarted:
        sender.clients = [r.rpc for r in restarted]
        sender.connect()
        trainer = stepped(trainer_a, 1e-5, 4)
        d = sender.refit(driver, trainer).delta
        assert d.kind == "full" and d.attempts == 2, d
        assert "rank 1 does not hold the delta round's base" in d.reason, d.reason
        assert held(restarted) == [want(driver, trainer)]
        sender.close()


def test_a_delta_sender_refuses_send_and_an_unknown_mode_is_named():
    with pytest.raises(TransportError, match=r"mode 'sparse': use 'atomic', 'bounded' or 'delta'"):
        RefitSender([], "127.0.0.1", 1, mode="sparse")
    s = RefitSender([], "127.0.0.1", 1, mode="delta")
    with pytest.raises(TransportError, match=r"a delta-mode sender sends through refit\(\)"):
        s.send(None, iter(()))
