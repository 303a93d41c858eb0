"""Attacks on issue 45's delta sender (the source run ahead on a second thread, bounded delta,
incremental re-quantization's scale checks): each test states the behaviour expected and failed
on 5b07e21 (or pins what held). In process, no engine: a round's ``send`` takes every bucket's
payload in order, as ``scripts/bench_delta_sender.py`` does, and every stream is compared byte
for byte with a fresh full quantization's (:func:`qstrat.transport.delta.encoding.stream_of`)."""
from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
from qstrat.cli.demo.trajectory import adam_trajectory
from qstrat.execute.driver import RefitDriver
from qstrat.transport.delta import encoding as delta
from qstrat.transport.delta.rounds import DeltaRounds
from qstrat.transport.send.report import TransferReport
from qstrat.transport.send.sender import WIRE_MANIFEST, sender_checks

BUCKET = 64 << 10


@pytest.fixture(scope="module")
def trajectory():
    """(block-FP8 driver, its sender checks, 4 Adam steps of the tiny model's state)."""
    model = build_tiny_qwen3_moe(seed=1)
    driver = RefitDriver("block-fp8", hf_config=hf_config(model))
    return driver, sender_checks(driver, BUCKET, 256), list(adam_trajectory(model, 1e-5, 4))


def take_all(enc, extra):
    """A round's ``send`` in process: every bucket's payload in order."""
    wm = enc.target
    enc.start(None, bytes(32))
    for k in range(len(wm.buckets)):
        enc.payload(k)
    return TransferReport(wm, enc.wire_bytes, len(wm.buckets), 0.0, 0.0, None)


def fresh_stream(driver, checks, state):
    """The stream of a fresh full quantization of ``state`` (the oracle)."""
    prepared = driver.prepare(state, None, checks)
    wm = prepared.results[WIRE_MANIFEST]
    return delta.stream_of(wm, prepared.execute())


def refit(sender, driver, checks, state, send=take_all, bounded=False):
    prepared = driver.prepare(state, None, checks)
    wm = prepared.results[WIRE_MANIFEST]
    return sender.refit(wm, prepared.execute(quantize=sender.quantize), send, bounded)


@pytest.mark.parametrize("modes", [("inference",) * 3, ("plain", "inference", "plain", "inference"),
                                   ("inference", "plain", "inference", "plain")])
def test_rounds_under_inference_mode_are_exact_also_when_the_caller_switches_between_rounds(trajectory, modes):
    """A trainer that refits under ``torch.inference_mode()`` (valid: ``mode="atomic"`` quantizes
    on the caller's thread there) got ``RuntimeError: Inplace update to inference tensor outside
    InferenceMode`` on every delta round: the stream buffer was allocated on the caller's thread
    (an inference tensor) and written by the look-ahead thread (outside inference mode). Every
    round must go through, delta after the first, its stream the fresh quantization's, whether or
    not the caller is in inference mode, also switching between rounds (the requantizer's
    entries and the spare stream outlive a round)."""
    driver, checks, states = trajectory
    sender = DeltaRounds()
    for i, mode in enumerate(modes):
        with torch.inference_mode() if mode == "inference" else contextlib.nullcontext():
            report = refit(sender, driver, checks, states[i])
        assert report.delta.kind == ("full" if i == 0 else "delta"), (i, mode, report.delta)
        assert torch.equal(sender.base.stream, fresh_stream(driver, checks, states[i])), (i, mode)


def _bounded_take(ahead, k):
    """``ahead.take(k)`` on a helper thread, waited for at most 5 s: (returned, raised) - a hang
    fails the test instead of stalling the suite."""
    out: dict = {}

    def run():
        try:
            out["value"] = ahead.take(k)
        except BaseException as exc:  # noqa: BLE001 - what take raised is the result
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), f"LookAhead.take({k}) hung"
    return out


def test_a_take_after_close_or_past_the_last_step_raises_instead_of_hanging():
    """``take(k)`` waited for step k with no end once ``close()`` had stopped the thread before
    it (or for a k past the last step): a caller that asked for a bucket after a failed round's
    cleanup hung forever. It must raise, naming the step."""
    from qstrat.transport.delta.ahead import LookAhead

    started = threading.Event()

    def step(k):
        if k == 1:
            started.set()
            threading.Event().wait(0.1)

    ahead = LookAhead(step, 5)
    ahead.take(0)
    assert started.wait(5)
    ahead.close()
    assert _bounded_take(ahead, 1)["value"] >= 0.0  # the step running at close finished
    got = _bounded_take(ahead, 3)
    assert isinstance(got.get("error"), RuntimeError) and str(got["error"]) == \
        "LookAhead.take(3): closed before step 3 ran", got
    never = LookAhead(lambda k: None, 2)
    never.close()  # closed before the first take: no step runs
    got = _bounded_take(never, 0)
    assert isinstance(got.get("error"), RuntimeError) and "closed before step 0 ran" in str(got["error"]), got
    got = _bounded_take(LookAhead(lambda k: None, 2), 7)
    assert isinstance(got.get("error"), IndexError) and str(got["error"]) == \
        "LookAhead.take(7): steps are 0..2", got


@pytest.mark.parametrize("mode", ["atomic", "delta", "bounded-delta"])
def test_a_trainer_under_inference_mode_refits_over_the_transport_exactly(tiny, mode):
    """Over the transport (two StandaloneReceivers, tests/transport_harness.py): a trainer that
    calls ``RefitSender.refit`` under ``torch.inference_mode()`` got the source's RuntimeError
    in the delta modes (the stream written outside inference mode by the look-ahead thread) and
    the round was aborted. A whole round, then a delta round (atomic: two whole rounds, the
    reference: it passed on 5b07e21, the tiny model's weights being one chunk each - the
    serializers' chunk workers failed only on larger ones: the last test of this module), each exact
    on both receivers."""
    from transport_harness import connected_sender, counting_receivers
    from transport_harness import held_digests as held, run_digests as want, sign_step as stepped

    driver, _, trainer, ckpt = tiny
    with counting_receivers(ckpt, "a secret for the attack tests") as receivers:
        sender = connected_sender(receivers, mode, "a secret for the attack tests", BUCKET, 20)
        try:
            for step, kind in ((0, "full"), (1, "delta")):
                state = stepped(trainer, 1e-5, step)
                with torch.inference_mode():
                    report = sender.refit(driver, state)
                if mode != "atomic":
                    assert report.delta.kind == kind and report.delta.attempts == 1, report.delta
                assert held(receivers) == [want(driver, state)] * 2
        finally:
            sender.close()


def _source_threads_end() -> bool:
    """Whether every look-ahead thread ended (waited for up to 2 s: one may be returning from its last step)."""
    for _ in range(200):
        if not any(t.name == "qstrat-delta-source" for t in threading.enumerate()):
            return True
        threading.Event().wait(0.01)
    return False


FORMATS = {"block-fp8": "block-fp8", "mxfp8": "mxfp8",
           "nvfp4": {"rules": [{"select": "linear", "serializer": "nvfp4"}]}}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_rounds_refused_failed_and_resent_whole_under_every_grad_mode_stay_exact_and_leave_no_thread(fmt):
    """Many rounds of one sender through everything a round can meet (in process; each ``send``
    stands for an outcome of the real protocol): refused at the accept vote (whole from the
    source), refused at the commit vote (whole from the stream), a peer lost at bucket 2 (the
    source still running ahead: closed before the requantizer is cleared), a refusal before
    any data (the base kept), under plain, ``no_grad`` and ``inference_mode`` callers. Every
    round that returns holds the fresh full quantization's stream as its base, and no
    look-ahead thread outlives its round. (On 5b07e21 the inference-mode rounds raised.)"""
    from qstrat.errors import TransportError, WireManifestMismatchError
    from transport_harness import sign_step

    def at_accept(enc, extra):
        if enc.base is not None:
            raise delta.DeltaRefused("stale base (the accept vote)")
        return take_all(enc, extra)

    def at_commit(enc, extra):
        report = take_all(enc, extra)
        if enc.base is not None:
            raise delta.DeltaRefused("digest mismatch (the commit vote)")
        return report

    def lost_at_2(enc, extra):
        enc.start(None, bytes(32))
        enc.payload(0)
        enc.payload(1)
        raise TransportError("a receiver died at bucket 2")

    def before_data(enc, extra):
        raise WireManifestMismatchError("refused before any data")

    plain, no_grad, inference = contextlib.nullcontext, torch.no_grad, torch.inference_mode
    schedule = [(take_all, plain, "full", 1), (take_all, inference, "delta", 1), (at_accept, no_grad, "full", 2),
                (at_commit, inference, "full", 2), (lost_at_2, plain, TransportError, None),
                (take_all, inference, "full", 1), (before_data, no_grad, WireManifestMismatchError, None),
                (take_all, plain, "delta", 1)]
    model = build_tiny_qwen3_moe(seed=1)
    driver = RefitDriver(FORMATS[fmt], hf_config=hf_config(model))
    checks = sender_checks(driver, BUCKET, 256)
    sender, state = DeltaRounds(), model.state_dict()
    for i, (send, mode, kind, attempts) in enumerate(schedule):
        state = sign_step(state, 1e-6, i)
        kept = sender.base
        with mode():
            if isinstance(kind, type):
                with pytest.raises(kind):
                    refit(sender, driver, checks, state, send)
                assert (sender.base is kept) if kind is WireManifestMismatchError else sender.base is None, i
            else:
                report = refit(sender, driver, checks, state, send)
        assert _source_threads_end(), f"round {i}: a look-ahead thread still runs"
        if isinstance(kind, type):
            continue
        assert (report.delta.kind, report.delta.attempts) == (kind, attempts), (i, report.delta)
        assert torch.equal(sender.base.stream, fresh_stream(driver, checks, state)), i
    assert report.delta.requantize.get("incremental", 0) > 0, report.delta.requantize


@pytest.mark.parametrize("fmt", ["block_fp8", "mxfp8", "nvfp4"])
def test_a_full_quantize_under_inference_mode_spread_over_worker_threads_gives_the_same_bytes(fmt):
    """Found while attacking the look-ahead (the same per-thread inference mode, in the
    serializers): the fast path spreads a weight's chunks over worker threads
    (serializers/torch_paths.run_fast), which ran outside the caller's inference mode, so under
    ``torch.inference_mode()`` with more than one torch thread every multi-chunk quantize -
    any mode's refit, not only delta - raised ``Inplace update to inference tensor outside
    InferenceMode``. The bytes must be the plain call's, and a plain call after it still work."""
    from qstrat.plugins.registry import get_serializer

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # two workers, whatever this machine has
    try:
        ser = get_serializer(fmt, chunk_elements=256 * 256)
        w = torch.randn(512, 1024, generator=torch.Generator().manual_seed(5)).bfloat16()
        want = ser.quantize(w)
        with torch.inference_mode():
            got = ser.quantize(w)
        after = ser.quantize(w)
    finally:
        torch.set_num_threads(threads)
    assert want.keys() == got.keys() == after.keys()
    for k in want:
        flat = [t.reshape(-1).view(torch.uint8) for t in (want[k], got[k], after[k])]
        assert torch.equal(flat[0], flat[1]) and torch.equal(flat[0], flat[2]), k


@pytest.mark.parametrize("second", ["lost", "refused before data"])
def test_a_whole_resend_that_fails_after_a_bounded_delta_mix_is_reported_as_the_mix(trajectory, second):
    """A bounded delta round left a MIX (DeltaMixed: every unit loaded was verified) and the whole
    resend that repairs it failed too - a receiver lost before any unit of it loaded, or a refusal
    before any data. The engines still hold the first attempt's MIX, yet the caller got a plain
    TransportError / WireManifestMismatchError ("nothing loaded"), and after the refusal the
    sender even kept its old base as if no engine had changed. The error must be a
    MixedWeightsError naming the MIX (RefitSender's contract: "MixedWeightsError when some rank
    holds new weights and the round was not committed everywhere"), and the next round whole."""
    from qstrat.errors import MixedWeightsError, TransportError, WireManifestMismatchError

    driver, checks, states = trajectory
    sender = DeltaRounds()
    refit(sender, driver, checks, states[0])
    attempts = []

    def send(enc, extra):
        attempts.append(enc.base is not None)
        if len(attempts) == 1:  # the delta: every bucket sent, then a MIX at the commit vote
            take_all(enc, extra)
            exc = delta.DeltaMixed("round not committed: rank 1 did not reconstruct the delta round; the "
                                   "engines hold a MIX: ranks 1 hold new weights")
            exc.detail = "ranks 1 hold new weights"
            raise exc
        if second == "lost":
            raise TransportError("broadcast of delta bucket 0/9 failed (a receiver died?)")
        raise WireManifestMismatchError("round refused before any data")

    with pytest.raises(MixedWeightsError) as err:
        refit(sender, driver, checks, states[1], lambda enc, extra: send(enc, extra), bounded=True)
    assert attempts == [True, False]
    assert "MIX" in str(err.value) and "ranks 1 hold new weights" in str(err.value), str(err.value)
    assert sender.base is None
    report = refit(sender, driver, checks, states[2])
    assert report.delta.kind == "full" and report.delta.reason.startswith("no base"), report.delta
