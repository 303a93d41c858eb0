"""A receiver without an engine: :class:`StandaloneReceiver` (benchmarks, tests, a checkpoint
writer), the same four weight-sync calls as the vLLM backend, loading into a dict of tensors."""
from __future__ import annotations

from typing import Any

import torch

from qstrat.transport.group import TransferGroup
from qstrat.transport.receive.receiver import Unit
from qstrat.transport.receive.session import ReceiverSession


class StandaloneReceiver:
    """A receiver without an engine, speaking the same four weight-sync calls as a vLLM engine
    with ``weight_transfer_config={"backend": "qstrat"}`` (``init_weight_transfer_engine``,
    ``start_weight_update``, ``update_weights``, ``finish_weight_update``).

    Loaded tensors land in :attr:`tensors` (name -> tensor; a round overwrites the names it sends
    in place, like an engine's reload: memory behaves like an engine's weights plus staging). ``expected``: name -> (dtype name, shape) the wire manifest is
    checked against (None: accept any wire manifest). ``secret``/``address``: as the engine's
    :data:`~qstrat.transport.security.keys.ENV_SECRET` / :data:`~qstrat.transport.security.address.ENV_ADDRESS`
    (default: read from the environment at each ``init_weight_transfer_engine``).
    """

    def __init__(self, expected: dict[str, tuple[str, tuple[int, ...]]] | None = None,
                 secret: Any = None, address: str | None = None) -> None:
        self.expected = expected
        self.tensors: dict[str, torch.Tensor] = {}
        self.session = ReceiverSession(lambda: self.expected, self, secret, address)

    @property
    def group(self) -> TransferGroup | None:
        """The open transfer group (None before ``init_weight_transfer_engine``)."""
        return self.session.group

    # the session's loader: an engine's layerwise reload, here a dict
    def begin_load(self) -> None:
        """Nothing to prepare (an engine starts its layerwise reload here)."""

    def load(self, tensors: Unit) -> None:
        """Copy each tensor into the one of that name held (as an engine's weight loader copies
        into its parameters, so the received buffers can be freed), or keep a copy of a new one."""
        for name, t in tensors:
            held = self.tensors.get(name)
            if held is not None and held.dtype == t.dtype and held.shape == t.shape:
                held.copy_(t)
            else:
                self.tensors[name] = t.clone()

    def end_load(self) -> None:
        """Nothing to finalize."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the group: ``init_info`` as :class:`qstrat.transport.send.sender.RefitSender` sends it."""
        self.session.join(init_info)

    def start_weight_update(self) -> None:
        """Begin a session: drop any staged round (:attr:`tensors` keeps the last commit)."""
        self.session.start()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one round (``{"wire_manifest": ..., "mode": ...}``); raises like
        :func:`~qstrat.transport.receive.receiver.receive_round` and :meth:`ReceiverSession.update`."""
        self.session.update(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Load the staged round into :attr:`tensors`. Raises TransportError without one."""
        self.session.finish()

    @property
    def mixed(self) -> str | None:
        """Why this receiver holds a mix of two rounds (None: it does not)."""
        return self.session.mixed

    def shutdown(self) -> None:
        """Close the transfer group."""
        self.session.shutdown()
