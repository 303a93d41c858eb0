"""Benchmark: qstrat's transport round vs a raw gloo broadcast of the same bytes.

One sender (this process, rank 0) and N receiver processes (StandaloneReceiver, no engine;
tests/transport_harness.py). The payload is a synthetic block-FP8 checkpoint: per layer 24
float8_e4m3fn weights [512, 1024] with float32 block scales [4, 8] and a bfloat16 norm [1024];
plus a bfloat16 embedding [8192, 1024] (16 MiB: chunked for every bucket size below 16 MiB).

For each bucket size it measures, median of ``--reps``:

* ``transport``: ``RefitSender.send`` - wire manifest RPC and check, pack + CRC-32 (double
  buffered), broadcast, receive + CRC check, votes, zero-copy unpack, commit on every
  receiver (the round's wall time as the sender sees it, RPCs over pipes included);
* ``raw``: plain ``broadcast`` of the same bucket sizes from preallocated buffers, two in
  flight, no packing, no checksum (the same group);
* ``pack+crc``: packing and checksumming alone, in this process (no wire).

GB/s = payload bytes / seconds / 1e9; ratio = transport GB/s / raw GB/s.

    .venv/bin/python scripts/bench_transport.py [--layers 8] [--receivers 2] [--bucket-mib 1 4 16 64] [--reps 3] [--threads 1]
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
from qstrat.transport.buckets import bucket_contents, checksum, pack  # noqa: E402


def synthetic(layers: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = [("model.embed_tokens.weight", torch.randn(8192, 1024, generator=g).to(torch.bfloat16))]
    for i in range(layers):
        out.append((f"model.layers.{i}.input_layernorm.weight", torch.ones(1024, dtype=torch.bfloat16)))
        for j in range(24):
            w = torch.randint(0, 256, (512, 1024), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
            out.append((f"model.layers.{i}.mlp.experts.{j}.weight", w))
            out.append((f"model.layers.{i}.mlp.experts.{j}.weight_scale_inv", torch.rand(4, 8, generator=g)))
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--bucket-mib", type=float, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads in this process (default 1: on a shared, "
                         "oversubscribed CPU, OpenMP-parallel copies run ~100x slower)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    tensors = synthetic(args.layers)
    receivers = [Receiver("standalone", "") for _ in range(args.receivers)]
    try:
        for r in receivers:
            r.wait_ready()
        sender = RefitSender([r.rpc for r in receivers], "127.0.0.1", free_port(), timeout_s=120)
        sender.connect()
        print(f"torch {torch.__version__}, gloo, {args.receivers} receivers, "
              f"{torch.get_num_threads()} threads")
        print(f"{'bucket MiB':>10} {'payload MiB':>11} {'buckets':>7} {'transport GB/s':>14} "
              f"{'raw GB/s':>9} {'ratio':>6} {'pack+crc GB/s':>13}")
        for mib in args.bucket_mib:
            sender.bucket_bytes = int(mib * 2**20)
            wire_manifest = build_wire_manifest(((n, str(t.dtype).removeprefix("torch."), tuple(t.shape))
                                       for n, t in tensors), sender.bucket_bytes)
            sizes = [b.nbytes for b in wire_manifest.buckets]
            bufs = [torch.zeros(sender.bucket_bytes, dtype=torch.uint8) for _ in range(2)]
            t_tr, t_raw, t_pack = [], [], []
            for _ in range(args.reps):
                t_tr.append(sender.send(wire_manifest, iter(tensors)).seconds)
                futures = [sender._pool.submit(r.rpc.call, "raw_broadcast", sizes) for r in receivers]
                t0 = time.perf_counter()
                raw_broadcast(sender.group, sizes, bufs)
                for f in futures:
                    f.result(120)
                t_raw.append(time.perf_counter() - t0)
                t_pack.append(pack_only(wire_manifest, tensors))
            gbps = [wire_manifest.total_bytes / statistics.median(t) / 1e9 for t in (t_tr, t_raw, t_pack)]
            print(f"{mib:>10g} {wire_manifest.total_bytes / 2**20:>11.1f} {len(sizes):>7} {gbps[0]:>14.2f} "
                  f"{gbps[1]:>9.2f} {gbps[0] / gbps[1]:>6.2f} {gbps[2]:>13.2f}")
        sender.close()
    finally:
        for r in receivers:
            r.close()


if __name__ == "__main__":
    main()
