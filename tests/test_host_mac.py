"""The host bucket MAC (qstrat/transport/security/seal.py ``host_mac``, keys.poly1305_key / host_bucket_mac):
its value against a computation written out here from its definition (HKDF subkey, HMAC-SHA256,
the cryptography package's Poly1305), piecewise feeding, and that every bound field and byte
changes it."""
from __future__ import annotations

import hashlib
import hmac
import struct

import pytest
import torch
from cryptography.hazmat.primitives.poly1305 import Poly1305

from qstrat.transport.security.keys import Secret, hkdf
from qstrat.transport.mesh.steps import pair_sealer
from qstrat.transport.security.seal import PIECE_BYTES, Sealer, pieces

SECRET = b"host mac test secret, 32 bytes.."
MAC = bytes(range(32))


def oracle(secret: bytes, mac: bytes, index: int, flags: int, payload: bytes) -> bytes:
    sub = hkdf(secret, b"qstrat-poly1305")
    one_time = hmac.new(sub, b"key" + mac + struct.pack("<q", index), hashlib.sha256).digest()
    tag = Poly1305.generate_tag(one_time, payload)
    return hmac.new(sub, b"bucket" + mac + struct.pack("<qqq", index, flags, len(payload)) + tag,
                    hashlib.sha256).digest()


def payload(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [0, 1, 4097, PIECE_BYTES + 12345])
def test_the_seal_is_hmac_over_a_one_time_poly1305_tag(n):
    x = payload(n)
    s = Sealer(Secret(SECRET), MAC, torch.device("cpu"), host_mac=True)
    want = oracle(SECRET, MAC, 7, 0, x.numpy().tobytes())
    assert s.seal(7, 0, x) == want
    state = s.begin(7, n)  # fed in the pieces a large bucket is sent in
    for piece in pieces(x):
        state.update(piece)
    assert state.seal(0) == want and s.verifies(7, 0, x, want)
    assert Sealer(None, MAC, torch.device("cpu"), host_mac=True).seal(7, 0, x) == oracle(b"", MAC, 7, 0, x.numpy().tobytes())


def test_every_byte_and_header_field_is_bound():
    x = payload(3 * 4096 + 5, 1)
    s = Sealer(Secret(SECRET), MAC, torch.device("cpu"), host_mac=True)
    seal = s.seal(3, 0, x)
    for i in (0, 4096, len(x) - 1):
        y = x.clone()
        y[i] ^= 1
        assert not s.verifies(3, 0, y, seal), i
    assert not s.verifies(4, 0, x, seal)  # another bucket index (another one-time key)
    assert not s.verifies(3, 1, x, seal)  # other flags
    assert not s.verifies(3, 0, x[:-1], seal)  # another length
    assert not Sealer(Secret(SECRET[::-1]), MAC, torch.device("cpu"), host_mac=True).verifies(3, 0, x, seal)
    assert not Sealer(None, MAC, torch.device("cpu"), host_mac=True).verifies(3, 0, x, seal)
    assert not Sealer(Secret(SECRET), MAC, torch.device("cpu")).verifies(3, 0, x, seal)  # the NH MAC differs


def test_each_mesh_pair_seals_with_its_own_keys_on_the_cpu():
    x = payload(1000, 2)
    secret = Secret(SECRET)
    a, b = (pair_sealer(secret, MAC, 0, r, torch.device("cpu")) for r in (2, 3))
    assert a.host_mac and b.host_mac
    assert a.seal(0, 0, x) != b.seal(0, 0, x)
    assert not b.verifies(0, 0, x, a.seal(0, 0, x))


def test_refusals_name_the_reason():
    with pytest.raises(ValueError, match="host memory, not on meta"):
        Sealer(None, MAC, torch.device("meta"), host_mac=True)
    s = Sealer(Secret(SECRET), MAC, torch.device("cpu"), host_mac=True)
    state = s.begin(0, 10)
    state.update(payload(6))
    with pytest.raises(ValueError, match="6 of 10 bytes fed"):
        state.seal(0)
    with pytest.raises(ValueError, match="11 bytes fed, the bucket has 10"):
        state.update(payload(5))
