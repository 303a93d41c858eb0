"""Round authentication: what a round's MAC binds, and a receiver's checks of it.

Threat (issue 24, issue 30): vLLM's API key does not guard the weight-transfer routes, so
whoever reaches an engine's port can call ``init_weight_transfer_engine`` (pointing it at a
group of their own), stream weights with valid checksums, record a round and replay it, or sit
between the ranks and rewrite a collective. Defence, with a SECRET given to both sides (the
sender's ``secret=``, the engine's :data:`~qstrat.transport.security.keys.ENV_SECRET`; the key schedule
is :mod:`qstrat.transport.security.keys`):

* ROUND MAC over :class:`RoundContext`: protocol version, wire manifest digest, mode, round
  counter, the whole challenge vector (every receiver's fresh random words and its last
  accepted counter) and the group's address, port and size. A receiver accepts a round only if
  the MAC verifies AND its own slot of the challenge vector holds the words IT drew for this
  round (:func:`challenge`, ``os.urandom``): a recorded round replayed with the challenge
  all-reduce rewritten to the recorded vector is refused, even by a restarted receiver; then,
  and only then, that the counter is above the last it accepted.
* COUNTER: the sender takes one above the highest counter any receiver reports in the
  challenge step (and above its own last), so it never depends on a wall clock.
* VOTES: each rank tags its accept/commit vote (:func:`~qstrat.transport.security.keys.vote_tag`); a
  vote whose tag does not verify counts as a failure of that rank, so rewriting the vote
  all-reduce cannot make one rank load while another refused.
* BUCKET SEALS (:mod:`qstrat.transport.security.seal`): with a secret the bucket MAC, without one an
  integrity seal (accidents only).
* INIT: with a secret an engine joins only an init info carrying a valid tag
  (:func:`init_message`), and leaves its live group only once the new one is joined.
* ADDRESS (:mod:`qstrat.transport.security.address`).

The secret never appears in a manifest, header, log line or error message.
"""
from __future__ import annotations

import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qstrat.transport.security.keys import Secret, equal, init_tag, round_mac

#: The transport protocol this qstrat speaks (round header word 1 and ``update_info["protocol"]``).
#: From version 2 on, the handshake's collectives (challenge all-reduce, round header, accept
#: vote) keep their sizes, so a later version's mismatch is refused in the accept vote. Version 3:
#: a delta round streams one patch per target bucket (:mod:`qstrat.transport.delta.stream`;
#: version 2 sent it as two blobs after encoding the whole round).
PROTOCOL_VERSION = 3
#: int64 words each rank writes into the challenge all-reduce: two random words, last counter.
CHALLENGE_WORDS = 3


@dataclass(frozen=True)
class RoundContext:
    """What a round's MAC binds: the wire manifest digest (hex), mode, counter, the challenge
    vector (int64 words, :data:`CHALLENGE_WORDS` per rank, rank order), the group's address,
    port and world size, and the protocol version."""

    digest: str
    mode: str
    counter: int
    challenges: tuple[int, ...]
    address: str
    port: int
    world_size: int
    protocol: int = PROTOCOL_VERSION

    def message(self) -> bytes:
        """The canonical bytes the MAC is computed over."""
        addr = self.address.encode()
        return b"".join([struct.pack("<q", self.protocol), bytes.fromhex(self.digest),
                         struct.pack("<B", len(self.mode)), self.mode.encode(),
                         struct.pack(f"<qq{len(self.challenges)}q", self.counter, len(self.challenges),
                                     *self.challenges),
                         struct.pack("<H", len(addr)), addr, struct.pack("<ii", self.port, self.world_size)])

    def mac(self, secret: Secret | None) -> bytes:
        """The round MAC (32 bytes; :func:`qstrat.transport.security.keys.round_mac`)."""
        return round_mac(secret, self.message())


def challenge() -> tuple[int, int]:
    """A receiver's fresh challenge: two random int64 words."""
    return struct.unpack("<2q", os.urandom(16))


def next_counter(own_last: int, challenges: Sequence[int]) -> int:
    """The sender's round counter: above its own last and above every counter a receiver
    reported in the challenge vector (word 2 of each rank's slot).
    Raises: OverflowError when a reported counter leaves no int64 above it."""
    reported = max((challenges[i + 2] for i in range(0, len(challenges), CHALLENGE_WORDS)), default=-1)
    counter = max(own_last, reported) + 1
    if counter >= 2**63:
        raise OverflowError("a receiver reported a round counter at the int64 limit")
    return counter


def int64_words(data: bytes) -> list[int]:
    """32 bytes as 4 little-endian int64 words (for an int64 header)."""
    return list(struct.unpack("<4q", data))


def from_words(values: Sequence[int]) -> bytes:
    """Inverse of :func:`int64_words`."""
    return struct.pack("<4q", *values)


def init_message(init_info: Mapping[str, Any]) -> bytes:
    """The canonical bytes of an init info's group fields, which its ``auth`` tag covers."""
    keys = ("master_address", "master_port", "rank_offset", "world_size", "backend", "timeout_s")
    # a mesh group's trainer ranks (unchanged bytes without: a parsed init info carries senders=None)
    keys += ("senders",) if init_info.get("senders") is not None else ()
    return repr(tuple(str(init_info.get(k)) for k in keys)).encode()


def sign_init(secret: Secret | None, init_info: dict[str, Any]) -> dict[str, Any]:
    """``init_info`` with its ``auth`` tag (hex) added (unchanged without a secret)."""
    if secret is None:
        return init_info
    return {**init_info, "auth": init_tag(secret, init_message(init_info)).hex()}


#: How a receiver's refusal of an unauthenticated init begins: the sender recognises it in an
#: engine's error text (over HTTP the exception class does not travel) as a TransferAuthError.
INIT_REFUSED = "init_weight_transfer_engine refused: no valid authentication tag"


def check_init(secret: Secret | None, init_info: Mapping[str, Any]) -> str | None:
    """Why an init info must be refused by a receiver holding ``secret`` (None: accept)."""
    if secret is None:
        return None
    tag = init_info.get("auth")
    try:
        ok = isinstance(tag, str) and equal(bytes.fromhex(tag), init_tag(secret, init_message(init_info)))
    except ValueError:
        ok = False
    if not ok:
        return (f"{INIT_REFUSED} (this engine holds a transfer secret; the caller holds none or another "
                "key: give the trainer the engine's secret, QSTRAT_TRANSFER_SECRET or RefitSender(secret=...)); "
                "the live group is kept")
    return None


@dataclass
class ReceiverAuth:
    """A receiver's side of authentication: its secret (None: unauthenticated rounds), the group
    address and port it joined (from its init info), and the last round counter it accepted."""

    secret: Secret | None
    address: str
    port: int
    last_counter: int = -1

    def verify(self, ctx: RoundContext, mac: bytes, rank: int, drawn: Sequence[int]) -> str | None:
        """Why the round must be refused by rank ``rank``, which drew ``drawn`` (None: accept).
        Never mentions the secret; says nothing of the counter unless the MAC verified."""
        if not equal(mac, ctx.mac(self.secret)):
            held = "a transfer secret" if self.secret is not None else "no transfer secret"
            return (f"the round's MAC does not verify (this engine holds {held}; the sender holds "
                    f"none, another key, or the round was tampered with)")
        mine = tuple(ctx.challenges[CHALLENGE_WORDS * rank:CHALLENGE_WORDS * rank + 2])
        if mine != tuple(drawn):
            return ("the round does not carry the challenge this receiver drew (a replayed round, or "
                    "the challenge all-reduce was rewritten)")
        if ctx.counter <= self.last_counter:
            return (f"round counter {ctx.counter} is not above the last accepted {self.last_counter}: "
                    f"a replayed round")
        return None
