"""Benchmark: qstrat's transport round vs a raw gloo broadcast of the same bytes, and receiver memory.

One sender (this process, rank 0) and N receiver processes (StandaloneReceiver, no engine;
tests/transport_harness.py; its loader copies into the tensors it holds, like an engine's weight
loader). The payload is a synthetic block-FP8 checkpoint: per layer 24 float8_e4m3fn weights
[rows, 1024] (rows from ``--layer-mib``; 512 rows = 12 MiB per layer, the default) with float32
block scales and a bfloat16 norm; plus a bfloat16 embedding [8192, 1024] (16 MiB).

Throughput (default), per receiver count (``--receivers 1 2``) and bucket size, median of ``--reps``:

* ``transport``: ``RefitSender.send`` - wire manifest RPC and check, challenge, round MAC, pack +
  seal (device checksum, or with ``--secret`` the NH bucket MAC; double buffered), broadcast,
  receive + seal check, votes, unpack and load on every receiver (the round's wall time as the
  sender sees it);
* ``raw``: plain ``broadcast`` of the same bucket sizes from preallocated buffers, two in
  flight, no packing, no checksum (the same group);
* ``ratio``: transport GB/s / raw GB/s (the issue's target: >= 0.8);
* ``stream``: the same ratio with only the stream (``TransferReport.stream_seconds``: challenge,
  header, votes and buckets; without the RPCs and the receivers' load);
* ``staged``: the raw broadcast with every receiver receiving each bucket into a NEW buffer
  kept to the end (fresh memory, as a round's staging), as a ratio to ``raw``;
* ``pack+seal``: packing and sealing alone, in this process (no wire): the checksum, or the
  bucket MAC with ``--secret``;
* ``cpu s``: CPU seconds (all threads) of the sender and of receiver 1 over a transport round
  and over a raw broadcast: on a machine with few cores the round is bound by their sum;
* then, per row, the phase profile of the median round: the sender's (``start``: the
  start_weight_update RPCs; ``handshake``: challenge, header, accept vote; ``source``,
  ``pack``, ``seal``, ``wait`` (blocked on the wire) in the bucket loop; ``commit`` vote;
  ``update``: waiting for the update_weights RPCs; ``finish``: the receivers' load) and
  receiver 1's (``handshake``, ``alloc``, ``wait``, ``seal``, ``commit``, ``finish``: its load).

GB/s = payload bytes / seconds / 1e9. Each configuration first runs one unmeasured round (the
receivers' held tensors, "the model", are allocated by it, as in an engine).

Memory (``--memory``), per mode, fresh receivers: round 1 fills the receivers' tensors (the
"model"), the peak RSS is reset (Linux ``/proc/self/clear_refs``), round 2 runs; printed: the
receivers' peak RSS above their RSS before round 2, against the payload, and the round's time
against a raw broadcast of the same bytes.

Delta (``--delta``): the tiny model's float32 master weights take ``--steps`` real Adam steps per
``--lr``; per format, two receivers (each its own sender, so the full one's rounds do not reset
the delta one's base; ``--width``: hidden and intermediate sizes and heads times this): after
the start round and every step, a FULL round (``mode="atomic"``) and a DELTA round
(``mode="delta"``) of the same weights, one after the other; both with ``--bucket-mib``'s first
size, the delta round's raised to the delta modes' floor (``RefitSender(delta_min_bucket_bytes=)``,
16 MiB; ``--delta-min-mib 0``: as given; the header names both). Printed per step: wire bytes of
each (the delta's as % of the full's), the delta sender's encode seconds (``enc s``: compare,
digest, patch, summed over the buckets), the receiver's decode seconds (``dec s``: rebuild and
digest, summed over the buckets, each while the sender encodes the next), each ``refit`` call's wall seconds (quantization
included), the CPU seconds of each round (``cpu s``: the sender process over the ``refit`` call
plus the receiver process over the same time: what the round costs whatever the machine's load),
whether both receivers hold exactly ``RefitDriver.run``'s bytes, and the memory each round
needed (``peak MiB``: the process's peak RSS during the round, VmHWM reset at its start, minus
its RSS at the start: memory the round needed beyond what the process already held; 0 when it
needed none (Linux updates VmHWM lazily, so such a round can read a fraction of a MiB below its
start: printed as 0). After each delta round, the incremental quantizer's line: entries
quantized incrementally and whole (with why), the % of input elements changed, blocks touched
and rescaled, codes re-encoded, and the stream bytes copied whole (``DeltaReport.copied_whole``:
the passthrough tensors when the write log served the rest; every tensor in a whole round).
Then per format and lr, the medians over the delta steps (every step but the start round): wall seconds full / delta and their ratio, CPU seconds full / delta, and the
machine's load average (``os.getloadavg``) before and after; then the phase profile (as above) of
the median full and the median delta round (a delta round's ``source`` phase is quantizing and
encoding each bucket, interleaved with its ``wait`` on the wire, as a full round's).

Per-process links (``--mesh-links RATE...``): every process in its own network namespace behind
its own link shaped to RATE in and out (scripts/mesh_links.py); the per-link efficiency of raw gloo
point-to-point (S senders x R receivers, all pairs at once) and of today's broadcast refit on the
same links, the real mesh round against a ``RefitSender`` broadcast of the same payload (:func:`run_mesh`), and the routing model's projected
round times at that efficiency (:func:`mesh_section`).

Mesh delta (``--mesh-delta``): delta mesh rounds (every (trainer rank, engine rank) pair patched
against its own base) against full mesh rounds of the same weights on loopback, over real Adam
steps per ``--lr`` and format (:func:`mesh_delta`).

Links (``--link``): every measurement above runs over each link in turn: ``loopback`` (the
default: 127.0.0.1), or a real network link on this machine (root, iproute2; scripts/shaped_link.py):
a veth pair into a network namespace, the receivers spawned inside it, both directions shaped by
the kernel's token bucket filter to a tc rate (``1gbit``, ``10gbit``), or ``unshaped``; gloo's
connections cross it (a kernel TCP path at that rate). Each delta run first prints the link's
measured rate (a raw gloo broadcast of 32 MiB, bucket-size pieces). At the end, a summary row per
link, format, width and lr: the medians and delta / full wall; then, per format, width and lr run
on several links, the break-even link rate: where delta / full wall crosses 1, interpolated in
log(rate) between the two measured links around it (``>X``: delta faster on every link measured,
``<X``: on none; ``noisy``: no crossing from faster to slower).

    .venv/bin/python scripts/bench_transport.py --delta [--lr 1e-6 1e-5] [--steps 4] [--formats block-fp8 mxfp8 nvfp4] [--width 1] [--secret]
    .venv/bin/python scripts/bench_transport.py [--layers 8] [--layer-mib 12] [--receivers 1 2] [--bucket-mib 4 16 64] [--reps 3] [--secret]
    sudo .venv/bin/python scripts/bench_transport.py --delta --lr 1e-6 --link 1gbit 10gbit loopback [--json out.json]
    .venv/bin/python scripts/bench_transport.py --mesh-delta --lr 1e-6 --bucket-mib 1 [--steps 4] [--formats block-fp8 mxfp8 nvfp4]
    sudo .venv/bin/python scripts/bench_transport.py --mesh-links 500mbit 1gbit [--senders 1 2 4] [--mesh-receivers 2 4] [--pair-mib 8] [--layers 2]
    .venv/bin/python scripts/bench_transport.py --memory --layers 8 --layer-mib 256 --receivers 1 --bucket-mib 64 --modes atomic bounded
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from transport_harness import Receiver, free_port, raw_broadcast  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shaped_link import LOOPBACK, UNSHAPED, check_can_shape, rate_bits, shaped_link  # noqa: E402

from qstrat.transport import RefitSender, build_wire_manifest  # noqa: E402
from qstrat.transport.buckets import bucket_contents, pack  # noqa: E402
from qstrat.transport.security.keys import Secret  # noqa: E402
from qstrat.transport.security.seal import Sealer  # noqa: E402
from qstrat.transport.delta.rounds import DELTA_MIN_BUCKET_BYTES, delta_bucket_bytes  # noqa: E402
from qstrat.transport.wire_manifest import DEFAULT_ALIGNMENT, reload_unit  # noqa: E402

SECRET = "benchmark secret, not a real one"


def synthetic(layers: int, layer_mib: float = 12) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of the synthetic checkpoint (module docstring)."""
    rows = max(128, int(layer_mib * 2**20 / 24 / 1024) // 128 * 128)
    g = torch.Generator().manual_seed(0)
    out = [("model.embed_tokens.weight", torch.randn(8192, 1024, generator=g).to(torch.bfloat16))]
    for i in range(layers):
        out.append((f"model.layers.{i}.input_layernorm.weight", torch.ones(1024, dtype=torch.bfloat16)))
        for j in range(24):
            w = torch.randint(0, 256, (rows, 1024), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
            out.append((f"model.layers.{i}.mlp.experts.{j}.weight", w))
            out.append((f"model.layers.{i}.mlp.experts.{j}.weight_scale_inv",
                        torch.rand(rows // 128, 8, generator=g)))
    return out


def pack_only(wire_manifest, tensors, secret: bool) -> float:
    """Seconds to pack and seal every bucket in this process (no wire)."""
    data = dict(tensors)
    buf = torch.empty(wire_manifest.bucket_bytes, dtype=torch.uint8)
    sealer = Sealer(Secret(SECRET) if secret else None, bytes(32), torch.device("cpu"))
    t0 = time.perf_counter()
    for b, slots in zip(wire_manifest.buckets, bucket_contents(wire_manifest)):
        if b.tensor is None:
            sealer.seal(b.index, 0, pack(buf, b, slots, [data[s.name] for s in slots]))
        else:
            sealer.seal(b.index, 0, data[b.tensor].reshape(-1).view(torch.uint8)[:b.nbytes])
    return time.perf_counter() - t0


def manifest_for(tensors, bucket_bytes):
    return build_wire_manifest(((n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors),
                               bucket_bytes)


def raw_round(sender, receivers, sizes, bufs, staged=False) -> tuple[float, float, float]:
    """(wall seconds, sender CPU seconds, receiver 1 CPU seconds) of a raw broadcast."""
    with ThreadPoolExecutor(len(receivers)) as pool:
        futures = [pool.submit(r.rpc.call, "raw_broadcast", sizes, staged) for r in receivers]
        t0, cpu = time.perf_counter(), time.process_time()
        raw_broadcast(sender.group, sizes, bufs)
        cpus = [f.result(600) for f in futures]
    return time.perf_counter() - t0, time.process_time() - cpu, cpus[0]


def start(args, mode="atomic", receivers=None):
    n = receivers or args.receivers[0]
    receivers = [Receiver("standalone", "", timeout_s=600, threads=args.threads) for _ in range(n)]
    for r in receivers:
        r.wait_ready()
        if args.secret:
            r.ctl.call("setenv", "QSTRAT_TRANSFER_SECRET", SECRET)
    sender = RefitSender([r.rpc for r in receivers], args.address, free_port(), timeout_s=600, mode=mode,
                         secret=SECRET if args.secret else None)
    sender.connect()
    return sender, receivers


def _delta_layout(args) -> str:
    """What bucket bound the delta rounds of ``--delta`` are laid out with (for the header)."""
    floor = DELTA_MIN_BUCKET_BYTES if args.delta_min_mib is None else int(args.delta_min_mib * 2**20)
    mib = delta_bucket_bytes(int(args.bucket_mib[0] * 2**20), floor, DEFAULT_ALIGNMENT) / 2**20
    if mib == args.bucket_mib[0]:
        return f"delta rounds the same ({floor / 2**20:g} MiB floor not above it)"
    return f"delta rounds {mib:g} MiB (raised to the delta modes' {floor / 2**20:g} MiB floor)"


def _phases(d: dict, keys: tuple[str, ...]) -> str:
    return " ".join(f"{k}={d.get(k + '_s', 0.0):.3f}" for k in keys)


SEND_PHASES = ("start", "handshake", "source", "pack", "seal", "wait", "commit", "update", "finish")
RECV_PHASES = ("handshake", "alloc", "wait", "seal", "rebuild", "load", "commit", "finish")


def throughput(args, tensors) -> None:
    print(f"torch {torch.__version__}, gloo, {torch.get_num_threads()} torch thread(s) per process, "
          f"{'authenticated (bucket MAC)' if args.secret else 'no secret (integrity checksum)'}, "
          f"median of {args.reps}")
    print(f"{'recv':>4} {'bucket MiB':>10} {'payload MiB':>11} {'buckets':>7} {'transport GB/s':>14} "
          f"{'raw GB/s':>8} {'ratio':>5} {'stream':>6} {'staged':>6} {'pack+seal GB/s':>14} "
          f"{'cpu s send tr/raw':>17} {'cpu s recv tr/raw':>17}")
    profiles = []
    for n in args.receivers:
        sender, receivers = start(args, receivers=n)
        try:
            for mib in args.bucket_mib:
                sender.bucket_bytes = int(mib * 2**20)
                wm = manifest_for(tensors, sender.bucket_bytes)
                sizes = [b.nbytes for b in wm.buckets]
                bufs = [torch.zeros(sender.bucket_bytes, dtype=torch.uint8) for _ in range(2)]
                rows = []  # (round s, stream s, raw s, staged s, pack s, send profile, recv stats, raw cpu)
                sender.send(wm, iter(tensors))  # warm-up: the receivers' held tensors exist after it
                for _ in range(args.reps):
                    report = sender.send(wm, iter(tensors))
                    send_prof, recv_stats = dict(sender.profile), receivers[0].ctl.call("stats")
                    raw = raw_round(sender, receivers, sizes, bufs)
                    staged = raw_round(sender, receivers, sizes, bufs, staged=True)
                    rows.append((report.seconds, report.stream_seconds, raw[0], staged[0],
                                 pack_only(wm, tensors, args.secret), send_prof, recv_stats, raw[1:]))
                med = lambda i: statistics.median(r[i] for r in rows)  # noqa: E731
                gbps = [wm.total_bytes / med(i) / 1e9 for i in range(5)]
                mid = sorted(rows, key=lambda r: r[0])[len(rows) // 2]
                send_prof, recv_stats, raw_cpu = mid[5], mid[6], mid[7]
                print(f"{n:>4} {mib:>10g} {wm.total_bytes / 2**20:>11.1f} {len(sizes):>7} {gbps[0]:>14.2f} "
                      f"{gbps[2]:>8.2f} {gbps[0] / gbps[2]:>5.2f} {gbps[1] / gbps[2]:>6.2f} "
                      f"{gbps[3] / gbps[2]:>6.2f} {gbps[4]:>14.2f} "
                      f"{send_prof['cpu_s']:>8.2f}/{raw_cpu[0]:<8.2f} {recv_stats['cpu_s']:>8.2f}/{raw_cpu[1]:<8.2f}",
                      flush=True)
                profiles.append((n, mib, mid[0], send_prof, recv_stats))
            sender.close()
        finally:
            for r in receivers:
                r.close()
    print("\nphase profile of the median round (wall seconds; send = the sender, recv = receiver 1):")
    for n, mib, seconds, send_prof, recv_stats in profiles:
        print(f"  {n} recv, {mib:g} MiB, round {seconds:.3f} s: send {_phases(send_prof, SEND_PHASES)} "
              f"| recv {_phases(recv_stats, RECV_PHASES)}")


def memory(args, tensors) -> list[dict[str, int | str]]:
    mib = args.bucket_mib[0]
    print(f"torch {torch.__version__}, gloo, {args.receivers} receiver(s), bucket {mib:g} MiB, "
          f"{'authenticated' if args.secret else 'no secret'}")
    print(f"{'mode':>8} {'payload MiB':>11} {'RSS before MiB':>14} {'peak above MiB':>14} {'x payload':>9} "
          f"{'round s':>8} {'raw s':>6} {'ratio':>6}")
    rows = []
    for mode in args.modes:
        sender, receivers = start(args, mode)
        try:
            sender.bucket_bytes = int(mib * 2**20)
            wm = manifest_for(tensors, sender.bucket_bytes)
            sender.send(wm, iter(tensors))
            before = [r.ctl.call("memory", True)[0] for r in receivers]
            report = sender.send(wm, iter(tensors))
            peaks = [r.ctl.call("memory")[1] for r in receivers]
            sizes = [b.nbytes for b in wm.buckets]
            bufs = [torch.zeros(sender.bucket_bytes, dtype=torch.uint8) for _ in range(2)]
            raw = raw_round(sender, receivers, sizes, bufs)[0]
            above = max(p - b for p, b in zip(peaks, before))
            print(f"{mode:>8} {wm.total_bytes / 2**20:>11.1f} {max(before) / 2**20:>14.0f} "
                  f"{above / 2**20:>14.0f} {above / wm.total_bytes:>9.2f} {report.seconds:>8.2f} "
                  f"{raw:>6.2f} {raw / report.seconds:>6.2f}", flush=True)
            units: dict[str, int] = {}
            for slot in wm.slots:
                units[reload_unit(slot.name)] = units.get(reload_unit(slot.name), 0) + slot.nbytes
            rows.append({"mode": mode, "payload_bytes": wm.total_bytes, "bucket_bytes": sender.bucket_bytes,
                         "largest_unit_bytes": max(units.values()), "peak_above_bytes": above})
            sender.close()
        finally:
            for r in receivers:
                r.close()
    return rows


DELTA_FORMATS = {"block-fp8": "block-fp8", "mxfp8": "mxfp8",
                 "nvfp4": {"rules": [{"select": "linear", "serializer": "nvfp4"}]}}


def _own_memory(reset: bool = False) -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes (``reset``: the peak set back to the RSS first)."""
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    return tuple(int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))


def _timed_round(sender, receiver, driver, state):
    """One refit: (report, wall s, sender peak above RSS, receiver peak above RSS, CPU s of the
    sender process and the receiver process over it)."""
    before = receiver.ctl.call("memory", True)[0]
    own, rcpu = _own_memory(True)[0], receiver.ctl.call("cpu")
    t0, cpu = time.perf_counter(), time.process_time()
    report = sender.refit(driver, state)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu
    rcpu = receiver.ctl.call("cpu") - rcpu
    return (report, wall, max(0, _own_memory()[1] - own), max(0, receiver.ctl.call("memory")[1] - before),
            cpu + rcpu, dict(sender.profile), receiver.ctl.call("stats"))


def link_rate(args, sender, receivers, mib: float = 32) -> float:
    """Bits per second of a raw gloo broadcast of ``mib`` MiB (in bucket-size pieces) from
    ``sender`` to ``receivers`` over the benchmark's link (printed)."""
    bucket = int(args.bucket_mib[0] * 2**20)
    sizes = [bucket] * max(1, int(mib * 2**20) // bucket)
    bufs = [torch.zeros(bucket, dtype=torch.uint8) for _ in range(2)]
    raw_round(sender, receivers, sizes[:1], bufs)  # connections warm
    seconds = raw_round(sender, receivers, sizes, bufs)[0]
    bps = sum(sizes) * 8 / seconds
    print(f"{'':9} link {args.link_name}: raw gloo broadcast of {sum(sizes) / 2**20:.0f} MiB at "
          f"{bps / 1e9:.2f} Gbit/s ({sum(sizes) / seconds / 1e9:.3f} GB/s)", flush=True)
    return bps


def break_even(rows: list[dict]) -> str:
    """Where delta / full wall crosses 1 over ``rows`` (one format, width and lr, on several
    links): the link rate, interpolated in log(rate) between the two measured links around the
    first crossing from below (delta faster on the slower link), or the measured range's bound."""
    import math

    pts = sorted((r["link_gbps"], r["delta_s"] / r["full_s"]) for r in rows)
    for (r0, q0), (r1, q1) in zip(pts, pts[1:]):
        if q0 < 1 <= q1:
            x = math.log(r0) + (1 - q0) / (q1 - q0) * (math.log(r1) - math.log(r0))
            return f"~{math.exp(x):.1f}"
    if all(q < 1 for _, q in pts):
        return f">{pts[-1][0]:.1f}"
    return f"<{pts[0][0]:.1f}" if all(q >= 1 for _, q in pts) else "noisy"


def delta(args, summary: list[dict]) -> None:
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver
    from transport_harness import adam_trajectory, sha256

    w = args.width
    model = build_tiny_qwen3_moe(seed=1, hidden_size=256 * w, intermediate_size=512 * w,
                                 moe_intermediate_size=128 * w, num_attention_heads=4 * w,
                                 num_key_value_heads=2 * w)
    print(f"torch {torch.__version__}, gloo, tiny Qwen3-MoE x{w} wide, Adam on float32 master weights, "
          f"{'authenticated' if args.secret else 'no secret'}, bucket {args.bucket_mib[0]:g} MiB, "
          f"{_delta_layout(args)}; wall = the refit call (quantization included)")
    print("per step: full B / delta B = bytes on the wire; kind: delta, or full (step 0: the first round, whole); "
          "enc s = the sender's compare + patch + digest, dec s = a receiver's rebuild + digest (summed over "
          "buckets); f/d = full round / delta round; exact = both receivers hold a fresh quantization's bytes")
    print(f"{'format':9} {'lr':>6} {'step':>4} {'full B':>8} {'delta B':>8} {'%':>6} {'kind':>5} {'enc s':>6} "
          f"{'dec s':>6} {'full s':>6} {'delta s':>7} {'cpu s f/d':>11} {'exact':>5} {'send peak MiB f/d':>17} "
          f"{'recv peak MiB f/d':>17}")
    for fmt in args.formats:
        driver = RefitDriver(DELTA_FORMATS[fmt], hf_config=hf_config(model))
        for lr in args.lr:
            (full_s, full_r), (delta_s, delta_r) = (start(args, mode, 1) for mode in ("atomic", "delta"))
            for s in (full_s, delta_s):
                s.bucket_bytes = int(args.bucket_mib[0] * 2**20)
            if args.delta_min_mib is not None:
                delta_s.delta_min_bucket_bytes = int(args.delta_min_mib * 2**20)
            load, rows = os.getloadavg()[0], []
            try:
                link_bps = link_rate(args, full_s, full_r)
                for step, state in enumerate(adam_trajectory(model, lr, args.steps)):
                    f = _timed_round(full_s, full_r[0], driver, state)
                    d = _timed_round(delta_s, delta_r[0], driver, state)
                    want = {n: sha256(t) for n, t in driver.run(state)}
                    exact = full_r[0].ctl.call("digests") == want == delta_r[0].ctl.call("digests")
                    info = d[0].delta
                    dec = delta_r[0].ctl.call("stats").get("rebuild_s", 0.0)
                    print(f"{fmt:9} {lr:6.0e} {step:>4} {info.full_bytes:>8} {info.wire_bytes:>8} "
                          f"{100 * info.wire_bytes / info.full_bytes:>6.2f} {info.kind:>5} {info.encode_s:>6.3f} "
                          f"{dec:>6.3f} {f[1]:>6.3f} {d[1]:>7.3f} {f[4]:>5.2f}/{d[4]:<5.2f} {str(exact):>5} "
                          f"{f[2] / 2**20:>8.1f}/{d[2] / 2**20:<8.1f} {f[3] / 2**20:>8.1f}/{d[3] / 2**20:<8.1f}",
                          flush=True)
                    if info.requantize:  # the delta sender's incremental quantizer, this round
                        rq = info.requantize
                        whole = {k[6:]: v for k, v in rq.items() if k.startswith("whole:")}
                        print(f"{'':9} requantize: {rq.get('incremental', 0)} entries incremental, whole {whole}; "
                              f"{100 * rq.get('changed', 0) / max(rq.get('elements', 1), 1):.3f} % of the elements "
                              f"changed, blocks touched {rq.get('blocks_touched', 0)} (rescaled "
                              f"{rq.get('blocks_rescaled', 0)}), codes re-encoded {rq.get('encoded', 0)}; stream "
                              f"copied whole {info.copied_whole / 2**20:.2f} MiB"
                              + (" (the rest from the write log)" if info.copied_whole < info.full_bytes else
                                 " (every tensor: no base's marks to follow)"), flush=True)
                    if step:
                        rows.append((f[1], d[1], f[4], d[4], info.full_bytes, info.wire_bytes, f[5:], d[5:]))
                if rows:
                    med = [statistics.median(r[i] for r in rows) for i in range(6)]
                    after = os.getloadavg()[0]
                    print(f"{'':9} median of {len(rows)} delta steps: wall s full {med[0]:.3f} / delta {med[1]:.3f} "
                          f"(x{med[1] / med[0]:.2f}), CPU s full {med[2]:.3f} / delta {med[3]:.3f} "
                          f"(x{med[3] / med[2]:.2f}); load average {load:.1f} -> {after:.1f}", flush=True)
                    for kind, i, k in (("full", 0, 6), ("delta", 1, 7)):
                        mid = sorted(rows, key=lambda r: r[i])[len(rows) // 2]
                        print(f"{'':9} median {kind} round ({mid[i]:.3f} s) by phase: send "
                              f"{_phases(mid[k][0], SEND_PHASES)} | recv {_phases(mid[k][1], RECV_PHASES)}", flush=True)
                    summary.append({"link": args.link_name, "link_gbps": link_bps / 1e9, "format": fmt, "lr": lr,
                                    "width": w, "full_bytes": med[4], "delta_bytes": med[5], "full_s": med[0],
                                    "delta_s": med[1], "full_cpu_s": med[2], "delta_cpu_s": med[3],
                                    "load": (load, after)})
                print(f"{'':9} base held: sender {delta_s.base.nbytes / 2**20:.2f} MiB (host memory; and a spare "
                      f"buffer of that size between rounds), receiver the same; peak RSS (VmHWM) sender {_own_memory()[1] / 2**20:.0f} MiB, receivers "
                      f"full {full_r[0].ctl.call('memory')[1] / 2**20:.0f} / delta "
                      f"{delta_r[0].ctl.call('memory')[1] / 2**20:.0f} MiB", flush=True)
            finally:
                for s, rs in ((full_s, full_r), (delta_s, delta_r)):
                    s.close()
                    for r in rs:
                        r.close()


def run_mesh(senders: int, receivers: int, links: list, pair_bytes: int, reps: int) -> dict:
    """The mesh round (issue 41: every trainer rank sends what it owns, point to point, to the
    engine ranks that load it): ``senders`` ``MeshSender`` processes in ``links[:senders]`` and
    ``receivers`` engine-less ``MeshReceiver`` ranks (expert-parallel) in the next ``receivers``
    links, each pair moving one ``pair_bytes`` expert (scripts/mesh_links.py
    :func:`~mesh_links.mesh_round`); then today's ``RefitSender`` broadcasting the same payload
    from ``links[0]`` into ``receivers`` engine-less receivers. Returns ``{"mesh_s": [per rep],
    "stream_s": [per rep: the slowest rank's bucket streams],
    "broadcast_s": [per rep], "received": {rank: bytes}, "payload": bytes}``."""
    from mesh_links import broadcast_refit, mesh_outputs_synthetic, mesh_round

    m = mesh_round(links, senders, receivers, pair_bytes, reps)
    b = broadcast_refit(links, receivers, bucket_mib=4, reps=reps,
                        outputs=mesh_outputs_synthetic(senders, receivers, pair_bytes))
    return {"mesh_s": m["seconds"], "stream_s": m["stream_s"], "broadcast_s": b["refit_s"], "received": m["received"], "payload": m["payload"]}


def mesh_delta(args) -> None:
    """``--mesh-delta``: delta mesh rounds against full mesh rounds on loopback. Two trainer
    processes (each its half of the tiny Qwen3-MoE's experts) and two engine-less expert-parallel
    receivers (attention narrowed by TP rank 1 / 0 of 2, the odd / even experts whole), a gloo
    group over 127.0.0.1 (tests/mesh_delta_harness.py), each pair's buckets of the first
    ``--bucket-mib``; per ``--lr`` one trajectory of
    ``--steps`` real Adam steps, and after the start and every step a FULL mesh round
    (``MeshSender``) and a DELTA mesh round (``DeltaMeshSender``) of the same weights, one after
    the other, each on its own sender and receiver objects. Printed per format and step: the
    payload bytes every pair carried in each (summed over the pairs), the delta's as % of the
    full's, the wall seconds of each round on the slower trainer rank (``send`` call,
    quantization included), whether both receivers hold the same bytes after both rounds; then
    the medians over the delta steps (every step but the start) and the load average before and
    after."""
    import tempfile

    from mesh_delta_harness import run_delta_mesh, save_trajectory

    from qstrat.transport.mesh.routing import ReceiverLayout

    layouts = [ReceiverLayout(1, 2, (1, 3, 5, 7), moe_tp=False).to_dict(),
               ReceiverLayout(0, 2, (0, 2, 4, 6), moe_tp=False).to_dict()]
    print(f"mesh: 2 trainer processes -> 2 expert-parallel receivers, gloo on loopback, tiny Qwen3-MoE, "
          f"{args.bucket_mib[0]:g} MiB buckets per pair, secret set; wall = the slower trainer rank's send call "
          f"(quantization included)")
    with tempfile.TemporaryDirectory() as tmp:
        for lr in args.lr:
            path = os.path.join(tmp, f"states-{lr:g}.pt")
            save_trajectory(path, lr, args.steps)
            load = os.getloadavg()[0]
            res = run_delta_mesh(free_port(), list(args.formats), 2, layouts, path, modes=("atomic", "delta"),
                                 bucket_bytes=int(args.bucket_mib[0] * 2**20))
            after = os.getloadavg()[0]
            bad = {r: v for r, (st, v) in res.items() if st != "ok"}
            if bad:
                raise RuntimeError(f"mesh delta bench: ranks failed: {bad}")
            print(f"\n{'format':9} {'lr':>6} {'step':>4} {'full B':>9} {'delta B':>9} {'%':>6} {'attempts':>8} "
                  f"{'full s':>7} {'delta s':>7} {'exact':>5}")
            for f, fmt in enumerate(args.formats):
                rows = []
                for i in range(args.steps + 1):
                    got = {m: [res[s][1][f][m][i] for s in range(2)] for m in ("atomic", "delta")}
                    if any(st != "ok" for m in got for st, _, _ in got[m]):
                        raise RuntimeError(f"mesh delta bench: {fmt} step {i}: {got}")
                    full_b = sum(sum(sent.values()) for _, sent, _ in got["atomic"])
                    delta_b = sum(sum(sent.values()) for _, sent, _ in got["delta"])
                    full_s = max(extra[1] for _, _, extra in got["atomic"])
                    delta_s = max(extra[1] for _, _, extra in got["delta"])
                    attempts = max(extra[0]["attempts"] for _, _, extra in got["delta"])
                    exact = all(res[2 + r][1][f]["atomic"][i][1] == res[2 + r][1][f]["delta"][i][1] for r in range(2))
                    print(f"{fmt:9} {lr:6.0e} {i:>4} {full_b:>9} {delta_b:>9} {100 * delta_b / full_b:>6.2f} "
                          f"{attempts:>8} {full_s:>7.3f} {delta_s:>7.3f} {str(exact):>5}", flush=True)
                    if i:
                        rows.append((full_s, delta_s, full_b, delta_b))
                if rows:
                    med = [statistics.median(r[k] for r in rows) for k in range(4)]
                    print(f"{'':9} median of {len(rows)} delta steps: wall s full {med[0]:.3f} / delta {med[1]:.3f} "
                          f"(x{med[1] / med[0]:.2f}), bytes {100 * med[3] / med[2]:.2f} % of full; load average "
                          f"{load:.1f} -> {after:.1f}", flush=True)


def mesh_section(args) -> None:
    """``--mesh-links RATE...``: every process behind its own shaped link (scripts/mesh_links.py);
    per rate: (i) raw gloo point-to-point, S senders x R receivers all pairs at once, efficiency =
    busiest link's bytes (``max(S, R) * pair bytes``) * 8 / (seconds * rate); (ii) today's
    ``RefitSender`` round and a raw gloo broadcast of its buckets into R receivers, efficiency
    against the flat model (the sender's link carries the payload once per receiver) and the
    pipelined one (once); (iii) the mesh round through :func:`run_mesh`, where plugged in. Then
    the routing model's round time for the example configs at 400 Gbit/s per GPU, at the measured
    point-to-point efficiency (the lowest over the configurations at the last rate). The machine's
    load average is printed beside every figure."""
    from mesh_links import broadcast_refit, mesh_links, p2p_round

    configs = [(s, r) for s in args.senders for r in args.mesh_receivers]
    pair = int(args.pair_mib * 2**20)
    n = max(max(s + r for s, r in configs), 1 + max(args.mesh_receivers))
    effs: list[float] = []
    for rate in args.mesh_links:
        bps = rate_bits(rate)
        with mesh_links(n, rate) as links:
            print(f"\n== per-process links: {n} namespaces, each {rate} in and out ==", flush=True)
            effs = []
            for (s, r), secs in p2p_round(links, configs, pair, args.reps).items():
                med = statistics.median(secs)
                effs.append(max(s, r) * pair * 8 / (med * bps))
                print(f"  p2p gloo S={s} R={r}: {pair / 2**20:g} MiB per pair, busiest link {max(s, r) * pair / 2**20:g} "
                      f"MiB in {med:.3f} s (median of {len(secs)}): efficiency {effs[-1]:.2f} of {rate} "
                      f"[load {os.getloadavg()[0]:.1f}]", flush=True)
            for r in args.mesh_receivers:
                b = broadcast_refit(links, r, args.layers, args.layer_mib, args.bucket_mib[0], args.reps)
                for what in ("refit_s", "raw_s"):
                    med = statistics.median(b[what])
                    eff = {k: b["payload"] * c * 8 / (med * bps) for k, c in (("tree", r.bit_length()), ("flat", r),
                                                                               ("pipelined", 1))}
                    print(f"  broadcast {'RefitSender round' if what == 'refit_s' else 'raw gloo broadcast'} R={r}: "
                          f"{b['payload'] / 2**20:.1f} MiB in {med:.3f} s: efficiency {eff['tree']:.2f} as a binomial "
                          f"tree (the sender's link carries ceil(log2(R+1)) = {r.bit_length()} copies), "
                          f"{eff['flat']:.2f} if flat (R copies), {eff['pipelined']:.2f} if pipelined (1) "
                          f"[load {os.getloadavg()[0]:.1f}]", flush=True)
            p2p_eff = dict(zip(configs, effs))
            for s, r in configs:
                got = run_mesh(s, r, links, pair, args.reps)
                med, bmed = statistics.median(got["mesh_s"]), statistics.median(got["broadcast_s"])
                busiest = max(s, r) * pair
                floor = busiest * 8 / (bps * p2p_eff[(s, r)])
                share = sorted(set(got["received"].values()))
                print(f"  mesh round S={s} R={r}: {got['payload'] / 2**20:g} MiB payload, each engine rank received "
                      f"{'/'.join(f'{b / 2**20:g}' for b in share)} MiB, busiest link {busiest / 2**20:g} MiB: "
                      f"{med:.3f} s (median of {len(got['mesh_s'])}; bucket streams {statistics.median(got['stream_s']):.3f} s); the busiest link at the measured p2p rate "
                      f"({p2p_eff[(s, r)]:.2f} x {rate}) needs {floor:.3f} s: ratio {med / floor:.2f} (target <= 1.25), "
                      f"{busiest * 8 / (med * bps):.2f} of {rate}; RefitSender broadcast of the same payload "
                      f"{bmed:.3f} s: speedup {bmed / med:.1f}x [load {os.getloadavg()[0]:.1f}]", flush=True)
    if effs:
        project(min(effs))


def project(efficiency: float) -> None:
    """The routing model's figures at 400 Gbit/s per GPU x ``efficiency`` (measured)."""
    from qstrat.cli.bench import PLAN_MODELS
    from qstrat.plan.cluster_report import bench_cluster

    print(f"\nprojected (routing model, not measured): 400 Gbit/s per GPU x measured p2p efficiency {efficiency:.2f}")
    for row in bench_cluster(PLAN_MODELS[0].parent):
        print(f"  {row['model']:16} {row['trainer']:10} -> {row['engine']:22} busiest {row['busiest_gb']:7.1f} GB: "
              f"mesh {row['mesh_s'] / efficiency:6.2f} s; broadcast pipelined {row['broadcast_pipelined_s'] / efficiency:6.1f} s, "
              f"tree (gloo) {row['broadcast_tree_s'] / efficiency:6.1f} s, flat {row['broadcast_flat_s'] / efficiency:7.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--layer-mib", type=float, default=12)
    ap.add_argument("--receivers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--bucket-mib", type=float, nargs="+", default=[4, 16, 64],
                    help="bucket sizes, MiB (default 4 16 64; throughput: each in turn; --memory, --delta and "
                         "--mesh-delta: the first)")
    ap.add_argument("--delta-min-mib", type=float, default=None,
                    help="--delta: the delta sender's delta_min_bucket_bytes in MiB (default: RefitSender's, "
                         f"{DELTA_MIN_BUCKET_BYTES / 2**20:g}; 0: delta rounds laid out with --bucket-mib as given). "
                         "Not used by --mesh-delta, which lays both of its rounds out with --bucket-mib as given")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--secret", action="store_true", help="authenticated rounds (both sides hold a secret)")
    ap.add_argument("--memory", action="store_true", help="receiver peak RSS per mode (see the docstring)")
    ap.add_argument("--modes", nargs="+", default=["atomic", "bounded"])
    ap.add_argument("--json", help="with --memory or --delta: also write the rows (bytes, seconds) to this JSON file")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads in every process (default 1: on a shared, "
                         "oversubscribed CPU, OpenMP-parallel copies run ~100x slower)")
    ap.add_argument("--delta", action="store_true",
                    help="delta vs full rounds of a tiny Qwen3-MoE over real Adam steps, per format and lr: "
                         "wire bytes, encode/decode s, round wall and CPU s, exactness, memory (see the docstring)")
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5],
                    help="--delta: Adam learning rates, one trajectory each (default 1e-6 1e-5)")
    ap.add_argument("--steps", type=int, default=4,
                    help="--delta: optimizer steps per trajectory, after the start round (whole) (default 4)")
    ap.add_argument("--width", type=int, default=1,
                    help="--delta: the tiny model's hidden/intermediate sizes and heads times this (1: ~5 MiB "
                         "quantized, 4: ~64 MiB)")
    ap.add_argument("--formats", nargs="+", default=list(DELTA_FORMATS), choices=list(DELTA_FORMATS),
                    help="--delta: checkpoint formats (default all)")
    ap.add_argument("--link", nargs="+", default=[LOOPBACK], metavar="RATE",
                    help="run every measurement over each of these links in turn: a tc rate (1gbit, 10gbit, "
                         f"500mbit: a veth pair into a network namespace, both directions shaped by tc tbf; "
                         f"needs root, ip and tc), {UNSHAPED!r} (the veth pair, not shaped) or {LOOPBACK!r} "
                         "(127.0.0.1, no namespace; the default)")
    ap.add_argument("--mesh-links", nargs="+", metavar="RATE",
                    help="every process behind its own link shaped to each RATE in turn (root): raw gloo "
                         "point-to-point and today's broadcast refit, efficiency per link, then the routing "
                         "model's projection (see mesh_section)")
    ap.add_argument("--mesh-delta", action="store_true",
                    help="delta vs full MESH rounds on loopback: 2 trainer processes into 2 expert-parallel "
                         "receivers, real Adam steps per --lr and --formats (see mesh_delta)")
    ap.add_argument("--senders", type=int, nargs="+", default=[1, 2, 4], help="--mesh-links: sender counts S")
    ap.add_argument("--mesh-receivers", type=int, nargs="+", default=[2, 4], help="--mesh-links: receiver counts R")
    ap.add_argument("--pair-mib", type=float, default=8, help="--mesh-links: MiB each (sender, receiver) pair moves")
    args = ap.parse_args()
    if args.delta_min_mib is not None and args.delta_min_mib < 0:
        ap.error(f"--delta-min-mib {args.delta_min_mib:g}: give a size >= 0 (MiB; 0: the delta rounds' buckets "
                 f"as --bucket-mib)")
    torch.set_num_threads(args.threads)
    if args.mesh_delta:
        mesh_delta(args)
        return
    if args.mesh_links:
        check_can_shape()
        for rate in args.mesh_links:
            rate_bits(rate)
        mesh_section(args)
        return
    for link in args.link:  # refuse a bad rate or a missing privilege before measuring anything
        if link != LOOPBACK:
            check_can_shape()
            if link != UNSHAPED:
                rate_bits(link)
    tensors = None if args.delta else synthetic(args.layers, args.layer_mib)
    summary: list[dict] = []
    memory_rows: list[dict] = []
    for link in args.link:
        args.link_name = link
        with contextlib.nullcontext("127.0.0.1") if link == LOOPBACK else shaped_link(link) as address:
            args.address = address
            print(f"\n== link: {link} (sender {address}) ==", flush=True)
            if args.delta:
                delta(args, summary)
                continue
            for row in (memory if args.memory else throughput)(args, tensors) or []:
                memory_rows.append({**row, "link": link})
    if summary:
        print_summary(summary)
    if args.json and (summary or memory_rows):
        Path(args.json).write_text(json.dumps({"delta": summary} if summary else {"memory": memory_rows}, indent=1))


#: Issue 45's round-time targets, delta / full wall at lr 1e-6: on loopback, and behind a link
#: of at most this many Gbit/s (``--link 1gbit``: measured ~0.9-1.0).
LOOPBACK_TARGET, LINK_TARGET, LINK_TARGET_GBPS = 0.9, 0.3, 1.05


def target_verdict(row: dict) -> str:
    """``meets`` / ``misses`` issue 45's target for ``row`` (a summary row at lr 1e-6, on
    loopback or a link of at most :data:`LINK_TARGET_GBPS`), else ``-`` (no target)."""
    if abs(row["lr"] - 1e-6) > 1e-12:
        return "-"
    bound = (LOOPBACK_TARGET if row["link"] == LOOPBACK else
             LINK_TARGET if row["link_gbps"] <= LINK_TARGET_GBPS else None)
    if bound is None:
        return "-"
    return "meets" if row["delta_s"] / row["full_s"] <= bound else "misses"


def print_summary(summary: list[dict]) -> None:
    """The delta runs' medians, one row per link, format, width and lr; then per format, width and
    lr over the links, the break-even link rate (:func:`break_even`)."""
    print(f"\nmedians; f/d = full round / delta round; target: delta/full wall <= {LOOPBACK_TARGET} on loopback, "
          f"<= {LINK_TARGET} behind a link of <= {LINK_TARGET_GBPS:g} Gbit/s, at lr 1e-6 (issue 45's acceptance)")
    print(f"{'link':>9} {'Gbit/s':>6} {'format':9} {'width':>5} {'lr':>6} {'full MiB':>8} {'delta %':>7} "
          f"{'full s':>6} {'delta s':>7} {'delta/full':>10} {'cpu s f/d':>11} {'load':>9} {'target':>8}")
    for r in summary:
        print(f"{r['link']:>9} {r['link_gbps']:>6.2f} {r['format']:9} {r['width']:>5} {r['lr']:>6.0e} "
              f"{r['full_bytes'] / 2**20:>8.2f} {100 * r['delta_bytes'] / r['full_bytes']:>7.2f} "
              f"{r['full_s']:>6.3f} {r['delta_s']:>7.3f} {r['delta_s'] / r['full_s']:>10.2f} "
              f"{r['full_cpu_s']:>5.2f}/{r['delta_cpu_s']:<5.2f} {r['load'][0]:>4.1f}-{r['load'][1]:<4.1f} "
              f"{target_verdict(r):>8}", flush=True)
    groups: dict[tuple, list[dict]] = {}
    for r in summary:
        groups.setdefault((r["format"], r["width"], r["lr"]), []).append(r)
    if any(len(rows) > 1 for rows in groups.values()):
        print("\nbreak-even link rate (Gbit/s measured; delta faster below it):")
        for (fmt, width, lr), rows in groups.items():
            print(f"  {fmt:9} width {width} lr {lr:.0e}: {break_even(rows)}")


if __name__ == "__main__":
    main()
