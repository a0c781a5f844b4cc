"""The hang watch: when a job stops progressing, the ranks that can still talk agree on who stopped it.

::

    trigger                                    on that rank
    a wait passes --distributed-timeout-minutes  the watch thread (any backend) or the failed wait
    a peer dies (a transfer fails)             pretrain_gpt.py's handler of the failure
    SIGUSR1                                    the watch thread (the job goes on)
    SIGTERM / SIGINT ending the job            the signal handler, or the watch thread when the main
                                               thread is blocked in a wait and cannot run it

A trigger bumps a request counter in a side channel that does not depend on the process groups:
the c10d store torchrun already runs (a TCPStore client of our own, under a prefix per restart
round). Every rank's watch thread polls it (twice a second) and answers by publishing its flight
recorder's snapshot and writing its whole ring to ``--debug-dir/flight_recorder_rank_<N>.json``. A
rank in an endless computation answers from this thread; a stopped or dead one does not, and its
silence plus the others' waits name it (megalite.observability.diagnosis). The requesting rank collects the
answers for a few seconds, and the first rank to claim the printing prints the diagnosis once::

    hang diagnosis: rank 1 (stage 1, dp 0) stopped progressing: it does not answer (its process is
    stopped); rank 0 waits for it in recv from rank 1 (B micro-batch 0)

Without a store to reach (the test harness' in-process runs) each rank still writes its own file.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import threading
import time
import uuid
from datetime import timedelta
from typing import Callable, Dict, Optional

import torch.distributed as dist

from megalite.observability.diagnosis import Diagnosis
from megalite.observability.flight_recorder import FlightRecorder
from megalite.parallel.state import ParallelState

FILE = "flight_recorder_rank_{}.json"
ANSWER_S = 3.0  # how long a diagnosis waits for the other ranks' snapshots
POLL_S = 0.5
STUCK_S = 10.0  # on a signal: a wait this long (or a silent rank) is worth a diagnosis


def default_debug_dir(save: Optional[str]) -> str:
    """--debug-dir's default: ``<--save>/debug``, else ``<tmp>/megalite_debug`` (torch's flight recorder
    writes to /tmp/nccl_trace_rank_<N> by default)."""
    if save:
        return os.path.join(save, "debug")
    return os.path.join(os.environ.get("TMPDIR", "/tmp"), "megalite_debug")


def _side_store(world_size: int) -> Optional["dist.Store"]:
    """A store client of our own on torchrun's store (or the default group's), under this round's prefix."""
    if world_size < 2 or not dist.is_initialized():
        return None
    if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        return None  # the test harness' own rendezvous: no side channel (each rank still writes its file)
    # torchrun's agent store (or rank 0's, under env://): it lives outside the process groups
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=10)
    )
    return dist.PrefixStore(
        f"megalite_diag/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/round_"
        f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/",
        base,
    )


def _stderr(line: str) -> None:
    os.write(2, (line + "\n").encode())


class HangWatch:
    """One rank's watch thread, its side channel and its flight-recorder files."""

    def __init__(
        self,
        ps: ParallelState,
        recorder: FlightRecorder,
        debug_dir: str,
        timeout_s: float,
        exit_on_signal: Optional[Callable[[int], None]] = None,
        save_on_signal: bool = False,
    ):
        self.ps, self.rec, self.debug_dir, self.timeout_s = ps, recorder, debug_dir, timeout_s
        self.exit_on_signal, self.save_on_signal = exit_on_signal, save_on_signal
        self.store = None
        self.answered = 0  # the last request generation this rank answered
        self.fatal_done = False
        self.exiting = False
        self._lock = threading.RLock()
        self._main_busy = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._wake_r = self._wake_w = None
        self._prev_wakeup, self._prev_usr1 = None, None
        self._timed_out_event = -1
        self.job = (
            os.environ.get("TORCHELASTIC_RUN_ID", "local") + "/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        )

    # -- setup ----------------------------------------------------------------------------------
    def start(self) -> "HangWatch":
        try:
            self.store = _side_store(self.ps.world_size)
            if self.store is not None:
                self.store.set(f"pid/{self.ps.rank}", json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
                # one id for this job's files (torchrun's run id is "none" unless --rdzv-id is given)
                self.job = self.store.compare_set("job", "", uuid.uuid4().hex).decode() + "/" + self.job
        except Exception:  # no side channel: files only
            self.store = None
        if threading.current_thread() is threading.main_thread():
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self._prev_wakeup = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
            self._prev_usr1 = signal.signal(signal.SIGUSR1, lambda signum, frame: None)  # the thread acts
        self._thread = threading.Thread(target=self._loop, name="megalite-hang-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._wake_w is not None:
            try:
                self._wake_w.send(b"\0")  # wake the thread's select now
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=2 * POLL_S)
        if self._wake_w is not None and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(self._prev_wakeup if self._prev_wakeup is not None else -1)
            signal.signal(signal.SIGUSR1, self._prev_usr1 or signal.SIG_DFL)
            self._wake_r.close()
            self._wake_w.close()
            self._wake_w = None

    def meta(self) -> dict:
        ps = self.ps
        grid = {"tp": ps.tp_size, "cp": getattr(ps, "cp_size", 1), "dp": ps.dp_size, "pp": ps.pp_size}
        groups = {name: list(axis.ranks) for name, axis in ps.axes.items()}
        groups["world"] = list(range(ps.world_size))
        return {
            "rank": ps.rank,
            "world_size": ps.world_size,
            "grid": grid,
            "groups": groups,
            "job": self.job,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }

    # -- the thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception:  # the store went away (the launcher is gone): stay quiet, keep dumping locally
                self.store = None
                time.sleep(POLL_S)

    def _tick(self) -> None:
        for signum in self._signals(POLL_S):
            if signum == signal.SIGUSR1:
                self.diagnose("SIGUSR1", fatal=False)
            elif signum in (signal.SIGTERM, signal.SIGINT) and not self.save_on_signal:
                time.sleep(POLL_S)  # the main thread's handler runs unless the main thread is blocked in a wait
                if not self.exiting and not self._main_busy and self.exit_on_signal is not None:
                    self.exit_on_signal(signum)
        if self.store is not None:
            gen = self.store.add("req", 0)
            if gen > self.answered:
                self.publish(gen)
                self.dump(f"request {gen}", gen)
        e = self.rec.current_wait()
        if e is not None and e["id"] != self._timed_out_event and time.time() - e["start"] > self.timeout_s:
            self._timed_out_event = e["id"]
            self.diagnose(f"a wait on rank {self.ps.rank} passed --distributed-timeout-minutes", fatal=True)

    def _signals(self, timeout: float):
        if self._wake_r is None:
            self._stop.wait(timeout)
            return []
        ready, _, _ = select.select([self._wake_r], [], [], timeout)
        if not ready:
            return []
        try:
            return list(self._wake_r.recv(64))
        except (BlockingIOError, OSError):
            return []

    # -- publishing and dumping -----------------------------------------------------------------
    def _snapshot(self, gen: int, final: bool, reason: str, recent: Optional[int]) -> dict:
        return {**self.meta(), **self.rec.snapshot(recent=recent), "gen": gen, "final": final, "reason": reason}

    def publish(self, gen: int, final: bool = False, reason: str = "") -> None:
        """Answer request ``gen`` (a final snapshot answers every later one: this rank is leaving)."""
        self.answered = max(self.answered, gen)
        if self.store is not None:
            self.store.set(f"snap/{self.ps.rank}", json.dumps(self._snapshot(gen, final, reason, 64)))

    def dump(self, reason: str, gen: int = 0, final: bool = False, diagnosis: Optional[str] = None) -> Optional[str]:
        """Write this rank's whole ring to --debug-dir (atomically); returns the path (None: it failed)."""
        path = os.path.join(self.debug_dir, FILE.format(self.ps.rank))
        try:
            os.makedirs(self.debug_dir, exist_ok=True)
            data = self._snapshot(gen, final, reason, None)
            if diagnosis:
                data["diagnosis"] = diagnosis
            with open(path + ".tmp", "w") as f:
                json.dump(data, f)
            os.replace(path + ".tmp", path)
            return path
        except OSError:
            return None

    # -- the diagnosis --------------------------------------------------------------------------
    def diagnose(self, reason: str, fatal: bool, only_if_problem: bool = False, final: bool = False) -> Optional[str]:
        """Request every rank's snapshot, wait for the answers, print the diagnosis once (see the module
        docstring). ``fatal``: at most one per job round; ``only_if_problem``: stay quiet on a healthy job."""
        on_main = threading.current_thread() is threading.main_thread()
        with self._lock:
            if fatal and self.fatal_done:  # diagnosed already: this rank's last word, for the others and the files
                self.publish(self.answered, final=final, reason=reason)
                if final:
                    self.dump(reason, self.answered, final=True)
                return None
            self._main_busy = self._main_busy or on_main
            try:
                return self._diagnose(reason, fatal, only_if_problem, final)
            finally:
                self.fatal_done = self.fatal_done or fatal
                self._main_busy = self._main_busy and not on_main

    def _diagnose(self, reason: str, fatal: bool, only_if_problem: bool, final: bool) -> Optional[str]:
        store, me = self.store, self.ps.rank
        gen = store.add("req", 1) if store is not None else self.answered + 1
        self.publish(gen, final=final, reason=reason)
        snaps = self._collect(gen) if store is not None else {me: self._snapshot(gen, final, reason, 64)}
        if store is None and self.ps.world_size > 1:
            self.dump(reason, gen, final)
            return None  # no side channel: the other ranks' files tell the rest (tools/diagnose.py)
        d = Diagnosis(
            snaps, self.ps.world_size, self._silent_detail([r for r in range(self.ps.world_size) if r not in snaps])
        )
        stuck = min(STUCK_S, self.timeout_s / 2)
        problem = (
            (fatal and not only_if_problem)
            or bool(d.silent)
            or any(snaps[r]["time"] - e["start"] >= stuck for r, e in d.blocked.items())
        )
        if not problem:  # a wait of a few milliseconds is progress, not a hang
            d = Diagnosis(snaps, self.ps.world_size, min_wait_s=stuck)
        sentence = d.sentence()
        path = self.dump(reason, gen, final, sentence)
        if only_if_problem and not problem:
            return None
        if self._claim(fatal):
            where = os.path.dirname(path) if path else self.debug_dir
            _stderr(f"hang diagnosis: {sentence}")
            if path is None:  # never claim files that are not there (a full disk, a --debug-dir gone bad)
                _stderr(f"hang diagnosis ({reason}): this rank could not write its flight record to {where}")
                return sentence
            _stderr(
                f"hang diagnosis ({reason}): flight records of the ranks that answered are in {where} "
                f"(python tools/diagnose.py {where})"
            )
        return sentence

    def _collect(self, gen: int) -> Dict[int, dict]:
        snaps: Dict[int, dict] = {}
        deadline = time.time() + ANSWER_S
        while True:
            for r in range(self.ps.world_size):
                if r in snaps or not self.store.check([f"snap/{r}"]):
                    continue
                s = json.loads(self.store.get(f"snap/{r}"))
                if s.get("gen", 0) >= gen or s.get("final"):
                    snaps[r] = s
            current = self.store.add("req", 0)  # keep answering the others while waiting for them
            if current > self.answered:
                self.publish(current)
            if len(snaps) == self.ps.world_size or time.time() > deadline:
                return snaps
            time.sleep(0.1)

    def _claim(self, fatal: bool) -> bool:
        if self.store is None:
            return True
        if fatal:
            return self.store.add("printed/fatal", 1) == 1
        now = time.time()  # SIGUSR1 sent to several ranks at once: one diagnosis
        last = self.store.get("usr1_at").decode() if self.store.check(["usr1_at"]) else ""
        if last and now - float(last) < 2 * ANSWER_S:
            return False
        return self.store.compare_set("usr1_at", last, str(now)).decode() == str(now)

    def _silent_detail(self, silent) -> Dict[int, str]:
        out = {}
        for r in silent:
            try:
                info = json.loads(self.store.get(f"pid/{r}")) if self.store.check([f"pid/{r}"]) else None
            except Exception:
                info = None
            if info is None:
                continue
            if info["host"] != socket.gethostname():
                out[r] = f"pid {info['pid']} on {info['host']}"
                continue
            try:
                with open(f"/proc/{info['pid']}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                state = "gone"
            out[r] = {
                "T": "its process is stopped",
                "t": "its process is stopped",
                "Z": "its process has exited",
                "gone": "its process has exited",
            }.get(state, f"its process is alive (state {state}) but silent")
        return out

    # -- exits ----------------------------------------------------------------------------------
    def busy_here(self) -> bool:
        """True when this (main) thread is making a diagnosis: a signal handler must not exit now."""
        return self._main_busy and threading.current_thread() is threading.main_thread()

    def before_exit(self, signum: int) -> None:
        """The job is being ended by a signal: publish, dump, and diagnose when something is wrong."""
        self.exiting = True
        if self.ps.world_size == 1:
            return
        try:
            self.diagnose(f"received {signal.Signals(signum).name}", fatal=True, only_if_problem=True, final=True)
        except Exception:
            self.dump(f"received {signal.Signals(signum).name}", self.answered, final=True)

    def on_failure(self, what: str) -> None:
        """A wait failed (a timeout or a dead peer): this rank's last word before it exits."""
        try:
            self.diagnose(what, fatal=True, final=True)
        except Exception:
            self.dump(what, self.answered, final=True)


def start_hang_watch(cfg, ps: ParallelState, signals=None) -> Optional[HangWatch]:
    """Size the flight recorder from the flags and start this rank's watch (None: --flight-recorder-size 0).

    ``signals`` (faults.ExitSignals) learns of the watch, so a job ended by a signal is diagnosed."""
    par = cfg.parallel
    ps.recorder.resize(par.flight_recorder_size)
    if not ps.recorder.enabled:
        return None
    watch = HangWatch(
        ps,
        ps.recorder,
        par.debug_dir or default_debug_dir(cfg.checkpoint.save),
        60.0 * par.distributed_timeout_minutes,
        exit_on_signal=signals.exit_now if signals is not None else None,
        save_on_signal=cfg.train.exit_signal_handler,
    )
    if signals is not None:
        signals.watch = watch
    return watch.start()
