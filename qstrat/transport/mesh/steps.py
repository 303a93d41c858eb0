"""The steps of a mesh round that every rank takes: S trainer ranks (group ranks ``0..S-1``) send
straight to R engine ranks (``S..S+R-1``), every (sender, receiver) pair at once, point to point.

Once per group, when it forms (:meth:`qstrat.transport.mesh.refit.MeshRefitSender.connect` and the
vLLM backend's ``init_weight_transfer_engine``): OPEN SESSIONS (all-reduce, :func:`open_sessions`):
each engine rank says whether its engine's weight-update session is still open - a trainer rank 0
that died mid-round never called ``finish_weight_update``, and vLLM refuses every
``start_weight_update`` until someone does - so the new rank 0 ends those sessions first.

Each round:

0. LAYOUTS and 1. CHALLENGE, one all-reduce (:func:`opening`): each engine rank writes its
   challenge (as :func:`qstrat.transport.protocol.challenges`; only engine ranks draw) and its
   :class:`~qstrat.transport.mesh.routing.ReceiverLayout` (JSON) in its slots: every rank then
   computes the same :class:`~qstrat.transport.mesh.routing.MeshRoutes`.
2. ROUND HEADER (broadcast from rank 0, :func:`qstrat.transport.protocol.round_header`): the
   routes' digest (outputs, owners, layouts, bucket size) and the round MAC over
   :class:`~qstrat.transport.security.auth.RoundContext`. Every other rank, senders included, checks both
   against its own routes and secret.
3. PAIR HEADERS (point to point, each sender to each engine rank, int64[7]: magic, bucket count,
   payload bytes, the pair's wire manifest digest): an engine rank compares each with the pair
   wire manifest it computed ITSELF from its own layout, so it takes exactly its share.
4. ACCEPT VOTE (:func:`qstrat.transport.protocol.vote` over every rank): any refusal stops every
   rank; no data moves.
5. BUCKETS, every pair at once: each pair's own bucket stream (its wire manifest's buckets: payload
   with tag ``2k+1``, then :func:`~qstrat.transport.protocol.bucket_header` with tag ``2k+2``),
   sealed under the pair's own MAC (:func:`qstrat.transport.security.keys.pair_mac`; on gloo the host
   bucket MAC, :func:`pair_sealer`); ABORT as today.
6. COMMIT VOTE over every rank; the outcome is :func:`qstrat.transport.protocol.outcome`'s.
"""
from __future__ import annotations

import json
from typing import Any

import torch

from qstrat.errors import TransportError
from qstrat.transport import protocol
from qstrat.transport.security.auth import CHALLENGE_WORDS, challenge, from_words, int64_words
from qstrat.transport.group import TransferGroup
from qstrat.transport.security.keys import Secret, pair_mac
from qstrat.transport.mesh.routing import ReceiverLayout
from qstrat.transport.security.seal import Sealer
from qstrat.transport.wire_manifest import WireManifest

#: int64 words of one rank's layout slot (8 KiB of JSON: a rank's expert list included).
LAYOUT_WORDS = 1024
PAIR_MAGIC = 0x5153_5041_4952  # "QSPAIR"
PAIR_WORDS = 7
#: The mode a mesh round binds into its MAC (atomic: engines load only after the commit vote).
MODE = "mesh-atomic"


def opening(group: TransferGroup, senders: int, layout: ReceiverLayout | None, last_counter: int = -1
            ) -> tuple[list[ReceiverLayout], tuple[int, ...], tuple[int, ...]]:
    """Steps 0 and 1 in ONE all-reduce (int64[(CHALLENGE_WORDS + LAYOUT_WORDS) * world]: every
    rank's challenge slot, then every rank's layout slot; one collective less per round).

    Args: layout: this rank's (None on a sender); last_counter: the last round counter this
        engine rank accepted (its challenge slot's third word).
    Returns: (every engine rank's layout in rank order, the challenge words this rank drew -
        empty on a sender -, the whole challenge vector).
    Raises: TransportError for a missing or malformed layout slot (on every rank) or a layout
        over :data:`LAYOUT_WORDS`.
    """
    world, cw = group.world_size, CHALLENGE_WORDS
    slots = torch.zeros((cw + LAYOUT_WORDS) * world, dtype=torch.int64)
    drawn: tuple[int, ...] = ()
    if group.rank >= senders:
        drawn = challenge()
        slots[cw * group.rank:cw * (group.rank + 1)] = torch.tensor([*drawn, last_counter], dtype=torch.int64)
    if layout is not None:
        raw = json.dumps(layout.to_dict(), separators=(",", ":")).encode()
        if len(raw) > 8 * LAYOUT_WORDS - 8:
            raise TransportError(f"rank {group.rank}: layout too large ({len(raw)} bytes)")
        raw = raw + b" " * (-len(raw) % 8)
        lo = cw * world + LAYOUT_WORDS * group.rank
        slots[lo:lo + len(raw) // 8] = torch.frombuffer(bytearray(raw), dtype=torch.int64)
    got = group.sum(slots.to(group.device)).cpu()
    layouts = []
    for r in range(senders, world):
        lo = cw * world + LAYOUT_WORDS * r
        raw = got[lo:lo + LAYOUT_WORDS].numpy().tobytes().rstrip(b"\0")
        try:
            layouts.append(ReceiverLayout.from_dict(json.loads(raw)))
        except (ValueError, TransportError) as exc:
            raise TransportError(f"rank {r} published no usable receiver layout: {exc}") from None
    return layouts, drawn, tuple(int(v) for v in got[:cw * world])


def open_sessions(group: TransferGroup, senders: int, is_open: bool = False) -> list[int]:
    """The group's first step (collective, int64[world]): the engine group ranks whose engine's
    weight-update session is open (``is_open``: this engine rank's; trainer ranks give False).
    Raises: TransportError when the all-reduce fails (the group is closed)."""
    flags = torch.zeros(group.world_size, dtype=torch.int64, device=group.device)
    if is_open and group.rank >= senders:
        flags[group.rank] = 1
    got = collective(group, "open-session exchange failed", group.sum, flags)
    return [r for r in range(senders, group.world_size) if int(got[r])]


def pair_header(wm: WireManifest, device: torch.device) -> torch.Tensor:
    """Step 3's int64[7] header of one pair's wire manifest."""
    return torch.tensor([PAIR_MAGIC, len(wm.buckets), wm.total_bytes, *int64_words(bytes.fromhex(wm.digest))],
                        dtype=torch.int64, device=device)


def pair_sealer(secret: Secret | None, mac: bytes, sender: int, receiver: int, device: torch.device) -> Sealer:
    """The seals of one pair (group ranks ``sender`` -> ``receiver``): today's
    :class:`~qstrat.transport.security.seal.Sealer` keyed by the pair's MAC; on the CPU (gloo) with the
    host bucket MAC (Poly1305 over the payload in place: ~15x less CPU than NH with tensor ops
    there), on a GPU with NH on the device."""
    return Sealer(secret, pair_mac(secret, mac, sender, receiver), device, host_mac=device.type == "cpu")


def header_fields(words: list[int]) -> tuple[int, bytes, str]:
    """(counter, round MAC, digest hex) of a received round header."""
    return words[4], from_words(words[9:13]), from_words(words[5:9]).hex()


def wait(group: TransferGroup, work: Any, what: str) -> None:
    """Wait for one Work; a c10d failure closes the group and raises TransportError."""
    try:
        group.wait(work)
        return
    except RuntimeError as exc:
        error = str(exc)
    del work
    raise protocol.lost(group, what, error) from None


def collective(group: TransferGroup, what: str, fn: Any, *args: Any) -> Any:
    """Run one collective step; a c10d failure closes the group and raises TransportError."""
    try:
        return fn(*args)
    except RuntimeError as exc:
        error = str(exc)
    raise protocol.lost(group, what, error) from None
