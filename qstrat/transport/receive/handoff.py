"""Bounded rounds on a receiver: the reload units handed to the loader as their bytes verify, and
the MIX that a round cut off after the first hand leaves.

A BOUNDED DELTA round (``mode="bounded-delta"``, docs/transport.md "Delta in bounded mode") hands
units from the rebuilt stream (:class:`StreamUnits`): once bucket ``k``'s rebuilt bytes match the
trainer's digest, every unit whose last byte lies below ``cuts[k + 1]``
(:func:`qstrat.transport.delta.encoding.cuts`) - a tile straddling two buckets completes with the
later one. A bounded full round hands units from its staged buckets
(:func:`qstrat.transport.receive.receiver.receive_round`).
"""
from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from qstrat.errors import MixedWeightsError
from qstrat.transport import protocol
from qstrat.transport.buckets import slot_tensor
from qstrat.transport.group import TransferGroup
from qstrat.transport.wire_manifest import WireManifest, reload_unit

Unit = list[tuple[str, torch.Tensor]]


def few(names: list[str]) -> str:
    """``"a, b, c, ... +4"``: the first three of ``names`` and how many more."""
    return ", ".join(names[:3]) + (f", ... +{len(names) - 3}" if len(names) > 3 else "")


def cut_off(group: TransferGroup, what: str, error: BaseException | str, handed: list[str], units: int
            ) -> MixedWeightsError:
    """Close ``group`` (the stream was lost after ``handed`` of ``units`` reload units were
    loaded) and return the MixedWeightsError this receiver raises: it holds a MIX. Raise it
    ``from None`` holding no Work objects (:func:`qstrat.transport.protocol.lost`)."""
    group.close()
    return MixedWeightsError(
        f"rank {group.rank}: {what}: {error} (the transfer group is closed); loading had begun: {len(handed)} of "
        f"{units} reload units are new ({few(handed)}), the rest old - this receiver holds a MIX; the next "
        f"refit must be whole")


class StreamUnits:
    """A bounded delta round's reload units, handed as views of the rebuilt stream.

    Args: target: the round's wire manifest; cuts: where each bucket's patch begins and ends in
        the stream (:func:`~qstrat.transport.delta.encoding.cuts`, ``len(target.buckets) + 1``
        byte offsets); on_unit: called ``on_unit(unit, tensors)`` with each unit's
        ``(name, tensor)`` pairs (views of the stream: the loader copies them), in wire order.
    """

    def __init__(self, target: WireManifest, cuts: list[int], on_unit: Callable[[str, Unit], None]) -> None:
        self.on_unit = on_unit
        self._buckets = target.buckets
        slots: dict[str, list] = {}
        end: dict[str, int] = {}
        for s in target.slots:
            u = reload_unit(s.name)
            slots.setdefault(u, []).append(s)
            end[u] = max(end.get(u, 0), target.buckets[s.bucket].stream_offset + s.offset + s.nbytes)
        #: Per bucket, the units whose last byte lies below its patch's end (wire order).
        self.completes: dict[int, list[str]] = {}
        for u in slots:  # dict order: wire order of each unit's first tensor
            k = bisect.bisect_left(cuts, end[u], 1) - 1  # the first k with end <= cuts[k + 1]
            self.completes.setdefault(k, []).append(u)
        self._slots = slots
        #: The units handed so far (a load that raised counts: it may have changed the unit).
        self.handed: list[str] = []
        #: How many units the round has.
        self.units = len(slots)

    def hand(self, k: int, stream: torch.Tensor, rank: int) -> tuple[int, str] | None:
        """After bucket ``k``'s digest verified: hand the units it completes, views of
        ``stream`` (1-D uint8, the rebuilt stream). Returns None, or the failure
        ``(status ERROR, message)`` when a load raised (the units handed before it stay)."""
        for u in self.completes.get(k, []):
            # each tensor as a staged bucket's view would give it (its bucket's slice of the stream)
            tensors = [(s.name, slot_tensor(s, stream[b.stream_offset:b.stream_offset + b.nbytes]))
                       for s in self._slots[u] for b in (self._buckets[s.bucket],)]
            self.handed.append(u)
            try:
                self.on_unit(u, tensors)
            except Exception as exc:  # noqa: BLE001 - the engine's load failed: a mix
                return protocol.ERROR, f"rank {rank}: loading {u} failed: {type(exc).__name__}: {exc}"
        return None
