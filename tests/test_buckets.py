"""qstrat.transport.buckets: the bytes of each bucket (packing with zeroed padding, chunks of a
large tensor as views). The pack -> receive -> unpack round trip: tests/test_transport.py."""
from __future__ import annotations

import torch

from qstrat.transport.buckets import bucket_contents, byte_view, chunk_view, pack
from qstrat.transport.wire_manifest import build_wire_manifest


def test_byte_view_is_the_little_endian_bytes_without_a_copy():
    t = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)  # bf16 0x3F80, 0xC000
    v = byte_view(t)
    assert v.dtype == torch.uint8 and v.tolist() == [0x80, 0x3F, 0x00, 0xC0]
    assert v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert byte_view(torch.tensor(7, dtype=torch.int32)).tolist() == [7, 0, 0, 0]  # 0-dim
    assert byte_view(torch.tensor([True, False])).tolist() == [1, 0]


def test_pack_places_tensors_at_their_offsets_and_zeroes_the_padding():
    m = build_wire_manifest([("a", "uint8", (3,)), ("b", "int16", (2,))], bucket_bytes=128, alignment=16)
    (b0,) = m.buckets
    slots = bucket_contents(m)[0]
    assert [(s.name, s.offset) for s in slots] == [("a", 0), ("b", 16)] and b0.nbytes == 32
    buffer = torch.full((128,), 0xEE, dtype=torch.uint8)  # stale bytes of an earlier bucket
    payload = pack(buffer, b0, slots, [torch.tensor([1, 2, 3], dtype=torch.uint8),
                                       torch.tensor([0x0102, -1], dtype=torch.int16)])
    want = [1, 2, 3] + [0] * 13 + [0x02, 0x01, 0xFF, 0xFF] + [0] * 12
    assert payload.tolist() == want
    assert payload.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    assert buffer[32:].tolist() == [0xEE] * 96  # past the bucket: untouched


def test_a_large_tensor_is_cut_into_consecutive_chunk_views():
    m = build_wire_manifest([("small", "uint8", (5,)), ("big", "float32", (100,)), ("tail", "uint8", (1,))],
                            bucket_bytes=128, alignment=16)
    contents = bucket_contents(m)
    assert [[s.name for s in c] for c in contents] == [["small"], ["big"], ["big"], ["big"], ["big"], ["tail"]]
    big_slot = m.slots[1]
    assert (big_slot.bucket, big_slot.chunks) == (1, 4)
    big = torch.arange(100, dtype=torch.float32)
    chunks = [chunk_view(big, m, big_slot, m.buckets[i]) for i in range(1, 5)]
    assert [c.numel() for c in chunks] == [128, 128, 128, 16]
    assert torch.equal(torch.cat(chunks), byte_view(big))
    assert all(c.untyped_storage().data_ptr() == big.untyped_storage().data_ptr() for c in chunks)


def test_packing_piece_by_piece_gives_the_packed_bucket():
    from qstrat.transport.buckets import pack_range

    specs = [("a", "bfloat16", (5, 3)), ("b", "float32", (70,)), ("c", "uint8", (1,)), ("d", "bfloat16", (200,))]
    m = build_wire_manifest(specs, bucket_bytes=4096, alignment=64)
    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(s[2], generator=g).to(getattr(torch, s[1])) if s[1] != "uint8"
          else torch.tensor([7], dtype=torch.uint8) for s in specs]
    b, slots = m.buckets[0], bucket_contents(m)[0]
    want = pack(torch.full((4096,), 0xAB, dtype=torch.uint8), b, slots, ts).clone()
    for step in (1, 7, 64, 100, b.nbytes):
        buf = torch.full((4096,), 0xCD, dtype=torch.uint8)  # garbage: padding must be zeroed
        for lo in range(0, b.nbytes, step):
            pack_range(buf, slots, ts, lo, min(b.nbytes, lo + step))
        assert torch.equal(buf[:b.nbytes], want), step
