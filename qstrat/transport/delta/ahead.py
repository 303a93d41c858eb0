"""The source run ahead on a second thread: a delta round's sender quantizes (and, once the
round's digests are keyed, encodes) the buckets after bucket k while bucket k is posted.

A delta round's sender does two things per bucket: the SOURCE (the driver quantizes the
bucket's entries - incrementally, :mod:`qstrat.transport.delta.requantize` - and writes their
bytes into the round's stream) and the ENCODE (compare the bucket's tiles with the base, code
the patch, digest the rebuilt bytes). Both are memory-bound torch passes that release the GIL,
and they touch disjoint stream bytes (bucket k+1's tensors begin at or after ``cuts[k + 1]``,
:func:`qstrat.transport.delta.encoding.cuts`), and the stream is allocated before the round, so
the source can run ahead of the encoder by any number of buckets without more memory. With
:class:`LookAhead` the sender's time is about max(source, encode) over the round instead of
their sum; one bucket of look-ahead is not enough, since the source is lumpy (a bucket that
begins an expert slab quantizes the whole slab; docs/performance.md, "Delta rounds: the measurement history":
measured there). :class:`~qstrat.transport.delta.stream.PatchEncoder` also encodes each bucket
here right after writing it, from the core's cache (less CPU: docs/performance.md, "Delta rounds:
the measurement history", sixth pass).

While a source thread runs, the interpreter's switch interval (``sys.setswitchinterval``,
5 ms by default) is at most :data:`SWITCH_INTERVAL_S`: the encoder and the source hand the GIL
to each other between torch calls, and at 5 ms each hand-over could stall the other thread for
that long (measured: the sender's round 3-19 % shorter at 0.5 ms; docs/performance.md, fifth pass). The
interval in force before is put back when the last running source thread ends.

The thread runs with the caller's autograd mode and, where CUDA is initialised, the caller's
current device and stream (both are per thread in torch), so the source behaves as it would
on the caller's thread, in the same stream order. It runs outside inference mode whatever the
caller's (torch's default on a new thread): what it writes in place - the round's stream, the
requantizer's entries - must then be normal tensors, which is why
:class:`~qstrat.transport.delta.stream.PatchEncoder` allocates the stream outside inference
mode; a caller under ``torch.inference_mode()`` gets the same bytes.
"""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["LookAhead", "SWITCH_INTERVAL_S"]

#: The switch interval (seconds) while a source thread runs (module docstring).
SWITCH_INTERVAL_S = 0.0005

_interval_lock = threading.Lock()
_interval_users = 0
_interval_saved = 0.0


def _switch_fast(on: bool) -> None:
    """Lower the interpreter's switch interval for the first running source thread (``on``)
    and put it back after the last one (module docstring)."""
    global _interval_users, _interval_saved
    with _interval_lock:
        if on:
            if _interval_users == 0:
                _interval_saved = sys.getswitchinterval()
                sys.setswitchinterval(min(_interval_saved, SWITCH_INTERVAL_S))
            _interval_users += 1
        else:
            _interval_users -= 1
            if _interval_users == 0:
                sys.setswitchinterval(_interval_saved)


class LookAhead:
    """Runs ``step(0), step(1), ..., step(last)`` in order on one background thread, started by
    the first :meth:`take`, while the caller takes them in the same order.

    Args:
        step: the work of index ``k`` (its return value is discarded; what it raises is raised
            by :meth:`take` of that ``k``, and no later step runs).
        last: the last index.
    """

    def __init__(self, step: Callable[[int], Any], last: int) -> None:
        self._step, self._last = step, last
        self._cond = threading.Condition()
        self._done, self._stop = -1, False  # the last index finished; stop before the next
        self._over = False  # the thread ran its last step, failed or stopped: waiting would never end
        self._error: BaseException | None = None
        self._seconds = [0.0] * (last + 1)
        self._thread: threading.Thread | None = None
        self._grad = torch.is_grad_enabled()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self._cuda = (torch.cuda.current_device(), torch.cuda.current_stream()) if cuda else None

    def take(self, k: int) -> float:
        """Wait until ``step(k)`` finished (indices taken in order). Returns the seconds it ran.
        Raises: what ``step(k)`` raised; IndexError for a ``k`` outside ``0..last``; RuntimeError
        when :meth:`close` stopped the thread before ``step(k)`` (it will never run)."""
        if not 0 <= k <= self._last:
            raise IndexError(f"LookAhead.take({k}): steps are 0..{self._last}")
        self.start()
        with self._cond:
            self._cond.wait_for(lambda: self._done >= k or self._error is not None or self._over)
            if self._done >= k:
                return self._seconds[k]
            if self._error is not None:
                raise self._error
            raise RuntimeError(f"LookAhead.take({k}): closed before step {k} ran")

    @property
    def started(self) -> bool:
        """Whether the thread was started (by :meth:`start` or a :meth:`take`)."""
        return self._thread is not None

    def start(self) -> None:
        """Start the thread now, if it is not running yet (:meth:`take` starts it otherwise); a
        step it raises in is raised by that step's :meth:`take`. Raises: RuntimeError when no
        thread can be started. Does nothing after :meth:`close`."""
        if self._thread is not None:
            return
        if self._stop:  # closed before it ran: a take() of any step raises at once
            with self._cond:
                self._over = True
            return
        thread = threading.Thread(target=self._run, name="qstrat-delta-source", daemon=True)
        _switch_fast(True)  # undone by the thread when it ends
        try:
            thread.start()
        except BaseException:
            _switch_fast(False)
            raise
        self._thread = thread

    def close(self) -> None:
        """Stop before the next step, and wait for the one running (a round that failed part-way:
        its source must not run on beside the sender's cleanup). Idempotent."""
        with self._cond:
            self._stop = True
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        """Every step in order, under the caller's autograd mode, CUDA device and stream; then
        wake every :meth:`take` (one waiting for a step that will not run raises)."""
        try:
            with torch.set_grad_enabled(self._grad):
                if self._cuda is None:
                    return self._steps()
                device, stream = self._cuda
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    return self._steps()
        finally:
            _switch_fast(False)
            with self._cond:
                self._over = True
                self._cond.notify_all()

    def _steps(self) -> None:
        for k in range(self._last + 1):
            with self._cond:
                if self._stop:
                    return
            t0 = time.perf_counter()
            try:
                self._step(k)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's take(k)
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self._seconds[k], self._done = time.perf_counter() - t0, k
                self._cond.notify_all()
