"""Run a function on N gloo processes, each with its own ParallelState: the launcher of the
multi-process tests (tests/distributed) and of the benchmarks.

Workers are forked from a fork server that imported torch once and ran no
torch op (about 2 s for 8 ranks instead of ~15 s with spawn), so tests can use
many small process groups. The function must be importable (module level);
it receives (ps, *args) and its return value comes back, one per rank.
It lives in the package, not under tests/, because the benchmarks (run as plain
scripts) use it too; it imports no test framework.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable, List, Optional

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "megalite.parallel.state", "megalite.training"])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process group's init_method)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world: int,
    port: int,
    tp: int,
    pp: int,
    cp: int,
    fn: Callable,
    args: tuple,
    queue,
    experts: Optional[dict] = None,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch

        torch.set_num_threads(1)
        from megalite.parallel.state import ParallelState

        ps = ParallelState.init_for_test(rank, world, f"tcp://127.0.0.1:{port}", tp=tp, pp=pp, cp=cp, **(experts or {}))
        result = fn(ps, *args)
        ps.destroy()
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_distributed(
    fn: Callable,
    world: int,
    *args: Any,
    tp: int = 1,
    pp: int = 1,
    timeout: float = 300.0,
    cp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    experts: bool = False,
) -> List[Any]:
    """Run ``fn(ps, *args)`` on ``world`` ranks; return the results ordered by rank.

    Each rank is a forked process with one thread and a gloo ParallelState of the given tp, pp and
    cp (dp = world / (tp * pp * cp)), and for mixtures of experts the expert grid's ep and etp (None:
    the same as tp) with its groups; ``experts`` asks for those groups at ep 1 and etp tp too (a model
    with experts needs them). A rank that raises fails the call with an AssertionError carrying its
    traceback; ``timeout`` bounds the wait for each rank's result.
    """
    port = free_port()
    queue = _CTX.Queue()
    moe = experts or (ep, etp) != (1, None)
    experts_kw = {"ep": ep, "etp": etp, "experts": True} if moe else None  # dense: the old signature
    procs = [
        _CTX.Process(target=_worker, args=(r, world, port, tp, pp, cp, fn, args, queue, experts_kw))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
