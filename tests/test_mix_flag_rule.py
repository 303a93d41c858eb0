"""The MIX flag's one rule (qstrat/execute/mix_rule.py), held the same way by an in-process engine
(qstrat/vllm/sink/engine_flag.py, qstrat/vllm/sink/reload.py) and by a transport receiver
(qstrat/transport/receive/receiver_flag.py, qstrat/transport/receive/session.py): a load that failed once it began
flags the holder and then finalizes the reload (a finalize that fails too is noted, never
raised); only a WHOLE refit that loads clears the flag - a partial one that reached the engine
leaves it flagged on both holders (the in-process holder used to clear on any finished load)."""
from __future__ import annotations

import pytest

from qstrat.errors import EngineStateError
from qstrat.execute.mix_rule import MixFlag
from qstrat.transport.receive.receiver_flag import MixFlag as ReceiverFlag
from qstrat.vllm.sink.engine_flag import engine_flag
from qstrat.vllm.sink.reload import flagged_reload


class Engine:
    """A stand-in engine (the flag is kept by qstrat, keyed by it)."""


def test_only_a_whole_load_clears_the_flag():
    flag = MixFlag("this engine", EngineStateError)
    flag.set("RuntimeError: boom", {"a", "b"})
    flag.clear_if_whole(1, 2)
    assert flag.reason == "RuntimeError: boom"
    flag.clear_if_whole(2, 2)
    assert flag.reason is None and flag.required is None


def test_the_engine_and_the_receiver_clear_by_the_same_rule():
    """A partial round that loaded completely while flagged: neither holder clears."""
    engine = Engine()
    engine_flag(engine).set("RuntimeError: boom")
    flagged_reload(engine, lambda: None, lambda: None, lambda: "", lambda: (1, 7))  # partial, loaded
    assert engine_flag(engine).reason == "RuntimeError: boom"
    receiver = ReceiverFlag()
    receiver.set("RuntimeError: boom", {"a", "b"})
    receiver.loaded(lambda: {"a": 1, "b": 1}, {"a"})
    assert receiver.reason == "RuntimeError: boom"
    flagged_reload(engine, lambda: None, lambda: None, lambda: "", lambda: (7, 7))  # whole
    receiver.loaded(lambda: {"a": 1, "b": 1}, {"a", "b"})
    assert engine_flag(engine).reason is None and receiver.reason is None


def test_coverage_is_asked_only_when_flagged():
    def never() -> tuple[int, int]:
        raise AssertionError("coverage asked of an engine that is not flagged")

    flagged_reload(Engine(), lambda: None, lambda: None, lambda: "", never)


def test_a_failed_load_is_flagged_then_finalized_and_a_failed_finalize_is_noted():
    """Both holders go through MixFlag.fail_load: the same order and the same sentence."""
    order: list[str] = []

    def finalize() -> None:
        order.append("finalize")
        raise OSError("worker gone")

    def reload() -> None:
        raise RuntimeError("CUDA out of memory (simulated)")

    engine = Engine()
    with pytest.raises(EngineStateError, match="began reloading .3 of 9.: RuntimeError: CUDA out of memory"):
        flagged_reload(engine, reload, finalize, lambda: " (3 of 9)", lambda: (9, 9))
    want = ("RuntimeError: CUDA out of memory (simulated) (finalizing the reload failed too: "
            "OSError: worker gone)")
    assert engine_flag(engine).reason == want and order == ["finalize"]
    receiver = ReceiverFlag()

    def finalize_seen_flagged() -> None:
        assert receiver.reason is not None  # flagged before finalizing
        finalize()

    receiver.fail_load("RuntimeError: CUDA out of memory (simulated)", finalize_seen_flagged, {"a"})
    assert receiver.reason == want and receiver.required == {"a"}
