"""Every process behind its own shaped link, for the mesh measurements (root only).

``mesh_links(n, rate)`` makes ``n`` network namespaces ``mm0..mm{n-1}``, each joined to a bridge
``mmbr0`` in this namespace by its own veth pair (``mmh{i}`` on the bridge, ``mmn{i}`` inside,
10.141.0.{10+i}/24), both ends' egress shaped by tbf to ``rate``: what a process in ``mm{i}``
sends crosses ``mmn{i}``'s shaper (its outgoing link), what it receives crosses ``mmh{i}``'s (its
incoming link) - one full-duplex NIC per process, as a GPU's in a cluster. A process is started
inside a namespace by :func:`spawn_in` (``multiprocessing``'s spawn, through ``ip netns exec``
with ``GLOO_SOCKET_IFNAME`` set to its link), so every gloo connection between two processes
crosses both of their links.

Names start with ``mm`` (this branch's prefix on the shared machine). Leftovers of an earlier
run that was killed (the same names) are removed before creating; a second run while one is open
is refused (an exclusive lock). Everything made is removed at exit, shapers with their links.

:func:`p2p_round` (raw ``torch.distributed`` gloo point-to-point, all pairs at once),
:func:`broadcast_refit` (today's ``RefitSender`` into engine-less receivers) and
:func:`mesh_round` (the mesh round: ``MeshSender`` ranks into ``MeshReceiver`` ranks) run inside it;
scripts/bench_transport.py ``--mesh-links`` prints them.
"""
from __future__ import annotations

import contextlib
import fcntl
import multiprocessing as mp
import multiprocessing.spawn as mp_spawn
import os
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

from shaped_link import _sh, check_can_shape, rate_bits

PREFIX, BRIDGE, SUBNET = "mm", "mmbr0", "10.141.0"
LOCK = "/run/mm-links.lock"
#: The most namespaces one run makes (interface names stay under 15 characters).
MAX_LINKS = 32


@dataclass(frozen=True)
class Link:
    """One process's place: its namespace, its interface inside, its address, its spawn wrapper."""

    netns: str
    ifname: str
    address: str
    wrapper: str


def _names(i: int) -> tuple[str, str, str]:
    return f"{PREFIX}{i}", f"{PREFIX}h{i}", f"{PREFIX}n{i}"


def _remove(n: int) -> None:
    """Remove namespaces ``mm0..``, their veth pairs and the bridge (missing ones skipped)."""
    present = _sh("ip", "netns", "list").stdout.split()
    for i in range(max(n, MAX_LINKS)):
        ns, host_if, _ = _names(i)
        _sh("ip", "link", "del", host_if, check=False)  # deletes its peer (and both shapers) too
        if ns in present:
            _sh("ip", "netns", "del", ns, check=False)
    _sh("ip", "link", "del", BRIDGE, check=False)


def _shape(run, dev: str, rate: str) -> None:
    burst = max(256 * 1024, int(rate_bits(rate) / 8 / 1000))
    run("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst), "latency", "50ms")


def _create(n: int, rate: str) -> None:
    _sh("ip", "link", "add", BRIDGE, "type", "bridge")
    _sh("ip", "link", "set", BRIDGE, "up")
    for i in range(n):
        ns, host_if, ns_if = _names(i)
        in_ns = lambda *cmd: _sh("ip", "netns", "exec", ns, *cmd)  # noqa: E731
        _sh("ip", "netns", "add", ns)
        in_ns("ip", "link", "set", "lo", "up")
        _sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _sh("ip", "link", "set", ns_if, "netns", ns)
        _sh("ip", "link", "set", host_if, "master", BRIDGE)
        _sh("ip", "link", "set", host_if, "up")
        in_ns("ip", "addr", "add", f"{SUBNET}.{10 + i}/24", "dev", ns_if)
        in_ns("ip", "link", "set", ns_if, "up")
        _shape(_sh, host_if, rate)     # into the namespace: the process's incoming link
        _shape(in_ns, ns_if, rate)     # out of it: its outgoing link


@contextlib.contextmanager
def mesh_links(n: int, rate: str) -> Iterator[list[Link]]:
    """``n`` shaped per-process links (module docstring); yields them, removes them on exit.

    Raises: SystemExit when not root, ``ip``/``tc`` are missing, ``rate`` is not a tc rate,
        ``n`` is out of range, another run holds the lock, or a command fails.
    """
    check_can_shape()
    rate_bits(rate)
    if not 1 <= n <= MAX_LINKS:
        raise SystemExit(f"mesh_links: {n} links; expected 1..{MAX_LINKS}")
    with open(LOCK, "w") as lock, tempfile.TemporaryDirectory(prefix="mm-links-") as tmp:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(f"mesh_links: another run holds {LOCK}; wait for it to end") from None
        links = []
        for i in range(n):
            ns, _, ns_if = _names(i)
            wrapper = os.path.join(tmp, f"python-in-{ns}")
            with open(wrapper, "w") as f:
                f.write(f'#!/bin/sh\nexec ip netns exec {ns} env GLOO_SOCKET_IFNAME={ns_if} "{sys.executable}" "$@"\n')
            os.chmod(wrapper, stat.S_IRWXU)
            links.append(Link(ns, ns_if, f"{SUBNET}.{10 + i}", wrapper))
        _remove(n)  # a killed earlier run's leftovers (this run holds the lock: nobody else's)
        try:
            _create(n, rate)
            yield links
        finally:
            _remove(n)


def spawn_in(link: Link, ctx, target, args) -> mp.Process:
    """Start ``target(*args)`` in a spawned process inside ``link``'s namespace."""
    old = mp_spawn.get_executable()
    mp_spawn.set_executable(link.wrapper)
    try:
        p = ctx.Process(target=target, args=args, daemon=False)
        p.start()
    finally:
        mp_spawn.set_executable(os.fsdecode(old))
    return p


def _reap(procs: list, grace_s: float) -> None:
    """Join every process, killing one still alive after ``grace_s`` seconds."""
    for p in procs:
        p.join(grace_s)
        if p.is_alive():
            p.kill()
            p.join(5)


def _p2p_worker(rank: int, world: int, master: str, port: int, configs, nbytes: int, reps: int, out) -> None:
    """One rank of the point-to-point measurement: for each ``(S, R)`` of ``configs``, ranks
    ``0..S-1`` each send ``nbytes`` to every rank ``S..S+R-1`` and those receive from every
    sender, all pairs posted at once (``isend``/``irecv``); ``reps + 1`` rounds (the first warms
    the connections). Sends ``[(S, R, [(start, end) per rank per rep])]`` to ``out`` (rank 0)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    inbox = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(world)]
    results = []
    for s, r in configs:
        times = []
        for _ in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank < s:
                works = [dist.isend(buf, dst) for dst in range(s, s + r)]
            elif rank < s + r:
                works = [dist.irecv(inbox[src], src) for src in range(s)]
            else:
                works = []
            for w in works:
                w.wait()
            stamp = torch.tensor([t0, time.perf_counter()] if works else [float("inf"), 0.0], dtype=torch.float64)
            every = [torch.empty(2, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(every, stamp)
            times.append((min(t[0].item() for t in every), max(t[1].item() for t in every)))
        results.append((s, r, times[1:]))
    if rank == 0:
        out.send(results)
    dist.destroy_process_group()


def p2p_round(links: list[Link], configs: list[tuple[int, int]], nbytes: int, reps: int,
              port: int = 29641) -> dict[tuple[int, int], list[float]]:
    """Wall seconds of each rep of each ``(S, R)`` all-pairs point-to-point round (one process per
    link, one gloo group, rank ``i`` in ``links[i]``), from the first rank's start to the last
    rank's end (CLOCK_MONOTONIC is one clock for every process on the machine)."""
    world = max(s + r for s, r in configs)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    procs = [spawn_in(links[i], ctx, _p2p_worker, (i, world, links[0].address, port, configs, nbytes, reps, child))
             for i in range(world)]
    try:
        if not parent.poll(600):
            raise TimeoutError("p2p_round: no result within 600 s")
        results = parent.recv()
    finally:
        _reap(procs, 30)
    return {(s, r): [end - start for start, end in times] for s, r, times in results}


def _broadcast_sender(links: list[Link], receivers: int, layers: int, layer_mib: float, bucket_mib: float,
                      reps: int, port: int, out, outputs=None) -> None:
    """Today's round inside ``links[0]``: a ``RefitSender`` (rank 0) into ``receivers`` standalone
    receivers, each in its own ``links[1 + i]``; ``reps`` timed rounds after one warm-up, then as
    many raw gloo broadcasts of the same buckets (tests/transport_harness.py); ``outputs`` (the
    mesh benchmark's ``(name, dtype, shape, owner)``): that payload instead of the synthetic
    checkpoint, all of it sent by this one process. Sends
    ``{"payload": bytes, "refit_s": [...], "raw_s": [...]}`` to ``out``."""
    from bench_transport import manifest_for, raw_round, synthetic
    from transport_harness import Receiver

    import torch
    from qstrat.transport import RefitSender

    ctx = mp.get_context("spawn")
    old = mp_spawn.get_executable()
    started = []
    try:
        for link in links[1:1 + receivers]:
            mp_spawn.set_executable(link.wrapper)
            started.append(Receiver("standalone", "", timeout_s=600, threads=1))
        mp_spawn.set_executable(os.fsdecode(old))
        for r in started:
            r.wait_ready()
        tensors = (synthetic(layers, layer_mib) if outputs is None else
                   [(n, torch.ones(shape, dtype=getattr(torch, d))) for n, d, shape, _ in outputs])
        sender = RefitSender([r.rpc for r in started], links[0].address, port, timeout_s=600,
                             bucket_bytes=int(bucket_mib * 2**20))
        sender.connect()
        wm = manifest_for(tensors, sender.bucket_bytes)
        sizes = [b.nbytes for b in wm.buckets]
        bufs = [torch.zeros(sender.bucket_bytes, dtype=torch.uint8) for _ in range(2)]
        sender.send(wm, iter(tensors))  # warm-up: the receivers' tensors exist after it
        raw_round(sender, started, sizes[:1], bufs)
        refit_s, raw_s = [], []
        for _ in range(reps):
            refit_s.append(sender.send(wm, iter(tensors)).seconds)
            raw_s.append(raw_round(sender, started, sizes, bufs)[0])
        sender.close()
        out.send({"payload": wm.total_bytes, "refit_s": refit_s, "raw_s": raw_s})
    finally:
        mp_spawn.set_executable(os.fsdecode(old))
        for r in started:
            r.close()
    del ctx


def broadcast_refit(links: list[Link], receivers: int, layers: int = 2, layer_mib: float = 12,
                    bucket_mib: float = 4, reps: int = 3, port: int = 29651, outputs=None) -> dict:
    """Today's single-sender round over per-process links (:func:`_broadcast_sender`, run in a
    process spawned inside ``links[0]``). Returns its result dict."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = spawn_in(links[0], ctx, _broadcast_sender,
                 (links, receivers, layers, layer_mib, bucket_mib, reps, port, child, outputs))
    try:
        if not parent.poll(900):
            raise TimeoutError("broadcast_refit: no result within 900 s")
        return parent.recv()
    finally:
        _reap([p], 60)


def mesh_outputs_synthetic(senders: int, receivers: int, pair_bytes: int) -> list[tuple[str, str, tuple[int, ...], int]]:
    """The mesh benchmark's outputs: ``senders * receivers`` routed experts of ``pair_bytes``
    each (one BF16 ``down_proj`` weight, ``(pair_bytes // 2048, 1024)``); expert ``s * R + r`` is
    owned by sender ``s`` (expert-parallel, contiguous) and held by engine rank ``r`` (expert
    parallel: whole experts, round-robin), so every (sender, engine rank) pair moves one expert."""
    shape = (max(1, pair_bytes // 2048), 1024)
    return [(f"model.layers.0.mlp.experts.{s * receivers + r}.down_proj.weight", "bfloat16", shape, s)
             for s in range(senders) for r in range(receivers)]


def _mesh_worker(rank: int, world: int, senders: int, master: str, port: int, pair_bytes: int, reps: int,
                 out) -> None:
    """One rank of the mesh round benchmark: a ``MeshSender`` (rank < ``senders``, its own
    experts of :func:`mesh_outputs_synthetic`) or a ``MeshReceiver`` (an expert-parallel engine
    rank holding its experts); ``reps + 1`` authenticated rounds (the first warms the
    connections). Puts ``(rank, [(start, end, stream seconds) per round], bytes)`` on ``out``
    (stream seconds: the pair bucket streams alone, after the accept vote; bytes: sent per
    engine rank on a sender, received on an engine rank, of the last round)."""
    import torch

    from qstrat.transport.group import open_group
    from qstrat.transport.mesh.receiver import MeshReceiver
    from qstrat.transport.mesh.sender import MeshSender
    from qstrat.transport.mesh.routing import MeshRoutes, ReceiverLayout

    secret = b"mesh benchmark secret, not a real one"
    torch.set_num_threads(1)
    receivers = world - senders
    outputs = mesh_outputs_synthetic(senders, receivers, pair_bytes)
    group = open_group(master, port, rank, world, "gloo", 600)
    times, got = [], None
    if rank < senders:
        mine = [(n, torch.ones(s, dtype=torch.bfloat16)) for n, _, s, o in outputs if o == rank]
        sender = MeshSender(group, senders, secret, master, port, bucket_bytes=4 << 20)
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            report = sender.send(outputs, iter(mine))
            times.append((t0, time.perf_counter(), report.stream_seconds))
        got = report.sent
    else:
        r = rank - senders
        layout = ReceiverLayout(experts=tuple(s * receivers + r for s in range(senders)), moe_tp=False)
        doc = MeshRoutes(outputs, senders, [], 4 << 20, 64).to_dict()
        recv = MeshReceiver(group, senders, layout, secret=secret, address=master, port=port)
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            recv.round(doc)
            times.append((t0, time.perf_counter(), recv.stats["stream_s"]))
        got = int(recv.stats["bytes"])
    group.close()
    out.put((rank, times[1:], got))


def mesh_round(links: list[Link], senders: int, receivers: int, pair_bytes: int, reps: int,
               port: int = 29661) -> dict:
    """Time the real mesh round (``MeshSender``/``MeshReceiver``, :func:`_mesh_worker`), one
    process per link: senders in ``links[:senders]``, engine ranks in the next ``receivers``.
    A round's wall seconds run from the LAST rank's call (the round's first step is a collective
    that waits for every rank) to the last rank's return; its stream seconds are the slowest
    rank's bucket streams (from its accept vote to its last bucket). Returns ``{"seconds": [per rep],
    "stream_s": [per rep],
    "sent": {rank: {dst: bytes}}, "received": {rank: bytes}, "payload": bytes}``.
    Raises: TimeoutError when a rank does not report within 600 s (every process is killed)."""
    world = senders + receivers
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [spawn_in(links[i], ctx, _mesh_worker, (i, world, senders, links[0].address, port, pair_bytes, reps, queue))
             for i in range(world)]
    results = {}
    try:
        end = time.monotonic() + 600
        while len(results) < world:
            if time.monotonic() > end:
                raise TimeoutError(f"mesh_round S={senders} R={receivers}: {world - len(results)} ranks silent "
                                   "after 600 s")
            try:
                rank, times, got = queue.get(timeout=1.0)
                results[rank] = (times, got)
            except Exception:  # noqa: BLE001 - queue.Empty; a dead rank shows as the timeout above
                if all(not p.is_alive() for p in procs) and len(results) < world:
                    raise RuntimeError(f"mesh_round S={senders} R={receivers}: ranks died "
                                       f"(exit codes {[p.exitcode for p in procs]})") from None
    finally:
        _reap(procs, 30)
    seconds = [max(results[k][0][i][1] for k in results) - max(results[k][0][i][0] for k in results)
               for i in range(reps)]
    outputs = mesh_outputs_synthetic(senders, receivers, pair_bytes)
    payload = sum(s[0] * s[1] * 2 for _, _, s, _ in outputs)
    stream = [max(results[k][0][i][2] for k in results) for i in range(reps)]
    return {"seconds": seconds, "stream_s": stream, "sent": {k: v[1] for k, v in results.items() if k < senders},
            "received": {k: v[1] for k, v in results.items() if k >= senders}, "payload": payload}
