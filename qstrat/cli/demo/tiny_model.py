"""The built-in default model: a seeded tiny Qwen3-MoE made with transformers (no download).

Its ``state_dict()`` is the trainer's view (transformers 5.x holds experts as grouped slabs
``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I]);
``save_pretrained`` writes per-expert names. H and I are multiples of 128 so block-FP8 MoE
kernels accept it. Random init is scaled up so greedy decoding does not repeat one token.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: Shape of the default model (hidden 256, 8 experts of 128, 4 layers, vocab 1024).
TINY_QWEN3_MOE = dict(
    hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
    num_experts_per_tok=2, vocab_size=1024, max_position_embeddings=512, tie_word_embeddings=False,
)
INIT_SCALE = 2.5


def build_tiny_qwen3_moe(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random ``Qwen3MoeForCausalLM`` in bfloat16 with a fixed seed.

    Args: seed: torch seed; overrides: Qwen3MoeConfig fields replacing :data:`TINY_QWEN3_MOE`.
    Returns: the model (eval mode, bfloat16 parameters, CPU). Raises: ImportError without
    transformers (``pip install 'qstrat[demo]'``).
    """
    from qstrat.cli.console import quiet_torchao_import

    quiet_torchao_import()  # transformers imports torchao (when installed), whose import warns
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **overrides})
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(INIT_SCALE)
    return model.to(torch.bfloat16).eval()


def hf_config(model: torch.nn.Module) -> dict[str, Any]:
    """The model's config.json content as a dict (``torch_dtype`` bfloat16; ``architectures`` set,
    as ``save_pretrained`` writes it: vLLM picks the model class from it)."""
    cfg = model.config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    cfg["torch_dtype"] = "bfloat16"
    cfg.pop("dtype", None)
    return cfg


def save_bf16(model: torch.nn.Module, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """``save_pretrained`` in ``dtype`` (per-expert names on disk). Returns the directory."""
    directory = Path(directory)
    model.to(dtype).save_pretrained(directory)
    model.to(torch.bfloat16)
    return directory
