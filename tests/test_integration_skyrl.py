"""qstrat.integrations.skyrl.QstratWeightSource against vLLM's real weight-transfer contract
(``vllm.distributed.weight_transfer.base``, the one SkyRL 0.4.0's sources implement): over vLLM's
own ``ModuleSource`` of the tiny model, metadata agrees with iteration element for element, vLLM's
``iter_groups`` (which checks the order against metadata) accepts the stream, and the bytes are
``RefitDriver.run``'s. SkyRL's own sources under Python 3.12: tests/skyrl312 (scripts/skyrl_check.sh)."""
from __future__ import annotations

import pytest
import torch

from qstrat import PlanError, RefitDriver


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous()


def _stream(tiny_model, tiny_hf_config, strategy):
    """(the source, its metadata, one pass of it, RefitDriver.run's stream of the same model)."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    from qstrat.integrations.skyrl import QstratWeightSource

    driver = RefitDriver(strategy, hf_config=tiny_hf_config)
    source = QstratWeightSource(ModuleSource(tiny_model), driver)
    return source, source.metadata(), list(source), list(driver.run(dict(tiny_model.named_parameters())))


@pytest.mark.parametrize("strategy", ["block-fp8", "nvfp4-experts"])
def test_source_streams_run_bytes_and_keeps_vllms_contract(tiny_model, tiny_hf_config, strategy):
    source, meta, got, want = _stream(tiny_model, tiny_hf_config, strategy)
    assert [m.name for m in meta] == [n for n, _ in got] == [n for n, _ in want]
    assert [(m.dtype, m.shape) for m in meta] == [(t.dtype, tuple(t.shape)) for _, t in got]
    assert {t.dtype for _, t in got} >= {torch.bfloat16, torch.float8_e4m3fn if strategy == "block-fp8" else torch.uint8}
    assert all(torch.equal(_bytes(a), _bytes(b)) for (_, a), (_, b) in zip(got, want))
    assert [n for n, _ in list(source)] == [m.name for m in meta]  # re-iterable: a fresh pass each sync


@pytest.mark.parametrize("strategy", ["block-fp8", "nvfp4-experts"])
def test_vllms_grouped_iteration_accepts_the_stream(tiny_model, tiny_hf_config, strategy):
    """vLLM's default ``iter_groups`` raises if iteration leaves metadata's order; its groups are
    ``layerwise_groups`` of the metadata's names."""
    from vllm.distributed.weight_transfer import base

    if not hasattr(base.WeightSource, "iter_groups"):
        pytest.skip("this vLLM's WeightSource has no iter_groups (vLLM's grouped iteration, with layerwise_groups "
                    "and held_names, arrived in 0.29.0): no trainer engine of this vLLM groups a source")
    source, meta, _, _ = _stream(tiny_model, tiny_hf_config, strategy)
    assert [names for names, _ in source.iter_groups()] == base.layerwise_groups([m.name for m in meta])


def test_a_partial_source_and_an_unplannable_one_are_refused(tiny_model, tiny_hf_config):
    from vllm.distributed.weight_transfer.base import ModuleSource

    from qstrat.integrations.skyrl import QstratWeightSource

    driver = RefitDriver("block-fp8", hf_config=tiny_hf_config)

    class Sharded(ModuleSource):
        def held_names(self):
            return ["model.embed_tokens.weight"]

    with pytest.raises(ValueError, match=r"^QstratWeightSource: Sharded holds only part of the model on this rank "
                                         r"\(held_names\(\) is not None"):
        QstratWeightSource(Sharded(tiny_model), driver)
    odd = torch.nn.Module()  # a name no layout places (nn.Module names cannot hold dots)
    odd.register_parameter("model_layers_0_q_proj_weight", torch.nn.Parameter(torch.zeros(3, 5, dtype=torch.bfloat16)))
    with pytest.raises(PlanError, match=r"layout 'qwen3_moe' cannot place 1 weight matrices: "
                                        r"model_layers_0_q_proj_weight"):
        QstratWeightSource(ModuleSource(odd), driver)
