"""The bucket seal of one round, computed the same way by the sender and every receiver.

* With a secret: the bucket MAC, ``HMAC-SHA256`` over the payload's NH outputs (UMAC's universal
  hash on the payload's device, per-round key; :mod:`qstrat.transport.nh`,
  :func:`qstrat.transport.auth.bucket_mac`): a cryptographic MAC.
* Without: the integrity seal over the keyed multilinear checksum
  (:mod:`qstrat.transport.checksum`, :func:`qstrat.transport.auth.bucket_seal`): accident
  detection only.
"""
from __future__ import annotations

import torch

from qstrat.transport import nh
from qstrat.transport.auth import Secret, bucket_mac, bucket_seal, checksum_seed, nh_key, same
from qstrat.transport.checksum import checksum


class Sealer:
    """Seals for one round.

    Args:
        secret: the shared secret (None: integrity seals only).
        mac: the round MAC (32 bytes).
        device: where payloads live (the NH key is placed there once per round).
    """

    def __init__(self, secret: Secret | None, mac: bytes, device: torch.device) -> None:
        self.secret, self.mac = secret, mac
        self.seed = checksum_seed(secret, mac)
        self.key = nh.key_from_bytes(nh_key(secret, mac), device) if secret is not None else None

    def seal(self, index: int, flags: int, payload: torch.Tensor | None) -> bytes:
        """The seal of bucket ``index`` (32 bytes); ``payload`` None for an aborted bucket (its
        bytes are garbage: the seal then covers the index and flags only).

        Args: payload: the bucket's bytes, 1-D contiguous uint8 on the device given at init.
        """
        if payload is None:
            return bucket_seal(self.secret, self.mac, index, flags, (0, 0, 0))
        if self.key is None:
            return bucket_seal(None, self.mac, index, flags, checksum(payload, self.seed))
        return bucket_mac(self.secret, self.mac, index, flags, payload.numel(),
                          nh.to_bytes(nh.nh(payload, self.key)))

    def ok(self, index: int, flags: int, payload: torch.Tensor, seal: bytes) -> bool:
        """Whether ``seal`` is the seal of ``payload`` (constant-time comparison)."""
        return same(seal, self.seal(index, flags, payload))
