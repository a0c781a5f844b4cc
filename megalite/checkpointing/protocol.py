"""The atomic directory protocol every save follows, and the readers of its two markers.

::

    SAVE/iter_0000100.tmp/    every rank writes its files here (stale .tmp/.old dirs of killed saves removed first)
    SAVE/iter_0000100/        the .tmp directory renamed once every rank is done (an existing one moved to .old
                              first, so the same iteration saved again stays loadable until replaced)
    SAVE/latest_checkpointed_iteration.txt   written last, through a temporary file and a rename
    SAVE/.megalite_lock       the run that saves here (save_lock.py): a second run is refused

Files and directories are fsynced before the rename that publishes them, so a
crash at any point leaves the previous checkpoint and ``latest`` intact. Every
rank reads back a marker rank 0 wrote into the ``.tmp`` directory before anyone
writes a file: nodes that do not share ``SAVE`` are refused at the first save.
An OSError (a full disk) is one CheckpointError line on every rank, never a
half-published checkpoint. ``latest`` holding anything but ASCII digits (or
Megatron's ``release``) is one line naming the file.
Retention (``--ckpt-keep-last``) runs after ``latest`` names the new one and never
deletes the checkpoint ``latest`` names. What goes inside a directory is the
formats' business (``sharded.py``, ``torch_format.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from megalite.checkpointing.safe_load import CheckpointError
from megalite.checkpointing.save_lock import ensure_save_lock
from megalite.parallel.agreement import flag_on_any_rank, lowest_rank_with
from megalite.parallel.state import ParallelState

LATEST = "latest_checkpointed_iteration.txt"

__all__ = [
    "LATEST",
    "MARKER",
    "agree_on_error",
    "iteration_dir",
    "read_latest",
    "read_latest_text",
    "saved_iterations",
    "begin_save",
    "publish_save",
    "write_json",
    "save_synced",
    "read_json",
    "fsync_dir",
    "prune",
]


def agree_on_error(ps: ParallelState, error: Optional[CheckpointError]) -> None:
    """Before the next collective of a load: raise on every rank if any rank failed (that rank's own
    line; a quiet pointer to it elsewhere), so no rank goes on while another stopped (collective)."""
    failed = flag_on_any_rank(error is not None, ps)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(
            "another rank could not read this checkpoint (its error is printed above); "
            "check --load and the model flags",
            report=False,
        )


def iteration_dir(root: str, iteration: int) -> str:
    """The directory of iteration ``iteration`` under ``root`` (``iter_0000100``, Megatron's naming)."""
    return os.path.join(root, f"iter_{iteration:07d}")


def read_latest_text(root: str) -> Optional[str]:
    """What ``latest_checkpointed_iteration.txt`` says: ASCII digits or ``release`` (Megatron's), None when
    there is no such file; anything else (binary, other digits, empty, huge, a directory) is one CheckpointError."""
    path = os.path.join(root, LATEST)
    if not os.path.lexists(path):
        return None
    fix = "write the iteration to resume from into it, or pick one with --ckpt-step"
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a directory, not a file holding an iteration number; {fix}")
    try:
        with open(path, "rb") as f:
            raw = f.read(_LATEST_MAX + 1)
    except OSError as e:
        raise CheckpointError(f"cannot read {path} ({e.strerror or e}); {fix}") from None
    text = raw.strip()
    if text == b"release" or (0 < len(text) <= 12 and all(48 <= c <= 57 for c in text)):
        return text.decode()
    if not raw.strip():
        found = "nothing (the file is empty)"
    elif len(raw) > _LATEST_MAX:
        found = f"{len(raw)}+ bytes"
    else:
        try:
            found = repr(raw.decode("utf-8")[:40])
        except UnicodeDecodeError:
            found = f"binary bytes {raw[:20]!r}"
    raise CheckpointError(f"{path} should hold an iteration number (ASCII digits), found {found}; {fix}")


_LATEST_MAX = 64  # Megatron writes the bare number; anything longer is not one


def read_latest(root: str) -> Optional[int]:
    """The iteration ``latest_checkpointed_iteration.txt`` names, or None when there is none."""
    text = read_latest_text(root)
    if text == "release":
        raise CheckpointError(
            f"{os.path.join(root, LATEST)} names a Megatron-LM release checkpoint; convert it "
            f"with tools/checkpoint/convert.py --loader megatron"
        )
    return None if text is None else int(text)


def saved_iterations(root: str) -> List[str]:
    """The seven-digit iteration numbers of the complete (renamed) directories under ``root``, sorted."""
    if not os.path.isdir(root):
        return []
    return sorted(x[5:] for x in os.listdir(root) if x.startswith("iter_") and x[5:].isascii() and x[5:].isdigit())


def begin_save(root: str, iteration: int, ps: ParallelState) -> str:
    """Create the temporary directory every rank writes ``iteration`` into (collective); returns its path.

    Rank 0 first removes the ``.tmp``/``.old`` directories of saves killed earlier, then writes a
    marker into the new one that every rank must read back: nodes that do not share ``root`` are
    refused here, before any rank writes a shard. Only one run saves into ``root`` (save_lock.py).
    """
    ensure_save_lock(root, ps)
    tmp = iteration_dir(root, iteration) + ".tmp"
    token, error = int.from_bytes(os.urandom(6), "little"), None
    if ps.rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            for stale in os.listdir(root):
                if stale.startswith("iter_") and stale.endswith((".tmp", ".old")):
                    shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
            os.makedirs(tmp)
            with open(os.path.join(tmp, MARKER), "w") as f:
                f.write(str(token))
        except OSError as e:
            error = _os_error(f"cannot start the checkpoint of iteration {iteration} in {root}", e)
    _agree(error, ps, f"rank 0 could not start the checkpoint in {root}")
    _check_shared(root, tmp, token, ps)
    return tmp


MARKER = ".megalite_save_marker"  # rank 0's token in iter_N.tmp: every rank must read it back


def _os_error(what: str, e: OSError) -> CheckpointError:
    return CheckpointError(
        f"{what}: {e.strerror or e}{' (' + e.filename + ')' if e.filename else ''}; free space "
        f"or fix the directory, then resume (the previous checkpoint and latest are intact)"
    )


def _agree(error: Optional[CheckpointError], ps: ParallelState, follower: str) -> None:
    """Raise ``error`` where it happened and a quiet CheckpointError on the other ranks (acts as a barrier)."""
    failed = flag_on_any_rank(error is not None, ps)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{follower} (its error is printed above)", report=False)


def _check_shared(root: str, tmp: str, token: int, ps: ParallelState) -> None:
    """Every rank reads back rank 0's marker; a rank that cannot sees another directory than rank 0."""
    try:
        with open(os.path.join(tmp, MARKER)) as f:
            seen = int(f.read().strip())
    except (OSError, ValueError):
        seen = -1
    t = torch.tensor([float(token) if ps.rank == 0 else 0.0], dtype=torch.float64, device=ps.device)
    if ps.world_size > 1 and dist.is_initialized():
        dist.all_reduce(t)  # rank 0's token, known everywhere
    blind = lowest_rank_with(seen != int(t.item()), ps)
    if blind is None:
        return
    what = (
        f"the files rank 0 wrote into {tmp}: --save {root} must be one directory shared by every node "
        f"(a shared file system); nothing was saved"
    )
    if blind == ps.rank or seen != int(t.item()):
        raise CheckpointError(f"rank {ps.rank} ({socket.gethostname()}) does not see {what}")
    raise CheckpointError(f"rank {blind} does not see {what}", report=ps.rank == 0)


def publish_save(root: str, iteration: int, ps: ParallelState, keep_last: Optional[int] = None) -> str:
    """Publish the temporary directory of ``iteration`` once every rank wrote its files (collective).

    Rank 0 renames it into place, then writes ``latest`` (last), then prunes to the
    newest ``keep_last``. Returns the final directory.
    """
    final, error = iteration_dir(root, iteration), None
    ps.barrier()  # every rank's files are in tmp
    if ps.rank == 0:
        try:
            old = final + ".old"
            if os.path.lexists(os.path.join(final + ".tmp", MARKER)):
                os.remove(os.path.join(final + ".tmp", MARKER))
            if os.path.exists(final):  # saving the same iteration again: it stays loadable until replaced
                os.replace(final, old)
            os.replace(final + ".tmp", final)
            fsync_dir(root)
            _write_latest(root, iteration)
            shutil.rmtree(old, ignore_errors=True)
            if keep_last:
                prune(root, keep_last, iteration)
        except OSError as e:
            error = _os_error(f"cannot publish the checkpoint of iteration {iteration} in {root}", e)
    _agree(error, ps, f"rank 0 could not publish the checkpoint in {root}")
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
        raise CheckpointError(
            f"cannot read {path} ({e}); the checkpoint is damaged: load another iteration with --ckpt-step"
        ) from None


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
