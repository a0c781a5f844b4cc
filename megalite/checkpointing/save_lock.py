"""One run at a time saves into a ``--save`` directory: the lock file ``.megalite_lock`` in it.

Global rank 0 creates it when the run's Checkpointer is built (and at the latest when the first
save begins), holding an exclusive ``flock`` on it for the life of the process, and writes who holds
it: ``{"host", "pid", "started", "run_id"}``. A second run finds the file locked, or naming a live
process, and is refused in one line naming that host and pid. The lock is free when

- its ``flock`` can be taken: the holder died, however it died (the kernel drops the lock);
  where the file system cannot ``flock``, when the file names this host and a pid that is gone;
- it is this process's own (a tool or test that builds several runs in one process);
- where the file system cannot ``flock``: it names the same ``TORCHELASTIC_RUN_ID`` (torchrun
  --max-restarts: the next round of the same job; with ``flock`` that round finds the lock free anyway,
  because torchrun stops every worker of a round before it starts the next).

A lock left by a run that is gone is taken over with a warning. The file is removed at a normal
exit; an exit by signal leaves it behind, free for the next run to take over.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import os
import socket
import time
from typing import Dict, Optional, Tuple

from megalite.checkpointing.safe_load import CheckpointError
from megalite.parallel.agreement import flag_on_any_rank
from megalite.parallel.state import ParallelState

LOCK_FILE = ".megalite_lock"
logger = logging.getLogger("megalite")

__all__ = ["LOCK_FILE", "ensure_save_lock", "acquire_save_lock", "release_save_locks"]

_held: Dict[str, Tuple[int, dict]] = {}  # realpath(root) -> (fd, what the file says); rank 0 only


def _run_id() -> Optional[str]:
    rid = os.environ.get("TORCHELASTIC_RUN_ID")
    return rid if rid and rid != "none" else None  # torchrun's default id is "none" for every job


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(owner: dict) -> str:
    return f"host {owner.get('host', '?')}, pid {owner.get('pid', '?')}, started {owner.get('started', '?')}"


def _pid_of(owner: dict) -> Optional[int]:
    try:
        pid = int(owner.get("pid"))
    except (TypeError, ValueError):
        return None
    return pid if pid > 0 else None


def _open_locked(path: str) -> Tuple[int, Optional[bool]]:
    """Open ``path`` and try its ``flock``: (fd, True locked / False held elsewhere / None no flock here).

    A holder removes the file at exit: a lock taken on a file that was meanwhile removed (or replaced)
    guards nothing, so the file is opened again until the locked one is the one in the directory."""
    for _ in range(10):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return fd, False
        except OSError as e:  # a file system without flock: judge by host and pid
            if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                os.close(fd)
                raise
            return fd, None
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd, True
        except FileNotFoundError:
            pass
        os.close(fd)
    raise OSError(errno.EAGAIN, "the lock file keeps being replaced")


def _try_lock(root: str) -> Tuple[int, dict, Optional[str]]:
    """Open and lock ``root``'s lock file: (fd, its previous content, why it is held or None)."""
    path = os.path.join(root, LOCK_FILE)
    os.makedirs(root, exist_ok=True)
    fd, flocked = _open_locked(path)
    try:
        try:
            owner = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
            owner = owner if isinstance(owner, dict) else {}
        except (ValueError, UnicodeDecodeError):
            owner = {}
        here = socket.gethostname()
        same_job = _run_id() is not None and owner.get("run_id") == _run_id()
        mine = owner.get("host") == here and owner.get("pid") == os.getpid()
        if flocked is False and not mine:
            held = "its holder is running"
        elif (
            flocked is None
            and owner
            and not (same_job or mine)
            and (owner.get("host") != here or _pid_of(owner) is None or _pid_alive(_pid_of(owner)))
        ):
            held = (
                "its holder may be running (this file system cannot lock files, so a lock of another host or "
                "of a live process counts)"
            )
        else:
            held = None
        return fd, owner, held
    except BaseException:
        os.close(fd)
        raise


def acquire_save_lock(root: str) -> None:
    """Take ``root``'s lock for this process (one process: global rank 0); CheckpointError when another run
    holds it."""
    key = os.path.realpath(root)
    if key in _held:
        return
    path = os.path.join(root, LOCK_FILE)
    try:
        fd, owner, held = _try_lock(root)
    except OSError as e:
        raise CheckpointError(
            f"cannot create the lock file {path} ({e.strerror or e}); give a writable --save"
        ) from None
    if held is not None:
        os.close(fd)
        raise CheckpointError(
            f"--save {root} is in use by another run ({_describe(owner)}; {held}): two runs "
            f"saving into one directory would destroy each other's checkpoints; give another "
            f"--save, or stop that run (remove {path} only if it is certainly gone)"
        )
    me = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "run_id": _run_id(),
    }
    if owner and not (owner.get("host") == me["host"] and owner.get("pid") == me["pid"]):
        same_job = _run_id() and owner.get("run_id") == _run_id()
        how = "the same torchrun job restarted" if same_job else "that run is gone"
        logger.warning(f"taking over the lock {path} of {_describe(owner)}: {how}")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
    except OSError as e:
        os.close(fd)
        raise CheckpointError(
            f"cannot write the lock file {path} ({e.strerror or e}); free space or give a writable --save"
        ) from None
    _held[key] = (fd, me)


def ensure_save_lock(root: str, ps: ParallelState) -> None:
    """Every rank: make sure rank 0 holds ``root``'s lock, taking it if it does not (one all-reduce);
    a refusal is raised on every rank (rank 0's says why, the others' are quiet)."""
    error = None
    if ps.rank == 0:
        try:
            acquire_save_lock(root)
        except CheckpointError as e:
            error = e
    if flag_on_any_rank(error is not None, ps):
        raise error or CheckpointError(
            f"rank 0 could not lock --save {root} (its error is printed above)", report=False
        )


def release_save_locks() -> None:
    """Remove the lock files this process holds (at exit): only while they still name this process."""
    for key, (fd, me) in list(_held.items()):
        try:
            path = os.path.join(key, LOCK_FILE)
            if json.loads(os.pread(fd, 4096, 0).decode() or "{}") == me and os.path.exists(path):
                os.remove(path)
        except (OSError, ValueError):
            pass
        finally:
            os.close(fd)
            _held.pop(key, None)


atexit.register(release_save_locks)
