"""qstrat.select: the trainer-side decisions for a module or a list of names."""
from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

import qstrat
from qstrat import PlanError

from properties import PROPS


def test_select_on_module_and_names(tiny_model):
    decisions = qstrat.select({"preset": "mxfp8-experts", "keep_bf16": {"first": 1}}, tiny_model)
    assert decisions["model.layers.1.mlp.experts.gate_up_proj"].serializer == "mxfp8"
    assert decisions["model.layers.0.mlp.experts.gate_up_proj"].rule == "keep_bf16.first"
    assert decisions["model.layers.1.mlp.gate"].serializer == "passthrough"
    assert decisions["model.layers.1.self_attn.q_proj"].serializer == "bf16"
    assert "model.layers.1.input_layernorm" in decisions
    by_names = qstrat.select("block-fp8", ["model.layers.0.mlp.gate", "model.layers.0.mlp.gate_proj",
                                           "model.layers.0.mlp.experts.gate_up_proj"],
                             hf_config={"model_type": "qwen3_moe"})
    assert {k: d.serializer for k, d in by_names.items()} == {
        "model.layers.0.mlp.gate": "passthrough", "model.layers.0.mlp.gate_proj": "block_fp8",
        "model.layers.0.mlp.experts.gate_up_proj": "block_fp8"}


def test_select_on_names_with_the_models_config_and_on_one_name(tiny_model, tiny_hf_config):
    """The old select planned a bare slab name as one expert, so with the model's config.json
    (which a keep_bf16.last config needs) every MoE model's names were refused ('slab holds 1
    experts, the model config says 4'); a single name as a str was planned letter by letter."""
    config = {"preset": "mxfp8-experts", "keep_bf16": {"last": 1}}
    by_module = qstrat.select(config, tiny_model, hf_config=tiny_hf_config)
    names = [n for n, _ in tiny_model.named_parameters()]
    by_names = qstrat.select(config, names, hf_config=tiny_hf_config)
    assert {k: d.serializer for k, d in by_names.items()} == {k: d.serializer for k, d in by_module.items()}
    assert by_names["model.layers.3.mlp.experts.gate_up_proj"].rule == "keep_bf16.last"
    one = qstrat.select(config, "model.layers.0.mlp.experts.gate_up_proj", hf_config=tiny_hf_config)
    assert {k: d.serializer for k, d in one.items()} == {"model.layers.0.mlp.experts.gate_up_proj": "mxfp8"}


def test_select_with_a_plan_of_another_model_is_refused():
    """The old select checked only the given plan's config: the plan of a hidden-256 model read
    against a hidden-512 one answered silently with the other model's decisions."""
    import transformers

    def model(hidden):
        cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=256, num_attention_heads=4,
                                       num_key_value_heads=2, num_hidden_layers=2, vocab_size=256)
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16), cfg.to_dict()

    (small, cfg), (large, _) = model(256), model(512)
    plan = qstrat.RefitDriver("mxfp8", hf_config=cfg).plan(small.state_dict())
    assert qstrat.select("mxfp8", small, plan=plan) == qstrat.select("mxfp8", small)
    with pytest.raises(PlanError, match=r"^the given tensors do not match the given plan:\n  model\.embed_tokens\.weight: "
                                        r"arrived as bfloat16\[256, 512\], planned as bfloat16\[256, 256\]"):
        qstrat.select("mxfp8", large, plan=plan)


# ---- select is read from the plan (issue 36, item 2) ------------------------------------------
def test_select_reports_the_plans_bf16_fallbacks():
    """k/v of 64 rows cannot join a block-FP8 q/k/v on vLLM's 128-row tile: the plan keeps the
    fused module BF16 (``on_unsupported: bf16``) and lists it ignored; the old select said
    block_fp8."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=256, num_attention_heads=4,
                                   num_key_value_heads=1, head_dim=64, num_hidden_layers=2, vocab_size=512)
    cfg.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    config = {"rules": [{"select": "linear", "serializer": "block_fp8", "on_unsupported": "bf16"}]}
    decisions = qstrat.select(config, model)
    plan = qstrat.RefitDriver(config, hf_config=cfg.to_dict()).plan(model.state_dict())
    assert "model.layers.0.self_attn.qkv_proj" in plan.ignored_layers or \
        "model.layers.0.self_attn.q_proj" in plan.ignored_layers
    for proj in ("q_proj", "k_proj", "v_proj"):
        d = decisions[f"model.layers.0.self_attn.{proj}"]
        assert (d.serializer, d.rule) == ("bf16", "rules[0]") and d.note.startswith("BF16 fallback: ")
    assert decisions["model.layers.0.mlp.gate_proj"].serializer == "block_fp8"


def test_select_refuses_keep_bf16_last_without_the_depth_as_the_plan_does():
    """A shard of layers 0-1 of a 4-layer model: the old select guessed depth 2 and reported
    layer 1 BF16 (the engine serves it in FP8); the plan refuses to guess."""
    names = [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    with pytest.raises(PlanError, match=r"keep_bf16\.last needs the decoder depth: pass hf_config"):
        qstrat.select({"preset": "block-fp8", "keep_bf16": {"last": 1}}, names)
    decisions = qstrat.select({"preset": "block-fp8", "keep_bf16": {"last": 1}}, names,
                              hf_config={"model_type": "llama", "num_hidden_layers": 4})
    assert {d.serializer for d in decisions.values()} == {"block_fp8"}


def test_select_on_a_ddp_wrapped_model_reads_the_wrapped_models_config(tmp_path):
    """DistributedDataParallel has no ``.config``: the old select planned without it (layout
    'generic', no Mixtral rename), so the documented ``*.block_sparse_moe.*`` pattern matched
    nothing and the trainer's view disagreed with the plan (here: a PlanError 'quantizes nothing';
    with a preset behind the rule, a silent disagreement)."""
    import torch.distributed as dist
    import transformers

    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=1, vocab_size=128, num_local_experts=2)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    config = {"preset": "mxfp8", "rules": [{"select": "experts", "include": ["*.block_sparse_moe.*"],
                                            "serializer": "bf16"}]}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        decisions = qstrat.select(config, wrapped)
    finally:
        dist.destroy_process_group()
    plan = qstrat.RefitDriver(config, hf_config=cfg.to_dict()).plan(model.state_dict())
    by_plan = {e.name.removesuffix(".weight"): e.serializer for e in plan.entries
               if e.name.endswith(".weight") or "experts." in e.name}
    assert {k.removeprefix("module."): d.serializer for k, d in decisions.items()} == by_plan
    assert decisions["module.model.layers.0.mlp.experts.gate_up_proj"].serializer == "bf16"
    assert decisions["module.model.layers.0.self_attn.q_proj"].serializer == "mxfp8"


def test_select_on_a_tied_model_reports_its_lm_head_as_the_plan_of_its_state_dict_does():
    """A tied lm_head shares the embedding's Parameter: the old select read named_parameters(),
    which drops it, so select had no 'lm_head' while the refit's plan (of state_dict(), which
    holds it) quantizes it under an lm_head rule."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, vocab_size=512, tie_word_embeddings=True)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    for config, want in (({"preset": "block-fp8", "rules": [{"select": "lm_head", "serializer": "block_fp8"}]},
                          "block_fp8"), ("block-fp8", "passthrough")):
        decisions = qstrat.select(config, model)
        plan = qstrat.RefitDriver(config, hf_config=cfg.to_dict()).plan(model.state_dict())
        assert decisions["lm_head"].serializer == want
        assert {k: d.serializer for k, d in decisions.items()} == {
            e.name.removesuffix(".weight"): e.serializer for e in plan.entries}


# ---- the property: select == the plan, whatever wraps or shards the model ----------------------
_FAMILIES = ("llama", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "qwen3_5_moe", "gpt_oss")
_PATTERNS = ("model.layers.0.*", "*.block_sparse_moe.*", "re:layers\\.1\\.", "*.q_proj.weight", "*.experts.*",
             "*.mlp.gate.weight", "re:\\.(gate|up)_proj")
_WRAPPERS = ("", "_orig_mod.", "module.", "module._orig_mod.", "fsdp")


@functools.lru_cache(maxsize=None)
def _family(family: str) -> tuple[dict, dict]:
    from model_families import config_dict, hf_config, hf_state_dict

    return hf_state_dict(family), config_dict(hf_config(family))


@st.composite
def _configs(draw) -> dict:
    fmt = draw(st.sampled_from(["block_fp8", "mxfp8", "nvfp4"]))
    rules = []
    for _ in range(draw(st.integers(0, 3))):
        rule = {"select": draw(st.lists(st.sampled_from(["linear", "experts", "attention", "dense_mlp",
                                                         "shared_experts", "routers"]), min_size=1, max_size=2)),
                "serializer": draw(st.sampled_from([fmt, "bf16"])),
                "on_unsupported": draw(st.sampled_from(["error", "bf16"]))}
        for key in ("include", "exclude"):
            if draw(st.booleans()):
                rule[key] = draw(st.lists(st.sampled_from(_PATTERNS), min_size=1, max_size=2))
        if "include" in rule and draw(st.booleans()):
            rule["allow_special"] = True
        rules.append(rule)
    config = {"rules": rules, "keep_bf16": {"first": draw(st.integers(0, 2)), "last": draw(st.integers(0, 1))},
              "unplaced_weights": "bf16"}
    preset = draw(st.sampled_from([None, {"block_fp8": "block-fp8", "mxfp8": "mxfp8", "nvfp4": "nvfp4-experts"}[fmt]]))
    if preset:
        config["preset"] = preset
    return config


def _plan_or_error(config: dict, specs: dict, cfg: dict):
    try:
        return qstrat.RefitDriver(config, hf_config=cfg).plan(specs), None
    except PlanError as exc:
        return None, exc


def _select_or_error(config: dict, specs: dict, cfg: dict):
    try:
        return qstrat.select(config, specs, hf_config=cfg), None
    except PlanError as exc:
        return None, exc


def _by_checkpoint_name(decisions: dict) -> dict:
    return {d.parsed.checkpoint_name: (d.serializer, d.options, d.rule, d.note) for d in decisions.values()}


@PROPS
@given(family=st.sampled_from(_FAMILIES), config=_configs(), wrap=st.sampled_from(_WRAPPERS),
       shard=st.tuples(st.integers(0, 2), st.integers(1, 3)))
def test_select_is_what_the_plan_says_for_every_module(family, config, wrap, shard):
    """For random configs, families, wrappers (``_orig_mod.``, ``module.``, FSDP1 + activation
    checkpointing names) and pipeline shards (a range of decoder layers): ``qstrat.select`` gives
    each weight exactly its plan entry's serializer, options, rule and note, refuses exactly when
    the plan refuses, and a wrapped model's decisions - by checkpoint name - are the bare model's;
    a shard's are the whole model's for its layers."""
    from test_rules import _wrapped

    sd, cfg = _family(family)
    specs = _wrapped(sd, wrap) if wrap else sd
    plan, refused = _plan_or_error(config, specs, cfg)
    decisions, select_refused = _select_or_error(config, specs, cfg)
    assert (refused is None) == (select_refused is None)
    if refused is not None:
        event("the plan refuses")
        assert str(select_refused) == str(refused)
        return
    layout = qstrat.RefitDriver(config, hf_config=cfg).layout
    expected = {}
    for e in plan.entries:
        p = layout.parse(e.name, plan.num_layers)
        if e.name.endswith(".weight") or p.slab:
            expected[e.name.removesuffix(".weight")] = (e.serializer, e.options, e.rule, e.note)
    assert {k: (d.serializer, d.options, d.rule, d.note) for k, d in decisions.items()} == expected
    bare, _ = _select_or_error(config, sd, cfg)
    assert _by_checkpoint_name(decisions) == _by_checkpoint_name(bare)
    first, count = shard
    layers = range(first, first + count)
    part = {n: t for n, t in specs.items() if layout.parse(n).layer in layers}
    shard_decisions, _ = _select_or_error(config, part, cfg)
    event(f"shard planned: {shard_decisions is not None}")
    if shard_decisions is not None:  # a shard may be refused on its own (e.g. it quantizes nothing)
        whole = _by_checkpoint_name(bare)
        assert {k: whole[k] for k in _by_checkpoint_name(shard_decisions)} == _by_checkpoint_name(shard_decisions)
