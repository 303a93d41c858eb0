"""A sender's weight-sync calls, fanned out to every engine: each call on a daemon thread of its
own, waited for at most ``timeout_s``, failures gathered per engine (a hung call neither blocks
the next round's calls nor the interpreter's exit)."""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import Any

from qstrat.errors import MixedWeightsError, TransferAuthError, TransportError
from qstrat.transport.security.auth import INIT_REFUSED
from qstrat.transport.group import TransferGroup
from qstrat.transport.rpc_errors import describe as describe_rpc_error

#: How long, after one engine refused its init, the others' answers are awaited before raising
#: (seconds): refusals come at once, an engine that accepted waits for the group and never does.
REFUSAL_GRACE_S = 1.0


class EngineClients:
    """One weight-sync client per engine (``VLLMWeightSyncClient`` protocol) and the ranks each
    engine brings to the transfer group.

    Args:
        clients: the clients, engine 0 first.
        workers: ranks per client (its TP x PP x DP worker count; None: one each); engine
            ``i``'s ranks follow rank 0 (the sender) and engines ``0..i-1``'s.
        timeout_s: how long :meth:`results` waits for a batch of calls (seconds, in all).
    Raises: TransportError when ``workers`` does not give one count per client.
    """

    def __init__(self, clients: Sequence[Any], workers: Sequence[int] | None, timeout_s: float) -> None:
        self.clients, self.timeout_s = list(clients), timeout_s
        self.workers = list(workers or [1] * len(self.clients))
        if len(self.workers) != len(self.clients):
            raise TransportError("workers_per_client needs one count per client")

    def offsets(self) -> list[int]:
        """Each engine's first rank in the transfer group (rank 0 is the sender)."""
        return [1 + sum(self.workers[:i]) for i in range(len(self.workers))]

    def ranks(self, engines: Sequence[int]) -> list[int]:
        """The group ranks of the engines ``engines`` (indices), ascending."""
        offsets = self.offsets()
        return sorted(r for i in engines for r in range(offsets[i], offsets[i] + self.workers[i]))

    def join(self, infos: Sequence[Any], rendezvous: Callable[[], TransferGroup]) -> TransferGroup:
        """``init_weight_transfer_engine(infos[i])`` on engine ``i``, concurrently with this rank's
        ``rendezvous()``; the group once every engine joined. An engine that answers its init
        with an error before the group formed (a refused secret: at once) is reported at once,
        not after the rendezvous timed out; the abandoned rendezvous (a daemon thread) times out
        on its own and closes any group it still forms. Raises: TransportError (the
        rendezvous' with the engines' errors added, or an engine's init failure: the group closed),
        TransferAuthError when an engine refused its init."""
        futures = [call(c.init_weight_transfer_engine, info) for c, info in zip(self.clients, infos)]
        joining = call(rendezvous)
        pending = {joining, *futures}
        while joining in pending:
            done, pending = wait_futures(pending, return_when=FIRST_COMPLETED)
            if joining in pending and any(f.exception() is not None for f in done if f is not joining):
                # an engine that will not join: no group can form; the others' answers, briefly
                wait_futures([f for f in futures if f in pending], timeout=min(REFUSAL_GRACE_S, self.timeout_s))
                failed = {i: describe_rpc_error(f.exception()) for i, f in enumerate(futures)
                          if f.done() and f.exception() is not None}
                joining.add_done_callback(_close_late_group)
                raise _refusal(failed)(f"init_weight_transfer_engine failed before the transfer group formed "
                                       f"(the sender did not wait out its {self.timeout_s:g} s rendezvous): "
                                       f"{listed(failed)}")
        try:
            group = joining.result()
        except TransportError as exc:  # say why the engines did not join (e.g. an address refusal)
            errors = self.results(futures)
            raise _refusal(errors)(f"{exc}; init_weight_transfer_engine: {listed(errors) or 'no error reported'}") from None
        errors = self.results(futures)
        if errors:
            group.close()
            raise TransportError(f"init_weight_transfer_engine failed: {listed(errors)}")
        return group

    def start(self, method: str, *args: Any) -> list[Future]:
        """``client.<method>(*args)`` on every engine, each on its own daemon thread."""
        return [call(getattr(c, method), *args) for c in self.clients]

    def call_all(self, method: str) -> None:
        """``client.<method>()`` on every engine; raises TransportError naming each that failed."""
        errors = self.results(self.start(method))
        if errors:
            raise TransportError(f"{method} failed: {listed(errors)}")

    def finish_all(self) -> None:
        """``finish_weight_update`` on every engine. Raises MixedWeightsError when any failed
        (atomic mode: the round was committed, so every other engine loaded it); its ``detail``
        names the failed engines and their ranks, and the engines that loaded."""
        errors = self.results(self.start("finish_weight_update"))
        if not errors:
            return
        loaded = [i for i in range(len(self.clients)) if i not in errors]
        detail = (f"finish_weight_update failed on engine(s) {sorted(errors)} (ranks {self.ranks(errors)}); "
                  f"engine(s) {loaded} loaded the round")
        exc = MixedWeightsError(f"the round was committed but its load failed: {listed(errors)}; {detail}: the "
                                f"engines hold a MIX, each failed engine is flagged and accepts only a whole refit")
        exc.detail = detail
        raise exc

    def results(self, futures: list[Future]) -> dict[int, str]:
        """Wait (at most ``timeout_s`` in all) for every RPC; engine index -> its error."""
        done, _ = wait_futures(futures, timeout=self.timeout_s)
        errors = {}
        for i, f in enumerate(futures):
            if f not in done:
                errors[i] = f"no answer within {self.timeout_s:g} s"
            elif f.exception() is not None:
                errors[i] = describe_rpc_error(f.exception())
        return errors


class OfEngines:
    """A descriptor: an attribute of an object's :class:`EngineClients` (its ``engines``),
    read and assigned through the object (e.g. ``RefitSender.clients``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else getattr(obj.engines, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.engines, self.name, value)


def call(fn: Callable[..., Any], *args: Any) -> Future:
    """``fn(*args)`` on a daemon thread of its own (a hung call holds only that thread)."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            future.set_exception(exc)

    threading.Thread(target=run, name="qstrat-rpc", daemon=True).start()
    return future


def _refusal(errors: dict[int, str]) -> type[TransportError]:
    """TransferAuthError when any engine refused its init (a secret or address refusal), else
    TransportError."""
    refused = any("TransferAuthError" in e or INIT_REFUSED in e for e in errors.values())
    return TransferAuthError if refused else TransportError


def _close_late_group(joining: Future) -> None:
    """Close the group an abandoned rendezvous formed after all (its sender already raised)."""
    if joining.exception() is None:
        joining.result().close()


def listed(errors: dict[int, str]) -> str:
    """``engine i: error; ...`` in engine order."""
    return "; ".join(f"engine {i}: {e}" for i, e in sorted(errors.items()))
