"""Built-in model layouts, one module per family; docs/models.md is their table.

Each family's home holds everything qstrat knows about it: its naming data (names, fusions,
what stays BF16) and, where its structure differs from the Llama-style default, the small
methods that say so (the tensors its config.json implies, its MoE layers, why its slabs stay
whole):

- :mod:`~qstrat.plugins.builtin.layouts.generic` (no family matched), :mod:`~qstrat.plugins.builtin.layouts.llama`,
  :mod:`~qstrat.plugins.builtin.layouts.qwen` (Qwen2/Qwen3 dense and MoE, Qwen3-Next, Qwen3.5-MoE),
  :mod:`~qstrat.plugins.builtin.layouts.deepseek` (DeepSeek-V2/V3), :mod:`~qstrat.plugins.builtin.layouts.glm`
  (GLM-4.5), :mod:`~qstrat.plugins.builtin.layouts.mixtral`, :mod:`~qstrat.plugins.builtin.layouts.gpt_oss`.

Each layout is written from the family's transformers 5.x modeling class (its ``state_dict()``,
the trainer's view) and vLLM 0.32's model class (module names, ``packed_modules_mapping``,
``hf_to_vllm_mapper``), and checked against both by tests/test_model_families.py.
What each family keeps in BF16 (routers, ``sensitive`` projections, vision towers) follows the
official quantized checkpoints and ModelOpt's default exclusions
(``modelopt/torch/quantization/config.py``, ``_default_disabled_quantizer_cfg``: ``*lm_head*``,
``*router*``, ``*mlp.gate.*``, ``*block_sparse_moe.gate*``, ``*mlp.shared_expert_gate.*``,
``*linear_attn.conv1d*``); sources per family in docs/models.md.
Registered through the ``qstrat_layouts`` hook like any third-party layout.
Shared by several families: :mod:`.common` (Llama-style attention projections and vLLM's fusions of
them).
"""
from __future__ import annotations

from qstrat.plugins.builtin.layouts.common import QKV_GATE_UP, QKVO
from qstrat.plugins.builtin.layouts.deepseek import DEEPSEEK_V3
from qstrat.plugins.builtin.layouts.generic import GENERIC
from qstrat.plugins.builtin.layouts.glm import GLM4_MOE
from qstrat.plugins.builtin.layouts.gpt_oss import GPT_OSS
from qstrat.plugins.builtin.layouts.llama import LLAMA
from qstrat.plugins.builtin.layouts.mixtral import MIXTRAL
from qstrat.plugins.builtin.layouts.qwen import QWEN3, QWEN3_5_MOE, QWEN3_5_MOE_TEXT, QWEN3_MOE, QWEN3_NEXT

__all__ = ["BUILTIN_LAYOUTS", "DEEPSEEK_V3", "GENERIC", "GLM4_MOE", "GPT_OSS", "LLAMA", "MIXTRAL", "QKVO",
           "QKV_GATE_UP", "QWEN3", "QWEN3_5_MOE", "QWEN3_5_MOE_TEXT", "QWEN3_MOE", "QWEN3_NEXT"]

BUILTIN_LAYOUTS = (GENERIC, LLAMA, QWEN3, QWEN3_MOE, QWEN3_NEXT, QWEN3_5_MOE, QWEN3_5_MOE_TEXT,
                   DEEPSEEK_V3, GLM4_MOE, MIXTRAL, GPT_OSS)
