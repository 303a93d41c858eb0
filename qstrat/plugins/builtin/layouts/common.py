"""What several built-in families share: the projections of Llama-style attention and the
fusions vLLM applies to them (vLLM ``LlamaForCausalLM``: ``qkv_proj``, ``gate_up_proj``)."""
from __future__ import annotations

#: Projections of a softmax-attention block (``self_attn``) in Llama-style families.
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
#: Engine fusions shared by Llama-style families: vLLM's ``qkv_proj`` and ``gate_up_proj``.
QKV_GATE_UP = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
