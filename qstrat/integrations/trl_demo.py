"""``python -m qstrat.integrations.trl_demo``: GRPO with qstrat rollouts on a CPU, checked step by step.

Builds the seeded tiny Qwen3-MoE (:mod:`qstrat.cli.demo.tiny_model`) with a word-level tokenizer made
here (``w3`` ... ``w1023``: one token per word, no download), runs TRL's ``GRPOTrainer``
(colocated vLLM engine) through :func:`qstrat.integrations.trl.make_trainer`, and after every
sync records the trainer's weights and the engine's greedy tokens and logprobs
(:class:`ParityProbe`). After training it starts a FRESH engine on a qstrat checkpoint of each
recorded weight set and compares: the refit engine must equal it exactly. Used by the demo's
command and by tests/test_integration_trl.py.
"""
from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

#: Prompts of the training set (words of the tiny tokenizer).
TRAIN_PROMPTS = ("w5 w6 w7 w8", "w100 w200 w300", "w7 w7 w900", "w12 w55 w9")
#: Greedy tokens per probe prompt.
PROBE_TOKENS = 4


def probe_greedy(llm: Any) -> list[Any]:
    """Greedy tokens and logprobs of :data:`qstrat.vllm.engine.local.PROMPTS`, one prompt per
    ``generate`` call: TRL's engine (``max_num_seqs`` = the batch size) and a fresh engine would
    otherwise schedule the prompts in different batches, and CPU matmuls need not be
    batch-invariant (seen with the three prompts in one call: MXFP8, after a GRPO step, tokens
    equal, logprobs 2.3e-4 apart; one prompt per call: exact)."""
    from qstrat.vllm.engine.local import PROMPTS, greedy

    return [g for prompt in PROMPTS for g in greedy(llm, (prompt,), max_tokens=PROBE_TOKENS)]


def tiny_tokenizer(vocab_size: int = 1024) -> Any:
    """A word-level ``PreTrainedTokenizerFast``: ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, then the
    words ``w3`` ... ``w{vocab_size-1}`` (ids = their number), split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def word_reward(completions: list[str], **_: Any) -> list[float]:
    """GRPO reward: the mean word number of a completion / 1000 (varies between completions, so
    GRPO's group advantages are not all zero and the policy moves)."""
    out = []
    for text in completions:
        ids = [int(w[1:]) for w in text.split() if w[1:].isdigit()]
        out.append(sum(ids) / len(ids) / 1000 if ids else 0.0)
    return out


def policy(seed: int = 0) -> Any:
    """The tiny Qwen3-MoE (bfloat16) with the tokenizer's special ids in its config."""
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe

    model = build_tiny_qwen3_moe(seed=seed)
    model.config.pad_token_id, model.config.eos_token_id, model.config.bos_token_id = 0, 1, None
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    return model.train()


def grpo_args(out_dir: str | Path, steps: int, **overrides: Any) -> Any:
    """A small CPU ``GRPOConfig``: colocated vLLM, 2 prompts x 2 generations of 4 tokens per
    step, learning rate 1e-2 (the weights visibly move every step), no checkpoints, no reporting."""
    from trl import GRPOConfig

    args = dict(output_dir=str(out_dir), use_vllm=True, vllm_mode="colocate", per_device_train_batch_size=2,
                num_generations=2, max_completion_length=4, max_steps=steps, logging_steps=1, report_to="none",
                use_cpu=True, bf16=False, learning_rate=1e-2, seed=0, vllm_max_model_length=64,
                save_strategy="no", disable_tqdm=True)
    args.update(overrides)
    return GRPOConfig(**args)


@dataclass
class SyncRecord:
    """One sync: the training step it followed, the trainer's weights then (checkpoint names and
    layout the trainer holds: a PEFT model merged), the engine's greedy output right after."""

    step: int
    weights: dict[str, torch.Tensor]
    engine: list[Any]
    report: Any


@dataclass
class ParityProbe:
    """Wraps a trainer's qstrat sync: after each one, record :class:`SyncRecord` (the weights come
    from the trainer's model itself, not from TRL's iterator: PEFT through ``merge_and_unload``
    of a copy)."""

    trainer: Any
    records: list[SyncRecord] = field(default_factory=list)
    #: How the engine's greedy output is read after a sync (default: :func:`probe_greedy` of the
    #: trainer's colocated engine; server mode: the server's, over HTTP).
    read_engine: Any = None

    def __post_init__(self) -> None:
        gen = self.trainer.vllm_generation
        self.sync = gen.sync_weights
        gen.sync_weights = self

    def __call__(self) -> Any:
        # The weights before the sync: TRL's PEFT sync merges and then unmerges the adapter in
        # place, which may round the base weights in BF16 (a later merge differs by that rounding).
        model = self.trainer.model
        if callable(getattr(model, "merge_and_unload", None)):  # PEFT: its own merge, on a copy
            model = copy.deepcopy(model).merge_and_unload()
        weights = {n: t.detach().clone() for n, t in model.state_dict().items()}
        report = self.sync()
        engine = self.read_engine() if self.read_engine else probe_greedy(self.trainer.vllm_generation.llm)
        self.records.append(SyncRecord(self.trainer.state.global_step, weights, engine, report))
        return report


def fresh_engine_greedy(strategy: Any, hf_config: dict[str, Any], weights: dict[str, torch.Tensor],
                        directory: Path) -> list[Any]:
    """Greedy output of a fresh engine started on a qstrat checkpoint of ``weights`` (released
    before returning). ``logprobs_mode`` as TRL starts its engine (processed logprobs)."""
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.execute.driver import RefitDriver
    from qstrat.vllm.engine.local import release, start_engine

    write_checkpoint(RefitDriver(strategy, hf_config=hf_config), weights, directory, overwrite=True)
    llm = start_engine(directory, logprobs_mode="processed_logprobs")
    try:
        return probe_greedy(llm)
    finally:
        release(llm)


def build_trainer(strategy: Any, steps: int, work: Path, peft: bool = False, **rollout_kwargs: Any) -> Any:
    """The demo's GRPO trainer with qstrat rollouts (:func:`qstrat.integrations.trl.make_trainer`
    on the tiny policy, :func:`grpo_args`), built and not trained; its engine is running.
    ``rollout_kwargs``: ``verify_every``, ``on_fidelity_failure`` (:func:`qstrat.integrations.trl.rollouts`)."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from qstrat.integrations.trl import make_trainer

    kwargs: dict[str, Any] = {}
    if peft:
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    with torch._dynamo.config.patch(disable=True):  # eager: vLLM would compile helpers (~10 s on a CPU)
        return make_trainer(GRPOTrainer, strategy, model=policy(), processing_class=tiny_tokenizer(),
                            reward_funcs=word_reward, train_dataset=Dataset.from_dict({"prompt": list(TRAIN_PROMPTS)}),
                            args=grpo_args(work / "grpo", steps), **rollout_kwargs, **kwargs)


def train(strategy: Any, steps: int, work: Path, peft: bool = False, **rollout_kwargs: Any) -> tuple[Any, ParityProbe]:
    """Build (:func:`build_trainer`) and train a GRPO trainer with qstrat rollouts for ``steps``
    steps, then sync once more (as TRL does before its next generation), so that the probe holds
    the engine after every step. ``rollout_kwargs``: the fidelity probe's cadence and what its
    failed verdict does (``verify_every``, ``on_fidelity_failure``: :func:`qstrat.integrations.trl.rollouts`).
    Returns: the trainer (its engine still running) and its :class:`ParityProbe`.
    """
    trainer = build_trainer(strategy, steps, work, peft=peft, **rollout_kwargs)
    with torch._dynamo.config.patch(disable=True):
        probe = ParityProbe(trainer)
        trainer.train()
        trainer.vllm_generation.sync_weights()
    return trainer, probe


def _env() -> None:
    """The in-process CPU engine settings of :func:`qstrat.vllm.engine.local.start_engine`."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def main(argv: list[str] | None = None) -> int:
    """The demo's command. Returns 0 when the engine equalled a fresh engine after every step, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="python -m qstrat.integrations.trl_demo", description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="block-fp8", help="a qstrat preset or config file (default block-fp8)")
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps (default 2)")
    parser.add_argument("--peft", action="store_true", help="train a LoRA adapter (merged on every sync)")
    opts = parser.parse_args(argv)
    _env()
    from qstrat.cli.console import make_console, quiet_torchao_import, stderr_to
    from qstrat.cli.demo.tiny_model import hf_config
    from qstrat.vllm.engine.local import release

    quiet_torchao_import()
    say = make_console().print
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qstrat-trl-demo-") as tmp:
        work = Path(tmp)
        log = work / "engine.log"
        say(f"GRPO on the tiny Qwen3-MoE, {opts.steps} steps, rollouts in {opts.strategy!r} "
            f"(TRL, vLLM and the engine start; their output goes to {log}, removed at the end: its last "
            "lines are shown if a step fails) ...")
        with stderr_to(log):
            trainer, probe = train(opts.strategy, opts.steps, work, peft=opts.peft)
            cfg = hf_config(policy())
            history = [h for h in trainer.state.log_history if "loss" in h]
            release(trainer.vllm_generation.llm)
            fresh = [fresh_engine_greedy(opts.strategy, cfg, r.weights, work / f"fresh{i}")
                     for i, r in enumerate(probe.records)]
        all_equal = True
        for record, want in zip(probe.records, fresh):
            equal = [g.tokens for g in record.engine] == [w.tokens for w in want] and \
                   [g.logprobs for g in record.engine] == [w.logprobs for w in want]
            d = max((abs(a - b) for g, w in zip(record.engine, want) for a, b in zip(g.logprobs, w.logprobs)),
                    default=0.0)
            all_equal &= equal
            r = record.report
            say(f"after step {record.step}: refit {r.tensors} tensors, {r.bytes / 2**20:.2f} MiB, {r.seconds:.2f} s; "
                f"engine {'==' if equal else '!='} fresh engine on the trainer's weights (max |dlogprob| {d:.3g})")
        for h in history:
            keys = ("sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/mean",
                    "qstrat/refit/seconds")
            say(f"step {h['step']} logs: " + ", ".join(f"{k} {h[k]:.4g}" for k in keys if k in h))
        say(f"{'OK' if all_equal else 'FAILED'} in {time.perf_counter() - start:.0f} s")
    return 0 if all_equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
