"""Attacks on the transport's numba kernels (qstrat/transport/delta/scan.py: the delta compare;
qstrat/transport/security/checksum.py: the row sums): inputs where the kernel must give what the
torch path gives - the same values, the same error - and never read or write past a tensor."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from cpu_kernels import kernels
from qstrat.transport.delta import encoding as delta, scan
from qstrat.transport.delta.encoding import bits_view, changed_values
from qstrat.transport.security import checksum as cs

pytestmark = kernels


def brute(new: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    nb, ob = bits_view(new).reshape(-1), bits_view(old).reshape(-1)
    idx = torch.nonzero(nb != ob).reshape(-1)
    return idx, nb[idx], ob[idx]


def bf16_pair(elements: int, old_elements: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-100, 100, (elements,), generator=g).to(torch.bfloat16),
            torch.randint(-100, 100, (old_elements,), generator=g).to(torch.bfloat16))


@pytest.fixture(params=[True, False], ids=["kernel", "torch"])
def kernel(request, monkeypatch):
    assert scan.ENABLED, "numba did not import: the delta compare runs on the torch path"
    monkeypatch.setattr(scan, "ENABLED", request.param)
    return request.param


# ---- an old side of another length: the kernel has no bounds checks ----

@pytest.mark.parametrize("split", [False, True], ids=["one", "split"])
@pytest.mark.parametrize("extra", [-4, 4, 64], ids=["shorter", "longer", "longer-by-8-words"])
def test_an_old_side_of_another_length_is_refused(kernel, monkeypatch, extra, split):
    """The kernel reads ``b[i]`` for every word of ``a`` without bounds checks: an ``old`` of
    fewer elements was read past its end (and, below, written past it), one of more compared
    as its prefix without a word. Both paths refuse it, whole or split, before reading."""
    if split:
        monkeypatch.setattr(delta, "SPLIT_WORDS", 64)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    new, old = bf16_pair(4096, 4096 + extra)
    kept = old.clone()
    with pytest.raises(ValueError, match=r"changed_values: new has 4096 elements, old \d+"):
        changed_values(new, kept)
    with pytest.raises(ValueError, match=r"changed_values: new has 4096 elements, old \d+"):
        changed_values(new, kept, update=True)
    assert torch.equal(kept.view(torch.int16), old.view(torch.int16))  # nothing written


def test_the_kernel_refuses_word_views_of_different_lengths_itself():
    """:func:`scan.changed_words` guards its own loop (a caller other than changed_values)."""
    a, b = torch.zeros(64, dtype=torch.int64), torch.ones(63, dtype=torch.int64)
    with pytest.raises(ValueError, match="changed_words: a has 64 words, b 63"):
        scan.changed_words(a, b, torch.int16, 4, update=True)


def test_a_shorter_old_updated_does_not_corrupt_the_heap():
    """Before the length check the kernel wrote ``new``'s words past the end of a shorter
    ``old`` ("double free or corruption" at exit): a child process must end cleanly."""
    code = textwrap.dedent("""
        import torch
        from qstrat.transport.delta import scan
        from qstrat.transport.delta.encoding import changed_values
        assert scan.ENABLED
        for _ in range(20):
            new = torch.randint(-100, 100, (4096,)).to(torch.bfloat16)
            old = torch.randint(-100, 100, (4096 - 64,)).to(torch.bfloat16)
            try:
                changed_values(new, old, update=True)
            except ValueError:
                pass
        print("clean")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "clean" in done.stdout, done.stderr[-2000:]


# ---- an old side whose elements share memory (an expanded tensor) ----

def test_an_expanded_old_is_not_updated_word_by_word(kernel):
    """An int64 ``old`` of stride 0 (``expand``: every element one word) passes ``bits_view`` and
    the word view; the kernel wrote each changed word into it and read the next "old" element
    back from the word it had just written (old bits: new's previous element, not 0). The torch
    path refuses the in-place write; the kernel only takes contiguous word views."""
    new = torch.arange(1, 65, dtype=torch.int64)
    old = torch.zeros(1, dtype=torch.int64).expand(64)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        changed_values(new, old, update=True)
    got = changed_values(new, old)  # read only: exact on both paths
    assert all(torch.equal(g, w) for g, w in zip(got, brute(new, old)))


def test_a_strided_int64_pair_is_exact_with_update(kernel):
    """Every other word of two int64 tensors (stride 2: not contiguous, but each element its own
    word) - compared and updated exactly."""
    g = torch.Generator().manual_seed(5)
    new = torch.randint(-2**62, 2**62, (256,), generator=g)[::2]
    base = torch.randint(-2**62, 2**62, (256,), generator=g)
    old, between = base[::2], base[1::2].clone()
    want = brute(new, old)
    got = changed_values(new, old, update=True)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert torch.equal(old, new) and torch.equal(base[1::2], between)  # the words between untouched


# ---- autograd's record of in-place writes ----

def test_an_update_through_the_kernel_is_seen_by_autograd(kernel):
    """The kernel writes ``old`` through NumPy, unseen by torch's version counter: a graph that
    saved ``old`` then back-propagated with the new values (a silently wrong gradient) where the
    torch path's in-place write makes backward refuse."""
    new, old = bf16_pair(512, 512, seed=3)
    new, old = new.float(), old.float()
    w = torch.ones(512, requires_grad=True)
    y = (old * w).sum()  # saves old for w's gradient
    before = old._version
    changed_values(new, old, update=True)
    assert old._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_an_inference_tensor_is_updated_in_and_outside_inference_mode(kernel):
    """Inference tensors have no version counter (the bump is skipped): the update still lands."""
    with torch.inference_mode():
        new, old = bf16_pair(512, 512, seed=4)
    want = brute(new, old)
    got = changed_values(new, old, update=True)
    assert all(torch.equal(x, y) for x, y in zip(got, want)) and torch.equal(bits_view(old), bits_view(new))
    with torch.inference_mode():
        new2 = new.clone()
        bits_view(new2)[::7] ^= 1
        got = changed_values(new2, old, update=True)
    assert got[0].numel() == len(range(0, 512, 7)) and torch.equal(bits_view(old), bits_view(new2))


# ---- a default device other than the CPU (torch.set_default_device / a torch.device context) ----

def test_the_compare_of_cpu_tensors_under_another_default_device(kernel):
    """The kernel's output buffers came from ``torch.empty`` on the default device: under
    ``with torch.device("meta")`` (or a trainer's ``set_default_device("cuda")``) the compare of
    two CPU tensors failed converting them to NumPy; the torch path answers on the inputs' device."""
    new, old = bf16_pair(4096, 4096, seed=6)
    want = brute(new, old)
    kept = old.clone()
    with torch.device("meta"):
        got = changed_values(new, kept, update=True)
    assert all(x.device.type == "cpu" and torch.equal(x, y) for x, y in zip(got, want))
    assert torch.equal(bits_view(kept), bits_view(new))


@pytest.mark.parametrize("row_kernel", [True, False], ids=["kernel", "mv"])
def test_the_checksum_of_a_cpu_payload_under_another_default_device(monkeypatch, row_kernel):
    """The same for the row sums' kernel (its sums from ``torch.empty`` on the default device);
    the keys are cached from a first call, as in a run after its first round."""
    assert cs.ROW_KERNEL, "numba did not import: the CPU row sums run on torch.mv"
    monkeypatch.setattr(cs, "ROW_KERNEL", row_kernel)
    x = torch.randint(0, 256, (3 * cs._ROW_BYTES + 7,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    want, sums = cs.checksum(x, 5), cs.row_sums(x[:3 * cs._ROW_BYTES], 9)
    with torch.device("meta"):
        got, got_sums = cs.checksum(x, 5), cs.row_sums(x[:3 * cs._ROW_BYTES], 9)
    assert got == want
    assert all(g.device.type == "cpu" and torch.equal(g, s) for g, s in zip(got_sums, sums))


# ---- without numba ----

def test_qstrat_without_numba_imports_and_gives_the_same_values():
    """numba not importable (``sys.modules['numba'] = None``): qstrat imports, both kernels are
    off, and the compare and the checksum give the values they give with numba."""
    code = textwrap.dedent("""
        import sys
        if sys.argv[1] == "off":
            sys.modules["numba"] = None
        import torch
        from qstrat.transport import jit
        from qstrat.transport.delta import scan
        from qstrat.transport.delta.encoding import changed_values
        from qstrat.transport.security import checksum as cs
        assert (jit.AVAILABLE, scan.ENABLED, cs.ROW_KERNEL) == ((sys.argv[1] == "on",) * 3)
        g = torch.Generator().manual_seed(0)
        new = torch.randint(-2**62, 2**62, (8 * 96,), generator=g).view(torch.bfloat16)
        old = new.clone()
        old.view(torch.int16)[::13] ^= 1
        idx, a, b = changed_values(new, old, update=True)
        x = torch.randint(0, 256, (3 * cs._ROW_BYTES + 7,), dtype=torch.uint8, generator=g)
        print(idx.sum().item(), a.sum().item(), b.sum().item(), old.view(torch.int16).sum().item(), cs.checksum(x, 5))
    """)
    out = [subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=120)
           for mode in ("off", "on")]
    assert all(o.returncode == 0 for o in out), out[0].stderr[-2000:] + out[1].stderr[-2000:]
    assert out[0].stdout == out[1].stdout
