"""What both of qstrat's TRL modes share: the check of TRL's hooks (:func:`check_trl`,
:class:`TRLHookError`), the copies of the items TRL's ``_iter_named_params`` yields, and the
colocated engine's sync (:class:`QstratWeightSync`, which the server mode's sync extends).

:mod:`qstrat.integrations.trl` (colocated; the public door, re-exporting these names) and
:mod:`qstrat.integrations.trl_server` (server mode) both import from here, so neither imports the
other's module at import time.
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from qstrat.errors import QstratError
from qstrat.vllm.fidelity.metrics import FIDELITY_METRICS, fidelity_metrics  # noqa: F401 (FIDELITY_METRICS: re-exported)
from qstrat.vllm.fidelity.verdict import check_on_failure
from qstrat.vllm.adapter import names
from qstrat.vllm.adapter.views import EngineView

#: TRL versions whose ``VLLMGeneration`` has every hook this module uses (checked on the released
#: wheels: ``_iter_named_params`` first appears in 1.11.0). 1.16.0 runs the tests here.
SUPPORTED_TRL = ">=1.11.0,<1.17"
#: What the test suite ran against (tests/test_integration_trl.py).
TESTED_TRL = ("1.16.0",)

_MODULE = "trl.generation.vllm_generation"
#: Methods of ``VLLMGeneration`` this integration calls or replaces.
_CLASS_HOOKS = ("_init_vllm", "_iter_named_params", "sync_weights")
#: Metric names added to the trainer's logs on every sync.
METRICS = ("qstrat/refit/seconds", "qstrat/refit/bytes", "qstrat/refit/tensors", "qstrat/sync/seconds")



class TRLHookError(QstratError, RuntimeError):
    """The installed TRL lacks a hook this integration relies on (a TRL outside
    :data:`SUPPORTED_TRL`, or one that changed). The message names the TRL version, the range and
    the missing hook."""


def _trl_version() -> str:
    try:
        import trl
    except ImportError as exc:
        raise ImportError("qstrat.integrations.trl needs TRL: pip install 'qstrat[trl]' "
                          f"(TRL {SUPPORTED_TRL})") from exc
    return str(getattr(trl, "__version__", "unknown"))


def _hook_error(version: str, what: str) -> TRLHookError:
    return TRLHookError(f"TRL {version}: {what}. qstrat.integrations.trl supports TRL {SUPPORTED_TRL} "
                        f"(tested: {', '.join(TESTED_TRL)}); install one of those "
                        "(pip install 'qstrat[trl]') or see docs/integrations.md")


def check_trl() -> str:
    """Check that the installed TRL has every hook this integration uses; changes nothing.

    Checked: ``trl.generation.vllm_generation`` imports, defines ``VLLMGeneration`` with the
    methods ``_init_vllm``, ``_iter_named_params`` and ``sync_weights``, and holds vLLM's ``LLM``
    as a module name (TRL imports it there only when vLLM is installed).

    Returns: the TRL version string.
    Warns: RuntimeWarning when every hook is there but the version is outside
        :data:`SUPPORTED_TRL` (not tested).
    Raises: ImportError without TRL or without vLLM; TRLHookError naming the TRL version, the
        supported range and the first missing hook.
    """
    version = _trl_version()
    import importlib

    try:
        module = importlib.import_module(_MODULE)
    except ImportError as exc:
        raise _hook_error(version, f"cannot import {_MODULE} ({exc})") from exc
    cls = getattr(module, "VLLMGeneration", None)
    if not isinstance(cls, type):
        raise _hook_error(version, f"{_MODULE} has no class VLLMGeneration")
    for name in _CLASS_HOOKS:
        if not callable(cls.__dict__.get(name)):
            raise _hook_error(version, f"{_MODULE}.VLLMGeneration has no method {name}")
    if not callable(getattr(module, "LLM", None)):
        from qstrat.vllm.adapter.platform_facts import vllm_installed

        if not vllm_installed():
            raise ImportError(f"qstrat.integrations.trl needs vLLM: {names.INSTALL}")
        raise _hook_error(version, f"{_MODULE} does not hold vLLM's LLM as a module name (TRL builds "
                          "its engine elsewhere)")
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        inside = Version(version) in SpecifierSet(SUPPORTED_TRL)
    except InvalidVersion:
        inside = False
    if not inside:
        warnings.warn(f"TRL {version} is outside the range qstrat.integrations.trl was checked against "
                      f"({SUPPORTED_TRL}); its hooks are there, so it proceeds", RuntimeWarning, stacklevel=2)
    return version


def _copied(pairs: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Each pair's tensor copied before the iterator moves on: TRL's ``_iter_named_params``
    yields views that are valid only until the next item (ZeRO-3 re-partitions a gathered
    parameter, FSDP1 leaves ``summon_full_params``, PEFT unmerges its adapters in place after the
    last item). Costs one transient copy of the model's weights on their device (the checkpoint
    the engine starts on is written from it, once)."""
    return [(name, t.detach().clone()) for name, t in pairs]


def copied_each(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each pair with its tensor copied (same device, dtype and shape) as it is drawn, before the
    iterator moves on (see :func:`_copied`), one at a time: fed to ``refit(..., read_once=True)``,
    a copy lives only until its fused group is quantized, so a sync's extra memory is the payload
    sent plus about one decoder layer of copies - not a copy of the whole (gathered) model."""
    for name, t in pairs:
        yield name, t.detach().clone()


class QstratWeightSync:
    """The ``sync_weights`` of one TRL ``VLLMGeneration``: a qstrat refit of its engine.

    Called by the trainer (``self.vllm_generation.sync_weights()``) whenever the training step
    changed. Each call copies the tensors TRL's ``_iter_named_params`` yields (PEFT merged,
    FSDP/ZeRO-3 gathered; every process iterates, as TRL's collectives need), refits the engine
    with :func:`qstrat.vllm.refit` (everything checked before the first tensor is sent), then
    resets the engine's prefix cache (as TRL does after its own sync).

    Attributes:
        generation: the TRL ``VLLMGeneration``.
        driver: the :class:`~qstrat.RefitDriver` of the strategy.
        plan: the plan the engine's checkpoint was written with.
        checkpoint: the directory the engine started on.
        reports: one :class:`qstrat.vllm.RefitReport` per sync, in order.
        fidelity_reports: one :class:`~qstrat.vllm.fidelity.probe.FidelityReport` per probed sync
            (a failed one too), in order.
        metrics: the trainer's metric store (``trainer._metrics``, set by :meth:`QstratRollouts.attach`);
            each sync appends ``qstrat/refit/seconds`` (quantize + send, s), ``qstrat/refit/bytes``,
            ``qstrat/refit/tensors`` and ``qstrat/sync/seconds`` (the whole sync: TRL's gathering
            and merging, the copy, the refit, the cache reset) under ``"train"`` or ``"eval"``;
            a probed sync also :data:`FIDELITY_METRICS`.
        verify_every: run the fidelity probe (:class:`qstrat.vllm.fidelity.probe.Verify` on the trainer's
            model) on the first sync and every ``verify_every``-th after it; 0: never. Each
            probe measures the arithmetic floor behind its limits on its own weights.
        on_fidelity_failure: what a failed probe does once logged (``qstrat/fidelity/ok`` 0.0):
            ``"raise"`` (stops ``trainer.train()``) or ``"warn"`` (:mod:`qstrat.vllm.fidelity.verdict`).
    """

    def __init__(self, generation: Any, driver: Any, plan: Any, checkpoint: Path, keep: Any = None,
                 verify_every: int = 0, on_fidelity_failure: str = "raise") -> None:
        self.verify_every = verify_every
        self.on_fidelity_failure = check_on_failure(on_fidelity_failure, "on_fidelity_failure")
        self.generation = generation
        self.driver = driver
        self.plan = plan
        self.checkpoint = checkpoint
        self.reports: list[Any] = []
        self.metrics: Mapping[str, Any] | None = None
        self._keep = keep  # the temporary directory holding ``checkpoint`` (removed with this object)
        self._verify: Any = None  # one qstrat.vllm.fidelity.probe.Verify for every probed sync (its floor kept)
        self._fidelity: Any = None  # this sync's probe report (also a failed one), logged by _log
        self.fidelity_reports: list[Any] = []

    def __call__(self) -> Any:
        """Refit the engine from the trainer's current weights.

        TRL's items are copied one at a time as they are drawn and quantized as they arrive
        (:func:`copied_each`, ``refit(..., plan=self.plan, read_once=True)``): the sync's extra
        memory is the payload it sends (``report.bytes``) plus about one decoder layer of copies.
        Whatever happens once the reload began - success, a fidelity probe above its threshold, a
        reload that failed - the engine's prefix cache is reset (its cached KV came from the old
        weights) and the sync's metrics are logged (``qstrat/sync/seconds`` always; the refit's
        and the probe's when they ran) before an error propagates.

        Returns: the :class:`qstrat.vllm.RefitReport`.
        Raises: what :func:`qstrat.vllm.refit` raises (PlanError, NonFiniteError: nothing sent;
            EngineStateError: the reload failed part-way); FidelityError from the probe under
            ``on_fidelity_failure="raise"`` (the report, with its ``fidelity``, is in :attr:`reports`).
        Warns: :class:`~qstrat.vllm.fidelity.verdict.FidelityWarning` for a failed probe under ``"warn"``.
        """
        import dataclasses

        import qstrat.vllm

        start = time.perf_counter()
        gen = self.generation
        verify = self._due_verify()
        report = None
        failed = False
        try:
            report = qstrat.vllm.refit(gen.llm, self.driver, copied_each(gen._iter_named_params()),
                                       plan=self.plan, read_once=True)
            if verify is not None:
                self._probe(verify, gen.llm)
        except BaseException:
            failed = True
            raise
        finally:
            if report is not None and self._fidelity is not None:
                report = dataclasses.replace(report, fidelity=self._fidelity)
            try:
                EngineView(gen.llm).reset_prefix_cache()
            except Exception:
                if not failed:  # else the refit's own error, which says more, propagates
                    raise
            finally:
                self._log(report, time.perf_counter() - start)
        return report

    def _due_verify(self) -> Any:
        """The :class:`~qstrat.vllm.fidelity.probe.Verify` of the trainer's model when this sync is
        probed (the first, then every ``verify_every``-th), else None; clears the last probe's report."""
        self._fidelity = None
        if not (self.verify_every and len(self.reports) % self.verify_every == 0):
            return None
        from qstrat.vllm.fidelity.probe import Verify

        model = self.generation.model
        if self._verify is None or self._verify.model is not model:
            self._verify = Verify(model)
        return self._verify

    def _probe(self, verify: Any, engine: Any) -> Any:
        """Run ``verify`` on ``engine`` (a ``vllm.LLM``, or a
        :class:`~qstrat.vllm.fidelity.served.ServedEngine`) under ``on_fidelity_failure``
        (:func:`qstrat.vllm.fidelity.verdict.judged`); its report, a failed one too, is kept for
        this sync's metrics. Returns the report; raises FidelityError under ``"raise"``."""
        from qstrat.errors import FidelityError
        from qstrat.vllm.fidelity.verdict import judged

        try:
            self._fidelity = judged(verify, engine, self.driver, self.on_fidelity_failure)
        except FidelityError as exc:
            self._fidelity = exc.report
            raise
        finally:
            if self._fidelity is not None:
                self.fidelity_reports.append(self._fidelity)
        return self._fidelity

    def _values(self, report: Any) -> dict[str, float]:
        """The metrics of one reload's ``report`` (:data:`METRICS` but the sync's seconds)."""
        return dict(zip(METRICS[:3], (report.seconds, float(report.bytes), float(report.tensors))))

    def _log(self, report: Any, seconds: float) -> None:
        """Record ``report`` (None: no reload ran) and append this sync's metrics (the probe's
        :data:`FIDELITY_METRICS` when it ran)."""
        if report is not None:
            self.reports.append(report)
        if self.metrics is None:
            return
        store = self.metrics["train" if self.generation.model.training else "eval"]
        values = {"qstrat/sync/seconds": seconds, **(self._values(report) if report is not None else {}),
                  **(fidelity_metrics(self._fidelity) if self._fidelity is not None else {})}
        for key, value in values.items():
            store[key].append(value)


def _hf_config(model: Any) -> dict[str, Any]:
    """config.json content of the policy (a PEFT model's base model), ``architectures`` filled
    in from the model class when the config has none (a model built from a config object)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    cfg = base.config.to_dict()
    if not cfg.get("architectures"):
        cfg["architectures"] = [type(base).__name__]
    return cfg
