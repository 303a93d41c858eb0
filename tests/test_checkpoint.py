"""The safetensors sink: streaming shards, file modes, shared-memory tensors, refusals."""
from __future__ import annotations

import json
import os
import weakref

import pytest
import torch
from safetensors.torch import load_file

import qstrat.execute.checkpoint as ckpt
from qstrat import NonFiniteError, PlanError, QstratError, RefitDriver
from qstrat.execute.checkpoint import assign_shards, load_checkpoint, shard_file_names, write_checkpoint

MiB = 1 << 20


def u8(t):
    return t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_shards_are_written_while_quantizing_and_then_dropped(tiny_model, tiny_hf_config, tmp_path, monkeypatch):
    state = tiny_model.state_dict()
    driver = RefitDriver("block-fp8", hf_config=tiny_hf_config)
    plan = driver.plan(state)
    expected = assign_shards(plan.outputs(), MiB)
    assert [len(s) for s in expected] == [32, 63, 63, 63, 26]  # 247 outputs, 5003712 bytes
    names = shard_file_names(5)
    assert names[0] == "model-00001-of-00005.safetensors" and names[-1] == "model-00005-of-00005.safetensors"

    emitted = []                      # names the driver has yielded so far
    execute = driver.execute

    def spy_execute(plan, tensors, **kw):
        for name, t in execute(plan, tensors, **kw):
            emitted.append(name)
            yield name, t
    monkeypatch.setattr(driver, "execute", spy_execute)

    saves = []                        # (file name, tensors emitted when it was saved, weakrefs)
    save_file = ckpt.save_file

    def spy_save(tensors, path, metadata=None):
        alive = [s for s in saves if any(r() is not None for r in s[2])]
        # only the previous shard (held by the caller's loop variables) may still be alive
        assert [s[0] for s in alive] in ([], [s[0] for s in saves[-1:]]), [s[0] for s in alive]
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= MiB
        save_file(tensors, path, metadata=metadata)
        refs = [weakref.ref(t) for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
        saves.append((os.path.basename(path), len(emitted), refs))
    monkeypatch.setattr(ckpt, "save_file", spy_save)

    calls = []                        # (bytes written, total, shard files on disk at that moment)

    def progress(done, total):
        calls.append((done, total, sorted(p.name for p in tmp_path.glob(".qstrat-*/*.safetensors"))))

    write_checkpoint(driver, state, tmp_path / "ckpt", shard_bytes=MiB, progress=progress)

    # each shard is saved as soon as its last tensor is emitted, not at the end
    assert [(s[0], s[1]) for s in saves] == [(names[0], 32), (names[1], 95), (names[2], 158),
                                             (names[3], 221), (names[4], 247)]
    sizes = [sum(o.nbytes for o in shard) for shard in expected]
    assert calls[0] == (0, 5003712, [])
    assert [c[0] for c in calls[1:]] == [sum(sizes[:i + 1]) for i in range(5)]
    assert [c[2] for c in calls[1:]] == [names[:i + 1] for i in range(5)]  # 100% only with all 5 on disk
    assert calls[-1][:2] == (5003712, 5003712)

    index = json.loads((tmp_path / "ckpt" / ckpt.INDEX).read_text())
    assert index["metadata"] == {"total_size": 5003712}
    assert index["weight_map"] == {o.name: names[i] for i, shard in enumerate(expected) for o in shard}
    for i, shard in enumerate(expected):  # each file holds its planned tensors
        assert sorted(load_file(str(tmp_path / "ckpt" / names[i]))) == sorted(o.name for o in shard)
    stored = load_checkpoint(tmp_path / "ckpt")
    direct = dict(RefitDriver("block-fp8", hf_config=tiny_hf_config).run(state))
    assert stored.keys() == direct.keys()
    assert all(torch.equal(u8(stored[k]), u8(direct[k].contiguous())) for k in direct)


def test_one_shard_is_model_safetensors_without_index(tiny_model, tiny_hf_config, tmp_path):
    calls = []
    write_checkpoint(RefitDriver("block-fp8", hf_config=tiny_hf_config), tiny_model.state_dict(),
                     tmp_path / "ckpt", progress=lambda d, t: calls.append((d, t)))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors",
                                                                    "qstrat_plan.json"]
    assert calls == [(0, 5003712), (5003712, 5003712)]
    assert shard_file_names(1) == ["model.safetensors"]


@pytest.mark.parametrize("umask,mode", [(0o022, 0o755), (0o027, 0o750), (0o077, 0o700)])
def test_output_directory_mode_follows_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_checkpoint(RefitDriver("bf16"), {"model.norm.weight": torch.ones(8)}, tmp_path / "out")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == mode
    assert (tmp_path / "out" / "model.safetensors").stat().st_mode & 0o777 == mode & 0o666


def test_views_sharing_memory_are_written(tmp_path, umask_022):
    base = torch.arange(10, dtype=torch.bfloat16)
    tied = torch.arange(32, dtype=torch.bfloat16).reshape(4, 8)
    tensors = {"model.norm.weight": base[0:8], "model.layers.0.input_layernorm.weight": base[2:10],
               "model.embed_tokens.weight": tied, "lm_head.weight": tied}  # overlapping views, tied
    write_checkpoint(RefitDriver("bf16"), tensors, tmp_path / "out")
    stored = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert stored.keys() == tensors.keys()
    assert stored["model.norm.weight"].tolist() == list(range(8))
    assert stored["model.layers.0.input_layernorm.weight"].tolist() == list(range(2, 10))
    assert torch.equal(stored["lm_head.weight"], tied) and torch.equal(stored["model.embed_tokens.weight"], tied)
    assert base.tolist() == list(range(10))  # the caller's tensors are not modified


def test_error_after_some_shards_leaves_nothing(tiny_model, tiny_hf_config, tmp_path):
    state = dict(tiny_model.state_dict())
    bad = state["model.layers.3.mlp.experts.down_proj"].clone()
    bad[1, 2, 3] = float("inf")
    state["model.layers.3.mlp.experts.down_proj"] = bad
    calls = []
    with pytest.raises(NonFiniteError, match=r"model\.layers\.3\.mlp\.experts\.down_proj"):
        write_checkpoint(RefitDriver("block-fp8", hf_config=tiny_hf_config), state, tmp_path / "out",
                         shard_bytes=MiB, progress=lambda d, t: calls.append(d))
    assert calls[1] > 0  # shard files had been written before the bad tensor was reached
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_overwrite(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError) as info:
        write_checkpoint(RefitDriver("bf16"), {"model.norm.weight": torch.ones(8)}, tmp_path / "out")
    assert str(info.value) == f"{tmp_path / 'out'} exists; pass overwrite=True to replace it"
    (tmp_path / "afile").write_text("keep")
    with pytest.raises(FileExistsError) as info:
        write_checkpoint(RefitDriver("bf16"), {"model.norm.weight": torch.ones(8)}, tmp_path / "afile",
                         overwrite=True)
    assert str(info.value) == (f"{tmp_path / 'afile'} exists and is not a directory; not replacing it "
                               "(overwrite=True replaces a checkpoint directory only)")
    assert (tmp_path / "afile").read_text() == "keep"
    write_checkpoint(RefitDriver("bf16"), {"model.norm.weight": torch.ones(8)}, tmp_path / "out", overwrite=True)
    assert load_checkpoint(tmp_path / "out")["model.norm.weight"].tolist() == [1.0] * 8


@pytest.mark.parametrize("where,message", [
    ("same", "output directory {out} is the source model directory {src}; write the quantized "
             "checkpoint somewhere else"),
    ("inside", "output directory {out} is inside the source model directory {src}; write the quantized "
               "checkpoint somewhere else"),
    ("around", "output directory {out} contains the source model directory {src}; write the quantized "
               "checkpoint somewhere else"),
])
def test_output_may_not_overlap_the_source(tmp_path, where, message):
    src = tmp_path / "model"
    src.mkdir()
    (src / "tokenizer.json").write_text("{}")
    out = {"same": src, "inside": src / "q", "around": tmp_path}[where]
    with pytest.raises(QstratError) as info:
        write_checkpoint(RefitDriver("bf16"), {"model.norm.weight": torch.ones(8)}, out, overwrite=True,
                         source_dir=src)
    assert str(info.value) == message.format(out=out, src=src)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["model", "tokenizer.json"]


def test_source_dir_files_are_copied_except_weights_and_regenerated_ones(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    for name in ("tokenizer.json", "generation_config.json", "vocab.txt", "tokenizer.model", "config.json",
                 "qstrat_plan.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json", "consolidated.pth"):
        (src / name).write_text(name)
    (src / "original").mkdir()
    write_checkpoint(RefitDriver("bf16"), {"model.norm.weight": torch.ones(8)}, tmp_path / "out",
                     hf_config={"model_type": "x", "architectures": ["XForCausalLM"]}, source_dir=src)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "qstrat_plan.json", "tokenizer.json",
        "tokenizer.model", "vocab.txt"]
    assert (out / "vocab.txt").read_text() == "vocab.txt"
    assert json.loads((out / "config.json").read_text()) == {"model_type": "x", "architectures": ["XForCausalLM"]}


def test_nan_in_the_model_config_is_refused_before_writing(tiny_model, tiny_hf_config, tmp_path):
    from qstrat import QstratError
    from qstrat.execute.checkpoint import write_checkpoint

    with pytest.raises(QstratError, match=r"'rope_theta' cannot be written to config.json"):
        write_checkpoint(RefitDriver("block-fp8", hf_config=tiny_hf_config), tiny_model.state_dict(),
                         tmp_path / "out", hf_config={**tiny_hf_config, "rope_theta": float("nan")})
    assert not (tmp_path / "out").exists()


def test_output_config_keeps_no_quantization_config_vllm_would_read_instead():
    """vLLM reads text_config.quantization_config (or compression_config) when the top level has
    none: a BF16 checkpoint must not carry a stale one there."""
    from qstrat.execute.checkpoint import output_hf_config
    from qstrat.layouts.model_layout import ModelLayout

    plan = RefitDriver("bf16").plan({"model.layers.0.mlp.down_proj.weight": torch.zeros(4, 4)})
    cfg = {"architectures": ["X"], "text_config": {"hidden_size": 4, "quantization_config": {"quant_method": "fp8"}},
           "compression_config": {"quant_method": "compressed-tensors"}, "quantization_config": {"quant_method": "fp8"}}
    out = output_hf_config(cfg, plan, ModelLayout("x"))
    assert out == {"architectures": ["X"], "text_config": {"hidden_size": 4}}
    assert cfg["text_config"]["quantization_config"] == {"quant_method": "fp8"}  # the caller's config untouched


# ---- the plan against the tensors hf_config implies (the "model tensors" sink check) ------------
def _mutated(state, change):
    state = dict(state)
    change(state)
    return state


MODEL_TENSOR_CASES = {
    "missing": (lambda s: s.pop("model.layers.2.self_attn.k_proj.weight"),
                r"model\.layers\.2\.self_attn\.\{q_proj,k_proj,v_proj\}: the plan sends 2 of its 3 tensors; vLLM would "
                r"process it with uninitialised memory for the rest\. Missing: model\.layers\.2\.self_attn\.k_proj\.weight"),
    "extra bias": (lambda s: s.__setitem__("model.layers.1.self_attn.q_proj.bias", torch.ones(256)),
                   r"model\.layers\.1\.self_attn\.q_proj\.bias: the engine's model\.layers\.1\.self_attn\.q_proj takes "
                   r"weight, not bias"),
    "transposed": (lambda s: s.__setitem__("model.layers.1.self_attn.k_proj.weight",
                                           s["model.layers.1.self_attn.k_proj.weight"].T.contiguous()),
                   r"model\.layers\.1\.self_attn\.k_proj\.weight: shape \[256, 128\], the engine expects \[128, 256\]"),
    "narrow norm": (lambda s: s.__setitem__("model.layers.0.input_layernorm.weight", torch.ones(255)),
                    r"model\.layers\.0\.input_layernorm\.weight: shape \[255\], the engine expects \[256\]"),
    "padded vocab": (lambda s: s.__setitem__("model.embed_tokens.weight", torch.ones(1088, 256, dtype=torch.bfloat16)),
                     r"model\.embed_tokens\.weight: shape \[1088, 256\], the engine expects \[1024, 256\]"),
}


@pytest.mark.parametrize("case", sorted(MODEL_TENSOR_CASES))
def test_a_plan_that_is_not_the_models_tensors_is_not_written(case, tiny_model, tiny_hf_config, tmp_path):
    change, message = MODEL_TENSOR_CASES[case]
    state = _mutated(tiny_model.state_dict(), change)
    driver = RefitDriver("bf16", hf_config=tiny_hf_config)
    with pytest.raises(PlanError, match=r"^the refit does not match the model's tensors \(from its config; nothing "
                                        r"was written or sent\):\n  " + (message or "")):
        write_checkpoint(driver, state, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_the_model_tensors_check_accepts_mtp_and_skips_what_it_cannot_derive(tmp_path):
    from qstrat.plugins.builtin.layouts import DEEPSEEK_V3
    from qstrat.vllm.checks.engine_manifest import check_model_tensors
    from qstrat.plugins.registry import get_registry
    from qstrat.layouts.skeleton import model_tensors

    from conftest import model_config

    cfg = model_config("deepseek-v3")
    drv = RefitDriver("block-fp8", hf_config=cfg)
    meta = {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in model_tensors(DEEPSEEK_V3, cfg)}
    assert any(n.startswith("model.layers.61.") for n in meta)  # the MTP layer
    assert check_model_tensors(drv.plan(meta), cfg, DEEPSEEK_V3, get_registry()) is True
    no_mtp = {n: t for n, t in meta.items() if not n.startswith("model.layers.61.")}
    assert check_model_tensors(drv.plan(no_mtp), cfg, DEEPSEEK_V3, get_registry()) is True
    generic = RefitDriver("bf16", hf_config={"model_type": "x", "num_hidden_layers": 1})
    plan = generic.plan({"model.norm.weight": torch.ones(8)})
    assert check_model_tensors(plan, generic.hf_config, generic.layout, get_registry()) is False


# ---- DeepSeek-V3 routing keys transformers fixes and vLLM reads ---------------------------------
def test_a_deepseek_v3_config_without_routing_keys_is_written_as_transformers_routes(tmp_path):
    """transformers' DeepseekV3Config.to_dict() has no scoring_func / topk_method (its modeling
    always routes sigmoid + noaux_tc); vLLM 0.32 reads them with defaults softmax / none. The
    checkpoint says what the trainer computes."""
    import transformers

    from qstrat.execute.checkpoint import output_hf_config

    cfg = transformers.DeepseekV3Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                                        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                                        n_shared_experts=1, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
                                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=128,
                                        num_nextn_predict_layers=0)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    hf = cfg.to_dict()
    assert "scoring_func" not in hf and "topk_method" not in hf
    driver = RefitDriver("bf16", hf_config=hf)
    write_checkpoint(driver, model.state_dict(), tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["scoring_func"], written["topk_method"]) == ("sigmoid", "noaux_tc")
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in load_checkpoint(tmp_path / "out")
    plan = driver.plan(model.state_dict())
    layout = driver.layout
    with pytest.raises(QstratError, match=r"^model config: scoring_func 'softmax': transformers' DeepSeek-V3 always "
                                          r"routes with scoring_func 'sigmoid' \(it does not read the key\) while vLLM "
                                          r"would use 'softmax'"):
        output_hf_config({**hf, "scoring_func": "softmax"}, plan, layout)
    v2 = {**hf, "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "topk_method": "greedy"}
    assert output_hf_config(v2, plan, layout) == v2  # DeepSeek-V2: transformers and vLLM read the keys alike


def test_the_model_tensors_manifest_is_built_once_per_driver(tiny_model, tiny_hf_config, tmp_path, monkeypatch):
    import qstrat.vllm.checks.engine_manifest as em

    built = []
    real = em.build_manifest
    monkeypatch.setattr(em, "build_manifest", lambda *a, **k: built.append(1) or real(*a, **k))
    driver = RefitDriver("block-fp8", hf_config=tiny_hf_config)
    for i in range(2):
        write_checkpoint(driver, tiny_model.state_dict(), tmp_path / f"out{i}")
    assert built == [1]


# ---- shards that are not regular, readable files (issue 36, item 13) ---------------------------
def test_a_directory_or_fifo_named_like_a_shard_is_refused_naming_it(tmp_path):
    """The old message: "No such device (os error 19)" with no file name."""
    from qstrat.execute.checkpoint import lazy_checkpoint

    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(QstratError, match=rf"^{tmp_path / 'model.safetensors'}: is a directory, not a safetensors "
                                          r"file; nothing was read$"):
        lazy_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").rmdir()
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(QstratError, match=r"model\.safetensors: is not a regular file \(a FIFO, device or socket\)"):
        lazy_checkpoint(tmp_path)


def test_an_unreadable_shard_gives_the_os_reason(tmp_path, monkeypatch):
    """safetensors reports a file it may not open as "No such file or directory" (it exists). The
    CI runs as root, where permissions do not stop a read, so the OS's refusal is simulated."""
    import builtins

    from qstrat.execute.checkpoint import lazy_checkpoint
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    real_open = builtins.open

    def denied(file, *args, **kwargs):
        if str(file).endswith("model.safetensors"):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", denied)
    with pytest.raises(QstratError, match=rf"^{tmp_path / 'model.safetensors'}: cannot read: Permission denied$"):
        lazy_checkpoint(tmp_path)


def test_an_index_that_is_a_device_is_refused_before_reading(tmp_path):
    """A model.safetensors.index.json symlinked to /dev/zero read without bound (MemoryError)."""
    from safetensors.torch import save_file

    from qstrat.execute.checkpoint import lazy_checkpoint

    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors.index.json").symlink_to("/dev/zero")
    with pytest.raises(QstratError, match=r"model\.safetensors\.index\.json: is a device, not a safetensors index; "
                                          r"nothing was read$"):
        lazy_checkpoint(tmp_path)


def test_without_an_hf_config_the_source_dirs_config_json_is_the_model_config(tiny_model, tiny_hf_config, tmp_path):
    """A checkpoint written from a model directory without hf_config gets that directory's model
    config (architectures, model_type, sizes) with the plan's quantization_config: it was written
    with only the quantization_config, which vLLM and transformers refuse to load."""
    from transformers import AutoConfig

    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(tiny_hf_config))
    write_checkpoint(RefitDriver("mxfp8"), tiny_model.state_dict(), tmp_path / "out", source_dir=src)
    got = json.loads((tmp_path / "out" / "config.json").read_text())
    assert got["model_type"] == tiny_hf_config["model_type"] and got["architectures"]
    write_checkpoint(RefitDriver("mxfp8"), tiny_model.state_dict(), tmp_path / "given", hf_config=tiny_hf_config)
    assert got == json.loads((tmp_path / "given" / "config.json").read_text())  # as if hf_config were given
    AutoConfig.from_pretrained(tmp_path / "out")  # loadable as a model config


def test_without_any_model_config_the_checkpoint_is_written_with_a_warning_naming_the_fix(tiny_model, tmp_path):
    with pytest.warns(UserWarning) as got:
        write_checkpoint(RefitDriver("mxfp8"), tiny_model.state_dict(), tmp_path / "out")
    message = str(got[0].message)
    assert message.startswith("write_checkpoint: no model config (hf_config, the driver's hf_config or "
                              "source_dir's config.json): ") and "pass hf_config=model.config" in message
    assert set(json.loads((tmp_path / "out" / "config.json").read_text())) == {"quantization_config"}
