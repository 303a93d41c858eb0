"""Benchmark: qstrat's transport round vs a raw gloo broadcast of the same bytes, and receiver memory.

One sender (this process, rank 0) and N receiver processes (StandaloneReceiver, no engine;
tests/transport_harness.py; its loader copies into the tensors it holds, like an engine's weight
loader). The payload is a synthetic block-FP8 checkpoint: per layer 24 float8_e4m3fn weights
[rows, 1024] (rows from ``--layer-mib``; 512 rows = 12 MiB per layer, the default) with float32
block scales and a bfloat16 norm; plus a bfloat16 embedding [8192, 1024] (16 MiB).

Throughput (default), per bucket size, median of ``--reps``:

* ``transport``: ``RefitSender.send`` - wire manifest RPC and check, challenge, round MAC, pack +
  device checksum + seal (double buffered), broadcast, receive + checksum + seal check, votes,
  unpack and load on every receiver (the round's wall time as the sender sees it);
* ``raw``: plain ``broadcast`` of the same bucket sizes from preallocated buffers, two in
  flight, no packing, no checksum (the same group);
* ``stream ratio``: the same with only the stream (``TransferReport.stream_seconds``: challenge,
  header, votes and buckets; without the three RPCs and the receivers' load);
* ``raw staged``: the raw broadcast with every receiver receiving each bucket into a NEW buffer
  kept to the end (fresh memory, as a round's staging), as a ratio to ``raw``;
* ``pack+sum``: packing and checksumming alone, in this process (no wire);
* then the sender's bucket loop by activity (source/pack/checksum/wait seconds) and receiver 1's
  (alloc/wait/checksum/load seconds): where a round's time goes.

GB/s = payload bytes / seconds / 1e9; ratio = transport GB/s / raw GB/s.

Memory (``--memory``), per mode, fresh receivers: round 1 fills the receivers' tensors (the
"model"), the peak RSS is reset (Linux ``/proc/self/clear_refs``), round 2 runs; printed: the
receivers' peak RSS above their RSS before round 2, against the payload, and the round's time
against a raw broadcast of the same bytes.

    .venv/bin/python scripts/bench_transport.py [--layers 8] [--layer-mib 12] [--receivers 2] [--bucket-mib 4 16 64] [--reps 3]
    .venv/bin/python scripts/bench_transport.py --memory --layers 8 --layer-mib 256 --receivers 1 --bucket-mib 64 --modes atomic bounded
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from transport_harness import Receiver, free_port, raw_broadcast  # noqa: E402

from qstrat.transport import RefitSender, build_wire_manifest  # noqa: E402
from qstrat.transport.buckets import bucket_contents, pack  # noqa: E402
from qstrat.transport.checksum import checksum  # noqa: E402

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


def pack_only(wire_manifest, tensors) -> float:
    data = dict(tensors)
    buf = torch.empty(wire_manifest.bucket_bytes, dtype=torch.uint8)
    t0 = time.perf_counter()
    for b, slots in zip(wire_manifest.buckets, bucket_contents(wire_manifest)):
        if b.tensor is None:
            checksum(pack(buf, b, slots, [data[s.name] for s in slots]))
        else:
            checksum(data[b.tensor].reshape(-1).view(torch.uint8)[:b.nbytes])
    return time.perf_counter() - t0


def manifest_for(tensors, bucket_bytes):
    return build_wire_manifest(((n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors),
                               bucket_bytes)


def raw_round(sender, receivers, sizes, bufs, staged=False) -> float:
    futures = [sender._pool.submit(r.rpc.call, "raw_broadcast", sizes, staged) for r in receivers]
    t0 = time.perf_counter()
    raw_broadcast(sender.group, sizes, bufs)
    for f in futures:
        f.result(600)
    return time.perf_counter() - t0


def start(args, mode="atomic"):
    receivers = [Receiver("standalone", "", timeout_s=600, threads=args.threads) for _ in range(args.receivers)]
    for r in receivers:
        r.wait_ready()
        if args.secret:
            r.ctl.call("setenv", "QSTRAT_TRANSFER_SECRET", SECRET)
    sender = RefitSender([r.rpc for r in receivers], "127.0.0.1", free_port(), timeout_s=600, mode=mode,
                         secret=SECRET if args.secret else None)
    sender.connect()
    return sender, receivers


def throughput(args, tensors) -> None:
    sender, receivers = start(args)
    try:
        print(f"torch {torch.__version__}, gloo, {args.receivers} receivers, {torch.get_num_threads()} "
              f"threads per process, {'authenticated' if args.secret else 'no secret'}")
        print(f"{'bucket MiB':>10} {'payload MiB':>11} {'buckets':>7} {'transport GB/s':>14} "
              f"{'raw GB/s':>9} {'ratio':>6} {'stream ratio':>12} {'raw staged':>10} {'pack+sum GB/s':>13}  profile (s)")
        for mib in args.bucket_mib:
            sender.bucket_bytes = int(mib * 2**20)
            wm = manifest_for(tensors, sender.bucket_bytes)
            sizes = [b.nbytes for b in wm.buckets]
            bufs = [torch.zeros(sender.bucket_bytes, dtype=torch.uint8) for _ in range(2)]
            t_tr, t_raw, t_pack, profs, t_stream, t_staged = [], [], [], [], [], []
            for _ in range(args.reps):
                report = sender.send(wm, iter(tensors))
                t_tr.append(report.seconds)
                t_stream.append(report.stream_seconds)
                profs.append((dict(sender.profile), receivers[0].ctl.call("stats")))
                t_raw.append(raw_round(sender, receivers, sizes, bufs))
                t_staged.append(raw_round(sender, receivers, sizes, bufs, staged=True))
                t_pack.append(pack_only(wm, tensors))
            gbps = [wm.total_bytes / statistics.median(t) / 1e9 for t in (t_tr, t_raw, t_pack, t_stream, t_staged)]
            snd, rcv = profs[t_tr.index(statistics.median(t_tr))] if args.reps % 2 else profs[-1]
            prof = " ".join(f"{k[:-2]}={v:.2f}" for k, v in snd.items())
            prof += " | recv " + " ".join(f"{k[:-2]}={v:.2f}" for k, v in rcv.items() if k.endswith("_s"))
            print(f"{mib:>10g} {wm.total_bytes / 2**20:>11.1f} {len(sizes):>7} {gbps[0]:>14.2f} "
                  f"{gbps[1]:>9.2f} {gbps[0] / gbps[1]:>6.2f} {gbps[3] / gbps[1]:>12.2f} {gbps[4] / gbps[1]:>10.2f} {gbps[2]:>13.2f}  "
                  f"send {prof}")
        sender.close()
    finally:
        for r in receivers:
            r.close()


def memory(args, tensors) -> None:
    mib = args.bucket_mib[0]
    print(f"torch {torch.__version__}, gloo, {args.receivers} receiver(s), bucket {mib:g} MiB, "
          f"{'authenticated' if args.secret else 'no secret'}")
    print(f"{'mode':>8} {'payload MiB':>11} {'RSS before MiB':>14} {'peak above MiB':>14} {'x payload':>9} "
          f"{'round s':>8} {'raw s':>6} {'ratio':>6}")
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
            raw = raw_round(sender, receivers, sizes, bufs)
            above = max(p - b for p, b in zip(peaks, before))
            print(f"{mode:>8} {wm.total_bytes / 2**20:>11.1f} {max(before) / 2**20:>14.0f} "
                  f"{above / 2**20:>14.0f} {above / wm.total_bytes:>9.2f} {report.seconds:>8.2f} "
                  f"{raw:>6.2f} {raw / report.seconds:>6.2f}", flush=True)
            sender.close()
        finally:
            for r in receivers:
                r.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--layer-mib", type=float, default=12)
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--bucket-mib", type=float, nargs="+", default=[4, 16, 64])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--secret", action="store_true", help="authenticated rounds (both sides hold a secret)")
    ap.add_argument("--memory", action="store_true", help="receiver peak RSS per mode (see the docstring)")
    ap.add_argument("--modes", nargs="+", default=["atomic", "bounded"])
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads in every process (default 1: on a shared, "
                         "oversubscribed CPU, OpenMP-parallel copies run ~100x slower)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tensors = synthetic(args.layers, args.layer_mib)
    (memory if args.memory else throughput)(args, tensors)


if __name__ == "__main__":
    main()
