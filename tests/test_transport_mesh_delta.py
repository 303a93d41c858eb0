"""Delta mesh rounds (qstrat/transport/mesh/pair_delta.py; issues 41 and 45): two expert-parallel
trainer ranks into two engine-less expert-parallel receivers (attention narrowed by TP rank 1 / 0
of 2, the odd / even experts whole), over real Adam steps of the tiny Qwen3-MoE at lr 1e-6, each
rank a process on a gloo group over loopback (tests/mesh_delta_harness.py), keyed rounds.

The oracles are computed HERE: what each receiver holds after every round against the
single-process driver's output on the same state cut to the receiver's share by hand
(``test_transport_mesh.expected_share``: what a full mesh round loads, checked byte for byte
there); the bytes on each pair's wire against the size of that pair's patch (the delta encoding
of the pair's parts, cut here from the driver's output, against the previous step's). Faults are
injected from outside the production path (a receiver's pair base dropped, a patch corrupted
before its seal, a byte flipped on the wire, a sender without the secret)."""
from __future__ import annotations

import pytest
import torch
from conftest import per_expert_view
from mesh_delta_harness import FORMATS, digest, run_delta_mesh, save_trajectory, tiny_driver
from mesh_harness import split_state
from test_transport_mesh import expected_share
from transport_harness import free_port

from qstrat.execute.sharding import ExpertParallel
from qstrat.transport.delta import encoding as delta
from qstrat.transport.delta.stream import encode_round
from qstrat.transport.mesh.pair_delta import id_from, id_words
from qstrat.transport.mesh.routing import MeshRoutes, ReceiverLayout, mesh_outputs

S = 2
#: Both ranks of an expert-parallel TP=2 engine: every expert reaches a rank.
LAYOUTS = [ReceiverLayout(1, 2, (1, 3, 5, 7), moe_tp=False), ReceiverLayout(0, 2, (0, 2, 4, 6), moe_tp=False)]
LR = 1e-6


@pytest.fixture(scope="module")
def trajectory(tmp_path_factory):
    """The start and 7 Adam steps, saved for the rank processes: (path, states)."""
    path = str(tmp_path_factory.mktemp("mesh-delta") / "states.pt")
    return path, save_trajectory(path, LR, 7)


def whole(fmt, state):
    """(the single-process driver's output on ``state``: name -> tensor, the round's routes)."""
    driver = tiny_driver(fmt)
    _, _, plan = split_state(driver, state, S)
    single = {n: t.clone() for n, t in driver.run(per_expert_view(state), plan=plan)}
    return single, MeshRoutes(mesh_outputs(plan, ExpertParallel(S, 8).owner), S, LAYOUTS, 1 << 16, 64)


def share_digests(single, layout):
    return {n: digest(t) for n, t in expected_share(single, layout).items()}


def patch_bytes(routes, s, r, new, old):
    """(the payload bytes of the pair's delta round from ``old`` to ``new``: digest and patch per
    bucket; the pair's full payload)."""
    target = routes.pair_manifest(s, r)

    def parts(out):
        return [(sl.name, sl.cut(out[sl.name]).contiguous()) for sl in routes.pair(s, r)]

    base = delta.Base("previous", target.digest, delta.fill_stream(target, parts(old)))
    _, payloads = encode_round(target, iter(parts(new)), base)
    return sum(p.numel() for p in payloads), target.total_bytes


def test_round_ids_travel_as_two_words_and_none_as_zeros():
    rid = "0123456789abcdef00112233445566ff"
    assert id_from(id_words(rid)) == rid and id_words(None) == [0, 0] and id_from([0, 0]) is None


def test_every_delta_round_loads_a_full_rounds_bytes_and_each_pair_carries_only_its_patch(trajectory):
    path, states = trajectory
    states = states[:3]
    torch.save(states, path + ".3")
    res = run_delta_mesh(free_port(), list(FORMATS), S, [lay.to_dict() for lay in LAYOUTS], path + ".3")
    assert all(st == "ok" for st, _ in res.values()), res
    for f, fmt in enumerate(FORMATS):
        prev = None
        for i, state in enumerate(states):
            single, routes = whole(fmt, state)
            for r, layout in enumerate(LAYOUTS):
                st, held, stats = res[S + r][1][f]["delta"][i]
                assert st == "ok", held
                assert held == share_digests(single, layout), (fmt, i, r)
                assert stats["attempts"] == 1
                assert stats["bytes"] == sum(res[s][1][f]["delta"][i][1][S + r] for s in range(S))  # counted on receipt
            for s in range(S):
                st, sent, extra = res[s][1][f]["delta"][i]
                assert st == "ok", sent
                info = extra[0]
                assert info["wire_bytes"] == sum(sent.values()) and info["attempts"] == 1
                if i == 0:
                    assert info["kind"] == "full" and info["reason"] == "no base for the pairs to engine ranks [2, 3]"
                    continue
                assert info["kind"] == "delta" and info["reason"] is None, info
                for r in range(len(LAYOUTS)):
                    patch, full = patch_bytes(routes, s, r, single, prev)
                    print(f"{fmt} step {i} pair {s}->{S + r}: {patch} of {full} bytes ({patch / full:.2%})")
                    assert sent[S + r] == patch < full / 10, (fmt, i, s, r)
            prev = single


def test_faults_resend_whole_when_only_the_delta_was_refused_and_refuse_the_rest_with_nothing_loaded(trajectory):
    """One MXFP8 trajectory, a fault per step: 2 receiver rank 3 dropped its base of the pair from
    trainer rank 1 (stale: refused in the accept vote, resent whole); 3 trainer rank 0's patch of
    bucket 0 to rank 2 corrupted before its seal (the rebuilt digest differs: refused in the commit
    vote, resent whole); 4 trainer rank 1 without the secret (refused before any data, nothing
    loaded; the bases kept: 5 is a delta); 6 a byte flipped on the wire from trainer rank 1 to
    rank 2 (its seal fails: nothing loaded; data went out, so 7 goes whole)."""
    path, states = trajectory
    faults = {3: {"stale_at": (2, 1)}, 0: {"corrupt_patch": (3, 2)}, 1: {"no_secret_at": 4, "flip_wire": (6, 2)}}
    res = run_delta_mesh(free_port(), ["mxfp8"], S, [lay.to_dict() for lay in LAYOUTS], path, faults)
    assert all(st == "ok" for st, _ in res.values()), res
    senders = [res[s][1][0]["delta"] for s in range(S)]
    recvs = [res[S + r][1][0]["delta"] for r in range(len(LAYOUTS))]
    wants = [[share_digests(whole("mxfp8", state)[0], lay) for lay in LAYOUTS] for state in states]

    def holds(i, step):  # every receiver holds exactly step ``step``'s share after round ``i``
        for r in range(len(LAYOUTS)):
            st, held, stats = recvs[r][i]
            assert (held if st == "ok" else stats) == wants[step][r], (i, r, st)

    for i in (0, 1, 2, 3, 5, 7):
        holds(i, i)
        assert all(s[i][0] == "ok" for s in senders), [s[i][1] for s in senders]
    reasons = [s[2][2][0]["reason"] for s in senders]
    assert all(s[2][2][0]["attempts"] == 2 for s in senders)
    assert all(r.startswith("the engine ranks refused the delta: mesh delta refused before any data: rank 3 does "
                            "not hold the delta round's base") for r in reasons), reasons
    assert recvs[1][2][2]["attempts"] == 2 and recvs[0][2][2]["attempts"] == 2
    assert "rank 3: the pair from trainer rank 1: the delta round is encoded against base round" in recvs[1][2][2]["refused"]
    assert "this receiver holds no base" in recvs[1][2][2]["refused"]
    for s in senders:  # refused at the commit vote: every pair resent whole from the streams encoded
        info = s[3][2][0]
        assert info["attempts"] == 2 and info["kind"] == "full", info
        assert "rank 2 did not reconstruct the delta round to the trainer's digests" in info["reason"], info
    refused = recvs[0][3][2]["refused"]
    assert "rank 2: delta bucket 0/" in refused and "from trainer rank 0" in refused and "nothing loaded" in refused
    assert recvs[0][3][2]["refused_bytes"] > 0
    # 4: a sender without the secret: refused before any data everywhere, nothing loaded
    holds(4, 3)
    assert all(s[4][0] == "err" and s[4][1].startswith("TransferAuthError: mesh round refused before any data")
               for s in senders), [s[4][1] for s in senders]
    assert all(r[4][0] == "err" and "refused before any data" in r[4][1] for r in recvs)
    assert all(s[5][2][0]["kind"] == "delta" and s[5][2][0]["attempts"] == 1 for s in senders)  # bases kept
    # 6: a byte flipped on one pair's wire: its seal fails, refused everywhere, nothing loaded
    holds(6, 5)
    assert "rank 2: delta bucket 0/" in recvs[0][6][1] and "from trainer rank 1 failed its checksum" in recvs[0][6][1]
    assert all(s[6][0] == "err" and "nothing loaded" in s[6][1] for s in senders), [s[6][1] for s in senders]
    assert all(r[6][0] == "err" and "nothing loaded" in r[6][1] for r in recvs)
    assert all(s[7][2][0]["kind"] == "full" and s[7][2][0]["reason"].startswith("no base") for s in senders)


def test_an_engine_session_loads_every_delta_round_exactly_and_resends_a_stale_pair_whole(trajectory):
    """The vLLM backend's receiver (ReceiverSession's mesh round, qstrat/transport/mesh/engine.py) in
    delta mode, TP rank 1 of 2 (experts narrowed by TP): its loader is handed every tensor in the
    whole shape, the received slice where TP rank 1 narrows, zeros elsewhere (what vLLM's loaders
    take), after each round exactly the driver's output; at step 2 its base of the pair from
    trainer rank 0 is gone (a restarted worker's): refused before any data, sent again whole."""
    path, states = trajectory
    states = states[:4]
    torch.save(states, path + ".4")
    layout = ReceiverLayout(1, 2)
    res = run_delta_mesh(free_port(), ["block-fp8"], S, [layout.to_dict()], path + ".4",
                         {S: {"session": True, "stale_at": (2, 0)}})
    assert all(st == "ok" for st, _ in res.values()), res
    got = res[S][1][0]["delta"]
    for i, state in enumerate(states):
        single, _ = whole("block-fp8", state)
        part = expected_share(single, layout)
        want = {}
        for name, t in single.items():
            if part[name].shape != t.shape:
                dim = next(d for d in range(t.dim()) if part[name].shape[d] != t.shape[d])
                t = torch.zeros_like(t)
                t.narrow(dim, layout.tp_rank * part[name].shape[dim], part[name].shape[dim]).copy_(part[name])
            want[name] = digest(t)
        st, held, stats = got[i]
        assert st == "ok" and held == want, (i, held if st != "ok" else "")
        assert stats["attempts"] == (2 if i == 2 else 1)
        if i in (1, 3):
            assert stats["bytes"] < stats["share_bytes"] / 10, stats
        for s in range(S):
            assert res[s][1][0]["delta"][i][2][0]["attempts"] == stats["attempts"]
    assert "rank 2: the pair from trainer rank 0: the delta round is encoded against base round" in got[2][2]["refused"]
