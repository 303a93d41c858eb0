"""qstrat.integrations.trl against a REAL TRL GRPOTrainer with a colocated vLLM CPU engine.

Engine tests: 2 GRPO steps on the tiny Qwen3-MoE, then one more sync (what TRL does before its
next generation); after EVERY sync (initial weights, after step 1, after step 2) the trainer's
engine must give exactly the greedy tokens and logprobs of a fresh engine started on a qstrat
checkpoint of the trainer's weights at that moment (read from the trainer's model, a LoRA model
merged by peft itself). The other tests check the hook checks and refusals without an engine.
"""
from __future__ import annotations

import math

import pytest
import torch

from engine_harness import assert_same
from stale_layer import REASON as _REASON, StaleLayer as _StaleLayer, assert_logged as _assert_logged

HOOK_MODULE = "trl.generation.vllm_generation"


def _vllm_generation():
    import importlib

    return importlib.import_module(HOOK_MODULE)


def _run(strategy, tmp_path, peft=False, verify_every=0):
    """Train, release the trainer's engine, then compare every sync with a fresh engine."""
    from qstrat.cli.demo.tiny_model import hf_config
    from qstrat.vllm.engine.local import release
    from qstrat.integrations.trl import QstratWeightSync
    from qstrat.integrations.trl_demo import fresh_engine_greedy, policy, train

    trainer, probe = train(strategy, 2, tmp_path, peft=peft, verify_every=verify_every)
    sync = probe.sync
    assert isinstance(sync, QstratWeightSync)
    # The engine started on the qstrat checkpoint of the policy, in the strategy's format.
    llm = trainer.vllm_generation.llm
    from qstrat.vllm import engine_quantization_config

    assert engine_quantization_config(llm)["quant_method"] == sync.plan.vllm_quantization_config()["quant_method"]
    assert str(llm.llm_engine.model_config.model) == str(sync.checkpoint)
    history = [h for h in trainer.state.log_history if "loss" in h]
    release(llm)
    del llm
    records = probe.records
    assert [r.step for r in records] == [0, 1, 2]
    cfg = hf_config(policy())
    for i, record in enumerate(records):
        want = fresh_engine_greedy(strategy, cfg, record.weights, tmp_path / f"fresh{i}")
        assert_same(record.engine, want, f"{strategy}: TRL engine after step {record.step} vs fresh engine")
    # Not vacuous: training moved the weights, and the engine's outputs moved with them.
    assert any(not torch.equal(records[0].weights[n], records[2].weights[n]) for n in records[0].weights)
    assert [g.logprobs for g in records[0].engine] != [g.logprobs for g in records[2].engine]
    # Every sync was a qstrat refit of the whole model; steps 1 and 2 logged theirs.
    assert len(sync.reports) == 3 and all(r.tensors == len(sync.plan.outputs()) for r in sync.reports)
    assert len(history) == 2
    for h, report in zip(history, sync.reports):
        assert h["qstrat/refit/bytes"] == report.bytes
        assert h["qstrat/refit/tensors"] == report.tensors
        assert h["qstrat/refit/seconds"] == pytest.approx(report.seconds)
        assert h["qstrat/sync/seconds"] >= report.seconds
        if verify_every:  # the fidelity probe ran on every sync and logged its numbers
            f = report.fidelity
            assert f is not None and f.passed and f.mean_kl <= f.threshold.mean_kl
            assert h["qstrat/fidelity/mean_kl"] == f.mean_kl
            assert h["qstrat/fidelity/max_dlogprob"] == f.max_dlogprob
            assert h["qstrat/fidelity/bf16_kl"] == f.bf16_kl > 0
            assert h["qstrat/fidelity/limit"] == f.threshold.mean_kl and h["qstrat/fidelity/ratio"] == f.ratio <= 1
            assert h["qstrat/fidelity/median_kl"] == f.median_kl and h["qstrat/fidelity/median_ratio"] == f.median_ratio <= 1
            assert h["qstrat/fidelity/ok"] == 1.0 and h["qstrat/fidelity/seconds"] == f.seconds > 0
            # every probe measures its own floor, on its own weights, and derives its limits from it
            from qstrat.vllm.fidelity.limits import derived_limit
            assert f.threshold == derived_limit(f.floor) and f.floor.other == "float32"
        else:
            assert report.fidelity is None and "qstrat/fidelity/mean_kl" not in h
        # TRL's importance-sampling statistics are still computed (quantized engine vs BF16 trainer).
        for key in ("sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/mean"):
            assert math.isfinite(h[key])
    return records


@pytest.mark.engine
@pytest.mark.parametrize("strategy", ["block-fp8", "mxfp8"])
def test_grpo_engine_equals_fresh_engine_after_every_step(strategy, tmp_path, one_engine_thread):
    # MXFP8 also runs the fidelity probe on every sync and logs its numbers with TRL's metrics.
    _run(strategy, tmp_path, verify_every=1 if strategy == "mxfp8" else 0)


@pytest.mark.engine
def test_a_refit_leaving_one_layer_from_the_previous_step_logs_a_failed_verdict_and_training_goes_on(
        tmp_path, monkeypatch, one_engine_thread):
    """on_fidelity_failure='warn': the step whose sync left layer 1 stale logs ok 0 and its ratio
    through TRL's own log history, warns with the error's text, and training goes on."""
    from qstrat.vllm.engine.local import release
    from qstrat.integrations.trl_demo import train
    from qstrat.vllm.fidelity.limits import derived_limit
    from qstrat.vllm.fidelity.verdict import FidelityWarning

    cls = _vllm_generation().VLLMGeneration
    stale = _StaleLayer(cls.__dict__["_iter_named_params"])
    monkeypatch.setattr(cls, "_iter_named_params", stale)
    with pytest.warns(FidelityWarning, match=_REASON) as warned:
        trainer, probe = train("block-fp8", 2, tmp_path, verify_every=1, on_fidelity_failure="warn")
    try:
        sync = probe.sync
        history = [h for h in trainer.state.log_history if "loss" in h]
        assert stale.calls == 4 and len(sync.reports) == 3 and len(history) == 2
        good, bad, after = (r.fidelity for r in sync.reports)
        assert good.passed and not bad.passed and not after.passed
        # every probe's limits come from its own floor (measured on that probe's weights)
        assert bad.ratio > 1 and bad.threshold == derived_limit(bad.floor) and good.threshold == derived_limit(good.floor)
        _assert_logged(history[0], good)
        _assert_logged(history[1], bad)
        assert history[0]["qstrat/fidelity/ok"] == 1.0 and history[1]["qstrat/fidelity/ok"] == 0.0
        fidelity_warnings = [w for w in warned if issubclass(w.category, FidelityWarning)]
        assert len(fidelity_warnings) == 2 and f"mean KL {bad.mean_kl:.3g} (limit {bad.threshold.mean_kl:.3g}, " \
            f"{bad.ratio:.2g}x)" in str(fidelity_warnings[0].message)
        print(f"[trl] stale layer 1: {bad}")
    finally:
        release(trainer.vllm_generation.llm)


@pytest.mark.engine
def test_a_refit_leaving_one_layer_from_the_previous_step_stops_training_by_default(
        tmp_path, monkeypatch, one_engine_thread):
    """The default (on_fidelity_failure='raise'): trainer.train() raises FidelityError at the
    step whose sync left layer 1 stale, after the sync put ok 0 in TRL's metrics store."""
    from qstrat.errors import FidelityError
    from qstrat.vllm.engine.local import release
    from qstrat.integrations.trl_demo import build_trainer

    cls = _vllm_generation().VLLMGeneration
    monkeypatch.setattr(cls, "_iter_named_params", _StaleLayer(cls.__dict__["_iter_named_params"]))
    trainer = build_trainer("block-fp8", 2, tmp_path, verify_every=1)
    try:
        sync = trainer.vllm_generation.sync_weights
        with torch._dynamo.config.patch(disable=True), pytest.raises(FidelityError, match=_REASON) as err:
            trainer.train()
        history = [h for h in trainer.state.log_history if "loss" in h]
        assert len(history) == 1 and history[0]["qstrat/fidelity/ok"] == 1.0  # step 1 logged, step 2 stopped
        good, bad = (r.fidelity for r in sync.reports)
        assert err.value.report is bad and bad.ratio > 1
        _assert_logged(history[0], good)
        logged = trainer._metrics["train"]  # step 2's, appended before the error propagated
        assert logged["qstrat/fidelity/ok"] == [0.0] and logged["qstrat/fidelity/mean_kl"] == [bad.mean_kl]
        assert logged["qstrat/fidelity/ratio"] == [bad.ratio] and logged["qstrat/fidelity/limit"] == [bad.threshold.mean_kl]
    finally:
        release(trainer.vllm_generation.llm)


def test_on_fidelity_failure_is_checked_before_the_trainer_is_built():
    from qstrat.errors import ConfigError
    from qstrat.integrations import trl as qtrl

    before = _vllm_generation().VLLMGeneration.__dict__["_init_vllm"]
    for bad in ("stop", None, True):
        with pytest.raises(ConfigError, match=r"^on_fidelity_failure: what a failed fidelity verdict does, 'raise' "
                                              rf"\(stop the run\) or 'warn' \(log qstrat/fidelity/ok 0 and go on\), got {bad!r:s}$"):
            with qtrl.rollouts("block-fp8", verify_every=1, on_fidelity_failure=bad):
                pass
    assert _vllm_generation().VLLMGeneration.__dict__["_init_vllm"] is before


@pytest.mark.engine
def test_grpo_lora_merged_on_every_sync(tmp_path, one_engine_thread):
    records = _run("block-fp8", tmp_path, peft=True)
    first, last = records[0].weights, records[-1].weights
    changed = sorted(n for n in first if not torch.equal(first[n], last[n]))
    # Only the LoRA targets moved (merged into q_proj/v_proj); everything else is the base model.
    assert changed and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in changed)


# ---- hook checks and refusals (no engine) ----------------------------------------------------

def test_missing_hook_is_one_clear_error(monkeypatch):
    import trl

    from qstrat.integrations import trl as qtrl

    monkeypatch.delattr(_vllm_generation().VLLMGeneration, "_iter_named_params")
    before = _vllm_generation().VLLMGeneration.__dict__["_init_vllm"]
    with pytest.raises(qtrl.TRLHookError) as err:
        with qtrl.rollouts("block-fp8"):
            pass
    assert str(err.value).startswith(f"TRL {trl.__version__}: {HOOK_MODULE}.VLLMGeneration has no method "
                                     "_iter_named_params. qstrat.integrations.trl supports TRL >=1.11.0,<1.17")
    assert _vllm_generation().VLLMGeneration.__dict__["_init_vllm"] is before  # nothing was patched


def test_engine_built_elsewhere_is_refused(monkeypatch):
    import trl

    from qstrat.integrations import trl as qtrl

    monkeypatch.delattr(_vllm_generation(), "LLM")
    with pytest.raises(qtrl.TRLHookError, match=f"TRL {trl.__version__}: {HOOK_MODULE} does not hold vLLM's LLM"):
        qtrl.check_trl()


def test_untested_version_with_hooks_warns(monkeypatch):
    import trl

    from qstrat.integrations import trl as qtrl

    monkeypatch.setattr(trl, "__version__", "1.10.0")
    with pytest.warns(RuntimeWarning, match=r"TRL 1.10.0 is outside the range .*\(>=1.11.0,<1.17\)"):
        assert qtrl.check_trl() == "1.10.0"


def _bare_generation(**attrs):
    gen = _vllm_generation().VLLMGeneration.__new__(_vllm_generation().VLLMGeneration)
    defaults = dict(mode="colocate", model=None, accelerator=None, processing_class=None, enable_sleep_mode=False)
    for k, v in {**defaults, **attrs}.items():
        setattr(gen, k, v)
    return gen


@pytest.mark.parametrize("attrs, message", [
    (dict(mode="other"), "vllm_mode: qstrat.integrations.trl runs TRL's 'colocate' and 'server' modes, got 'other'"),
    (dict(enable_sleep_mode=True), "vllm_enable_sleep_mode: not supported"),
])
def test_refused_engine_modes_and_class_restored(attrs, message):
    from qstrat.errors import ConfigError
    from qstrat.integrations import trl as qtrl

    cls = _vllm_generation().VLLMGeneration
    original = cls.__dict__["_init_vllm"]
    with pytest.raises(ConfigError) as err:
        with qtrl.rollouts("block-fp8"):
            assert cls.__dict__["_init_vllm"] is not original
            cls._init_vllm(_bare_generation(**attrs))
    assert str(err.value).startswith(message)
    assert cls.__dict__["_init_vllm"] is original


def test_generation_without_attribute_is_a_hook_error():
    from qstrat.integrations import trl as qtrl

    gen = _bare_generation()
    del gen.processing_class
    with pytest.raises(qtrl.TRLHookError, match="VLLMGeneration has no attribute processing_class when it builds"):
        with qtrl.rollouts("block-fp8"):
            _vllm_generation().VLLMGeneration._init_vllm(gen)


def test_bad_arguments_fail_before_anything_is_patched():
    from qstrat.errors import ConfigError
    from qstrat.integrations import trl as qtrl

    cls = _vllm_generation().VLLMGeneration
    original = cls.__dict__["_init_vllm"]
    with pytest.raises(ConfigError, match="no-such-preset"):
        with qtrl.rollouts("no-such-preset"):
            pass
    with pytest.raises(ConfigError, match=r"^engine_kwargs.model: the engine starts on the qstrat checkpoint"):
        with qtrl.rollouts("block-fp8", engine_kwargs={"model": "x"}):
            pass
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match=r"^verify_every: a sync count >= 0 \(0: never probe\), got"):
            with qtrl.rollouts("block-fp8", verify_every=bad):
                pass
    assert cls.__dict__["_init_vllm"] is original


@pytest.mark.parametrize("kwargs, message", [
    ({"engine_kwargs": "abc"}, r"engine_kwargs: a mapping of vllm.LLM arguments \(e.g. \{'max_model_len': 2048\}\), "
                               r"got str 'abc'$"),
    ({"engine_kwargs": {1: 2}}, r"engine_kwargs: argument names are strings, got 1$"),
    ({"engine_kwargs": {"quantization": "fp8"}}, r"engine_kwargs\.quantization: the engine's quantization is the "
                                                 r"strategy's, read from the qstrat checkpoint's quantization_config"),
    ({"engine_kwargs": {"quantization_config": {}}}, r"engine_kwargs\.quantization_config: the engine's quantization"),
    ({"engine_kwargs": {"hf_overrides": {"num_hidden_layers": 1}}},
     r"engine_kwargs\.hf_overrides: it rewrites the model config the checkpoint and every sync's plan are made "
     r"from \(its layers, its quantization_config\)"),
    ({"checkpoint_dir": 5}, r"checkpoint_dir: a directory path \(str or pathlib\.Path\) or None, got int 5$"),
])
def test_wrong_arguments_are_refused_at_make_trainer_naming_the_key(kwargs, message):
    """Before: a raw TypeError/AttributeError, or (engine_kwargs changing the quantization or
    the model) an engine that took no sync correctly. Nothing of the trainer is built."""
    from qstrat.errors import ConfigError
    from qstrat.integrations import trl as qtrl

    built = []
    with pytest.raises(ConfigError, match="^" + message):
        qtrl.make_trainer(lambda **kw: built.append(kw), "block-fp8", **kwargs)
    assert built == []
    assert qtrl.check_engine_kwargs({"max_model_len": 64}) == {"max_model_len": 64}


def test_trainer_without_vllm_is_refused(tmp_path):
    from datasets import Dataset
    from trl import GRPOTrainer

    from qstrat.errors import ConfigError
    from qstrat.integrations import trl as qtrl
    from qstrat.integrations.trl_demo import grpo_args, policy, tiny_tokenizer, word_reward

    with pytest.raises(ConfigError, match=r"^use_vllm: the trainer has no vLLM engine built under"):
        qtrl.make_trainer(GRPOTrainer, "block-fp8", model=policy(), processing_class=tiny_tokenizer(),
                          reward_funcs=word_reward, train_dataset=Dataset.from_dict({"prompt": ["w5 w6"]}),
                          args=grpo_args(tmp_path, 1, use_vllm=False))


def test_fidelity_probe_with_a_peft_model_is_refused_before_the_engine_starts(tmp_path):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOTrainer

    from qstrat.errors import ConfigError
    from qstrat.integrations import trl as qtrl
    from qstrat.integrations.trl_demo import grpo_args, policy, tiny_tokenizer, word_reward

    cls = _vllm_generation().VLLMGeneration
    original = cls.__dict__["_init_vllm"]
    with pytest.raises(ConfigError, match=r"^verify_every: the fidelity probe runs the trainer's model on the "
                                          r"refit's own tensor names; a PEFT model's names differ"):
        qtrl.make_trainer(GRPOTrainer, "block-fp8", model=policy(), processing_class=tiny_tokenizer(),
                          reward_funcs=word_reward, train_dataset=Dataset.from_dict({"prompt": ["w5 w6"]}),
                          args=grpo_args(tmp_path, 1), verify_every=1,
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    assert cls.__dict__["_init_vllm"] is original
    assert not list(tmp_path.glob("**/*.safetensors"))  # no checkpoint was written


@pytest.mark.parametrize("trainer_cls", [None, "GRPOTrainer", 5])
def test_a_trainer_class_that_is_not_callable_is_refused_before_anything_starts(trainer_cls, monkeypatch):
    """The old code entered rollouts() (checkpoint, engine) and then raised a bare TypeError
    ("'NoneType' object is not callable")."""
    from qstrat.integrations import trl as qtrl

    monkeypatch.setattr(qtrl, "rollouts", lambda *a, **k: pytest.fail("rollouts() must not start"))
    with pytest.raises(TypeError, match=r"^make_trainer: trainer_cls must be a TRL trainer class \(e\.g\. "
                                        r"trl\.GRPOTrainer\), got "):
        qtrl.make_trainer(trainer_cls, "block-fp8")


def test_a_quantize_in_engine_strategy_is_refused_when_the_colocated_trainer_is_built(tmp_path, monkeypatch):
    """Before: the colocated engine started on the strategy's BF16 checkpoint without online
    quantization, and the first sync raised a PlanError whose fix (quantization='online')
    engine_kwargs forbids. Now a real GRPOTrainer (vllm_mode='colocate') is refused while it is
    built, before a checkpoint is written or an engine started, naming the setting and the fix."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from qstrat.errors import ConfigError
    from qstrat.integrations import trl as qtrl
    from qstrat.integrations.trl_demo import grpo_args, policy, tiny_tokenizer, word_reward

    cls = _vllm_generation().VLLMGeneration
    original = cls.__dict__["_init_vllm"]
    monkeypatch.setattr(_vllm_generation(), "LLM", lambda **kw: pytest.fail("no engine may start"), raising=False)
    strategy = {"preset": "block-fp8", "quantize_in": "engine"}
    with pytest.raises(ConfigError, match=r"^quantize_in: engine - TRL's colocated engine starts on qstrat's "
                                          r"checkpoint .*needs quantization='online', which engine_kwargs cannot "
                                          r"set\. Use quantize_in: trainer with vllm_mode='colocate', or "
                                          r"vllm_mode='server' .*nothing was written, no engine started$"):
        qtrl.make_trainer(GRPOTrainer, strategy, model=policy(), processing_class=tiny_tokenizer(),
                          reward_funcs=word_reward, train_dataset=Dataset.from_dict({"prompt": ["w5 w6"]}),
                          args=grpo_args(tmp_path, 1), checkpoint_dir=tmp_path / "ckpt")
    assert cls.__dict__["_init_vllm"] is original
    assert not list(tmp_path.glob("**/*.safetensors"))
