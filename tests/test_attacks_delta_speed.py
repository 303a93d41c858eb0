"""Attacks on the delta sender's speed changes (the compare handing back values and split over two
threads, the requantizer's scatter/shift steps, the checksum's row blocks, a refused-then-whole
round's byte accounting): each against an oracle computed here (brute-force compare, a full
``Serializer.quantize``, the payloads the fake wire saw)."""
from __future__ import annotations

import threading

import pytest
import torch

from qstrat.transport.delta import encoding as delta
from qstrat.transport.delta.encoding import bits_view, changed_values
from qstrat.transport.delta.stream import PatchEncoder
from qstrat.transport.wire_manifest import build_wire_manifest

T = delta.TILE


def brute(new: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    nb, ob = bits_view(new).reshape(-1), bits_view(old).reshape(-1)
    idx = torch.nonzero(nb != ob).reshape(-1)
    return idx, nb[idx], ob[idx]


@pytest.fixture
def split(monkeypatch):
    """The split compare for every input of 16 words or more."""
    monkeypatch.setattr(delta, "SPLIT_WORDS", 16)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)


DTYPES = [torch.bool, torch.float8_e4m3fn, torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.complex64]
#: every dtype at every byte offset its elements can start at (8: aligned; else the element-wise path)
PLACES = [(d, o) for d in DTYPES for o in (0, 2, 4, 8) if o % torch.tensor([], dtype=d).element_size() == 0]


@pytest.mark.parametrize(("dtype", "offset"), PLACES, ids=[f"{d}-{o}" for d, o in PLACES])
@pytest.mark.parametrize("nbytes", [0, 8, 72, 136, 1032, 64 * 8 * 9])
def test_split_compare_of_every_width_size_and_offset_equals_the_brute_force(split, dtype, nbytes, offset):
    g = torch.Generator().manual_seed(nbytes + offset)
    raw = torch.randint(0, 256, (nbytes + offset,), generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        raw &= 1
    old = raw[offset:].view(dtype)
    new = old.clone()
    n = new.numel()
    if n:
        bv = bits_view(new)
        at = torch.cat([torch.randint(0, n, (max(1, n // 10),), generator=g), torch.tensor([0, n - 1, n // 2])])
        bv[at] ^= 1
    got, want = changed_values(new, old), brute(new, old)
    for g_, w_ in zip(got, want):
        assert g_.dtype == w_.dtype and torch.equal(g_, w_)
    assert got[0].numel() == int((bits_view(new).reshape(-1) != bits_view(old).reshape(-1)).sum())


def test_split_compare_sees_negative_zero_and_nan_payloads_and_parameters(split):
    old = torch.zeros(4096)
    old[100] = float("nan")
    new = old.clone()
    new[7] = -0.0
    bits_view(new)[100] |= 1  # another NaN payload
    idx, nb, ob = changed_values(new, old)
    assert idx.tolist() == [7, 100] and nb[0] == bits_view(torch.tensor(-0.0)) and ob[0] == 0
    p = torch.nn.Parameter(torch.randn(8192))
    q = p.detach().clone()
    q[5] += 1
    assert changed_values(p, q)[0].tolist() == [5]


def test_many_threads_at_once_each_get_their_own_exact_result(split):
    errors: list[int] = []

    def run(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        old = torch.randn(1 << 14, generator=g).bfloat16()
        new = old.clone()
        new[torch.randint(0, new.numel(), (50,), generator=g)] += 1
        for _ in range(10):
            if not torch.equal(changed_values(new, old)[0], brute(new, old)[0]):
                errors.append(seed)

    before = threading.active_count()
    threads = [threading.Thread(target=run, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and threading.active_count() == before


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, ValueError])
@pytest.mark.parametrize("on", ["qstrat-compare", "caller"])
def test_what_either_thread_raises_is_raised_and_no_helper_is_left(split, monkeypatch, exc, on):
    real = delta._changed_words

    def failing(a, *args):
        name = threading.current_thread().name
        if (name == "qstrat-compare") == (on == "qstrat-compare"):
            raise exc("boom")
        return real(a, *args)

    monkeypatch.setattr(delta, "_changed_words", failing)
    old = torch.randn(1 << 14).bfloat16()
    new = old.clone()
    new[3] += 1
    before = threading.active_count()
    with pytest.raises(exc, match="boom"):
        changed_values(new, old)
    assert threading.active_count() == before


def test_a_helper_thread_that_cannot_start_does_not_refuse_the_compare(split, monkeypatch):
    """Starting a thread can fail (a process at its thread limit, RuntimeError "can't start new
    thread"): the helper is only a speed-up, so the compare runs on the caller's thread instead of
    refusing a valid input."""
    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    old = torch.randn(1 << 14).bfloat16()
    new = old.clone()
    new[[3, 5000, 16383]] += 1
    got = changed_values(new, old)
    for g_, w_ in zip(got, brute(new, old)):
        assert torch.equal(g_, w_)
    assert got[0].tolist() == [3, 5000, 16383]
