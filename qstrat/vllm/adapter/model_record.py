"""vLLM's own record of a live engine's model, to cross-check an engine manifest with.

When vLLM builds a model it records, for its layerwise reload, every module's parameters in
CHECKPOINT format (meta tensors: shapes and dtypes before any repacking;
``vllm.model_executor.model_loader.reload``: ``record_metadata_for_reloading``). A reload then
processes a module once the elements it received reach that module's total. Reading that record
gives the engine's reload units and their sizes, which :func:`cross_check` compares with the
units of an :class:`~qstrat.vllm.checks.engine_manifest.EngineManifest` built from the model config: a module vLLM
has but the manifest lacks would keep its old weights after a refit; a size that differs means
the manifest would let through a refit that leaves a module half-loaded.

vLLM has no public API for this record. The narrowest private names, resolved through the
version table (:mod:`.names`; a missing one raises :class:`~.resolver.VllmNameError` naming it):
``layerwise_info`` (``reload.layerwise.LAYERWISE_INFO``, the record), ``skip_tensors``
(``reload.meta.SKIP_TENSORS``, tensors it leaves out, e.g. ``bias``) and
``is_deferred_attention_layer`` (``layers.attention``: attention modules whose kv-cache scales
are not checkpoint weights). The public ``LLM.collective_rpc(callable)`` runs the reader in the
worker; ``packed_modules_mapping`` (the model class attribute vLLM's LoRA and quantization
code use) names the fused modules (``qkv_proj`` <- ``q_proj, k_proj, v_proj``).
Importing this module does not import vLLM.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qstrat.vllm.checks.engine_ignore import ENGINE_FUSED_NAMES
from qstrat.vllm.checks.engine_manifest import CASTABLE, EngineManifest, ManifestUnit
from qstrat.serializers.base import dtype_name
from qstrat.vllm.adapter.resolver import available, known_versions, resolve
from qstrat.vllm.adapter.views import EngineView, WorkerView, read


#: vLLM's fused module name -> its checkpoint modules, for a fused module the model class's
#: ``packed_modules_mapping`` does not list (Qwen3-MoE adds ``gate_up_proj`` only for
#: ``mlp_only_layers``; a ``decoder_sparse_step`` dense layer still has one).
_FUSED_LEAVES = {fused: group for group, fused in ENGINE_FUSED_NAMES.items()}


@dataclass(frozen=True)
class EngineModel:
    """What vLLM recorded about rank 0's model.

    Attributes:
        layers: vLLM module prefix -> {dtype name: checkpoint elements} of its parameters
            as recorded (a vocabulary's padding rows included), for modules with parameters (deferred attention layers left out).
        packed: the model's ``packed_modules_mapping`` (fused module -> checkpoint modules).
        skipped: parameter names the record leaves out (``bias``, ``e_score_correction_bias``...).
        world_size: ranks; above 1 the recorded shapes are shards, and sizes are not compared.
        vocab_padding: vLLM module prefix -> the row multiple its vocabulary is padded to
            (``VocabParallelEmbedding.padding_size``: 64, vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``,
            unless the model asks for another), for the embedding and lm_head modules; their
            recorded counts hold the padded rows, the checkpoint the real ones.
        mapper: the class's ``hf_to_vllm_mapper`` (vLLM's ``WeightsMapper``; None: names are
            vLLM's as they are), by which checkpoint names become vLLM's (Qwen3.5's multimodal
            class: ``model.visual.`` -> ``visual.``; gpt-oss: ``.self_attn.`` -> ``.attn.``).
        released: vLLM module prefixes of MLA attention layers built on vLLM's AMX MLA backend
            (``MLAAttention.is_amx_bmm_enabled``, vLLM 0.29+), which releases the layer's
            ``kv_b_proj.weight`` after loading: a layerwise reload cannot refill it.
        quantized: vLLM module prefix -> (``"linear"`` or ``"moe"``, whether its quantization
            method quantizes), for every linear and fused-MoE module (a ``LinearMethodBase`` /
            ``FusedMoEMethodBase``; unquantized: ``UnquantizedLinearMethod`` /
            ``UnquantizedFusedMoEMethod``): what vLLM built.
        modules: every module prefix of the model (shared modules under each name).
    """

    layers: Mapping[str, Mapping[str, int]]
    packed: Mapping[str, Sequence[str]]
    skipped: frozenset[str]
    world_size: int
    vocab_padding: Mapping[str, int] = field(default_factory=dict)
    mapper: Any = None
    released: tuple[str, ...] = ()
    quantized: Mapping[str, tuple[str, bool]] = field(default_factory=dict)
    modules: frozenset[str] = frozenset()

    def vllm_name(self, module: str) -> str:
        """A checkpoint module name as vLLM names it: ``{module}.weight`` through the mapper's
        ``apply_list`` (public in every supported vLLM; ``map_name`` exists only from 0.31.0),
        less ``.weight`` (a module whose weight the mapper drops keeps its name)."""
        mapped = self.mapper.apply_list([f"{module}.weight"]) if self.mapper is not None else []
        return mapped[0][: -len(".weight")] if mapped and mapped[0].endswith(".weight") else module


def read_engine_model(worker: Any) -> EngineModel:
    """Run in a vLLM worker (``llm.collective_rpc(read_engine_model)``): its model's reload record.

    Raises: VllmNameError (a RuntimeError) naming a missing vLLM name; RuntimeError if the
        worker has no ``model_runner.get_model()``.
    """
    view = WorkerView(worker)
    try:
        model = view.model()
    except AttributeError as exc:
        raise RuntimeError(f"the vLLM worker has no get_model() ({exc}; qstrat's vLLM version table "
                           f"was checked against vllm {known_versions()})") from exc
    return read_model(model, view.world_size)


def read_model(model: Any, world_size: int = 1) -> EngineModel:
    """The :class:`EngineModel` of a vLLM model built in this process (``initialize_model`` records
    it; a worker's ``model_runner.get_model()``, a weight-transfer backend's ``model``).

    Args: world_size: the engine's ranks (``parallel_config.world_size``).
    Raises: VllmNameError (a RuntimeError) naming a missing vLLM name.
    """
    info = resolve("layerwise_info")
    skipped = resolve("skip_tensors")
    deferred = _deferred_attention_predicate()
    layers: dict[str, dict[str, int]] = {}
    padding: dict[str, int] = {}
    mla = resolve("mla_attention_layer")
    released = tuple(name for name, module in model.named_modules()
                     if isinstance(module, mla) and read(module, "mla_is_amx_bmm_enabled", False))
    for name, module in model.named_modules():
        if module not in info or deferred(module):
            continue
        if hasattr(module, "num_embeddings_padded") and isinstance(getattr(module, "padding_size", None), int):
            padding[name] = module.padding_size
        params, _buffers = read(info[module], "reload_restore_metadata")
        for t in params.values():
            numel = layers.setdefault(name, {})
            key = dtype_name(t.dtype)
            numel[key] = numel.get(key, 0) + int(read(t, "weight_loader_numel", t.numel()))
    packed = {k: list(v) for k, v in (read(model, "packed_modules_mapping", None) or {}).items()}
    return EngineModel(layers, packed, frozenset(skipped), world_size, padding,
                       read(model, "hf_to_vllm_mapper", None), released, built_quantized(model),
                       frozenset(name for name, _ in model.named_modules(remove_duplicate=False)))


def built_quantized(model: Any) -> dict[str, tuple[str, bool]]:
    """vLLM module prefix -> (``"linear"`` / ``"moe"``, whether vLLM built it quantized), for
    every linear and fused-MoE module of ``model`` (by its ``quant_method``; see
    :attr:`EngineModel.quantized`)."""
    kinds = {"linear": (resolve("linear_method_base"), resolve("unquantized_linear_method")),
             "moe": (resolve("fused_moe_method_base"), resolve("unquantized_fused_moe_method"))}
    out = {}
    for name, module in model.named_modules():
        method = read(module, "layer_quant_method", None)
        for kind, (base, plain) in kinds.items():
            if isinstance(method, base):
                out[name] = (kind, not isinstance(method, plain))
    return out


def released_errors(model: EngineModel) -> list[str]:
    """One line per module of ``model`` whose weights vLLM released after loading (see
    :attr:`EngineModel.released`), saying why a refit cannot refill them and what to change."""
    if not model.released:
        return []
    return [f"{len(model.released)} MLA attention layers ({', '.join(model.released[:3])}"
            f"{', ...' if len(model.released) > 3 else ''}) run on vLLM's AMX MLA backend, which "
            "releases kv_b_proj.weight after loading: vLLM's layerwise reload cannot refill it. Start "
            "the engine with attention_backend='CPU_MLA' (qstrat.vllm.engine.local.start_engine does on AMX "
            "CPUs; vllm serve: --attention-backend CPU_MLA)"]


def _deferred_attention_predicate() -> Any:
    """``module -> bool``: whether vLLM's layerwise reload defers this attention module (its
    kv-cache scales are not checkpoint weights). vLLM's ``is_deferred_attention_layer`` where the
    installed version has it; before it existed (vllm < 0.28), the test those versions' reload
    itself makes (``reload/layerwise.py``: ``isinstance(layer, (Attention, MLAAttention))``)."""
    if available("is_deferred_attention_layer"):
        return resolve("is_deferred_attention_layer")
    kinds = (resolve("attention_layer"), resolve("mla_attention_layer"))
    return lambda module: isinstance(module, kinds)


def engine_model(llm: Any) -> EngineModel:
    """Rank 0's :class:`EngineModel` of a running ``vllm.LLM`` (one ``collective_rpc``)."""
    return EngineView(llm).collective_rpc(read_engine_model)[0]


def cross_check(manifest: EngineManifest, model: EngineModel) -> list[str]:
    """Disagreements between a manifest's reload units and vLLM's record (empty: they agree).

    Every vLLM module with parameters must be one manifest unit (matched by name, through
    ``packed_modules_mapping`` for fused modules, or as a child of an experts unit), and every
    unit must match vLLM modules; with one rank, their checkpoint elements per dtype must be
    equal (tensors vLLM leaves out of its record excluded on both sides), after vLLM's
    load-time transforms: a vocabulary's rows padded (``EngineModel.vocab_padding``); a tied
    lm_head (the manifest's ``dropped`` tensor: no unit of its own) is vLLM's module sharing
    the embedding's weight, neither unknown nor counted.
    """
    owner, tied = _owners(manifest, model)
    errors = [f"vLLM's model has {layer} ({dict(model.layers[layer])}), which the manifest does not "
              "know: a refit would leave it with its old weights"
              for layer in model.layers if layer not in owner and layer not in tied]
    errors += _tied_errors(manifest, model, tied)
    misbuilt = {u for u, _ in _format_mismatches(manifest, model, owner)}
    for u in manifest.units.values():
        mine, theirs = _unit_elements(manifest, model, owner, u)
        if not theirs:
            if mine:
                errors.append(f"{u.name}: no vLLM module takes these tensors")
        elif u.name not in misbuilt and model.world_size == 1 and not _same_elements(mine, theirs, u.quantized):
            errors.append(f"{u.name}: the manifest has {mine} elements per dtype, vLLM records {theirs}")
    return errors


def format_errors(manifest: EngineManifest, model: EngineModel) -> list[str]:
    """Modules vLLM built in another format than the manifest says (empty: none): for each, the
    vLLM module and the checkpoint modules, the format the engine's ``quantization_config`` says
    (the dtypes of its checkpoint tensors), the one vLLM built (the dtypes it recorded), and the
    fix. A format is compared by its dtypes: an unquantized module holds float dtypes only, a
    quantized one its format's parts (``float8_e4m3fn`` + ``float32`` block FP8,
    ``float8_e4m3fn`` + ``uint8`` MXFP8...). Compared at any world size (a shard has its
    module's dtypes)."""
    owner, _ = _owners(manifest, model)
    return [msg for _, msg in _format_mismatches(manifest, model, owner)]


def _format_mismatches(manifest: EngineManifest, model: EngineModel,
                       owner: Mapping[str, str]) -> list[tuple[str, str]]:
    out = []
    for u in manifest.units.values():
        mine, theirs = _unit_elements(manifest, model, owner, u)
        if not mine or not theirs:
            continue
        built_quantized = bool(set(theirs) - CASTABLE)
        if built_quantized == u.quantized and (not u.quantized or set(mine) == set(theirs)):
            continue
        modules = sorted(layer for layer, unit in owner.items() if unit == u.name)
        where = f"{', '.join(modules)} (checkpoint {u.name})" if modules != [u.name] else u.name
        said = f"quantized ({_dtypes(mine)})" if u.quantized else f"unquantized ({_dtypes(mine)})"
        built = f"quantized ({_dtypes(theirs)})" if built_quantized else f"unquantized ({_dtypes(theirs)})"
        if not u.quantized:
            fix = (f"vLLM did not match the ignore list's entries for it: list vLLM's own name "
                   f"{' and '.join(repr(m) for m in modules)} in the checkpoint's quantization_config ignore list too "
                   "(qstrat.execute.checkpoint.write_checkpoint and 'qstrat quantize' write both names), then restart the "
                   "engine; an engine serving it computes with scales no checkpoint tensor fills (NaN)")
        elif not built_quantized:
            fix = ("an entry of the engine's ignore list covers it: remove that entry from the checkpoint's "
                   "quantization_config, or keep the module BF16 in the strategy (keep_bf16, a bf16 rule) and "
                   "write the checkpoint again")
        else:
            fix = "start the engine on a checkpoint written with the plan's strategy (its quantization_config)"
        out.append((u.name, f"{where}: the engine's quantization_config says {said}, vLLM built it {built}; "
                            f"fix: {fix}"))
    return out


def _dtypes(elements: Mapping[str, int]) -> str:
    return " + ".join(sorted(elements))


def _owners(manifest: EngineManifest, model: EngineModel) -> tuple[dict[str, str], set[str]]:
    """(vLLM module -> the manifest unit it belongs to, vLLM names of tied lm_heads)."""
    owner: dict[str, str] = {}
    by_members = {frozenset(model.vllm_name(m) for m in _members(u)): u.name for u in manifest.units.values()}
    # A tied lm_head (the manifest drops its tensor) shares the embedding's weight: vLLM still
    # records the module, but a refit loads nothing into it and it serves the new embedding.
    # (vLLM's names: a mapper may rename it, e.g. Qwen3.5's language_model.lm_head)
    tied = {model.vllm_name(name.rpartition(".")[0]) for name in manifest.dropped}
    for layer in model.layers:
        if layer in tied:
            continue
        parent, _, leaf = layer.rpartition(".")
        members = frozenset(f"{parent}.{m}" if parent else m for m in model.packed.get(leaf, ())) or {layer}
        unit = by_members.get(frozenset(members)) or by_members.get(frozenset({layer}))
        if unit is None and leaf in _FUSED_LEAVES:  # a fused module outside the class's mapping
            unit = by_members.get(frozenset(f"{parent}.{m}" for m in _FUSED_LEAVES[leaf]))
        if unit is None:  # a child module of a unit, e.g. experts.routed_experts
            unit = next((u.name for u in manifest.units.values() if "{" not in u.name
                         and layer.startswith(model.vllm_name(u.name) + ".")), None)
        if unit is not None:
            owner[layer] = unit
    return owner, tied


def _unit_elements(manifest: EngineManifest, model: EngineModel, owner: Mapping[str, str],
                   u: ManifestUnit) -> tuple[dict[str, int], dict[str, int]]:
    """(the manifest's, vLLM's recorded) elements per dtype of unit ``u``."""
    theirs: dict[str, int] = {}
    pad = 1
    for layer, unit in owner.items():
        if unit == u.name:
            pad = model.vocab_padding.get(layer, pad)
            for k, v in model.layers[layer].items():
                theirs[k] = theirs.get(k, 0) + v
    return _numel(manifest, u, model.skipped, pad), theirs


def _tied_errors(manifest: EngineManifest, model: EngineModel, tied: set[str]) -> list[str]:
    """A tied lm_head must hold exactly the embedding's weight (padded alike): anything more
    means the engine built it quantized (scales a refit never loads)."""
    errors = []
    embedding = next((u for u in manifest.units.values() if u.kind == "embedding"), None)
    for layer in sorted(tied & set(model.layers)):
        if embedding is None or model.world_size != 1:
            continue
        pad = model.vocab_padding.get(layer, 1)
        want = _numel(manifest, embedding, model.skipped, pad)
        got = dict(model.layers[layer])
        if got != want:
            why = (f" (the engine's quantization_config quantizes the tied {layer}: list it in its ignore list)"
                   if set(got) != set(want) else "")  # same dtypes, other counts: another vocabulary
            errors.append(f"{layer}: tied to {embedding.name}, it should hold the embedding's {want} elements "
                          f"per dtype, vLLM records {got}{why}")
    return errors


def _members(u: ManifestUnit) -> frozenset[str]:
    if "{" in u.name:  # a fused group key parent.{a,b,c}
        parent, _, names = u.name.partition(".{")
        return frozenset(f"{parent}.{m}" for m in names.rstrip("}").split(","))
    return frozenset({u.name})


def _numel(manifest: EngineManifest, u: ManifestUnit, skipped: frozenset[str], pad: int = 1) -> dict[str, int]:
    """The elements per dtype vLLM records for unit ``u``: the checkpoint shapes, with the rows of
    a vocabulary module padded up to a multiple of ``pad`` (vLLM's ``pad_vocab_size``)."""
    out: dict[str, int] = {}
    for name in next(iter(u.forms.values())):
        t = manifest.tensors[name]
        if name.rpartition(".")[2] in skipped:
            continue
        n = 1
        for i, s in enumerate(t.shape):
            n *= -(-s // pad) * pad if i == 0 else s
        out[t.dtype] = out.get(t.dtype, 0) + n
    return out


def _same_elements(mine: dict[str, int], theirs: dict[str, int], quantized: bool) -> bool:
    """Per dtype for a quantized module (its parts are exact); in total for an unquantized one,
    which accepts any float dtype (vLLM casts it: e.g. GLM-4.5 keeps its router in float32)."""
    return mine == theirs if quantized else sum(mine.values()) == sum(theirs.values())
