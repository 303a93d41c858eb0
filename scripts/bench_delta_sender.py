"""A delta round's sender in process (no wire, no receiver): wall and CPU seconds per round with
the source run ahead on a second thread (qstrat.transport.delta.ahead, what ``RefitSender(mode=
"delta")`` does) and without it, over real Adam steps of the tiny Qwen3-MoE.

Each round is :class:`qstrat.transport.delta.rounds.DeltaRounds` ``refit`` with a ``send`` that
takes every bucket's payload in order (incremental quantize, stream writes, compare with the
base, patch, digest): the sender's share of a delta round, the part issue 45's 1 Gbit/s target
is bounded by (docs/performance.md, "Delta rounds: the measurement history", fourth pass). Medians over steps 2..N (step 0 is
whole, step 1 warms the requantizer), both variants in the same process, one after the other.

    .venv/bin/python scripts/bench_delta_sender.py [--width 4] [--steps 7] [--lr 1e-6]
        [--formats block-fp8 mxfp8 nvfp4]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time

import torch

from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
from qstrat.cli.demo.trajectory import adam_trajectory
from qstrat.execute.driver import RefitDriver
from qstrat.transport.delta import rounds as delta_rounds
from qstrat.transport.delta.stream import PatchEncoder
from qstrat.transport.send.report import TransferReport
from qstrat.transport.send.sender import WIRE_MANIFEST, sender_checks

FORMATS = {"block-fp8": "block-fp8", "mxfp8": "mxfp8",
           "nvfp4": {"rules": [{"select": "linear", "serializer": "nvfp4"}]}}


class _InOrder(PatchEncoder):
    """The encoder without the look-ahead (the source runs on the caller's thread, bucket by bucket)."""

    def __init__(self, *args, look_ahead: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)


def rounds(driver: RefitDriver, states: list, ahead: bool) -> list[tuple[float, float, str]]:
    """(wall s, process CPU s, SHA-256 of the round's stream) of each delta round over ``states``."""
    delta_rounds.PatchEncoder = PatchEncoder if ahead else _InOrder
    try:
        sender, checks, out = delta_rounds.DeltaRounds(), sender_checks(driver, 4 << 20, 256), []
        for state in states:
            prepared = driver.prepare(state, None, checks)
            wm = prepared.results[WIRE_MANIFEST]

            def send(enc: PatchEncoder, extra: dict) -> TransferReport:
                enc.start(None, bytes(32))
                for k in range(len(wm.buckets)):
                    enc.payload(k)
                return TransferReport(wm, enc.wire_bytes, len(wm.buckets), 0.0, 0.0, None)

            t0, c0 = time.perf_counter(), time.process_time()
            sender.refit(wm, prepared.execute(quantize=sender.quantize), send)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            out.append((wall, cpu, hashlib.sha256(sender.base.stream.numpy().tobytes()).hexdigest()))
        return out
    finally:
        delta_rounds.PatchEncoder = PatchEncoder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the transport bench's default)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    w = args.width
    model = build_tiny_qwen3_moe(seed=1, hidden_size=256 * w, intermediate_size=512 * w,
                                 moe_intermediate_size=128 * w, num_attention_heads=4 * w,
                                 num_key_value_heads=2 * w)
    states = list(adam_trajectory(model, args.lr, args.steps))
    print(f"tiny Qwen3-MoE x{w}, lr {args.lr:g}, {len(states)} rounds (medians of rounds 2..), "
          f"{os.cpu_count()} CPUs, torch threads {args.threads}")
    print(f"{'format':10} {'in order s':>10} {'ahead s':>8} {'ratio':>6} {'CPU in order':>12} {'CPU ahead':>9} "
          f"{'same bytes':>10} {'load':>9}")
    for fmt in args.formats:
        driver = RefitDriver(FORMATS[fmt], hf_config=hf_config(model))
        load = os.getloadavg()[0]
        every = {ahead: rounds(driver, states, ahead) for ahead in (False, True)}
        same = [r[2] for r in every[False]] == [r[2] for r in every[True]]  # every round's stream, both ways
        med = {a: [statistics.median(r[i] for r in every[a][2:]) for i in (0, 1)] for a in every}
        print(f"{fmt:10} {med[False][0]:>10.3f} {med[True][0]:>8.3f} {med[True][0] / med[False][0]:>6.2f} "
              f"{med[False][1]:>12.3f} {med[True][1]:>9.3f} {str(same):>10} {load:>4.1f}-{os.getloadavg()[0]:<4.1f}",
              flush=True)


if __name__ == "__main__":
    main()
