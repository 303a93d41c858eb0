"""Hostile and unusual inputs an attacker found against the delta one-pass encoder, PlanCache's
one rule and TRL server's served-method check: each test failed before its fix (69dbb47; on 35abb4b) -
a delta stream took a tensor of another dtype/shape with its slot's byte count (full mode
refused it), a malformed server document crashed instead of a ConfigError, a handle with a list
shape never hit the cache, an in-place hf_config edit re-planned with the old layout. Real
gloo receivers where the transport is involved; no engine."""
from __future__ import annotations

import pytest
import torch

from qstrat.errors import ConfigError, TransportError
from qstrat.transport.delta import encoding as delta
from qstrat.transport.delta.stream import encode_round
from qstrat.transport.wire_manifest import build_wire_manifest

BUCKET = 1008  # not a tile multiple: buckets end off a word boundary


def _target():
    shapes = {"b": (1001,), "scale": (4, 8), "d": (2 * BUCKET + 5,)}
    g = torch.Generator().manual_seed(3)
    tensors = {n: torch.randint(0, 256, s, dtype=torch.uint8, generator=g) for n, s in shapes.items()}
    return build_wire_manifest([(n, "uint8", s) for n, s in shapes.items()], BUCKET, 16), tensors


# ---- 1. delta: the stream accepts a tensor the full round refuses ----------------------------------
@pytest.mark.parametrize("bad", [torch.zeros(4, 8, dtype=torch.int8),   # another dtype, same bytes
                                 torch.zeros(8, 4, dtype=torch.uint8),  # another shape, same bytes
                                 torch.zeros(2, 8, dtype=torch.float16)])  # both
def test_delta_stream_refuses_a_tensor_whose_dtype_or_shape_differs_from_its_slot(bad):
    """Delta mode refuses a tensor whose dtype or shape is not its slot's with the full path's
    message (qstrat/transport/send/outgoing.py: 'the source yielded NAME DTYPE SHAPE where the wire
    manifest has ...'), in both the bucket-by-bucket encoder and the stream. Before 69dbb47 fill_stream checked
    only the name and the byte count, so the engine reinterpreted the bytes in the slot's
    dtype/shape with agreeing digests: a silent wrong result this test now rules out."""
    target, tensors = _target()
    tensors["scale"] = bad
    with pytest.raises(TransportError, match=r"'scale'.*where the wire manifest has 'scale' uint8 \[4, 8\]"):
        encode_round(target, iter(tensors.items()), None)
    with pytest.raises(TransportError, match=r"'scale'.*where the wire manifest has 'scale' uint8 \[4, 8\]"):
        delta.stream_of(target, tensors.items())


# ---- 2. TRL server's check: a hostile / malformed server document ---------------------------------
class _Fp8Plan:
    engine_quantization = None

    def vllm_quantization_config(self):
        return {"quant_method": "fp8", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("model_config,why", [
    ({"quantization": ["fp8"]}, r"serves \['fp8'\]"),
    ({"quantization": {"method": "fp8"}}, r"serves \{'method': 'fp8'\}"),
    (["fp8"], r"model_config"),
])
def test_trl_server_check_names_a_malformed_server_document_as_a_config_error(model_config, why):
    """check_server_info raises ConfigError naming the setting for every malformed server
    document: a ``model_config.quantization`` that is a list/dict (unhashable), and a
    ``model_config`` that is not a mapping. Before 69dbb47 these crashed (``TypeError:
    unhashable type`` in _is_online; ``AttributeError: 'list' object has no attribute 'get'``:
    only ``weight_transfer_config`` was guarded by isinstance)."""
    from qstrat.integrations.trl_server import check_server_info

    info = {"weight_transfer_config": {"backend": "qstrat"}, "model_config": model_config}
    with pytest.raises(ConfigError, match=why):
        check_server_info(info, _Fp8Plan(), "http://server:8000")


# ---- 3. PlanCache: a handle whose .shape is a list -------------------------------------------------
def test_plan_cache_hits_for_a_handle_whose_shape_is_a_list_and_never_reports_equal_shapes_as_a_miss():
    """as_tensor_dict accepts any object with .shape and a torch .dtype; a handle whose .shape is
    a list hits PlanCache on the second plan (the same plan object) and no miss reason reports
    equal shapes as the difference. Before 69dbb47 get compared the list with put's tuple(shape),
    so such an input re-planned on every refit with the miss 'shape [1024, 256], planned
    [1024, 256]'."""
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver

    model = build_tiny_qwen3_moe(seed=0)

    class Handle:
        def __init__(self, t):
            self.t, self.shape, self.dtype = t, list(t.shape), t.dtype

        def load(self):
            return self.t

    handles = {n: Handle(t) for n, t in model.state_dict().items()}
    driver = RefitDriver("block-fp8", hf_config=hf_config(model))
    first = driver.plan(handles)
    again = driver.plan(handles)
    miss = driver.plan_cache.miss
    assert miss is None or "shape [1024, 256], planned [1024, 256]" not in miss, miss
    assert again is first


# ---- 1b. the same over the transport: full mode refuses, delta mode loads reinterpreted bytes ------
class _Fp16Norm:
    """A driver whose stream yields ``model.norm.weight`` as float16 (a buggy serializer plugin:
    same values, same byte count, another dtype than the plan's bfloat16)."""

    NAME = "model.norm.weight"

    def __init__(self, driver):
        self.driver = driver

    def __getattr__(self, name):
        return getattr(self.driver, name)

    def prepare(self, *args, **kwargs):
        prepared = self.driver.prepare(*args, **kwargs)
        real = prepared.execute

        def execute(*a, **k):
            for n, t in real(*a, **k):
                yield n, (t.to(torch.float16) if n == self.NAME else t)

        prepared.execute = execute
        return prepared


@pytest.mark.parametrize("mode", ["atomic", "delta"])
def test_a_tensor_of_another_dtype_is_refused_in_every_mode_before_anything_loads(tiny, mode):
    """Both modes raise TransportError 'the source yielded 'model.norm.weight' torch.float16 [256]
    where the wire manifest has ... bfloat16' and no receiver loads anything (digests unchanged).
    Before 69dbb47 only atomic refused; delta loaded the float16 bit patterns as bfloat16 on both
    receivers without an error."""
    from transport_harness import free_port, sha256, standalone_receivers

    from qstrat.transport import RefitSender
    from qstrat.transport.security.keys import ENV_SECRET

    driver, trainer_a, trainer_b, ckpt = tiny
    secret = "a shared secret for the attack tests"
    with standalone_receivers(ckpt, env={ENV_SECRET: secret}) as rs:
        before = [r.ctl.call("digests") for r in rs]
        s = RefitSender([r.rpc for r in rs], "127.0.0.1", free_port(), timeout_s=20, bucket_bytes=64 << 10,
                        secret=secret, mode=mode, delta_min_bucket_bytes=0)  # delta rounds of many buckets
        s.connect()
        try:
            with pytest.raises(TransportError, match=r"'model.norm.weight'.*where the wire manifest has"):
                s.refit(_Fp16Norm(driver), trainer_b)
            assert [r.ctl.call("digests") for r in rs] == before  # nothing loaded
        finally:
            s.close()


# ---- 3b. PlanCache: an hf_config edit that changes the model family ---------------------------------
def test_an_hf_config_edit_that_changes_the_family_replans_as_a_fresh_driver_does():
    """PlanCache's rule (driver.py): an edited ``hf_config`` re-plans as a fresh driver on it
    would. Editing ``driver.hf_config["model_type"]`` / ``["architectures"]`` in place refuses the
    plan exactly as a fresh driver does ("layout 'llama' cannot place 4 weight matrices ...").
    Before 69dbb47 the re-plan kept the layout chosen at construction (qwen3_moe) and returned a
    plan the fresh driver refuses."""
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver
    from qstrat.errors import PlanError

    model = build_tiny_qwen3_moe(seed=0)
    state = model.state_dict()
    driver = RefitDriver("block-fp8", hf_config=hf_config(model))
    driver.plan(state)
    driver.hf_config["model_type"], driver.hf_config["architectures"] = "llama", ["LlamaForCausalLM"]
    with pytest.raises(PlanError, match=r"layout 'llama' cannot place 4 weight matrices"):
        RefitDriver("block-fp8", hf_config=driver.hf_config).plan(state)
    with pytest.raises(PlanError, match=r"layout 'llama' cannot place 4 weight matrices"):
        driver.plan(state)
