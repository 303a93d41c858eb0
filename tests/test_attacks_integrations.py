"""Integrations and refits an attacker found failing unclearly or half-applying (issue 42): each
test failed on f44ce35 - a /server_info that is not a mapping crashed with AttributeError, ..."""
from __future__ import annotations

import pytest
import torch

from qstrat.errors import ConfigError


# ---- TRL server: a /server_info that is not a mapping ----------------------------------------------
class _Fp8Plan:
    engine_quantization = None

    def vllm_quantization_config(self):
        return {"quant_method": "fp8", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("info,kind", [(None, "NoneType"), (["fp8"], "list"), ("qstrat", "str")])
def test_trl_server_check_refuses_a_server_info_that_is_not_a_mapping_as_a_config_error(info, kind):
    """check_server_info read ``info.get(...)`` on whatever /server_info answered: None, a list
    or a string raised AttributeError; it is a ConfigError naming ``server_info`` and the type."""
    from qstrat.integrations.trl_server import check_server_info

    with pytest.raises(ConfigError, match=rf"^server_info: the vLLM server at http://s:8000 answered "
                                          rf"/server_info with a {kind} "):
        check_server_info(info, _Fp8Plan(), "http://s:8000")


# ---- SkyRL: a NaN deep in the stream ---------------------------------------------------------------
def test_skyrl_source_refuses_a_nan_in_the_last_layer_before_the_first_tensor():
    """QstratWeightSource checked values as it streamed: a NaN in the last layer was raised after
    every earlier tensor had been yielded to vLLM's layerwise reload (no rollback, no flag on the
    trainer side). It is raised before the first tensor now, naming the tensor."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    from qstrat import NonFiniteError, RefitDriver
    from qstrat.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.integrations.skyrl import QstratWeightSource

    model = build_tiny_qwen3_moe(seed=1)
    last = max(int(n.split(".")[2]) for n, _ in model.named_parameters() if n.startswith("model.layers."))
    name = f"model.layers.{last}.self_attn.o_proj.weight"
    with torch.no_grad():
        dict(model.named_parameters())[name][1, 2] = float("nan")
    source = QstratWeightSource(ModuleSource(model), RefitDriver("block-fp8", hf_config=hf_config(model)))
    yielded = []
    with pytest.raises(NonFiniteError, match=rf"{name}"):
        for item in source:
            yielded.append(item[0])
    assert yielded == []
    inline = QstratWeightSource(ModuleSource(model), RefitDriver("block-fp8", hf_config=hf_config(model)),
                                values="inline")
    got = []
    with pytest.raises(NonFiniteError, match=rf"{name}"):
        for item in inline:
            got.append(item[0])
    assert len(got) > 10  # what the stream did before: the earlier layers were handed over
