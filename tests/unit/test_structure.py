"""The package's shape (README, Architecture; DESIGN.md): no import cycles, the runtime apart from the rooms
that plan, convert or compose it, small functions.

The runtime is what a training step executes. It is derived from the package, not listed: every module of
megalite outside the declared non-runtime rooms (``NOT_RUNTIME``), so a new package or module is runtime
(and checked) from the day it is added. The rooms outside it:

- ``megalite.analysis``: simulator, balancing, planner, divergence; it may import the runtime, never the
  reverse;
- ``megalite.interop``: readers and writers of other projects' files (Hugging Face, Megatron-LM), which
  register as load sources, so the run's own load path never imports them;
- ``megalite.training``: the composition root; the Trainer wires the runtime to the checkpoint formats
  (interop's included), the plan check and the measured balance (analysis);
- ``megalite.inference``: generation and evaluation from a checkpoint of any format (tools/generate.py,
  tools/evaluate.py), not a training step;
- ``megalite.testing``: the gloo fork-server harness of the tests and benchmarks.

Observability stays runtime, diagnosis included: the ranks of a hung job run it (hang_watch prints the
diagnosis), as tools/diagnose.py does afterwards.

Functions (methods and nested functions included, measured from ``def`` to their last line) stay under
FUNCTION_CAP lines: DESIGN.md's about 50, cap 80.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megalite"
NOT_RUNTIME = ("megalite.analysis", "megalite.interop", "megalite.training", "megalite.inference", "megalite.testing")
FUNCTION_CAP = 80


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> Dict[str, Set[str]]:
    """Every megalite module -> the megalite modules it imports anywhere in its body (functions included)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: Dict[str, Set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for t in targets:  # the longest prefix that is a module of ours
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != name and t != "megalite":
                    deps.add(t)
        graph[name] = deps
    return graph


def _in(module: str, rooms) -> bool:
    """``module`` is one of ``rooms`` or inside one of them (``megalite.interop`` holds ``megalite.interop.hf``)."""
    return any(module == room or module.startswith(room + ".") for room in rooms)


def _runtime(graph: Dict[str, Set[str]]) -> List[str]:
    return sorted(m for m in graph if m != "megalite" and not _in(m, NOT_RUNTIME))


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _runtime_imports_of(room: str) -> List[tuple]:
    graph = _imports()
    return [(m, d) for m in _runtime(graph) for d in sorted(graph[m]) if _in(d, [room])]


def test_no_import_cycles_even_inside_functions():
    assert _cycles(_imports()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_runtime_is_the_package_but_its_declared_rooms():
    graph = _imports()
    runtime = _runtime(graph)
    assert [room for room in NOT_RUNTIME if room not in graph] == []  # a renamed room must not go unchecked
    core = [
        "megalite.model",
        "megalite.tensor_parallel",
        "megalite.pipeline",
        "megalite.optim",
        "megalite.data_parallel",
        "megalite.checkpointing",
        "megalite.data",
        "megalite.parallel.state",
        "megalite.config",
        "megalite.observability.logging",
        "megalite.parallel.agreement",
    ]
    assert [m for m in core if m not in runtime] == []


def test_runtime_never_imports_analysis():
    assert _runtime_imports_of("megalite.analysis") == []


def test_runtime_never_imports_interop():
    assert _runtime_imports_of("megalite.interop") == []


def test_library_functions_stay_small():
    long = {
        f"{p.relative_to(REPO)}:{node.lineno} {node.name}": size
        for p in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (size := node.end_lineno - node.lineno + 1) > FUNCTION_CAP
    }
    assert long == {}


def _config_error_raises() -> List[str]:
    """``file:line`` of every ``raise ConfigError(...)`` in the library outside megalite/config/."""
    out = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "config":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id == "ConfigError":
                    out.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return sorted(out)


def test_flag_errors_are_raised_from_the_config_package_only():
    """A bad flag is one ConfigError line, and every one comes from megalite/config/ (checks.py holds the
    few that need the world, the device or the data), so the rules live in one package."""
    assert _config_error_raises() == []
