"""NH universal hashing with tensor ops: the device half of an authenticated round's bucket MAC.

NH is the first-level hash of UMAC: J. Black, S. Halevi, H. Krawczyk, T. Krovetz, P. Rogaway,
"UMAC: Fast and Secure Message Authentication", CRYPTO 1999 (section 4), specified in RFC 4418
(section 5.2.2, NH; section 5.2.1, L1-HASH and its Toeplitz key shift). For a message of ``2m``
32-bit words ``M[i]`` and a key of 32-bit words ``K[i]``::

    NH_K(M) = sum_{i < m} ((M[2i] + K[2i]) mod 2**32) * ((M[2i+1] + K[2i+1]) mod 2**32)   mod 2**64

For any two DIFFERENT messages of the same length, ``Pr_K[NH_K(M) = NH_K(M')] <= 2**-32`` over
a uniformly random key (NH is 2^-32-almost-universal; the paper's theorem for NH[n, w], w = 32).
Two iterations with the key shifted by 16 bytes (RFC 4418's Toeplitz construction, L1-HASH's
``K[1 + 16 i ..]``) give ``2**-64`` for the pair of outputs (the paper's Toeplitz theorem).

Here a payload of ``n`` bytes, zero-padded to a multiple of :data:`CHUNK_BYTES`, is cut into
chunks of :data:`CHUNK_BYTES` (8192 little-endian uint32 words); each chunk is hashed by both
iterations with the same key (as UMAC's L1 reuses its key for every 1024-byte chunk; lengths
are equal because ``n`` is fixed by the wire manifest and bound into the MAC). The result,
int64[chunks, 2] (16 bytes per 32 KiB of payload: 32 KiB for a 64 MiB bucket), is what the
host then authenticates with HMAC-SHA256 (:func:`qstrat.transport.security.keys.bucket_mac`). Only that
small tensor leaves the payload's device.

Why not UMAC's other layers: its L2/L3 polynomial and inner-product hashes compress NH's output
on the host in UMAC; here HMAC-SHA256 over the few KiB of NH output does that job (a PRF over an
almost-universal hash: the Carter-Wegman / hash-then-PRF composition).

All arithmetic is int64 with wrap-around (two's complement = modulo 2**64), so the value is
exact in any reduction order, on any device: the same code runs on CPU and CUDA (elementwise
add/and/multiply and a sum; no integer matmul).
"""
from __future__ import annotations

import torch

#: Bytes per NH chunk (8192 uint32 words); one pair of 64-bit outputs per chunk.
CHUNK_BYTES = 32768
_WORDS = CHUNK_BYTES // 4
#: Toeplitz shift between the two iterations (uint32 words: 16 bytes, as RFC 4418's L1-HASH).
SHIFT_WORDS = 4
ITERATIONS = 2
#: Key length in bytes: one chunk plus the shift of the second iteration.
KEY_BYTES = CHUNK_BYTES + 4 * SHIFT_WORDS * (ITERATIONS - 1)
#: Chunks hashed per step (bounds the temporaries to 3 MiB).
_CHUNKS_PER_STEP = 32
_LOW32 = 0xFFFFFFFF


def key_from_bytes(raw: bytes, device: torch.device) -> torch.Tensor:
    """The NH key as int32[ITERATIONS, CHUNK_BYTES / 4] on ``device``: row i holds the little-endian
    words of ``raw`` from word ``i * SHIFT_WORDS`` on (the Toeplitz iterations' keys).

    Raises: ValueError unless ``raw`` is exactly :data:`KEY_BYTES` long.
    """
    if len(raw) != KEY_BYTES:
        raise ValueError(f"NH key: {len(raw)} bytes, need {KEY_BYTES}")
    words = torch.frombuffer(bytearray(raw), dtype=torch.int32)
    return torch.stack([words[i * SHIFT_WORDS:i * SHIFT_WORDS + _WORDS] for i in range(ITERATIONS)]).to(device)


def nh(payload: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """NH of every chunk of ``payload`` under both Toeplitz iterations (module docstring).

    Args:
        payload: 1-D contiguous uint8 tensor on any device (its storage offset a multiple of 4,
            else the aligned body is copied once).
        key: int32[ITERATIONS, CHUNK_BYTES / 4] on the payload's device (:func:`key_from_bytes`).
    Returns: int64[chunks, 2] on the payload's device, chunks = ceil(n / CHUNK_BYTES) (at least
        1: an empty payload hashes one zero chunk), column i = iteration i.
    Raises: ValueError for a tensor that is not 1-D contiguous uint8, or a key of another shape.
    """
    if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
        raise ValueError(f"nh: needs a 1-D contiguous uint8 tensor, got {payload.dtype} {list(payload.shape)}")
    if key.dtype != torch.int32 or key.shape != (ITERATIONS, _WORDS):
        raise ValueError(f"nh: key must be int32[{ITERATIONS}, {_WORDS}], got {key.dtype} {list(key.shape)}")
    n = payload.numel()
    full = n // CHUNK_BYTES
    body = payload[:full * CHUNK_BYTES]
    if body.storage_offset() % 4:
        body = body.clone()
    scratch = _Scratch(min(max(full, 1), _CHUNKS_PER_STEP), payload.device)
    parts = []
    if full:
        words = body.view(torch.int32).view(full, _WORDS)
        parts += [_hash(words[i:i + _CHUNKS_PER_STEP], key, scratch) for i in range(0, full, _CHUNKS_PER_STEP)]
    if n > full * CHUNK_BYTES or not full:
        tail = torch.zeros(CHUNK_BYTES, dtype=torch.uint8, device=payload.device)
        tail[:n - full * CHUNK_BYTES] = payload[full * CHUNK_BYTES:]
        parts.append(_hash(tail.view(torch.int32).view(1, _WORDS), key, scratch))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class _Scratch:
    """Temporaries of one :func:`nh` call, reused step to step: int32 sums, int64 halves."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.sums = torch.empty(rows, _WORDS, dtype=torch.int32, device=device)
        self.low = torch.empty(rows, _WORDS // 2, dtype=torch.int64, device=device)
        self.high = torch.empty(rows, _WORDS // 2, dtype=torch.int64, device=device)


def _hash(words: torch.Tensor, key: torch.Tensor, scratch: _Scratch) -> torch.Tensor:
    """int64[rows, ITERATIONS]: NH of each row of int32 ``words`` [rows, _WORDS], both iterations.

    The int32 sum ``M + K`` wraps (mod 2**32 per word); read as int64 words, each holds the pair
    ``(M[2i] + K[2i], M[2i+1] + K[2i+1])`` in its two 32-bit halves, which are masked out as
    unsigned values and multiplied (the product's order does not matter: the same on either
    byte order)."""
    r = words.shape[0]
    out = []
    for i in range(ITERATIONS):
        pairs = torch.add(words, key[i], out=scratch.sums[:r]).view(torch.int64)
        low = torch.bitwise_and(pairs, _LOW32, out=scratch.low[:r])
        high = torch.bitwise_right_shift(pairs, 32, out=scratch.high[:r]).bitwise_and_(_LOW32)
        out.append(low.mul_(high).sum(1))  # products < 2**64, sum mod 2**64
    return torch.stack(out, 1)


class NH:
    """NH of ``n`` bytes fed in consecutive pieces (:meth:`update`): the same outputs as
    :func:`nh` over the whole. Every piece but the last must be a multiple of
    :data:`CHUNK_BYTES`.

    Raises: ValueError (from :meth:`update`) for a piece after a partial chunk or more than
        ``n`` bytes in all; from :meth:`value` before all ``n`` bytes were fed.
    """

    def __init__(self, key: torch.Tensor, n: int) -> None:
        self.key, self.n, self.done = key, n, 0
        self.parts: list[torch.Tensor] = []

    def update(self, piece: torch.Tensor) -> None:
        """Add the next ``piece`` of the payload (1-D contiguous uint8 on the key's device)."""
        if self.done % CHUNK_BYTES or self.done + piece.numel() > self.n:
            raise ValueError(f"nh: piece of {piece.numel()} bytes at {self.done} of {self.n} (pieces "
                             f"before the last must be whole chunks of {CHUNK_BYTES} bytes)")
        if piece.numel() or not self.n:
            self.parts.append(nh(piece, self.key))
        self.done += piece.numel()

    def value(self) -> torch.Tensor:
        """int64[chunks, ITERATIONS], as :func:`nh` of the whole payload."""
        if self.done != self.n or not self.parts:
            raise ValueError(f"nh: {self.done} of {self.n} bytes fed")
        return torch.cat(self.parts) if len(self.parts) > 1 else self.parts[0]


def to_bytes(hashes: torch.Tensor) -> bytes:
    """The NH outputs as little-endian bytes (moved to the host: 16 bytes per chunk)."""
    return hashes.cpu().contiguous().numpy().astype("<i8").tobytes()
