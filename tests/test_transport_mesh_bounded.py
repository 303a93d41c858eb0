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
FORMATS = ["block-fp8", "mxfp8", "nvfp4"]


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
