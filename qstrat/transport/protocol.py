"""One transfer round on the group, the steps sender and receivers take in the same order.

0. CHALLENGE (all-reduce, int64[2 * world_size]): each receiver writes two fresh random words in
   its slots (:func:`qstrat.transport.auth.challenge`); the sender writes zeros.
1. ROUND HEADER (broadcast, int64[12]): magic, bucket count, payload bytes, round counter, the
   wire manifest digest (32 bytes as 4 int64), the round MAC (4 int64: HMAC-SHA256 over digest,
   mode, counter, every challenge and the group address; :mod:`qstrat.transport.auth`). A
   receiver whose wire manifest (from the ``update_info`` RPC) has another digest, whose MAC does
   not verify, or whose counter is not above the last it accepted rejects the round.
2. ACCEPT (all-reduce, int64[world_size]): each rank writes its status in its own slot
   (receivers: did the wire manifest pass the engine check, did the MAC verify). Any nonzero
   slot: every rank stops here; no data is sent.
3. BUCKETS, in wire manifest order: per bucket the payload (broadcasts of the bucket's bytes in
   pieces of at most ``PIECE_BYTES``, :mod:`qstrat.transport.seal`), then a BUCKET HEADER
   (broadcast, int64[7]: magic, index, flags, SEAL: with a secret the bucket MAC over the
   payload's NH hash, without one an integrity HMAC over its device checksum). The header
   follows the payload so that each piece is sealed as it is produced (sender) and as it
   arrives (receivers), overlapping the transfer; a receiver posts bucket k+1 once header k
   told it the stream goes on. ``flags = ABORT``: the sender could not produce the bucket (its
   source fell short or disagreed with the wire manifest); the payload was still sent (garbage
   of the right size) and every rank goes to step 4.
4. COMMIT VOTE (all-reduce, int64[world_size]): each rank's verdict (receivers: every seal
   matched). Only if every slot is zero may any receiver hand its tensors to the engine
   (all-or-nothing mode; in bounded mode the units were handed as they verified).

Every rank finishes the same sequence of collectives even when it has already failed, so
a refused round leaves the group usable; a lost peer or a timeout raises (the group is then
closed). Step 4 makes the round all-or-nothing across receivers too.
"""
from __future__ import annotations

import torch

from qstrat.errors import TransportError
from qstrat.transport.auth import challenge, words
from qstrat.transport.group import TransferGroup

ROUND_MAGIC = 0x5153_5452_4E44  # "QSTRND"
BUCKET_MAGIC = 0x5153_5442_4B54  # "QSTBKT"
ABORT = 1
#: Lengths (int64 words) of the round and bucket headers.
ROUND_WORDS, BUCKET_WORDS = 12, 7

#: Status codes a rank writes in its slot of an ACCEPT / COMMIT vote.
OK, REJECTED, CHECKSUM, SENDER_ABORT, ERROR, UNAUTHENTICATED, MIXED = 0, 1, 2, 3, 4, 5, 6
REASONS = {REJECTED: "rejected the wire manifest", CHECKSUM: "a bucket failed its checksum",
           SENDER_ABORT: "the sender aborted the stream", ERROR: "failed",
           UNAUTHENTICATED: "refused the round's authentication",
           MIXED: "a bucket failed its checksum after loading began (engine holds a mix)"}


def round_header(n_buckets: int, total_bytes: int, counter: int, digest: str, mac: bytes,
                 device: torch.device) -> torch.Tensor:
    """The int64[12] round header (see the module docstring, step 1)."""
    return torch.tensor([ROUND_MAGIC, n_buckets, total_bytes, counter, *words(bytes.fromhex(digest)),
                         *words(mac)], dtype=torch.int64, device=device)


def bucket_header(index: int, flags: int, seal: bytes, device: torch.device) -> torch.Tensor:
    """The int64[7] bucket header (step 3)."""
    return torch.tensor([BUCKET_MAGIC, index, flags, *words(seal)], dtype=torch.int64, device=device)


def challenges(group: TransferGroup) -> tuple[int, ...]:
    """Step 0: every receiver's fresh challenge words, rank order (the sender's slots are 0)."""
    slots = torch.zeros(2 * group.world_size, dtype=torch.int64, device=group.device)
    if group.rank:
        slots[2 * group.rank:2 * group.rank + 2] = torch.tensor(challenge(), dtype=torch.int64)
    return tuple(int(v) for v in group.sum(slots).cpu())


def vote(group: TransferGroup, status: int) -> list[int]:
    """All-reduce every rank's status (steps 2 and 4); returns the status of each rank."""
    slots = torch.zeros(group.world_size, dtype=torch.int64, device=group.device)
    slots[group.rank] = status
    return [int(v) for v in group.sum(slots).cpu()]


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
