"""The shared secret and the key schedule: one subkey per use, and the MACs built on them.

A round's secret (:class:`Secret`: the sender's ``secret=``, the engine's :data:`ENV_SECRET`)
never keys anything directly. Each use gets its own subkey, derived with HKDF-SHA256
(RFC 5869: extract with a fixed salt, expand with the use's label as ``info``):

* ``round``: the round MAC (:func:`round_mac`) over the round's context
  (:class:`qstrat.transport.security.auth.RoundContext`);
* ``vote``: the tag each rank puts on its accept/commit vote (:func:`vote_tag`);
* ``bucket``: the bucket MAC of an authenticated round (:func:`bucket_mac`), HMAC-SHA256 over
  the payload's NH outputs (:mod:`qstrat.transport.security.nh`) - hash-then-PRF (Black et al.,
  CRYPTO 1999; RFC 4418): a changed bucket keeps its seal only if two NH outputs collide
  (probability <= 2**-64 over the round's NH key) or HMAC-SHA256 is broken;
* ``nh``: the round's NH key (:func:`nh_key`), new every round (it is keyed by the round MAC);
* ``seal``: the integrity seal of rounds without a secret (:func:`bucket_seal`) and its checksum
  seed (:func:`checksum_seed`);
* ``init``: the tag on an ``init_weight_transfer_engine`` request (:func:`init_tag`);
* ``pair``: a mesh round's per-pair MAC (:func:`pair_mac`), which then stands for the round MAC
  in that (sender, receiver) pair's seals: each pair gets its own NH key and bucket MAC;
* ``poly1305``: the host bucket MAC of a round whose payloads are in host memory (a mesh round
  on gloo): a one-time Poly1305 key per bucket (:func:`poly1305_key`) and the HMAC-SHA256 over
  its tag (:func:`host_bucket_mac`).

Without a secret every subkey is derived from the empty key: every value above can then be
computed by anyone (integrity against accidents only, for trusted networks and tests).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence

#: Environment variable holding the shared secret (engine side; the sender's default too).
ENV_SECRET = "QSTRAT_TRANSFER_SECRET"

_SALT = b"qstrat-transport-kdf-v2"
_USES = ("round", "vote", "bucket", "nh", "seal", "init", "pair", "poly1305")


class Secret:
    """A shared secret (>= 16 bytes; text is UTF-8 encoded). ``repr``/``str`` never show it.

    Raises: TypeError for anything but bytes or text; ValueError for a secret shorter than 16
        bytes (the message gives its length only) or undecodable text (the message carries no
        part of it).
    """

    __slots__ = ("_key", "_subkeys")

    def __init__(self, key: bytes | str) -> None:
        if isinstance(key, str):
            try:
                raw = key.encode()
            except UnicodeEncodeError:  # e.g. undecodable bytes in the environment (surrogates)
                raise ValueError(f"transfer secret ({ENV_SECRET}): not valid text; use >= 16 random "
                                 "bytes as hex or base64") from None  # the exception would carry it
        elif isinstance(key, (bytes, bytearray, memoryview)):
            raw = bytes(key)
        else:  # bytes(16) would be 16 zero bytes: a guessable key
            raise TypeError(f"transfer secret: bytes or str expected, got {type(key).__name__}")
        if len(raw) < 16:
            raise ValueError(f"transfer secret too short ({len(raw)} bytes; use >= 16 random bytes)")
        self._key = raw
        self._subkeys = _schedule(raw)

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    __str__ = __repr__

    def __reduce__(self):  # never serialized by accident (pickle, multiprocessing)
        raise TypeError("a transfer Secret is not picklable; give each process its own")

    @classmethod
    def from_env(cls) -> Secret | None:
        """The secret in :data:`ENV_SECRET`, or None when unset/empty."""
        value = os.environ.get(ENV_SECRET, "")
        return cls(value) if value else None

    @staticmethod
    def coerce(value: Secret | bytes | str | None) -> Secret | None:
        """None, a Secret, or raw bytes/text as a Secret."""
        return value if value is None or isinstance(value, Secret) else Secret(value)


def hkdf(key: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF-SHA256 (RFC 5869) of input key ``key`` with this module's salt and ``info``;
    ``length`` <= 8160 bytes."""
    prk = hmac.new(_SALT, key, hashlib.sha256).digest()
    out, block = b"", b""
    for i in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out += block
    return out[:length]


def _schedule(key: bytes) -> dict[str, bytes]:
    return {use: hkdf(key, b"qstrat-" + use.encode()) for use in _USES}


_PUBLIC = _schedule(b"")


def subkey(secret: Secret | None, use: str) -> bytes:
    """The 32-byte subkey of ``use`` (one of ``round``, ``vote``, ``bucket``, ``nh``, ``seal``,
    ``init``) derived from ``secret`` (None: from the empty key)."""
    return (secret._subkeys if secret is not None else _PUBLIC)[use]


def _mac(secret: Secret | None, use: str, message: bytes) -> bytes:
    return hmac.new(subkey(secret, use), message, hashlib.sha256).digest()


def round_mac(secret: Secret | None, message: bytes) -> bytes:
    """HMAC-SHA256 under the ``round`` subkey of a round context's canonical bytes (32 bytes)."""
    return _mac(secret, "round", message)


def vote_tag(secret: Secret | None, mac: bytes, step: int, rank: int, status: int, holds_new: int) -> bytes:
    """The tag rank ``rank`` puts on its vote at ``step`` (0 accept, 1 commit) of the round whose
    MAC is ``mac`` (32 bytes; a forged or moved vote does not verify)."""
    return _mac(secret, "vote", mac + struct.pack("<qqqq", step, rank, status, holds_new))


def init_tag(secret: Secret | None, message: bytes) -> bytes:
    """The tag on an ``init_weight_transfer_engine`` request's canonical bytes (32 bytes)."""
    return _mac(secret, "init", message)


def pair_mac(secret: Secret | None, mac: bytes, sender: int, receiver: int) -> bytes:
    """The MAC of the (``sender``, ``receiver``) group-rank pair of the mesh round whose MAC is
    ``mac``: HMAC-SHA256 under the ``pair`` subkey over the round MAC and both ranks (32 bytes).
    A bucket sealed for one pair does not verify on another."""
    return _mac(secret, "pair", mac + struct.pack("<qq", sender, receiver))


def checksum_seed(secret: Secret | None, mac: bytes) -> int:
    """The round's checksum key seed (63 bits), from the ``seal`` subkey and the round MAC."""
    d = _mac(secret, "seal", b"checksum-seed" + mac)
    return int.from_bytes(d[:8], "little") & (2**63 - 1)


def bucket_seal(secret: Secret | None, mac: bytes, index: int, flags: int,
                checksum: Sequence[int]) -> bytes:
    """The integrity seal: HMAC-SHA256 under the ``seal`` subkey over the round MAC, bucket
    index, flags and checksum ``(h1, h2, n)`` (:mod:`qstrat.transport.security.checksum`)."""
    return _mac(secret, "seal", b"bucket" + mac + struct.pack("<qq3q", index, flags, *checksum))


def nh_key(secret: Secret, mac: bytes) -> bytes:
    """The round's NH key (:data:`qstrat.transport.security.nh.KEY_BYTES` bytes, more than HKDF's 8160):
    SHAKE-256 (FIPS 202, an extendable-output function) of HMAC-SHA256 under the ``nh`` subkey
    over the round MAC. New every round (the MAC binds every receiver's fresh challenge);
    unpredictable without the secret."""
    from qstrat.transport.security.nh import KEY_BYTES

    return hashlib.shake_256(_mac(secret, "nh", mac)).digest(KEY_BYTES)


def bucket_mac(secret: Secret, mac: bytes, index: int, flags: int, nbytes: int, nh_bytes: bytes) -> bytes:
    """The bucket MAC of an authenticated round: HMAC-SHA256 under the ``bucket`` subkey over the
    round MAC, bucket index, flags, payload length (bytes) and the payload's NH outputs
    (:func:`qstrat.transport.security.nh.nh` as :func:`~qstrat.transport.security.nh.to_bytes`). 32 bytes."""
    return _mac(secret, "bucket", mac + struct.pack("<qqq", index, flags, nbytes) + nh_bytes)


def poly1305_key(secret: Secret | None, mac: bytes, index: int) -> bytes:
    """The one-time Poly1305 key (32 bytes: ``r`` and ``s``, RFC 8439 section 2.5) of bucket
    ``index`` of the round (or mesh pair) whose MAC is ``mac``: HMAC-SHA256 under the
    ``poly1305`` subkey over ``b"key"``, ``mac`` and the index. A sender seals each bucket index
    once per round and every round's MAC is new (each receiver's fresh challenge), so no key
    authenticates two messages - Poly1305's one-time condition (D. J. Bernstein, "The
    Poly1305-AES message-authentication code", FSE 2005)."""
    return _mac(secret, "poly1305", b"key" + mac + struct.pack("<q", index))


def host_bucket_mac(secret: Secret | None, mac: bytes, index: int, flags: int, nbytes: int, tag: bytes) -> bytes:
    """The host bucket MAC: HMAC-SHA256 under the ``poly1305`` subkey over ``b"bucket"``, the round
    (or pair) MAC, bucket index, flags, payload length (bytes) and the payload's 16-byte
    Poly1305 tag under :func:`poly1305_key`. A changed payload keeps its seal only with a
    Poly1305 forgery (probability <= 8 * ceil(nbytes / 16) / 2**106 per try, Bernstein 2005)
    or a broken HMAC-SHA256; header fields are bound by the HMAC. 32 bytes."""
    return _mac(secret, "poly1305", b"bucket" + mac + struct.pack("<qqq", index, flags, nbytes) + tag)


def equal(a: bytes, b: bytes) -> bool:
    """Constant-time comparison of two MACs/tags/seals."""
    return hmac.compare_digest(a, b)
