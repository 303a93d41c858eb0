"""What a sender's round returns: :class:`TransferReport`, and for ``mode="delta"`` its
:class:`DeltaReport`."""
from __future__ import annotations

from dataclasses import dataclass, field

from qstrat.transport.wire_manifest import WireManifest


@dataclass(frozen=True, repr=False)
class TransferReport:
    """One round: its wire manifest, payload bytes, buckets, wall seconds of the stream (steps 1-4)
    and of the whole round (RPCs and engine load included). Printed as one line (the wire manifest
    as its tensor count and digest; every slot: ``report.wire_manifest.to_dict()``)."""

    wire_manifest: WireManifest
    bytes: int
    buckets: int
    stream_seconds: float
    seconds: float
    #: ``mode="delta"``: what the round sent and why (None in the other modes).
    delta: DeltaReport | None = None
    #: Why the round went twice: the driver's kept plan did not fit an input (its reason), that
    #: round was aborted with nothing loaded, and the inputs were planned again and sent (None:
    #: one attempt). :meth:`~qstrat.transport.RefitSender.refit`.
    replanned: str | None = None

    def __repr__(self) -> str:
        more = (f", {self.delta}" if self.delta is not None else "") + \
            (f", replanned: {self.replanned}" if self.replanned else "")
        return (f"TransferReport(tensors={len(self.wire_manifest.slots)}, bytes={self.bytes} "
                f"({self.bytes / 2**20:.2f} MiB), buckets={self.buckets}, "
                f"stream_seconds={self.stream_seconds:.3f}, seconds={self.seconds:.3f}, "
                f"wire manifest digest {self.wire_manifest.digest[:12]}{more})")


@dataclass(frozen=True)
class DeltaReport:
    """A ``mode="delta"`` round: ``kind`` ``delta`` (some tile went as a patch) or ``full``
    (every tile raw); ``reason``: why it went full (None: it did not, or every tile was simply
    smaller raw), e.g. ``no base ...`` or ``the engines refused the delta: ...`` (a stale base or
    a digest mismatch: the round was then sent again, whole); ``full_bytes``: the full round's
    payload (the target wire manifest's); ``wire_bytes``: the payload bytes sent (digests,
    patch headers, tile tables and patches; with ``attempts == 2`` both rounds' payloads: a
    delta refused in the commit vote went on the wire before the whole round, one refused in
    the accept vote did not); ``tiles``: tiles per encoding (``rle``,
    ``bitmap``, ``raw``; :mod:`qstrat.transport.delta.encoding`); ``encode_s``: wall seconds comparing
    the round's stream with the base, digesting it and making the patch of the round sent;
    ``source_s``: the rest of the wall seconds until the round was encoded (quantizing into
    the stream);
    ``base_bytes``: the host memory the sender's base holds after the round; ``attempts``: 2 when
    a refused delta was followed by the whole round. The report's ``seconds`` then cover the
    whole ``refit`` call after the checks (quantization, encoding, the round or rounds).
    ``requantize``: the incremental quantizer's counts over the round
    (:attr:`qstrat.transport.delta.requantize.Requantizer.stats`: elements, changed, blocks
    touched and rescaled, codes re-encoded, and ``whole:<why>`` per entry quantized whole;
    empty without it); ``copied_whole``: the bytes of the round's stream copied into it whole and
    compared with the base whole - the round's tensors that the requantizer's write log could not
    vouch for (passthrough tensors, a part changed outside the requantizer, a round without a
    base); the rest were copied and compared only where the log named written bytes
    (:mod:`qstrat.transport.delta.written`)."""

    kind: str
    reason: str | None
    full_bytes: int
    wire_bytes: int
    tiles: dict[str, int]
    source_s: float
    encode_s: float
    base_bytes: int
    attempts: int
    requantize: dict[str, int] = field(default_factory=dict)
    copied_whole: int = 0

    def __str__(self) -> str:
        why = f" ({self.reason})" if self.reason else ""
        return (f"delta kind={self.kind}{why}, wire {self.wire_bytes} of {self.full_bytes} bytes "
                f"({100 * self.wire_bytes / max(self.full_bytes, 1):.2f} %), tiles {self.tiles}")
