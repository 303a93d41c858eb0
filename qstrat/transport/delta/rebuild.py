"""A receiver's delta base across rounds (:mod:`qstrat.transport.delta.encoding`), and the decoder that
rebuilds a delta round's tensors from it (:mod:`qstrat.transport.delta.receive`)."""
from __future__ import annotations

from typing import Any

from qstrat.transport.delta import encoding as delta
from qstrat.transport.delta.receive import PatchDecoder
from qstrat.transport.security.keys import Secret
from qstrat.transport.wire_manifest import WireManifest


class DeltaRebuild:
    """The base (the tensors' bytes as of the last delta-mode round this receiver loaded, in host
    memory) and the round being rebuilt (until it is loaded)."""

    def __init__(self) -> None:
        #: None: no base (any round in another mode, or a failed load, drops it).
        self.base: delta.Base | None = None
        self._decoder: PatchDecoder | None = None
        #: The stream of the base before the current one (every tensor of it was replaced by the
        #: load of the current base, and loaders copy): the next rebuild is written into it.
        self._spare = None
        #: The round id of the stream ``_spare`` holds (the decoder then copies only the bytes
        #: the current base's patch changed into it, instead of the whole base).
        self._spare_round: str | None = None

    def decoder(self, info: dict[str, Any], target: WireManifest, secret: Secret | None, mac: bytes) -> PatchDecoder:
        """The decoder of the round ``info`` (``update_info["delta"]``) of wire manifest
        ``target`` against :attr:`base`, its digests keyed by ``secret`` and the round MAC
        ``mac``; a DeltaError it raises drops the base first (out of step with the trainer: the
        next round is whole). Its new base is kept until :meth:`take_next`."""
        def drop() -> None:
            self.base = None

        spare, self._spare = self._spare, None
        spare_round, self._spare_round = self._spare_round, None
        self._decoder = PatchDecoder(info, target, self.base, secret, mac, drop, spare, spare_round)
        return self._decoder

    def commit(self, next_base: delta.Base | None) -> None:
        """The round of ``next_base`` loaded whole: it becomes the base (None: no base), and the
        replaced base's stream the buffer of the next rebuild."""
        if self.base is not None and next_base is not None and self.base.stream is not next_base.stream:
            self._spare, self._spare_round = self.base.stream, self.base.round_id
        self.base = next_base

    def take_next(self) -> delta.Base | None:
        """The base of the round rebuilt last (None: none, or not rebuilt whole), forgotten here."""
        decoder, self._decoder = self._decoder, None
        return decoder.new_base if decoder is not None else None
