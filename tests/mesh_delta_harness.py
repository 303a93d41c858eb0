"""Delta mesh rounds over a real Adam trajectory for tests/test_transport_mesh_delta.py and
scripts/bench_transport.py --mesh-delta: S trainer ranks (:class:`~qstrat.transport.mesh.pair_delta.DeltaMeshSender`,
each holding its half of the experts) and R engine-less receivers
(:class:`~qstrat.transport.mesh.pair_delta.DeltaMeshReceiver`), one spawned process per rank on a gloo
group over loopback, one mesh round per state of the trajectory (saved by the test with
``torch.save``). Faults are injected per rank and step, from outside the production path."""
from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from typing import Any

from mesh_harness import SECRET, TIMEOUT_S, collect, split_state

#: Formats of the delta mesh tests (RefitDriver configs): block FP8, MXFP8, NVFP4 on every linear layer.
FORMATS = {"block-fp8": "block-fp8", "mxfp8": "mxfp8",
           "nvfp4": {"rules": [{"select": "linear", "serializer": "nvfp4"}]}}


def digest(t: Any) -> str:
    """SHA-256 of a tensor's bytes, dtype and shape."""
    import hashlib

    import torch

    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                          + repr((str(t.dtype), tuple(t.shape))).encode()).hexdigest()


def tiny_driver(fmt: Any) -> Any:
    """The tiny Qwen3-MoE's RefitDriver in ``fmt`` (a FORMATS key, or a config)."""
    from qstrat import RefitDriver
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config

    return RefitDriver(FORMATS.get(fmt, fmt) if isinstance(fmt, str) else fmt,
                       hf_config=hf_config(build_tiny_qwen3_moe(seed=1)))


def _install_faults(faults: dict, step: list[int]) -> None:
    """``corrupt_patch`` (step, engine group rank): bucket 0 of this sender's pair to that rank
    gets its payload's last byte flipped once (the resend goes clean) BEFORE it is sealed (a
    corrupted patch its seal covers: the rebuilt digest differs); ``flip_wire`` (step, engine group rank): one byte of bucket 0's
    payload flipped AFTER sealing, on the wire."""
    from qstrat.transport.group import TransferGroup
    from qstrat.transport.mesh.pair_delta import PairDeltaOut

    if "corrupt_patch" in faults:
        at, dst = faults["corrupt_patch"]
        post, once = PairDeltaOut._post_next, [True]

        def corrupted(self: Any) -> None:
            if once and step[0] == at and self.dst == dst and self.k == 0:
                once.pop()
                payload = self.encoder.payload(0).clone()
                payload[-1] ^= 1
                return self._send(payload, 0)
            return post(self)

        PairDeltaOut._post_next = corrupted
    if "flip_wire" in faults:
        at, dst = faults["flip_wire"]
        send = TransferGroup.send

        def flipped(self: Any, tensor: Any, to: int, tag: int) -> Any:
            if step[0] == at and to == dst and tag == 1:
                tensor = tensor.clone()
                tensor[len(tensor) // 2] ^= 1
            return send(self, tensor, to, tag)

        TransferGroup.send = flipped


def delta_rank_main(rank: int, world: int, senders: int, port: int, fmts: list, layouts: list[dict], states_path: str,
                    faults: dict, modes: tuple[str, ...], bucket_bytes: int, queue: Any) -> None:
    """One rank, for each format of ``fmts`` in turn on one group, over every state in
    ``states_path``, a round in each of ``modes`` (:func:`_rounds`). Puts (rank, "ok",
    [per format: {mode: [per step: ("ok" | "err", value, extra)]}]; each pair's buckets of
    ``bucket_bytes``): a sender's value is ``report.sent``
    (err: the error's text), extra (``report.delta`` as a dict or None, the call's wall seconds); a
    receiver's value is name -> digest of what it holds after the step, extra its stats (err:
    the error's text, and the digests it holds). ``faults``: ``no_secret_at`` (a sender without
    the secret at that step), ``stale_at`` (step, trainer rank: this receiver drops that pair's
    base first), ``corrupt_patch`` / ``flip_wire`` (:func:`_install_faults`); ``session``: this
    receiver is a :class:`~qstrat.transport.receive.session.ReceiverSession` (the vLLM backend's
    receiver) loading into a dict, delta rounds only (:func:`_session_rounds`)."""
    try:
        import torch

        from qstrat.transport.group import open_group

        torch.set_num_threads(1)
        states = torch.load(states_path)
        step = [0]
        _install_faults(faults, step)
        if rank >= senders and faults.get("session"):
            session, loaded = _session(rank, world, senders, port, layouts[rank - senders])
            out = [_session_rounds(session, loaded, senders, fmt, states, faults, step, bucket_bytes) for fmt in fmts]
            session.shutdown()
        else:
            group = open_group("127.0.0.1", port, rank, world, "gloo", TIMEOUT_S)
            out = [_rounds(group, rank, senders, port, fmt, layouts, states, faults, step, modes, bucket_bytes)
                   for fmt in fmts]
            group.close()
        queue.put((rank, "ok", out))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put((rank, "err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"))


def _rounds(group: Any, rank: int, senders: int, port: int, fmt: Any, layouts: list[dict], states: list, faults: dict,
            step: list[int], modes: tuple[str, ...], bucket_bytes: int) -> dict[str, list[tuple[str, Any, Any]]]:
    """One format's rounds on this rank (:func:`delta_rank_main`): per state, a round of each of
    ``modes`` in turn (``atomic``: MeshSender / MeshReceiver; ``delta``: the delta ones), each
    mode on its own sender or receiver object; mode -> per step (status, value, extra)."""
    from qstrat.execute.sharding import ExpertParallel
    from qstrat.transport.mesh.pair_delta import DeltaMeshReceiver, DeltaMeshSender
    from qstrat.transport.mesh.receiver import MeshReceiver
    from qstrat.transport.mesh.routing import MeshRoutes, ReceiverLayout, mesh_outputs
    from qstrat.transport.mesh.sender import MeshSender

    driver = tiny_driver(fmt)
    _, plans, plan = split_state(driver, states[0], senders)
    outputs = mesh_outputs(plan, ExpertParallel(senders, 8).owner)
    out: dict[str, list[tuple[str, Any, Any]]] = {m: [] for m in modes}
    if rank < senders:
        cls = {"atomic": MeshSender, "delta": DeltaMeshSender}
        ends = {m: cls[m](group, senders, SECRET, "127.0.0.1", port, bucket_bytes=bucket_bytes) for m in modes}
        for i, state in enumerate(states):
            step[0] = i
            held = split_state(driver, state, senders)[0][rank]
            for m, sender in ends.items():
                sender.secret = None if faults.get("no_secret_at") == i else _secret()
                try:
                    t0 = time.perf_counter()
                    report = sender.send(outputs, driver.run(iter(held.items()), plan=plans[rank]))
                    info = vars(report.delta) if report.delta is not None else None
                    out[m].append(("ok", report.sent, (info, time.perf_counter() - t0)))
                except Exception as exc:  # noqa: BLE001 - reported per step
                    out[m].append(("err", f"{type(exc).__name__}: {exc}", None))
        return out
    layout = ReceiverLayout.from_dict(layouts[rank - senders])
    doc = MeshRoutes(outputs, senders, [], bucket_bytes, 64).to_dict()
    cls = {"atomic": MeshReceiver, "delta": DeltaMeshReceiver}
    recvs = {m: cls[m](group, senders, layout, secret=SECRET, address="127.0.0.1", port=port) for m in modes}
    for i in range(len(states)):
        step[0] = i
        stale = faults.get("stale_at")
        if stale is not None and stale[0] == i:
            recvs["delta"].pairs.rebuilds[stale[1]].base = None
        for m, recv in recvs.items():
            try:
                recv.round(doc)
                out[m].append(("ok", {n: digest(t) for n, t in recv.tensors.items()}, dict(recv.stats)))
            except Exception as exc:  # noqa: BLE001 - reported per step
                out[m].append(("err", f"{type(exc).__name__}: {exc}",
                               {n: digest(t) for n, t in recv.tensors.items()}))
    return out


def _session(rank: int, world: int, senders: int, port: int, layout: dict) -> tuple[Any, dict]:
    """A joined ReceiverSession for engine rank ``rank`` (``layout``) whose loader keeps a copy of
    every tensor it is handed, and that dict."""
    from qstrat.transport.mesh.routing import ReceiverLayout
    from qstrat.transport.receive.session import ReceiverSession
    from qstrat.transport.security.auth import sign_init

    loaded: dict[str, Any] = {}

    class DictLoader:
        def begin_load(self) -> None: ...
        def end_load(self) -> None: ...

        def load(self, tensors: list) -> None:
            loaded.update((n, t.clone()) for n, t in tensors)

    session = ReceiverSession(lambda: None, DictLoader(), SECRET, layout=lambda: ReceiverLayout.from_dict(layout))
    session.join(sign_init(_secret(), {"master_address": "127.0.0.1", "master_port": port, "rank_offset": rank,
                                       "world_size": world, "backend": "gloo", "timeout_s": TIMEOUT_S,
                                       "senders": senders}))
    return session, loaded


def _session_rounds(session: Any, loaded: dict, senders: int, fmt: Any, states: list, faults: dict,
                    step: list[int], bucket_bytes: int) -> dict[str, list[tuple[str, Any, Any]]]:
    """One format's delta mesh rounds through ``session`` (start, a mesh ``update`` in mode
    ``delta``, finish: what the vLLM backend runs); per step (status, name -> digest of what the
    loader holds, the session's stats). ``stale_at`` (step, trainer rank): the session drops that
    pair's base first."""
    from qstrat.execute.sharding import ExpertParallel
    from qstrat.transport.mesh.routing import MeshRoutes, mesh_outputs

    driver = tiny_driver(fmt)
    _, _, plan = split_state(driver, states[0], senders)
    doc = MeshRoutes(mesh_outputs(plan, ExpertParallel(senders, 8).owner), senders, [], bucket_bytes, 64).to_dict()
    out: list[tuple[str, Any, Any]] = []
    for i in range(len(states)):
        step[0] = i
        stale = faults.get("stale_at")
        if stale is not None and stale[0] == i:
            session.mesh_pairs.rebuilds[stale[1]].base = None
        try:
            session.start()
            session.update({"mesh": doc, "mode": "delta"})
            session.finish()
            out.append(("ok", {n: digest(t) for n, t in loaded.items()}, dict(session.stats)))
        except Exception as exc:  # noqa: BLE001 - reported per step
            out.append(("err", f"{type(exc).__name__}: {exc}", {n: digest(t) for n, t in loaded.items()}))
    return {"delta": out}


def _secret() -> Any:
    from qstrat.transport.security.keys import Secret

    return Secret.coerce(SECRET)


def run_delta_mesh(port: int, fmts: list, senders: int, layouts: list[dict], states_path: str,
                   faults: dict[int, dict] | None = None, modes: tuple[str, ...] = ("delta",),
                   bucket_bytes: int = 1 << 16, timeout_s: float = 900.0) -> dict[int, tuple[str, Any]]:
    """Mesh rounds of each format of ``fmts`` over every state in ``states_path``, one per mode of
    ``modes`` per state, on ``senders + len(layouts)`` processes; rank -> (status, value)
    (:func:`delta_rank_main`'s)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    world = senders + len(layouts)
    procs = [ctx.Process(target=delta_rank_main, daemon=True,
                         args=(r, world, senders, port, fmts, layouts, states_path, (faults or {}).get(r, {}), modes,
                               bucket_bytes, queue))
             for r in range(world)]
    return collect(procs, queue, timeout_s)


def save_trajectory(path: str, lr: float, steps: int) -> list[dict]:
    """The tiny Qwen3-MoE (seed 1)'s bf16 states over ``steps`` real Adam steps at ``lr``
    (:func:`qstrat.cli.demo.trajectory.adam_trajectory`: the start and after each step), saved
    to ``path`` and returned."""
    import torch

    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe
    from qstrat.cli.demo.trajectory import adam_trajectory

    states = list(adam_trajectory(build_tiny_qwen3_moe(seed=1), lr, steps))
    torch.save(states, path)
    return states


# ---- live engines (tests/test_engine_transport_mesh_delta.py) --------------------------------
def engine_delta_trainer_main(rank: int, senders: int, port: int, conns: list, workers: list[int], fmt: Any,
                              states_path: str, queue: Any) -> None:
    """One trainer rank of live delta mesh refits: a ``MeshRefitSender(mode="delta")`` holding its
    half of the experts of each state in ``states_path`` (the tiny model with TP2_SHAPE), one
    ``refit`` per state; rank 0 drives the engines through ``conns``. Puts (rank, "ok", [per
    state: (report.sent, report.delta as a dict)]) or (rank, "err", text)."""
    try:
        import torch

        from qstrat.execute.sharding import ExpertParallel
        from qstrat.transport.mesh.refit import MeshRefitSender
        from transport_harness import PipeClient

        from mesh_harness import TP2_SHAPE
        from qstrat import RefitDriver
        from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config

        states = torch.load(states_path)
        driver = RefitDriver(fmt, hf_config=hf_config(build_tiny_qwen3_moe(seed=0, **TP2_SHAPE)))
        sender = MeshRefitSender(rank, senders, "127.0.0.1", port, [PipeClient(c, 600.0) for c in conns], workers,
                                 timeout_s=240.0, secret=SECRET, bucket_bytes=1 << 20, mode="delta")
        sender.connect()
        out = []
        for state in states:
            held, _, plan = split_state(driver, state, senders)
            report = sender.refit(driver, held[rank], plan, ExpertParallel(senders, 8).owner)
            out.append((report.sent, vars(report.delta)))
        sender.close()
        queue.put((rank, "ok", out))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put((rank, "err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"))


def run_engine_delta_mesh(engines: list, workers: list[int], fmt: Any, states_path: str, senders: int = 2,
                          timeout_s: float = 900.0) -> dict[int, tuple[str, Any]]:
    """Live delta mesh refits: ``senders`` trainer processes refit ``engines`` (transport_harness
    Receivers; their RPC pipes go to trainer rank 0) to each state in ``states_path`` in turn;
    rank -> (status, value)."""
    from transport_harness import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=engine_delta_trainer_main, daemon=True,
                         args=(r, senders, port, [e.rpc.conn for e in engines] if r == 0 else [], workers, fmt,
                               states_path, queue)) for r in range(senders)]
    return collect(procs, queue, timeout_s)
