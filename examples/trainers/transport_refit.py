"""Refit a running vLLM server over qstrat's transport, authenticated, and check it against the
fresh server (docs/transport.md, "A recipe on a CPU"). Runs on a CPU.

1. ``python examples/trainers/transport_refit.py write DIR``: qstrat's block-FP8 checkpoint of
   the tiny Qwen3-MoE model B into DIR (what the server starts on).
2. Start the server on DIR with docs/transport.md's command, ``QSTRAT_TRANSFER_SECRET`` set.
3. ``QSTRAT_TRANSFER_SECRET=... python examples/trainers/transport_refit.py refit http://127.0.0.1:8000``:
   reads the server's greedy completions (the fresh server on B), refits it to model A (they
   change), then back to B (they must equal the fresh server's, token for token and logprob for
   logprob); exits 1 otherwise. Each step prints one line. ``--mode delta``: the same with
   ``RefitSender(..., mode="delta")`` - the first round whole, the refit back to B a delta
   round against it (docs/transport.md, "Delta rounds"), its ``report.delta`` line printed.

A qstrat error (the server refused this trainer's secret: ``TransferAuthError``; a round it
refused; a plan the server does not serve) is printed as one line, ``transport_refit.py:
TransferAuthError: ...``, on stderr, and the script exits 2 (no traceback: the message says what
happened and where). A server that does not answer (not started yet, or another URL) is one line
too, ``transport_refit.py: no server at URL (...)``, exit 2.
"""
from __future__ import annotations

import argparse
import sys

PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300, 400], [7, 7, 7, 7, 7, 7])


def tiny_models():
    """(driver, trainer tensors of A, of B): the tiny model's two seeds."""
    from qstrat import RefitDriver
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config

    a, b = build_tiny_qwen3_moe(seed=0), build_tiny_qwen3_moe(seed=1)
    return RefitDriver("block-fp8", hf_config=hf_config(b)), a.state_dict(), b.state_dict()


def completions(url: str) -> list[tuple[list[str], list[float]]]:
    """Greedy completions of PROMPTS (token ids in and out: the server runs without a tokenizer)."""
    import requests

    model = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    out = []
    for prompt in PROMPTS:
        r = requests.post(f"{url}/v1/completions", timeout=60, json={
            "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1,
            "return_tokens_as_token_ids": True})
        r.raise_for_status()
        lp = r.json()["choices"][0]["logprobs"]
        out.append((lp["tokens"], lp["token_logprobs"]))
    return out


def main(argv: list[str] | None = None) -> int:
    """The steps above; a qstrat error as one line on stderr, exit status 2."""
    import requests

    from qstrat.errors import QstratError

    try:
        return _run(argv)
    except QstratError as exc:
        print(f"transport_refit.py: {type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except requests.ConnectionError as exc:
        url = exc.request.url if exc.request is not None else "the URL given"
        print(f"transport_refit.py: no server at {url} (is it started and /health answering? "
              f"docs/transport.md, \"A recipe on a CPU\", step 2): {type(exc).__name__}", file=sys.stderr)
        return 2


def _run(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                     epilog="Steps: docs/transport.md, \"A recipe on a CPU\".")
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("write", help="write qstrat's block-FP8 checkpoint of model B (the server starts on it)"
                   ).add_argument("dir", help="the folder to write the checkpoint into")
    refit = sub.add_parser("refit", help="refit the server to A and back to B; check it against the fresh server")
    refit.add_argument("url", help="the vLLM server's base URL, e.g. http://127.0.0.1:8000")
    refit.add_argument("--mode", choices=("atomic", "delta"), default="atomic",
                       help="atomic: whole rounds; delta: only the changed words after the first round")
    refit.add_argument("--trainer-address", default="127.0.0.1", help="where the engine reaches this process")
    refit.add_argument("--port", type=int, default=29600, help="the transfer group's port on this process")
    args = parser.parse_args(argv)
    driver, a, b = tiny_models()
    if args.step == "write":
        from qstrat.execute.checkpoint import write_checkpoint

        write_checkpoint(driver, b, args.dir)
        print(f"wrote qstrat's block-FP8 checkpoint of model B to {args.dir}")
        return 0

    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    from qstrat.transport import RefitSender

    fresh = completions(args.url)
    print(f"fresh server: {len(fresh)} greedy completions read")
    # the secret: QSTRAT_TRANSFER_SECRET, as on the server
    sender = RefitSender([HTTPVLLMWeightSyncClient(args.url, timeout=60)], args.trainer_address, args.port,
                         timeout_s=60, mode=args.mode)
    sender.connect()
    try:
        print(f"refit to A: {sender.refit(driver, a)}")
        if completions(args.url) == fresh:
            print("FAILED: the server's completions did not change on A")
            return 1
        report = sender.refit(driver, b)
        print(f"refit to B: {report.delta if args.mode == 'delta' else report}")
        back = completions(args.url)
    finally:
        sender.close()
    if back != fresh:
        print(f"FAILED: after the refit back to B the server answers {back}, the fresh server {fresh}")
        return 1
    print("back on B: every completion equals the fresh server's (tokens and logprobs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
