"""vLLM objects are read only inside qstrat/vllm/adapter, through its views (by AST, not by grep).

Two rules over every qstrat module outside the adapter:

* a name that holds a vLLM object (``llm``, ``worker``, ``runner``, ``vllm_config``, ...) is read
  only as a view: a parameter annotated ``EngineView`` / ``WorkerView`` or a name bound to
  ``EngineView(...)`` / ``WorkerView(...)``, and then only for the view's own members; any other
  attribute read, ``getattr`` / ``setattr`` / ``hasattr`` on it, or its ``__dict__`` fails;
* an attribute the views read from vLLM (a member named by one of the table's entries for
  them: ``llm_engine``, ``engine_core``, ``data_parallel_index``, ``packed_modules_mapping``,
  ...) is read nowhere outside the adapter, whatever the object is called.

The views themselves: each member reads through a table entry, and the table's source check
covers those entries (tests/test_vllm_adapter.py, scripts/compat_source_check.py).
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from qstrat.vllm.adapter import names, views
from qstrat.vllm.adapter.engine_state import EngineState

ROOT = Path(__file__).resolve().parents[1]
ADAPTER = ROOT / "qstrat" / "vllm" / "adapter"

#: Names that hold a vLLM object wherever qstrat uses them.
VLLM_OBJECTS = frozenset({"llm", "worker", "runner", "model_runner", "llm_engine", "engine_core", "vllm_config",
                          "parallel_config", "cache_config", "mc"})
#: Members of the views (what a view-typed name may read).
VIEW_MEMBERS = {
    "EngineView": frozenset(m for m in dir(views.EngineView) if not m.startswith("_")),
    "WorkerView": frozenset(m for m in dir(views.WorkerView) if not m.startswith("_")),
    "TransferBackendView": frozenset(m for m in dir(views.TransferBackendView) if not m.startswith("_")),
}
#: Members the views read that qstrat's own objects also use as names (generic words): left to
#: the first rule, which checks them on every name that holds a vLLM object.
GENERIC = frozenset({"rank", "world_size", "device", "model", "generate", "model_config", "vllm_config", "hf_config",
                     "reset_prefix_cache", "collective_rpc"})
#: Calls taking an object and an attribute name.
ATTR_CALLS = frozenset({"getattr", "setattr", "hasattr", "delattr"})


def view_keys() -> set[str]:
    """The table keys the adapter reads or calls on vLLM objects (``read(obj, "key")``,
    ``call(obj, "key")``: the views, and the adapter's own readers such as model_record)."""
    keys = set()
    for path in ADAPTER.glob("*.py"):
        keys |= {n.args[1].value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
                 and getattr(n.func, "id", getattr(n.func, "attr", None)) in ("read", "call")
                 and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant)}
    return keys


def view_entries() -> dict[str, str]:
    """member name -> table key, for every table entry the views read on an object."""
    out = {}
    for key in view_keys():
        where = next(w for w in names.TABLE[key].locations.values() if w)
        out[where.rpartition(":")[2].rpartition(".")[2]] = key
    return out


#: vLLM attributes qstrat reads only through a view member that hides them (``model_runner``).
HIDDEN = frozenset({"model_runner", "parallel_config", "cache_config"})
VLLM_ATTRS = frozenset(view_entries()) - GENERIC | HIDDEN


def _view_names(fn: ast.AST) -> dict[str, str]:
    """name -> view class, for the parameters annotated with a view and the names bound to one."""
    bound: dict[str, str] = {}
    args = fn.args if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else None
    for a in ([*args.posonlyargs, *args.args, *args.kwonlyargs] if args else []):
        text = ast.unparse(a.annotation) if getattr(a, "annotation", None) else ""
        for view in VIEW_MEMBERS:
            if view in text:
                bound[a.arg] = view
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            callee = node.value.func
            view = callee.id if isinstance(callee, ast.Name) else getattr(callee, "attr", None)
            if view in VIEW_MEMBERS:
                bound.update({t.id: view for t in node.targets if isinstance(t, ast.Name)})
    return bound


def violations(source: str, path: str = "<module>") -> list[str]:
    """Every read of a vLLM object in ``source`` that is not through a view, as ``path:line: what``."""
    tree = ast.parse(source)
    out = []
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    view_of: dict[int, dict[str, str]] = {}
    for scope in sorted(scopes, key=lambda n: (n.lineno, -(n.end_lineno or 0))):
        bound = _view_names(scope)
        for node in ast.walk(scope):
            view_of.setdefault(id(node), {}).update(bound)
    for node in ast.walk(tree):
        bound = view_of.get(id(node), {})
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            base = node.value.id if isinstance(node.value, ast.Name) else \
                node.value.attr if isinstance(node.value, ast.Attribute) else None
            if base in bound and node.attr in VIEW_MEMBERS[bound[base]]:
                continue  # a view's own member
            made = node.value.func if isinstance(node.value, ast.Call) else None
            made = made.id if isinstance(made, ast.Name) else getattr(made, "attr", None)
            if made in VIEW_MEMBERS and node.attr in VIEW_MEMBERS[made]:
                continue  # a member of a view made here: EngineView(llm).engine_core
            if base in VLLM_OBJECTS:
                out.append(f"{path}:{node.lineno}: {base}.{node.attr}")
            elif node.attr in VLLM_ATTRS:
                out.append(f"{path}:{node.lineno}: .{node.attr} (vLLM's {view_entries().get(node.attr, 'reads')})")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTR_CALLS \
                and len(node.args) >= 2:
            obj, name = node.args[0], node.args[1]
            const = name.value if isinstance(name, ast.Constant) else None
            if isinstance(obj, ast.Name) and obj.id in VLLM_OBJECTS:
                out.append(f"{path}:{node.lineno}: {node.func.id}({obj.id}, ...)")
            elif const in VLLM_ATTRS:
                out.append(f"{path}:{node.lineno}: {node.func.id}(..., {const!r}) (vLLM's "
                           f"{view_entries().get(const, 'reads')})")
    return sorted(set(out))


def outside_modules() -> list[Path]:
    return sorted(p for p in (ROOT / "qstrat").rglob("*.py") if ADAPTER not in p.parents)


def test_no_module_outside_the_adapter_reads_a_vllm_object():
    found = [v for p in outside_modules() for v in violations(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "vLLM objects read outside qstrat/vllm/adapter (use its views):\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    "def f(llm):\n    return llm.llm_engine\n",                      # a raw LLM
    "def f(llm: EngineView):\n    return llm.llm.llm_engine\n",       # through the view's object
    "def f(worker):\n    return worker.model_runner.get_model()\n",
    "def f(x):\n    return getattr(x, 'engine_core', None)\n",          # any name, a view member
    "def f(layer):\n    return layer.packed_modules_mapping\n",
    "def f(cfg):\n    return cfg.parallel_config.data_parallel_index\n",
    "def f(llm):\n    setattr(llm, '_qstrat_flag', 1)\n",               # state in vLLM's object
    "def f(llm):\n    return llm.__dict__\n",
    "def f(gen):\n    gen.llm.reset_prefix_cache()\n",                 # an LLM held by another object
    "def f(w: WorkerView):\n    return w.worker.model_runner\n",
    "def f(engine: EngineView, llm):\n    return llm.collective_rpc(g)\n",  # typed elsewhere, not here
    "def f(x):\n    return EngineView(x).llm.engine_core\n",            # past the view
])
def test_a_deliberately_added_read_fails(line):
    """Each of these reads, added to any qstrat module, fails the rule above."""
    assert violations(line), line


@pytest.mark.parametrize("line", [
    "def f(llm: EngineView):\n    return llm.collective_rpc(g), llm.hf_config\n",
    "def f(llm):\n    view = EngineView(llm)\n    return view.model_config\n",
    "def f(x):\n    llm = EngineView(x)\n    return llm.cache_dtype\n",
    "def f(worker: WorkerView):\n    return worker.model(), worker.world_size\n",
    "def f(x):\n    return EngineView(x).engine_core\n",
])
def test_reads_through_a_view_pass(line):
    assert violations(line) == [], line


def test_the_check_knows_the_reads_the_issue_named():
    """The attribute paths issue 43 found read outside the adapter are all view entries."""
    assert {"llm_engine", "engine_core", "data_parallel_index", "is_amx_bmm_enabled", "restore_metadata",
            "weight_loader_numel", "packed_modules_mapping", "weight_group_shape", "block_shape",
            "cache_dtype", "get_model", "collective_rpc"} <= set(view_entries())


def test_every_view_read_is_a_table_entry():
    """Each key the adapter reads or calls is in the table (so the source check covers it), and
    the views read no attribute by a literal name."""
    keys = view_keys()
    assert keys and keys <= set(names.TABLE), keys - set(names.TABLE)
    source = inspect.getsource(views)
    assert not [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
                and getattr(n.func, "id", None) == "getattr" and isinstance(n.args[1], ast.Constant)]


def test_views_read_through_the_table_names():
    """A view reads the attribute the table names, and a stand-in without it gives the default."""
    class Engine:
        model_config = "mc"

    class LLM:
        llm_engine = Engine()

    assert views.EngineView(LLM()).model_config == "mc"
    assert views.EngineView(object()).engine is None
    with pytest.raises(AttributeError, match="llm_collective_rpc"):
        views.EngineView(object()).collective_rpc(print)


def test_engine_state_is_keyed_by_the_engine_and_goes_with_it():
    import gc
    from types import SimpleNamespace

    class LLM:
        pass

    state: EngineState[str] = EngineState("test")
    a, b = LLM(), LLM()
    state.set(a, "a")
    assert state.get(views.EngineView(a)) == "a" and state.get(b) is None
    assert state.setdefault(b, lambda: "b") == "b" and "b" not in vars(b)
    del a
    gc.collect()
    assert len(state._values) == 1  # a's entry went with a
    ns = SimpleNamespace()  # not weak-referenceable: held until dropped
    state.set(ns, "ns")
    assert state.get(ns) == "ns"
    state.drop(ns)
    assert state.get(ns) is None


def test_weight_sources_of_both_forms(monkeypatch):
    """vLLM < 0.33: ``metadata()`` a method, ``__iter__``, ``held_names()``; 0.33+: ``metadata`` a
    cached property, ``iter_full()``, owners per parameter (table entry weight_source_iter_full,
    source-checked on every release)."""
    from functools import cached_property
    from types import SimpleNamespace

    class Old:
        def metadata(self):
            return [SimpleNamespace(name="a")]

        def __iter__(self):
            return iter([("a", 1)])

        def held_names(self):
            return None

    class New:
        @cached_property
        def metadata(self):
            return [SimpleNamespace(name="a", owners=None), SimpleNamespace(name="b", owners=(0,))]

        def iter_full(self):
            return iter([("a", 2)])

    monkeypatch.setattr(views, "member", lambda key: "held_names" if key == "weight_source_held_names" else None)
    assert [m.name for m in views.source_metadata(Old())] == ["a"]
    assert list(views.source_tensors(Old())) == [("a", 1)] and views.source_held_names(Old()) is None
    new = {"weight_source_iter_full": "iter_full", "param_meta_owners": "owners"}
    monkeypatch.setattr(views, "member", new.get)
    assert [m.name for m in views.source_metadata(New())] == ["a", "b"]
    assert list(views.source_tensors(New())) == [("a", 2)]
    assert views.source_held_names(New()) == ["b"]  # b is owned by rank 0 only: a sharded source
