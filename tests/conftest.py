"""Shared by tests/unit and tests/distributed: the repository path and the tiny pretrain_gpt.py
flag lists. Markers (registered in pyproject.toml): ``slow`` for tests over ~10 s, ``multiprocess``
for tests that start several processes (the gloo fork-server harness, torchrun jobs, launch scripts).

Test modules import these names (``from tests.conftest import REPO, TINY_RUN``). The repository root is
put on sys.path once here, so ``import pretrain_gpt`` and ``from tools import ...`` work in any test; so
is benchmarks/, whose scripts import their helper module as ``common`` (they run as
``python benchmarks/x.py``) and which test_planner.py imports (``benchmarks.bench_plan``).
"""
from __future__ import annotations

import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
for _path in (str(REPO), str(REPO / "benchmarks")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

# The model every pretrain_gpt.py CLI test trains: 2 layers, hidden 32, 4 heads, sequence 16.
TINY_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
# A tiny mock-data run: vocabulary 200, micro-batch 2, global batch 8 (tests add iterations, logging, layout).
TINY_RUN = ["--mock-data", "--vocab-size", "200", *TINY_MODEL, "--micro-batch-size", "2", "--global-batch-size", "8"]


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """pretrain_gpt.main(--num-threads N) run in-process sets torch's process-wide thread count; later tests
    (half-precision curves compared within 2% are sensitive to the reduction order) must not inherit it."""
    import torch
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _megalite_logger_reset():
    """pretrain_gpt.main() configures the process-wide "megalite" logger for a run (its own handler,
    no propagation); tests that call it in-process must not change what later tests' caplog sees."""
    import logging
    yield
    logger = logging.getLogger("megalite")
    logger.handlers.clear()
    logger.propagate = True
    logger.setLevel(logging.NOTSET)
