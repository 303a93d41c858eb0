"""The bucket seal of one round, computed the same way by the sender and every receiver.

* With a secret: the bucket MAC, ``HMAC-SHA256`` over the payload's NH outputs (UMAC's universal
  hash on the payload's device, per-round key; :mod:`qstrat.transport.security.nh`,
  :func:`qstrat.transport.security.keys.bucket_mac`): a cryptographic MAC.
* Without: the integrity seal over the keyed multilinear checksum
  (:mod:`qstrat.transport.security.checksum`, :func:`qstrat.transport.security.keys.bucket_seal`): accident
  detection only.
* With ``host_mac`` (payloads in host memory, e.g. a mesh round on gloo; with or without a
  secret): the host bucket MAC, HMAC-SHA256 over the payload's Poly1305 tag under a one-time key
  per bucket (:func:`qstrat.transport.security.keys.host_bucket_mac`; Poly1305 from the ``cryptography``
  package, which reads the payload's memory in place). Without a secret its keys derive from the
  empty key: integrity only, as the checksum. Measured here: ~0.09 ms per MiB against ~1.4 ms
  for NH with tensor ops on the CPU (docs/transport.md, "Mesh round").
"""
from __future__ import annotations

import torch

from cryptography.hazmat.primitives.poly1305 import Poly1305

from qstrat.transport.security import nh
from qstrat.transport.security.keys import (Secret, bucket_mac, bucket_seal, checksum_seed, equal, host_bucket_mac, nh_key, poly1305_key)
from qstrat.transport.security.checksum import Checksum


class Sealer:
    """Seals for one round.

    Args:
        secret: the shared secret (None: integrity seals only).
        mac: the round MAC (32 bytes).
        device: where payloads live (the NH key is placed there once per round).
        host_mac: seal with the host bucket MAC (module docstring); ``device`` must be the CPU.
    Raises: ValueError for ``host_mac`` on another device than the CPU.
    """

    def __init__(self, secret: Secret | None, mac: bytes, device: torch.device, host_mac: bool = False) -> None:
        if host_mac and device.type != "cpu":
            raise ValueError(f"host bucket MAC: payloads must be in host memory, not on {device}")
        self.secret, self.mac, self.host_mac = secret, mac, host_mac
        self.seed, self.key_device = checksum_seed(secret, mac), device
        #: The checksum's column keys' own seed (None: from :attr:`seed` as its row keys; a delta
        #: round's digests: :func:`qstrat.transport.delta.encoding.digest_sealer`).
        self.column_seed: int | None = None
        self.key = nh.key_from_bytes(nh_key(secret, mac), device) if secret is not None and not host_mac else None

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
        if sealer.host_mac:
            self.state: Checksum | nh.NH | Poly1305 = Poly1305(poly1305_key(sealer.secret, sealer.mac, index))
            self.fed = 0
        elif sealer.key is None:
            self.state = Checksum(sealer.seed, nbytes, sealer.key_device, sealer.column_seed)
        else:
            self.state = nh.NH(sealer.key, nbytes)

    def update(self, piece: torch.Tensor) -> None:
        """Feed the next piece of the bucket's bytes (see :func:`pieces`)."""
        if isinstance(self.state, Poly1305):
            if self.fed + piece.numel() > self.nbytes:
                raise ValueError(f"host MAC: {self.fed + piece.numel()} bytes fed, the bucket has {self.nbytes}")
            self.state.update(piece.numpy())  # the tensor's memory, read in place
            self.fed += piece.numel()
            return
        self.state.update(piece)

    def seal(self, flags: int) -> bytes:
        """The bucket's seal with header ``flags``, once every byte was fed (32 bytes).
        Raises: ValueError before every byte was fed."""
        s = self.sealer
        if isinstance(self.state, Poly1305):
            if self.fed != self.nbytes:
                raise ValueError(f"host MAC: {self.fed} of {self.nbytes} bytes fed")
            return host_bucket_mac(s.secret, s.mac, self.index, flags, self.nbytes, self.state.finalize())
        if s.key is None:
            return bucket_seal(None, s.mac, self.index, flags, self.state.value())
        return bucket_mac(s.secret, s.mac, self.index, flags, self.nbytes, nh.to_bytes(self.state.value()))

    def verifies(self, flags: int, seal: bytes) -> bool:
        """Whether ``seal`` is this bucket's seal with ``flags`` (constant-time comparison)."""
        return equal(seal, self.seal(flags))
