"""A one-trainer delta mesh for tests/test_attacks_delta_floor.py: this process is trainer rank 0
(``MeshRefitSender``), one spawned engine-less ``DeltaMeshReceiver`` is rank 1; the sender's
weight-sync client hands each round's routes document to it over a pipe."""
from __future__ import annotations

import multiprocessing as mp
import traceback
from typing import Any

SECRET = b"mesh-floor-secret-0123456789abcdef"


def receiver_main(port: int, conn: Any) -> None:
    try:
        from qstrat.transport.group import open_group
        from qstrat.transport.mesh.pair_delta import DeltaMeshReceiver
        from qstrat.transport.mesh.routing import ReceiverLayout
        from transport_harness import sha256

        from qstrat.transport.mesh.steps import open_sessions

        group = open_group("127.0.0.1", port, 1, 2, "gloo", 60.0)
        open_sessions(group, 1)  # the engines' half of MeshRefitSender.connect's first step
        recv = DeltaMeshReceiver(group, 1, ReceiverLayout(), secret=SECRET, address="127.0.0.1", port=port)
        conn.send(("ready", None))
        while True:
            doc = conn.recv()
            if doc is None:
                break
            try:
                recv.round(doc)
                conn.send(("ok", ({n: sha256(t) for n, t in recv.tensors.items()}, dict(recv.stats))))
            except BaseException as exc:  # noqa: BLE001 - reported to the test
                conn.send(("err", f"{type(exc).__name__}: {exc}"))
        group.close()
    except BaseException as exc:  # noqa: BLE001
        conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"))


class PipeEngine:
    """The weight-sync client of the spawned receiver: ``update_weights`` hands it the routes
    document and waits for its round; :attr:`held` is what it holds after it (name -> SHA-256)."""

    def __init__(self, port: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=receiver_main, args=(port, child), daemon=True)
        self.process.start()
        self.held: dict[str, str] = {}
        self.stats: dict[str, Any] = {}
        self.docs: list[dict] = []

    def init_weight_transfer_engine(self, info: dict) -> None:
        status, value = self.conn.recv()  # the receiver joined the group
        if status != "ready":
            raise RuntimeError(value)

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, info: dict) -> None:
        from qstrat.transport.mesh.engine import MESH_KEY

        self.docs.append(info[MESH_KEY])
        self.conn.send(info[MESH_KEY])
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        self.held, self.stats = value

    def finish_weight_update(self) -> None:
        pass

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
