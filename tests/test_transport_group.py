"""qstrat.transport.group and the vote/describe/lost steps of qstrat.transport.protocol on a
one-rank gloo group (no peer process). A round between real processes: tests/test_transport.py;
with an engine: tests/test_engine_transport.py."""
from __future__ import annotations

import pytest
import torch

from qstrat.errors import TransportError
from qstrat.transport import protocol
from qstrat.transport.group import open_group
from transport_harness import free_port


@pytest.fixture
def solo():
    group = open_group("127.0.0.1", free_port(), 0, 1, timeout_s=10)
    yield group
    group.close()


def test_a_one_rank_group_sums_broadcasts_and_votes(solo):
    assert (solo.rank, solo.world_size, solo.device, solo.timeout_s) == (0, 1, torch.device("cpu"), 10)
    t = torch.tensor([3, -4], dtype=torch.int64)
    assert solo.sum(t) is t and t.tolist() == [3, -4]
    b = torch.arange(5, dtype=torch.uint8)
    solo.wait(solo.broadcast(b))
    assert b.tolist() == [0, 1, 2, 3, 4]
    mac = bytes(range(32))
    assert protocol.vote(solo, protocol.ACCEPT, protocol.OK, False, None, mac) == protocol.Votes([0], [False])
    assert protocol.vote(solo, protocol.COMMIT, protocol.CHECKSUM, True, None, mac) == protocol.Votes(
        [protocol.CHECKSUM], [True])


def test_close_is_idempotent_and_lost_closes_the_group(solo):
    err = protocol.lost(solo, "bucket 3/7", "Connection closed by peer")
    assert isinstance(err, TransportError) and solo.pg is None and solo.store is None
    assert str(err) == ("rank 0: bucket 3/7: Connection closed by peer (timeout 10 s; the transfer group is "
                        "closed, call init_weight_transfer_engine again)")
    solo.close()  # a second close does nothing
    assert solo.pg is None


def test_describe_names_each_failing_rank_and_its_reason():
    assert protocol.describe([0, 0, 0]) == ""
    assert protocol.describe([0, protocol.CHECKSUM, protocol.REJECTED]) == (
        "rank 1 a bucket failed its checksum; rank 2 rejected the wire manifest")
    assert protocol.describe([protocol.SENDER_ABORT, 0, 99]) == (
        "rank 0 the sender aborted the stream; rank 2 status 99")


@pytest.mark.parametrize(("statuses", "holding", "outcome"), [
    ([0, 0, 0], [False, True, True], "committed"),
    ([0, 0, protocol.CHECKSUM], [False, False, False], "refused"),
    ([0, 0, protocol.CHECKSUM], [False, True, False], "mixed"),  # rank 1 loaded, rank 2 refused
    ([protocol.SENDER_ABORT, protocol.MIXED, 0], [False, True, True], "mixed"),
])
def test_one_outcome_for_every_mode_from_the_commit_vote(statuses, holding, outcome):
    assert protocol.outcome(protocol.Votes(statuses, holding)) == outcome


@pytest.mark.parametrize("kwargs,message", [
    ({"backend": "mpi"}, "transport backend 'mpi': use 'gloo' (CPU) or 'nccl' (GPU)"),
    ({"rank": 2}, "rank 2 outside world_size 2"),
    ({"rank": -1}, "rank -1 outside world_size 2"),
])
def test_open_group_refuses_bad_arguments_before_connecting(kwargs, message):
    args = {"master_address": "127.0.0.1", "master_port": free_port(), "rank": 1, "world_size": 2, **kwargs}
    with pytest.raises(TransportError) as info:
        open_group(**args)
    assert str(info.value) == message


def test_a_rendezvous_nobody_hosts_is_a_transport_error_naming_the_address():
    port = free_port()  # nothing listens there: rank 1 waits for rank 0's store
    with pytest.raises(TransportError, match=rf"^rank 1: could not join the transfer group at 127\.0\.0\.1:{port} "
                                             r"\(gloo, world_size 2, timeout 1 s\): "):
        open_group("127.0.0.1", port, 1, 2, timeout_s=1)
