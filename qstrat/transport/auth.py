"""Authenticated rounds: a shared secret, a per-round MAC, per-bucket seals, replay protection.

Threat (issue 24): vLLM's API key does not guard the weight-transfer routes, so whoever reaches
an engine's port can call ``init_weight_transfer_engine`` (pointing it at a group of their own)
and stream weights with valid checksums. Defence, with a SECRET given to both sides (the
sender's ``secret=`` argument, the engine's environment variable :data:`ENV_SECRET`):

* ROUND MAC: ``HMAC-SHA256(secret, "qstrat-round-v1" | wire manifest digest | mode | round
  counter | every receiver's fresh challenge | group address, port and size)``, carried in the
  round header. Each receiver draws its challenge (16 random bytes, ``os.urandom``) for every
  round, so a header recorded from an earlier round never verifies again (replay), even on a
  restarted engine; the counter (strictly increasing per sender) gives a replay its own error
  while the engine remembers the last one it accepted.
* BUCKET SEAL, with a secret (the bucket MAC): ``HMAC-SHA256(secret, "qstrat-bucket-mac-v1" |
  round MAC | index | flags | n | NH(payload))``, NH being UMAC's universal hash computed with
  tensor ops on the payload's device under a per-round key (:mod:`qstrat.transport.nh`: 16
  bytes per 32 KiB reach the host). Security (hash-then-PRF; Black et al., CRYPTO 1999; RFC
  4418): for a bucket changed in any way by someone without the secret, the seal still matches
  only if the two NH outputs of a changed chunk collide (probability <= 2**-64 over the
  round's NH key) or HMAC-SHA256 is broken; the NH key is derived from the secret and the round
  MAC (:func:`nh_key`), new every round, and never leaves either side.
* BUCKET SEAL, without a secret (integrity only): ``HMAC-SHA256("", "qstrat-bucket-v1" | round
  MAC | index | flags | checksum)``, the checksum being the keyed multilinear device checksum
  (:mod:`qstrat.transport.checksum`): it catches accidents (any single-word change, bit flips),
  not an adversary - its keys are public without a secret, and even with secret keys two words
  changed by 2**63 each cancel (which is why a secret switches the seal to the MAC above).
  In both forms the checksum/NH value never travels: a receiver recomputes it and compares
  seals (``hmac.compare_digest``).
* ADDRESS: an engine configured with :data:`ENV_ADDRESS` refuses, before joining, an init info
  naming another address (or port).

Without a secret on either side the same code runs with an empty key: the seals are then plain
integrity checks anyone can compute (today's behaviour, for trusted networks and tests). A secret
on one side only fails the MAC. The secret is held by :class:`Secret`, whose ``repr``/``str`` hide
it; it is never put in a manifest, a header, a log line or an error message.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

#: Environment variable holding the shared secret (engine side; the sender's default too).
ENV_SECRET = "QSTRAT_TRANSFER_SECRET"
#: Environment variable with the one group address an engine may join: ``host`` or ``host:port``.
ENV_ADDRESS = "QSTRAT_TRANSFER_ADDRESS"

_ROUND, _BUCKET, _SEED = b"qstrat-round-v1\0", b"qstrat-bucket-v1\0", b"qstrat-checksum-seed-v1\0"
_BUCKET_MAC, _NH_KEY = b"qstrat-bucket-mac-v1\0", b"qstrat-nh-key-v1\0"


class Secret:
    """A shared secret (>= 16 bytes; text is UTF-8 encoded). ``repr``/``str`` never show it.

    Raises: ValueError for a secret shorter than 16 bytes (the message gives its length only).
    """

    __slots__ = ("_key",)

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


def _key(secret: Secret | None) -> bytes:
    return secret._key if secret is not None else b""


@dataclass(frozen=True)
class RoundContext:
    """What a round's MAC binds: the wire manifest digest (hex), mode, counter, the receivers'
    challenges (int64 words, rank order) and the group's address, port and world size."""

    digest: str
    mode: str
    counter: int
    challenges: tuple[int, ...]
    address: str
    port: int
    world_size: int

    def message(self) -> bytes:
        """The canonical bytes the MAC is computed over."""
        addr = self.address.encode()
        return b"".join([bytes.fromhex(self.digest), struct.pack("<B", len(self.mode)), self.mode.encode(),
                         struct.pack(f"<q{len(self.challenges)}q", self.counter, *self.challenges),
                         struct.pack("<H", len(addr)), addr, struct.pack("<ii", self.port, self.world_size)])


def round_mac(secret: Secret | None, ctx: RoundContext) -> bytes:
    """HMAC-SHA256 of ``ctx`` (32 bytes)."""
    return hmac.new(_key(secret), _ROUND + ctx.message(), hashlib.sha256).digest()


def checksum_seed(secret: Secret | None, mac: bytes) -> int:
    """The round's checksum key seed (63 bits), derived from the secret and the round MAC."""
    d = hmac.new(_key(secret), _SEED + mac, hashlib.sha256).digest()
    return int.from_bytes(d[:8], "little") & (2**63 - 1)


def bucket_seal(secret: Secret | None, mac: bytes, index: int, flags: int,
                checksum: Sequence[int]) -> bytes:
    """HMAC-SHA256 over the round MAC, bucket index, flags and checksum ``(h1, h2, n)``."""
    body = struct.pack("<qq3q", index, flags, *checksum)
    return hmac.new(_key(secret), _BUCKET + mac + body, hashlib.sha256).digest()


def nh_key(secret: Secret, mac: bytes) -> bytes:
    """The round's NH key (:data:`qstrat.transport.nh.KEY_BYTES` bytes): SHAKE-256 (FIPS 202, an
    extendable-output function) of ``HMAC-SHA256(secret, "qstrat-nh-key-v1" | round MAC)``. New
    every round (the MAC binds the receivers' fresh challenges); unpredictable without the secret.
    """
    from qstrat.transport.nh import KEY_BYTES

    seed = hmac.new(_key(secret), _NH_KEY + mac, hashlib.sha256).digest()
    return hashlib.shake_256(seed).digest(KEY_BYTES)


def bucket_mac(secret: Secret, mac: bytes, index: int, flags: int, nbytes: int, nh_bytes: bytes) -> bytes:
    """The bucket MAC of an authenticated round: HMAC-SHA256 over the round MAC, bucket index,
    flags, payload length (bytes) and the payload's NH outputs (:func:`qstrat.transport.nh.nh`,
    as :func:`~qstrat.transport.nh.to_bytes`). 32 bytes."""
    body = struct.pack("<qqq", index, flags, nbytes)
    return hmac.new(_key(secret), _BUCKET_MAC + mac + body + nh_bytes, hashlib.sha256).digest()


def same(a: bytes, b: bytes) -> bool:
    """Constant-time comparison of two MACs/seals."""
    return hmac.compare_digest(a, b)


def challenge() -> tuple[int, int]:
    """A receiver's fresh challenge: two random int64 words."""
    return struct.unpack("<2q", os.urandom(16))


def words(data: bytes) -> list[int]:
    """32 bytes as 4 little-endian int64 words (for an int64 header)."""
    return list(struct.unpack("<4q", data))


def from_words(values: Sequence[int]) -> bytes:
    """Inverse of :func:`words`."""
    return struct.pack("<4q", *values)


def _host(host: str) -> str:
    """A host as compared: IPv6 literals without brackets, in their canonical form."""
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def split_address(configured: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]``, ``[v6]:port`` or a bare IPv6 literal (``::1``,
    ``fe80::1``) as ``(host, port or None)``.

    Raises: ValueError naming :data:`ENV_ADDRESS` for an empty host or a port that is not an
        integer in 1-65535.
    """
    text = configured.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None
        if rest and port is None:
            host = ""
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:  # a host name, an IPv4 address, or a bare IPv6 literal (two colons or more)
        host, port = text, None
    bad = not host or (port is not None and not (port.isdigit() and 1 <= int(port) <= 65535))
    if bad:
        raise ValueError(f"{ENV_ADDRESS}={configured!r}: expected host, host:port, [ipv6] or [ipv6]:port "
                         "(port 1-65535)")
    return _host(host), None if port is None else int(port)


def check_address(configured: str | None, address: str, port: int) -> None:
    """Refuse an init info naming another group address than ``configured`` (``host`` or
    ``host:port``; None: anything is accepted).

    Raises: TransferAuthError naming both addresses (addresses are not secrets).
    """
    from qstrat.errors import TransferAuthError

    if not configured:
        return
    host, want_port = split_address(configured)
    if _host(address) != host or (want_port is not None and want_port != int(port)):
        raise TransferAuthError(f"init_weight_transfer_engine refused: it points the engine at "
                                f"{address}:{port}, the configured transfer address is {configured} "
                                f"({ENV_ADDRESS})")


@dataclass
class ReceiverAuth:
    """A receiver's side of authentication: its secret (None: unauthenticated rounds), the group
    address and port it joined (from its init info), and the last round counter it accepted."""

    secret: Secret | None
    address: str
    port: int
    last_counter: int = -1

    def verify(self, ctx: RoundContext, mac: bytes) -> str | None:
        """Why the round must be refused (None: accept). Never mentions the secret.

        A counter not above the last accepted one is a replay; otherwise the MAC must verify
        (it binds this receiver's fresh challenge, so an old header cannot)."""
        if ctx.counter <= self.last_counter:
            return (f"round counter {ctx.counter} is not above the last accepted {self.last_counter}: "
                    f"a replayed round")
        if not same(mac, round_mac(self.secret, ctx)):
            held = "a transfer secret" if self.secret is not None else "no transfer secret"
            return (f"the round's MAC does not verify (this engine holds {held}; the sender holds "
                    f"none, another key, or the round was tampered with or replayed)")
        return None
