"""Rank 0's part of a round (:mod:`qstrat.transport.protocol`'s steps 0-4: challenge, round
header, accept vote, buckets, commit vote) and the round's outcome as the sender raises it.

What a sender does around it (the weight-sync calls, the report) is
:class:`~qstrat.transport.send.sender.RefitSender`'s; the bucket stream is
:func:`~qstrat.transport.send.outgoing.send_buckets` (a delta round's:
:func:`~qstrat.transport.delta.stream.send_patches`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from qstrat.errors import InputMismatchError, MixedWeightsError, NonFiniteError, TransportError
from qstrat.transport.delta import encoding as delta
from qstrat.transport import protocol as proto
from qstrat.transport.protocol import BOUNDED_MODES, DELTA_MODES
from qstrat.transport.security.auth import RoundContext, next_counter
from qstrat.transport.delta.stream import PatchEncoder, send_patches
from qstrat.transport.group import TransferGroup
from qstrat.transport.security.keys import Secret
from qstrat.transport.send.outgoing import SourceFailure, send_buckets
from qstrat.transport.security.seal import Sealer
from qstrat.transport.timing import Phases
from qstrat.transport.wire_manifest import WireManifest


class SenderProtocol:
    """Runs rounds as rank 0 and carries the round counter from one round to the next."""

    def __init__(self) -> None:
        #: The last round's counter (each round's is above it and every receiver's challenge).
        self.counter = -1

    def run(self, group: TransferGroup, wire_manifest: WireManifest,
            tensors: Iterator[tuple[str, torch.Tensor]] | PatchEncoder,
            prof: Phases, close: Callable[[], None], secret: Secret | None, mode: str,
            master: tuple[str, int]) -> None:
        """Steps 0-4 on this rank, then the outcome; returns only when every rank committed.

        ``tensors``: yielded in ``wire_manifest``'s wire order (delta modes: the round's
        :class:`~qstrat.transport.delta.stream.PatchEncoder`); ``prof``: gets ``handshake_s``,
        ``commit_s`` and :func:`~qstrat.transport.send.outgoing.send_buckets`' phases; ``close``: called
        when the source itself failed (its device state is suspect) before the error is raised;
        ``secret`` (None: unauthenticated), ``mode`` (``atomic``, ``bounded``, ``delta``, ``bounded-delta``) and
        ``master`` (the group's address and port) are bound into the round's MAC.

        Raises: as :meth:`RefitSender.send <qstrat.transport.send.sender.RefitSender.send>` (before its
            engine errors are added); a MixedWeightsError carries ``detail``: which ranks hold
            new weights.
        """
        mac = self._accept(group, wire_manifest, prof, secret, mode, master)
        try:
            sealer = Sealer(secret, mac, group.device)
            failure = (send_patches(group, wire_manifest, tensors, sealer, prof) if mode in DELTA_MODES else
                       send_buckets(group, wire_manifest, iter(tensors), sealer, prof))
        except TransportError as exc:
            if mode in BOUNDED_MODES:
                raise _mixed(f"{exc}; bounded mode: engines may hold a MIX of two rounds, the next refit "
                             f"must be whole", f"a bounded round was cut off ({exc})") from None
            raise
        try:
            with prof.timed("commit_s"):
                votes = proto.vote(group, proto.COMMIT, proto.SENDER_ABORT if failure else proto.OK, False,
                                   secret, mac)
        except RuntimeError as exc:
            raise proto.lost(group, "commit vote failed (a receiver died?)", exc) from None
        raise_outcome(votes, failure, close)

    def _accept(self, group: TransferGroup, wire_manifest: WireManifest, prof: Phases, secret: Secret | None,
                mode: str, master: tuple[str, int]) -> bytes:
        """Challenge, round header, accept vote; the round's MAC, or raise the refusal."""
        try:
            with prof.timed("handshake_s"):
                _, challenges = proto.challenges(group)
                self.counter = next_counter(self.counter, challenges)
                ctx = RoundContext(wire_manifest.digest, mode, self.counter, challenges, *master, group.world_size)
                mac = ctx.mac(secret)
                group.wait(group.broadcast(proto.round_header(
                    len(wire_manifest.buckets), wire_manifest.total_bytes, ctx.counter, wire_manifest.digest,
                    mac, group.device)))
                votes = proto.vote(group, proto.ACCEPT, proto.OK, False, secret, mac)
        except RuntimeError as exc:
            raise proto.lost(group, "round header / accept vote failed (an engine died?)", exc) from None
        if votes.delta_refused():
            raise delta.DeltaRefused(f"delta refused before any data: {proto.describe(votes.statuses)}")
        if votes.failed():
            raise votes.refusal("round")
        return mac


def raise_outcome(votes: proto.Votes, failure: SourceFailure | None, close: Callable[[], None]) -> None:
    """Raise unless every rank committed (:func:`qstrat.transport.protocol.outcome`): the source's
    own error (after ``close()``, unless it is the trainer's data refused - an InputMismatchError
    (an input's metadata, before it was read) or a NonFiniteError (a value): no device work
    failed, and the sender may send again on the same group)
    when it failed and nothing is mixed, DeltaRefused when only the delta was refused,
    MixedWeightsError (with ``detail``) when some rank holds new weights - a DeltaMixed when
    only the delta was refused (a bounded delta round: every loaded unit verified) -,
    TransportError otherwise."""
    outcome = proto.outcome(votes)
    if outcome == "committed":
        return
    own = failure is not None and not isinstance(failure.error, TransportError)
    data = isinstance(failure.error, (InputMismatchError, NonFiniteError)) if own else False
    if own and not data:  # OOM, a compile error...: device state suspect
        close()
    described = proto.describe(votes.statuses)
    if outcome == "mixed":
        holders = ", ".join(map(str, votes.holders()))
        why = f"the sender aborted the stream ({failure}); " if failure else ""
        cls = delta.DeltaMixed if failure is None and votes.delta_refused() else MixedWeightsError
        raise _mixed(f"round not committed: {why}{described}; the engines hold a MIX: ranks {holders} hold new "
                     f"weights, the others not (each flagged rank now accepts only a whole refit)",
                     f"ranks {holders} hold new weights after: {described}", cls
                     ) from (failure.error if failure else None)
    if own:
        raise failure.error
    if failure is None and votes.delta_refused():
        raise delta.DeltaRefused(f"delta refused, nothing loaded: {described}")
    if failure is not None:
        raise TransportError(f"sender aborted the stream: {failure}; nothing loaded")
    raise TransportError(f"round not committed: {described}; nothing loaded")


def _mixed(message: str, detail: str, cls: type[MixedWeightsError] = MixedWeightsError) -> MixedWeightsError:
    """A MixedWeightsError (``cls``) whose ``detail`` names the ranks or engines holding new weights."""
    exc = cls(message)
    exc.detail = detail
    return exc
