"""The delta compare's one-pass CPU kernel (qstrat/transport/delta/scan.py) against the brute
force (``nonzero`` of the bitwise compare) and against the torch path it replaces, on every
element width, change density (its output buffers grown), with and without ``update``, on two
threads at once."""
from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st

from cpu_kernels import kernels
from qstrat.transport.delta import encoding as delta, scan
from qstrat.transport.delta.encoding import bits_view, changed_values

pytestmark = kernels

DTYPES = [torch.bool, torch.float8_e4m3fn, torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.int64]


def brute(new: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    nb, ob = bits_view(new).reshape(-1), bits_view(old).reshape(-1)
    idx = torch.nonzero(nb != ob).reshape(-1)
    return idx, nb[idx], ob[idx]


def pair(dtype: torch.dtype, words: int, changed: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(new, old): ``words`` int64 words of random bits (a multiple of 8), ``changed`` of new's
    elements with one bit flipped (bool: 0 <-> 1)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-2**62, 2**62, (words,), generator=g, dtype=torch.int64)
    old = raw.view(torch.uint8).view(dtype) if dtype != torch.bool else (raw.view(torch.uint8) & 1).view(torch.bool)
    new = old.clone()
    n, m = new.numel(), int(new.numel() * changed)
    if m:
        at = torch.randperm(n, generator=g)[:m]
        bv = bits_view(new)
        bv[at] ^= 1
    return new, old


def test_the_kernel_answers_on_cpu_where_numba_is_installed(monkeypatch):
    """numba is a dependency of qstrat: the kernel, not the torch path, answers a CPU compare
    (a test suite on the torch path alone would not see the kernel's bugs)."""
    assert scan.ENABLED, "numba did not import: the delta compare runs on the torch path"
    calls = []
    real = scan._scan
    monkeypatch.setattr(scan, "_scan", lambda *a: calls.append(a[4]) or real(*a))
    new, old = pair(torch.bfloat16, 64, 0.1, 0)
    changed_values(new, old)
    assert calls == [4]  # four bf16 elements per word


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), groups=st.integers(1, 300),
       changed=st.sampled_from([0.0, 0.001, 0.02, 0.2, 0.7, 1.0]), update=st.booleans(), seed=st.integers(0, 2**16))
def test_the_kernel_equals_the_brute_force_and_the_torch_path(dtype, groups, changed, update, seed):
    new, old = pair(dtype, 8 * groups, changed, seed)
    want = brute(new, old)
    results = {}
    for kernel in (True, False):
        scan.ENABLED = kernel
        try:
            kept = old.clone()
            results[kernel] = changed_values(new, kept, update=update), kept
        finally:
            scan.ENABLED = True
    for kernel, (got, kept) in results.items():
        for g_, w_ in zip(got, want):
            assert g_.dtype == w_.dtype and torch.equal(g_, w_), f"kernel={kernel}"
        assert torch.equal(bits_view(kept), bits_view(new) if update else bits_view(old)), f"kernel={kernel}"


def test_a_change_denser_than_the_first_buffer_grows_it_and_loses_nothing(monkeypatch):
    """Every element changed: the first output buffer (1/32 of the elements, at least 1024)
    fills many times; each refill restarts at the word it stopped at, none skipped or doubled."""
    seen = []
    real = scan._scan
    monkeypatch.setattr(scan, "_scan", lambda *a: seen.append(a[5]) or real(*a))
    new, old = pair(torch.bfloat16, 8 * 4096, 1.0, 3)
    kept = old.clone()
    got = changed_values(new, kept, update=True)
    want = brute(new, old)
    assert len(seen) > 3 and seen[0] == 0 and seen == sorted(set(seen))
    for g_, w_ in zip(got, want):
        assert torch.equal(g_, w_)
    assert torch.equal(bits_view(kept), bits_view(new))


def test_the_split_compare_on_the_kernel_gives_each_thread_its_own_exact_result(monkeypatch):
    """Four callers at once, each splitting its compare with a helper (eight threads in the
    kernel, which releases the GIL): every result exact, every kept side updated."""
    monkeypatch.setattr(delta, "SPLIT_WORDS", 64)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    cases = [pair(d, 8 * 512, 0.05, i) for i, d in enumerate([torch.bfloat16, torch.float32, torch.uint8, torch.int64])]
    wants = [brute(n, o) for n, o in cases]
    kept = [o.clone() for _, o in cases]
    got: list = [None] * len(cases)

    def run(i: int) -> None:
        got[i] = changed_values(cases[i][0], kept[i], update=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (new, _), k, g, w in zip(cases, kept, got, wants):
        assert all(torch.equal(a, b) for a, b in zip(g, w))
        assert torch.equal(bits_view(k), bits_view(new))


@pytest.mark.parametrize("offset", [2, 4])
def test_a_view_off_the_word_grid_is_compared_element_by_element_exactly(offset):
    """A bf16 view at a 2- or 4-byte offset cannot be read as int64 words: the element-wise
    path answers (the kernel is never handed misaligned words)."""
    new, old = pair(torch.bfloat16, 8 * 16, 0.1, 7)
    a, b = new.view(torch.uint8)[offset:offset + 512].view(torch.bfloat16), old.view(torch.uint8)[offset:offset + 512].view(torch.bfloat16)
    assert all(torch.equal(x, y) for x, y in zip(changed_values(a, b), brute(a, b)))
