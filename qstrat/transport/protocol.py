"""One transfer round on the group, the steps sender and receivers take in the same order.

0. CHALLENGE (all-reduce, int64[3 * world_size]): each receiver writes, in its slot, two fresh
   random words (:func:`qstrat.transport.security.auth.challenge`) and the last round counter it
   accepted; the sender writes zeros and takes its counter above every reported one
   (:func:`qstrat.transport.security.auth.next_counter`).
1. ROUND HEADER (broadcast, int64[13]): magic, protocol version, bucket count, payload bytes,
   round counter, the wire manifest digest (32 bytes as 4 int64), the round MAC (4 int64:
   :class:`qstrat.transport.security.auth.RoundContext`). A receiver refuses another protocol version,
   another digest than its wire manifest's (from the ``update_info`` RPC), a MAC that does not
   verify, a challenge vector without the words it drew, or a counter not above its last.
2. ACCEPT VOTE (all-reduce, int64[6 * world_size]): each rank writes its status, whether it
   holds new weights (always 0 here) and a 4-word tag (:func:`qstrat.transport.security.keys.vote_tag`)
   in its slot; an OK whose tag does not verify counts as :data:`FORGED`. Any nonzero status:
   every rank stops here; no data is sent. (A delta round's receiver that does not hold the
   round's base votes :data:`STALE_BASE`; the sender then sends the round whole.)
3. BUCKETS, in wire manifest order: per bucket the payload (broadcasts of at most
   ``PIECE_BYTES``, :mod:`qstrat.transport.security.seal`), then a BUCKET HEADER (broadcast, int64[7]:
   magic, index, flags, SEAL). The header follows the payload so that each piece is sealed as it
   is produced (sender) and as it arrives (receivers). ``flags = ABORT``: the sender could not
   produce the bucket (its source raised, fell short or disagreed with the wire manifest); the
   payload was still sent (garbage of the right size) and every rank goes to step 4.
   A DELTA round (protocol 3) sends, per bucket of its target wire manifest, a PRELUDE first
   (broadcast, int64[4]: magic, index, payload bytes, flags) and then that bucket's PATCH as its
   payload (sealed and headed as above; :mod:`qstrat.transport.delta.stream`); an ABORT prelude
   carries no payload and sends every rank to step 4.
4. COMMIT VOTE (like step 2): each rank's verdict and whether it already holds new weights
   (bounded: a unit was loaded; delta: :data:`DELTA` when a rebuilt tensor's digest differs
   from the trainer's, held after a unit in bounded delta). The round's OUTCOME (:func:`outcome`)
   follows from it, the same on every rank: COMMITTED (every status 0), REFUSED (a nonzero
   status, nobody holds anything new), or MIXED (a nonzero status while some rank holds new
   weights: each such rank flags itself; the sender raises MixedWeightsError naming them).

Every rank finishes the same sequence of collectives even when it has already failed, so a
refused round leaves the group usable; a lost peer or a timeout raises (the group is then closed).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qstrat.errors import TransferAuthError, TransportError, WireManifestMismatchError
from qstrat.transport.security.auth import CHALLENGE_WORDS, PROTOCOL_VERSION, challenge, from_words, int64_words
from qstrat.transport.group import TransferGroup
from qstrat.transport.security.keys import Secret, equal, vote_tag

ROUND_MAGIC = 0x5153_5452_4E44  # "QSTRND"
BUCKET_MAGIC = 0x5153_5442_4B54  # "QSTBKT"
PRELUDE_MAGIC = 0x5153_5450_4348  # "QSTPCH"
ABORT = 1
#: Lengths (int64 words) of the round and bucket headers, and of one rank's vote slot.
ROUND_WORDS, BUCKET_WORDS, VOTE_WORDS, PRELUDE_WORDS = 13, 7, 6, 4
#: The two votes (bound into each vote's tag).
ACCEPT, COMMIT = 0, 1

#: Status codes a rank writes in its slot of an ACCEPT / COMMIT vote.
OK, REJECTED, CHECKSUM, SENDER_ABORT, ERROR, UNAUTHENTICATED, MIXED, PROTOCOL, FORGED, STALE_BASE, DELTA = range(11)
REASONS = {REJECTED: "rejected the wire manifest", CHECKSUM: "a bucket failed its checksum",
           SENDER_ABORT: "the sender aborted the stream", ERROR: "failed",
           UNAUTHENTICATED: "refused the round's authentication",
           MIXED: "failed after loading began (holds a mix)",
           PROTOCOL: f"speaks another transport protocol version (this qstrat: {PROTOCOL_VERSION})",
           FORGED: "cast a vote whose tag does not verify (a rewritten all-reduce?)",
           STALE_BASE: "does not hold the delta round's base (restarted engine, missed or other-mode round)",
           DELTA: "did not reconstruct the delta round to the trainer's digests"}
#: Statuses that refuse only a delta round's encoding: the sender then sends the round whole.
DELTA_ONLY = (STALE_BASE, DELTA)
#: The round modes (``update_info["mode"]``, bound into the round MAC): ``delta`` is an atomic
#: round whose buckets travel as patches (:mod:`qstrat.transport.delta.encoding`),
#: ``bounded-delta`` a bounded one.
MODES = ("atomic", "bounded", "delta", "bounded-delta")
#: The modes whose buckets travel as patches, and those that load unit by unit as buckets verify.
DELTA_MODES, BOUNDED_MODES = ("delta", "bounded-delta"), ("bounded", "bounded-delta")


def round_header(n_buckets: int, total_bytes: int, counter: int, digest: str, mac: bytes,
                 device: torch.device, protocol: int = PROTOCOL_VERSION) -> torch.Tensor:
    """The int64[13] round header (see the module docstring, step 1)."""
    return torch.tensor([ROUND_MAGIC, protocol, n_buckets, total_bytes, counter,
                         *int64_words(bytes.fromhex(digest)), *int64_words(mac)],
                        dtype=torch.int64, device=device)


def bucket_header(index: int, flags: int, seal: bytes, device: torch.device) -> torch.Tensor:
    """The int64[7] bucket header (step 3)."""
    return torch.tensor([BUCKET_MAGIC, index, flags, *int64_words(seal)], dtype=torch.int64, device=device)


def patch_prelude(index: int, nbytes: int, flags: int, device: torch.device) -> torch.Tensor:
    """The int64[4] prelude of a delta round's bucket (step 3): magic, index, payload bytes, flags."""
    return torch.tensor([PRELUDE_MAGIC, index, nbytes, flags], dtype=torch.int64, device=device)


def challenges(group: TransferGroup, last_counter: int = -1) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Step 0. Returns (the words this rank drew - empty on the sender -, the whole vector in
    rank order: :data:`~qstrat.transport.security.auth.CHALLENGE_WORDS` per rank)."""
    slots = torch.zeros(CHALLENGE_WORDS * group.world_size, dtype=torch.int64, device=group.device)
    drawn: tuple[int, ...] = ()
    if group.rank:
        drawn = challenge()
        lo = CHALLENGE_WORDS * group.rank
        slots[lo:lo + CHALLENGE_WORDS] = torch.tensor([*drawn, last_counter], dtype=torch.int64)
    return drawn, tuple(int(v) for v in group.sum(slots).cpu())


@dataclass(frozen=True)
class Votes:
    """The result of a vote: each rank's status (a forged slot reads :data:`FORGED`) and
    whether it holds new weights."""

    statuses: list[int]
    holding: list[bool]

    def failed(self) -> bool:
        """Whether any rank's status is not OK."""
        return any(self.statuses)

    def holders(self) -> list[int]:
        """Ranks holding new weights."""
        return [r for r, h in enumerate(self.holding) if h]

    def delta_refused(self) -> bool:
        """Whether the vote failed and every refusal refused only a delta round's encoding
        (:data:`DELTA_ONLY`): the sender sends the same round again, whole."""
        return self.failed() and all(s == OK or s in DELTA_ONLY for s in self.statuses)

    def refusal(self, what: str) -> TransportError:
        """The error of an accept vote that failed, ``what`` naming the round: a
        WireManifestMismatchError when a rank rejected the round, TransferAuthError when one
        could not authenticate it (or a slot was forged), TransportError otherwise."""
        st = self.statuses
        cls = (WireManifestMismatchError if REJECTED in st else
               TransferAuthError if UNAUTHENTICATED in st or FORGED in st else TransportError)
        return cls(f"{what} refused before any data: {describe(st)}")


def vote(group: TransferGroup, step: int, status: int, holds_new: bool, secret: Secret | None,
         mac: bytes) -> Votes:
    """All-reduce every rank's tagged status (steps 2 and 4; ``step`` :data:`ACCEPT` or
    :data:`COMMIT`) and check every slot's tag under the round MAC ``mac``."""
    slots = torch.zeros(VOTE_WORDS * group.world_size, dtype=torch.int64, device=group.device)
    tag = vote_tag(secret, mac, step, group.rank, status, int(holds_new))
    lo = VOTE_WORDS * group.rank
    slots[lo:lo + VOTE_WORDS] = torch.tensor([status, int(holds_new), *int64_words(tag)], dtype=torch.int64)
    got = [int(v) for v in group.sum(slots).cpu()]
    statuses, holding = [], []
    for r in range(group.world_size):
        s, h, *t = got[VOTE_WORDS * r:VOTE_WORDS * (r + 1)]
        ok = h in (0, 1) and 0 <= s < 2**31 and equal(from_words(t), vote_tag(secret, mac, step, r, s, h))
        # an OK must verify; a refusal counts as one even untagged (a rank that does not share
        # the key cannot tag it; a refusal makes nobody load anything)
        statuses.append(s if ok or s != OK else FORGED)
        holding.append(h == 1)
    return Votes(statuses, holding)


def outcome(votes: Votes) -> str:
    """``committed`` (every status 0), ``mixed`` (a nonzero status and a rank holding new
    weights) or ``refused`` (nobody holds anything new)."""
    if not votes.failed():
        return "committed"
    return "mixed" if any(votes.holding) else "refused"


def describe(statuses: list[int]) -> str:
    """``"rank 2 a bucket failed its checksum; rank 0 ..."`` for the nonzero slots."""
    return "; ".join(f"rank {r} {REASONS.get(s, f'status {s}')}" for r, s in enumerate(statuses) if s)


def lost(group: TransferGroup, what: str, error: BaseException | str) -> TransportError:
    """Close ``group`` and turn a c10d error (peer died, timeout) into a TransportError.

    Callers raise it ``from None`` and outside their ``except`` block, holding no Work objects:
    gloo closes its connections (what tells the peers) only when the last reference to the
    group's context - every Work holds one - is gone; ``shutdown()`` alone does not.
    """
    group.close()
    return TransportError(f"rank {group.rank}: {what}: {error} (timeout {group.timeout_s:g} s; the "
                          f"transfer group is closed, call init_weight_transfer_engine again)")
