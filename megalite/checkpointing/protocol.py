"""The atomic directory protocol every save follows, and the readers of its two markers.

::

    SAVE/iter_0000100.tmp/    every rank writes its files here (stale .tmp/.old dirs of killed saves removed first)
    SAVE/iter_0000100/        the .tmp directory renamed once every rank is done (an existing one moved to .old
                              first, so the same iteration saved again stays loadable until replaced)
    SAVE/latest_checkpointed_iteration.txt   written last, through a temporary file and a rename

Files and directories are fsynced before the rename that publishes them, so a
crash at any point leaves the previous checkpoint and ``latest`` intact.
Retention (``--ckpt-keep-last``) runs after ``latest`` names the new one and never
deletes the checkpoint ``latest`` names. What goes inside a directory is the
formats' business (``sharded.py``, ``torch_format.py``).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, List, Optional

import torch

from megalite.checkpointing.safe_load import CheckpointError
from megalite.parallel_state import ParallelState

LATEST = "latest_checkpointed_iteration.txt"

__all__ = ["LATEST", "iteration_dir", "read_latest", "saved_iterations", "begin_save", "publish_save",
           "write_json", "save_synced", "read_json", "fsync_dir", "prune"]


def iteration_dir(root: str, iteration: int) -> str:
    """The directory of iteration ``iteration`` under ``root`` (``iter_0000100``, Megatron's naming)."""
    return os.path.join(root, f"iter_{iteration:07d}")


def read_latest(root: str) -> Optional[int]:
    """The iteration ``latest_checkpointed_iteration.txt`` names, or None when there is none."""
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} should hold an iteration number, found {text[:40]!r}")
    return int(text)


def saved_iterations(root: str) -> List[str]:
    """The seven-digit iteration numbers of the complete (renamed) directories under ``root``, sorted."""
    if not os.path.isdir(root):
        return []
    return sorted(x[5:] for x in os.listdir(root) if x.startswith("iter_") and x[5:].isdigit())


def begin_save(root: str, iteration: int, ps: ParallelState) -> str:
    """Create the temporary directory every rank writes ``iteration`` into (collective); returns its path.

    Rank 0 first removes the ``.tmp``/``.old`` directories of saves killed earlier.
    """
    tmp = iteration_dir(root, iteration) + ".tmp"
    if ps.rank == 0:
        os.makedirs(root, exist_ok=True)
        for stale in os.listdir(root):
            if stale.startswith("iter_") and stale.endswith((".tmp", ".old")):
                shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
        os.makedirs(tmp)
    ps.barrier()
    return tmp


def publish_save(root: str, iteration: int, ps: ParallelState, keep_last: Optional[int] = None) -> str:
    """Publish the temporary directory of ``iteration`` once every rank wrote its files (collective).

    Rank 0 renames it into place, then writes ``latest`` (last), then prunes to the
    newest ``keep_last``. Returns the final directory.
    """
    final = iteration_dir(root, iteration)
    ps.barrier()  # every rank's files are in tmp
    if ps.rank == 0:
        old = final + ".old"
        if os.path.exists(final):  # saving the same iteration again: it stays loadable until replaced
            os.replace(final, old)
        os.replace(final + ".tmp", final)
        fsync_dir(root)
        _write_latest(root, iteration)
        shutil.rmtree(old, ignore_errors=True)
        if keep_last:
            prune(root, keep_last, iteration)
    ps.barrier()
    return final


def fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable (a no-op where the file system cannot sync a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot sync a directory
        pass
    finally:
        os.close(fd)


def write_json(path: str, obj: Any) -> None:
    """``json.dump`` to ``path``, fsynced."""
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save_synced(obj: Any, path: str) -> None:
    """``torch.save`` to ``path``, fsynced."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def read_json(path: str) -> Any:
    """A checkpoint's JSON file; unreadable or damaged is one CheckpointError line."""
    try:
        with open(path) as f:
            return json.load(f)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"cannot read {path} ({e}); the checkpoint is damaged: load another iteration "
                              f"with --ckpt-step") from None


def _write_latest(root: str, it: int) -> None:
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(it))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    fsync_dir(root)


def prune(root: str, keep_last: int, latest: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints; never the one latest names."""
    its = sorted(int(d) for d in saved_iterations(root))
    for old in its[:-keep_last]:
        if old != latest:
            shutil.rmtree(iteration_dir(root, old), ignore_errors=True)
