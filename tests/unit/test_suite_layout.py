"""The test suite's own rules (tests/conftest.py, tests/helpers): no test module imports another (what two
share lives in tests/helpers), and the gloo ranks come from the ``run_distributed`` fixture, which marks the
test multiprocess, never from an import of megalite.testing's launcher."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import List, Tuple

TESTS = Path(__file__).resolve().parents[1]


def _imports() -> List[Tuple[str, str, List[str]]]:
    """(test module, imported module, imported names) for every import in tests/ outside tests/helpers."""
    out = []
    for path in sorted(TESTS.rglob("*.py")):
        if "helpers" in path.relative_to(TESTS).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                out.append((str(path.relative_to(TESTS)), node.module, [a.name for a in node.names]))
            elif isinstance(node, ast.Import):
                out += [(str(path.relative_to(TESTS)), a.name, []) for a in node.names]
    return out


def test_no_test_module_imports_another():
    imported = [
        (where, module)
        for where, module, _ in _imports()
        if module.startswith("tests.") and not (module == "tests.helpers" or module.startswith("tests.helpers."))
    ]
    assert imported == []


def test_gloo_ranks_come_from_the_fixture():
    launcher = [
        (where, module)
        for where, module, names in _imports()
        if module.startswith("megalite.testing") and "run_distributed" in names and where != "conftest.py"
    ]
    assert launcher == []
