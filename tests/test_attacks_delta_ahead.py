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


def refit(sender, driver, checks, state, send=take_all):
    prepared = driver.prepare(state, None, checks)
    wm = prepared.results[WIRE_MANIFEST]
    return sender.refit(wm, prepared.execute(quantize=sender.quantize), send)


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
