"""qstrat.plan.structure: a plan never guesses about a model it does not understand (layers past
the config's depth, weight matrices the layout cannot place, a config that quantizes nothing).
Through the planner: tests/test_model_families.py (unplaced matrices, another family's layout, a
config that quantizes nothing)."""
from __future__ import annotations

import pytest

from qstrat import PlanError, RefitDriver


def test_layers_past_the_configs_depth_are_an_error_not_mtp(tiny_model, tiny_hf_config):
    """num_hidden_layers too small for the tensors given (an adversarial case: layers 2-3 were
    taken for MTP layers and passed through in BF16 silently)."""
    with pytest.raises(PlanError, match=r"tensors are in layers past the model config's 2 decoder layers "
                                        r"\(it has no MTP layers\): model\.layers\.2\."):
        RefitDriver("block-fp8", hf_config={**tiny_hf_config, "num_hidden_layers": 2}).plan(tiny_model.state_dict())
