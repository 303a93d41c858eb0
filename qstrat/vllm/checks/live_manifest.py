"""The engine manifest of a vLLM engine - what it accepts, built from its own model config
(:mod:`qstrat.vllm.checks.engine_manifest`) - and whether vLLM agrees: cross-checked with vLLM's record of
the model it built (:mod:`qstrat.vllm.adapter.model_record`), right after start
(:func:`check_engine_built`, :func:`check_model_built`) and before a refit (:func:`engine_manifest`)."""
from __future__ import annotations

from typing import Any

from qstrat.execute.driver import RefitDriver, layout_for
from qstrat.vllm.checks.engine_manifest import EngineManifest, build_manifest
from qstrat.errors import ConfigOnlyUnsupportedError, EngineBuildError, EngineManifestError
from qstrat.layouts.model_layout import ModelLayout
from qstrat.vllm.online import engine_online_args
from qstrat.vllm.checks.online_built import online_build_errors
from qstrat.plugins.registry import Registry, get_registry
from qstrat.vllm.checks.quant_config import engine_quantization_config
from qstrat.vllm.adapter import model_record
from qstrat.vllm.adapter.engine_state import EngineState
from qstrat.vllm.adapter.platform_facts import device_type, in_process
from qstrat.vllm.adapter.views import EngineView, model_config_of, parsed_config_of, read

#: Per engine, per registry (both held weakly): (layout name, cross-checked) -> its manifest.
MANIFESTS: EngineState[EngineState[dict[tuple[str, bool], EngineManifest]]] = EngineState("engine manifests")


def engine_manifest(llm: Any, driver: RefitDriver | None = None, cross_check: bool = True) -> EngineManifest:
    """The :class:`~qstrat.vllm.checks.engine_manifest.EngineManifest` of a running ``vllm.LLM``.

    Built from the engine's own model config, quantization_config and dtype (never from the
    trainer's tensors), with the layout ``driver``'s config names (else the one the engine's
    config selects) and the driver's registry; then cross-checked with vLLM's record of the
    model (:func:`qstrat.vllm.adapter.model_record.cross_check`). Cached on the engine per layout.

    Returns: the manifest.
    Raises: EngineManifestError (nothing sent) if it cannot be built - a family whose tensors its
        layout cannot derive from the config (:class:`~qstrat.errors.ConfigOnlyUnsupportedError`,
        e.g. the ``generic`` layout) included - if vLLM disagrees with it, or if vLLM released
        weights a reload must refill (:func:`qstrat.vllm.adapter.model_record.released_errors`).
    """
    registry = driver.registry if driver is not None else get_registry()
    mc = EngineView(llm).model_config
    layout = layout_for(registry, driver.config.layout if driver is not None else None, parsed_config_of(mc))
    key = (layout.name, cross_check)
    cache = MANIFESTS.setdefault(llm, lambda: EngineState("engine manifests per registry")).setdefault(registry, dict)
    if key in cache:
        return cache[key]
    manifest = model_manifest(mc, registry, layout)
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
    if engine_online_args(EngineView(llm).model_config) is not None:
        if in_process(llm):  # a multiprocess engine: the qstrat transfer backend checks in its worker
            check_online_built(EngineView(llm).model_config, model_record.engine_model(llm))
        return None
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
    mc = model_config_of(vllm_config)
    world = int(read(read(vllm_config, "vllm_config_parallel_config"), "parallel_world_size", 1) or 1)
    if engine_online_args(mc) is not None:
        check_online_built(mc, model_record.read_model(model, world))
        return None
    if parsed_config_of(mc).quantization_config is None:
        return None
    try:
        manifest = model_manifest(mc)
    except EngineManifestError as exc:
        if isinstance(exc.__cause__, ConfigOnlyUnsupportedError):
            return None
        raise
    _check_built(manifest, model_record.read_model(model, world))
    return manifest


def check_online_built(model_config: Any, model: model_record.EngineModel) -> None:
    """Raise EngineBuildError unless vLLM built an online-quantizing engine's modules exactly as
    its ``ignore`` list (the plan's BF16 modules) says (:func:`qstrat.vllm.checks.online_built.online_build_errors`);
    entries under a vision tower the engine did not build (every modality limited to 0) are not
    checked. ``model``: vLLM's record of the built model (:mod:`qstrat.vllm.adapter.model_record`)."""
    args = engine_online_args(model_config)
    ignore = list(getattr(args, "ignore", None) or [])
    kinds = [k for k in ("linear", "moe") if getattr(args, k, None) is not None]
    unbuilt: tuple[str, ...] = ()
    if _no_towers(model_config):
        lay = layout_for(get_registry(), None, parsed_config_of(model_config))
        unbuilt = tuple(f"{model.vllm_name(p.rstrip('.'))}." for p in lay.non_decoder_prefixes)
    errors = online_build_errors(ignore, model.quantized, model.modules, model.packed, kinds, unbuilt)
    if errors:
        raise EngineBuildError(
            f"vLLM built this online-quantizing engine's modules otherwise than its quantization_config's ignore "
            f"list (the plan's BF16 modules) says ({len(errors)}):\n  " + "\n  ".join(errors[:25])
            + "\nfix: start the engine with qstrat.vllm.online.engine_kwargs(plan) of a plan made where vLLM's model "
            "classes can be read (the list is written in vLLM's module names), or use quantize_in: trainer")


def _check_built(manifest: EngineManifest, model: model_record.EngineModel) -> None:
    """Raise EngineBuildError naming each module vLLM built in another format than ``manifest``
    says (:func:`model_record.format_errors`)."""
    misbuilt = model_record.format_errors(manifest, model)
    if misbuilt:
        raise EngineBuildError(_BUILT + "\n  ".join(misbuilt[:25]))


def model_manifest(model_config: Any, registry: Registry | None = None, layout: str | ModelLayout | None = None,
                   record: model_record.EngineModel | None = None) -> EngineManifest:
    """The :class:`~qstrat.vllm.checks.engine_manifest.EngineManifest` of an engine's model, from vLLM's
    ``ModelConfig`` (its hf_config, quantization_config and dtype): what :func:`engine_manifest`
    builds for an ``LLM``, what a refit inside a worker (:mod:`qstrat.vllm.sink.in_worker`) and the
    ``qstrat`` weight-transfer backend (:mod:`qstrat.vllm.engine.transfer_backend`) check against.

    Args:
        model_config: vLLM's ``ModelConfig`` (``hf_config``, ``dtype``, ``multimodal_config``).
        registry: where layouts and formats are looked up (default: the process-wide registry).
        layout: a layout name or object; None: the one the config selects.
        record: vLLM's record of the built model
            (:func:`qstrat.vllm.adapter.model_record.read_engine_model` of a worker) to
            cross-check the manifest with; None: not cross-checked.
    Raises: EngineManifestError if it cannot be built (see :func:`engine_manifest`) or vLLM's
        record disagrees; EngineBuildError for a module vLLM built in another format.
    """
    registry = registry or get_registry()
    config = parsed_config_of(model_config)
    lay = layout if isinstance(layout, ModelLayout) else layout_for(registry, layout, config)
    try:
        manifest = build_manifest(config, config.quantization_config, lay, registry,
                                  model_config.dtype, device_type(),
                                  unbuilt=lay.non_decoder_prefixes if _no_towers(model_config) else ())
    except ConfigOnlyUnsupportedError as exc:  # no family is refit without the manifest's checks
        raise EngineManifestError(f"no engine manifest for layout {lay.name!r}: {exc} (nothing was "
                                  "sent; qstrat refits only engines whose tensors it can check)") from exc
    if record is not None:
        _cross_check(manifest, record)
    return manifest


def _no_towers(model_config: Any) -> bool:
    """Whether a multimodal engine was started with every modality limited to 0
    (``limit_mm_per_prompt``): vLLM then builds no vision tower and skips its weights."""
    mm = getattr(model_config, "multimodal_config", None)
    if mm is None:
        return False
    return all(mm.get_limit_per_prompt(m) == 0 for m in ("image", "video"))

