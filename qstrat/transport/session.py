"""A receiver's state across rounds: its group, secret, address binding, last round counter,
the mode of the round in progress, and the MIX flag.

Shared by the vLLM backend (:mod:`qstrat.engine.transfer_backend`) and
:class:`~qstrat.transport.standalone.StandaloneReceiver`; what differs is the LOADER:

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
from typing import Any, Protocol

import torch

from qstrat.errors import MixedWeightsError, TransferAuthError, TransportError, WireManifestMismatchError
from qstrat.transport import delta
from qstrat.transport.address import ENV_ADDRESS, check_address
from qstrat.transport.auth import ReceiverAuth, check_init
from qstrat.transport.engine_check import EngineExpectations
from qstrat.transport.keys import Secret
from qstrat.transport.group import DEFAULT_TIMEOUT_S, TransferGroup, open_group
from qstrat.transport.receiver import MODES, receive_round
from qstrat.transport.wire_manifest import WireManifest, check_against

#: What a receiver accepts: name -> (dtype, shape), or an engine's manifest (EngineExpectations).
Expected = dict[str, tuple[str, tuple[int, ...]]] | EngineExpectations


class Loader(Protocol):
    """Where a receiver's tensors go (see the module docstring)."""

    def begin_load(self) -> None: ...
    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None: ...
    def end_load(self) -> None: ...


class ReceiverSession:
    """The four weight-sync calls' receiver logic.

    Args:
        expected: returns what the receiver accepts: name -> (dtype, shape), an engine's
            :class:`~qstrat.transport.engine_check.EngineExpectations`, or None (anything).
        loader: a :class:`Loader`.
        secret: the shared secret (Secret, bytes, text), or None to read :data:`ENV_SECRET
            <qstrat.transport.auth.ENV_SECRET>` at each :meth:`join`.
        address: the one group address to join (``host`` / ``host:port``), or None to read
            :data:`~qstrat.transport.auth.ENV_ADDRESS` at each :meth:`join` (unset: any).
        rank_in_client: this worker's index among its engine's workers (added to ``rank_offset``).
        staging: atomic mode staging device (None: the group's device; ``cpu``: host staging,
            pinned when CUDA is available).
    """

    def __init__(self, expected: Callable[[], Expected | None], loader: Loader, secret: Any = None,
                 address: str | None = None, rank_in_client: int = 0,
                 staging: torch.device | None = None) -> None:
        self.expected, self.loader = expected, loader
        self._secret, self._address = Secret.coerce(secret), address
        self.rank_in_client, self.staging = rank_in_client, staging
        self.group: TransferGroup | None = None
        self.auth: ReceiverAuth | None = None
        self.mixed: str | None = None
        self._required: set[str] | None = None
        self._staged: list[tuple[str, torch.Tensor]] | None = None
        self._received = False
        self._loading = False
        #: The delta base (:mod:`qstrat.transport.delta`): the tensors' bytes as of the last
        #: delta-mode round this receiver loaded, in host memory; None: no base (any round in
        #: another mode, or a failed load, drops it).
        self.base: delta.Base | None = None
        self._next_base: delta.Base | None = None
        #: The last round's ``peak_bytes`` and seconds by phase (see
        #: :func:`~qstrat.transport.receiver.receive_round`), plus ``finish_s`` (atomic: the load).
        self.stats: dict[str, float] = {}

    def join(self, init_info: Any) -> None:
        """Join the transfer group after checking the init info; a previous group is closed only
        once the new one is joined (a refused or failed init leaves a live group as it is).

        Args: init_info: a mapping or object with ``master_address``, ``master_port``,
            ``rank_offset``, ``world_size`` and optionally ``backend``, ``timeout_s`` and ``auth``
            (the tag :func:`qstrat.transport.auth.sign_init` adds; required with a secret).
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
        self.group = group
        last = self.auth.last_counter if self.auth is not None else -1
        self.auth = ReceiverAuth(secret, host, port, last)

    def start(self) -> None:
        """Begin an update session: drop any staged round; the loader is not touched."""
        self._staged, self._received, self._next_base = None, False, None

    def update(self, update_info: dict[str, Any]) -> None:
        """Receive one round: ``{"wire_manifest": ..., "mode": "atomic" | "bounded" | "delta",
        "protocol": PROTOCOL_VERSION}`` (``delta``: also ``"delta": {"base", "round", "target"}``,
        :mod:`qstrat.transport.delta`; the engine checks the TARGET wire manifest, the tensors
        are reconstructed from :attr:`base` and checked against the trainer's digests before
        the commit vote, and :meth:`finish` loads them as an atomic round's).

        Raises: as :func:`~qstrat.transport.receiver.receive_round`; TransportError for a second
            round in one session or an unknown mode. Bounded mode: a round that was not committed
            everywhere after this receiver loaded a unit finalizes the reload, sets :attr:`mixed`
            and raises MixedWeightsError.
        """
        if self.group is None or self.group.pg is None:
            raise TransportError("qstrat transfer: call init_weight_transfer_engine first "
                                 "(no open transfer group)")
        if self._received:
            raise TransportError("qstrat transfer: one update_weights round per session "
                                 "(call finish_weight_update first)")
        # Malformed update_info is refused in the round's accept vote (check below), not raised
        # here: the sender and the other ranks are already waiting in the round's collectives.
        info = update_info if isinstance(update_info, dict) else {}
        mode = info.get("mode", "atomic")
        protocol = info.get("protocol")
        self._received = True
        self.stats = {}
        sent: set[str] = set()

        targets: list[WireManifest] = []

        def check(wm: WireManifest) -> None:
            if not isinstance(update_info, dict) or mode not in MODES:
                raise TransportError(f"qstrat transfer: update_info must be a dict with a round mode in "
                                     f"{MODES}, got mode {mode!r}")
            if mode == "delta":  # the engine checks the full round's wire manifest, the base after
                targets.append(delta.target_of(wm, info.get("delta")))
                wm = targets[0]
            sent.update(s.name for s in wm.slots)
            expected = self.expected()
            if isinstance(expected, EngineExpectations):
                expected.check(wm, info)
            elif expected is not None:
                check_against(wm, expected)
            if self.mixed is not None:
                sends, whole = self._coverage(expected, sent)
                if sends < whole:
                    raise WireManifestMismatchError(
                        f"this receiver holds a MIX of two rounds ({self.mixed}): the next refit "
                        f"must be whole, this one sends {sends} of the {whole} {self._unit_word(expected)}")
            if mode == "delta":
                delta.check_base(info["delta"], targets[0], self.base)

        if mode == "delta":
            def finalize(blobs: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
                try:
                    staged, self._next_base = delta.decode_round(blobs, info["delta"], targets[0], self.base,
                                                                 self.auth.secret if self.auth else None)
                except delta.DeltaError:
                    self.base = None  # out of step with the trainer: the next round is whole
                    raise
                return staged

            self._staged = receive_round(self.group, info.get("wire_manifest"), check, self.auth, "delta",
                                         staging=self.staging, stats=self.stats, protocol_version=protocol,
                                         finalize=finalize)
            return

        self.base = None  # another mode changes the weights outside the delta's bookkeeping
        if mode != "bounded":  # atomic, or a bad mode: refused by check() in the accept vote
            self._staged = receive_round(self.group, info.get("wire_manifest"), check, self.auth,
                                         staging=self.staging, stats=self.stats, protocol_version=protocol)
            return

        def on_unit(unit: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
            if not self._loading:
                self.loader.begin_load()
                self._loading = True
            self.loader.load(tensors)

        try:
            receive_round(self.group, info.get("wire_manifest"), check, self.auth, "bounded", on_unit,
                          stats=self.stats, protocol_version=protocol)
        except MixedWeightsError as exc:
            self.mixed = getattr(exc, "detail", str(exc))
            self._required = self._required or sent
            self._end()
            raise
        except BaseException:
            self._end()
            raise
        self._end()
        self._committed(sent)
        self._staged = []

    def finish(self) -> None:
        """Atomic mode: load the staged round (begin, load, end); bounded mode: nothing left.

        Raises: TransportError if no round was received in this session; MixedWeightsError when
            the load raised part-way (the reload is finalized, the receiver flagged :attr:`mixed`).
        """
        staged, self._staged = self._staged, None
        next_base, self._next_base = self._next_base, None
        if staged is None:
            raise TransportError("qstrat transfer: finish_weight_update without a received round")
        if not staged:
            return
        t0 = time.perf_counter()
        sent = {n for n, _ in staged}
        try:
            self.loader.begin_load()
            self._loading = True
            self.loader.load(staged)
        except BaseException as exc:
            self.base = None
            self._fail_load(exc, sent)
            if not isinstance(exc, Exception):
                raise
            raise MixedWeightsError(f"rank {self.group.rank if self.group else '?'}: the load of a committed "
                                    f"round failed part-way: {self.mixed}; this receiver holds a MIX, the "
                                    f"next refit must be whole") from exc
        self._end()
        self.stats["finish_s"] = time.perf_counter() - t0
        self.base = next_base
        self._committed(sent)

    def _fail_load(self, exc: BaseException, sent: set[str]) -> None:
        """Flag this receiver after a load that raised part-way, and finalize the reload."""
        self.mixed = f"{type(exc).__name__}: {exc}"
        self._required = self._required or sent
        try:
            self._end()
        except Exception as end_exc:  # noqa: BLE001 - the flag is what matters now
            self.mixed += f" (finalizing the reload failed too: {type(end_exc).__name__}: {end_exc})"

    def _coverage(self, expected: Any, sent: set[str]) -> tuple[int, int]:
        """(how much of the receiver a round sending ``sent`` updates, the whole)."""
        if isinstance(expected, EngineExpectations):
            return expected.coverage(sent)
        need = set(expected) if expected is not None else (self._required or set())
        return len(need & sent), len(need)

    @staticmethod
    def _unit_word(expected: Any) -> str:
        return "parts" if isinstance(expected, EngineExpectations) else "tensors"

    def _committed(self, sent: set[str]) -> None:
        if self.mixed is None:
            return
        sends, whole = self._coverage(self.expected(), sent)
        if sends == whole:
            self.mixed, self._required = None, None

    def _end(self) -> None:
        if self._loading:
            self._loading = False
            self.loader.end_load()

    def shutdown(self) -> None:
        """Close the transfer group; staged data is dropped."""
        self._staged = None
        if self.group is not None:
            self.group.close()
            self.group = None
