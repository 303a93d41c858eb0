"""What runs before the first byte: the one preparation step every refit sink goes through.

A sink (``qstrat.vllm.refit``, ``qstrat.execute.checkpoint.write_checkpoint``,
``qstrat.transport.RefitSender.refit``, ``RefitDriver.run``) calls
:meth:`qstrat.RefitDriver.prepare`, which runs :data:`STEPS` in order and returns a
:class:`PreparedRefit`; only then does the sink emit anything (``PreparedRefit.execute``). The
sink hands in its own checks (:class:`SinkCheck`: the engine's format and manifest, the
checkpoint's config.json, the wire manifest), run as the second step. docs/concepts.md, "What
runs before the first byte", lists the same steps; tests/test_prepare.py holds the two to each
other and makes every check of every sink fail in turn.

Order: everything that reads only metadata (names, shapes, dtypes, devices, the sink's own
description of what it accepts) comes first; the values pass, which reads every byte of every
input, comes last, so a refusal on metadata costs no read pass.

A sink that is all-or-none until the last input was read (``all_or_none=True``: a transport
round before its commit vote) reuses the driver's kept plan when the inputs' names and the
``hf_config`` match it (:class:`qstrat.execute.driver.PlanCache`), and then checks each input's shape,
dtype, device and values where the stream reads it, not up front: the per-input passes over
every tensor are what a warm refit would otherwise pay before its first byte.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from qstrat.execute.named_tensors import NamedTensors, as_tensor_dict, lacks_values, no_values_error
from qstrat.plan.data import RefitPlan

__all__ = ["STEPS", "PreparedRefit", "SinkCheck", "Step", "prepare"]

#: When a sink wants the NaN/inf check: ``"first"`` - one read pass over every input before
#: anything is emitted (sinks with no rollback: an engine, a wire round); ``"inline"`` - while
#: quantizing each input (a sink that discards everything on error, e.g. a checkpoint written to
#: a temporary directory; saves a second read of lazily loaded inputs).
ValuesWhen = Literal["first", "inline"]


class Driver(Protocol):
    """What preparation needs of the driver (:class:`qstrat.RefitDriver` is the one)."""

    #: the driver's :class:`qstrat.execute.driver.PlanCache` (its kept plan, and what is kept with it)
    plan_cache: Any

    def plan(self, named_tensors: NamedTensors) -> RefitPlan: ...

    def kept_plan(self, tensors: Mapping[str, Any]) -> RefitPlan | None: ...

    def check_plan(self, plan: RefitPlan, tensors: Any = None) -> None: ...

    def check_backends(self, plan: RefitPlan, tensors: Mapping[str, Any]) -> None: ...

    def check_values(self, plan: RefitPlan, tensors: Mapping[str, torch.Tensor]) -> None: ...

    def execute(self, plan: RefitPlan, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
                values_checked: bool = False, expert_batch: int | None = None,
                consumer_stream: Any = None, quantize: Any = None) -> Iterator[tuple[str, torch.Tensor]]: ...


@dataclass(frozen=True)
class SinkCheck:
    """One check a sink adds (run by the ``sink`` step, in the order the sink gives them).

    ``run(prepared)`` reads ``prepared.plan`` (and ``prepared.plan_given``, ``prepared.tensors``)
    and raises the sink's error naming what is wrong; it must not emit or send anything. What it
    returns (e.g. the wire manifest it built) is kept in ``prepared.results[name]``.

    ``plan_only``: what ``run`` returns or raises depends on ``prepared.plan`` and
    ``prepared.plan_given`` alone (and on the driver's fixed config, layout and ``hf_config``):
    its result is then kept with the driver's kept plan (:meth:`qstrat.execute.driver.PlanCache.keep`,
    under ``(name, plan_given, *key)``) and not computed again while that plan is reused; a
    check that raises is run again each time.
    """

    name: str
    run: Callable[[PreparedRefit], Any]
    plan_only: bool = False
    #: more of what the result depends on, with ``plan_only`` (e.g. a bucket size)
    key: tuple[Any, ...] = ()


@dataclass
class PreparedRefit:
    """A plan and its inputs that passed every step: :meth:`execute` emits the outputs.

    Attributes:
        driver: the driver that planned (serializer instances, config).
        plan: the plan (made here, or given and checked against the inputs).
        tensors: name -> tensor (or lazy handle), or - a given plan with ``stream=True`` - the
            iterator of ``(name, tensor)`` pairs, consumed once by :meth:`execute`.
        plan_given: the caller gave the plan (a partial refit may then leave layers out).
        values_checked: the values step read every input (``execute`` does not check again).
        ran: the names of the steps and sink checks that ran, in order (``sink`` is replaced by
            the sink's check names; a step deferred to the stream is absent).
        results: what each sink check returned, by its name.
        checked_in_stream: the plan is the driver's kept plan, matched by names and
            ``hf_config`` only (``all_or_none``); ``tensors`` is then a stream over the given
            mapping, and each input's shape and dtype is compared with its entry as it is read
            (:class:`~qstrat.errors.InputMismatchError`), its device and values as it is quantized.
    """

    driver: Driver
    plan: RefitPlan
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]
    plan_given: bool
    values_checked: bool = False
    ran: list[str] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    checked_in_stream: bool = False

    @property
    def streamed(self) -> bool:
        """Whether the inputs are an iterator consumed once (their devices and values are then
        checked as each tensor arrives, by execution, with the same errors)."""
        return not isinstance(self.tensors, Mapping)

    def execute(self, expert_batch: int | None = None, consumer_stream: Any = None, quantize: Any = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(checkpoint_name, tensor)`` in the plan's wire order
        (:meth:`qstrat.RefitDriver.execute`; the arguments as there; ``quantize``: the
        serializer call, :class:`qstrat.execute.stream.quantize.Quantize`). A streamed input can
        be executed once."""
        return self.driver.execute(self.plan, self.tensors, values_checked=self.values_checked,
                                   expert_batch=expert_batch, consumer_stream=consumer_stream, quantize=quantize)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.execute()


@dataclass
class _Preparation:
    """The arguments of :func:`prepare` and, from the ``plan`` step on, its result."""

    driver: Driver
    named_tensors: NamedTensors
    plan: RefitPlan | None
    checks: Sequence[SinkCheck]
    values: ValuesWhen
    stream: bool
    all_or_none: bool = False
    prepared: PreparedRefit | None = None


@dataclass(frozen=True)
class Step:
    """One step of :data:`STEPS`: its name, what it checks, the error it raises, its code."""

    name: str
    checks: str
    error: str
    run: Callable[[_Preparation], None] = field(repr=False)


def _plan(s: _Preparation) -> None:
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]
    if s.plan is None and s.all_or_none and isinstance(s.named_tensors, dict):
        kept = s.driver.kept_plan(s.named_tensors)
        if kept is not None:  # shapes, dtypes, devices, values: as the stream reads each input
            s.prepared = PreparedRefit(s.driver, kept, iter(s.named_tensors.items()), plan_given=False,
                                       ran=["plan"], checked_in_stream=True)
            return
    if s.plan is None:
        tensors = as_tensor_dict(s.named_tensors)
        plan = s.driver.plan(tensors)
    else:
        tensors = s.named_tensors if s.stream else as_tensor_dict(s.named_tensors)
        s.driver.check_plan(s.plan, tensors)
        plan = s.plan
    if isinstance(tensors, Mapping):  # every sink reads the values: a spec-only input is refused now
        empty = [e.name for e in plan.entries if e.name in tensors and lacks_values(tensors[e.name])]
        if empty:
            raise no_values_error(empty, tensors[empty[0]])
    s.prepared = PreparedRefit(s.driver, plan, tensors, plan_given=s.plan is not None, ran=["plan"])


def _sink(s: _Preparation) -> None:
    p = _prepared(s)
    for check in s.checks:
        if check.plan_only:
            p.results[check.name] = p.driver.plan_cache.keep(p.plan, (check.name, p.plan_given, *check.key),
                                                             lambda: check.run(p))
        else:
            p.results[check.name] = check.run(p)
        p.ran.append(check.name)


def _backends(s: _Preparation) -> None:
    p = _prepared(s)
    if isinstance(p.tensors, Mapping):  # a stream: checked as each tensor arrives
        p.driver.check_backends(p.plan, p.tensors)
        p.ran.append("backends")


def _values(s: _Preparation) -> None:
    p = _prepared(s)
    if s.values == "first" and isinstance(p.tensors, Mapping):
        p.driver.check_values(p.plan, p.tensors)
        p.values_checked = True
        p.ran.append("values")


def _prepared(s: _Preparation) -> PreparedRefit:
    assert s.prepared is not None, "the plan step runs first"
    return s.prepared


#: What runs before the first byte, in this order (docs/concepts.md lists it; a test keeps the two
#: equal).
STEPS: tuple[Step, ...] = (
    Step("plan", "plan every input (names, shapes, dtypes, formats, the whole plan's consistency), "
                 "or check a given plan: made with this driver's config, and every planned input "
                 "present with its planned shape and dtype; every input holds values (not a "
                 "TensorSpec)", "PlanError", _plan),
    Step("sink", "the sink's own checks, in the sink's order (SinkCheck)", "the sink's errors", _sink),
    Step("backends", "every planned format's backend can run on its input's device",
         "BackendUnavailableError", _backends),
    Step("values", "every input is finite (one read pass), for sinks with values='first'",
         "NonFiniteError", _values),
)


def prepare(driver: Driver, named_tensors: NamedTensors, plan: RefitPlan | None = None,
            checks: Sequence[SinkCheck] = (), values: ValuesWhen = "first",
            stream: bool = False, all_or_none: bool = False) -> PreparedRefit:
    """Run :data:`STEPS` (what :meth:`qstrat.RefitDriver.prepare` does).

    Args:
        driver: the refit driver.
        named_tensors: mapping or iterable of (HF name, tensor), any device.
        plan: a plan made beforehand (``driver.plan(specs)``, ``plan.only_layers(...)``);
            None: plan the inputs here.
        checks: the sink's checks, run in order after the plan.
        values: ``"first"`` or ``"inline"`` (see :data:`ValuesWhen`).
        stream: with a given ``plan``, keep an iterator as it is (consumed once by execute; its
            devices and values are then checked as each tensor arrives). Otherwise the inputs
            are collected into a mapping first (without a plan they always are: planning reads
            every input's metadata).
        all_or_none: the sink discards everything it received if execution raises (a transport
            round before its commit vote). Without ``plan``, given a dict whose names (in order)
            and the driver's ``hf_config`` match the driver's kept plan, that plan is used and
            the inputs are executed as a stream over the dict: each one's shape and dtype is then
            checked as it is read (InputMismatchError), its device and values as it is quantized,
            instead of the up-front passes (``PreparedRefit.checked_in_stream``).
    Returns: the :class:`PreparedRefit`.
    Raises: the error of the first step that fails (see :data:`STEPS`); nothing was emitted.
    """
    state = _Preparation(driver, named_tensors, plan, tuple(checks), values, stream, all_or_none)
    for step in STEPS:
        step.run(state)
    return _prepared(state)
