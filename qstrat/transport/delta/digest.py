"""A delta round's per-bucket digests on the sender, brought up to date from the bytes that
changed instead of read again whole.

A bucket's digest is the keyed checksum of its rebuilt bytes
(:func:`~qstrat.transport.delta.encoding.digest_sealer`): ``h = sum_r r[r] * s[r]`` with row sums
``s[r] = sum_j c[j] * W[r, j]`` over the region's int64 words, column keys ``c`` from the
layout's seed (the same every round of a layout and secret) and row keys ``r`` from the round's
(:mod:`qstrat.transport.security.checksum`). The sender keeps the row sums of the bytes it sent
last (:attr:`RegionDigests.rows`, 16 bytes per 32 KiB row); in the next round it knows exactly
which bytes of each region differ from the base - the compare that made the patch
(:func:`~qstrat.transport.delta.encoding.changed_bytes`) - so the new row sums are the old ones
plus ``c[j] * (new word - old word)`` for the changed words alone
(:func:`~qstrat.transport.security.checksum.patch_row_sums`): the value a full read gives, bit for
bit, at a cost that follows the changes instead of the bucket (docs/transport.md, "The sender's
digests from the changed words").

Receivers still read every rebuilt byte (:class:`~qstrat.transport.delta.receive.PatchDecoder`):
that read is the check. A base byte changed in the sender's memory since it was sent is caught
when the new round's byte there differs from it (refused, sent again whole); one changed TO the
new round's byte is not: the compare skips it, the receiver keeps its old byte and the kept sums
match its read (docs/transport.md, "The sender's digests from the changed words").
"""
from __future__ import annotations

import torch

from qstrat.transport.security.checksum import ROW_WORDS, from_row_sums, patch_row_sums, row_sums
from qstrat.transport.security.keys import bucket_seal
from qstrat.transport.security.seal import Sealer

#: One bucket's row sums ``(s1, s2)`` (int64 [rows] each), or None (an empty region).
Sums = tuple[torch.Tensor, torch.Tensor] | None


class RegionDigests:
    """The digests of one round's buckets, in order, on the sender.

    Args:
        sealer: the round's digest sealer (:func:`~qstrat.transport.delta.encoding.digest_sealer`:
            its ``column_seed`` set).
        base_rows: the row sums the base's buckets were sent with (:attr:`rows` of the round
            that made the base) and their column seed; None: every digest reads its region.
    """

    def __init__(self, sealer: Sealer, base_rows: tuple[int, list[Sums]] | None) -> None:
        self.sealer = sealer
        seed = sealer.column_seed
        self._base = base_rows[1] if base_rows is not None and base_rows[0] == seed else None
        #: This round's row sums per bucket so far (:meth:`digest` order).
        self.rows: list[Sums] = []

    def digest(self, k: int, region: torch.Tensor, old: torch.Tensor | None, changed: torch.Tensor | None) -> bytes:
        """Bucket ``k``'s digest (32 bytes; buckets in order): the same bytes as
        :func:`~qstrat.transport.delta.encoding.region_digest` of ``region``.

        Args:
            region: the bucket's bytes this round (1-D uint8 CPU, whole 32 KiB tiles, 8-byte aligned).
            old: the base's bytes of that region (None: no base).
            changed: the sorted positions where ``region`` and ``old`` differ, all of them
                (:func:`~qstrat.transport.delta.encoding.changed_bytes`; None: unknown).
        """
        if k != len(self.rows):
            raise ValueError(f"RegionDigests: bucket {k} asked for after {len(self.rows)} buckets")
        s = self.sealer
        if not region.numel():
            self.rows.append(None)
            return s.seal(k, 0, None)  # the seal of the index alone, as a receiver's
        kept = self._base[k] if self._base is not None and k < len(self._base) else None
        if kept is None or old is None or changed is None or kept[0].numel() * 8 * ROW_WORDS != region.numel():
            sums = row_sums(region, s.column_seed)
        else:
            words = torch.unique_consecutive(changed >> 3)
            new64, old64 = region.view(torch.int64), old.view(torch.int64)
            sums = patch_row_sums(kept, words, new64.index_select(0, words) - old64.index_select(0, words),
                                  s.column_seed)
        self.rows.append(sums)
        return bucket_seal(None, s.mac, k, 0, from_row_sums(sums, s.seed, region.numel()))

    def kept(self) -> tuple[int, list[Sums]]:
        """What a base made from this round keeps: ``(column seed, row sums per bucket)``."""
        return self.sealer.column_seed, list(self.rows)
