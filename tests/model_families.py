"""Test helpers: tiny models of each family from transformers' real classes, and vLLM's real model
classes built on the meta device with a plan's quantization_config, to load a plan's outputs.

- :func:`hf_state_dict`: the trainer's view (``state_dict()`` of the transformers 5.x class,
  built on ``meta``: names, shapes, grouped slabs) of a tiny random config per family.
- :func:`vllm_model`: vLLM 0.32's model class for that config, built (tiny, on CPU) exactly as the
  engine builds it (``initialize_model``: the class's ``hf_to_vllm_mapper`` applied to the
  ignore list, ``packed_modules_mapping`` passed to the quantization config), in this process
  (one gloo rank per model, torn down by :func:`vllm_teardown`).
- :func:`load_into`: the plan's outputs, as zero tensors of the planned shapes and dtypes, fed
  to the model's own ``load_weights`` - the code a refit runs - recording what each parameter
  received.

Dims are multiples of 128 so that block-FP8 shards tile exactly (vLLM refuses otherwise).
"""
from __future__ import annotations

import os
import sys
import tempfile
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

#: Shared tiny dims: every fused shard a multiple of 128 rows, K a multiple of 128.
_BASE = dict(hidden_size=256, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
             head_dim=128, vocab_size=512, num_hidden_layers=2, max_position_embeddings=256,
             tie_word_embeddings=False)
_MOE = dict(moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2)
_GDN = dict(linear_num_key_heads=1, linear_key_head_dim=128, linear_num_value_heads=2,
            linear_value_head_dim=128, linear_conv_kernel_dim=4, layer_types=["linear_attention",
                                                                              "full_attention"],
            shared_expert_intermediate_size=128)

#: family -> (transformers config class, architecture, config kwargs).
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _BASE),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", _BASE),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**_BASE, **_MOE}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {**_BASE, **_MOE, "shared_expert_intermediate_size": 128}),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {**_BASE, **_MOE, **_GDN}),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {**_BASE, **_MOE, **_GDN}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        **_BASE, "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 128, "n_shared_experts": 1, "n_group": 2,
        "topk_group": 1, "routed_scaling_factor": 2.5, "q_lora_rank": 128, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "num_key_value_heads": 2, "topk_method": "noaux_tc",
        # DeepSeek-V3's config.json says sigmoid; transformers' config class has no such key, and
        # without it vLLM routes with softmax (an engine no CPU MoE kernel serves). The CPU MLA
        # decode kernel only takes kv_lora_rank + qk_rope_head_dim = 576 (DeepSeek's 512 + 64).
        "scoring_func": "sigmoid", "kv_lora_rank": 512}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {
        **_BASE, "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 128, "n_shared_experts": 1, "n_group": 1,
        "topk_group": 1, "partial_rotary_factor": 0.5}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**_BASE, "num_local_experts": 4,
                                                        "num_experts_per_tok": 2}),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", {
        "text_config": {**_BASE, **_MOE, **_GDN}, "vision_config": {
            "depth": 1, "hidden_size": 128, "intermediate_size": 256, "num_heads": 1,
            "out_hidden_size": 256, "num_position_embeddings": 64}}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {
        **_BASE, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 128,
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 128}),
}


#: Layouts with a BF16-kept dense or partially-dense layer: variant -> (family, config overrides).
#: DeepSeek-V3 and GLM-4 MoE have one through ``first_k_dense_replace`` already; Mixtral has none
#: (its kept first layer comes from ``keep_bf16``).
DENSE_LAYER_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe-mlp_only": ("qwen3_moe", {"mlp_only_layers": [0]}),
    "qwen3_moe-sparse_step": ("qwen3_moe", {"decoder_sparse_step": 2}),
    "qwen2_moe-mlp_only": ("qwen2_moe", {"mlp_only_layers": [0]}),
    "qwen2_moe": ("qwen2_moe", {}),  # every layer MoE; its shared expert is the dense part
    "deepseek_v3": ("deepseek_v3", {}),
    "glm4_moe": ("glm4_moe", {}),
    "mixtral": ("mixtral", {}),
}


def variant_config(variant: str) -> Any:
    """The transformers config of a :data:`DENSE_LAYER_VARIANTS` entry."""
    family, overrides = DENSE_LAYER_VARIANTS[variant]
    return hf_config(family, **overrides)


def hf_config(family: str, **overrides: Any) -> Any:
    """The transformers config object of the family's tiny model (``overrides``: more config keys)."""
    import transformers

    cls_name, arch, kwargs = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**{**kwargs, **overrides})
    cfg.architectures = [arch]
    return cfg


def hf_state_dict(family: str, cfg: Any = None) -> dict[str, torch.Tensor]:
    """``state_dict()`` of the family's transformers class built on ``meta`` in bfloat16."""
    import transformers

    cfg = cfg if cfg is not None else hf_config(family)
    cls = getattr(transformers, cfg.architectures[0])
    with torch.device("meta"):
        model = cls(cfg)
    return {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}


def config_dict(cfg: Any) -> dict[str, Any]:
    """The config as its config.json would read (what a user hands qstrat)."""
    return cfg.to_dict()


def random_model(cfg: Any, seed: int) -> torch.nn.Module:
    """The family's transformers class with real random weights (bf16, CPU, eval), matrices
    scaled x2.5 like the demo's tiny model so greedy decoding does not repeat one token."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, cfg.architectures[0])(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(2.5)
    return model.to(torch.bfloat16).eval()


# ---- vLLM ---------------------------------------------------------------------------------
@dataclass
class Loaded:
    """What vLLM's ``load_weights`` did with a plan's outputs.

    Attributes:
        params: the model's parameter names and dtypes after build.
        received: parameter name -> dtypes of the tensors its weight loader received.
        returned: the names ``load_weights`` reports loaded.
        quantized_modules / unquantized_modules: vLLM modules whose quant method quantizes
            (``Fp8LinearMethod``, ``Fp8MoEMethod``) / does not (``Unquantized*``).
        packed: the class's ``packed_modules_mapping``.
    """

    params: dict[str, torch.dtype]
    received: dict[str, list[torch.dtype]] = field(default_factory=dict)
    returned: set[str] = field(default_factory=set)
    quantized_modules: list[str] = field(default_factory=list)
    unquantized_modules: list[str] = field(default_factory=list)
    packed: dict[str, list[str]] = field(default_factory=dict)

    def missing(self) -> list[str]:
        """Parameters no tensor reached: neither a weight loader received one nor
        ``load_weights`` reports it loaded (gpt-oss copies some parameters directly)."""
        return sorted(p for p in self.params if p not in self.received and p not in self.returned)

    def wrong_dtype(self) -> list[str]:
        """Parameters that received a tensor of another KIND of dtype, which vLLM's ``copy_``
        casts silently: FP8 or packed bytes into a float weight, a float into an FP8 one. (BF16
        into an fp32 router, as vLLM does from a BF16 checkpoint, is the same kind.)"""
        return sorted(f"{p}: {self.params[p]} <- {d}" for p, ds in self.received.items()
                      for d in ds if _kind(d) != _kind(self.params[p]))


def _kind(dtype: torch.dtype) -> str:
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu):
        return "fp8"
    return "float" if dtype.is_floating_point else "bytes"


def vllm_importable(module: str) -> str | None:
    """None if ``vllm.model_executor.models.<module>`` imports here, else the measured reason."""
    import importlib

    try:
        importlib.import_module(f"vllm.model_executor.models.{module}")
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        return f"{type(exc).__name__}: {exc}"
    return None


_DIST: dict[str, Any] = {}


def vllm_model(cfg: Any, quantization_config: dict[str, Any] | None, tmp: Path) -> tuple[Any, Loaded]:
    """vLLM's model class for ``cfg`` built on CPU with ``quantization_config`` (None: BF16; a
    config without ``quant_method``: vLLM's online quantization, ``quantization="online"``).
    (Not on meta: some loaders, e.g. Qwen3-Next's, read the values they split.)

    Returns: (the model, a :class:`Loaded` with its params and module quant methods filled in).
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as an engine does: qstrat's CPU kernels where vLLM has none
    d = Path(tempfile.mkdtemp(dir=tmp))
    cfg.save_pretrained(d)
    kwargs: dict[str, Any] = {}
    if quantization_config is not None and "quant_method" not in quantization_config:  # online (qstrat.vllm.online)
        from vllm.config.quantization import resolve_quantization_config  # as EngineArgs does

        kwargs = dict(quantization="online", quantization_config=resolve_quantization_config("online", quantization_config))
    elif quantization_config is not None:
        kwargs = dict(quantization=quantization_config["quant_method"],
                      hf_overrides={"quantization_config": quantization_config})
    mc = ModelConfig(model=str(d), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=128,
                     enforce_eager=True, **kwargs)
    vc = VllmConfig(model_config=mc, load_config=LoadConfig(load_format="dummy"))
    from vllm.model_executor.model_loader.utils import get_model_architecture

    with set_current_vllm_config(vc), pristine_packed_mappings(get_model_architecture(mc)[0]):
        _init_distributed(tmp)
        with set_default_torch_dtype(mc.dtype):
            model = initialize_model(vllm_config=vc)
    kv_scales = {f"{name}." for name, mod in model.named_modules()
                 if "KVCache" in type(getattr(mod, "quant_method", None)).__name__}
    # KV-cache scales (attn.k_scale...) are not checkpoint tensors: vLLM keeps their defaults
    loaded = Loaded({n: p.dtype for n, p in model.named_parameters()
                     if not any(n.startswith(k) for k in kv_scales)},
                    packed=dict(getattr(model, "packed_modules_mapping", {}) or {}))
    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if qm is None or f"{name}." in kv_scales or "Embedding" in type(qm).__name__:
            continue
        (loaded.unquantized_modules if type(qm).__name__.startswith("Unquantized")
         else loaded.quantized_modules).append(name)
    model._qstrat_vllm_config = vc
    return model, loaded


@contextmanager
def pristine_packed_mappings(model_class: type) -> Iterator[None]:
    """Build ``model_class`` as a FRESH engine process does: vLLM 0.32's Qwen3-MoE and Qwen2-MoE add
    ``gate_up_proj`` to their CLASS-level ``packed_modules_mapping`` inside ``__init__`` (after
    ``SupportsQuant.__new__`` copied it into the quantization config), so in one process every
    later build sees the mapping the first build lacked. Each class's mapping is put back, as a
    new dict, on exit (the built model keeps the one it was built with)."""
    saved = {c: {k: list(v) for k, v in c.__dict__["packed_modules_mapping"].items()}
             for c in model_class.__mro__ if isinstance(c.__dict__.get("packed_modules_mapping"), dict)}
    try:
        yield
    finally:
        for c, mapping in saved.items():
            c.packed_modules_mapping = mapping


def _init_distributed(tmp: Path) -> None:
    """One gloo rank, set up again for each model: vLLM creates its expert-parallel group only
    when the current config is an MoE model."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    vllm_teardown()
    init_file = tempfile.mktemp(dir=tmp, prefix="dist-init-")
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{init_file}")
    initialize_model_parallel(1, 1)
    _DIST["up"] = True


def vllm_teardown() -> None:
    """Tear vLLM's distributed state down (so an engine test can start after these tests)."""
    if _DIST:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
        _DIST.clear()


def load_into(model: Any, loaded: Loaded, plan: Any) -> Loaded:
    """Feed every planned output (zeros, planned shape and dtype) to ``model.load_weights``,
    recording the dtypes each parameter's weight loader receives. Raises what vLLM raises (an
    unknown name, a shape its loader asserts on)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    for name, param in model.named_parameters():
        inner = getattr(param, "weight_loader", default_weight_loader)
        param.weight_loader = _recording(inner, name, loaded.received)
    tensors = [(o.name, torch.zeros(o.shape, dtype=getattr(torch, o.dtype)))
               for _, o in plan.wire_order()]
    with set_current_vllm_config(model._qstrat_vllm_config):
        loaded.returned = set(model.load_weights(iter(tensors)))
    return loaded


def _recording(inner: Any, name: str, received: dict[str, list[torch.dtype]]) -> Any:
    def loader(param: Any, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        received.setdefault(name, []).append(loaded_weight.dtype)
        return inner(param, loaded_weight, *args, **kwargs)

    return loader


# ---- Qwen3.5: vLLM's module imports torchvision --------------------------------------------
@contextmanager
def torchvision_stub() -> Iterator[None]:
    """Let ``vllm.model_executor.models.qwen3_5`` import where torchvision cannot (see
    docs/models.md): its import chain reaches transformers' Qwen2-VL image processor, which
    imports ``torchvision.transforms.v2.functional`` at module level. The stub modules only
    satisfy those imports; calling anything in them raises. No image is processed.

    vLLM inspects a model class in a subprocess (``_LazyRegisteredModel.inspect_model_cls``),
    which the stub would not reach; inside this context it inspects in this process instead
    (private hook of vLLM 0.32, patched here only)."""
    import importlib.machinery
    from unittest import mock

    import transformers  # noqa: F401 - its package-availability checks run before the stub
    from vllm.model_executor.models import registry

    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2",
             "torchvision.transforms.v2.functional", "torchvision.io", "torchvision.ops"]
    saved = {n: sys.modules.get(n) for n in names}
    for n in names:
        m = types.ModuleType(n)
        m.__spec__ = importlib.machinery.ModuleSpec(n, None)
        m.__getattr__ = _stub_attr(n)  # type: ignore[method-assign]
        sys.modules[n] = m
    cls = registry._LazyRegisteredModel
    try:
        with mock.patch.object(cls, "inspect_model_cls",
                               lambda self: registry._ModelInfo.from_model_cls(self.load_model_cls())):
            yield
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def _stub_attr(module: str) -> Any:
    def attr(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*_a: Any, **_k: Any) -> Any:
            raise RuntimeError(f"{module}.{name}: torchvision stub (qstrat tests) called")

        return unavailable

    return attr
