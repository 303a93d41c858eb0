"""qstrat.vllm.refit against a recording stand-in for vllm.LLM: validation happens before any
RPC, and what reaches ``reload_weights`` is exactly driver.run's stream. (The real engine is
exercised in test_engine_refit.py.)"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import qstrat
import qstrat.vllm.checks.live_manifest
import qstrat.vllm.sink.in_process
import qstrat.vllm.sink.spool
from qstrat import NonFiniteError, PlanError, RefitDriver
from qstrat.vllm.sink.engine_flag import engine_flag


class RecordingLLM:
    """Has what refit touches: llm_engine.model_config (hf_config of the tiny model, dtype) and
    collective_rpc. vLLM's record of the model is not there: the manifest is built without the
    cross-check (test_engine_manifest.py runs it on a live engine)."""

    def __init__(self, quantization_config):
        from qstrat.cli.demo.tiny_model import TINY_QWEN3_MOE

        cfg = {**TINY_QWEN3_MOE, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}
        qc = {"quantization_config": quantization_config} if quantization_config is not None else {}
        hf = SimpleNamespace(quantization_config=quantization_config, to_dict=lambda: {**cfg, **qc})  # as HF's
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, dtype=torch.bfloat16))
        self.calls = []

    def collective_rpc(self, method, kwargs):
        self.calls.append((method, [(n, t.clone()) for n, t in kwargs["weights_iterator"]],
                           kwargs["is_checkpoint_format"]))


@pytest.fixture(autouse=True)
def manifest_without_cross_check(monkeypatch):
    real = qstrat.vllm.engine_manifest
    monkeypatch.setattr(qstrat.vllm.checks.live_manifest, "engine_manifest", lambda llm, driver: real(llm, driver, cross_check=False))
    monkeypatch.setattr(qstrat.vllm.checks.live_manifest, "device_type", lambda: "cpu")  # the stand-in is a CPU engine


@pytest.fixture()
def driver(tiny_hf_config):
    return RefitDriver("block-fp8", hf_config=tiny_hf_config)


@pytest.mark.parametrize("stream", [False, True])
def test_refit_sends_exactly_the_run_stream(tiny_model, driver, stream):
    state = tiny_model.state_dict()
    llm = RecordingLLM(driver.plan(state).vllm_quantization_config())
    report = qstrat.vllm.refit(llm, driver, state, stream=stream)
    (method, sent, ckpt_format), = llm.calls
    assert method == "reload_weights" and ckpt_format is True
    expected = list(driver.run(state))
    assert [n for n, _ in sent] == [n for n, _ in expected]
    assert all(torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.contiguous().view(torch.uint8) if b.element_size() == 1 else b)
               for (_, a), (_, b) in zip(sent, expected))
    assert report.tensors == len(expected)
    assert report.bytes == sum(t.numel() * t.element_size() for _, t in expected)


def test_nan_is_found_before_anything_is_sent(tiny_model, driver):
    state = dict(tiny_model.state_dict())
    bad = state["model.layers.3.self_attn.o_proj.weight"].clone()
    bad[5, 9] = float("inf")
    state["model.layers.3.self_attn.o_proj.weight"] = bad
    llm = RecordingLLM(driver.plan(state).vllm_quantization_config())
    with pytest.raises(NonFiniteError, match=r"layers\.3\.self_attn\.o_proj\.weight: non-finite value inf at index \[5, 9\] \(row, col\);"):
        qstrat.vllm.refit(llm, driver, state, stream=True)
    assert llm.calls == []


def test_engine_format_mismatch_is_refused(tiny_model, tiny_hf_config, driver):
    state = tiny_model.state_dict()
    fp8_config = driver.plan(state).vllm_quantization_config()
    mx = RefitDriver("mxfp8", hf_config=tiny_hf_config)
    llm = RecordingLLM(fp8_config)
    with pytest.raises(PlanError, match="quantization_config.quant_method: engine has 'fp8'"):
        qstrat.vllm.refit(llm, mx, state)
    with pytest.raises(PlanError, match="does not match"):
        qstrat.vllm.refit(RecordingLLM(None), driver, state)
    other_block = dict(fp8_config, weight_block_size=[64, 64])
    with pytest.raises(PlanError, match="weight_block_size"):
        qstrat.vllm.refit(RecordingLLM(other_block), driver, state)
    assert llm.calls == []


def test_bf16_into_modules_the_engine_serves_quantized_is_refused(tiny_model, tiny_hf_config, driver):
    state = tiny_model.state_dict()
    engine = RecordingLLM(driver.plan(state).vllm_quantization_config())  # every decoder linear in FP8
    kept = RefitDriver({"preset": "block-fp8", "keep_bf16": {"first": 1}}, hf_config=tiny_hf_config)
    with pytest.raises(PlanError, match=r"dtype bfloat16, the engine expects float8_e4m3fn "
                                        r"\(model\.layers\.0\.mlp\.experts is served quantized"):
        qstrat.vllm.refit(engine, kept, state)
    experts_only = RefitDriver({"rules": [{"select": "experts", "serializer": "block_fp8"}]},
                               hf_config=tiny_hf_config)
    with pytest.raises(PlanError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight: dtype bfloat16, the "
                                        r"engine expects float8_e4m3fn"):
        qstrat.vllm.refit(engine, experts_only, state)
    assert engine.calls == []
    # The matching engine (started on a keep_bf16.first checkpoint) accepts it; on a CPU engine
    # only with the explicit opt-in for unquantized experts (layer 0's), and with a warning.
    ok = RecordingLLM(kept.plan(state).vllm_quantization_config())
    with pytest.warns(RuntimeWarning, match=r"unquantized MoE experts \(model\.layers\.0\.mlp\.experts\)"):
        qstrat.vllm.refit(ok, kept, state, allow_cpu_bf16_experts=True)
    assert len(ok.calls) == 1


def test_wildcard_ignore_lists_are_understood(tiny_model, tiny_hf_config):
    state = tiny_model.state_dict()
    mx = RefitDriver("mxfp8-experts", hf_config=tiny_hf_config)
    cfg = dict(mx.plan(state).vllm_quantization_config(), ignore=["*self_attn*", "*mlp.gate", "lm_head"])
    qstrat.vllm.refit(RecordingLLM(cfg), mx, state)
    cfg["ignore"] = ["*self_attn*", "lm_head"]  # routers missing: the engine would quantize them
    with pytest.raises(PlanError, match=r"model\.layers\.0\.mlp\.gate"):
        qstrat.vllm.refit(RecordingLLM(cfg), mx, state)


def test_refit_reads_each_weight_once_for_nan(tiny_model, driver, monkeypatch):
    import qstrat.serializers.format_math as base  # where quantize reads values

    calls = []
    real = base.check_finite
    monkeypatch.setattr(base, "check_finite", lambda w3, name, chunk: (calls.append(name), real(w3, name, chunk))[1])
    state = tiny_model.state_dict()
    qstrat.vllm.refit(RecordingLLM(driver.plan(state).vllm_quantization_config()), driver, state)
    quantized = [e.name for e in driver.plan(state).entries if e.serializer != "passthrough"]
    assert sorted(n for n in calls if n in quantized) == sorted(quantized)  # once each, up front


class FileReadingLLM(RecordingLLM):
    """Reads the folder ``reload_weights(weights_path=...)`` names, as the engine's loader would."""

    def collective_rpc(self, method, kwargs):
        from safetensors.torch import load_file

        folder = kwargs["weights_path"]
        files = sorted(p.name for p in Path(folder).iterdir())
        self.calls.append((method, folder, files, load_file(f"{folder}/model.safetensors"),
                           kwargs["is_checkpoint_format"], "weights_iterator" in kwargs))


@pytest.mark.filterwarnings("ignore:qstrat.vllm.refit. this refit wrote:RuntimeWarning")  # asserted below
def test_refit_through_a_file_sends_the_same_payload_and_cleans_up(tiny_model, driver, tmp_path):
    """``weights_dir`` (multiprocess engines): one safetensors file in a fresh folder under it,
    exactly driver.run's tensors, the folder gone afterwards; ``stream`` with it is refused."""
    state = tiny_model.state_dict()
    llm = FileReadingLLM(driver.plan(state).vllm_quantization_config())
    report = qstrat.vllm.refit(llm, driver, state, weights_dir=tmp_path)
    (method, folder, files, sent, ckpt_format, has_iterator), = llm.calls
    assert method == "reload_weights" and ckpt_format is True and not has_iterator
    assert Path(folder).parent == tmp_path and files == ["model.safetensors"]
    assert not Path(folder).exists() and list(tmp_path.iterdir()) == []
    expected = dict(driver.run(state))
    assert sent.keys() == expected.keys() and report.tensors == len(expected)
    assert all(torch.equal(sent[n].view(torch.uint8), t.contiguous().view(torch.uint8))
               for n, t in expected.items())
    with pytest.raises(ValueError, match="stream=True.*weights_dir"):
        qstrat.vllm.refit(llm, driver, state, stream=True, weights_dir=tmp_path)
    assert len(llm.calls) == 1


class FailingLLM(RecordingLLM):
    """Consumes the weights like vLLM does, then fails after ``after`` tensors (an engine-side
    fault or out of memory mid-reload), once; counts the finalize calls that follow a failure."""

    def __init__(self, quantization_config, after):
        super().__init__(quantization_config)
        self.after, self.finalized = after, 0

    def collective_rpc(self, method, kwargs=None):
        if callable(method):  # qstrat's finalize of a failed reload, run in every worker
            self.finalized += 1
            return
        if self.after is None:
            return super().collective_rpc(method, kwargs)
        for i, _ in enumerate(kwargs["weights_iterator"]):
            if i == self.after:
                self.after = None
                raise RuntimeError("CUDA out of memory (simulated)")


@pytest.mark.parametrize("stream", [False, True])
def test_a_fault_after_the_reload_began_flags_the_engine_until_a_whole_refit(tiny_model, driver, stream):
    """The same rule as the transport's receivers (tests/test_transport_faults.py, a load raising
    inside finish): the failed reload is finalized and the engine flagged; a partial refit is
    then refused before anything is sent; a whole refit loads and clears the flag."""
    from qstrat.errors import EngineStateError

    state = tiny_model.state_dict()
    llm = FailingLLM(driver.plan(state).vllm_quantization_config(), after=100)
    with pytest.raises(EngineStateError, match=r"the refit failed after the engine began reloading "
                                               r"\(\d+ of 247 tensors handed over\): RuntimeError: CUDA out "
                                               r"of memory \(simulated\).*holds a MIX of two rounds and accepts "
                                               r"only a whole refit now"):
        qstrat.vllm.refit(llm, driver, state, stream=stream)
    assert llm.finalized == 1 and engine_flag(llm).reason == "RuntimeError: CUDA out of memory (simulated)"
    plan = driver.plan(state)
    with pytest.raises(EngineStateError, match=r"^this engine holds a MIX of two rounds \(RuntimeError: CUDA out of "
                                               r"memory \(simulated\)\): the next refit must be whole, this "
                                               r"one sends 1 of the 7 parts \(nothing was sent\)$"):
        qstrat.vllm.refit(llm, driver, state, plan=plan.only_layers([0]))
    assert llm.calls == []
    qstrat.vllm.refit(llm, driver, state)  # whole: loads, clears the flag
    assert len(llm.calls) == 1 and engine_flag(llm).reason is None
    qstrat.vllm.refit(llm, driver, state, plan=plan.only_layers([0]))  # partial refits again
    assert len(llm.calls) == 2


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("after", [0, 59, 246])
def test_a_failed_reload_reports_how_many_tensors_vllm_really_drew(tiny_model, driver, stream, after):
    """The count is what vLLM's reload drew before it failed (``after`` + 1: the tensor it failed
    on was handed over); the whole list was reported ("247 of 247") when the payload was built
    first (stream=False)."""
    from qstrat.errors import EngineStateError

    llm = FailingLLM(driver.plan(tiny_model.state_dict()).vllm_quantization_config(), after=after)
    with pytest.raises(EngineStateError, match=rf"began reloading \({after + 1} of 247 tensors handed over\): "):
        qstrat.vllm.refit(llm, driver, tiny_model.state_dict(), stream=stream)


def test_a_quantizer_fault_mid_stream_is_an_engine_state_error(tiny_model, driver, monkeypatch):
    """With stream=True quantization runs inside the engine's reload: a fault there (here a
    serializer raising on layer 2) leaves the engine half-reloaded."""
    from qstrat.errors import EngineStateError
    from qstrat.serializers.block_fp8 import BlockFP8

    real = BlockFP8.quantize

    def faulty(self, w, *, name="weight", **kw):
        if ".layers.2." in name:
            raise MemoryError("simulated allocation failure")
        return real(self, w, name=name, **kw)

    state = tiny_model.state_dict()
    llm = FailingLLM(driver.plan(state).vllm_quantization_config(), after=10**9)
    monkeypatch.setattr(BlockFP8, "quantize", faulty)
    with pytest.raises(EngineStateError, match="MemoryError: simulated allocation failure"):
        qstrat.vllm.refit(llm, driver, state, stream=True)
    # Without streaming the same fault happens before the engine is called: nothing was sent.
    llm = FailingLLM(driver.plan(state).vllm_quantization_config(), after=0)
    with pytest.raises(MemoryError):
        qstrat.vllm.refit(llm, driver, state)
    assert engine_flag(llm).reason is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_backend_that_cannot_run_here_is_refused_before_anything_is_sent(tiny_model, tiny_hf_config,
                                                                         monkeypatch, stream):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    state = tiny_model.state_dict()
    cfg = {"preset": "block-fp8", "rules": [{"select": "attention", "serializer": "block_fp8",
                                              "options": {"backend": "triton"}}]}
    drv = RefitDriver(cfg, hf_config=tiny_hf_config)
    llm = RecordingLLM(drv.plan(state).vllm_quantization_config())
    from qstrat.errors import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight \(rules\[0\]\): "
                                                      r"block_fp8: backend='triton' needs CUDA tensors"):
        qstrat.vllm.refit(llm, drv, state, stream=stream)
    assert llm.calls == []


Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("bad", ["short q_proj", "int32 lm_head", "int32 slab", "missing slab", "3-D q_proj"])
def test_tensors_not_matching_a_given_plan_are_refused_before_anything_is_sent(tiny_model, driver, bad, stream):
    """refit(plan=...) with a mapping: every planned input must be there with its planned shape
    and dtype (found by an adversarial run: a short q_proj broke a live engine, an int32 lm_head
    silently zeroed it)."""
    state = dict(tiny_model.state_dict())
    plan = driver.plan(state)
    slab = "model.layers.1.mlp.experts.gate_up_proj"
    if bad == "short q_proj":
        state[Q] = state[Q][:, :-1]
        want = r"q_proj\.weight: arrived as bfloat16\[256, 255\], planned as bfloat16\[256, 256\]"
    elif bad == "int32 lm_head":
        state["lm_head.weight"] = state["lm_head.weight"].to(torch.int32)
        want = r"lm_head\.weight: arrived as int32\["
    elif bad == "int32 slab":
        state[slab] = state[slab].to(torch.int32)
        want = r"experts\.gate_up_proj: arrived as int32\["
    elif bad == "missing slab":
        del state[slab]
        want = r"experts\.gate_up_proj: planned, but not among the given tensors"
    else:
        state[Q] = state[Q][None]
        want = r"q_proj\.weight: arrived as bfloat16\[1, 256, 256\]"
    llm = RecordingLLM(plan.vllm_quantization_config())
    with pytest.raises(PlanError, match=r"the given tensors do not match the given plan:(.|\n)*" + want):
        qstrat.vllm.refit(llm, driver, state, plan=plan, stream=stream)
    assert llm.calls == []


def test_run_and_write_checkpoint_check_a_mapping_against_a_given_plan(tiny_model, driver, tmp_path):
    from qstrat.execute.checkpoint import write_checkpoint

    state = dict(tiny_model.state_dict())
    plan = driver.plan(state)
    state[Q] = state[Q].to(torch.int8)
    with pytest.raises(PlanError, match=r"q_proj\.weight: arrived as int8\[256, 256\]"):
        next(driver.run(state, plan=plan))
    with pytest.raises(PlanError, match=r"q_proj\.weight: arrived as int8\[256, 256\]"):
        write_checkpoint(driver, state, tmp_path / "out", plan=plan)
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_a_report_prints_as_one_line_of_totals(tiny_model, driver):
    """print(report) gives the counts, bytes, time and the plan's totals per format, not the
    whole plan (it was ~57,000 characters for the tiny model)."""
    import dataclasses

    state = tiny_model.state_dict()
    report = qstrat.vllm.refit(RecordingLLM(driver.plan(state).vllm_quantization_config()), driver, state)
    line = ("RefitReport(tensors=247, bytes=5003712 (4.77 MiB), seconds=1.500, plan: layout qwen3_moe, "
            "4 decoder layers, 47 inputs -> 247 tensors (passthrough 23 -> 23, block_fp8 24 -> 224))")
    fixed = dataclasses.replace(report, seconds=1.5)  # the one figure that varies
    assert repr(fixed) == str(fixed) == line
    assert report.tensors == 247 and report.bytes == 5003712 and report.seconds > 0


class MultiprocessLLM(RecordingLLM):
    """A multiprocess engine (vLLM's default): like vLLM 0.32's engine core, its RPC cannot
    pickle tensors for the worker process; it can reload from a folder."""

    def collective_rpc(self, method, kwargs):
        if "weights_iterator" in kwargs:
            raise TypeError("cannot pickle memoryview objects")
        from safetensors.torch import load_file

        (f,) = Path(kwargs["weights_path"]).iterdir()
        self.calls.append((method, kwargs["weights_path"], sorted(load_file(f))))


@pytest.mark.filterwarnings("ignore:qstrat.vllm.refit. this refit wrote:RuntimeWarning")  # asserted below
def test_multiprocess_engine_without_weights_dir_gets_a_temporary_folder(tiny_model, driver, monkeypatch):
    """Before: vLLM's "cannot pickle memoryview objects" became an EngineStateError and every later
    refit of the engine was refused. Now qstrat takes a temporary folder itself (removed after);
    stream=True is refused before anything is sent, and the engine keeps refitting."""
    import tempfile

    monkeypatch.setattr(qstrat.vllm.sink.in_process, "in_process", lambda llm: False)  # the live case: test_engine_multiprocess.py
    state = tiny_model.state_dict()
    llm = MultiprocessLLM(driver.plan(state).vllm_quantization_config())
    with pytest.raises(ValueError, match=r"^refit: stream=True needs an in-process engine .*drop stream=True"):
        qstrat.vllm.refit(llm, driver, state, stream=True)
    assert llm.calls == []
    for _ in range(2):
        qstrat.vllm.refit(llm, driver, state)
    assert [c[0] for c in llm.calls] == ["reload_weights"] * 2
    for _, folder, names in llm.calls:
        assert Path(folder).parent == Path(tempfile.gettempdir()) and not Path(folder).exists()
        assert names == sorted(n for n, _ in driver.run(state))


def test_refit_through_a_file_warns_once_with_its_cost_and_the_path_that_scales(tiny_model, driver, monkeypatch):
    """A multiprocess engine is refit through a temporary checkpoint: the first such refit in a
    process warns with the bytes written, the folder and its free space, and names the transport;
    the second refit is silent."""
    import shutil
    import tempfile
    import warnings

    monkeypatch.setattr(qstrat.vllm.sink.in_process, "in_process", lambda llm: False)
    monkeypatch.setattr(qstrat.vllm.sink.spool, "_WARNED", False)
    state = tiny_model.state_dict()
    llm = MultiprocessLLM(driver.plan(state).vllm_quantization_config())
    folder = Path(tempfile.gettempdir())
    with pytest.warns(RuntimeWarning) as caught:
        report = qstrat.vllm.refit(llm, driver, state)
    (w,) = [w for w in caught if "temporary checkpoint" in str(w.message)]
    msg = str(w.message)
    nbytes = sum(t.numel() * t.element_size() for _, t in driver.run(state))
    assert report.bytes == nbytes
    assert msg.startswith(f"qstrat.vllm.refit: this refit wrote the whole quantized payload, {nbytes:,} bytes, "
                          f"to a temporary checkpoint under {folder} ("), msg
    free = int(msg.split(f"under {folder} (")[1].split(" bytes free there")[0].replace(",", ""))
    assert 0 < free <= shutil.disk_usage(folder).total
    assert "limited by this host's free memory and that folder's free space" in msg
    assert "The path that scales is the transport: qstrat.transport.RefitSender" in msg and "docs/transport.md" in msg
    assert w.filename == __file__, "the warning points at the caller of refit"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qstrat.vllm.refit(llm, driver, state)
    assert len(llm.calls) == 2


class FailingFileLLM(MultiprocessLLM):
    """A multiprocess engine whose reload from a file fails (vLLM reads the file itself)."""

    def collective_rpc(self, method, kwargs=None):
        if callable(method):
            return
        raise RuntimeError("disk read error (simulated)")


def test_a_failed_reload_from_a_file_does_not_claim_a_count(tiny_model, driver, tmp_path):
    from qstrat.errors import EngineStateError

    llm = FailingFileLLM(driver.plan(tiny_model.state_dict()).vllm_quantization_config())
    with pytest.raises(EngineStateError, match=r"began reloading \(all 247 tensors written to a file for the engine "
                                               r"to read; how many it loaded before failing is not known\): "
                                               r"RuntimeError: disk read error"):
        qstrat.vllm.refit(llm, driver, tiny_model.state_dict(), weights_dir=tmp_path)


class FP8KVMultiprocessLLM(MultiprocessLLM):
    """A multiprocess engine with an FP8 KV cache: each RPC is first encoded as vLLM 0.32's engine
    core client encodes it (``vllm.v1.serial_utils.MsgpackEncoder``, which refuses a Python
    function: "Object of type <class 'function'> is not serializable"), then run BY NAME on a
    worker built from ``worker_extension_cls`` (vLLM mixes the extension into its worker), whose
    model has two attention layers holding FP8 KV-cache scales under vLLM's attribute names."""

    def __init__(self, quantization_config, extension):
        from vllm.v1.serial_utils import MsgpackEncoder

        from qstrat.vllm.adapter.resolver import resolve

        super().__init__(quantization_config)
        self.encoder = MsgpackEncoder()
        self.llm_engine.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="fp8"),
                                                      parallel_config=SimpleNamespace(worker_extension_cls=extension))
        model = torch.nn.Module()
        for i, (k, v) in enumerate(((0.05, 0.07), (0.06, 0.08))):
            attn = torch.nn.Module()
            setattr(attn, resolve("attention_kv_cache_dtype"), "fp8")
            for key, x in (("k", k), ("v", v)):
                setattr(attn, resolve(f"attention_{key}_scale"), torch.tensor([x]))
                setattr(attn, resolve(f"attention_{key}_scale_float"), float(torch.tensor(x)))
            model.add_module(f"attn{i}", attn)
        import importlib

        module, _, name = extension.rpartition(".")
        worker_cls = type("Worker", (getattr(importlib.import_module(module), name),) if extension else (), {})
        self.worker = worker_cls()
        self.worker.get_model = lambda: model  # vLLM's Worker.get_model (qstrat's WorkerView.model)

    def collective_rpc(self, method, kwargs=None):
        self.encoder.encode((0, 1, "collective_rpc", (method, None, (), kwargs)))
        if method == "reload_weights":
            return super().collective_rpc(method, kwargs)
        return [getattr(self.worker, method)()]


@pytest.mark.filterwarnings("ignore:qstrat.vllm.refit. this refit wrote:RuntimeWarning")
def test_a_multiprocess_fp8_kv_engine_is_refit_through_the_reader_or_refused_naming_it(tiny_model, driver,
                                                                                      monkeypatch):
    """Every refit of a multiprocess engine with an FP8 KV cache failed in vLLM's RPC encoder
    ("Object of type <class 'function'> is not serializable": the scale check sent a function).
    With qstrat's reader extension the scales are read by name and the refit loads; without it
    the refit is refused before anything is sent, naming the fix. (Live: test_engine_kv_multiprocess.py.)"""
    import qstrat.vllm.sink.kv_scales

    for module in (qstrat.vllm.sink.in_process, qstrat.vllm.sink.kv_scales):
        monkeypatch.setattr(module, "in_process", lambda llm: False, raising=False)
    state = tiny_model.state_dict()
    qc = driver.plan(state).vllm_quantization_config()
    plain = FP8KVMultiprocessLLM(qc, "")
    with pytest.raises(qstrat.ConfigError, match=r"^kv_cache_dtype: this multiprocess engine caches keys and values "
                                                 r"in fp8, .*its worker_extension_cls \(none\) has no "
                                                 r"qstrat_kv_scales\. Start the engine with worker_extension_cls="
                                                 r"'qstrat\.vllm\.sink\.kv_scales\.KVScaleReader' .*nothing was sent$"):
        qstrat.vllm.refit(plain, driver, state)
    assert plain.calls == []
    llm = FP8KVMultiprocessLLM(qc, "qstrat.vllm.sink.kv_scales.KVScaleReader")
    qstrat.vllm.refit(llm, driver, state)
    assert [c[0] for c in llm.calls] == ["reload_weights"]
    f32 = {x: float(torch.tensor(x)) for x in (0.05, 0.06, 0.07, 0.08)}
    assert qstrat.vllm.sink.kv_scales.engine_kv_scales(llm) == {
        f"attn{i}": {"k_scale": f32[k], "k_scale_float": f32[k], "v_scale": f32[v], "v_scale_float": f32[v]}
        for i, (k, v) in enumerate(((0.05, 0.07), (0.06, 0.08)))}


class FailingFP8KVMultiprocessLLM(FP8KVMultiprocessLLM):
    """A multiprocess engine whose worker fails mid-reload; every RPC is encoded as vLLM's
    engine core encodes it (a Python function is refused), and the worker extension's
    ``qstrat_finalize_reload`` is counted (the stand-in model has no layerwise reload)."""

    def __init__(self, quantization_config, extension):
        super().__init__(quantization_config, extension)
        self.finalized = 0
        if hasattr(self.worker, "qstrat_finalize_reload"):
            self.worker.qstrat_finalize_reload = lambda: setattr(self, "finalized", self.finalized + 1)

    def collective_rpc(self, method, kwargs=None):
        if method == "reload_weights":
            self.encoder.encode((0, 1, "collective_rpc", (method, None, (), kwargs)))
            raise RuntimeError("worker fault mid-reload (simulated)")
        return super().collective_rpc(method, kwargs)


@pytest.mark.filterwarnings("ignore:qstrat.vllm.refit. this refit wrote:RuntimeWarning")
def test_a_failed_reload_of_a_multiprocess_engine_is_finalized_through_the_worker_extension(
        tiny_model, driver, monkeypatch):
    """Before: the finalize of a failed reload sent a Python function over collective_rpc, which
    a multiprocess engine refuses ("Object of type <class 'function'> is not serializable"): the
    reload stayed unfinalized and the flag's reason said so. Now it runs by name through qstrat's
    worker extension; an engine without it gets the flag and a reason naming the fix."""
    import qstrat.vllm.sink.kv_scales
    from qstrat.errors import EngineStateError
    from qstrat.vllm.sink.engine_flag import engine_flag
    from qstrat.vllm.sink.reload import finalize_engine_reload

    for module in (qstrat.vllm.sink.in_process, qstrat.vllm.sink.kv_scales):
        monkeypatch.setattr(module, "in_process", lambda llm: False, raising=False)
    monkeypatch.setattr("qstrat.vllm.adapter.platform_facts.in_process", lambda llm: False)
    state = tiny_model.state_dict()
    llm = FailingFP8KVMultiprocessLLM(driver.plan(state).vllm_quantization_config(), qstrat.vllm.sink.kv_scales.READER)
    with pytest.raises(EngineStateError, match="worker fault mid-reload"):
        qstrat.vllm.refit(llm, driver, state)
    assert llm.finalized == 1
    assert engine_flag(llm).reason == "RuntimeError: worker fault mid-reload (simulated)"
    plain = MultiprocessLLM(None)
    plain.llm_engine.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(worker_extension_cls=""))
    with pytest.raises(qstrat.ConfigError, match=r"^this multiprocess engine's worker_extension_cls \(none\) has "
                                                 r"no qstrat_finalize_reload.*worker_extension_cls="
                                                 r"'qstrat\.vllm\.sink\.kv_scales\.KVScaleReader'$"):
        finalize_engine_reload(plain)
