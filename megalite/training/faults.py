"""How a run ends when something outside it intervenes: a signal, a dead launcher, a time limit.

::

    SIGTERM / SIGINT      default: one line (rank 0), every rank exits at once (128 + signal)
                          --exit-signal-handler: noted; at the end of the iteration all ranks agree
                          (one all-reduce), save a checkpoint and exit 0. A second signal exits at once.
    launcher gone         a rank started by torchrun whose parent died exits within a second
                          instead of training on as an orphan
    --exit-duration-in-mins   checked every iteration with the same all-reduce: save and exit 0

A hung or stopped rank is the process group's timeout (``--distributed-timeout-minutes``):
the waiting ranks' collectives fail and pretrain_gpt.py turns that into one line and exit 1, after
the hang watch (megalite.observability.hang_watch) has named the rank the job waits for. A job ended by a signal
(torchrun stopping the survivors of a dead rank) gets the same diagnosis before it exits.

In-job restart: under ``torchrun --max-restarts N`` a failed round (any rank exiting non-zero)
makes torchrun stop the others and start round ``TORCHELASTIC_RESTART_COUNT`` + 1, which forms
its process group on keys of its own (parallel_state.elastic_round_store) and resumes from
``--load``'s latest checkpoint. ``--inject-fault-at-iteration K --inject-fault-rank R
--inject-fault-kind kind`` makes rank R fail in iteration K, in round 0 only::

    kill         the rank dies (SIGKILL) as the iteration begins
    exception    it raises an error (one line, exit 1)
    hang         its first forward of the iteration computes without end inside its first layer (it still
                 answers the watch; its TP/CP/EP peers block in the layer's collectives)
    skip-send    its schedule for the iteration lacks its first send: a deadlock through a bad schedule
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional, Sequence

import torch

from megalite.observability.stop_line import already_said
from megalite.pipeline.actions import Comm

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_SAME_REQUEST_S = 2.0  # a second signal within this is the first one delivered twice


def _stderr(line: str) -> None:
    """One line straight to stderr, for a process about to exit (not the logger, and not print:
    a signal handler writing to a buffered stream the interrupted code was writing to raises a
    reentrancy error instead of exiting; the user's error goes to stderr, the log to stdout)."""
    os.write(2, (line + "\n").encode())


def _say(line: str) -> None:
    """One line on stderr from rank 0 only (every rank receives the same signal), unless another rank has
    already said why the job stops (torchrun's SIGTERM to the survivors of a lost rank is its consequence)."""
    if os.environ.get("RANK", "0") == "0" and not already_said():
        _stderr(line)


class ExitSignals:
    """SIGTERM/SIGINT handling for a training process (see the module docstring)."""

    def __init__(self, save_on_signal: bool):
        self.save_on_signal = save_on_signal
        self.received: Optional[int] = None
        self._first_at = 0.0
        self._previous = {}
        self.watch = None  # hang_watch.HangWatch: diagnoses a job ended by a signal before it exits
        self._exit_lock = threading.Lock()

    def install(self) -> "ExitSignals":
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread (e.g. under a test runner)
        for sig in _SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.save_on_signal and (self.received is None or now - self._first_at < _SAME_REQUEST_S):
            # Ctrl-C reaches a rank from the terminal and again from torchrun (SLURM likewise):
            # a repeat within a moment is the same request, not an order to exit at once.
            if self.received is None:
                self.received, self._first_at = signum, now
                _say(
                    f"pretrain_gpt.py: received {name}: saving a checkpoint at the end of this iteration, "
                    f"then exiting (send it again to exit at once; torchrun kills ranks 30 s after it "
                    f"forwards a signal)"
                )
            return
        if self.watch is not None and self.watch.busy_here():
            return  # this thread is diagnosing a failure (a peer died): it ends the process when done
        self.exit_now(signum)

    def exit_now(self, signum: int) -> None:
        """End the process for ``signum``: diagnose (hang watch), say it once, exit 128 + signum.
        Also called by the watch thread when the main thread is blocked in a wait."""
        self._exit_lock.acquire()  # the main thread and the watch thread: one of them exits
        name = signal.Signals(signum).name
        try:
            try:  # keep the log lines already printed; a flush interrupting a write may refuse
                sys.stdout.flush()
            except (RuntimeError, ValueError, OSError):
                pass
            if self.watch is not None:
                self.watch.before_exit(signum)
            _say(
                f"pretrain_gpt.py: received {name}: exiting without saving"
                + ("" if self.save_on_signal else " (--exit-signal-handler saves a checkpoint first)")
            )
        finally:
            os._exit(128 + signum)


class LauncherWatch:
    """This rank's launcher (its parent when the watch started) and the thread that exits the rank
    once the launcher has died (the rank was reparented)."""

    def __init__(self, poll_s: float = 0.5):
        self.launcher_pid = os.getppid()
        self.poll_s = poll_s
        self._said = threading.Lock()  # the line once: the watcher and a failed transfer may both notice
        self.thread = threading.Thread(target=self._watch, name="megalite-launcher-watch", daemon=True)

    def gone(self) -> bool:
        """True when this rank's launcher has died."""
        return os.getppid() != self.launcher_pid

    def say_gone(self) -> None:
        """The one line for a dead launcher; every rank of the node sees it, so local rank 0 says it."""
        if os.environ.get("LOCAL_RANK", "0") == "0" and self._said.acquire(blocking=False):
            _stderr(
                f"pretrain_gpt.py: rank {os.environ.get('RANK', '?')}: its launcher (pid {self.launcher_pid}) "
                f"is gone; exiting (and so do the node's other ranks)"
            )

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll_s)
            if self.gone():
                self.say_gone()
                os._exit(1)


def watch_launcher(poll_s: float = 0.5) -> Optional[LauncherWatch]:
    """Under torchrun, exit this rank when its launcher dies (the rank's parent process changes); the
    started watch, or None when torchrun did not start this rank."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    watch = LauncherWatch(poll_s)
    watch.thread.start()
    return watch


class ExitConditions:
    """Per-iteration stop requests other than the iteration count: a signal or the time limit."""

    def __init__(
        self, signals: Optional[ExitSignals], duration_mins: Optional[float], start_time: Optional[float] = None
    ):
        self.signals, self.duration_mins = signals, duration_mins
        self.start_time = time.time() if start_time is None else start_time

    def local_reason(self) -> Optional[str]:
        """Why this rank wants to stop now (None: it does not)."""
        if self.signals is not None and self.signals.received is not None:
            return f"received {signal.Signals(self.signals.received).name}"
        if self.duration_mins is not None and time.time() - self.start_time > 60.0 * self.duration_mins:
            return f"--exit-duration-in-mins {self.duration_mins:g} reached"
        return None

    @property
    def active(self) -> bool:
        return (self.signals is not None and self.signals.save_on_signal) or self.duration_mins is not None


def restart_round() -> int:
    """torchrun's restart round: 0 for the first start, n after n restarts (0 outside torchrun)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


class InjectedFault(Exception):
    """--inject-fault-kind exception: the error a rank raises (pretrain_gpt.py: one line, exit 1)."""


class ScheduleFault:
    """A fault inside the next executor run (it sets ``executor.fault``; the run clears it)."""

    def __init__(self, kind: str, what: str):
        self.kind, self.what = kind, what

    def actions(self, actions: Sequence) -> list:
        """skip-send: the list without its first send (the rest of that Comm stays)."""
        out = list(actions)
        for i, a in enumerate(out):
            sends = [op for op in a.ops if op.op == "send"] if isinstance(a, Comm) and self.kind == "skip-send" else []
            if sends:
                out[i] = Comm(tuple(op for op in a.ops if op is not sends[0]))
                _stderr(
                    f"pretrain_gpt.py: {self.what}: this rank's schedule drops its send of {sends[0].kind} "
                    f"micro-batch {sends[0].mb} to pipeline rank {sends[0].peer}"
                )
                break
        return out

    def during(self, action, chunk: Optional[torch.nn.Module] = None) -> None:
        """hang: the first forward of the run computes without end inside its chunk's first layer (as a
        stuck kernel or loop would), after the collectives before it (the embedding's) and before the
        layer's own (TP, SP, CP, EP): its peers block in those. A chunk without layers hangs at once."""
        if self.kind != "hang" or action.kind != "F":
            return
        layers = getattr(getattr(chunk, "decoder", None), "layers", None)
        where = f"F micro-batch {action.mb} chunk {action.chunk}"
        if not layers:
            _hang(f"pretrain_gpt.py: {self.what}: this rank computes without end in {where}")
        name, layer = next(iter(layers.items()))
        layer.register_forward_pre_hook(
            lambda module, args: _hang(
                f"pretrain_gpt.py: {self.what}: this rank computes without end in {where}, layer {name}"
            )
        )


def _hang(line: str) -> None:
    """Say ``line`` and compute forever (the watch thread still answers: torch releases the GIL)."""
    _stderr(line)
    x = torch.full((64, 64), 0.01)
    while True:
        x = torch.tanh(x @ x + 0.01)


def inject_fault(train_cfg, iteration: int, rank: int, executor=None) -> None:
    """Fail this rank in ``iteration`` when the --inject-fault-* flags say so (round 0 only): kill and
    exception now, hang and skip-send inside ``executor``'s next run."""
    if train_cfg.inject_fault_at_iteration != iteration or train_cfg.inject_fault_rank != rank or restart_round() != 0:
        return
    kind = train_cfg.inject_fault_kind
    what = f"rank {rank}: --inject-fault-kind {kind} at iteration {iteration}"
    if kind in ("hang", "skip-send") and executor is not None:
        executor.fault = ScheduleFault(kind, what)
        return
    if kind == "exception":
        raise InjectedFault(f"{what}: this rank stops with an error")
    try:
        sys.stdout.flush()  # the log lines so far stay in the log
    except (RuntimeError, ValueError, OSError):
        pass
    if kind == "kill":
        _stderr(f"pretrain_gpt.py: {what}: killing this rank (SIGKILL)")
        os.kill(os.getpid(), signal.SIGKILL)
    _stderr(f"pretrain_gpt.py: {what}: this rank stops until it is killed")
    while True:  # SIGTERM (torchrun stopping the round) still ends it through ExitSignals
        time.sleep(3600)
