"""Built-in model layouts, one module per family; docs/models.md is their table.

Each family's home holds everything qstrat knows about it: its naming data (names, fusions,
what stays BF16) and, where its structure differs from the Llama-style default, the small
methods that say so (the tensors its config.json implies, its MoE layers, why its slabs stay
whole):

- :mod:`~qstrat.builtin.layouts.generic` (no family matched), :mod:`~qstrat.builtin.layouts.llama`,
  :mod:`~qstrat.builtin.layouts.qwen` (Qwen2/Qwen3 dense and MoE, Qwen3-Next, Qwen3.5-MoE),
  :mod:`~qstrat.builtin.layouts.deepseek` (DeepSeek-V2/V3), :mod:`~qstrat.builtin.layouts.glm`
  (GLM-4.5), :mod:`~qstrat.builtin.layouts.mixtral`, :mod:`~qstrat.builtin.layouts.gpt_oss`.

Each layout is written from the family's transformers 5.x modeling class (its ``state_dict()``,
the trainer's view) and vLLM 0.32's model class (module names, ``packed_modules_mapping``,
``hf_to_vllm_mapper``), and checked against both by tests/test_model_families.py.
What each family keeps in BF16 (routers, ``sensitive`` projections, vision towers) follows the
official quantized checkpoints and ModelOpt's default exclusions
(``modelopt/torch/quantization/config.py``, ``_default_disabled_quantizer_cfg``: ``*lm_head*``,
``*router*``, ``*mlp.gate.*``, ``*block_sparse_moe.gate*``, ``*mlp.shared_expert_gate.*``,
``*linear_attn.conv1d*``); sources per family in docs/models.md.
Registered through the ``qstrat_layouts`` hook like any third-party layout.
"""
from __future__ import annotations

from qstrat.builtin.layouts.common import QKV_GATE_UP, QKVO
from qstrat.builtin.layouts.deepseek import DEEPSEEK_V3
from qstrat.builtin.layouts.generic import GENERIC
from qstrat.builtin.layouts.glm import GLM4_MOE
from qstrat.builtin.layouts.gpt_oss import GPT_OSS
from qstrat.builtin.layouts.llama import LLAMA
from qstrat.builtin.layouts.mixtral import MIXTRAL
from qstrat.builtin.layouts.qwen import QWEN3, QWEN3_5_MOE, QWEN3_5_MOE_TEXT, QWEN3_MOE, QWEN3_NEXT

__all__ = ["BUILTIN_LAYOUTS", "DEEPSEEK_V3", "GENERIC", "GLM4_MOE", "GPT_OSS", "LLAMA", "MIXTRAL", "QKVO",
           "QKV_GATE_UP", "QWEN3", "QWEN3_5_MOE", "QWEN3_5_MOE_TEXT", "QWEN3_MOE", "QWEN3_NEXT"]

BUILTIN_LAYOUTS = (GENERIC, LLAMA, QWEN3, QWEN3_MOE, QWEN3_NEXT, QWEN3_5_MOE, QWEN3_5_MOE_TEXT,
                   DEEPSEEK_V3, GLM4_MOE, MIXTRAL, GPT_OSS)
