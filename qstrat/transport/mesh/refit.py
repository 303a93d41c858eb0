"""The trainer side of a mesh refit of vLLM engines: every trainer rank holds a
:class:`MeshRefitSender` and calls :meth:`MeshRefitSender.refit` with the tensors it holds
(FSDP-style: every rank calls it); each quantizes only the entries it owns and streams each engine
rank's share of them straight to that rank (:mod:`qstrat.transport.mesh.steps`). Trainer rank 0 also
drives the engines' weight-sync calls (``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``), as :class:`~qstrat.transport.RefitSender` does.

The engines run ``weight_transfer_config={"backend": "qstrat"}``
(:mod:`qstrat.vllm.engine.transfer_backend`); each of their workers joins the group as one engine rank
(group ranks ``senders..``) and publishes what it loads. Atomic rounds (default; ``mode="delta"``:
atomic rounds of per-pair patches, :mod:`qstrat.transport.mesh.pair_delta`): nothing is loaded
anywhere unless every rank voted to commit; then rank 0 calls ``finish_weight_update``.
Bounded rounds (``mode="bounded"``): each engine rank loads unit by unit under ``staged_bytes``;
a fault after a rank loaded leaves a MIX, flagged on those ranks and raised as
MixedWeightsError naming them (:attr:`MeshRefitSender.mixed`).

A trainer rank 0 that dies mid-round leaves the engines' update sessions open (vLLM then refuses
every ``start_weight_update``): when the next group forms, its first step
(:func:`qstrat.transport.mesh.steps.open_sessions`) names those engine ranks (:attr:`MeshRefitSender.left_open`)
and the new rank 0 ends them with ``finish_weight_update`` (loading nothing) before its first round.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from qstrat.errors import MixedWeightsError, TransportConfigError, TransportError
from qstrat.transport.security.auth import PROTOCOL_VERSION, sign_init
from qstrat.transport.engine_check import FORMAT_KEY, ONLINE_KEY
from qstrat.transport.send.fanout import EngineClients, call, listed
from qstrat.transport.group import DEFAULT_TIMEOUT_S, open_group
from qstrat.transport.security.keys import Secret
from qstrat.transport.mesh.steps import open_sessions
from qstrat.transport.mesh.engine import MESH_KEY
from qstrat.transport.delta.rounds import DELTA_MIN_BUCKET_BYTES, BucketFloor
from qstrat.transport.mesh.pair_delta import DeltaMeshSender
from qstrat.transport.mesh.sender import MeshReport, MeshSender
from qstrat.transport.mesh.bounded import routes_for
from qstrat.transport.mesh.routing import Output, mesh_outputs
from qstrat.transport.wire_manifest import DEFAULT_ALIGNMENT, DEFAULT_BUCKET_BYTES

_UNNAMED = object()


class MeshRefitSender(BucketFloor):
    """Trainer rank ``rank`` of ``senders`` in a mesh refit.

    Args:
        rank, senders: this trainer rank and how many send (group ranks ``0..senders-1``).
        master_address, master_port: the group's TCPStore (hosted by rank 0).
        clients: rank 0 only: one weight-sync client per engine (``VLLMWeightSyncClient``
            protocol); the other ranks give none.
        workers_per_client: ranks each engine brings (its TP x PP x DP workers); every rank gives
            the same (the group's size is ``senders + sum(workers_per_client)``).
        backend, timeout_s: ``gloo`` / ``nccl``; rendezvous, collective and RPC timeout (seconds).
        secret: the secret shared with the engines (default: ``QSTRAT_TRANSFER_SECRET``).
        bucket_bytes, alignment: each pair's bucket layout (bytes); in delta mode raised to
            ``delta_min_bucket_bytes``.
        mode, staged_bytes: ``atomic`` (default), ``bounded`` (each engine rank loads unit by unit
            as its pieces arrive, at most ``staged_bytes`` of receive buffers alive; a fault after a
            rank loaded leaves a flagged MIX: :mod:`qstrat.transport.mesh.bounded`), as
            :class:`~qstrat.transport.mesh.sender.MeshSender`, or ``delta``: atomic rounds in which
            each (trainer rank, engine rank) pair sends the patch against the pair's base
            (:class:`~qstrat.transport.mesh.pair_delta.DeltaMeshSender`; the round goes again,
            whole, in the same call when the engines refuse only the delta); every rank gives the same.
        delta_min_bucket_bytes: delta mode: the smallest bucket bound of each pair's layout
            (bytes; default :data:`~qstrat.transport.delta.rounds.DELTA_MIN_BUCKET_BYTES`; 0:
            ``bucket_bytes`` as given), as :class:`~qstrat.transport.send.sender.RefitSender`'s;
            every rank gives the same. Other modes: unused (still checked, whenever set).
    Raises: TransportError for a rank outside ``0..senders-1``, clients on a rank other than 0,
        another mode, ``staged_bytes`` outside bounded mode, or a ``delta_min_bucket_bytes``
        that is not an int >= 0.
    """

    def __init__(self, rank: int, senders: int, master_address: str, master_port: int,
                 clients: Sequence[Any] = (), workers_per_client: Sequence[int] | None = None,
                 backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S,
                 secret: Secret | bytes | str | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 alignment: int = DEFAULT_ALIGNMENT, mode: str = "atomic", staged_bytes: int | None = None,
                 delta_min_bucket_bytes: int = DELTA_MIN_BUCKET_BYTES) -> None:
        if not 0 <= rank < senders or (clients and rank != 0):
            raise TransportConfigError(f"MeshRefitSender: rank {rank} of {senders} senders (only rank 0 drives "
                                       "the engines' clients)")
        self.rank, self.senders, self.address, self.port = rank, senders, master_address, master_port
        workers = list(workers_per_client or [1] * len(clients))
        self.world_size = senders + sum(workers)
        self.engines = EngineClients(clients, workers if clients else None, timeout_s)
        self.backend, self.timeout_s = backend, timeout_s
        self.secret = Secret.coerce(secret) if secret is not None else Secret.from_env()
        self.bucket_bytes, self.alignment = bucket_bytes, alignment
        if mode not in ("atomic", "bounded", "delta"):
            raise TransportConfigError(f"MeshRefitSender mode {mode!r}: use 'atomic', 'bounded' or 'delta'")
        #: How the engine ranks load: a delta round's pairs are patches, loaded as an atomic round.
        self.load_mode = "atomic" if mode == "delta" else mode
        routes_for([], senders, [], bucket_bytes, alignment, self.load_mode, staged_bytes)  # checked up front
        self.mode, self.staged_bytes = mode, staged_bytes
        self.delta_min_bucket_bytes = delta_min_bucket_bytes
        #: After a round that left a MIX: which engine ranks hold new weights (None: no mix known).
        self.mixed: str | None = None
        self.mesh: MeshSender | None = None
        #: Engine group ranks whose weight-update session was still open when the group formed
        #: (a previous rank 0 died before ``finish_weight_update``); rank 0 ends them before its
        #: first round.
        self.left_open: list[int] = []
        self._to_end: list[int] = []

    def init_infos(self) -> list[dict[str, Any]]:
        """Each engine's ``init_weight_transfer_engine`` payload (signed with the secret)."""
        return [sign_init(self.secret, {"master_address": self.address, "master_port": self.port,
                                        "rank_offset": self.senders - 1 + offset, "world_size": self.world_size,
                                        "backend": self.backend, "timeout_s": self.timeout_s, "senders": self.senders})
                for offset in self.engines.offsets()]

    def connect(self) -> None:
        """Open the group (every trainer rank calls it; rank 0 also has each engine join).
        Raises: TransportError / TransferAuthError as :meth:`RefitSender.connect`."""
        self.close()

        def rendezvous() -> Any:
            group = open_group(self.address, self.port, self.rank, self.world_size, self.backend, self.timeout_s)
            self.left_open = open_sessions(group, self.senders)  # with the engines' joins (their init RPCs)
            self._to_end = list(self.left_open)
            return group

        group = self.engines.join(self.init_infos(), rendezvous) if self.rank == 0 else rendezvous()
        cls = DeltaMeshSender if self.mode == "delta" else MeshSender
        self.mesh = cls(group, self.senders, self.secret, self.address, self.port, self.layout_bucket_bytes,
                        self.alignment, mode=self.load_mode, staged_bytes=self.staged_bytes)

    def close(self) -> None:
        """Close the group (engines keep their weights)."""
        if self.mesh is not None:
            self.mesh.group.close()
            self.mesh = None

    def engine_ranks(self, engine: int) -> list[int]:
        """The group ranks of engine ``engine`` (its workers, after the trainer ranks and the
        engines before it)."""
        first = self.senders - 1 + self.engines.offsets()[engine]
        return list(range(first, first + self.engines.workers[engine]))

    def _end_left_open(self) -> None:
        """Rank 0, once per group: ``finish_weight_update`` on each engine whose update session a
        previous rank 0 left open (:attr:`left_open`; its backend loads nothing: the session's round was never
        committed here). Raises: TransportError when an engine's workers disagree (vLLM's
        ``finish_weight_update`` would then fail on some of them) or the call fails."""
        left = set(self._to_end)
        ends = []
        for i in range(len(self.engines.clients)):
            ranks = set(self.engine_ranks(i))
            if ranks & left and not ranks <= left:
                raise TransportError(f"engine {i}: the update session of a previous round is open on ranks "
                                     f"{sorted(ranks & left)} only, of {sorted(ranks)}: restart that engine")
            if ranks <= left:
                ends.append(i)
        errors = self.engines.results([call(self.engines.clients[i].finish_weight_update) for i in ends])
        if errors:
            raise TransportError(f"finish_weight_update of a session a previous round left open failed: "
                                 f"{listed({ends[i]: e for i, e in errors.items()})}")
        self._to_end = []

    def refit(self, driver: Any, held: Any, plan: Any, owner: Callable[[Any], int]) -> MeshReport:
        """One mesh round: quantize the entries of ``plan`` this rank owns from ``held`` and send.

        Args:
            driver: the :class:`~qstrat.RefitDriver`; held: this rank's (name, tensor) inputs
                (e.g. :meth:`qstrat.execute.sharding.ExpertParallel.global_tensors`).
            plan: the WHOLE model's plan, the same on every rank (e.g. planned from
                :func:`qstrat.execute.sharding.gather_specs`); owner: plan entry -> sending rank (e.g.
                :meth:`qstrat.execute.sharding.ExpertParallel.owner`).
        Returns / Raises: as :meth:`send`; PlanError from ``owner``.
        """
        from qstrat.execute.sharding import split_plan

        mine = split_plan(plan, owner, self.senders)[self.rank]
        return self.send(mesh_outputs(plan, owner), driver.run(iter(dict(held).items()), plan=mine),
                         plan.vllm_quantization_config(), plan.engine_quantization)

    def send(self, outputs: Sequence[Output], tensors: Iterator[tuple[str, torch.Tensor]],
             quantization_config: Any = _UNNAMED, engine_quantization: Any = _UNNAMED) -> MeshReport:
        """Send one round (every rank calls it with the same ``outputs``,
        :func:`~qstrat.transport.mesh.routing.mesh_outputs`, and its own ``tensors``, wire order).

        ``quantization_config`` / ``engine_quantization``: the plan's ``vllm_quantization_config()``
        and ``engine_quantization``, checked by each engine before any data (not given: not checked).

        Returns: the rank's :class:`MeshReport`, once every rank committed (rank 0: and every
            engine loaded). A round that was not committed ends the engines' update session
            (rank 0 calls ``finish_weight_update``, which loads nothing after a refused mesh round:
            the backend's ``update_weights`` does not raise, see
            :meth:`~qstrat.vllm.engine.transfer_backend.QstratWeightTransferEngine.receive_weights`). Raises: as :meth:`MeshSender.send`, with the engines' errors added on
            rank 0; MixedWeightsError when an engine's load failed after the commit.
        """
        if self.mesh is None or self.mesh.group.pg is None:
            raise TransportError("connect() first (no open transfer group)")
        # the layout of this round, the same in the routes the engines get and the pairs this rank
        # sends: bucket_bytes / delta_min_bucket_bytes / alignment may have been assigned since connect()
        self.mesh.bucket_bytes, self.mesh.alignment = self.layout_bucket_bytes, self.alignment
        futures = []
        if self.rank == 0:
            doc = routes_for(outputs, self.senders, [], self.mesh.bucket_bytes, self.mesh.alignment, self.load_mode,
                             self.staged_bytes).to_dict()
            info = {"wire_manifest": None, MESH_KEY: doc, "mode": self.mode, "protocol": PROTOCOL_VERSION}
            info.update({k: v for k, v in ((FORMAT_KEY, quantization_config), (ONLINE_KEY, engine_quantization))
                         if v is not _UNNAMED})
            self._end_left_open()
            self.engines.call_all("start_weight_update")
            futures = self.engines.start("update_weights", info)
        try:
            report = self.mesh.send(outputs, tensors)
        except BaseException as exc:
            if isinstance(exc, MixedWeightsError):
                self.mixed = getattr(exc, "detail", str(exc))
            errors = self.engines.results(futures)
            if self.rank == 0:  # end the engines' update session (the backend loads nothing: not committed)
                errors.update({i: f"finish_weight_update: {e}"
                               for i, e in self.engines.results(self.engines.start("finish_weight_update")).items()})
            exc.add_note(f"qstrat mesh, the engines' update_weights: {listed(errors) or 'no error reported'}")
            raise
        errors = self.engines.results(futures)
        if errors:
            raise TransportError(f"update_weights failed after the mesh round: {listed(errors)}")
        if self.rank == 0:
            self.engines.finish_all()
        self.mixed = None
        return report
