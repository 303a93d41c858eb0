"""Command line: ``qstrat demo | plan | quantize | bench | list | doctor``."""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from qstrat.cli.bench_sections import SECTIONS
from qstrat.cli.console import make_console
from qstrat.errors import ConfigError, ConfigOnlyUnsupportedError, QstratError


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``qstrat`` command. Returns the exit status (2 on a user error)."""
    parser = _parser()
    args = parser.parse_args(argv)
    console = make_console()
    try:
        return args.func(args, console)
    except (QstratError, OSError) as exc:
        from rich.markup import escape

        make_console(stderr=True).print(f"[bold red]error:[/] {escape(str(exc))}", markup=True)
        return 2


#: ``qstrat --help`` text (plain: argparse prints it as is).
DESCRIPTION = ("Quantize BF16 weights into the checkpoint tensors a vLLM engine loads (block FP8, MXFP8, "
               "NVFP4, BF16): plan which tensor gets which format, write a quantized checkpoint, or run "
               "the demo refit.")
EPILOG = "Run 'qstrat COMMAND --help' for a command's options."


def _subcommand(sub: Any, name: str, text: str) -> argparse.ArgumentParser:
    """A subcommand whose one-line help in ``qstrat --help`` is also its ``--help`` description."""
    return sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")


def _parser() -> argparse.ArgumentParser:
    from qstrat import __version__

    p = argparse.ArgumentParser(prog="qstrat", description=DESCRIPTION, epilog=EPILOG)
    p.add_argument("--version", action="version", version=f"qstrat {__version__}",
                   help="print qstrat's version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = _subcommand(sub, "demo", "plan, quantize, verify and refit the built-in tiny Qwen3-MoE")
    _strategy_args(demo, required=False)
    demo.add_argument("--out", type=Path, help="directory for the checkpoints (default: temporary)")
    demo.add_argument("--no-engine", action="store_true", help="skip the vLLM engine stage")
    demo.set_defaults(func=_cmd_demo)

    plan = _subcommand(sub, "plan", "show every tensor's decision (reads config.json and safetensors "
                                    "headers only; no weights)")
    plan.add_argument("model", type=Path, help="model directory (config.json [+ *.safetensors])")
    _strategy_args(plan, required=True)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--summary", action="store_true", help="totals only, not every tensor")
    plan.add_argument("--grouped", action="store_true",
                      help="config-only model: plan grouped expert slabs (trainer view) instead of "
                           "per-expert names (an error for a directory with *.safetensors)")
    cluster = plan.add_argument_group(
        "cluster model", "bytes per link and the link-bound round time of a refit where every trainer rank "
        "sends what it owns to the engine ranks that load it, against today's single-sender broadcast "
        "(docs/transport.md, 'Refit at cluster scale'); prints the totals, not every tensor")
    cluster.add_argument("--trainer-layout", metavar="LAYOUT",
                         help="trainer ranks as epNxfsdpN (e.g. ep8xfsdp8: 64 ranks)")
    cluster.add_argument("--engine-layout", metavar="LAYOUT",
                         help="engine ranks as tpNxdpN[xep] (e.g. tp8xdp16: 16 TP8 engines; xep: vLLM's "
                              "expert parallelism inside each)")
    cluster.add_argument("--link", default="400gbit", metavar="RATE",
                         help="per-GPU link rate in bits/s (default 400gbit; units kbit, mbit, gbit, tbit)")
    cluster.add_argument("--link-efficiency", type=float, default=1.0, metavar="F",
                         help="fraction of the rate a point-to-point stream achieves (default 1.0; "
                              "scripts/bench_transport.py --mesh-links measures it)")
    cluster.add_argument("--expert-placement", default="linear", choices=("linear", "round_robin"),
                         help="vLLM's expert placement under xep (default linear)")
    plan.set_defaults(func=_cmd_plan)

    quant = _subcommand(sub, "quantize", "quantize a safetensors checkpoint into OUT")
    quant.add_argument("model", type=Path, help="model directory (config.json + *.safetensors)")
    _strategy_args(quant, required=True)
    quant.add_argument("-o", "--out", type=Path, required=True, help="output checkpoint directory")
    quant.add_argument("--overwrite", action="store_true",
                       help="replace OUT if it is an existing directory (OUT may never be, hold "
                            "or lie inside MODEL)")
    quant.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="where to quantize: each tensor is read from its shard onto this device "
                            "(cuda: the formats' Triton kernels; cpu: the torch reference); auto: cuda "
                            "when a CUDA device is visible, else cpu")
    quant.set_defaults(func=_cmd_quantize)

    bench = _subcommand(sub, "bench", "measure qstrat's CPU paths against vLLM, torchao, a copy and a "
                                      "per-expert loop (ratios; docs/performance.md)")
    bench.add_argument("--quick", action="store_true", help="reduced sizes (seconds; what CI runs)")
    bench.add_argument("--only", default=",".join(SECTIONS),
                       help=f"comma-separated sections (default: all of {','.join(SECTIONS)})")
    bench.add_argument("--reps", type=int, help="timed repetitions per implementation (median kept; default 7, 2 with --quick)")
    bench.add_argument("--max-experts", type=int,
                       help="cap the expert count of the grouped slabs and the driver's layer")
    bench.add_argument("--json", type=Path, help="also write the measurements to this JSON file")
    bench.set_defaults(func=_cmd_bench)

    lst = _subcommand(sub, "list", "list every registered plugin and where it came from")
    lst.set_defaults(func=_cmd_list)

    doctor = _subcommand(sub, "doctor", "report what this machine gives qstrat: vLLM version and range, "
                                        "torch, GPU or CPU (AMX), each format's engine kernels, "
                                        "weight-transfer backends, Triton (always exits 0)")
    doctor.add_argument("--json", action="store_true", help="print the facts as JSON")
    doctor.set_defaults(func=_cmd_doctor)
    return p


def _strategy_args(p: argparse.ArgumentParser, required: bool) -> None:
    g = p.add_mutually_exclusive_group(required=required)
    g.add_argument("-c", "--config", type=Path, help="refit config file (.yaml, .toml, .json)")
    g.add_argument("--preset", help="a registered strategy preset (run 'qstrat list' to see them)")


def _config_source(args: argparse.Namespace, default: str | None = None) -> Any:
    if args.config is not None:
        return args.config
    if args.preset is not None:
        return {"preset": args.preset}
    return {"preset": default}


def _read_hf_config(model: Path) -> tuple[Path, dict[str, Any]]:
    """``(path, content)`` of the model's config.json (``model`` is its directory or the file)."""
    if not model.exists():
        raise FileNotFoundError(f"{model} does not exist")
    if model.is_dir():
        cfg_path = model / "config.json"
        if not cfg_path.exists():
            raise FileNotFoundError(f"{cfg_path} does not exist")
    elif model.suffix == ".safetensors":
        raise ConfigError(f"{model} is a safetensors file; pass the model directory holding it "
                          "and its config.json")
    elif model.suffix in (".yaml", ".yml", ".toml"):  # the refit config given where MODEL goes
        raise ConfigError(f"{model}: MODEL is the model's directory (or its config.json); a refit config "
                          "goes after --config (qstrat plan MODEL --config FILE)")
    else:
        cfg_path = model
    from qstrat.config.files import read_text_file

    text = read_text_file(cfg_path, "JSON file", " (the model's config.json)", text_what="JSON text file")
    try:
        hf = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{cfg_path}: invalid JSON: {exc}") from exc
    except RecursionError:
        from qstrat.config.files import NESTED_TOO_DEEPLY

        raise ConfigError(f"{cfg_path}: invalid JSON: {NESTED_TOO_DEEPLY}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{cfg_path}: expected a JSON object, got {type(hf).__name__}")
    return cfg_path, hf


def _load_model(model: Path, config: Any, grouped: bool = False) -> tuple[Any, dict[str, Any]]:
    """The refit driver for the model's config.json and the model's tensors: lazily read
    safetensors headers, or, for a config-only directory, ``meta`` tensors with the shapes the
    config implies, named by the driver's layout (``layout:`` in the config, else detected).

    Raises: FileNotFoundError; ConfigError naming config.json (unreadable, invalid, a key the
    model needs is missing) or ``--grouped`` with safetensors present, or naming a refit config
    key; QstratError naming a safetensors file (unreadable header, unsupported dtype, no tensors).
    """
    from qstrat.execute.checkpoint import lazy_checkpoint
    from qstrat.execute.driver import RefitDriver
    from qstrat.layouts.model_config import ModelConfig

    cfg_path, hf = _read_hf_config(model)
    try:
        parsed = ModelConfig.of(hf)  # the door: parsed once, errors name the file
    except ConfigError as exc:
        raise ConfigError(f"{cfg_path}: {exc}") from exc
    try:
        driver = RefitDriver(config, hf_config=parsed)  # checks the config's values (ModelConfig.check)
    except ConfigError as exc:
        if str(exc).startswith("model config:"):  # config.json's, not the refit config's: name the file
            raise ConfigError(f"{cfg_path}: {exc}") from exc
        raise
    if model.is_dir() and any(model.glob("*.safetensors")):
        if grouped:
            raise ConfigError(f"--grouped plans a config-only directory, but {model} has *.safetensors: "
                              "their tensors are planned as stored; drop --grouped")
        tensors = lazy_checkpoint(model)
        if not tensors:
            raise QstratError(f"{model}: no tensors in its *.safetensors files; nothing to plan")
        return driver, tensors
    import torch

    from qstrat.layouts.skeleton import model_tensors

    dtype = getattr(torch, str(hf.get("torch_dtype", "bfloat16")), torch.bfloat16)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"{cfg_path}: torch_dtype {hf.get('torch_dtype')!r} is not a torch dtype")
    try:
        shapes = list(model_tensors(driver.layout, driver.model_config, grouped))
    except KeyError as exc:
        raise ConfigError(f"{cfg_path}: missing key {exc.args[0]!r}, needed to plan the model from its "
                          "config alone (no *.safetensors in the directory)") from exc
    except ConfigOnlyUnsupportedError as exc:  # a structure the skeleton does not generate
        raise ConfigOnlyUnsupportedError(f"{cfg_path}: {exc}") from exc
    except ConfigError as exc:  # a value out of range, named by qstrat.layouts.model_config
        raise ConfigError(f"{cfg_path}: {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{cfg_path}: invalid value, cannot derive the tensor shapes: {exc}") from exc
    try:
        return driver, {n: torch.empty(s, dtype=dtype, device="meta") for n, s in shapes}
    except RuntimeError as exc:  # torch: "Storage size calculation overflowed" (each key in range)
        raise ConfigError(f"{cfg_path}: the config implies a tensor too large to describe ({exc}); "
                          "check its dimension keys") from exc


def _cmd_plan(args: argparse.Namespace, console: Console) -> int:
    cluster = _cluster_layouts(args)
    driver, tensors = _load_model(args.model, _config_source(args), args.grouped)
    plan = driver.plan(tensors)
    if cluster is not None:
        from qstrat.plan.cluster_report import cluster_row, cluster_table, field_table

        _print_summary(console, plan)
        row = cluster_row(args.model.name, plan, driver.model_config, *cluster)
        console.print(cluster_table([row]))
        console.print(field_table())
        return 0
    if args.json:
        sys.stdout.write(plan.to_json(indent=1) + "\n")
        _print_plan_warnings(None, driver, plan)
        return 0
    if not args.summary:
        width = max((len(e.name) for e in plan.entries), default=0)
        for e in plan.entries:
            outs = ", ".join(f"{o.name.rsplit('.', 1)[-1]} {o.dtype}{list(o.shape)}" for o in e.outputs[:2])
            more = f" (+{len(e.outputs) - 2} more)" if len(e.outputs) > 2 else ""
            console.out(f"{e.name:<{width}}  {e.kind:<13} {e.serializer:<11} {e.rule:<28} {outs}{more}")
    _print_summary(console, plan)
    _print_plan_warnings(console, driver, plan)
    return 0


def _cluster_layouts(args: argparse.Namespace) -> tuple[Any, ...] | None:
    """``(trainer, engine, rate_bps, efficiency)`` of ``qstrat plan``'s cluster options, or None.

    Raises: ConfigError naming the option (one layout without the other, with --json, a bad
        token, rate or efficiency)."""
    if args.trainer_layout is None and args.engine_layout is None:
        return None
    if args.trainer_layout is None or args.engine_layout is None:
        missing = "--trainer-layout" if args.trainer_layout is None else "--engine-layout"
        raise ConfigError(f"the cluster model needs both layouts: {missing} is missing "
                          "(e.g. --trainer-layout ep8xfsdp8 --engine-layout tp8xdp16)")
    if args.json:
        raise ConfigError("--json prints the plan; the cluster model (--trainer-layout/--engine-layout) "
                          "prints a table: drop one of them")
    if not 0 < args.link_efficiency <= 1:
        raise ConfigError(f"--link-efficiency {args.link_efficiency}: expected a fraction in (0, 1]")
    from qstrat.plan.cluster_layout import parse_engine_layout, parse_link_rate, parse_trainer_layout

    return (parse_trainer_layout(args.trainer_layout),
            parse_engine_layout(args.engine_layout, args.expert_placement),
            parse_link_rate(args.link), args.link_efficiency)


def _print_plan_warnings(console: Console | None, driver: Any, plan: Any) -> None:
    """Warning lines about a valid plan: rules that decided no tensor (qstrat.plan.structure.
    idle_rules) and the plan's experts a CPU vLLM engine would refuse to refit
    (qstrat.vllm.checks.cpu_experts); on stderr when ``console`` is None (stdout holds JSON)."""
    from qstrat.vllm.checks.cpu_experts import plan_cpu_refit_warning
    from qstrat.plan.structure import idle_rules

    notes = idle_rules(plan.entries, driver.config)
    cpu = plan_cpu_refit_warning(plan, driver.model_config, driver.registry, driver.layout)
    for note in notes + ([cpu] if cpu is not None else []):
        if console is None:
            sys.stderr.write(f"warning: {note}\n")
        else:
            console.print(f"warning: {note}", markup=False, soft_wrap=True)


#: What the unquantized rows of the totals mean, printed under them (docs/cli.md).
LEGEND = {
    "passthrough": ("passthrough: sent unchanged, in the trainer's dtype - not weight matrices (norms, "
                    "biases) and kinds never quantized (embeddings, lm_head, routers)"),
    "bf16": ("bf16: quantizable weight matrices kept unquantized by a rule, default, keep_bf16 or a BF16 "
             "fallback, sent as bfloat16"),
}


def _print_summary(console: Console, plan: Any) -> None:
    table = Table(title=f"plan: layout {plan.layout}, {plan.num_layers} decoder layers")
    for col in ("serializer", "tensors", "outputs", "GiB in", "GiB out"):
        table.add_column(col, justify="right" if col != "serializer" else "left")
    for name, t in plan.totals().items():
        table.add_row(name, str(t["tensors"]), str(t["outputs"]), f"{t['bytes_in'] / 2**30:.3f}",
                      f"{t['bytes_out'] / 2**30:.3f}")
    console.print(table)
    legend = [LEGEND[name] for name in plan.totals() if name in LEGEND]
    if legend:
        console.print("; ".join(legend), markup=False, soft_wrap=True)
    if plan.layout == "generic":
        why = ("chosen by the refit config" if plan.config.get("layout") == "generic" else
               "config.json's architectures/model_type match no registered model family")
        kinds = collections.Counter(e.kind for e in plan.entries)
        console.print(f"layout generic ({why}): no family-specific names were recognised; tensors by kind: "
                      + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
                      + " (set 'layout:' in the refit config to choose a family: 'qstrat list')", markup=False)
    qc = plan.vllm_quantization_config()
    if qc is not None:
        shown = {k: (v if not isinstance(v, list) or len(v) <= 6 else v[:6] + [f"... {len(v)} in all"])
                 for k, v in qc.items()}
        console.print("quantization_config:", json.dumps(shown))
    elif plan.engine_quantization is not None:
        console.print("quantization_config: none (a BF16 checkpoint: quantize_in: engine)")
    else:
        console.print("quantization_config: none (unquantized plan)")
    if plan.engine_quantization is not None:
        from qstrat.vllm.online import engine_kwargs

        online = engine_kwargs(plan)["quantization_config"]
        ignore = online.get("ignore", [])
        shown = {**online, "ignore": ignore if len(ignore) <= 6 else ignore[:6] + [f"... {len(ignore)} in all"]}
        console.print("engine quantizes online: start it with quantization='online', quantization_config="
                      + json.dumps(shown) + " (all of it: qstrat.vllm.online.engine_kwargs(plan), or the checkpoint's "
                      "qstrat_plan.json 'engine_quantization')", markup=False, soft_wrap=True)


def _cmd_quantize(args: argparse.Namespace, console: Console) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from qstrat.execute.checkpoint import write_checkpoint

    if not args.model.is_dir():
        if args.model.exists():
            raise NotADirectoryError(f"{args.model}: not a model directory (config.json + *.safetensors)")
        raise FileNotFoundError(f"{args.model} does not exist")
    if not any(args.model.glob("*.safetensors")):
        raise FileNotFoundError(f"{args.model}: no *.safetensors to quantize")
    device = _export_device(args.device)
    driver, tensors = _load_model(args.model, _config_source(args))
    if device != "cpu":
        from qstrat.execute.named_tensors import OnDevice

        tensors = {n: OnDevice(t, device) for n, t in tensors.items()}
    progress = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                        TimeRemainingColumn(), console=console)
    tasks: list[Any] = []

    def update(done: int, total: int) -> None:
        # write_checkpoint reports (0, total) only once the plan and OUT passed their checks:
        # output starts then, never above an error, and a warning about the input comes before
        # anything is written. Not a terminal (a log): one line per shard.
        if done == 0 and not tasks:
            _print_plan_warnings(console, driver, driver.plan(tensors))
            console.print(f"quantizing on {device}")
        if not console.is_terminal:
            tasks.append(None)
            if done:
                unit, scale = ("GiB", 2**30) if total >= 2**30 else ("MiB", 2**20)
                console.print(f"quantizing: {done / scale:,.1f} of {total / scale:,.1f} {unit} written "
                              f"({done / max(total, 1):.0%})")
            return
        if not tasks:
            progress.start()
            tasks.append(progress.add_task("quantizing", total=total))
        progress.update(tasks[0], completed=done, total=total)

    from qstrat.execute.checkpoint import OutputExistsError

    try:
        plan = write_checkpoint(driver, tensors, args.out, overwrite=args.overwrite,
                                source_dir=args.model, progress=update)
    except OutputExistsError as exc:  # the API's wording says overwrite=True
        raise FileExistsError(exc.for_option("--overwrite")) from None
    finally:
        if tasks and console.is_terminal:
            progress.stop()
    _print_summary(console, plan)
    console.print(f"wrote {args.out}")
    return 0


def _cmd_bench(args: argparse.Namespace, console: Console) -> int:
    from qstrat.cli.bench import machine, machine_table, render, run_bench

    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    if args.reps is not None and args.reps < 1:
        raise ConfigError(f"--reps must be >= 1, got {args.reps}")
    if args.max_experts is not None and args.max_experts < 1:
        raise ConfigError(f"--max-experts must be >= 1, got {args.max_experts}")
    unknown = sorted(set(sections) - set(SECTIONS))
    if not sections:
        raise ConfigError(f"--only: no section given; choose from {list(SECTIONS)}")
    if unknown:
        raise ConfigError(f"--only: unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    if args.json is not None:  # before minutes of measuring, not after
        _check_writable(args.json, "--json")

    def show(part: dict[str, Any]) -> None:
        for table in render(part):
            console.print(table)

    import tempfile

    from qstrat.cli.console import stderr_to

    # vLLM and torchao write warnings to stderr while they load (missing CUDA libraries, Triton
    # without a CPU backend): a log, whose tail is attached to any error, not the tables. The log
    # is kept when the run fails (the error names it) and removed after a successful one.
    log = Path(tempfile.mkdtemp(prefix="qstrat-bench-")) / "bench.log"
    console.print(machine_table(machine()))
    with stderr_to(log):
        doc = run_bench(quick=args.quick, sections=sections, reps=args.reps, max_experts=args.max_experts,
                        on_section=show)
    log.unlink(missing_ok=True)
    log.parent.rmdir()
    console.print(f"{doc['size']} size, {doc['seconds']} s, load {doc['load_before'][0]:.1f} -> "
                  f"{doc['load_after'][0]:.1f}"
                  + ("; a smoke test: tiny shapes, where fixed costs dominate - its ratios do not "
                     "compare with a full run's" if doc["size"] == "quick" else ""))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        console.print(f"wrote {args.json}")
    return 0


def _check_writable(path: Path, flag: str) -> None:
    """Make ``path``'s directory (as the later write would) and check a file can be written there.

    Raises: ConfigError naming ``flag`` and the reason.
    """
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot create its directory: {exc.strerror or exc}") from None
    target = path if path.exists() else path.parent
    if not os.access(target, os.W_OK):
        raise ConfigError(f"{flag} {path}: {target} is not writable")


def _export_device(choice: str) -> str:
    """``cpu`` or ``cuda`` for ``--device``. Raises ConfigError for cuda without a CUDA device."""
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False, "
                          f"torch {torch.__version__}); use --device cpu or auto")
    return choice


def _cmd_list(args: argparse.Namespace, console: Console) -> int:
    from qstrat.plugins.registry import get_registry

    reg = get_registry()
    table = Table(title="qstrat plugins")
    for col in ("kind", "name", "summary", "from"):
        table.add_column(col)
    for kind in reg.KINDS:
        for name, entry in sorted(getattr(reg, kind).items()):
            summary = getattr(entry.obj, "summary", "") or ", ".join(getattr(entry.obj, "architectures", ()))
            table.add_row(kind, name, summary, entry.origin)
    console.print(table)
    return 0


def _cmd_doctor(args: argparse.Namespace, console: Console) -> int:
    from qstrat.cli import doctor

    if args.json:
        print(json.dumps(doctor.as_dicts(doctor.diagnose()), indent=2))
    else:  # line by line as the facts are found (importing vLLM takes a while)
        for line in doctor.report_lines(doctor.facts_as_found()):
            print(line, flush=True)
    return 0


def _two_columns(title: str, header: tuple[str, str], rows: dict[str, str]) -> Table:
    table = Table(title=title)
    table.add_column(header[0])
    table.add_column(header[1], justify="right")
    for key, value in rows.items():
        table.add_row(key, value)
    return table


def _cmd_demo(args: argparse.Namespace, console: Console) -> int:
    console.print("qstrat demo: importing torch and transformers ...")
    from qstrat.cli.demo import run_demo

    report = run_demo(_config_source(args, default="block-fp8"), out_dir=args.out,
                      engine=not args.no_engine, console=console)
    console.print()
    _print_summary(console, report.plan)
    console.print(_two_columns("quantization error", ("serializer", "relative RMS error vs BF16"),
                               {k: f"{v:.4%}" for k, v in report.rel_error.items()}))
    console.print(_two_columns("time per stage", ("stage", "seconds"),
                               {k: f"{v:.2f}" for k, v in report.stage_seconds.items()}))
    where = ("in a temporary directory, removed (keep it with --out DIR)" if report.removed
             else str(report.checkpoint))
    console.print(f"checkpoint: {'verified' if report.verified else 'NOT verified'}, {where}", markup=False)
    # the engine line carries its own reason and remedy (e.g. how to install vLLM)
    console.print(f"engine: {report.engine}", markup=False)
    if report.engine_ok is False:
        console.print(f"vLLM's output: {report.engine_log}", markup=False)
    return 0 if report.engine_ok is not False else 1


if __name__ == "__main__":
    raise SystemExit(main())
