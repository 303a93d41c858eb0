"""The bucket seal of one round, computed the same way by the sender and every receiver.

* With a secret: the bucket MAC, ``HMAC-SHA256`` over the payload's NH outputs (UMAC's universal
  hash on the payload's device, per-round key; :mod:`qstrat.transport.nh`,
  :func:`qstrat.transport.keys.bucket_mac`): a cryptographic MAC.
* Without: the integrity seal over the keyed multilinear checksum
  (:mod:`qstrat.transport.checksum`, :func:`qstrat.transport.keys.bucket_seal`): accident
  detection only.
"""
from __future__ import annotations

import torch

from qstrat.transport import nh
from qstrat.transport.keys import Secret, bucket_mac, bucket_seal, checksum_seed, equal, nh_key
from qstrat.transport.checksum import Checksum


class Sealer:
    """Seals for one round.

    Args:
        secret: the shared secret (None: integrity seals only).
        mac: the round MAC (32 bytes).
        device: where payloads live (the NH key is placed there once per round).
    """

    def __init__(self, secret: Secret | None, mac: bytes, device: torch.device) -> None:
        self.secret, self.mac = secret, mac
        self.seed, self.key_device = checksum_seed(secret, mac), device
        self.key = nh.key_from_bytes(nh_key(secret, mac), device) if secret is not None else None

    def begin(self, index: int, nbytes: int) -> SealState:
        """Start the seal of bucket ``index`` of ``nbytes`` bytes, fed in pieces as they are
        produced or arrive (:class:`SealState`; the pieces of :func:`pieces`)."""
        return SealState(self, index, nbytes)

    def seal(self, index: int, flags: int, payload: torch.Tensor | None) -> bytes:
        """The seal of bucket ``index`` (32 bytes); ``payload`` None for an aborted bucket (its
        bytes are garbage: the seal then covers the index and flags only).

        Args: payload: the bucket's bytes, 1-D contiguous uint8 on the device given at init.
        """
        if payload is None:
            return bucket_seal(self.secret, self.mac, index, flags, (0, 0, 0))
        state = self.begin(index, payload.numel())
        state.update(payload)
        return state.seal(flags)

    def verifies(self, index: int, flags: int, payload: torch.Tensor, seal: bytes) -> bool:
        """Whether ``seal`` is the seal of ``payload`` (constant-time comparison)."""
        return equal(seal, self.seal(index, flags, payload))


#: Bytes per broadcast of a bucket's payload (a multiple of both the checksum's rows and NH's
#: chunks): a bucket larger than this is sent in pieces, each sealed as it is produced (sender)
#: or as it arrives (receivers), so a large bucket's seal overlaps its own transfer.
PIECE_BYTES = 4 << 20


def pieces(payload: torch.Tensor) -> list[torch.Tensor]:
    """``payload`` cut into consecutive views of at most :data:`PIECE_BYTES` (one, possibly
    empty, for an empty payload)."""
    n = payload.numel()
    return [payload[i:i + PIECE_BYTES] for i in range(0, n, PIECE_BYTES)] or [payload]


class SealState:
    """One bucket's seal being computed piece by piece (from :meth:`Sealer.begin`)."""

    def __init__(self, sealer: Sealer, index: int, nbytes: int) -> None:
        self.sealer, self.index, self.nbytes = sealer, index, nbytes
        if sealer.key is None:
            self.state: Checksum | nh.NH = Checksum(sealer.seed, nbytes, sealer.key_device)
        else:
            self.state = nh.NH(sealer.key, nbytes)

    def update(self, piece: torch.Tensor) -> None:
        """Feed the next piece of the bucket's bytes (see :func:`pieces`)."""
        self.state.update(piece)

    def seal(self, flags: int) -> bytes:
        """The bucket's seal with header ``flags``, once every byte was fed (32 bytes).
        Raises: ValueError before every byte was fed."""
        s = self.sealer
        if s.key is None:
            return bucket_seal(None, s.mac, self.index, flags, self.state.value())
        return bucket_mac(s.secret, s.mac, self.index, flags, self.nbytes, nh.to_bytes(self.state.value()))

    def verifies(self, flags: int, seal: bytes) -> bool:
        """Whether ``seal`` is this bucket's seal with ``flags`` (constant-time comparison)."""
        return equal(seal, self.seal(flags))
