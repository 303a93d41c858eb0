"""One transfer round on the group, the steps sender and receivers take in the same order.

1. ROUND HEADER (broadcast, int64[8]): magic, bucket count, payload bytes, the wire manifest digest
   (32 bytes as 4 int64). A receiver whose wire manifest (from the ``update_info`` RPC) has another
   digest rejects the round.
2. ACCEPT (all-reduce, int64[world_size]): each rank writes its status in its own slot
   (receivers: did the wire manifest pass the engine check). Any nonzero slot: every rank stops
   here; no data is sent.
3. BUCKETS, in wire manifest order: per bucket a BUCKET HEADER (broadcast, int64[4]: magic, index,
   CRC-32, flags), then the payload (broadcast, the bucket's bytes). ``flags = ABORT``: the
   sender could not produce the bucket (its source fell short or disagreed with the wire manifest);
   the payload is still sent (garbage of the right size) and every rank goes to step 4.
4. COMMIT VOTE (all-reduce, int64[world_size]): each rank's verdict (receivers: every checksum
   matched). Only if every slot is zero may any receiver hand its tensors to the engine.

Every rank finishes the same sequence of collectives even when it has already failed, so
a refused round leaves the group usable; a lost peer or a timeout raises (the group is then
closed). Step 4 makes the round all-or-nothing across receivers too.
"""
from __future__ import annotations

import torch

from qstrat.errors import TransportError
from qstrat.transport.group import TransferGroup

ROUND_MAGIC = 0x5153_5452_4E44  # "QSTRND"
BUCKET_MAGIC = 0x5153_5442_4B54  # "QSTBKT"
ABORT = 1

#: Status codes a rank writes in its slot of an ACCEPT / COMMIT vote.
OK, REJECTED, CHECKSUM, SENDER_ABORT, ERROR = 0, 1, 2, 3, 4
REASONS = {REJECTED: "rejected the wire manifest", CHECKSUM: "a bucket failed its checksum",
           SENDER_ABORT: "the sender aborted the stream", ERROR: "failed"}


def round_header(n_buckets: int, total_bytes: int, digest: str, device: torch.device) -> torch.Tensor:
    """The int64[8] round header (see the module docstring, step 1)."""
    words = [int.from_bytes(bytes.fromhex(digest)[i:i + 8], "little", signed=True) for i in range(0, 32, 8)]
    return torch.tensor([ROUND_MAGIC, n_buckets, total_bytes, 0, *words], dtype=torch.int64, device=device)


def bucket_header(index: int, crc: int, flags: int, device: torch.device) -> torch.Tensor:
    """The int64[4] bucket header (step 3)."""
    return torch.tensor([BUCKET_MAGIC, index, crc, flags], dtype=torch.int64, device=device)


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
