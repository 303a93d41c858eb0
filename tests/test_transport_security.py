"""Integrity on the device and authenticated rounds, without an engine.

* The bucket MAC of authenticated rounds: NH (qstrat/transport/security/nh.py) against a pure-Python
  oracle of RFC 4418's formula; the bit-63 forgery that leaves the multilinear checksum
  unchanged changes the MAC, and a man-in-the-middle making it in a live round is refused.
* The device checksum (qstrat/transport/security/checksum.py) against a pure-Python oracle of its
  formula; the multiply+sum path (what CUDA runs: no integer ``mv`` there) gives the same value
  as the CPU ``mv`` path; every single-bit flip and a word swap change it.
* Authenticated rounds between this process (sender) and two StandaloneReceiver processes over
  gloo: a keyed round delivers the driver's bytes; no MAC, a wrong key, a replayed header (by
  counter, and on a "restarted" receiver by its fresh challenge) and an init info pointing at
  another address are each refused before any data with the receivers' tensors unchanged; the
  secret appears in no error text. The engine versions are in tests/test_engine_transport.py.
"""
from __future__ import annotations

import pickle
import time

import pytest
import torch

from qstrat.errors import TransferAuthError, TransportError
from qstrat.transport import RefitSender
from qstrat.transport.security import checksum as cs
from qstrat.transport.security import nh
from qstrat.transport.security.seal import Sealer
from qstrat.transport.security.address import ENV_ADDRESS
from qstrat.transport.security.keys import ENV_SECRET, Secret

from transport_harness import EditingClient, free_port, sha256, standalone_receivers, wrap_group

SECRET = "correct horse battery staple 42"
OTHER = "an entirely different secret!!"
M64 = 2**64


def oracle(payload: bytes, seed: int) -> tuple[int, int, int]:
    """The checksum formula in Python integers (module docstring of qstrat.transport.security.checksum)."""
    n = len(payload)
    rows = max(1, -(-n // cs._ROW_BYTES))
    padded = payload + bytes(rows * cs._ROW_BYTES - n)
    c1, r1, c2, r2 = (k.tolist() for k in cs._keys(seed, rows))
    w = [int.from_bytes(padded[8 * i:8 * i + 8], "little") for i in range(rows * cs.ROW_WORDS)]
    h1 = sum(r1[r] * sum(c1[j] * w[r * cs.ROW_WORDS + j] for j in range(cs.ROW_WORDS))
             for r in range(rows)) % M64
    h2 = sum(c2[j] * sum(r2[r] * w[r * cs.ROW_WORDS + j] for r in range(rows))
             for j in range(cs.ROW_WORDS)) % M64
    signed = [h - M64 if h >= 2**63 else h for h in (h1, h2)]
    return signed[0], signed[1], n


@pytest.mark.parametrize("n", [0, 5, 8 * cs.ROW_WORDS, 2 * 8 * cs.ROW_WORDS + 13,
                               (cs._CACHE_ROWS + 1) * 8 * cs.ROW_WORDS + 3])  # two row blocks
def test_checksum_equals_the_formula(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    assert cs.checksum(x, 7) == oracle(bytes(x.tolist()), 7)


def test_multiply_sum_path_equals_mv_path_and_unaligned_views_work(monkeypatch):
    x = torch.randint(0, 256, (5 * 8 * cs.ROW_WORDS + 1000,), dtype=torch.uint8)
    want = cs.checksum(x, 3)
    monkeypatch.setattr(cs, "_integer_mv", lambda device: False)  # the CUDA path, here on CPU
    assert cs.checksum(x, 3) == want
    monkeypatch.undo()
    assert cs.checksum(x[3:], 3) == cs.checksum(x[3:].clone(), 3)  # storage offset 3


def test_checksum_catches_bit_flips_word_swaps_and_depends_on_the_seed():
    x = torch.randint(0, 256, (3 * 8 * cs.ROW_WORDS + 77,), dtype=torch.uint8)
    base = cs.checksum(x, 11)
    for pos in range(0, x.numel(), 997):
        for bit in (0, 3, 7):
            y = x.clone()
            y[pos] ^= 1 << bit
            h = cs.checksum(y, 11)
            assert h[0] != base[0] and h[1] != base[1], (pos, bit)
    y = x.clone()
    y[0:8], y[8:16] = x[8:16], x[0:8]
    if not torch.equal(x[0:8], x[8:16]):
        assert cs.checksum(y, 11) != base
    assert cs.checksum(x, 12) != base
    assert cs.checksum(x[:-1], 11)[2] == x.numel() - 1


def test_secret_is_hidden_and_not_picklable():
    s = Secret(SECRET)
    assert SECRET not in repr(s) and SECRET not in str(s) and repr(s) == "Secret(<hidden>)"
    with pytest.raises(TypeError, match="not picklable"):
        pickle.dumps(s)
    with pytest.raises(ValueError, match=r"too short \(3 bytes"):
        Secret("abc")


# ---- authenticated rounds over gloo ----------------------------------------------------------
@pytest.fixture(scope="module")
def receivers(tiny):
    with standalone_receivers(tiny[3], env={ENV_SECRET: SECRET}) as rs:
        yield rs


def connect(receivers, secret, **kw):
    sender = RefitSender([r.rpc for r in receivers], "127.0.0.1", free_port(), timeout_s=20,
                         bucket_bytes=64 << 10, secret=secret, **kw)
    sender.connect()
    return sender


def digests(receivers):
    return [r.ctl.call("digests") for r in receivers]


def test_keyed_round_delivers_the_bytes(receivers, tiny):
    """A round with a secret delivers exactly the plan's bytes to both receivers. (The MAC's cost
    against a round is a benchmark figure, not a timed test: scripts/bench_transport.py --secret.)"""
    driver, trainer_a, _, _ = tiny
    sender = connect(receivers, SECRET)
    sender.refit(driver, trainer_a)
    want = {name: sha256(t) for name, t in driver.run(trainer_a)}
    assert digests(receivers) == [want, want]
    sender.close()


def test_unauthenticated_wrong_key_and_replayed_rounds_are_refused_before_any_data(receivers, tiny):
    driver, trainer_a, trainer_b, _ = tiny
    before = digests(receivers)
    for secret in (None, OTHER):
        # the engines hold a secret and refuse an init without its tag: these clients sign the
        # init with the right key, so that only the rounds are left to refuse
        clients = [EditingClient(r.rpc, _signed_init(SECRET)) for r in receivers]
        sender = RefitSender(clients, "127.0.0.1", free_port(), timeout_s=20, bucket_bytes=64 << 10, secret=secret)
        sender.connect()
        tap = wrap_group(sender.group, record=True)
        with pytest.raises(TransferAuthError) as err:
            sender.refit(driver, trainer_b)
        msg = str(err.value)
        assert "rank 1 refused the round's authentication; rank 2 refused" in msg, msg
        assert msg.count("the round's MAC does not verify (this engine holds a transfer secret") == 2, msg
        assert SECRET not in msg and OTHER not in msg
        assert not [k for k, *_ in tap.posted if k == "payload"] and digests(receivers) == before
        sender.close()

    # replay: a keyed round's header, recorded on the wire, sent again in a later round
    sender = connect(receivers, SECRET)
    tap = wrap_group(sender.group, record=True)
    sender.refit(driver, trainer_b)  # recorded, accepted
    recorded = next(t for kind, _, _, t in tap.posted if kind == "round")
    after_b = digests(receivers)
    tap.header_hook = lambda header: recorded
    with pytest.raises(TransferAuthError, match="the round's MAC does not verify"):
        sender.refit(driver, trainer_b)
    for r in receivers:  # a restarted engine has forgotten the counter: its challenge still refuses
        r.ctl.call("forget_counter")
    with pytest.raises(TransferAuthError, match="the round's MAC does not verify"):
        sender.refit(driver, trainer_b)
    assert digests(receivers) == after_b
    sender.close()


def _signed_init(secret):
    """An ``EditingClient`` edit: the init info's tag made with ``secret``."""
    def edit(method, args):
        from qstrat.transport.security.auth import sign_init

        if method != "init_weight_transfer_engine":
            return args
        return (sign_init(Secret(secret), {k: v for k, v in args[0].items() if k != "auth"}),)
    return edit


def test_init_info_pointing_at_another_address_is_refused_before_joining(receivers, tiny):
    for r in receivers:
        r.ctl.call("setenv", ENV_ADDRESS, "10.1.2.3")
    try:
        sender = RefitSender([r.rpc for r in receivers], "127.0.0.1", free_port(), timeout_s=3,
                             secret=SECRET)
        with pytest.raises(TransportError) as err:
            sender.connect()
        msg = str(err.value)
        assert msg.count("init_weight_transfer_engine refused: it points the engine at 127.0.0.1:") == 2, msg
        assert "the configured transfer address is 10.1.2.3 (QSTRAT_TRANSFER_ADDRESS)" in msg
        assert SECRET not in msg
    finally:
        for r in receivers:
            r.ctl.call("setenv", ENV_ADDRESS, None)


def flip_bit63_of_two_words(payload):
    """The forgery against a multilinear checksum modulo 2**64: adding 2**63 to two int64 words
    changes each keyed form by (odd key) * 2**63 twice, i.e. by 2**64 = 0, whatever the keys."""
    forged = payload.clone()
    forged[7] ^= 0x80  # bit 63 of word 0 (little-endian)
    forged[15] ^= 0x80  # bit 63 of word 1
    return forged


def test_bit63_forgery_leaves_the_public_checksum_unchanged():
    """Why the keyed checksum is not a MAC (it stays the accident check of unauthenticated rounds)."""
    x = torch.randint(0, 256, (3 * 8 * cs.ROW_WORDS + 77,), dtype=torch.uint8)
    forged = flip_bit63_of_two_words(x)
    assert not torch.equal(forged, x)
    for seed in (0, 11, 2**62 + 5):
        assert cs.checksum(forged, seed) == cs.checksum(x, seed)


def test_man_in_the_middle_bit63_forgery_is_refused_with_receivers_unchanged(receivers, tiny):
    """A man-in-the-middle without the key flips bit 63 of two words of one bucket of an
    authenticated round: the bucket MAC must refuse it, every receiver keeping its tensors."""
    driver, trainer_a, trainer_b, _ = tiny
    sender = connect(receivers, SECRET)
    sender.refit(driver, trainer_a)
    before = digests(receivers)
    forged_at = []

    def forge(bucket, piece, t):
        if bucket == 1 and not forged_at:
            forged_at.append(bucket)
            return flip_bit63_of_two_words(t)
        return None

    mitm = wrap_group(sender.group, wire=forge)
    with pytest.raises(TransportError) as err:
        sender.refit(driver, trainer_b)
    msg = str(err.value)
    assert forged_at == [1]
    assert "rank 1 a bucket failed its checksum; rank 2 a bucket failed its checksum" in msg, msg
    assert msg.count("bucket 1/") >= 2 and "failed its checksum (seal mismatch" in msg, msg
    assert SECRET not in msg
    assert digests(receivers) == before
    sender.group.pg = mitm.pg
    sender.refit(driver, trainer_b)  # the same group, no forgery: B arrives
    assert digests(receivers) == [{n: sha256(t) for n, t in driver.run(trainer_b)}] * 2
    sender.close()


def nh_oracle(payload: bytes, key: bytes) -> list[tuple[int, int]]:
    """NH per chunk, both Toeplitz iterations, in Python integers (RFC 4418 section 5.2.2:
    sum of (m_2i + k_2i mod 2^32) * (m_2i+1 + k_2i+1 mod 2^32) mod 2^64; 16-byte key shift)."""
    n = len(payload)
    chunks = max(1, -(-n // nh.CHUNK_BYTES))
    padded = payload + bytes(chunks * nh.CHUNK_BYTES - n)
    k = [int.from_bytes(key[4 * i:4 * i + 4], "little") for i in range(len(key) // 4)]
    out = []
    for c in range(chunks):
        m = [int.from_bytes(padded[c * nh.CHUNK_BYTES + 4 * i:c * nh.CHUNK_BYTES + 4 * i + 4], "little")
             for i in range(nh.CHUNK_BYTES // 4)]
        row = []
        for it in range(2):
            kk = k[4 * it:]
            y = sum(((m[2 * i] + kk[2 * i]) % 2**32) * ((m[2 * i + 1] + kk[2 * i + 1]) % 2**32)
                    for i in range(len(m) // 2)) % M64
            row.append(y - M64 if y >= 2**63 else y)
        out.append(tuple(row))
    return out


@pytest.mark.parametrize("n", [0, 5, nh.CHUNK_BYTES, 2 * nh.CHUNK_BYTES + 13])
def test_nh_equals_the_rfc4418_formula(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    key = bytes(torch.randint(0, 256, (nh.KEY_BYTES,), dtype=torch.uint8, generator=g).tolist())
    got = nh.nh(x, nh.key_from_bytes(key, torch.device("cpu")))
    assert [tuple(r) for r in got.tolist()] == nh_oracle(bytes(x.tolist()), key)
    assert nh.nh(x[1:], nh.key_from_bytes(key, torch.device("cpu"))).tolist() == \
        nh.nh(x[1:].clone(), nh.key_from_bytes(key, torch.device("cpu"))).tolist()  # storage offset 1


def test_bucket_mac_refuses_the_bit63_forgery_and_integrity_seal_does_not():
    x = torch.randint(0, 256, (3 * nh.CHUNK_BYTES + 77,), dtype=torch.uint8)
    forged = flip_bit63_of_two_words(x)
    mac = bytes(range(32))
    keyed, public = Sealer(Secret(SECRET), mac, x.device), Sealer(None, mac, x.device)
    assert not keyed.verifies(4, 0, forged, keyed.seal(4, 0, x))
    assert public.verifies(4, 0, forged, public.seal(4, 0, x))  # accidents only: the reason for the MAC
    assert keyed.verifies(4, 0, x, keyed.seal(4, 0, x))
    assert not keyed.verifies(5, 0, x, keyed.seal(4, 0, x))  # bound to the bucket index
    other = Sealer(Secret(SECRET), bytes(32), x.device)  # another round: another NH key
    assert not torch.equal(other.key, keyed.key) and not keyed.verifies(4, 0, x, other.seal(4, 0, x))
    for pos, bit in ((0, 0), (7, 7), (x.numel() - 1, 7), (nh.CHUNK_BYTES + 3, 5)):
        y = x.clone()
        y[pos] ^= 1 << bit
        assert not keyed.verifies(4, 0, y, keyed.seal(4, 0, x)), (pos, bit)


@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_seal_fed_piece_by_piece_equals_the_whole_buckets(secret):
    from qstrat.transport.security.seal import PIECE_BYTES, pieces

    x = torch.randint(0, 256, (2 * PIECE_BYTES + 3 * nh.CHUNK_BYTES + 11,), dtype=torch.uint8)
    sealer = Sealer(Secret(secret) if secret else None, bytes(range(32)), x.device)
    state = sealer.begin(3, x.numel())
    cut = pieces(x)
    assert [c.numel() for c in cut] == [PIECE_BYTES, PIECE_BYTES, 3 * nh.CHUNK_BYTES + 11]
    for c in cut:
        state.update(c)
    assert state.seal(0) == sealer.seal(3, 0, x) and state.verifies(0, sealer.seal(3, 0, x))
    early = sealer.begin(3, x.numel())
    early.update(x[:100])
    with pytest.raises(ValueError, match="pieces before the last must be whole"):
        early.update(x[100:200])
    with pytest.raises(ValueError, match=r"100 of \d+ bytes fed"):
        early.seal(0)


def _slot0(field, value):
    def tamper(info):
        info["wire_manifest"]["slots"][0][field] = value
        return info
    return tamper


def _drop(key):
    def tamper(info):
        del info[key]
        return info
    return tamper


def _set(key, value):
    def tamper(info):
        info[key] = value
        return info
    return tamper


@pytest.mark.parametrize(("tamper", "why"), [
    (_slot0("dtype", None), "malformed wire manifest: slot 0: name and dtype must be strings"),
    (_slot0("nbytes", float("inf")), "malformed wire manifest: OverflowError"),
    (_drop("wire_manifest"), "malformed wire manifest"),
    (_set("mode", "sideways"), "with a round mode in ('atomic', 'bounded', 'delta', 'bounded-delta'), got mode 'sideways'"),
    (lambda info: {**info, "wire_manifest": {**info["wire_manifest"], "alignment": 0}},
     "malformed wire manifest: alignment 0"),
], ids=["dtype-none", "nbytes-inf", "no-wire-manifest", "bad-mode", "alignment-0"])
def test_a_malformed_update_info_is_refused_in_the_vote_not_after_the_timeout(receivers, tiny, tamper, why):
    """One engine gets a malformed update_info (fields of the wrong type or range, a missing key,
    an unknown mode): it refuses in the round's accept vote, so the sender and the other engine
    hear it at once - before, the engine raised before the round's collectives and every other
    rank waited out the group timeout (20 s here). Nothing is loaded; the group stays usable."""
    driver, trainer_a, trainer_b, _ = tiny
    before = digests(receivers)
    clients = [receivers[0].rpc,
               EditingClient(receivers[1].rpc, lambda m, args: (tamper(args[0]),) if m == "update_weights" else args)]
    sender = RefitSender(clients, "127.0.0.1", free_port(), timeout_s=20, bucket_bytes=64 << 10, secret=SECRET)
    sender.connect()
    t0 = time.perf_counter()
    with pytest.raises(TransportError) as err:
        sender.refit(driver, trainer_b)
    assert time.perf_counter() - t0 < 10, "the refusal waited for the group timeout"
    msg = str(err.value)
    assert "refused" in msg and why in msg and SECRET not in msg, msg
    assert digests(receivers) == before
    sender.clients[1] = receivers[1].rpc  # the same group, an intact update_info: B arrives
    sender.refit(driver, trainer_b)
    assert digests(receivers) == [{n: sha256(t) for n, t in driver.run(trainer_b)}] * 2
    sender.close()


@pytest.mark.parametrize(("configured", "address", "port"), [
    ("127.0.0.1", "127.0.0.1", 29600), ("127.0.0.1:29600", "127.0.0.1", 29600),
    ("::1", "::1", 29600), ("[::1]", "::1", 1), ("[::1]:29600", "::1", 29600),
    ("fe80::1", "fe80:0:0:0:0:0:0:1", 5), ("trainer-0:29600", "trainer-0", 29600),
])
def test_a_configured_address_accepts_its_own_trainer_ipv6_included(configured, address, port):
    """IPv6 literals, bare or bracketed, compare as addresses (before: the last ':' was taken
    as the port separator, so '::1' refused the trainer at ::1)."""
    from qstrat.transport.security.address import check_address

    check_address(configured, address, port)


@pytest.mark.parametrize(("configured", "address", "port", "error"), [
    ("::1", "::2", 29600, "TransferAuthError"), ("[::1]:29600", "::1", 29601, "TransferAuthError"),
    ("127.0.0.1:29600", "127.0.0.2", 29600, "TransferAuthError"),
    ("127.0.0.1:", "127.0.0.1", 29600, "ValueError"), ("127.0.0.1:notaport", "127.0.0.1", 1, "ValueError"),
    ("[::1]x", "::1", 1, "ValueError"), ("127.0.0.1:70000", "127.0.0.1", 70000, "ValueError"),
])
def test_another_address_or_a_malformed_setting_is_refused_naming_it(configured, address, port, error):
    from qstrat.transport.security.address import check_address

    with pytest.raises(Exception) as err:
        check_address(configured, address, port)
    assert type(err.value).__name__ == error
    assert configured in str(err.value) and ENV_ADDRESS in str(err.value)


def test_a_secret_is_bytes_or_text_and_bad_text_does_not_carry_it():
    """An int or a list is not a key (Secret(16) was 16 zero bytes); undecodable text from the
    environment is refused naming the variable, and the exception carries no part of it."""
    with pytest.raises(TypeError, match="bytes or str expected, got int"):
        Secret(16)
    with pytest.raises(TypeError, match="got list"):
        Secret([1] * 16)
    bad = "\udcffTOPSECRETTOPSECRET"
    with pytest.raises(ValueError) as err:
        Secret(bad)
    assert ENV_SECRET in str(err.value) and "TOPSECRET" not in repr(err.value.args)
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert Secret(bytearray(b"k" * 16)) is not None
