"""Integrations and refits an attacker found failing unclearly or half-applying (issue 42): each
test failed on f44ce35 - a /server_info that is not a mapping crashed with AttributeError, ..."""
from __future__ import annotations

import pytest

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
