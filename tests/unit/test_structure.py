"""The package's shape (README, Architecture): no import cycles, runtime apart from analysis, small files."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megalite"
RUNTIME = ("megalite.model", "megalite.tensor_parallel", "megalite.pipeline", "megalite.optim",
           "megalite.data_parallel", "megalite.checkpointing", "megalite.data", "megalite.parallel_state",
           "megalite.config", "megalite.logging", "megalite.agreement")


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
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
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


def test_no_import_cycles_even_inside_functions():
    assert _cycles(_imports()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_runtime_never_imports_analysis():
    graph = _imports()
    offenders = [(m, d) for m, deps in graph.items() if m.startswith(RUNTIME) for d in deps
                 if d.startswith("megalite.analysis")]
    assert offenders == []


def test_library_files_stay_small():
    big = {str(p.relative_to(REPO)): n for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 450}
    assert big == {}
