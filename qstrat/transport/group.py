"""The trainer<->receivers process group: torch.distributed (gloo on CPU, NCCL on GPU).

The group is built from a ``TCPStore`` and a c10d backend object (``ProcessGroupGloo`` /
``ProcessGroupNCCL``) directly, not with ``init_process_group``: a vLLM worker already owns the
default process group, and a trainer usually does too. Rank 0 is the sender (it hosts the
store); receivers are ranks 1..N. Every operation has a timeout: a lost peer is an error, not a
hang.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from qstrat.errors import TransportError

#: Default timeout (seconds) for the rendezvous and for each collective.
DEFAULT_TIMEOUT_S = 60.0


class GroupError(RuntimeError):
    """A collective failed or timed out (c10d's message); raised without exception context."""


@dataclass
class TransferGroup:
    """An open group: ``rank`` of ``world_size``; ``device`` is where its tensors must live."""

    pg: Any
    rank: int
    world_size: int
    device: torch.device
    timeout_s: float
    store: Any = None

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start a broadcast from rank 0 (in place on receivers); returns the c10d Work."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self._timedelta()
        return self.pg.broadcast([tensor], opts)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        """Start a point-to-point send of contiguous ``tensor`` to rank ``dst``; returns the Work."""
        return self.pg.send([tensor], dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Any:
        """Start a point-to-point receive into contiguous ``tensor`` from rank ``src``; returns the Work."""
        return self.pg.recv([tensor], src, tag)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) ``tensor`` in place and wait for it."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.timeout = self._timedelta()
        self.wait(self.pg.allreduce([tensor], opts))
        return tensor

    def wait(self, work: Any) -> None:
        """Wait for a Work within the group timeout.

        Raises: GroupError (a RuntimeError) with c10d's message, holding no reference to the
            Work: gloo closes its connections only once every Work of the group is gone.
        """
        try:
            work.wait(self._timedelta())
            return
        except RuntimeError as exc:
            error = str(exc)
        del work
        raise GroupError(error)

    def close(self) -> None:
        """Shut the group down (peers still waiting on it get a connection error). Idempotent."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - already broken; closing must not raise
                pass
        self.store = None

    def _timedelta(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)


def open_group(master_address: str, master_port: int, rank: int, world_size: int,
               backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S) -> TransferGroup:
    """Join the transfer group (blocks until all ``world_size`` ranks joined, or ``timeout_s``).

    Args:
        master_address, master_port: the sender's TCPStore (rank 0 creates it).
        rank: 0 for the sender; receivers 1..world_size-1.
        backend: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors, current device).
        timeout_s: rendezvous and per-collective timeout in seconds.
    Raises: TransportError for an unknown backend, NCCL without CUDA, or a rendezvous that
        failed or timed out (naming the address and rank).
    """
    if backend not in ("gloo", "nccl"):
        raise TransportError(f"transport backend {backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
    if not 0 <= rank < world_size:
        raise TransportError(f"rank {rank} outside world_size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout)
        prefix = dist.PrefixStore("qstrat.transport", store)
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
            device = torch.device("cpu")
        else:
            if not torch.cuda.is_available():
                raise TransportError("transport backend 'nccl' needs a CUDA device; on CPU use backend='gloo'")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
            device = torch.device("cuda", torch.cuda.current_device())
    except TransportError:
        raise
    except Exception as exc:  # c10d raises RuntimeError / DistStoreError
        raise TransportError(f"rank {rank}: could not join the transfer group at "
                             f"{master_address}:{master_port} ({backend}, world_size {world_size}, "
                             f"timeout {timeout_s:g} s): {exc}") from exc
    return TransferGroup(pg, rank, world_size, device, timeout_s, store)
