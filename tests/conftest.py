"""Fixtures for tests/unit and tests/distributed; shared plain code lives in tests/helpers.

Markers (registered in pyproject.toml): ``slow`` for tests over ~10 s, by hand; ``gpu`` for tests
that need CUDA, by hand (skipped, never passed, without a GPU); ``multiprocess`` for
tests that start several processes, never by hand: the launcher fixtures below mark every test that
uses them, directly or through another fixture (``@launcher``):

- ``run_distributed``: forks gloo ranks from the fork server (``megalite.testing.run_distributed``);
- ``launch``: runs a command that starts processes of its own to the end (torchrun, a launch script, a
  tool that runs torchrun, megatron-core's oracle interpreter): ``subprocess.run``;
- ``torchrun_job``: starts a torchrun job in the background (``tests.helpers.faults.Job``) and kills
  what is left of it when the test ends.

A test not marked multiprocess that forks gloo ranks anyway (say through code that calls
``megalite.testing.run_distributed`` itself) fails, naming the fixture to take.

The repository root is put on sys.path once here, so ``import pretrain_gpt``, ``from tools import ...``
and ``import tests.helpers`` work in any test; so is benchmarks/, whose scripts import their helper
module as ``common`` (they run as ``python benchmarks/x.py``) and which test_planner.py imports
(``benchmarks.bench_plan``).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Callable, Set

import pytest

from tests.helpers import REPO

for _path in (str(REPO), str(REPO / "benchmarks")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

LAUNCHERS: Set[str] = set()  # the fixtures that start processes: their tests are marked multiprocess


def launcher(scope: str = "session") -> Callable:
    """Declare a fixture that starts processes: every test that uses it is marked ``multiprocess``."""

    def declare(fn: Callable) -> Callable:
        LAUNCHERS.add(fn.__name__)
        return pytest.fixture(scope=scope)(fn)

    return declare


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marker
def pytest_collection_modifyitems(items):
    no_gpu = None
    for item in items:
        if LAUNCHERS.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.multiprocess)
        if item.get_closest_marker("gpu") is not None:
            if no_gpu is None:
                import torch

                no_gpu = not torch.cuda.is_available()
            if no_gpu:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (marker gpu)"))


@launcher()
def run_distributed():
    """``run_distributed(fn, world, *args, tp=, pp=, cp=, ep=, etp=)``: ``fn(ps, *args)`` on ``world`` gloo
    ranks forked from the fork server; the results in rank order."""
    from megalite.testing import run_distributed as run

    return run


@launcher()
def launch():
    """``launch(args, **kwargs)``: ``subprocess.run`` of a command that starts several processes itself."""
    return subprocess.run


@launcher(scope="function")
def torchrun_job(tmp_path):
    """``torchrun_job(name, nproc, extra=(), launcher=())``: a background torchrun job of pretrain_gpt.py
    (``tests.helpers.faults.Job``, its output in tmp_path); what is left of it is killed at teardown."""
    from tests.helpers.faults import Job

    jobs = []

    def start(name, nproc, extra=(), launcher=()):
        jobs.append(Job(tmp_path, name, nproc, extra, launcher))
        return jobs[-1]

    yield start
    for job in jobs:
        job.kill()


@pytest.fixture(autouse=True)
def _gloo_ranks_only_through_the_launcher(request, monkeypatch):
    """Outside tests marked multiprocess the fork server starts no rank: such a test takes ``run_distributed``
    (or ``@pytest.mark.usefixtures("run_distributed")`` when code it calls forks them), which marks it."""
    if request.node.get_closest_marker("multiprocess") is None:
        from megalite.testing import multiprocess as harness

        def refuse(*args, **kwargs):
            raise AssertionError(
                f"{request.node.nodeid} forks gloo ranks but is not marked multiprocess: take the "
                "run_distributed fixture (tests/conftest.py), which marks it"
            )

        monkeypatch.setattr(harness._CTX, "Process", refuse)


@pytest.fixture(scope="module")
def gpt2_reference():
    """The one-process GPT-2-style run (tiny_config, REFERENCE_STEPS iterations) the TP x DP layouts reproduce."""
    from tests.helpers.parity import GPT2_STYLE, REFERENCE_STEPS, reference_run, tiny_config

    return reference_run(tiny_config(GPT2_STYLE), REFERENCE_STEPS)


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
