"""qstrat.vllm.checks.engine_ignore: which modules an engine keeps unquantized, read as vLLM 0.32 reads its
ignore list per quantization method - checked against vLLM's own functions (the oracle), and
through the engine manifest and the vLLM sink (false accepts and false refusals)."""
from __future__ import annotations

import itertools

import pytest
import torch

import qstrat
from qstrat import PlanError, RefitDriver
from qstrat.plugins.builtin.layouts import QWEN3_MOE
from qstrat.vllm.checks.engine_ignore import IgnoreRuleError, ignore_entries, unquantized_modules
from qstrat.vllm.checks.engine_manifest import build_manifest
from qstrat.plugins.registry import get_registry

from test_vllm_sink import RecordingLLM, manifest_without_cross_check  # noqa: F401 (autouse fixture)

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
#: vLLM prefixes of one decoder layer (fused names, as vLLM's modules are called) and others.
PREFIXES = [f"model.layers.{i}.{m}" for i in (0, 1, 10) for m in
            ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate", "mlp.experts", "mlp.gate_up_proj",
             "mlp.down_proj", "mlp.shared_experts.gate_up_proj", "mlp.shared_experts.down_proj")] + ["lm_head"]
#: valid-but-unusual entries: substrings, prefixes, per-expert names, fused names, wildcards.
ENTRIES = ["lm_head", "mlp.gate", "model.layers.0.", "model.layers.1", "q_proj", "self_attn",
           "model.layers.0.mlp.experts.0.gate_proj", "model.layers.1.self_attn.qkv_proj",
           "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj",
           "*.mlp.gate", "*self_attn.*", "model.layers.1?.*", "shared_experts", "model.layers.0.mlp.gate_proj",
           "model.layers.0.mlp.up_proj", "re:.*mlp\\.gate$", "re:model\\.layers\\.1\\.", "re:mlp"]


def _vllm_rule(method, entries):
    """vLLM's own decision for (prefix) -> excluded, or an exception type (it refuses)."""
    if method == "fp8":
        from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
        return lambda p: is_layer_skipped(p, entries, PACKED, match_mode="exact")
    if method == "modelopt":
        from vllm.model_executor.layers.quantization.modelopt import ModelOptMxFp8Config
        cfg = ModelOptMxFp8Config.from_config({"quant_method": "modelopt", "quant_algo": "MXFP8",
                                               "ignore": list(entries)})
        cfg.packed_modules_mapping = PACKED
        return cfg.is_layer_excluded
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer
    return lambda p: should_ignore_layer(p, entries, PACKED)


def _config(method, entries):
    return {"fp8": {"quant_method": "fp8", "ignored_layers": entries},
            "modelopt": {"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": entries},
            "compressed-tensors": {"quant_method": "compressed-tensors", "ignore": entries}}[method]


def _qstrat(cfg, prefix):
    """qstrat's decision for a vLLM prefix, via the unfused names qstrat's plans carry."""
    parent, _, proj = prefix.rpartition(".")
    members = [f"{parent}.{s}" for s in PACKED.get(proj, [proj])] if parent else [prefix]
    return unquantized_modules(cfg, members, QWEN3_MOE.fused)[members[0]]


@pytest.mark.parametrize("method", ["fp8", "modelopt", "compressed-tensors"])
def test_every_entry_pair_excludes_what_vllm_excludes(method):
    """Every single entry and every pair of entries, on every prefix: qstrat refuses exactly where
    vLLM refuses the config and otherwise decides as vLLM does."""
    checked = 0
    for n in (1, 2):
        for entries in itertools.combinations(ENTRIES, n):
            rule, cfg = _vllm_rule(method, list(entries)), _config(method, list(entries))
            for prefix in PREFIXES:
                try:
                    want = rule(prefix)
                except ValueError:
                    with pytest.raises(IgnoreRuleError, match="covers some of this fused module's members"):
                        _qstrat(cfg, prefix)
                    continue
                assert _qstrat(cfg, prefix) == want, (method, entries, prefix)
                checked += 1
    assert checked > 5000


def test_substring_entries_of_modelopt_differ_from_exact_fp8():
    fp8 = {"quant_method": "fp8", "ignored_layers": ["mlp.gate", "model.layers.0.", "lm_head"]}
    mo = {"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": ["mlp.gate", "model.layers.0.", "lm_head"]}
    mods = ["model.layers.0.self_attn.o_proj", "model.layers.1.mlp.gate", "model.layers.1.mlp.experts",
            "model.layers.0.mlp.experts", "model.layers.10.self_attn.o_proj"]
    assert unquantized_modules(fp8, mods, QWEN3_MOE.fused) == dict.fromkeys(mods, False)
    assert unquantized_modules(mo, mods, QWEN3_MOE.fused) == {
        "model.layers.0.self_attn.o_proj": True, "model.layers.1.mlp.gate": True,
        "model.layers.1.mlp.experts": False, "model.layers.0.mlp.experts": True,
        "model.layers.10.self_attn.o_proj": False}


def test_modelopt_never_quantizes_vision_towers():
    mo = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": []}
    fp8 = {"quant_method": "fp8", "ignored_layers": []}
    mods = ["model.vision_tower.blocks.0.attn.proj", "model.layers.0.self_attn.o_proj"]
    assert unquantized_modules(mo, mods, ()) == {mods[0]: True, mods[1]: False}
    assert unquantized_modules(fp8, mods, ()) == {mods[0]: False, mods[1]: False}


def test_fp8_per_expert_entry_excludes_the_whole_experts_module():
    cfg = {"quant_method": "fp8", "ignored_layers": ["model.layers.2.mlp.experts.5.down_proj"]}
    assert unquantized_modules(cfg, ["model.layers.2.mlp.experts", "model.layers.3.mlp.experts"], ()) == {
        "model.layers.2.mlp.experts": True, "model.layers.3.mlp.experts": False}


def test_a_substring_of_the_fused_name_excludes_all_its_members():
    """'q_proj' is not a substring of vLLM's qkv_proj (q/k/v stay quantized); 'self_attn.q' is."""
    qkv = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    for entry, kept in (("q_proj", False), ("self_attn.q", True)):
        cfg = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": [entry]}
        assert unquantized_modules(cfg, qkv, QWEN3_MOE.fused) == dict.fromkeys(qkv, kept)


def test_a_trailing_star_read_two_ways_is_refused():
    cfg = {"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": ["*mlp.gate*"]}
    dense = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    with pytest.raises(IgnoreRuleError, match=r"model\.layers\.0\.mlp\.gate_up_proj: the engine's ignore entries "
                                              r"\['\*mlp\.gate\*'\] exclude it or not depending on vLLM's model class"):
        unquantized_modules(cfg, dense, QWEN3_MOE.fused)
    assert unquantized_modules(cfg, ["model.layers.0.mlp.gate"], ()) == {"model.layers.0.mlp.gate": True}


@pytest.mark.parametrize("cfg, expected", [
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]},
      "ignore": ["x"]}, ["lm_head"]),
    ({"quant_method": "mxfp8", "ignored_layers": ["lm_head", "mlp.gate"]}, ["lm_head", "mlp.gate"]),
    ({"quant_method": "mxfp8", "quant_algo": "MXFP8", "ignore": ["a"], "ignored_layers": ["b"]}, ["a"]),
    ({"quant_method": "fp8", "modules_to_not_convert": ["lm_head"]}, ["lm_head"]),
    ({"quant_method": "fp8", "ignored_layers": [], "modules_to_not_convert": ["m"]}, ["m"]),
])
def test_the_list_comes_from_the_key_vllm_reads(cfg, expected):
    assert ignore_entries(cfg) == expected


def test_an_ignore_list_that_is_not_a_list_names_the_key():
    with pytest.raises(IgnoreRuleError, match=r"quantization_config\.ignore must be a list of module names "
                                              r"\(strings\), got 'lm_head'"):
        ignore_entries({"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": "lm_head"})


def test_manifest_follows_the_substring_rule(tiny_hf_config):
    cfg = {"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": ["model.layers.0.", "mlp.gate", "lm_head"]}
    m = build_manifest(tiny_hf_config, cfg, QWEN3_MOE, get_registry())
    assert not m.units["model.layers.0.mlp.experts"].quantized
    assert not m.units["model.layers.0.self_attn.o_proj"].quantized
    assert m.units["model.layers.1.mlp.experts"].quantized and not m.units["model.layers.1.mlp.gate"].quantized
    # ModelOpt quantizes lm_head unless excluded; fp8 never does
    m = build_manifest(tiny_hf_config, dict(cfg, ignore=["mlp.gate"]), QWEN3_MOE, get_registry())
    assert m.units["lm_head"].quantized and m.tensors["lm_head.weight_scale"].dtype == "uint8"


def test_sink_refuses_quantized_bytes_into_a_layer_modelopt_keeps_bf16(tiny_model, tiny_hf_config):
    """False accept before: 'model.layers.0.' excludes all of layer 0 (substring)."""
    state = tiny_model.state_dict()
    mx = RefitDriver("mxfp8", hf_config=tiny_hf_config)
    cfg = {"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": ["model.layers.0.", "mlp.gate", "lm_head"]}
    llm = RecordingLLM(cfg)
    with pytest.raises(PlanError, match=r"model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight \(from "
                                        r"model\.layers\.0\.mlp\.experts\.down_proj\): dtype float8_e4m3fn, the engine expects bfloat16 \(model\.layers\.0\.mlp\.experts "
                                        r"is served unquantized"):
        qstrat.vllm.refit(llm, mx, state)
    assert llm.calls == []


def test_sink_accepts_a_substring_list_that_matches_the_plan(tiny_model, tiny_hf_config):
    """False refusal before: the plan keeps layer 0 BF16, the engine's list says so by substring."""
    state = tiny_model.state_dict()
    mx = RefitDriver({"preset": "mxfp8", "keep_bf16": {"first": 1}}, hf_config=tiny_hf_config)
    cfg = {"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": ["model.layers.0.", "mlp.gate", "lm_head"]}
    llm = RecordingLLM(cfg)
    qstrat.vllm.refit(llm, mx, state, allow_cpu_bf16_experts=True)
    assert len(llm.calls) == 1


def test_sink_refuses_bf16_lm_head_into_a_modelopt_engine_that_quantizes_it(tiny_model, tiny_hf_config):
    state = tiny_model.state_dict()
    mx = RefitDriver("mxfp8", hf_config=tiny_hf_config)
    cfg = {"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": ["mlp.gate"]}
    with pytest.raises(PlanError, match=r"lm_head\.weight: dtype bfloat16, the engine expects float8_e4m3fn "
                                        r"\(lm_head is served quantized \(mxfp8\)\)"):
        qstrat.vllm.refit(RecordingLLM(cfg), mx, state)


# ---- the ignore list qstrat writes: every reading of vLLM keeps what the plan keeps ---------------
#: The packed-modules mappings vLLM's quantization config may hold when a fused module is built:
#: none (Qwen3-MoE's gate_up_proj with decoder_sparse_step, or before its __init__ adds it), the
#: class's q/k/v only (Qwen3-MoE's class attribute), or both.
MAPPINGS = [{}, {"qkv_proj": PACKED["qkv_proj"]}, PACKED]


def _vllm_rule_with(method, entries, packed):
    if method == "fp8":
        from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
        return lambda p: is_layer_skipped(p, entries, packed, match_mode="exact")
    if method == "modelopt":
        from vllm.model_executor.layers.quantization.modelopt import ModelOptMxFp8Config
        cfg = ModelOptMxFp8Config.from_config({"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": list(entries)})
        cfg.packed_modules_mapping = packed
        return cfg.is_layer_excluded
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer
    return lambda p: should_ignore_layer(p, entries, packed)


@pytest.mark.parametrize("preset,method", [("block-fp8", "fp8"), ("mxfp8", "modelopt")])
def test_the_written_ignore_list_keeps_fused_modules_under_every_mapping(preset, method):
    """A Qwen3-MoE whose layer 0 is dense and kept BF16: vLLM's own rule, whatever packed-modules
    mapping its quantization config holds, keeps layer 0's qkv_proj and gate_up_proj unquantized
    and quantizes layer 1's (the plan's answer). The shard-only list of the old writer lost
    gate_up_proj with the mappings vLLM 0.32's Qwen3-MoE really has (none, or q/k/v only)."""
    from qstrat.execute.checkpoint import output_hf_config
    from qstrat.cli.demo.tiny_model import TINY_QWEN3_MOE
    from qstrat.vllm.checks.engine_ignore import ignore_entries

    hf = {**TINY_QWEN3_MOE, "model_type": "qwen3_moe",
          "architectures": ["Qwen3MoeForCausalLM"], "mlp_only_layers": [0]}
    driver = RefitDriver({"preset": preset, "keep_bf16": {"first": 1}}, hf_config=hf)
    names = [f"model.layers.{i}.self_attn.{p}.weight" for i in (0, 1) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    names += [f"model.layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    plan = driver.plan({n: torch.empty(256, 256, dtype=torch.bfloat16, device="meta") for n in names})
    entries = ignore_entries(output_hf_config(hf, plan, driver.layout)["quantization_config"])
    assert {"model.layers.0.mlp.gate_up_proj", "model.layers.0.self_attn.qkv_proj",
            "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"} <= set(entries)
    for packed in MAPPINGS:
        rule = _vllm_rule_with(method, entries, packed)
        assert rule("model.layers.0.mlp.gate_up_proj") and rule("model.layers.0.self_attn.qkv_proj"), packed
        assert rule("model.layers.0.mlp.down_proj") and rule("model.layers.0.self_attn.o_proj"), packed
        assert not rule("model.layers.1.self_attn.qkv_proj") and not rule("model.layers.1.self_attn.o_proj"), packed
    shards_only = ignore_entries(plan.vllm_quantization_config())
    assert not _vllm_rule_with(method, shards_only, {})("model.layers.0.mlp.gate_up_proj")


@pytest.mark.parametrize("method", ["fp8", "modelopt", "compressed-tensors"])
def test_engine_ignore_list_adds_fused_names_only_for_whole_groups(method):
    from qstrat.vllm.checks.engine_ignore import engine_ignore_list, with_engine_ignore_list

    entries = ["lm_head", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
               "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.gate_proj",
               "model.layers.2.mlp.shared_expert.gate_proj", "model.layers.2.mlp.shared_expert.up_proj"]
    want = ["lm_head", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.gate_proj",
            "model.layers.2.mlp.shared_expert.gate_proj", "model.layers.2.mlp.shared_expert.gate_up_proj",
            "model.layers.2.mlp.shared_expert.up_proj"]
    assert engine_ignore_list(entries, QWEN3_MOE.fused) == want  # gate_proj alone: no fused name
    cfg = _config(method, entries)
    written = with_engine_ignore_list(cfg, QWEN3_MOE.fused)
    assert ignore_entries(written) == want and ignore_entries(cfg) == entries  # the input is not changed
    assert {k: v for k, v in written.items() if v != want} == {k: v for k, v in cfg.items() if v != entries}
    nested = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "exclude_modules": entries}}
    assert with_engine_ignore_list(nested, QWEN3_MOE.fused)["quantization"] == {"quant_algo": "NVFP4",
                                                                              "exclude_modules": want}
    assert with_engine_ignore_list(None, QWEN3_MOE.fused) is None
