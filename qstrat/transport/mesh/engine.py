"""A mesh round on a receiver with an engine (:class:`~qstrat.transport.receive.session.ReceiverSession`,
the vLLM backend's): the engine rank receives its share from every trainer rank
(:func:`~qstrat.transport.mesh.receiver.receive_mesh_round`), after checking the round against
what its engine loads, and stages it; the session's ``finish`` loads it (atomic, or delta: atomic
rounds whose pairs travel as patches against each pair's base, :mod:`qstrat.transport.mesh.pair_delta`),
or loads it unit by unit as it arrives (bounded: :mod:`qstrat.transport.mesh.bounded`).

What the engine is handed: each tensor of its share in the WHOLE tensor's shape
(:meth:`~qstrat.transport.mesh.routing.ShareSlice.embed`: the received slice where this rank's TP
loader narrows, zeros elsewhere). vLLM's weight loaders narrow a checkpoint tensor by TP rank
themselves (``ColumnParallelLinear.weight_loader``, ``RowParallelLinear.weight_loader``,
``FusedMoE._load_w13`` / ``_load_w2``: ``loaded_weight.narrow(dim, tp_rank * shard, shard)``), so
they read exactly the received bytes; the zeros are never read.
"""
from __future__ import annotations

from typing import Any

import torch

from qstrat.errors import TransportError, WireManifestMismatchError
from qstrat.transport.receive.acceptance import check_expected
from qstrat.transport.mesh.bounded import BoundedRoutes
from qstrat.transport.mesh.pair_delta import receive_delta_round
from qstrat.transport.mesh.receiver import receive_mesh_round
from qstrat.transport.mesh.routing import MeshRoutes, ReceiverLayout
from qstrat.transport.wire_manifest import build_wire_manifest

#: The ``update_info`` key of a mesh round: the routes document (:meth:`MeshRoutes.to_dict`).
MESH_KEY = "mesh"


class ShareCheck:
    """The engine rank's accept-vote check of a mesh round: its mode (``update_info``'s, the routes'
    the same: atomic or bounded), then the round's outputs in
    whole shapes (what its loaders are handed; the rank's share is the routing's part of them)
    against the engine (:class:`EngineExpectations`: who
    quantizes, the format, the tensors and whole reload units), then the MIX flag's rule.

    Args: session: the receiver's session (its ``expected`` and ``flag``); info: the round's
        ``update_info``.
    """

    def __init__(self, session: Any, info: dict[str, Any], refusal: TransportError | None = None) -> None:
        self.session, self.info, self.refusal = session, info, refusal
        #: The names of the round's share (once checked).
        self.sent: set[str] = set()

    def __call__(self, routes: MeshRoutes, me: int) -> None:
        """Raise WireManifestMismatchError unless the engine loads this rank's share (or the
        error its layout could not be read with)."""
        if self.refusal is not None:
            raise self.refusal
        mode = "bounded" if isinstance(routes, BoundedRoutes) else "atomic"
        given = self.info.get("mode", "atomic")
        if given != mode and not (mode == "atomic" and given == "delta"):  # delta: atomic routes, patched pairs
            raise WireManifestMismatchError(f"a mesh round's update_info names mode {given!r}, its "
                                            f"routes are {mode}'s (mesh rounds: 'atomic', 'bounded' or 'delta')")
        # the whole round against the engine (an expert-parallel rank's share leaves out the other
        # ranks' experts, which its engine manifest lists); the share is the routing's part of it
        wm = build_wire_manifest(((n, d, shape) for n, d, shape, _ in routes.outputs), routes.bucket_bytes,
                                 routes.alignment)
        self.sent = {n for n, *_ in routes.outputs}
        check_expected(wm, self.info, self.session.expected(), self.session.flag, self.sent)


def receive_mesh(session: Any, info: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Receive one mesh round on ``session``'s group as engine rank ``group.rank``.

    Args: session: a joined session with ``senders`` (from its init info) and ``layout()``
        (this rank's :class:`~qstrat.transport.mesh.routing.ReceiverLayout`, read from its engine);
        info: ``update_info`` with :data:`MESH_KEY` and ``mode`` (``atomic``, ``bounded``, or ``delta``:
        each pair patched against the pair base in ``session.mesh_pairs``,
        :mod:`qstrat.transport.mesh.pair_delta`, and received again whole in the same call when
        only the delta was refused; ``session.stats`` then has ``attempts``).
    Returns: this rank's share as its loader takes it (whole shapes, see the module docstring),
        in wire order (bounded: ``[]``, each unit loaded through ``session.load_bounded`` as its
        pieces verified; a MIX flags the session); ``session.stats`` gets the receive side's counts (``bytes`` received,
        ``share_bytes``, ``tensor_bytes``, ``seconds``, ``stream_s``).
    Raises: TransportError when the session joined without ``senders`` (not a mesh group) or
        has no layout; otherwise as :func:`receive_mesh_round` (a layout that raised
        TransportError - an engine mesh rounds do not cover - refuses the round in the accept
        vote, on every rank, before any data).
    """
    if session.senders is None or session.layout is None:
        raise TransportError("qstrat transfer: a mesh round needs a group joined with 'senders' in its init "
                             "info and a receiver layout (MeshRefitSender's init infos)")
    try:
        layout, refusal = session.layout(), None
    except TransportError as exc:  # e.g. an engine layout mesh rounds do not cover: refused in the vote
        layout, refusal = ReceiverLayout(), exc
    check = ShareCheck(session, info, refusal)
    doc = info[MESH_KEY]
    if isinstance(doc, dict) and doc.get("mode") == "bounded":
        session.load_bounded(lambda on_unit: receive_mesh_round(session.group, doc, int(session.senders), layout,
                                                                session.auth, check, session.stats, whole=True,
                                                                on_unit=on_unit),
                             lambda: check.sent)
        return []
    pairs = session.mesh_pairs if info.get("mode") == "delta" else None

    def receive() -> list[tuple[str, torch.Tensor]]:
        return receive_mesh_round(session.group, doc, int(session.senders), layout, session.auth, check,
                                  session.stats, whole=True, pairs=pairs)

    return receive() if pairs is None else receive_delta_round(receive, session.stats)
