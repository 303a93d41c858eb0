"""Hugging Face TRL: colocated vLLM rollouts in any qstrat strategy, every weight sync a qstrat refit
(TRL's server mode, ``vllm_mode="server"``: :mod:`qstrat.integrations.trl_server`).

One call (:func:`make_trainer`) builds a TRL trainer whose vLLM engine starts on a qstrat
checkpoint of the policy and whose every weight sync is :func:`qstrat.vllm.refit`, fed from
TRL's own parameter iterator::

    from trl import GRPOConfig, GRPOTrainer
    from qstrat.integrations import trl as qtrl

    trainer = qtrl.make_trainer(GRPOTrainer, "block-fp8", model=model, processing_class=tokenizer,
                                reward_funcs=reward, train_dataset=dataset,
                                args=GRPOConfig(use_vllm=True, vllm_mode="colocate", ...))
    trainer.train()     # logs qstrat/refit/{seconds,bytes,tensors} and qstrat/sync/seconds per sync
                        # (verify_every=1: qstrat/fidelity/{mean_kl,limit,ratio,ok,...} too)

How it hooks in (no fork of TRL, nothing patched outside the trainer's construction): while
the trainer is being constructed, :func:`rollouts` wraps TRL's
``VLLMGeneration._init_vllm`` so that it writes a qstrat checkpoint of the policy (from TRL's
``_iter_named_params``), runs TRL's own ``_init_vllm`` with the module's ``LLM`` swapped for
that call only (the engine starts on the checkpoint), checks the engine against the plan and
sets ``sync_weights`` to a :class:`QstratWeightSync` (server mode:
:func:`qstrat.integrations.trl_server.start`). Class and module are restored when the
construction returns or raises; every hook is checked at start (:func:`check_trl`: a TRL
without one raises :class:`TRLHookError`). The steps, what a sync does and importance sampling
with a quantized engine: docs/integrations.md, "TRL (live)".
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qstrat.errors import ConfigError
from qstrat.integrations.trl_sync import (FIDELITY_METRICS, METRICS, SUPPORTED_TRL, TESTED_TRL,  # noqa: F401
                                         QstratWeightSync, TRLHookError, _copied, _hf_config, _hook_error,
                                         _MODULE, _trl_version, check_trl, copied_each)

#: Attributes a ``VLLMGeneration`` instance must have when ``_init_vllm`` runs.
_INSTANCE_HOOKS = ("mode", "model", "accelerator", "processing_class", "enable_sleep_mode")


def _release_started(gen: Any, started: list[Any]) -> None:
    """Release every engine a failed ``_init_vllm`` started (:func:`qstrat.vllm.engine.local.release`:
    its memory and vLLM's process-wide distributed state), and drop the generation's reference."""
    from qstrat.vllm.engine.local import release

    if getattr(gen, "llm", None) is not None and gen.llm in started:
        del gen.llm
    while started:
        release(started.pop())


#: ``vllm.LLM`` arguments the qstrat checkpoint decides: setting them would start an engine that
#: differs from what every sync sends (another quantization, another model).
ENGINE_KWARGS_OWNED = ("model", "quantization", "quantization_config", "hf_overrides")


def check_engine_kwargs(engine_kwargs: Any) -> dict[str, Any]:
    """``engine_kwargs`` as a dict of ``vllm.LLM`` arguments, refused when it is not a mapping with
    string keys or sets what the qstrat checkpoint decides (:data:`ENGINE_KWARGS_OWNED`): the
    model (the checkpoint), the quantization (the strategy's ``quantization_config``; an engine
    with another method, or online quantization, would take none of the syncs' tensors), and
    ``hf_overrides`` (it rewrites the model config the checkpoint and every sync's plan come from:
    its layers, its quantization_config).

    Raises: ConfigError naming the argument (``engine_kwargs.quantization: ...``).
    """
    if engine_kwargs is None:
        return {}
    if not isinstance(engine_kwargs, Mapping):
        raise ConfigError(f"engine_kwargs: a mapping of vllm.LLM arguments (e.g. {{'max_model_len': 2048}}), got "
                          f"{type(engine_kwargs).__name__} {engine_kwargs!r}")
    bad = [k for k in engine_kwargs if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"engine_kwargs: argument names are strings, got {bad[0]!r}")
    why = {"model": "the engine starts on the qstrat checkpoint of the policy",
           "quantization": "the engine's quantization is the strategy's, read from the qstrat checkpoint's "
                           "quantization_config (another method would take none of the syncs' tensors)",
           "quantization_config": "the engine's quantization is the strategy's, read from the qstrat checkpoint's "
                                  "quantization_config",
           "hf_overrides": "it rewrites the model config the checkpoint and every sync's plan are made from "
                           "(its layers, its quantization_config); change the policy model instead"}
    for key in ENGINE_KWARGS_OWNED:
        if key in engine_kwargs:
            raise ConfigError(f"engine_kwargs.{key}: {why[key]}; do not set it")
    return dict(engine_kwargs)


def _cpu_engine() -> bool:
    """Whether vLLM runs on a CPU here (its platform; vLLM is installed, check_trl made sure)."""
    from qstrat.vllm.adapter.platform_facts import is_cpu

    return is_cpu()


class QstratRollouts:
    """What :func:`rollouts` hands out: the strategy and every :class:`QstratWeightSync` installed
    while it was active (one per ``VLLMGeneration`` built)."""

    def __init__(self, strategy: Any, checkpoint_dir: str | Path | None, engine_kwargs: Mapping[str, Any] | None,
                 version: str, verify_every: int = 0, on_fidelity_failure: str = "raise") -> None:
        from qstrat.execute.driver import RefitDriver
        from qstrat.vllm.fidelity.verdict import check_every, check_on_failure

        RefitDriver(strategy)  # an invalid strategy fails here, before the trainer is built
        self.verify_every = check_every(verify_every, "verify_every")
        self.on_fidelity_failure = check_on_failure(on_fidelity_failure, "on_fidelity_failure")
        if checkpoint_dir is not None and not isinstance(checkpoint_dir, (str, os.PathLike)):
            raise ConfigError(f"checkpoint_dir: a directory path (str or pathlib.Path) or None, got "
                              f"{type(checkpoint_dir).__name__} {checkpoint_dir!r}")
        engine_kwargs = check_engine_kwargs(engine_kwargs)
        self.strategy = strategy
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.engine_kwargs = engine_kwargs
        self.version = version
        self.syncs: list[QstratWeightSync] = []

    def start(self, gen: Any, init_vllm: Any, module: Any) -> None:
        """The replacement of ``VLLMGeneration._init_vllm`` (steps in the module docstring)."""
        from qstrat.execute.checkpoint import write_checkpoint
        from qstrat.execute.driver import RefitDriver
        from qstrat.vllm import check_engine_compatible, engine_quantization_config

        missing = [name for name in _INSTANCE_HOOKS if not hasattr(gen, name)]
        if missing:
            raise _hook_error(self.version, f"VLLMGeneration has no attribute {missing[0]} when it builds its engine")
        if self.verify_every and callable(getattr(gen.model, "merge_and_unload", None)):
            raise ConfigError("verify_every: the fidelity probe runs the trainer's model on the refit's own tensor "
                              "names; a PEFT model's names differ (base_model.model..., lora_A/B): probe a "
                              "merged copy with qstrat.vllm.fidelity.probe.probe instead")
        if gen.mode == "server":  # the engine is a vLLM server: qstrat.integrations.trl_server
            from qstrat.integrations import trl_server

            sync = trl_server.start(self, gen, init_vllm, module)
            gen.sync_weights = sync
            self.syncs.append(sync)
            return
        if gen.mode != "colocate":
            raise ConfigError(f"vllm_mode: qstrat.integrations.trl runs TRL's 'colocate' and 'server' modes, got "
                              f"{gen.mode!r}")
        if gen.enable_sleep_mode:
            raise ConfigError("vllm_enable_sleep_mode: not supported with qstrat.integrations.trl (level-2 sleep "
                              "discards the engine's weights; a qstrat refit into a sleeping engine is untested)")
        hf_config = _hf_config(gen.model)
        driver = RefitDriver(self.strategy, hf_config=hf_config)
        if driver.config.quantize_in == "engine":
            raise ConfigError(
                "quantize_in: engine - TRL's colocated engine starts on qstrat's checkpoint in the strategy's "
                "format and every sync sends that format; an engine that quantizes BF16 syncs itself needs "
                "quantization='online', which engine_kwargs cannot set. Use quantize_in: trainer with "
                "vllm_mode='colocate', or vllm_mode='server' (qstrat.integrations.trl_server, whose server "
                "is started online); nothing was written, no engine started")
        keep = None
        if self.checkpoint_dir is None:
            keep = tempfile.TemporaryDirectory(prefix="qstrat-trl-")
            root = Path(keep.name)
        else:
            root = self.checkpoint_dir
        checkpoint = root / f"rank{gen.accelerator.process_index}"
        with tempfile.TemporaryDirectory(prefix="qstrat-trl-files-") as files:
            # What the engine reads besides weights: TRL's tokenizer/processor, the generation config.
            gen.processing_class.save_pretrained(files)
            generation_config = getattr(gen.model, "generation_config", None)
            if generation_config is not None:
                generation_config.save_pretrained(files)
            plan = write_checkpoint(driver, _copied(gen._iter_named_params()), checkpoint, hf_config=hf_config,
                                    overwrite=True, source_dir=files)
        real_llm = module.LLM
        extra = {"enforce_eager": True} if _cpu_engine() else {}  # qstrat's CPU kernels run eagerly
        extra.update(self.engine_kwargs)

        started: list[Any] = []

        def llm(*args: Any, **kwargs: Any) -> Any:
            if args or "model" not in kwargs:
                raise _hook_error(self.version, "VLLMGeneration._init_vllm no longer calls LLM(model=...)")
            started.append(real_llm(**{**kwargs, **extra, "model": str(checkpoint)}))
            return started[-1]

        module.LLM = llm
        try:
            init_vllm(gen)
            if not hasattr(gen, "llm"):
                raise _hook_error(self.version, "VLLMGeneration._init_vllm did not set .llm")
            # before the first rollout: the plan's format, and what vLLM built (no NaN-serving engine)
            check_engine_compatible(plan, engine_quantization_config(gen.llm), llm=gen.llm)
        except BaseException:
            _release_started(gen, started)
            raise
        finally:
            module.LLM = real_llm
        sync = QstratWeightSync(gen, driver, plan, checkpoint, keep, verify_every=self.verify_every,
                                on_fidelity_failure=self.on_fidelity_failure)
        gen.sync_weights = sync
        self.syncs.append(sync)

    def attach(self, trainer: Any) -> QstratWeightSync:
        """Log the syncs of ``trainer``'s engine in its metrics (``trainer._metrics``, which TRL's
        GRPO, RLOO and distillation trainers average and log at every logging step).

        Returns: the trainer's :class:`QstratWeightSync`.
        Raises: ConfigError when the trainer has no engine built here (``use_vllm=False``, or built
            outside :func:`rollouts`); TRLHookError when it has no ``_metrics`` store.
        """
        sync = getattr(getattr(trainer, "vllm_generation", None), "sync_weights", None)
        if not isinstance(sync, QstratWeightSync) or sync not in self.syncs:
            raise ConfigError("use_vllm: the trainer has no vLLM engine built under qstrat.integrations.trl "
                              "(set use_vllm=True, vllm_mode='colocate' or 'server', and build it inside rollouts())")
        metrics = getattr(trainer, "_metrics", None)
        if not isinstance(metrics, Mapping) or not {"train", "eval"} <= set(metrics):
            raise _hook_error(self.version, f"{type(trainer).__name__} has no _metrics store with 'train' and "
                              "'eval' (where TRL's trainers collect logged metrics)")
        sync.metrics = metrics
        return sync


@contextmanager
def rollouts(strategy: Any, *, checkpoint_dir: str | Path | None = None,
             engine_kwargs: Mapping[str, Any] | None = None, verify_every: int = 0,
             on_fidelity_failure: str = "raise") -> Iterator[QstratRollouts]:
    """While active, every TRL ``VLLMGeneration`` built starts its engine on a qstrat checkpoint
    in ``strategy`` and syncs through :class:`QstratWeightSync` (colocated); in server mode it
    checks the server and syncs it through
    :class:`~qstrat.integrations.trl_server.QstratServerSync` (:func:`qstrat.integrations.trl_server.start`).

    For trainers built by code you do not call yourself; :func:`make_trainer` is this plus
    :meth:`QstratRollouts.attach`. ``VLLMGeneration._init_vllm`` is restored on exit (also when
    the body raises).

    Args:
        strategy: anything :class:`~qstrat.RefitDriver` takes: a preset name (``"block-fp8"``,
            ``"mxfp8"``, ``"mxfp8-experts"``, ``"nvfp4-experts"``), a mapping, a config file path.
        checkpoint_dir: where each process writes the checkpoint its engine starts on
            (``checkpoint_dir/rank<process index>``; an earlier qstrat checkpoint there is
            replaced, anything else refused). Default: a temporary directory, removed with the
            engine's :class:`QstratWeightSync`.
        engine_kwargs: more ``vllm.LLM`` arguments, overriding TRL's (not ``model``, ``quantization``,
            ``quantization_config``, ``hf_overrides``: the checkpoint decides); on a vLLM CPU
            engine ``enforce_eager=True`` is the default (qstrat's CPU kernels run eagerly).
        verify_every: probe the engine's fidelity on the first sync and every ``verify_every``-th
            after it (the server too, over HTTP), logging :data:`FIDELITY_METRICS`; 0 (default):
            never; not with a PEFT model. Cost: docs/integrations.md, "The fidelity probe per step".
        on_fidelity_failure: what a failed probe does once logged (``qstrat/fidelity/ok`` 0.0):
            ``"raise"`` (default; stops ``trainer.train()``) or ``"warn"`` (FidelityWarning, go on).
    Raises: ImportError / TRLHookError from :func:`check_trl`; ConfigError for an invalid strategy,
        a ``verify_every`` that is not an int >= 0 (or set with a PEFT model), an
        ``on_fidelity_failure`` other than ``"raise"``/``"warn"``, a ``checkpoint_dir``
        that is not a path, an ``engine_kwargs`` that is not a mapping or sets what the checkpoint
        decides (:func:`check_engine_kwargs`: ``model``, ``quantization``, ``quantization_config``,
        ``hf_overrides``), all before the trainer is built; while a trainer is built: ConfigError for ``vllm_mode``
        other than ``colocate`` and ``server``, for ``vllm_enable_sleep_mode`` and for a
        ``quantize_in: engine`` strategy (colocated: refused before anything is written), what
        :func:`qstrat.integrations.trl_server.start` raises (server mode), what ``write_checkpoint`` raises
        (PlanError, NonFiniteError, FileExistsError), PlanError when the started engine's
        quantization_config does not match the plan, EngineBuildError when vLLM built a module in
        another format than the plan (:func:`qstrat.vllm.check_engine_built`); an engine started
        for a trainer whose construction then fails is released.
    """
    version = check_trl()
    import importlib

    module = importlib.import_module(_MODULE)
    cls = module.VLLMGeneration
    original = cls.__dict__["_init_vllm"]
    handle = QstratRollouts(strategy, checkpoint_dir, engine_kwargs, version, verify_every, on_fidelity_failure)

    def _init_vllm(gen: Any) -> None:
        handle.start(gen, original, module)

    cls._init_vllm = _init_vllm
    try:
        yield handle
    finally:
        cls._init_vllm = original


def make_trainer(trainer_cls: type, strategy: Any, *, checkpoint_dir: str | Path | None = None,
                 engine_kwargs: Mapping[str, Any] | None = None, verify_every: int = 0,
                 on_fidelity_failure: str = "raise", **trainer_kwargs: Any) -> Any:
    """Build a TRL trainer whose vLLM rollouts (colocated, or a server) run ``strategy``.

    ``trainer_cls(**trainer_kwargs)`` is built inside :func:`rollouts` and attached
    (:meth:`QstratRollouts.attach`): its engine starts on a qstrat checkpoint of the policy,
    every weight sync is a :func:`qstrat.vllm.refit` fed from TRL's parameter iterator, and each
    sync logs ``qstrat/refit/seconds``, ``qstrat/refit/bytes``, ``qstrat/refit/tensors`` and
    ``qstrat/sync/seconds`` with the trainer's metrics.

    Args:
        trainer_cls: a TRL trainer that builds a ``VLLMGeneration`` (``GRPOTrainer``,
            ``RLOOTrainer``, the distillation trainers) or a subclass; its ``args`` must say
            ``use_vllm=True`` and ``vllm_mode="colocate"`` or ``"server"`` (a server started on a
            qstrat checkpoint with the ``qstrat`` backend: :mod:`qstrat.integrations.trl_server`;
            then ``checkpoint_dir``, ``engine_kwargs`` and ``verify_every`` are refused).
        strategy, checkpoint_dir, engine_kwargs, verify_every, on_fidelity_failure: as in :func:`rollouts`.
        trainer_kwargs: the trainer's own arguments (``model``, ``args``, ``processing_class``, ...).
    Returns: the trainer; its sync is ``trainer.vllm_generation.sync_weights``
        (a :class:`QstratWeightSync`: ``.reports``, ``.checkpoint``, ``.plan``; server mode: a
        :class:`~qstrat.integrations.trl_server.QstratServerSync`, ``.sender`` too).
    Raises: TypeError for a ``trainer_cls`` that is not callable (before anything starts); what
        :func:`rollouts` and :meth:`QstratRollouts.attach` raise, and what the trainer raises.
    """
    if not callable(trainer_cls):  # refused before rollouts() writes a checkpoint or starts an engine
        raise TypeError(f"make_trainer: trainer_cls must be a TRL trainer class (e.g. trl.GRPOTrainer), got "
                        f"{type(trainer_cls).__name__} {trainer_cls!r:.60}")
    with rollouts(strategy, checkpoint_dir=checkpoint_dir, engine_kwargs=engine_kwargs,
                  verify_every=verify_every, on_fidelity_failure=on_fidelity_failure) as handle:
        trainer = trainer_cls(**trainer_kwargs)
    handle.attach(trainer)
    return trainer
