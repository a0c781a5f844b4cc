"""Why a job stopped, said once for the whole job, whichever rank gets there first.

Several ranks often find the same problem (a bad flag on every rank, a damaged shard read by each data
parallel replica), and the rank picked to say it may be the slow one: once any rank exits, torchrun
stops the others, so a line left to rank 0 is lost when rank 1 exits first, while a line said by
every rank is N copies (two of them, written in pieces, glued on one line). Under torchrun the ranks
share its store from their first line on (``parallel.state.job_store``)::

    a rank that knows why     claims CLAIM (an atomic add); the first one writes the line, in one
                              write, then sets SAID; every other rank waits for SAID, then exits
    a rank that only follows  (it stops because another rank failed) waits for SAID, then exits

The waits are bounded (``wait_s``): a rank never stays because the rank that should speak died.
Without torchrun's store (one process, a test harness, another launcher) each rank decides alone:
it writes when it is the ``chosen`` one (rank 0 for an error every rank finds).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

from megalite.parallel.state import job_store

CLAIM, SAID = "stop_line/claim", "stop_line/said"

StoreFactory = Callable[[], Optional["dist.Store"]]


def write_line(line: str) -> None:
    """``line`` and its newline on stderr in one write, so lines of ranks sharing the stream never
    interleave (a stream replaced by a test runner, without a file descriptor, gets a plain write)."""
    stream = sys.stderr
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        stream.write(line + "\n")
        stream.flush()
        return
    stream.flush()  # what this rank wrote before stays before the line
    os.write(fd, (line + "\n").encode())


def say_stop(
    line: str,
    *,
    knows: bool = True,
    chosen: bool = True,
    wait_s: float = 10.0,
    store: StoreFactory = job_store,
) -> bool:
    """Say ``line``, why the job stops, once for the whole job; True when this rank wrote it.

    ``knows``: this rank found the problem itself (False: it stops because another rank did, and only
    waits for that rank's line). ``chosen``: without a shared store, this rank is the one that writes
    (with one, the first rank that knows writes and ``chosen`` is not used). See the module docstring.
    """
    shared = store()
    if shared is None:
        if knows and chosen:
            write_line(line)
        return knows and chosen
    try:
        if knows and shared.add(CLAIM, 1) == 1:
            write_line(line)
            shared.set(SAID, "1")
            return True
        shared.wait([SAID], timedelta(seconds=wait_s))  # the writer's line is out before this rank exits
    except (RuntimeError, ValueError, OSError):  # the store failed or the writer never wrote: say it here
        if knows:
            write_line(line)
            return True
    return False


def already_said(store: StoreFactory = job_store) -> bool:
    """Whether a rank of this job has already said why it stops (then a consequence, such as the SIGTERM
    torchrun sends the survivors, needs no line of its own). False without a shared store."""
    shared = store()
    if shared is None:
        return False
    try:
        return bool(shared.check([SAID]))
    except (RuntimeError, ValueError, OSError):
        return False
