"""A save in two phases: a snapshot in the training thread, then the writes (here or in the background).

::

    start_save()    main thread, collective: iter_N.tmp created; the format (formats.Format.snapshot)
                    takes weights and optimizer state, the run its counters, schedule, scaler and
                    random states -- views of the live tensors for a synchronous save, copies in host
                    memory (pinned on CUDA) for --async-save; the torch format's DP gather happens
                    here too. Returns a SaveJob.
    SaveJob.run()   the writes: the format's files, meta.json (rank 0); in a daemon thread with
                    --async-save. A format's collective (the sharded format's
                    torch.distributed.checkpoint) then runs over a gloo group of its own
                    (Format.background_group), so it never meets a training collective.
    conclude()      main thread, collective: every rank agrees that every write succeeded, then
                    protocol.publish_save renames iter_N.tmp and writes ``latest``. Any failure
                    (a full disk, any OSError, a writer's exception) is one CheckpointError line on
                    every rank, and ``latest`` keeps naming the previous checkpoint.

``Checkpointer.poll`` (one tiny all-reduce per iteration while a save is in flight) decides on
every rank at the same iteration that all writes finished; ``Checkpointer.wait`` joins first.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
from typing import TYPE_CHECKING, Callable, Optional

import torch

from megalite.checkpointing.protocol import LATEST, begin_save, publish_save, write_json
from megalite.checkpointing.run_state import RandomStates, run_meta
from megalite.checkpointing.safe_load import CheckpointError
from megalite.parallel.agreement import flag_on_any_rank
from megalite.parallel.state import ParallelState

if TYPE_CHECKING:
    from megalite.checkpointing.formats import Format
    from megalite.checkpointing.run import RunParts

logger = logging.getLogger("megalite")
__all__ = ["SaveJob", "start_save", "conclude", "to_host", "save_failed"]


def to_host(obj, pin: bool = False, pool: Optional[dict] = None, path: tuple = ()):
    """A copy of ``obj`` whose tensors are contiguous CPU tensors (pinned with ``pin``); other values kept.

    ``pool`` (path in ``obj`` -> tensor) keeps the host buffers between saves: a buffer of the same
    shape and dtype is reused (no allocation, no page faults), so a snapshot is one memory copy.
    """
    if torch.is_tensor(obj):
        out = pool.get(path) if pool is not None else None
        if out is None or out.shape != obj.shape or out.dtype != obj.dtype:
            out = torch.empty(obj.shape, dtype=obj.dtype, device="cpu", pin_memory=pin)
            if pool is not None:
                pool[path] = out
        return out.copy_(obj.detach(), non_blocking=pin)
    if isinstance(obj, dict):
        return {k: to_host(v, pin, pool, path + (k,)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v, pin, pool, path + (i,)) for i, v in enumerate(obj))
    return obj


def _root_cause(e: BaseException) -> BaseException:
    """The error under torch.distributed.checkpoint's wrappers (CheckpointException keeps each rank's)."""
    for _ in range(8):
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict) and failures:
            first = next(iter(failures.values()))
            inner = first[0] if isinstance(first, tuple) else getattr(first, "exc", first)
            if not isinstance(inner, BaseException):
                break
            e = inner
        elif e.__cause__ is not None:
            e = e.__cause__
        else:
            break
    return e


_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# torch.save's zip writer (caffe2's PyTorchStreamWriter) reports a short write without its errno:
# "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598" or "... failed writing file
# data/0: file write failed". On a local or network disk a short write is the disk (or quota) filling.
_SHORT_WRITE = re.compile(r"inline_container\.cc.*(unexpected pos \d+ vs \d+|file write failed)")


def _out_of_space(e: BaseException) -> bool:
    """True when ``e`` (or what it was raised from or during) says the disk or the quota is full."""
    for _ in range(8):
        if isinstance(e, OSError) and e.errno in _SPACE_ERRNOS:
            return True
        if _SHORT_WRITE.search(str(e)):
            return True
        nxt = e.__cause__ or e.__context__
        if nxt is None:
            return False
        e = nxt
    return False


def save_failed(root: str, iteration: int, error: Optional[BaseException]) -> CheckpointError:
    """The one line every rank raises when a save failed (``error``: this rank's, None: another rank's)."""
    where = f"saving the checkpoint of iteration {iteration} to {root} failed"
    tail = (
        f"; {LATEST} still names the previous checkpoint, if any (free space or fix --save, then resume "
        f"with --load {root})"
    )
    if error is None:
        return CheckpointError(f"{where} on another rank (its error is printed there){tail}")
    e = _root_cause(error)
    if isinstance(e, OSError) and e.strerror:
        what = f"{e.strerror}" + (f": {e.filename}" if e.filename else "")
    elif _out_of_space(e):  # torch's own words ("enforce fail at inline_container.cc") mean nothing to a user
        what = "No space left on device: torch.save could not write all of a checkpoint file"
    else:
        what = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200] or type(e).__name__
    return CheckpointError(f"{where} ({what}){tail}")


class SaveJob:
    """One save after its snapshot: ``write`` writes this rank's files; ``error`` holds what it raised."""

    def __init__(self, root: str, iteration: int, fmt: str, keep_last: Optional[int], write: Callable[[], None]):
        self.root, self.iteration, self.fmt, self.keep_last = root, iteration, fmt, keep_last
        self.write = write
        self.error: Optional[BaseException] = None
        self.thread: Optional[threading.Thread] = None

    def run(self, background: bool = False) -> None:
        """Write now, or in a daemon thread (``background``)."""
        if background:
            self.thread = threading.Thread(target=self._run, name=f"megalite-save-{self.iteration}", daemon=True)
            self.thread.start()
        else:
            self._run()

    def _run(self) -> None:
        try:
            self.write()
        except BaseException as e:  # noqa: BLE001  (torch's CheckpointException is a BaseException)
            self.error = e
        finally:
            self.write = None  # drop the snapshot as soon as it is on disk

    @property
    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()


def start_save(
    run: "RunParts",
    root: str,
    fmt: "Format",
    keep_last: Optional[int],
    copy: bool = False,
    group=None,
    buffers: Optional[dict] = None,
) -> SaveJob:
    """The snapshot phase (collective): iter_N.tmp, every piece of state taken; the job that writes it.

    ``fmt`` (a run format of the registry) takes the state and returns its writer. ``copy``
    (--async-save) copies the state into host memory so training may go on (into ``buffers``, kept
    from the previous save when given: the caller makes sure no write still reads them); ``group``
    is the process group the format's background collective uses.
    """
    ps, name = run.ps, fmt.info.name
    it = run.train_state.iteration
    tmp = begin_save(root, it, ps)  # a failure there is already one CheckpointError on every rank
    run.optimizer.finish_param_gather()
    pin = copy and torch.cuda.is_available()
    pool = {} if buffers is None else buffers
    keep = (lambda x, key: to_host(x, pin, pool, (name, key))) if copy else (lambda x, key: x)
    meta = {**run_meta(run.cfg, ps, run.optimizer, run.scheduler, run.train_state), "format": name}
    rng = to_host(RandomStates(run.rng_tracker, run.model_parts).state_dict())
    error: Optional[BaseException] = None
    write: Optional[Callable[[], None]] = None
    try:  # a host copy that fails on one rank (out of memory) must not leave the others writing
        write = fmt.snapshot(run, tmp, meta, rng, keep, copy, group)
        if pin:
            torch.cuda.synchronize()  # the copies into pinned memory are complete before training changes anything
    except (RuntimeError, MemoryError, OSError) as e:
        error = e
    if flag_on_any_rank(error is not None, ps):
        raise save_failed(root, it, error)

    def write_all() -> None:
        write()
        if ps.rank == 0:
            write_json(os.path.join(tmp, "meta.json"), meta)

    return SaveJob(root, it, name, keep_last, write_all)


def conclude(job: SaveJob, ps: ParallelState) -> str:
    """After every rank's write returned: agree on success, then publish (collective); returns the directory.

    A failure on any rank raises the same kind of one-line CheckpointError on every rank.
    """
    job.join()
    if flag_on_any_rank(job.error is not None, ps):
        raise save_failed(job.root, job.iteration, job.error)
    final = publish_save(job.root, job.iteration, ps, job.keep_last)  # its failures: one line on every rank
    logger.info(f"saved checkpoint at iteration {job.iteration} to {job.root} ({job.fmt} format)")
    return final
