"""Mesh-round processes for tests/test_transport_mesh.py: S trainer ranks (each holding its half of
the experts, expert-parallel) and R engine-less receivers (qstrat.transport.mesh.receiver.MeshReceiver), one
spawned process per rank on a gloo group over loopback. Faults are injected per rank by name."""
from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from typing import Any

SECRET = b"mesh-test-secret-0123456789abcdef"
TIMEOUT_S = 90.0


def model_and_plans(fmt: str, senders: int, seed: int = 1) -> tuple[Any, dict, list, list, Any]:
    """(driver, whole state (per-expert names), each rank's held tensors (global names), each
    rank's plan, the whole plan) for the tiny Qwen3-MoE ``seed``, experts split over ``senders`` ranks."""
    from qstrat import RefitDriver
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config

    model = build_tiny_qwen3_moe(seed=seed)
    state = model.state_dict()
    driver = RefitDriver(fmt, hf_config=hf_config(model))
    return (driver, state, *split_state(driver, state, senders))


def split_state(driver: Any, state: dict, senders: int) -> tuple[list, list, Any]:
    """(each rank's held tensors (global names), each rank's plan, the whole plan) of the tiny
    Qwen3-MoE's ``state`` (grouped expert slabs), experts split over ``senders`` ranks."""
    from qstrat import tensor_specs
    from qstrat.execute.sharding import ExpertParallel, split_plan

    ep = ExpertParallel(size=senders, num_experts=8)
    held = []
    for r in range(senders):
        local = {n: (t[ep.experts(r).start:ep.experts(r).stop] if ".experts." in n else t) for n, t in state.items()}
        held.append(dict(ep.global_tensors(r, local, driver.layout)))
    specs = {}
    for h in held:
        specs.update(tensor_specs(h.items()))
    plan = driver.plan(specs)
    return held, split_plan(plan, ep.owner, senders), plan


def rank_main(rank: int, world: int, senders: int, port: int, fmt: str, layouts: list[dict],
              fault: dict, queue: Any) -> None:
    """One rank: a sender (rank < senders) or a MeshReceiver; puts (rank, "ok"/"err", value)."""
    try:
        import torch

        from qstrat.execute.sharding import ExpertParallel
        from qstrat.transport.group import open_group
        from qstrat.transport.mesh.routing import MeshRoutes, ReceiverLayout, mesh_outputs

        secret = None if fault.get("no_secret") else SECRET
        _inject(fault)
        if fault.get("whole_shares"):  # a sender that routes whole tensors, TP ignored (a lying routing)
            import qstrat.transport.mesh.routing as routing

            real = routing.share_of
            routing.share_of = lambda n, d, shape, layout: real(n, d, shape, ReceiverLayout(experts=layout.experts))
        driver, state, held, plans, plan = model_and_plans(fmt, senders)
        outputs = mesh_outputs(plan, ExpertParallel(senders, 8).owner)
        if rank >= senders and fault.get("session"):  # the vLLM backend's receiver, with a dict loader
            layout = ReceiverLayout.from_dict(layouts[rank - senders])
            queue.put((rank, "ok", session_round(rank, world, senders, port, outputs, layout, secret,
                                                 fault["session"], fault.get("doc_mode"))))
            return
        group = open_group("127.0.0.1", port, rank, world, "gloo", TIMEOUT_S)  # once every rank is ready
        if rank < senders:
            from qstrat.transport.mesh.sender import MeshSender

            sender = MeshSender(group, senders, secret, "127.0.0.1", port, bucket_bytes=1 << 16,
                                mode=fault.get("mode", "atomic"))
            stream = driver.run(iter(held[rank].items()), plan=plans[rank])
            report = sender.send(outputs, _faulty(stream, fault))
            queue.put((rank, "ok", report.sent))
        else:
            from qstrat.transport.mesh.receiver import MeshReceiver

            layout = ReceiverLayout.from_dict(layouts[rank - senders])
            doc = MeshRoutes(outputs, senders, [], 1 << 16, 64).to_dict()
            recv = MeshReceiver(group, senders, layout, secret=secret, address="127.0.0.1", port=port)
            recv.round(doc)
            got = {n: t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() + repr(
                (str(t.dtype), tuple(t.shape))).encode() for n, t in recv.tensors.items()}
            queue.put((rank, "ok", (got, dict(recv.stats))))
        group.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put((rank, "err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"))


def _inject(fault: dict) -> None:
    """Install a rank's wire faults: ``flip_to`` (one byte of the first bucket to that group rank,
    after sealing), ``wrong_key_to`` (that pair's buckets sealed under another pair's keys: a
    sender whose MAC for that engine rank is wrong)."""
    from qstrat.transport.group import TransferGroup
    from qstrat.transport.mesh import steps

    if fault.get("flip_to") is not None:
        send = TransferGroup.send

        def flipped(self: Any, tensor: Any, dst: int, tag: int) -> Any:
            if dst == fault["flip_to"] and tag == 1:
                tensor = tensor.clone()
                tensor[len(tensor) // 2] ^= 1
            return send(self, tensor, dst, tag)

        TransferGroup.send = flipped
    if fault.get("wrong_key_to") is not None:
        real = steps.pair_sealer
        steps.pair_sealer = lambda secret, mac, s, r, device: real(
            secret, mac, s, r + 1 if r == fault["wrong_key_to"] else r, device)


def rounds_main(rank: int, world: int, senders: int, port: int, fmt: str, layouts: list[dict],
                rounds: list[dict], fault: dict, queue: Any) -> None:
    """One rank of several mesh rounds on one group: ``rounds`` gives each round's ``mode``,
    ``seed`` (the tiny model's), ``staged_bytes`` and ``clear`` (a receiver empties its tensors
    first); ``fault`` (as :func:`rank_main`'s, plus ``wrong_key_to``) applies to the last round.
    Puts (rank, "ok", [per round: ("ok" | "err", value, receiver: (name -> bytes, stats, units
    loaded))])."""
    try:
        import torch

        from qstrat.execute.sharding import ExpertParallel
        from qstrat.transport.group import open_group
        from qstrat.transport.mesh.bounded import routes_for
        from qstrat.transport.mesh.receiver import MeshReceiver
        from qstrat.transport.mesh.routing import ReceiverLayout, mesh_outputs
        from qstrat.transport.mesh.sender import MeshSender

        group = open_group("127.0.0.1", port, rank, world, "gloo", TIMEOUT_S)
        recv = (MeshReceiver(group, senders, ReceiverLayout.from_dict(layouts[rank - senders]), secret=SECRET,
                             address="127.0.0.1", port=port) if rank >= senders else None)
        out = []
        for j, rnd in enumerate(rounds):
            last = j == len(rounds) - 1
            if last:
                _inject(fault)
            mode, bound = rnd.get("mode", "atomic"), rnd.get("staged_bytes")
            driver, _, held, plans, plan = model_and_plans(fmt, senders, rnd.get("seed", 1))
            outputs = mesh_outputs(plan, ExpertParallel(senders, 8).owner)
            try:
                if recv is None:
                    sender = MeshSender(group, senders, SECRET, "127.0.0.1", port, bucket_bytes=1 << 16,
                                        mode=mode, staged_bytes=bound)
                    stream = driver.run(iter(held[rank].items()), plan=plans[rank])
                    out.append(("ok", sender.send(outputs, _faulty(stream, fault) if last else stream).sent, None))
                    continue
                if rnd.get("clear"):
                    recv.tensors.clear()
                result = ("ok", None)
                try:
                    recv.round(routes_for(outputs, senders, [], 1 << 16, 64, mode, bound).to_dict())
                except Exception as exc:  # noqa: BLE001 - reported with what the receiver holds
                    result = ("err", f"{type(exc).__name__}: {exc}")
                got = {n: t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() + repr(
                    (str(t.dtype), tuple(t.shape))).encode() for n, t in recv.tensors.items()}
                out.append((*result, (got, dict(recv.stats), list(recv.units))))
            except Exception as exc:  # noqa: BLE001 - a sender's error
                out.append(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}", None))
            if group.pg is None:
                break
        group.close()
        queue.put((rank, "ok", out))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put((rank, "err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"))


def run_rounds(port: int, fmt: str, senders: int, layouts: list[dict], rounds: list[dict],
               faults: dict[int, dict] | None = None, timeout_s: float = 900.0) -> dict[int, tuple[str, Any]]:
    """Run :func:`rounds_main` over ``senders + len(layouts)`` processes; rank -> (status, value)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    world = senders + len(layouts)
    procs = [ctx.Process(target=rounds_main, args=(r, world, senders, port, fmt, layouts, rounds,
                                                   (faults or {}).get(r, {}), queue), daemon=True)
             for r in range(world)]
    return collect(procs, queue, timeout_s)


def session_round(rank: int, world: int, senders: int, port: int, outputs: list, layout: Any, secret: Any,
                  mode: str, doc_mode: str | None = None) -> tuple[dict, dict]:
    """Engine rank ``rank`` through :class:`qstrat.transport.receive.session.ReceiverSession` (what the vLLM
    backend runs: join with ``senders`` in the signed init info, a mesh ``update`` in ``mode`` with
    routes of ``doc_mode`` (default: ``mode``), ``finish``) into a dict loader; (name -> (dtype,
    shape, bytes) of what the loader was handed, the session's stats)."""
    import torch

    from qstrat.transport.security.auth import sign_init
    from qstrat.transport.security.keys import Secret
    from qstrat.transport.mesh.bounded import routes_for
    from qstrat.transport.receive.session import ReceiverSession

    loaded: dict[str, tuple[str, tuple[int, ...], bytes]] = {}

    class DictLoader:
        def begin_load(self) -> None: ...
        def end_load(self) -> None: ...

        def load(self, tensors: list) -> None:
            for n, t in tensors:
                loaded[n] = (str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())

    session = ReceiverSession(lambda: None, DictLoader(), secret, layout=lambda: layout)
    session.join(sign_init(Secret.coerce(secret), {"master_address": "127.0.0.1", "master_port": port,
                                                   "rank_offset": rank, "world_size": world, "backend": "gloo",
                                                   "timeout_s": TIMEOUT_S, "senders": senders}))
    session.start()
    session.update({"mesh": routes_for(outputs, senders, [], 1 << 16, 64, doc_mode or mode).to_dict(), "mode": mode})
    session.finish()
    session.shutdown()
    return loaded, dict(session.stats)


def _faulty(stream: Any, fault: dict) -> Any:
    for i, item in enumerate(stream):
        if i == fault.get("raise_at"):
            raise KeyError("trainer-side failure mid-round")
        if i == fault.get("kill_at"):
            os._exit(17)
        yield item


def run_mesh(port: int, fmt: str, senders: int, layouts: list[dict], faults: dict[int, dict] | None = None,
             timeout_s: float = 900.0) -> dict[int, tuple[str, Any]]:
    """Run one mesh round over ``senders + len(layouts)`` processes; rank -> (status, value).
    A rank that died without reporting reads ``("dead", exitcode)``."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    world = senders + len(layouts)
    procs = [ctx.Process(target=rank_main, args=(r, world, senders, port, fmt, layouts,
                                                 (faults or {}).get(r, {}), queue), daemon=True)
             for r in range(world)]
    return collect(procs, queue, timeout_s)


def collect(procs: list, queue: Any, timeout_s: float) -> dict[int, tuple[str, Any]]:
    """Start ``procs`` (one per rank, in rank order) and gather what each puts on ``queue``;
    rank -> (status, value), ``("dead", exitcode)`` for a rank that died without reporting."""
    import queue as q
    import time

    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    end = time.monotonic() + timeout_s
    while len(results) < len(procs) and time.monotonic() < end:
        try:
            rank, status, value = queue.get(timeout=1.0)
            results[rank] = (status, value)
        except q.Empty:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    for r, p in enumerate(procs):
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
        results.setdefault(r, ("dead", p.exitcode))
    return results


# ---- live engines (tests/test_engine_transport_mesh.py) -------------------------------------
#: The tiny model's shape for a TP=2 engine (block FP8's 128-row blocks split evenly by rank;
#: tests/test_engine_transport_tp.py).
TP2_SHAPE = dict(head_dim=128, moe_intermediate_size=256)


def engine_trainer_main(rank: int, senders: int, port: int, conns: list, workers: list[int], fmt: Any,
                        seed: int, fault: dict, queue: Any) -> None:
    """One trainer rank of a live mesh refit: it holds its half of the experts of the tiny model
    ``seed`` (expert-parallel) and calls MeshRefitSender.refit; rank 0 drives the engines through
    ``conns`` (their RPC pipes). ``fmt``: a preset name or a config mapping (RefitDriver's).
    ``fault``: ``raise_at`` / ``kill_at`` (the i-th output raises / the process exits 17);
    ``group_timeout_s``: the group's and the engine RPCs' timeout (default 240 s; how long the
    survivors wait for a killed rank).
    Puts (rank, "ok", (report.sent, seconds, stream seconds, engine ranks whose update session a
    previous rank 0 left open)) or (rank, "err", text)."""
    try:
        from qstrat import RefitDriver, tensor_specs
        from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
        from qstrat.execute.sharding import ExpertParallel
        from qstrat.transport.mesh.refit import MeshRefitSender
        from transport_harness import PipeClient

        model = build_tiny_qwen3_moe(seed=seed, **TP2_SHAPE)
        state = model.state_dict()
        driver = RefitDriver(fmt, hf_config=hf_config(model))
        ep = ExpertParallel(size=senders, num_experts=8)
        local = {n: (t[ep.experts(rank).start:ep.experts(rank).stop] if ".experts." in n else t)
                 for n, t in state.items()}
        held = dict(ep.global_tensors(rank, local, driver.layout))
        specs = {}
        for r in range(senders):  # every rank plans the whole model from every rank's specs
            other = {n: (t[ep.experts(r).start:ep.experts(r).stop] if ".experts." in n else t) for n, t in state.items()}
            specs.update(tensor_specs(dict(ep.global_tensors(r, other, driver.layout)).items()))
        plan = driver.plan(specs)
        sender = MeshRefitSender(rank, senders, "127.0.0.1", port, [PipeClient(c, 600.0) for c in conns],
                                 workers, timeout_s=fault.get("group_timeout_s", 240.0),
                                 secret=SECRET, bucket_bytes=1 << 20)
        sender.connect()
        owner = ep.owner
        if fault:  # raise_at / kill_at: the source raises / the process dies at that output
            real_run = driver.run
            driver.run = lambda *args, **kwargs: _faulty(real_run(*args, **kwargs), fault)
        left_open = list(sender.left_open)
        report = sender.refit(driver, held, plan, owner)
        sender.close()
        queue.put((rank, "ok", (report.sent, report.seconds, report.stream_seconds, left_open)))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put((rank, "err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"))


def run_engine_mesh(engines: list, workers: list[int], fmt: Any, seed: int, senders: int = 2,
                    faults: dict[int, dict] | None = None, timeout_s: float = 900.0) -> dict[int, tuple[str, Any]]:
    """One live mesh round: ``senders`` trainer processes refit ``engines`` (transport_harness
    Receivers, their RPC pipes go to trainer rank 0) to the tiny model ``seed``; rank -> (status, value)."""
    from transport_harness import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=engine_trainer_main, daemon=True,
                         args=(r, senders, port, [e.rpc.conn for e in engines] if r == 0 else [], workers, fmt,
                               seed, (faults or {}).get(r, {}), queue)) for r in range(senders)]
    return collect(procs, queue, timeout_s)


def drain_answers(engine: Any, timeout_s: float) -> list:
    """The answers an engine (a transport_harness Receiver) gave on its RPC pipe to a trainer
    process that died before reading them (a dead client's pending calls: the first is awaited
    up to ``timeout_s``, the rest briefly); read and returned, so the next trainer's calls get
    their own answers."""
    out = []
    wait = timeout_s
    while engine.rpc.conn.poll(wait):
        out.append(engine.rpc.conn.recv())
        wait = 2.0
    return out
