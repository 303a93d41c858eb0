"""Bounded mesh rounds (qstrat/transport/mesh/bounded.py): two expert-parallel trainer ranks into the
two engine-less ranks of an expert-parallel TP=2 engine, each a process on a gloo group over
loopback (tests/mesh_harness.py's run_rounds: several rounds on one group).

What each rank should hold is computed HERE from the single-process driver's output and the test's
own reading of the rank's share (test_transport_mesh.expected_share), not with the mesh routing;
the bound an engine rank needs is checked against the test's own sum of its largest unit."""
from __future__ import annotations

import pytest
import torch
from mesh_harness import model_and_plans, run_rounds
from test_transport_mesh import EP_ENGINE, SENDERS, as_bytes, expected_share
from transport_harness import free_port

from qstrat.execute.sharding import ExpertParallel
from qstrat.transport.mesh.bounded import BoundedRoutes
from qstrat.transport.mesh.routing import ReceiverLayout, mesh_outputs
from qstrat.transport.wire_manifest import reload_unit

LAYOUTS = [ReceiverLayout.from_dict(d) for d in EP_ENGINE]
ENGINE = [SENDERS, SENDERS + 1]  # the engine ranks' group ranks
FORMATS = ["bf16", "block-fp8", "mxfp8", "nvfp4-experts"]


def shares(fmt: str, seed: int) -> list[dict[str, torch.Tensor]]:
    """Each engine rank's expected share of the tiny model ``seed`` (name -> its part)."""
    from conftest import per_expert_view

    driver, state, _, _, plan = model_and_plans(fmt, SENDERS, seed)
    single = {n: t.clone() for n, t in driver.run(per_expert_view(state), plan=plan)}
    return [expected_share(single, layout) for layout in LAYOUTS]


def as_held(share: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """A share as the harness reports what a receiver holds."""
    return {n: as_bytes(t) for n, t in share.items()}


def unit_bytes(fmt: str) -> list[int]:
    """Each engine rank's largest reload unit (bytes of its parts, no padding), the test's own sum."""
    from conftest import per_expert_view

    driver, state, _, _, plan = model_and_plans(fmt, SENDERS)
    single = dict(driver.run(per_expert_view(state), plan=plan))
    out = []
    for layout in LAYOUTS:
        units: dict[str, int] = {}
        for n, t in expected_share(single, layout).items():
            units[reload_unit(n)] = units.get(reload_unit(n), 0) + t.nbytes
        out.append(max(units.values()))
    return out


def need(fmt: str) -> int:
    """The largest bound any engine rank of LAYOUTS needs (the routing's own figure)."""
    _, _, _, _, plan = model_and_plans(fmt, SENDERS)
    routes = BoundedRoutes(mesh_outputs(plan, ExpertParallel(SENDERS, 8).owner), SENDERS, LAYOUTS, 1 << 16, 64)
    return max(routes.schedule(r).need for r in range(len(LAYOUTS)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_bounded_round_loads_what_an_atomic_round_does_under_its_bound(fmt):
    bound = need(fmt)
    largest = unit_bytes(fmt)
    assert max(largest) <= bound <= max(largest) + 64 * 64  # the largest unit, padding aside
    res = run_rounds(free_port(), fmt, SENDERS, EP_ENGINE,
                     [{"mode": "atomic"}, {"mode": "bounded", "staged_bytes": bound, "clear": True}])
    assert all(s == "ok" and all(r[0] == "ok" for r in v) for s, v in res.values()), res
    want = shares(fmt, 1)
    for i, r in enumerate(ENGINE):
        (_, _, (atomic, _, _)), (_, _, (got, stats, units)) = res[r][1]
        assert atomic == as_held(want[i]) and got == atomic  # byte for byte, every tensor of the share
        assert stats["staged_bytes"] == bound
        assert 0 < stats["staged_peak"] <= bound  # counted where the buffers are allocated
        assert stats["staged_peak"] < stats["share_bytes"] / 2  # not the share staged whole
        assert stats["tensor_bytes"] == sum(t.nbytes for t in want[i].values())
        assert sorted(units) == sorted({reload_unit(n) for n in want[i]})
        print(f"[bounded {fmt}] rank {r}: peak {stats['staged_peak']} of bound {bound}, share "
              f"{stats['share_bytes']} bytes, largest unit {largest[i]}")


def test_a_bound_below_the_largest_unit_is_refused_before_any_data():
    res = run_rounds(free_port(), "mxfp8", SENDERS, EP_ENGINE, [{"mode": "bounded", "staged_bytes": 4096}])
    need_ = need("mxfp8")
    for r in range(SENDERS + len(EP_ENGINE)):
        status, message, held = res[r][1][0]
        assert status == "err" and f"staged_bytes=4096 is below what engine rank" in message, res[r]
        assert f"raise staged_bytes to at least {need_}" in message or r < SENDERS, message
        if held is not None:
            assert held[0] == {} and held[2] == []  # nothing received, nothing loaded


@pytest.fixture(scope="module")
def before_after():
    """Each engine rank's share of the tiny model, seed 1 (the round before) and seed 2 (the faulty one)."""
    return shares("mxfp8", 1), shares("mxfp8", 2)


def faulty_round(faults: dict[int, dict], before_after) -> tuple[dict, set[int]]:
    """An atomic round of seed 1, then a bounded round of seed 2 with ``faults``; checks every
    engine rank: one that loaded units raised MixedWeightsError and holds exactly those units new
    (the rest of seed 1), one that loaded nothing raised TransportError and holds seed 1 whole.
    Returns (the results, the engine ranks that hold a mix)."""
    before, after = before_after
    res = run_rounds(free_port(), "mxfp8", SENDERS, EP_ENGINE, [{"mode": "atomic"}, {"mode": "bounded", "seed": 2}],
                     faults)
    mixed = set()
    for i, r in enumerate(ENGINE):
        (first, _, _), (status, message, (got, stats, units)) = res[r][1]
        assert first == "ok" and status == "err", res[r]
        want = {n: as_bytes(after[i][n] if reload_unit(n) in units else t) for n, t in before[i].items()}
        assert got == want, f"rank {r}: loaded units {units}"
        assert stats["units_loaded"] == len(units)
        if units:
            mixed.add(r)
            assert message.startswith("MixedWeightsError: ") and "this receiver holds a MIX" in message, message
            assert f"{len(units)} of 7 reload units are new" in message, message
        else:
            assert message.startswith("TransportError: ") and "nothing loaded on this rank" in message, message
    return res, mixed


def _senders_name(res: dict, mixed: set[int]) -> None:
    for r in range(SENDERS):
        status, message, _ = res[r][1][1]
        assert status == "err" and message.startswith("MixedWeightsError: "), res[r]
        assert f"ranks {', '.join(map(str, sorted(mixed)))} hold new weights" in message, message


def test_a_flipped_byte_before_one_rank_loaded_anything_mixes_only_the_rank_that_did(before_after):
    # trainer rank 0's first bucket to engine rank 3 (the embedding, its first unit): rank 3 loads nothing
    res, mixed = faulty_round({0: {"flip_to": 3}}, before_after)
    assert mixed == {2}
    assert "rank 3: bucket 0 from rank 0 failed its checksum (seal mismatch)" in res[3][1][1][1]
    assert "ranks 2 hold new weights: a MIX across ranks" in res[3][1][1][1]
    assert "rank 3 a bucket failed its checksum" in res[2][1][1][1]  # rank 2 loaded everything: a mix too
    _senders_name(res, mixed)


def test_a_wrong_pair_key_mid_round_mixes_the_ranks_that_loaded(before_after):
    # trainer rank 1 seals its buckets to engine rank 2 under another pair's keys: rank 2 loads the
    # embedding (trainer rank 0's) and stops at rank 1's first piece of layer 0
    res, mixed = faulty_round({1: {"wrong_key_to": 2}}, before_after)
    assert mixed == {2, 3}
    assert res[2][1][1][2][2] == ["model.embed_tokens"]
    assert "rank 2: bucket 0 from rank 1 failed its checksum (seal mismatch)" in res[2][1][1][1]
    _senders_name(res, mixed)


def test_a_sender_raising_mid_round_mixes_the_ranks_that_loaded(before_after):
    res, mixed = faulty_round({1: {"raise_at": 5}}, before_after)
    assert mixed == {2, 3}  # both loaded the embedding (trainer rank 0's) before rank 1's first piece
    for r in ENGINE:
        assert "from rank 1: the sender aborted the stream" in res[r][1][1][1], res[r]
    _senders_name(res, mixed)
    assert "KeyError" in res[1][1][1][1] or "trainer-side failure" in res[1][1][1][1]


def test_a_sender_killed_mid_round_mixes_the_ranks_that_loaded(before_after):
    res, mixed = faulty_round({0: {"kill_at": 5}}, before_after)
    assert res[0] == ("dead", 17)
    for r in ENGINE:
        message = res[r][1][1][1]
        assert "truncated" in message or "failed" in message, message
        if r in mixed:
            assert "ranks holding new weights: unknown: the group is closed" in message, message
    status, message, _ = res[1][1][1]
    assert status == "err" and message.startswith("TransportError: "), res[1]
    assert "engine ranks that loaded a unit hold a MIX" in message, message
