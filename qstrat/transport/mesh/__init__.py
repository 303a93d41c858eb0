"""Mesh rounds: every trainer rank sends its share straight to the engine ranks that load it.

- :mod:`.routing`: :class:`ReceiverLayout`, ``share_of``, :class:`MeshRoutes`: owner and share of
  every output
- :mod:`.steps`: the steps every rank takes
- :mod:`.sender`: :class:`MeshSender`, ``PairOut``: a trainer rank's side
- :mod:`.receiver`: :func:`receive_mesh_round`, :class:`MeshReceiver`, ``PairIn``: an engine rank's
  side
- :mod:`.bounded`: :class:`BoundedRoutes`, :class:`BoundedShare`: bounded rounds, each engine rank
  loading unit by unit under ``staged_bytes``
- :mod:`.pair_delta`: delta mode per (sender, engine rank) pair: :class:`DeltaMeshSender`,
  :class:`DeltaMeshReceiver`, ``PairBases`` (each pair's base, patch stream and digests; the
  round resent whole when only the delta was refused)
- :mod:`.engine`: an engine rank's mesh round on its ``ReceiverSession`` (checked, whole shapes to
  vLLM)
- :mod:`.refit`: :class:`MeshRefitSender`: the call every trainer rank makes; rank 0 drives the
  engines
"""
