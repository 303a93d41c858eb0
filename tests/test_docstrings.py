"""Docstrings state contracts (shapes, dtypes, units, errors, sources); measurements and history
go to docs/ (issue 43: 16 docstrings ran over 30 lines). A docstring of a module, class or
function of the installed packages over :data:`LIMIT` lines fails unless :data:`KNOWN` names it
with its present length, which it may not outgrow; an entry back under the limit fails too, so the
list only shrinks.

Run ``python tests/test_docstrings.py`` to print every docstring over the limit.
"""
from __future__ import annotations

import ast

from test_import_cycles import product_modules

#: Lines a docstring may hold.
LIMIT = 30

#: ``module`` / ``module.name`` -> (its present length, why it is still long). Each is a contract
#: (every argument, return and error of a public entry point) or a module's map; measurements and
#: history were moved to docs/ (docs/performance.md "Why the code does it this way", docs/vllm.md,
#: docs/integrations.md).
KNOWN: dict[str, tuple[int, str]] = {
    "qstrat.vllm.sink.in_process.refit": (56, "the public refit: nine arguments and every error, each with what was sent"),
    "qstrat.vllm.engine.local.start_engine": (46, "every argument of the CPU engine helper and its errors"),
    "qstrat.execute.checkpoint.write_checkpoint": (43, "every argument and the nothing-written guarantee per error"),
    "qstrat.layouts.model_layout.ModelLayout": (40, "the layout plugin contract: every attribute a family sets"),
    "qstrat.integrations.trl.rollouts": (38, "the hook's arguments and what it restores"),
    "qstrat.vllm.checks.engine_ignore": (37, "vLLM's ignore-list rule per quantization method, which the code mirrors"),
    "qstrat.transport.receive.receiver.receive_round": (38, "the receiver's round: arguments, outcomes, errors"),
    "qstrat.vllm.online": (33, "what quantize_in: engine sends, writes and refuses"),
    "qstrat.transport.protocol": (35, "the round's steps, which both sides implement (protocol 3: delta preludes)"),
    "qstrat.plan.trainer_decisions.select": (31, "the trainer-side decisions: arguments and errors"),
}


def docstring_lengths() -> dict[str, int]:
    """``module`` and ``module.name`` (nested as ``module.Outer.inner``) -> lines of its docstring,
    for every module, class and function of the installed packages."""
    lengths = {}
    for module, path in product_modules().items():
        tree = ast.parse(path.read_text(), filename=str(path))

        def visit(node: ast.AST, name: str) -> None:
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                lengths[name] = len(doc.splitlines())
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit(child, f"{name}.{child.name}")

        visit(tree, module)
    return lengths


def test_no_docstring_over_the_limit():
    lengths = docstring_lengths()
    over = {name: n for name, n in lengths.items() if n > LIMIT and name not in KNOWN}
    grown = {name: (lengths[name], cap) for name, (cap, _) in KNOWN.items() if lengths.get(name, 0) > cap}
    assert not over, (f"docstrings over {LIMIT} lines (contracts only: move measurements and history to docs/, "
                      f"or justify in KNOWN): {over}")
    assert not grown, f"KNOWN docstrings grew past their recorded length (now, recorded): {grown}"


def test_every_known_docstring_is_still_over_the_limit():
    lengths = docstring_lengths()
    stale = {name: lengths.get(name) for name in KNOWN if lengths.get(name, 0) <= LIMIT}
    assert not stale, f"no longer over {LIMIT} lines (or gone): drop from KNOWN: {stale}"


if __name__ == "__main__":
    for name, n in sorted(docstring_lengths().items(), key=lambda kv: -kv[1]):
        if n > LIMIT:
            print(n, name)
