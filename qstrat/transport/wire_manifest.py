"""The wire manifest: every tensor's place on the wire, fixed before any data flows.

A :class:`WireManifest` is computed from the refit plan's outputs (in wire order) by
:func:`build_wire_manifest`. It lays the tensors out in a byte stream cut into BUCKETS of at most
``bucket_bytes`` each:

* each tensor starts at an offset aligned to ``alignment`` bytes inside its bucket (so a
  receiver can view the received bytes as the tensor's dtype without copying);
* a tensor smaller than a bucket lies wholly inside one bucket (several small tensors of mixed
  dtypes share a bucket); a tensor larger than a bucket gets buckets of its own, ``chunks`` of
  them, each ``bucket_bytes`` long except the last (a receiver receives them straight into the
  tensor's own storage);
* the DIGEST is the SHA-256 of the canonical JSON of everything else: sender and receivers
  compare it before the first data bucket.

The wire manifest travels as plain JSON-able data (:meth:`WireManifest.to_dict`) in the weight-transfer
``update_info`` RPC, the way vLLM's NCCL backend sends names, dtypes and shapes.
"""
from __future__ import annotations

import hashlib
import json
import math
import numbers
import pickle
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from qstrat.errors import TransportError, WireManifestMismatchError

#: Wire manifest format version (part of the digest).
VERSION = 1
#: Default bucket size (bytes): 64 MiB.
DEFAULT_BUCKET_BYTES = 64 << 20
#: Default in-bucket alignment (bytes): a cache line, a multiple of every dtype's element size.
DEFAULT_ALIGNMENT = 64
#: The wire manifests this process last rebuilt from received documents, with a private copy of
#: each document, by digest (:meth:`WireManifest.received`): a delta round's blobs and its target
#: make two per round.
_RECEIVED: dict[str, tuple[WireManifest, Any]] = {}
_RECEIVED_KEPT = 4


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lies on the wire.

    Attributes:
        name: checkpoint name. dtype: torch dtype name (``float8_e4m3fn``). shape: as sent.
        nbytes: ``numel * element_size``.
        bucket: index of its (first) bucket. offset: byte offset inside that bucket (a multiple
            of the wire manifest's alignment; 0 for a chunked tensor).
        chunks: number of buckets it spans (1: shares a bucket; >1: its own consecutive buckets).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    bucket: int
    offset: int
    chunks: int = 1

    def check(self, name: str | None, tensor: Any) -> None:
        """Raise TransportError unless ``(name, tensor)`` is this slot's tensor: the same name,
        torch dtype and shape (the byte count alone is not enough: a float16 tensor in a
        bfloat16 slot, or a transposed one, has the right size and the wrong values)."""
        got = (name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)) if tensor is not None else None
        if got != (self.name, self.dtype, tuple(self.shape)):
            seen = f"{name!r} {tensor.dtype} {list(tensor.shape)}" if tensor is not None else "nothing"
            raise TransportError(f"the source yielded {seen} where the wire manifest has {self.name!r} "
                                 f"{self.dtype} {list(self.shape)}")


@dataclass(frozen=True)
class Bucket:
    """One broadcast on the wire: ``nbytes`` payload bytes starting at ``stream_offset`` of the
    stream (``tensor`` names the tensor when the bucket is one chunk of a large tensor)."""

    index: int
    stream_offset: int
    nbytes: int
    tensor: str | None = None


@dataclass(frozen=True)
class WireManifest:
    """Names, dtypes, shapes, byte offsets, bucket boundaries and wire order of one round.

    ``slots`` are in wire order; ``buckets`` in send order. Build with :func:`build_wire_manifest`;
    rebuild a received one with :meth:`from_dict` (which checks its digest and layout).
    """

    slots: tuple[TensorSlot, ...]
    buckets: tuple[Bucket, ...]
    bucket_bytes: int
    alignment: int
    digest: str

    @property
    def total_bytes(self) -> int:
        """Payload bytes on the wire (alignment padding included)."""
        return sum(b.nbytes for b in self.buckets)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (for the ``update_info`` RPC)."""
        return {"version": VERSION, **_body(self.slots, self.buckets, self.bucket_bytes,
                                            self.alignment), "digest": self.digest}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> WireManifest:
        """Rebuild a wire manifest sent as :meth:`to_dict`.

        Raises: WireManifestMismatchError for another wire manifest version, a malformed entry, a digest
            that does not match the content, or an inconsistent layout (see :meth:`check_layout`).
        """
        try:
            version = doc["version"]
        except (KeyError, TypeError) as exc:
            raise WireManifestMismatchError(f"malformed wire manifest: {exc!r}") from exc
        if version != VERSION:  # outside the try: QstratError is a ValueError, it would be wrapped
            raise WireManifestMismatchError(f"wire manifest version {version!r}, this qstrat reads "
                                            f"version {VERSION}")
        try:
            slots = tuple(TensorSlot(s["name"], s["dtype"], tuple(int(d) for d in s["shape"]),
                                     int(s["nbytes"]), int(s["bucket"]), int(s["offset"]),
                                     int(s["chunks"])) for s in doc["slots"])
            buckets = tuple(Bucket(int(b["index"]), int(b["stream_offset"]), int(b["nbytes"]),
                                   b["tensor"]) for b in doc["buckets"])
            bucket_bytes, alignment, digest = int(doc["bucket_bytes"]), int(doc["alignment"]), doc["digest"]
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise WireManifestMismatchError(f"malformed wire manifest: {exc!r}") from exc
        bad = _malformed(slots, buckets, bucket_bytes, alignment)
        if bad:  # before anything else reads a field: a wrong type must be this error, not a crash
            raise WireManifestMismatchError(f"malformed wire manifest: {bad}")
        want = _digest(slots, buckets, bucket_bytes, alignment)
        if digest != want:
            raise WireManifestMismatchError(f"wire manifest digest {digest} does not match its content "
                                        f"({want}): corrupted or edited in transit")
        wire_manifest = cls(slots, buckets, bucket_bytes, alignment, digest)
        wire_manifest.check_layout()
        return wire_manifest

    @classmethod
    def received(cls, doc: Any) -> WireManifest:
        """:meth:`from_dict` of a receiver's ``update_info`` document, or the wire manifest this
        process rebuilt from an EQUAL document recently (the last 4, by digest): a warm refit sends
        the same document every round, and rebuilding and digesting DeepSeek-V3's 90k slots costs
        about as much as a plan, each round, on every engine; comparing it with a kept private copy
        is a C-level dict comparison. A document that differs in anything is rebuilt (and refused
        as :meth:`from_dict` refuses it), so the result is always :meth:`from_dict`'s.

        Raises: as :meth:`from_dict` for anything it rebuilds.
        """
        digest = doc.get("digest") if isinstance(doc, Mapping) else None
        kept = _RECEIVED.get(digest) if isinstance(digest, str) else None
        if kept is not None and doc == kept[1]:
            return kept[0]
        built = cls.from_dict(doc)
        try:
            _RECEIVED[built.digest] = (built, pickle.loads(pickle.dumps(doc)))  # a copy no caller can edit
        except (pickle.PicklingError, TypeError, AttributeError):  # a mapping pickle cannot copy: not kept
            return built
        while len(_RECEIVED) > _RECEIVED_KEPT:  # the oldest first (dicts keep insertion order)
            del _RECEIVED[next(iter(_RECEIVED))]
        return built

    def check_layout(self) -> None:
        """Raise WireManifestMismatchError unless the layout is one :func:`build_wire_manifest` makes:
        known dtypes, ``nbytes == numel * element_size``, aligned non-overlapping slots inside
        their buckets, buckets contiguous in the stream and at most ``bucket_bytes`` long."""
        offset = 0
        for i, b in enumerate(self.buckets):
            if b.index != i or b.stream_offset != offset or not 0 < b.nbytes <= self.bucket_bytes:
                raise WireManifestMismatchError(f"bucket {i}: bad boundaries {b}")
            offset += b.nbytes
        ends: dict[int, int] = {}
        for s in self.slots:
            esize = _element_size(s.dtype, s.name)
            if s.nbytes != math.prod(s.shape) * esize:
                raise WireManifestMismatchError(f"{s.name}: nbytes {s.nbytes} != numel x {esize} for "
                                            f"shape {list(s.shape)}")
            if s.offset % self.alignment or not 0 <= s.bucket < len(self.buckets) or (
                    s.bucket + s.chunks > len(self.buckets)):
                raise WireManifestMismatchError(f"{s.name}: bad place (bucket {s.bucket}, offset {s.offset})")
            span = sum(self.buckets[s.bucket + c].nbytes for c in range(s.chunks))
            if s.chunks > 1 and (s.offset or span != s.nbytes):
                raise WireManifestMismatchError(f"{s.name}: chunked tensor does not fill its buckets")
            if s.chunks == 1 and (s.offset < ends.get(s.bucket, 0) or
                                  s.offset + s.nbytes > self.buckets[s.bucket].nbytes):
                raise WireManifestMismatchError(f"{s.name}: overlaps another tensor or its bucket's end")
            ends[s.bucket] = s.offset + s.nbytes
        names = [s.name for s in self.slots]
        if len(set(names)) != len(names):
            raise WireManifestMismatchError("duplicate tensor names in the wire manifest")
        chunked_tensor_of = {s.bucket + c: s.name for s in self.slots if s.chunks > 1 for c in range(s.chunks)}
        for b in self.buckets:
            if b.tensor != chunked_tensor_of.get(b.index) or (b.tensor is None and b.index not in ends):
                raise WireManifestMismatchError(f"bucket {b.index}: holds {b.tensor!r}, the slots say "
                                            f"{chunked_tensor_of.get(b.index)!r}")


def is_integer(v: object) -> bool:
    """Whether ``v`` is an integer size (a Python or NumPy integer), not a bool: what
    :func:`build_wire_manifest` and the delta bucket floor (:mod:`qstrat.transport.delta.rounds`)
    take as a byte count."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def build_wire_manifest(tensors: Iterable[tuple[str, str, tuple[int, ...]]],
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   alignment: int = DEFAULT_ALIGNMENT, unit_of: Callable[[str], str] | None = None) -> WireManifest:
    """Lay ``tensors`` out in buckets, in the order given (the plan's wire order).

    Args:
        tensors: ``(name, dtype name, shape)`` triples, e.g. from ``plan.outputs()``
            (:func:`wire_manifest_for_plan`).
        bucket_bytes: bucket bound in bytes; a multiple of ``alignment``.
        alignment: in-bucket offset alignment in bytes; a power of two >= 16 (the largest
            element size, complex128).
        unit_of: name -> its unit (e.g. :func:`reload_unit`); given, a shared bucket never holds
            tensors of two units (the open bucket is closed where the unit changes), so a
            receiver loading unit by unit frees each bucket with its unit. None: buckets fill up.
    Returns: the :class:`WireManifest` (digest included).
    Raises: WireManifestMismatchError for a bad bucket size or alignment, an unknown dtype, a
        duplicate name.
    """
    if not is_integer(alignment) or not is_integer(bucket_bytes):
        raise WireManifestMismatchError(f"bucket_bytes {bucket_bytes!r} / alignment {alignment!r}: give integers "
                                        f"(bytes; not {type(bucket_bytes).__name__} / {type(alignment).__name__})")
    bucket_bytes, alignment = int(bucket_bytes), int(alignment)  # NumPy integers: plain ints in the document
    if alignment < 16 or alignment & (alignment - 1):
        raise WireManifestMismatchError(f"alignment {alignment}: must be a power of two >= 16")
    if bucket_bytes <= 0 or bucket_bytes % alignment:
        raise WireManifestMismatchError(f"bucket_bytes {bucket_bytes}: must be a positive multiple "
                                    f"of the alignment ({alignment})")
    slots: list[TensorSlot] = []
    buckets: list[Bucket] = []
    used = 0  # bytes used in the open (last) shared bucket; 0: none open
    unit = None  # the unit of the open bucket's tensors (with ``unit_of``)

    def close() -> None:
        nonlocal used
        if used:
            buckets[-1] = Bucket(buckets[-1].index, buckets[-1].stream_offset, _round_up(used, alignment))
            used = 0

    def stream_end() -> int:
        return buckets[-1].stream_offset + buckets[-1].nbytes if buckets else 0

    for name, dtype, shape in tensors:
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * _element_size(dtype, name)
        if unit_of is not None and unit_of(name) != unit:
            close()
            unit = unit_of(name)
        if nbytes > bucket_bytes:
            close()
            first = len(buckets)
            for c in range(math.ceil(nbytes / bucket_bytes)):
                size = min(bucket_bytes, nbytes - c * bucket_bytes)
                buckets.append(Bucket(len(buckets), stream_end(), size, name))
            slots.append(TensorSlot(name, dtype, shape, nbytes, first, 0, len(buckets) - first))
            continue
        offset = _round_up(used, alignment)
        if not used or offset + nbytes > bucket_bytes:
            close()
            buckets.append(Bucket(len(buckets), stream_end(), bucket_bytes))
            offset = 0
        slots.append(TensorSlot(name, dtype, shape, nbytes, len(buckets) - 1, offset))
        used = max(offset + nbytes, 1)  # a 0-byte tensor still opens its bucket
    close()
    wire_manifest = WireManifest(tuple(slots), tuple(buckets), bucket_bytes, alignment,
                        _digest(slots, buckets, bucket_bytes, alignment))
    wire_manifest.check_layout()
    return wire_manifest


def wire_manifest_for_plan(plan: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      alignment: int = DEFAULT_ALIGNMENT) -> WireManifest:
    """:func:`build_wire_manifest` over a :class:`~qstrat.plan.RefitPlan`'s outputs in wire order."""
    return build_wire_manifest(((o.name, o.dtype, o.shape) for o in plan.outputs()), bucket_bytes, alignment)


def check_against(wire_manifest: WireManifest, expected: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
    """Raise WireManifestMismatchError unless the engine can load exactly what the wire manifest sends.

    Every sent tensor must be expected, with the expected dtype and shape. Tensors may be left
    out only as whole units (a partial refit, e.g. ``plan.only_layers(changed)``): a decoder
    layer (names sharing the prefix up to their first integer segment, ``model.layers.3``) or,
    outside the layers, a module (the name without its last segment, ``lm_head``). vLLM's
    layerwise reload keeps the old weights of a unit that receives nothing, but processes one
    that receives only part of its tensors with uninitialised memory for the rest.

    Args:
        wire_manifest: the round's wire manifest.
        expected: checkpoint name -> (dtype name, shape) the receiving engine accepts.
    Raises: WireManifestMismatchError listing (up to 5 of each) partly sent units with their
        missing names, unexpected names, dtype and shape differences - before any data.
    """
    sent = {s.name: (s.dtype, tuple(s.shape)) for s in wire_manifest.slots}
    units: dict[str, list[str]] = {}
    for name in expected:
        units.setdefault(reload_unit(name), []).append(name)
    partial = [_missing_of(unit, sorted(set(names) - set(sent)))
               for unit, names in sorted(units.items())
               if set(names) & set(sent) and not set(names) <= set(sent)]
    extra = sorted(set(sent) - set(expected))
    wrong = [f"{n}: sent {sent[n][0]} {list(sent[n][1])}, engine expects "
             f"{expected[n][0]} {list(expected[n][1])}"
             for n in sorted(set(sent) & set(expected))
             if (sent[n][0], tuple(sent[n][1])) != (expected[n][0], tuple(expected[n][1]))]
    problems = [] if sent else ["nothing to send"]
    for label, items in (("partly sent (a unit is sent whole or not at all)", partial),
                         ("not expected by the engine", extra), ("dtype/shape differ", wrong)):
        if items:
            more = f" (+{len(items) - 5} more)" if len(items) > 5 else ""
            problems.append(f"{len(items)} {label}: {items[:5]}{more}")
    if problems:
        raise WireManifestMismatchError("wire manifest does not match the engine: " + "; ".join(problems))


def _missing_of(unit: str, missing: list[str]) -> str:
    """``unit (missing N: [first 3] (+M more))``: how many names the unit lacks, and the first."""
    more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
    return f"{unit} (missing {len(missing)}: {missing[:3]}{more})"


def reload_unit(name: str) -> str:
    """The reload unit of a checkpoint name: its decoder layer, else its module."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1]) or name


def _element_size(dtype: str, name: str) -> int:
    t = getattr(torch, dtype, None)
    if not isinstance(t, torch.dtype):
        raise WireManifestMismatchError(f"{name}: unknown dtype {dtype!r}")
    return t.itemsize


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _body(slots: Iterable[TensorSlot], buckets: Iterable[Bucket], bucket_bytes: int,
          alignment: int) -> dict[str, Any]:
    return {"bucket_bytes": bucket_bytes, "alignment": alignment,
            "slots": [{**asdict(s), "shape": list(s.shape)} for s in slots],
            "buckets": [asdict(b) for b in buckets]}


def _malformed(slots: tuple[TensorSlot, ...], buckets: tuple[Bucket, ...], bucket_bytes: int,
               alignment: int) -> str | None:
    """What makes a received wire manifest's fields unusable (a type or range no
    :func:`build_wire_manifest` produces), or None."""
    if alignment < 1 or alignment & (alignment - 1):
        return f"alignment {alignment} (a power of two >= 1 expected)"
    if bucket_bytes < 1:
        return f"bucket_bytes {bucket_bytes}"
    for k, s in enumerate(slots):
        if not isinstance(s.name, str) or not isinstance(s.dtype, str):
            return f"slot {k}: name and dtype must be strings, got {s.name!r}, {s.dtype!r}"
        if any(d < 0 for d in s.shape) or s.nbytes < 0 or s.chunks < 1:
            return f"slot {k} ({s.name}): negative size in shape {list(s.shape)} / nbytes {s.nbytes} / chunks {s.chunks}"
    for b in buckets:
        if b.tensor is not None and not isinstance(b.tensor, str):
            return f"bucket {b.index}: tensor must be a name or null, got {b.tensor!r}"
    return None


def _digest(slots: Iterable[TensorSlot], buckets: Iterable[Bucket], bucket_bytes: int,
            alignment: int) -> str:
    body = {"version": VERSION, **_body(slots, buckets, bucket_bytes, alignment)}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def expected_from_checkpoint(model_dir: Any) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype name, shape) of every tensor of a safetensors checkpoint directory
    (headers only): what an engine started on it loads, so what a refit must send.

    Raises: FileNotFoundError without ``*.safetensors`` files; QstratError for an unreadable one.
    """
    from qstrat.execute.checkpoint import lazy_checkpoint

    return {name: (str(t.dtype).removeprefix("torch."), tuple(t.shape))
            for name, t in lazy_checkpoint(model_dir).items()}
