"""Refit across processes: qstrat's weight transport on torch.distributed (gloo / NCCL).

A round's wire format and steps live here; each side and each kind of round in a subpackage.
The engine side is a vLLM weight-transfer backend, :mod:`qstrat.vllm.engine.transfer_backend`
(``LLM(weight_transfer_config={"backend": "qstrat"})``). See docs/transport.md.

- :mod:`.wire_manifest`: the wire manifest: names, dtypes, shapes, byte offsets, buckets, wire
  order, digest (not the engine manifest)
- :mod:`.buckets`: bucket packing (sender) and zero-copy unpacking (receiver)
- :mod:`.group`: the stateless trainer<->engines process group (gloo / NCCL), timeouts on everything
- :mod:`.protocol`: the steps of one round (challenge, header, accept vote, buckets, commit vote)
  and its outcome
- :mod:`.engine_check`: a round against an engine's manifest (the in-process sink's checks)
- :mod:`.timing`: wall seconds by phase, for sender and receivers
- :mod:`.jit`: numba where it imports: the transport's CPU kernels compiled to one loop each
- :mod:`.rpc_errors`: what an engine's weight-sync call failed with, as the trainer sees it
- :mod:`.send` (package): the trainer side: :class:`RefitSender` and its pieces
- :mod:`.receive` (package): a receiver: one round, a session across rounds, the standalone receiver
- :mod:`.security` (package): keys, round authentication, the trainer address, bucket checksums and
  MACs
- :mod:`.delta` (package): delta rounds: the encoding, each side's delta base and stream, the churn
  study
- :mod:`.mesh` (package): mesh rounds: every trainer rank straight to the engine ranks that load its
  share
"""
from qstrat.transport.wire_manifest import (WireManifest, build_wire_manifest, check_against,
                                            wire_manifest_for_plan)
from qstrat.transport.receive.receiver import receive_round
from qstrat.transport.receive.standalone import StandaloneReceiver
from qstrat.transport.send.sender import RefitSender, TransferReport

__all__ = ["RefitSender", "StandaloneReceiver", "TransferReport", "WireManifest", "build_wire_manifest",
           "check_against", "wire_manifest_for_plan", "receive_round"]
