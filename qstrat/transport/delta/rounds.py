"""A delta-mode (``delta``, ``bounded-delta``) sender's state across rounds: the base it shares
with the engines, and per round the choice of a delta or a whole round
(:mod:`qstrat.transport.delta.stream` encodes each bucket as the round streams)."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from qstrat.errors import MixedWeightsError, TransferAuthError, TransportConfigError, WireManifestMismatchError
from qstrat.transport.delta import encoding as delta
from qstrat.transport.delta.requantize import Requantizer
from qstrat.transport.delta.stream import PatchEncoder
from qstrat.transport.protocol import DELTA_MODES
from qstrat.transport.send.report import DeltaReport, TransferReport
from qstrat.transport.wire_manifest import WireManifest, is_integer

#: Sends one round: (its encoder, the ``update_info`` additions) -> the round's report.
SendRound = Callable[[PatchEncoder, dict[str, Any]], TransferReport]


#: The smallest bucket bound a delta-mode sender lays its rounds out with (bytes; the
#: ``delta_min_bucket_bytes`` default of :class:`~qstrat.transport.send.sender.RefitSender` and
#: :class:`~qstrat.transport.mesh.refit.MeshRefitSender`). Each bucket of a delta round carries
#: fixed costs on every rank - its prelude, seal and header; on the sender the write log's copy,
#: the compare, the patch and the keyed digest; on each receiver the decode and the digest check -
#: which at the 0.2-0.8 % of bytes an RL step changes outweigh the bucket's own work: on the
#: benchmark's 64 MiB model behind a 1 Gbit/s link, 4 MiB buckets made a delta round 0.125-0.141 s
#: and 0.18-0.19 CPU s, 16 MiB buckets 0.098-0.123 s and 0.13-0.15 CPU s, 32 MiB no faster
#: (docs/transport.md, "Delta: the bucket floor").
DELTA_MIN_BUCKET_BYTES = 16 << 20


def delta_bucket_bytes(bucket_bytes: int, minimum: int, alignment: int) -> int:
    """The bucket bound of a delta-mode round's wire manifest (bytes): ``bucket_bytes``, raised
    to ``minimum`` (:data:`DELTA_MIN_BUCKET_BYTES` by default; 0: as given) rounded up to a
    multiple of ``alignment``. A ``bucket_bytes`` the wire manifest refuses (not a positive
    multiple of ``alignment``) is returned as given, for its check to name it. Both sides follow
    the result: the engines read the layout from the round's ``update_info``."""
    if not (is_integer(bucket_bytes) and is_integer(alignment)) or bucket_bytes <= 0 or alignment <= 0 or bucket_bytes % alignment:
        return bucket_bytes
    return max(int(bucket_bytes), -(-minimum // int(alignment)) * int(alignment))


def check_min_bucket(value: object, owner: str) -> int:
    """``delta_min_bucket_bytes`` as given to ``owner`` (a class name, for the message), checked:
    an integer >= 0 (a NumPy integer too; returned as an int). Raises: TransportConfigError
    naming the key and the value (for a bool, a float, a string, a negative number)."""
    if not is_integer(value) or value < 0:
        raise TransportConfigError(f"{owner} delta_min_bucket_bytes={value!r}: give an int >= 0 (bytes; 0 lays "
                                   f"delta rounds out with bucket_bytes as given)")
    return int(value)


class MinBucketBytes:
    """A sender's ``delta_min_bucket_bytes`` attribute, checked (:func:`check_min_bucket`, naming
    the sender's class) whenever it is set - in ``__init__`` and by a caller changing it between
    rounds alike."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj: Any, value: object) -> None:
        setattr(obj, self.slot, check_min_bucket(value, type(obj).__name__))


class BucketFloor:
    """The delta modes' bucket floor of a sender (:class:`~qstrat.transport.send.sender.RefitSender`,
    :class:`~qstrat.transport.mesh.refit.MeshRefitSender`): :attr:`delta_min_bucket_bytes` and the
    :attr:`layout_bucket_bytes` its rounds use. The sender sets ``mode``, ``bucket_bytes``,
    ``alignment`` and ``delta_min_bucket_bytes``."""

    #: The smallest bucket bound of a delta-mode round (bytes): checked whenever set (an int >= 0).
    delta_min_bucket_bytes = MinBucketBytes()
    mode: str
    bucket_bytes: int
    alignment: int

    @property
    def layout_bucket_bytes(self) -> int:
        """The bucket bound this sender's rounds are laid out with (bytes): ``bucket_bytes``, in
        a delta mode raised to :attr:`delta_min_bucket_bytes` rounded up to the alignment
        (:func:`delta_bucket_bytes`; a ``bucket_bytes`` that is not a positive multiple of the
        alignment is returned as given, for the wire manifest's check to name it)."""
        if self.mode in DELTA_MODES:
            return delta_bucket_bytes(self.bucket_bytes, self.delta_min_bucket_bytes, self.alignment)
        return self.bucket_bytes


#: What an engine raises when it refuses a round before any data (another wire manifest or plan
#: in the accept vote, a failed authentication): no engine changed, so the base is kept, as it
#: is when the round's source failed (the stream was aborted, nothing loaded anywhere). After
#: any other failure the next round goes whole.
REFUSED_BEFORE_DATA = (WireManifestMismatchError, TransferAuthError)


class DeltaRounds:
    """The sender's delta base and the rounds sent against it.

    Args:
        incremental: quantize each round from the last one's inputs and parts
            (:class:`~qstrat.transport.delta.requantize.Requantizer`: the same bytes, only what
            changed re-encoded; memory ~3 bytes per quantized parameter on the inputs' device);
            False: every round quantizes the whole model.
    """

    def __init__(self, incremental: bool = True) -> None:
        #: The incremental quantizer (None: ``incremental=False``); :meth:`quantize` is what the
        #: round's execution calls.
        self.requantizer: Requantizer | None = Requantizer() if incremental else None
        self._layout: str | None = None
        #: The base shared with the engines: the last round every engine committed, in host
        #: memory (None: the next round is whole).
        self.base: delta.Base | None = None
        #: A stream buffer no one reads (the base before the last), reused for the next round's
        #: stream: written in place, without a new allocation's page faults.
        self.spare: torch.Tensor | None = None
        #: The round id of the stream :attr:`spare` holds (None: unknown, e.g. a round stopped
        #: part-way): the next round catches it up to the base from the base's changes.
        self.spare_round: str | None = None

    @property
    def quantize(self) -> Any:
        """The serializer call for this sender's rounds (:class:`qstrat.execute.stream.quantize.Quantize`):
        the requantizer's, or None (whole)."""
        return self.requantizer.quantize if self.requantizer is not None else None

    def refit(self, target: WireManifest, tensors: Iterator[tuple[str, torch.Tensor]], send: SendRound,
              bounded: bool = False) -> TransferReport:
        """One round of ``tensors`` (``target``'s, in its wire order) through ``send``: each
        bucket patched against :attr:`base` as it streams, or whole when there is none (or it
        has another layout), or when the engines refuse the delta (then sent again, whole: from
        the round's stream when the refusal came at the commit vote, from ``tensors`` when it
        came before any data). ``bounded`` (a ``bounded-delta`` round): a MIX left by a refused
        delta alone (DeltaMixed: every unit loaded was verified) is also repaired by sending the
        round again whole, from its stream. A round that raises leaves no base, unless no engine
        changed: its source failed (the stream was aborted) or the engines refused it before any data
        (:data:`REFUSED_BEFORE_DATA`). Returns ``send``'s report (its ``bytes``: the payloads
        sent, over both attempts when there were two) with a :class:`DeltaReport`, and the
        seconds since ``tensors`` began. Raises: as ``send``; a MixedWeightsError
        (:func:`still_mixed`) when the whole resend repairing a MIX failed in another way (the
        engines still hold that MIX)."""
        base, self.base = self.base, None
        if self.requantizer is not None:
            self.requantizer.take_stats()  # this round's counts only (not a failed round's before it)
            if self._layout != target.digest:
                self.requantizer.clear()  # another plan: its entries would be quantized whole anyway
                self._layout = target.digest
        t0 = time.perf_counter()
        reason = ("no base (this sender's first round, or its last one failed)" if base is None else
                  "the base has another layout (wire manifest)" if base.target != target.digest else None)
        spare, self.spare = self.spare, None
        spare_round, self.spare_round = self.spare_round, None
        size = delta.padded_size(target.total_bytes)
        log = self.requantizer.written if self.requantizer is not None else None
        enc = PatchEncoder(target, tensors, base, spare if spare is not None and spare.numel() == size else None,
                           look_ahead=True, log=log, stream_round=spare_round)
        attempts, spent = 1, (0.0, 0.0, 0)
        try:
            try:
                enc.begin()  # the source quantizes while the engines answer the accept vote
                report = send(enc, {"delta": enc.info})
            except (delta.DeltaRefused, delta.DeltaMixed) as exc:
                if isinstance(exc, delta.DeltaMixed) and not (bounded and enc.complete):
                    raise
                what = "refused the delta" if isinstance(exc, delta.DeltaRefused) else "hold a MIX after the delta"
                reason, attempts = f"the engines {what}: {exc}", 2
                spent = (enc.source_s, enc.encode_s, enc.wire_bytes)  # the delta's payloads sent before the refusal
                enc = enc.whole()
                enc.begin()
                try:
                    report = send(enc, {"delta": enc.info})
                except Exception as again:  # the engines still hold a MIX left by the delta: say so
                    if isinstance(exc, delta.DeltaMixed) and not isinstance(again, MixedWeightsError):
                        raise still_mixed(exc, again) from again
                    raise
        except REFUSED_BEFORE_DATA:
            enc.close()
            self.base, self.spare = base, enc.stream  # every engine still holds it
            raise
        except BaseException as exc:
            enc.close()  # a bucket pulled ahead finishes before the requantizer is cleared
            if enc.source_error is not None and not isinstance(exc, MixedWeightsError):
                self.base, self.spare = base, enc.stream  # the source failed: aborted, nothing loaded anywhere
            if self.requantizer is not None:
                self.requantizer.clear()  # no state of a failed round is trusted: the next one quantizes whole
            raise
        self.base, self.spare = enc.new_base(), base.stream if base is not None else None
        self.spare_round = base.round_id if base is not None else None
        info = DeltaReport(enc.kind, reason, target.total_bytes, spent[2] + enc.wire_bytes, enc.tiles,
                           spent[0] + enc.source_s, spent[1] + enc.encode_s, self.base.nbytes, attempts,
                           self.requantizer.take_stats() if self.requantizer is not None else {}, enc.copied_whole)
        return TransferReport(report.wire_manifest, info.wire_bytes, report.buckets, report.stream_seconds,
                              time.perf_counter() - t0, info)


def still_mixed(first: delta.DeltaMixed, again: Exception) -> MixedWeightsError:
    """The error of a bounded delta round whose delta left a MIX (``first``) and whose whole
    resend, sent to repair it, failed with ``again`` (not itself a MixedWeightsError): the
    engines still hold that MIX, so a MixedWeightsError naming both (``detail``: the first
    attempt's)."""
    mixed = MixedWeightsError(f"{first}; the whole round sent again to repair that MIX failed: "
                              f"{type(again).__name__}: {again}")
    mixed.detail = getattr(first, "detail", str(first))
    return mixed
