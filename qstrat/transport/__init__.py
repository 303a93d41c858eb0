"""Refit across processes: qstrat's weight transport on torch.distributed (gloo / NCCL).

- :mod:`.wire_manifest`: names, dtypes, shapes, byte offsets, bucket boundaries, wire order, digest;
  computed from the plan before any data flows, checked by every receiver.
- :mod:`.buckets`: packing, zero-copy unpacking.
- :mod:`.checksum`: the per-bucket integrity checksum, tensor ops on the payload's device.
- :mod:`.nh`: NH universal hashing (UMAC, RFC 4418) on the payload's device, for the bucket MAC.
- :mod:`.seal`: the bucket seal both sides compute (MAC with a secret, integrity seal without).
- :mod:`.keys`: the shared secret and its key schedule (one HKDF subkey per use), the MACs.
- :mod:`.auth`: round authentication (what the round MAC binds, a receiver's checks, signed init).
- :mod:`.address`: the one trainer address an engine may join.
- :mod:`.group`: the stateless trainer<->engines process group, timeouts on everything.
- :mod:`.protocol`: the steps of one round (challenge, header, accept vote, buckets, commit vote)
  and its outcome (committed, refused, mixed).
- :mod:`.outgoing`: the sender's bucket stream (source, pack buffers, sealing, ABORT protocol).
- :mod:`.timing`: wall seconds by phase, for sender and receivers.
- :mod:`.engine_check`: a round against an engine's manifest (the in-process sink's checks).
- :mod:`.sender`: :class:`RefitSender`, the trainer side, driven from a ``RefitDriver`` plan: a
  round's weight-sync calls around the stream; its pieces: :mod:`.fanout` (each call on every
  engine), :mod:`.sender_protocol` (rank 0's steps and the round's outcome), :mod:`.delta_rounds`
  (the sender's delta base: a delta or a whole round) with :mod:`.delta_stream` (a delta round's
  buckets encoded and posted as they are quantized), :mod:`.report` (:class:`TransferReport`).
- :mod:`.receiver`: :func:`receive_round` (atomic or bounded).
- :mod:`.session`: a receiver's state across rounds (secret, address, counter, the mix flag, the
  delta base); its pieces: :mod:`.acceptance` (the accept vote's checks), :mod:`.landing` (the
  loader's begin/load/end), :mod:`.mix_flag` (a receiver's MIX flag, on
  :mod:`qstrat.mix_flag`'s rule), :mod:`.delta_rebuild` (the
  receiver's delta base) with :mod:`.delta_receive` (a delta round rebuilt and verified bucket by
  bucket).
- :mod:`.delta`: delta rounds (the round's stream patched against the last committed one, tile by
  tile; digests of the rebuilt buckets; round ids).
- :mod:`.standalone`: :class:`StandaloneReceiver` (no engine).
- Mesh rounds (every trainer rank straight to the engine ranks that load its share):
  :mod:`.routing` (owners and shares), :mod:`.mesh` (the steps), :mod:`.mesh_sender`
  (:class:`~qstrat.transport.mesh_sender.MeshSender`), :mod:`.mesh_receiver`
  (:func:`~qstrat.transport.mesh_receiver.receive_mesh_round`,
  :class:`~qstrat.transport.mesh_receiver.MeshReceiver`), :mod:`.mesh_engine` (an engine rank's
  mesh round on its session), :mod:`.mesh_refit` (:class:`~qstrat.transport.mesh_refit.MeshRefitSender`,
  the trainer-side call into vLLM engines).

The engine side is a vLLM weight-transfer backend, :mod:`qstrat.engine.transfer_backend`
(``LLM(weight_transfer_config={"backend": "qstrat"})``). See docs/transport.md.
"""
from qstrat.transport.wire_manifest import (WireManifest, build_wire_manifest, check_against,
                                            wire_manifest_for_plan)
from qstrat.transport.receiver import receive_round
from qstrat.transport.standalone import StandaloneReceiver
from qstrat.transport.sender import RefitSender, TransferReport

__all__ = ["RefitSender", "StandaloneReceiver", "TransferReport", "WireManifest", "build_wire_manifest",
           "check_against", "wire_manifest_for_plan", "receive_round"]
