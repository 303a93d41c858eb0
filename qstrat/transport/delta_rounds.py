"""A ``mode="delta"`` sender's state across rounds: the base it shares with the engines, and per
round the choice of a delta or a whole round (:mod:`qstrat.transport.delta` encodes them)."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from qstrat.errors import TransferAuthError, WireManifestMismatchError
from qstrat.transport import delta
from qstrat.transport.keys import Secret
from qstrat.transport.report import DeltaReport, TransferReport
from qstrat.transport.wire_manifest import WireManifest

#: Sends one encoded round: (its wire manifest, its blobs in wire order, the ``update_info``
#: additions) -> the round's report.
SendRound = Callable[[WireManifest, Iterator[tuple[str, torch.Tensor]], dict[str, Any]], TransferReport]


#: What an engine raises when it refuses a round before any data (another wire manifest or plan
#: in the accept vote, a failed authentication): no engine changed, so the base is kept, as it
#: is when encoding the round fails (nothing sent). After any other failure the next round goes
#: whole.
REFUSED_BEFORE_DATA = (WireManifestMismatchError, TransferAuthError)


class DeltaRounds:
    """The sender's delta base and the rounds sent against it."""

    def __init__(self) -> None:
        #: The base shared with the engines: the last round every engine committed, in host
        #: memory (None: the next round is whole).
        self.base: delta.Base | None = None

    def refit(self, target: WireManifest, tensors: Iterator[tuple[str, torch.Tensor]], secret: Secret | None,
              send: SendRound, target_doc: dict[str, Any] | None = None) -> TransferReport:
        """One round of ``tensors`` (``target``'s, in its wire order) through ``send``: the delta
        against :attr:`base` (bucket digests keyed with ``secret``; None: unkeyed), or the whole
        round when there is none (or it has another layout), or when the engines refuse the delta
        (then sent again, whole). A round that raises leaves no base, unless no engine changed:
        encoding it failed (nothing sent) or the engines refused it before any data
        (:data:`REFUSED_BEFORE_DATA`). ``target_doc``: ``target.to_dict()`` when the caller keeps
        it (None: built per round). Returns ``send``'s report with a :class:`DeltaReport` and the
        seconds since ``tensors`` began. Raises: as ``send``."""
        base, self.base = self.base, None
        t0 = time.perf_counter()
        reason = ("no base (this sender's first round, or its last one failed)" if base is None else
                  "the base has another layout (wire manifest)" if base.target != target.digest else None)
        try:
            rnd = delta.encode_tensors(target, tensors, base, secret, target_doc)
        except BaseException:
            self.base = base  # nothing was sent (a NaN the stream found, a tensor off its slot)
            raise
        stream, source_s = rnd.new_base.stream, time.perf_counter() - t0 - rnd.encode_s
        attempts = 1
        try:
            try:
                report = send(rnd.wire_manifest, iter(rnd.blobs), {"delta": rnd.info})
            except delta.DeltaRefused as exc:
                reason, attempts = f"the engines refused the delta: {exc}", 2
                rnd = delta.encode_round(target, stream, None, secret, target_doc)
                report = send(rnd.wire_manifest, iter(rnd.blobs), {"delta": rnd.info})
        except REFUSED_BEFORE_DATA:
            self.base = base  # every engine still holds it
            raise
        self.base = rnd.new_base
        info = DeltaReport(rnd.kind, reason, target.total_bytes, rnd.wire_manifest.total_bytes, rnd.tiles,
                           source_s, rnd.encode_s, self.base.nbytes, attempts)
        return TransferReport(report.wire_manifest, report.bytes, report.buckets, report.stream_seconds,
                              time.perf_counter() - t0, info)
