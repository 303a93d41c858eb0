"""``python -m qstrat.integrations.trl_server_demo``: TRL's server mode with qstrat on a CPU, checked sync by sync.

1. Writes qstrat's checkpoint of ANOTHER tiny Qwen3-MoE (seed 1) with the demo's tokenizer
   (:func:`qstrat.integrations.trl_server.write_server_checkpoint`): the server starts on
   weights the policy does not have, so its outputs are the policy's only if a sync replaced them.
2. Starts TRL's server command (:func:`qstrat.integrations.trl_server.serve_command`: TRL's
   ``vllm-serve`` arguments, TRL's ``build_command``, the ``qstrat`` backend) in a process
   group of its own, with ``QSTRAT_TRANSFER_SECRET`` set (authenticated rounds).
3. Trains TRL's ``GRPOTrainer`` in ``vllm_mode="server"`` through
   :func:`qstrat.integrations.trl.make_trainer` (the same secret in this process), syncing once
   more after the last step; after every sync records the trainer's weights and the server's
   greedy tokens and logprobs (read with TRL's own ``VLLMClient.generate``, one prompt per call).
4. Stops the server and starts a FRESH in-process engine on a qstrat checkpoint of each recorded
   weight set: the server must have equalled it exactly after every sync.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qstrat.vllm.engine.http_server import CPU_SERVER_ENV, free_port, serving

#: The demo's shared secret (both sides read ``QSTRAT_TRANSFER_SECRET``).
SECRET = "qstrat TRL server demo secret, 32 bytes"


def trl_serve_args(checkpoint: Path, port: int) -> list[str]:
    """``trl vllm-serve`` arguments for the tiny model on a CPU (TRL's own flags, then vLLM's)."""
    return ["--model", str(checkpoint), "--host", "127.0.0.1", "--port", str(port), "--enforce_eager", "true",
            "--max_model_len", "64", "--dtype", "bfloat16", "--log_level", "warning", "--max-num-seqs", "4"]


@contextmanager
def server(checkpoint: Path, log: Path, secret: str | None = SECRET) -> Iterator[str]:
    """Run ``python -m qstrat.integrations.trl_server`` on ``checkpoint`` until the block exits
    (:func:`qstrat.vllm.engine.http_server.serving`, environment :data:`~qstrat.vllm.engine.http_server.CPU_SERVER_ENV`
    and ``QSTRAT_TRANSFER_SECRET=secret``); yields its base URL."""
    port = free_port()
    env = {**os.environ, **CPU_SERVER_ENV}
    env.pop("QSTRAT_TRANSFER_SECRET", None)
    if secret is not None:
        env["QSTRAT_TRANSFER_SECRET"] = secret
    command = [sys.executable, "-m", "qstrat.integrations.trl_server", *trl_serve_args(checkpoint, port)]
    with serving(command, port, log, env) as url:
        yield url


def server_greedy(client: Any) -> list[Any]:
    """Greedy tokens and logprobs of :data:`qstrat.vllm.engine.local.PROMPTS` from the server, through
    TRL's ``VLLMClient.generate`` (one prompt per call, as :func:`~qstrat.integrations.trl_demo.probe_greedy`)."""
    from qstrat.vllm.engine.local import PROMPTS, Generation
    from qstrat.integrations.trl_demo import PROBE_TOKENS

    out = []
    for prompt in PROMPTS:
        r = client.generate([list(prompt)], n=1, temperature=0.0, max_tokens=PROBE_TOKENS, logprobs=0)
        out.append(Generation(tuple(r["completion_ids"][0]), tuple(float(lp[0]) for lp in r["logprobs"][0])))
    return out


def train(strategy: Any, steps: int, work: Path, url: str, stock: bool = False,
          peft: bool = False, **rollout_kwargs: Any) -> tuple[Any, Any]:
    """Build and train a server-mode GRPO trainer through ``make_trainer`` for ``steps`` steps,
    then sync once more; the probe holds the server after every sync.

    ``stock``: build TRL's trainer itself, without qstrat (on a CPU TRL raises
    NotImplementedError while it is built: its weight sync needs CUDA and NCCL). ``peft``: train
    a LoRA adapter (TRL merges it into every sync's weights). ``rollout_kwargs``: ``verify_every``,
    ``on_fidelity_failure`` (:func:`qstrat.integrations.trl.rollouts`; the probe reads the server).
    Returns: the trainer and its :class:`~qstrat.integrations.trl_demo.ParityProbe`.
    """
    import torch
    from datasets import Dataset
    from trl import GRPOTrainer

    from qstrat.integrations.trl import make_trainer
    from qstrat.integrations.trl_demo import TRAIN_PROMPTS, ParityProbe, grpo_args, policy, tiny_tokenizer, word_reward

    with torch._dynamo.config.patch(disable=True):
        kwargs = dict(model=policy(), processing_class=tiny_tokenizer(), reward_funcs=word_reward,
                      train_dataset=Dataset.from_dict({"prompt": list(TRAIN_PROMPTS)}),
                      args=grpo_args(work / "grpo", steps, vllm_mode="server", vllm_server_base_url=url,
                                     vllm_group_port=free_port(), vllm_server_timeout=60))
        if peft:
            from peft import LoraConfig

            kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        trainer = GRPOTrainer(**kwargs) if stock else make_trainer(GRPOTrainer, strategy, **rollout_kwargs, **kwargs)
        gen = trainer.vllm_generation
        probe = ParityProbe(trainer, read_engine=lambda: server_greedy(gen.vllm_client))
        trainer.train()
        gen.sync_weights()
    return trainer, probe


def start_checkpoint(strategy: Any, directory: Path) -> Any:
    """Write the checkpoint the server starts on: the tiny model with seed 1 (the policy has
    seed 0) and the demo's tokenizer. Returns the plan written."""
    from qstrat.integrations.trl_demo import policy, tiny_tokenizer
    from qstrat.integrations.trl_server import write_server_checkpoint

    return write_server_checkpoint(strategy, policy(seed=1), directory, processing_class=tiny_tokenizer())


def compare(strategy: Any, records: list[Any], work: Path) -> list[tuple[Any, list[Any], bool, float]]:
    """(record, fresh engine's greedy output, equal, max |dlogprob|) per sync record: a FRESH
    in-process engine on a qstrat checkpoint of the record's weights, one thread."""
    import torch

    from qstrat.cli.demo.tiny_model import hf_config
    from qstrat.integrations.trl_demo import fresh_engine_greedy, policy

    cfg = hf_config(policy())
    out = []
    threads = torch.get_num_threads()
    torch._C.set_num_threads(1)  # as the server's one OpenMP thread
    try:
        for i, record in enumerate(records):
            want = fresh_engine_greedy(strategy, cfg, record.weights, work / f"fresh{i}")
            equal = record.engine == want
            d = max((abs(a - b) for g, w in zip(record.engine, want) for a, b in zip(g.logprobs, w.logprobs)),
                    default=0.0)
            out.append((record, want, equal, d))
    finally:
        torch._C.set_num_threads(threads)
    return out


def main(argv: list[str] | None = None) -> int:
    """The demo's command. Returns 0 when the server equalled a fresh engine after every sync."""
    parser = argparse.ArgumentParser(prog="python -m qstrat.integrations.trl_server_demo",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="block-fp8", help="a qstrat preset or config file (default block-fp8)")
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps (default 2)")
    parser.add_argument("--peft", action="store_true", help="train a LoRA adapter (merged on every sync)")
    parser.add_argument("--stock", action="store_true", help="TRL's own trainer, without qstrat (shows the seam: "
                        "TRL refuses to sync a CPU trainer)")
    opts = parser.parse_args(argv)
    from qstrat.integrations.trl_demo import _env

    _env()
    os.environ["QSTRAT_TRANSFER_SECRET"] = SECRET
    from qstrat.cli.console import make_console, quiet_torchao_import, stderr_to

    quiet_torchao_import()
    say = make_console().print
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qstrat-trl-server-demo-") as tmp:
        work = Path(tmp)
        say(f"TRL server mode: GRPO on the tiny Qwen3-MoE, {opts.steps} steps, the server in {opts.strategy!r} "
            "(starting the server: about a minute) ...")
        with stderr_to(work / "trainer.log"):
            start_checkpoint(opts.strategy, work / "server-start")
            with server(work / "server-start", work / "server.log") as url:
                try:
                    trainer, probe = train(opts.strategy, opts.steps, work, url, stock=opts.stock,
                                           peft=opts.peft)
                except NotImplementedError as exc:
                    if not opts.stock:
                        raise
                    say(f"FAILED without qstrat: TRL's trainer cannot sync the server: {exc}")
                    return 1
                probe.sync.close()
            results = compare(opts.strategy, probe.records, work)
        ok = True
        for record, _, equal, d in results:
            ok &= equal
            r = record.report
            say(f"after step {record.step}: sent {len(r.wire_manifest.slots)} tensors, {r.bytes / 2**20:.2f} MiB "
                f"in {r.buckets} bucket{'s' if r.buckets != 1 else ''}, {r.seconds:.2f} s; server {'==' if equal else '!='} fresh engine on the "
                f"trainer's weights (max |dlogprob| {d:.3g})")
        say(f"{'OK' if ok else 'FAILED'} in {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
