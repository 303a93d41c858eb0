"""A receiver's state across rounds: its group, secret, address binding, last round counter,
the mode of the round in progress, and the MIX flag.

Shared by the vLLM backend (:mod:`qstrat.vllm.engine.transfer_backend`) and
:class:`~qstrat.transport.receive.standalone.StandaloneReceiver`; what differs is the LOADER:

* ``begin_load()``: before the first tensor is loaded (an engine: ``initialize_layerwise_reload``);
* ``load(tensors)``: ``(name, tensor)`` pairs of whole reload units (an engine: ``model.load_weights``);
* ``end_load()``: after the last (an engine: ``finalize_layerwise_reload``: units that received
  nothing keep their weights).

Fault semantics (enforced here), the same for every mode: a round is COMMITTED everywhere,
REFUSED everywhere (nothing loaded anywhere), or MIXED. A receiver that holds anything new from
a round that was not committed everywhere - bounded mode: it loaded a unit and some rank failed
(itself or another, :func:`qstrat.transport.protocol.outcome`); atomic mode: its load in
``finish_weight_update`` raised part-way - finalizes the reload (units not loaded keep their old
weights) and flags itself :attr:`ReceiverSession.mixed`. While flagged, a round must be WHOLE
(send every tensor the engine expects): a partial round is refused before any data, naming the
flag. A whole round that loads completely clears it. The engine keeps running (it serves requests
with whatever it holds). :func:`qstrat.vllm.refit` applies the same rule to an in-process engine.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from qstrat.errors import MixedWeightsError, TransferAuthError, TransportError
from qstrat.transport.delta import encoding as delta
from qstrat.transport.receive.acceptance import Expected, RoundCheck
from qstrat.transport.security.address import ENV_ADDRESS, check_address
from qstrat.transport.security.auth import ReceiverAuth, check_init
from qstrat.transport.delta.rebuild import DeltaRebuild
from qstrat.transport.group import DEFAULT_TIMEOUT_S, TransferGroup, open_group
from qstrat.transport.security.keys import Secret
from qstrat.transport.receive.landing import Landing, Loader
from qstrat.transport.mesh.engine import MESH_KEY, receive_mesh
from qstrat.transport.mesh.pair_delta import PairBases
from qstrat.transport.receive.receiver_flag import MixFlag
from qstrat.transport.protocol import DELTA_MODES
from qstrat.transport.receive.receiver import receive_round

__all__ = ["Expected", "Loader", "ReceiverSession"]


class ReceiverSession:
    """The four weight-sync calls' receiver logic.

    Args:
        expected: returns what the receiver accepts: name -> (dtype, shape), an engine's
            :class:`~qstrat.transport.engine_check.EngineExpectations`, or None (anything).
        loader: a :class:`Loader`.
        secret: the shared secret (Secret, bytes, text), or None to read :data:`ENV_SECRET
            <qstrat.transport.security.keys.ENV_SECRET>` at each :meth:`join`.
        address: the one group address to join (``host`` / ``host:port``), or None to read
            :data:`~qstrat.transport.security.address.ENV_ADDRESS` at each :meth:`join` (unset: any).
        rank_in_client: this worker's index among its engine's workers (added to ``rank_offset``).
        staging: atomic mode staging device (None: the group's device; ``cpu``: host staging,
            pinned when CUDA is available).
        layout: returns this receiver's :class:`~qstrat.transport.mesh.routing.ReceiverLayout` (what
            it loads in a mesh round, read from its engine); None: no mesh rounds.
    """

    def __init__(self, expected: Callable[[], Expected | None], loader: Loader, secret: Any = None,
                 address: str | None = None, rank_in_client: int = 0,
                 staging: torch.device | None = None, layout: Callable[[], Any] | None = None) -> None:
        self.expected, self.loader, self.layout = expected, loader, layout
        #: The trainer ranks of a mesh group (init info ``senders``); None: a single-sender group.
        self.senders: int | None = None
        self._secret, self._address = Secret.coerce(secret), address
        self.rank_in_client, self.staging = rank_in_client, staging
        self.group: TransferGroup | None = None
        self.auth: ReceiverAuth | None = None
        #: The MIX flag (:attr:`mixed` is its reason).
        self.flag = MixFlag()
        self.landing = Landing(loader)
        #: The delta base and the rebuild of delta rounds from it (:attr:`base`).
        self.delta = DeltaRebuild()
        #: A mesh group's pair bases (delta mesh rounds, :mod:`qstrat.transport.mesh.pair_delta`).
        self.mesh_pairs = PairBases()
        self._mesh_delta = False
        self._staged: list[tuple[str, torch.Tensor]] | None = None
        self._received = False
        #: The last round's ``peak_bytes`` and seconds by phase (see
        #: :func:`~qstrat.transport.receive.receiver.receive_round`), plus ``finish_s`` (atomic: the load).
        self.stats: dict[str, float] = {}

    @property
    def mixed(self) -> str | None:
        """Why this receiver holds a MIX of two rounds (None: it does not)."""
        return self.flag.reason

    @property
    def base(self) -> delta.Base | None:
        """The delta base (:mod:`qstrat.transport.delta.encoding`): the tensors' bytes as of the last
        delta-mode round this receiver loaded, in host memory; None: no base."""
        return self.delta.base

    def join(self, init_info: Any) -> None:
        """Join the transfer group after checking the init info; a previous group is closed only
        once the new one is joined (a refused or failed init leaves a live group as it is).

        Args: init_info: a mapping or object with ``master_address``, ``master_port``,
            ``rank_offset``, ``world_size`` and optionally ``backend``, ``timeout_s``, ``senders``
            (a mesh group's trainer ranks, :mod:`qstrat.transport.mesh.steps`) and ``auth``
            (the tag :func:`qstrat.transport.security.auth.sign_init` adds; required with a secret).
        Raises: TransferAuthError for an address other than the configured one, or (with a
            secret) an init info without a valid tag - nothing joined, nothing closed;
            TransportError if the rendezvous fails.
        """
        import os

        fields = dict(init_info) if isinstance(init_info, dict) else dict(vars(init_info))
        address = self._address if self._address is not None else os.environ.get(ENV_ADDRESS)
        host, port = str(fields.get("master_address")), int(fields.get("master_port"))
        check_address(address, host, port)
        secret = self._secret if self._secret is not None else Secret.from_env()
        refusal = check_init(secret, fields)
        if refusal is not None:
            raise TransferAuthError(refusal)
        group = open_group(host, port, int(fields.get("rank_offset")) + self.rank_in_client,
                           int(fields.get("world_size")), fields.get("backend") or "gloo",
                           float(fields.get("timeout_s") or DEFAULT_TIMEOUT_S))
        self.shutdown()
        self.group, self.senders = group, fields.get("senders")
        last = self.auth.last_counter if self.auth is not None else -1
        self.auth = ReceiverAuth(secret, host, port, last)

    def start(self) -> None:
        """Begin an update session: drop any staged round; the loader is not touched."""
        self._staged, self._received = None, False
        self.delta.take_next()

    def update(self, update_info: dict[str, Any]) -> None:
        """Receive one round: ``{"wire_manifest": ..., "mode": "atomic" | "bounded" | "delta" |
        "bounded-delta", "protocol": PROTOCOL_VERSION}`` (``delta``: also ``"delta": {"base",
        "round"}``, :mod:`qstrat.transport.delta.encoding`; the engine checks the wire manifest as a
        full round's, each bucket arrives as a patch rebuilt from :attr:`base` and checked against
        the trainer's digest before the commit vote, and :meth:`finish` loads them as an atomic
        round's; ``bounded-delta``: the same patches, each reload unit loaded as soon as its last
        bucket's digest verified, :func:`receive_delta`).

        A MESH round (``"mesh"``: the routes document, :mod:`qstrat.transport.mesh.engine`) is
        received from every trainer rank and staged for :meth:`finish` (atomic), or loaded unit by
        unit as its pieces arrive (bounded, :mod:`qstrat.transport.mesh.bounded`; a MIX flags
        this receiver as in single-sender bounded mode).

        Raises: as :func:`~qstrat.transport.receive.receiver.receive_round`; TransportError for a second
            round in one session or an unknown mode (:class:`~qstrat.transport.receive.acceptance.RoundCheck`).
            Bounded mode: a round that was not committed everywhere after this receiver loaded a
            unit finalizes the reload, sets :attr:`mixed` and raises MixedWeightsError.
        """
        if self.group is None or self.group.pg is None:
            raise TransportError("qstrat transfer: call init_weight_transfer_engine first "
                                 "(no open transfer group)")
        if self._received:
            raise TransportError("qstrat transfer: one update_weights round per session "
                                 "(call finish_weight_update first)")
        check = RoundCheck(update_info, self.expected, self.flag, lambda: self.delta.base)
        doc, protocol = check.info.get("wire_manifest"), check.info.get("protocol")
        self._received = True
        self.stats = {}
        self._mesh_delta = isinstance(update_info, dict) and MESH_KEY in update_info and check.mode == "delta"
        if not self._mesh_delta:
            self.mesh_pairs.drop()  # another round changes the weights outside the pairs' bookkeeping
        if isinstance(update_info, dict) and MESH_KEY in update_info:  # every trainer rank to its share
            self.delta.base = None
            self._staged = receive_mesh(self, update_info)
            return
        if check.mode in DELTA_MODES:
            self._staged = receive_delta(self, check, doc, protocol)
            return
        self.delta.base = None  # another mode changes the weights outside the delta's bookkeeping
        if check.mode != "bounded":  # atomic, or a bad mode: refused by check() in the accept vote
            self._staged = receive_round(self.group, doc, check, self.auth, staging=self.staging,
                                         stats=self.stats, protocol_version=protocol)
            return
        self.load_bounded(lambda on_unit: receive_round(self.group, doc, check, self.auth, "bounded", on_unit,
                                                        stats=self.stats, protocol_version=protocol),
                          lambda: check.sent)
        self._staged = []

    def load_bounded(self, receive: Callable[[Callable[[str, list], None]], Any], sent: Callable[[], set[str]]
                     ) -> None:
        """A bounded round: ``receive(on_unit)`` loads each unit through the landing as it arrives;
        the reload is finalized whatever happens. A MixedWeightsError flags this receiver (its
        ``detail``; ``sent()``: the round's tensor names) and is raised; a round that loaded
        completely clears the flag if it was whole. Raises: what ``receive`` raises."""
        try:
            receive(lambda unit, tensors: self.landing.load(tensors))
        except MixedWeightsError as exc:
            self.flag.set(getattr(exc, "detail", str(exc)), sent())
            raise
        finally:
            self.landing.end()
        self.flag.loaded(self.expected, sent())

    def finish(self) -> None:
        """Atomic mode: load the staged round (begin, load, end); bounded mode: nothing left.

        Raises: TransportError if no round was received in this session; MixedWeightsError when
            the load raised part-way (the reload is finalized, the receiver flagged :attr:`mixed`).
        """
        staged, self._staged = self._staged, None
        next_base = self.delta.take_next()
        if staged is None:
            raise TransportError("qstrat transfer: finish_weight_update without a received round")
        if not staged:
            return
        t0 = time.perf_counter()
        sent = {n for n, _ in staged}
        try:
            self.landing.load(staged)
        except BaseException as exc:
            self.delta.base = None
            self.mesh_pairs.drop()
            self._fail_load(exc, sent)
            if not isinstance(exc, Exception):
                raise
            raise MixedWeightsError(f"rank {self.group.rank if self.group else '?'}: the load of a committed "
                                    f"round failed part-way: {self.mixed}; this receiver holds a MIX, the "
                                    f"next refit must be whole") from exc
        self.landing.end()
        self.stats["finish_s"] = time.perf_counter() - t0
        self.delta.commit(next_base)
        if self._mesh_delta:
            self.mesh_pairs.commit()
        self.flag.loaded(self.expected, sent)

    def _fail_load(self, exc: BaseException, sent: set[str]) -> None:
        """Flag this receiver after a load that raised part-way, and finalize the reload."""
        self.flag.fail_load(f"{type(exc).__name__}: {exc}", self.landing.end, sent)

    def shutdown(self) -> None:
        """Close the transfer group; staged data is dropped."""
        self._staged = None
        if self.group is not None:
            self.group.close()
            self.group = None


def receive_delta(session: ReceiverSession, check: RoundCheck, doc: Any, protocol: Any
                  ) -> list[tuple[str, torch.Tensor]]:
    """A ``delta`` or ``bounded-delta`` round on ``session`` (``check``: its accept-vote check;
    ``doc``, ``protocol``: its wire manifest document and protocol version). ``delta``: returns
    the rebuilt tensors, staged for :meth:`ReceiverSession.finish` (which loads them and makes
    their stream the base). ``bounded-delta``: loaded unit by unit as
    :meth:`ReceiverSession.load_bounded` (each unit a view of the rebuilt stream, handed once the
    digest of the bucket holding its last byte verified), returns ``[]``; the round's stream
    becomes the base only once the round committed everywhere, and a MIX drops the base (the
    weights moved outside it: the next round is whole). Raises: as :meth:`ReceiverSession.update`."""
    def patches(mac: bytes) -> Any:  # check.target: set in the accept vote
        auth = session.auth
        return session.delta.decoder(check.info["delta"], check.target, auth.secret if auth else None, mac)

    if check.mode == "delta":
        return receive_round(session.group, doc, check, session.auth, "delta", staging=session.staging,
                             stats=session.stats, protocol_version=protocol, patches=patches)
    try:
        session.load_bounded(lambda on_unit: receive_round(
            session.group, doc, check, session.auth, "bounded-delta", on_unit, stats=session.stats,
            protocol_version=protocol, patches=patches), lambda: check.sent)
    except MixedWeightsError:
        session.delta.base = None
        raise
    session.delta.commit(session.delta.take_next())
    return []
