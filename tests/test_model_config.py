"""qstrat.layouts.model_config: a model config's shape keys are integers in range before any tensor is
generated (no ZeroDivisionError, negative dimension or endless generation), named in the error."""
from __future__ import annotations

import ast
import re

import pytest
import torch

from qstrat import RefitDriver
from qstrat.plugins.builtin.layouts import DEEPSEEK_V3, QWEN3_MOE
from qstrat.errors import ConfigError
from qstrat.layouts.model_config import INT_KEYS, BOOL_KEYS, ModelConfig, bounded, check_model_config, language_config
from qstrat.layouts.skeleton import model_tensors

from conftest import model_config


@pytest.mark.parametrize("key, value, message", [
    ("num_attention_heads", 0, "num_attention_heads must be an integer in 1..2147483647, got 0"),
    ("hidden_size", -4096, "hidden_size must be an integer in 1..2147483647, got -4096"),
    ("hidden_size", "4096", "hidden_size must be an integer in 1..2147483647, got '4096'"),
    ("vocab_size", 1024.0, "vocab_size must be an integer in 1..2147483647, got 1024.0"),
    ("num_key_value_heads", True, "num_key_value_heads must be an integer in 1..2147483647, got True"),
    ("num_hidden_layers", 10**12, "num_hidden_layers must be an integer in 1..4096, got 1000000000000 "
                                  "(qstrat's limit: a larger num_hidden_layers is no real model)"),
    ("num_experts", 10**6, "num_experts must be an integer in 0..65536, got 1000000 (qstrat's limit"),
    # a string "false" is truthy: read as is, the planner dropped the untied lm_head (adversarial run)
    ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false (a JSON boolean), got 'false'"),
    ("attention_bias", 1, "attention_bias must be true or false (a JSON boolean), got 1"),
])
def test_a_bad_shape_key_is_named_before_any_tensor(key, value, message):
    cfg = {**model_config("qwen3-235b-a22b"), key: value}
    with pytest.raises(ConfigError, match="^" + re.escape(f"model config: {message}")):
        check_model_config(cfg)
    with pytest.raises(ConfigError, match=re.escape(message)):
        next(iter(model_tensors(QWEN3_MOE, cfg)))


def test_deepseek_keys_are_checked_too():
    cfg = {**model_config("deepseek-v3"), "kv_lora_rank": 0}
    with pytest.raises(ConfigError, match=r"^model config: kv_lora_rank must be an integer in 1\.\.2147483647, got 0$"):
        list(model_tensors(DEEPSEEK_V3, cfg))


def test_text_config_must_be_a_mapping_for_the_driver_too():
    for cfg in ({"text_config": 5}, {"text_config": [1, 2]}):
        with pytest.raises(ConfigError, match=r"^model config: text_config must be a mapping \(the language "
                                              r"model's config\), got (int 5|list \[1, 2\])$"):
            RefitDriver("mxfp8", hf_config={**cfg, "model_type": "qwen3_moe"}).plan(
                {"model.layers.0.mlp.down_proj.weight": torch.empty(64, 64, device="meta")})
    assert language_config({"text_config": None, "hidden_size": 4}) == {"text_config": None, "hidden_size": 4}
    assert language_config({"text_config": {"hidden_size": 4}}) == {"hidden_size": 4}


def test_the_driver_refuses_an_impossible_depth():
    with pytest.raises(ConfigError, match=r"num_hidden_layers must be an integer in 1\.\.4096, got 1000000000000"):
        RefitDriver({"preset": "mxfp8", "keep_bf16": {"last": 1}},
                    hf_config={"model_type": "qwen3_moe", "num_hidden_layers": 10**12}).plan(
            {"model.layers.0.mlp.down_proj.weight": torch.empty(64, 64, device="meta")})


def test_generation_is_bounded():
    assert list(bounded(range(3), "x", limit=3)) == [0, 1, 2]
    with pytest.raises(ConfigError, match=r"^model config: it implies more than 3 tensors \(x\); qstrat's limit"):
        list(bounded(range(4), "x", limit=3))
    cfg = {**model_config("qwen3-235b-a22b"), "num_hidden_layers": 4000, "num_experts": 60000}
    with pytest.raises(ConfigError, match=r"implies more than 1000000 tensors \(layout qwen3_moe\)"):
        list(model_tensors(QWEN3_MOE, cfg))


def test_real_configs_pass():
    for name, layout in (("qwen3-235b-a22b", QWEN3_MOE), ("deepseek-v3", DEEPSEEK_V3)):
        check_model_config(model_config(name), layout.num_layers_key)
        assert len(list(model_tensors(layout, model_config(name)))) > 10_000


def test_one_language_config_lookup_serves_every_reader():
    """Where a multimodal model's text config lives is said once (model_config.language_config):
    the quantization config vLLM reads, the checkpoint's config.json, DeepSeek-V3's routing keys,
    the probe's vocabulary and the layouts all go through it (issue 43: five hand-written lookups)."""
    import ast
    from pathlib import Path
    from types import SimpleNamespace

    from qstrat.plugins.builtin.layouts import DEEPSEEK_V3
    from qstrat.vllm.fidelity.probe import text_vocab_size
    from qstrat.layouts.model_config import with_language_config
    from qstrat.vllm.checks.quant_config import quantization_config_of

    qc = {"quant_method": "fp8"}
    text = {"hidden_size": 4, "model_type": "deepseek_v3", "quantization_config": qc}
    mm = {"model_type": "kimi_vl", "text_config": text}
    assert language_config(mm) is text and language_config({"hidden_size": 4}) == {"hidden_size": 4}
    obj = SimpleNamespace(text_config=SimpleNamespace(vocab_size=7))  # an HF config object
    assert language_config(obj) is obj.text_config and language_config(SimpleNamespace(a=1)).a == 1
    assert language_config(None) == {}
    assert quantization_config_of(mm) == qc and quantization_config_of({**mm, "quantization_config": {"a": 1}}) == {"a": 1}
    assert text_vocab_size(SimpleNamespace(config=obj)) == 7
    assert with_language_config(mm, {"x": 1}) == {"model_type": "kimi_vl", "text_config": {"x": 1}}
    assert with_language_config({"y": 2}, {"x": 1}) == {"x": 1}
    out = DEEPSEEK_V3.output_config(ModelConfig.of(mm)).to_dict()  # V3's routing keys where the language model's config is
    assert out["text_config"]["scoring_func"] == "sigmoid" and "scoring_func" not in out
    # no module reads text_config by hand: only model_config.py names the key in code
    root = Path(__file__).resolve().parents[1] / "qstrat"
    readers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if any(isinstance(n, ast.Constant) and n.value == "text_config" for n in ast.walk(ast.parse(p.read_text())))
                     or any(isinstance(n, ast.Attribute) and n.attr in ("text_config", "get_text_config")
                            and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "layout", "ModelLayout"))
                            for n in ast.walk(ast.parse(p.read_text()))))
    assert readers == ["layouts/model_config.py"], readers


# ---- the model config parsed once, at the door (issue 43) -------------------------------------
#: Modules that take a model config from outside - the doors - and parse it
#: (:meth:`qstrat.layouts.model_config.ModelConfig.of`): module -> what comes in there.
DOORS = {
    "layouts/model_config.py": "the parser itself",
    "execute/driver.py": "RefitDriver(config, hf_config=...): parsed into driver.model_config; PlanCache notes edits",
    "execute/checkpoint.py": "write_checkpoint(..., hf_config=...)",
    "plan/trainer_decisions.py": "select(config, module, hf_config=...) and a module's own .config",
    "cli/commands.py": "config.json read from a model directory",
    "vllm/fidelity/probe.py": "a loaded transformers model's config object (the probe's vocabulary)",
    "integrations/": "a trainer's model.config",
    "cli/demo/": "the demo model's config, built there",
    "vllm/adapter/": "a vLLM engine's config object (views.parsed_config_of)",
    "vllm/checks/quant_config.py": "engine_quantization_config(llm): the engine view's hf_config",
    "transport/delta/churn.py": "a benchmark building the demo model's config",
}
#: config.json keys: reading one from a dict by name (``cfg["hidden_size"]``, ``cfg.get("model_type")``,
#: ``"n_group" in cfg``) is parsing the config again.
CONFIG_KEYS = (set(INT_KEYS) | set(BOOL_KEYS) | {"architectures", "model_type", "text_config", "vision_config",
               "compression_config", "layer_types", "mlp_only_layers", "topk_method", "n_group"})
#: functions that read a config dict (model_config.py's helpers of the parser).
DICT_READERS = {"language_config", "with_language_config", "check_model_config"}


def config_dict_reads(source: str) -> list[str]:
    """Where ``source`` reads a model config as a dict: a config key subscripted, ``.get`` /
    ``.pop`` / ``.setdefault`` or tested with ``in``; a :data:`DICT_READERS` call; or anything
    named ``hf_config`` (a parameter, a variable, an attribute) - ``line: what``."""
    found = []
    for n in ast.walk(ast.parse(source)):
        what = None
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value in CONFIG_KEYS:
            what = f"[{n.slice.value!r}]"
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("get", "pop", "setdefault")
              and n.args and isinstance(n.args[0], ast.Constant) and n.args[0].value in CONFIG_KEYS):
            what = f".{n.func.attr}({n.args[0].value!r})"
        elif (isinstance(n, ast.Compare) and isinstance(n.left, ast.Constant) and n.left.value in CONFIG_KEYS
              and any(isinstance(op, (ast.In, ast.NotIn)) for op in n.ops)):
            what = f"{n.left.value!r} in"
        elif isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) in DICT_READERS:
            what = f"{getattr(n.func, 'id', getattr(n.func, 'attr', None))}()"
        elif (isinstance(n, ast.Name) and n.id == "hf_config" or isinstance(n, ast.arg) and n.arg == "hf_config"
              or isinstance(n, ast.Attribute) and n.attr == "hf_config"):
            what = "hf_config"
        if what:
            found.append(f"{n.lineno}: {what}")
    return found


def test_no_module_below_the_door_reads_a_config_dict():
    """The model config is parsed once where it comes in (:data:`DOORS`) into a ModelConfig that
    every layer below reads by typed attribute: layouts, tensor generators, the planner, manifests,
    checks, the sender. Found by AST (keys by name, not by grep)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "qstrat"
    readers = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.split("/")[0] in ("serializers", "strategies") or any(rel == d or rel.startswith(d) for d in DOORS
                                                                     if d.endswith("/") or d == rel):
            continue
        found = config_dict_reads(path.read_text())
        if found:
            readers[rel] = found
    assert readers == {}, readers


def test_the_dict_read_check_fails_on_each_form():
    """Each form the check above looks for is found (a check that finds nothing proves nothing)."""
    source = '''
def f(cfg, hf_config):
    a = cfg["hidden_size"]
    b = cfg.get("model_type")
    c = "n_group" in cfg
    d = language_config(cfg)
    e = driver.hf_config
    return cfg["layout"], cfg.get("ignore"), config.hidden_size
'''
    assert config_dict_reads(source) == ["2: hf_config", "3: ['hidden_size']", "4: .get('model_type')",
                                         "5: 'n_group' in", "6: language_config()", "7: hf_config"]


def test_model_config_reads_as_the_generators_did():
    """Typed attributes: absent or null gives the default, a key without one is a KeyError naming
    it; the language model's keys of a multimodal config; a copy, not a view of the caller's dict."""
    given = {"model_type": "kimi_vl", "architectures": ["KimiVL"], "vision_config": {"depth": 2},
             "text_config": {"hidden_size": 64, "num_attention_heads": 4, "qkv_bias": None, "n_group": 8,
                             "model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8"}}}
    c = ModelConfig.of(given)
    assert (c.hidden_size, c.head_dim, c.num_key_value_heads, c.attention_bias, c.qkv_bias) == (64, None, None, False, None)
    assert (c.n_group, c.first_k_dense_replace, c.mlp_only_layers, c.layer_types) == (8, 0, (), ())
    assert (c.model_type, c.top_model_type, c.language_model_type, c.architectures) == (
        "kimi_vl", "kimi_vl", "deepseek_v3", ("KimiVL",))
    assert c.vision.depth == 2 and c.quantization_config == {"quant_method": "fp8"} and c.multimodal
    with pytest.raises(KeyError, match="vocab_size"):
        c.vocab_size
    assert c.known("vocab_size") is None and c.known("hidden_size") == 64
    with pytest.raises(AttributeError, match="no config key attribute 'hiden_size'"):
        c.known("hiden_size")
    given["text_config"]["hidden_size"] = 128  # the caller's dict edited: the parsed config is a copy
    assert c.hidden_size == 64 and ModelConfig.of(c) is c and ModelConfig.of(None).raw == {}
    with pytest.raises(TypeError):
        c.raw["model_type"] = "x"  # read-only
    out = c.with_quantization({"quant_method": "modelopt"}).to_dict()
    assert out["quantization_config"] == {"quant_method": "modelopt"} and "quantization_config" not in out["text_config"]
    assert c.with_language(qkv_bias=True).qkv_bias is True and c.qkv_bias is None
    with pytest.raises(ConfigError, match="hf_config must be the model's config.json content"):
        ModelConfig.of(42)
    with pytest.raises(ConfigError, match="architectures must be a list of class names"):
        ModelConfig.of({"architectures": "Llama"}).architectures


# ---- the door refuses bad values for every caller (adversarial run, branch attack) --------------

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "vocab_size": 256}
_TENSORS = {f"model.layers.{i}.mlp.down_proj.weight": torch.empty(64, 128, dtype=torch.bfloat16, device="meta")
            for i in range(2)}


@pytest.mark.parametrize("key, value, message", [
    # read as is, bool("false") tied the head of an untied model (tied_lm_head, the engine manifest)
    ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false (a JSON boolean), got 'false'"),
    ("hidden_size", -64, "hidden_size must be an integer in 1..2147483647, got -64"),
    ("num_experts", "8", "num_experts must be an integer in 0..65536, got '8'"),
    ("num_hidden_layers", 2.0, "num_hidden_layers must be an integer in 1..4096, got 2.0"),
])
def test_refit_driver_checks_the_config_at_the_door(key, value, message):
    """RefitDriver with real tensors (no config-only generation) checked only the layer count:
    a string "false" or a negative size passed and was read below the door."""
    with pytest.raises(ConfigError) as exc:
        RefitDriver("block-fp8", hf_config={**_LLAMA, key: value})
    assert str(exc.value) == f"model config: {message}"
    with pytest.raises(ConfigError) as exc:  # in a multimodal config's text_config too
        RefitDriver("block-fp8", hf_config={"model_type": "qwen2_5_vl", "text_config": {**_LLAMA, key: value}})
    assert str(exc.value) == f"model config: {message}"


def test_write_checkpoint_checks_its_own_hf_config_before_writing(tmp_path):
    from qstrat.execute.checkpoint import write_checkpoint

    driver = RefitDriver("block-fp8", hf_config=_LLAMA)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"^model config: tie_word_embeddings must be true or false"):
        write_checkpoint(driver, _TENSORS, out, hf_config={**_LLAMA, "tie_word_embeddings": "no"})
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_typed_attributes_refuse_what_int_and_bool_would_coerce():
    """A ConfigKey read below an unchecked door: int(2.5) was 2, bool("false") True."""
    with pytest.raises(ConfigError, match=r"^model config: tie_word_embeddings must be true or false .*got 'false'$"):
        ModelConfig.of({"tie_word_embeddings": "false"}).tie_word_embeddings
    with pytest.raises(ConfigError, match=r"^model config: n_group must be an integer, got 2.5$"):
        ModelConfig.of({"n_group": 2.5}).n_group
    assert ModelConfig.of({"tie_word_embeddings": True, "n_group": 8}).n_group == 8


def test_a_foreign_to_dict_is_named():
    class Broken:
        def to_dict(self):
            raise RuntimeError("boom")

    class NotAMapping:
        def to_dict(self):
            return [("hidden_size", 64)]

    with pytest.raises(ConfigError, match=r"^hf_config: Broken\.to_dict\(\) failed: RuntimeError: boom$"):
        ModelConfig.of(Broken())
    with pytest.raises(ConfigError, match=r"^hf_config: NotAMapping\.to_dict\(\) must return the config as a "
                                          r"mapping, got list$"):
        RefitDriver("block-fp8", hf_config=NotAMapping())


@pytest.mark.parametrize("cfg", [
    {**_LLAMA, "tie_word_embeddings": True},
    {**_LLAMA, "vocab_size": 151_937},
    {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
     "text_config": {**_LLAMA, "model_type": "qwen2"}},
    None,
])
def test_unusual_valid_configs_still_plan(cfg):
    driver = RefitDriver("block-fp8", hf_config=cfg)
    plan = driver.plan(_TENSORS)
    assert [e.name for e in plan.entries] == sorted(_TENSORS)
    assert driver.num_layers() == (None if cfg is None else 2)


def test_a_transformers_config_object_plans():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(**{k: v for k, v in _LLAMA.items() if k not in ("architectures", "model_type")})
    driver = RefitDriver("block-fp8", hf_config=cfg)
    assert driver.model_config.hidden_size == 64 and driver.num_layers() == 2


@pytest.mark.parametrize("change, message", [
    ({"vision_config": 5}, "vision_config must be a mapping (the vision tower's config), got int 5"),  # TypeError
    ({"quantization_config": "fp8"}, "quantization_config must be a mapping (a checkpoint's quantization config), "
                                     "got str 'fp8'"),  # was: accepted by RefitDriver, TypeError when read
])
def test_sections_that_are_not_mappings_are_refused_at_the_door(change, message):
    with pytest.raises(ConfigError) as exc:
        RefitDriver("block-fp8", hf_config={**_LLAMA, **change})
    assert str(exc.value) == f"model config: {message}"


def test_list_and_string_attributes_and_keys_are_not_coerced():
    with pytest.raises(ConfigError, match=r"^model config: layer_types must be a list, got 'full'$"):
        ModelConfig.of({"layer_types": "full"}).layer_types  # tuple("full") was ('f', 'u', 'l', 'l')
    with pytest.raises(ConfigError, match=r"^model config: topk_method must be a string, got 5$"):
        ModelConfig.of({"topk_method": 5}).topk_method
    with pytest.raises(ConfigError, match=r"^model config: keys must be strings \(config.json's\), got 1$"):
        ModelConfig.of({**_LLAMA, 1: 2})  # was: TypeError from ModelConfig.key's sorted JSON
    assert ModelConfig.of({"layer_types": ["full_attention"]}).layer_types == ("full_attention",)
