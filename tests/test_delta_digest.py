"""The delta digest's split keys and the sender's digests from the changed words
(qstrat.transport.delta.digest, qstrat.transport.security.checksum): checked against the
checksum formula in Python integers and against a receiver's read of every byte."""
from __future__ import annotations

import pytest
import torch

from qstrat.transport.delta import encoding as delta
from qstrat.transport.delta.digest import RegionDigests
from qstrat.transport.security import checksum as cs

M64 = 2**64
ROW = 8 * cs.ROW_WORDS


def oracle(payload: bytes, seed: int, column_seed: int) -> tuple[int, int, int]:
    """The checksum formula in Python integers, column keys from ``column_seed``, row keys from ``seed``."""
    n = len(payload)
    rows = max(1, -(-n // ROW))
    padded = payload + bytes(rows * ROW - n)
    c1, c2 = (k.tolist() for k in cs._column_keys(column_seed))
    r1, r2 = (k.tolist() for k in cs._row_keys(seed, rows))
    w = [int.from_bytes(padded[8 * i:8 * i + 8], "little") for i in range(rows * cs.ROW_WORDS)]
    h = [sum(r[i] * sum(c[j] * w[i * cs.ROW_WORDS + j] for j in range(cs.ROW_WORDS)) for i in range(rows)) % M64
         for c, r in ((c1, r1), (c2, r2))]
    return h[0] - M64 * (h[0] >= 2**63), h[1] - M64 * (h[1] >= 2**63), n


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [ROW, 3 * ROW, 2 * ROW + 13])
def test_split_keys_give_the_formula_and_the_row_sums_give_the_same_value(n):
    x = random_bytes(n, n)
    want = oracle(bytes(x.tolist()), 11, 5)
    state = cs.Checksum(11, n, torch.device("cpu"), column_seed=5)
    state.update(x)
    assert state.value() == want
    if n % ROW == 0:
        assert cs.from_row_sums(cs.row_sums(x, 5), 11, n) == want
    # the single-seed form is unchanged and differs
    assert cs.checksum(x, 11) != want


def test_split_keys_depend_on_both_seeds():
    x = random_bytes(2 * ROW, 1)
    values = {cs.from_row_sums(cs.row_sums(x, c), r, x.numel()) for c in (1, 2) for r in (1, 2)}
    assert len(values) == 4


def test_patched_row_sums_equal_the_row_sums_of_the_new_bytes_wrapping_and_row_edges_included():
    old = random_bytes(4 * ROW, 2)
    new = old.clone()
    w = new.view(torch.int64)
    # first and last word of the stream and of a row, a word going across the int64 wrap both
    # ways, and random single bytes
    w[0], w[cs.ROW_WORDS - 1], w[cs.ROW_WORDS], w[-1] = 2**63 - 1, -(2**63), 12345, -1
    new[torch.randint(0, new.numel(), (300,), generator=torch.Generator().manual_seed(3))] ^= 0x80
    changed = delta.changed_bytes(new, old)
    words = torch.unique_consecutive(changed >> 3)
    change = new.view(torch.int64)[words] - old.view(torch.int64)[words]
    got = cs.patch_row_sums(cs.row_sums(old, 9), words, change, 9)
    want = cs.row_sums(new, 9)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert cs.from_row_sums(got, 4, new.numel()) == oracle(bytes(new.tolist()), 4, 9)


def sealer_for(layout: str = "layout", round_id: str = "r1", base: str | None = "r0"):
    return delta.digest_sealer(None, bytes(32), {"round": round_id, "base": base}, layout)


def test_the_senders_digests_equal_a_receivers_read_of_every_byte_over_rounds():
    """Three rounds of a four-bucket stream (one bucket empty): the first from full reads, the
    next from the kept row sums and the changed bytes alone; each digest equal to what a
    receiver computes over the whole region, new round keys every round."""
    cuts = [0, 2 * delta.TILE, 2 * delta.TILE, 5 * delta.TILE, 6 * delta.TILE]
    stream, kept, base = random_bytes(cuts[-1], 5), None, None
    for step in range(3):
        sealer = sealer_for(round_id=f"r{step + 1}", base=f"r{step}")
        digests = RegionDigests(sealer, kept)
        for k in range(len(cuts) - 1):
            region = stream[cuts[k]:cuts[k + 1]]
            old = base[cuts[k]:cuts[k + 1]] if base is not None else None
            changed = delta.changed_bytes(region, old) if old is not None else None
            assert digests.digest(k, region, old, changed) == delta.region_digest(sealer, k, region), (step, k)
        kept, base = digests.kept(), stream
        stream = stream.clone()
        stream[torch.randint(0, stream.numel(), (50 * (step + 1),), generator=torch.Generator().manual_seed(step))] += 1


def test_row_sums_of_another_layout_are_not_used():
    region = random_bytes(delta.TILE, 6)
    other = RegionDigests(sealer_for("another layout"), None)
    other.digest(0, region, None, None)
    sealer = sealer_for()
    new = region.clone()
    new[100] ^= 1
    digests = RegionDigests(sealer, other.kept())  # kept under another column seed: read again
    assert digests.digest(0, new, region, delta.changed_bytes(new, region)) == delta.region_digest(sealer, 0, new)


def test_kept_sums_that_no_longer_describe_the_base_give_a_digest_no_receiver_computes():
    """The sender's base changed in memory after its row sums were kept, the new round holding
    the true byte there: its digest is not what a receiver holding the true base rebuilds from
    the patch (refused: sent again whole). The case this does not catch (the new round carries
    the changed byte) is in tests/test_attacks_delta_speed2.py."""
    true = random_bytes(2 * delta.TILE, 7)
    first = RegionDigests(sealer_for(), None)
    first.digest(0, true, None, None)
    base = true.clone()
    base[77] ^= 0x10  # a fault in the sender's memory
    new = true.clone()
    new[1000] += 3
    sealer = sealer_for(round_id="r2", base="r1")
    changed = delta.changed_bytes(new, base)
    got = RegionDigests(sealer, first.kept()).digest(0, new, base, changed)
    rebuilt = delta.decode_patch(delta.encode_patch(new, base, changed)[0], true.clone(), new.numel())
    assert torch.equal(rebuilt, new)  # the patch carried byte 77: the receiver's bytes are right
    assert got != delta.region_digest(sealer, 0, rebuilt)


def test_buckets_are_digested_in_order():
    digests = RegionDigests(sealer_for(), None)
    with pytest.raises(ValueError, match="bucket 1 asked for after 0 buckets"):
        digests.digest(1, random_bytes(delta.TILE, 1), None, None)


def test_row_sums_refuse_what_is_not_whole_aligned_rows():
    x = random_bytes(ROW + 8, 1)
    for bad in (x[:ROW + 1], x[1:ROW + 1], x[:ROW].view(torch.int16), x[:2 * ROW // 2].view(2, -1)):
        with pytest.raises(ValueError, match="row_sums: needs a 1-D contiguous uint8 tensor of whole"):
            cs.row_sums(bad, 1)
