"""FP8 KV-cache scales across refits: read an engine's k/v scales, and refuse a reload that reset them.

An engine serving an FP8 KV cache (``kv_cache_dtype="fp8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``)
quantizes every key and value it caches with a per-layer scale: the checkpoint's calibrated
``self_attn.k_scale`` / ``v_scale`` (vLLM's ``BaseKVCacheMethod.process_weights_after_loading``),
else 1.0. A reload that does not carry the scales can put 1.0 (or 0) back silently - the
failure NVIDIA-NeMo/RL#3225 and vLLM RFC #48310 describe - and the cache then saturates or loses
precision with no error. vLLM 0.32 has no runtime recomputation of these scales (its
``calculate_kv_scales`` is gone), so a correct refit leaves every layer's scales as they were,
except those the refit itself sends.

Each vLLM attention layer with an FP8 cache (``Attention``, ``MLAAttention``: a module with
``kv_cache_dtype`` starting ``fp8`` and ``_k_scale`` / ``_v_scale``) holds each scale twice: the
tensor its kernels read (``_k_scale``) and a host float (``_k_scale_float``); both are read and
both must hold. These layer attributes are vLLM names of the version table
(:mod:`qstrat.vllm.adapter.names`: ``attention_kv_cache_dtype``, ``attention_k_scale``,
``attention_v_scale``, ``attention_k_scale_float``, ``attention_v_scale_float``), resolved when
scales are read. Importing this module does not import vLLM.

:class:`KVScaleGuard` is what :func:`qstrat.vllm.refit` runs around every reload. Its reference
is the scales the engine MUST hold: those the previous guard's check on this engine recorded
(:data:`EXPECTED`: the scales it found after a passing check, or - after a failed one - the
scales it expected, so a reset engine never becomes the reference), else, on an engine no guard
checked yet, its scales when the reload starts (:func:`engine_kv_scales`). To that reference the
guard applies the scales the payload itself carries (:meth:`KVScaleGuard.observe`) and
compares the engine after the reload (:func:`check_kv_scales`). A sleep/wake or any other step
can be checked with :func:`engine_kv_scales` before and after and :func:`check_kv_scales`.
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch

from qstrat.errors import ConfigError, EngineStateError
from qstrat.vllm.adapter.engine_state import EngineState
from qstrat.vllm.adapter.platform_facts import in_process
from qstrat.vllm.adapter.resolver import resolve
from qstrat.vllm.adapter.views import EngineView, WorkerView

#: The scales of an attention layer, by qstrat's key (also the checkpoint's last name component).
SCALES = ("k_scale", "v_scale")
#: Values a reset leaves (vLLM's default for a missing scale, and an unset one).
RESET_VALUES = (1.0, 0.0)
#: Per engine: the FP8 KV-cache scales it must hold (set by a :class:`KVScaleGuard`
#: check; a failed check keeps the expected scales, so a later refit is compared with them).
EXPECTED: EngineState[dict[str, dict[str, float]]] = EngineState("expected FP8 KV-cache scales")


class KVScaleError(EngineStateError):
    """An FP8 KV-cache scale changed across a reload (or sleep/wake) that did not send it."""


def model_kv_scales(model: torch.nn.Module) -> dict[str, dict[str, float]]:
    """``{attention layer: {"k_scale", "v_scale", "k_scale_float", "v_scale_float"}}`` of every
    layer of ``model`` (a vLLM worker's model) that caches keys/values in FP8; ``{}`` when none
    does. Values are Python floats (the tensors' single element).

    Raises: VllmNameError where the installed vLLM's table entry lacks one of the layer attributes."""
    dtype, read = _layer_attributes()
    out: dict[str, dict[str, float]] = {}
    for name, mod in model.named_modules():
        if not str(getattr(mod, dtype, "")).startswith("fp8") or not hasattr(mod, read["k_scale"][0]):
            continue
        scales: dict[str, float] = {}
        for key, (tensor, host) in read.items():
            scales[key] = float(getattr(mod, tensor).detach().float().cpu().reshape(-1)[0])
            scales[f"{key}_float"] = float(getattr(mod, host))
        out[name] = scales
    return out


def _layer_attributes() -> tuple[str, dict[str, tuple[str, str]]]:
    """The installed vLLM's names of an attention layer's KV-cache dtype, and per scale of
    :data:`SCALES` (the kernels' tensor, the host float).

    Raises: VllmNameError (:func:`qstrat.vllm.adapter.resolve`) where the table lacks one."""
    return resolve("attention_kv_cache_dtype"), {
        "k_scale": (resolve("attention_k_scale"), resolve("attention_k_scale_float")),
        "v_scale": (resolve("attention_v_scale"), resolve("attention_v_scale_float"))}


def _worker_kv_scales(worker: Any) -> dict[str, dict[str, float]]:
    """:func:`model_kv_scales` of a vLLM worker's model (run through ``collective_rpc``)."""
    return model_kv_scales(WorkerView(worker).model())


class KVScaleReader:
    """vLLM worker extension (``worker_extension_cls="qstrat.vllm.sink.kv_scales.KVScaleReader"``, alone or
    as a base of another extension): adds :meth:`qstrat_kv_scales` and :meth:`qstrat_finalize_reload`
    to the worker, callable by name through ``collective_rpc``, which is how :func:`engine_kv_scales`
    reads a MULTIPROCESS engine's scales and a failed reload of one is finalized (vLLM's engine core cannot send a Python function to a worker process:
    "Object of type <class 'function'> is not serializable")."""

    def qstrat_kv_scales(self) -> dict[str, dict[str, float]]:
        """:func:`model_kv_scales` of this worker's model."""
        return model_kv_scales(WorkerView(self).model())

    def qstrat_finalize_reload(self) -> None:
        """vLLM's ``finalize_layerwise_reload`` of this worker's model after a failed reload (what
        :func:`qstrat.vllm.sink.reload.finalize_engine_reload` calls by name on a multiprocess engine)."""
        from qstrat.vllm.adapter.resolver import resolve

        view = WorkerView(self)
        resolve("finalize_layerwise_reload")(view.model(), view.model_config)


#: :class:`KVScaleReader`'s qualified name, as ``worker_extension_cls`` takes it.
READER = f"{KVScaleReader.__module__}.{KVScaleReader.__qualname__}"


def engine_kv_scales(llm: Any) -> dict[str, dict[str, float]]:
    """:func:`model_kv_scales` of a running ``vllm.LLM``'s model (rank 0's: every rank holds
    the same per-layer scales). ``{}`` for an engine without an FP8 KV cache (its
    ``vllm_config.cache_config.cache_dtype`` does not start with ``fp8``). An in-process engine
    runs the reader in its worker as a function; a multiprocess one by name, through its worker
    extension (:class:`KVScaleReader`).

    Raises: ConfigError, before anything is sent, for a multiprocess engine with an FP8 KV cache
        whose ``worker_extension_cls`` has no ``qstrat_kv_scales`` (naming the fix)."""
    view = EngineView(llm)
    if not view.cache_dtype.startswith("fp8"):
        return {}
    if in_process(llm):
        return view.collective_rpc(_worker_kv_scales)[0]
    extension = view.worker_extension_cls
    if not hasattr(extension_class(extension), "qstrat_kv_scales"):
        raise ConfigError(
            f"kv_cache_dtype: this multiprocess engine caches keys and values in {view.cache_dtype}, and qstrat "
            "checks its per-layer k/v scales across every reload by reading them in the worker, which vLLM's "
            "collective_rpc cannot send a function to (a worker process); its worker_extension_cls "
            f"({repr(extension) if extension else 'none'}) has no qstrat_kv_scales. Start the engine with "
            f"worker_extension_cls={READER!r} (or an extension subclassing it), or in-process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0); nothing was sent")
    return view.collective_rpc("qstrat_kv_scales")[0]


def extension_class(extension: Any) -> Any:
    """The class an engine's ``worker_extension_cls`` names (vLLM takes a qualified name or a
    class; ``""``/None: none), imported here; None when it cannot be imported."""
    if not extension or not isinstance(extension, str):
        return extension or None
    module, _, name = extension.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _layer_of(name: str) -> str | None:
    """The vLLM attention layer a scale belongs to: ``model.layers.3.self_attn.attn.k_scale`` ->
    ``model.layers.3.self_attn.attn``; a checkpoint's ``model.layers.3.self_attn.k_scale`` -> the
    same (vLLM's ``maybe_remap_kv_scale_name``); None for another name."""
    head, _, key = name.rpartition(".")
    if key not in SCALES:
        return None
    return head if head.endswith("attn") and not head.endswith("self_attn") else f"{head}.attn"


def expected_scales(before: Mapping[str, Mapping[str, float]],
                    sent: Mapping[str, float] | None = None) -> dict[str, dict[str, float]]:
    """The scales an engine must hold after a reload: ``before`` with the scales ``sent``
    replaced (names as in :func:`check_kv_scales`)."""
    expected = {layer: dict(scales) for layer, scales in before.items()}
    for name, value in (sent or {}).items():
        layer, key = _layer_of(name), name.rpartition(".")[2]
        if layer in expected:
            expected[layer][key] = expected[layer][f"{key}_float"] = float(value)
    return expected


def check_kv_scales(before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]],
                    sent: Mapping[str, float] | None = None, what: str = "the refit") -> None:
    """Raise unless every FP8 KV-cache scale of ``before`` is unchanged in ``after``, except those
    ``sent`` replaced (``{"model.layers.3.self_attn.attn.k_scale": 0.02}``: what the reload carried).

    Args:
        before, after: :func:`engine_kv_scales` of the engine before and after.
        sent: the scales the reload itself carried (checkpoint names are accepted too).
        what: the step, for the message (``"the refit"``, ``"sleep/wake"``).
    Raises: KVScaleError naming every layer and scale that changed, with the value it had and
        has: ``reset to 1.0`` / ``reset to 0.0`` where it became one of :data:`RESET_VALUES`,
        ``changed`` otherwise; a layer that lost its FP8 scales.
    """
    expected = expected_scales(before, sent)
    problems = []
    for layer, scales in expected.items():
        now = after.get(layer)
        if now is None:
            problems.append(f"{layer}: its FP8 KV-cache scales are gone")
            continue
        for key, want in scales.items():
            got = now.get(key)
            if got == want:
                continue
            how = f"reset to {got}" if got in RESET_VALUES else "changed"
            problems.append(f"{layer}.{key} {how} (was {want!r}, now {got!r})")
    if problems:
        raise KVScaleError(f"FP8 KV-cache scales changed across {what}, which did not send them - the engine now "
                           f"quantizes its KV cache with other scales than its checkpoint's: " + "; ".join(problems[:8])
                           + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
                           + ". Reload the checkpoint's k/v scales (or restart the engine) before serving.")


class KVScaleGuard:
    """Around one reload: :meth:`start` takes the scales the engine must hold - those an earlier
    guard's check expected (:data:`EXPECTED`, kept on the engine), else a snapshot of its FP8
    KV-cache scales -, :meth:`observe` records each scale the payload carries, :meth:`check`
    compares after the reload (:func:`check_kv_scales`). A failed check keeps what was expected:
    the next refit of that engine is refused too until its scales are restored (a refit after a
    refused one cannot take the reset engine as its reference). Does nothing for an engine
    without an FP8 KV cache."""

    def __init__(self, before: dict[str, dict[str, float]]) -> None:
        self.before = before
        self.sent: dict[str, float] = {}

    @classmethod
    def start(cls, llm: Any) -> KVScaleGuard:
        now = engine_kv_scales(llm)
        expected = EXPECTED.get(llm)
        return cls(expected if now and expected is not None else now)

    def observe(self, name: str, tensor: torch.Tensor) -> None:
        """Record ``name`` if it is a k/v scale (a one-element tensor named ``...k_scale``/``...v_scale``)."""
        if self.before and name.endswith(SCALES) and tensor.numel() == 1:
            self.sent[name] = float(tensor.detach().float().cpu().reshape(-1)[0])

    def check(self, llm: Any) -> None:
        """Raise KVScaleError (:func:`check_kv_scales`) if the reload changed a scale it did not send."""
        if not self.before:
            return
        after = engine_kv_scales(llm)
        try:
            check_kv_scales(self.before, after, self.sent)
        except KVScaleError:
            EXPECTED.set(llm, expected_scales(self.before, self.sent))  # what it must hold, kept
            raise
        EXPECTED.set(llm, after)
