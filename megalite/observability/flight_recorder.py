"""The flight recorder: one ring buffer per rank of what the rank did, for hang diagnosis.

::

    record(kind, **fields) -> id      an event starts (its wall-clock time is stamped)
    done(id)                          it ended (a no-op once the ring has overwritten it)

    kinds    F / B / W      a schedule action: mb, chunk, run (the executor's run counter)
             send / recv    a posted transfer: peer (global rank), what (F|B), mb, stage, run, n
                            (n: the transfer's ordinal between this pair, in this direction)
             wait           this rank blocks: on a recv/send (peer ...) or a collective (group, seq)
             coll           a collective: op, group (its name: dp, pp, tp, cp, ep, expert_mp, world ...;
                            ``tp/shadow``: a paired forward's second communicator), seq (per group, from
                            1, counted on every member alike), async. The model's own collectives (TP/SP,
                            CP ring/all-gather/all-to-all, MoE dispatch) are recorded by their AxisGroup
             phase          an iteration phase: data, schedule, grad reduce, optimizer, checkpoint,
                            evaluation ... (``enter_phase`` marks the top level, ``phase()`` nests)

The ring is preallocated: an event overwrites a slot in place (no tensor, no device sync, no
growth), so recording costs about a microsecond. Counters that the diagnosis needs over the whole
run (collectives per group, transfers per peer, the current run's plan of transfers; for the straggler
check the seconds spent in ended waits, ``waited``) live beside the ring and never wrap. ``snapshot()`` is what the hang watch publishes and writes; it may be
called from another thread while the main thread records (slots are copied one at a time under
the GIL and checked against their id).

Each rank's recorder is held by its ParallelState (``ps.recorder``), which whoever talks on the
rank's groups already receives; start_hang_watch sizes it from --flight-recorder-size.
"""

from __future__ import annotations

import itertools
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Tuple

DEFAULT_CAPACITY = 2000  # events (torch's NCCL flight recorder keeps 2000 entries by default too)
_ID, _KIND, _FIELDS, _START, _END = range(5)


class FlightRecorder:
    """A fixed-size ring of this rank's events plus per-group / per-peer counters."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.resize(capacity)

    def resize(self, capacity: int) -> None:
        """Preallocate ``capacity`` slots (0 turns recording off) and clear every counter."""
        self.capacity = max(0, int(capacity))
        self.enabled = self.capacity > 0
        self._slots: List[list] = [[-1, None, None, 0.0, None] for _ in range(self.capacity)]
        self._next = 0
        self._ids = itertools.count()
        self._wait = -1  # the latest wait event: what the hang watch checks against the timeout
        self.waited = 0.0  # seconds blocked in ended waits over the run: the straggler check's time on others
        self.seq: Dict[str, int] = {}  # collectives started per group name
        self.sent: Dict[int, int] = {}  # sends posted per peer (global rank)
        self.received: Dict[int, int] = {}  # receives posted per peer
        self.run = 0  # executor runs begun (the same sequence on every rank: steps and evaluations)
        self.plan: Dict[str, Dict[int, List[Tuple[str, int, int]]]] = {"send": {}, "recv": {}}
        self._top: Optional[Tuple[int, str, float]] = None  # the enter_phase marker: (id, name, start)
        self._nested: List[Tuple[int, str, float]] = []

    # -- recording -------------------------------------------------------------------------------
    def record(self, kind: str, **fields) -> int:
        """Start an event; returns its id (-1 when recording is off)."""
        if not self.enabled:
            return -1
        # next() on a count is atomic under the GIL: a paired forward records from a second thread, and two
        # events must never share a slot (_next, read by events(), may lag one event behind in such a race)
        i = next(self._ids)
        self._next = i + 1
        s = self._slots[i % self.capacity]
        s[_KIND], s[_FIELDS], s[_START], s[_END] = kind, fields, time.time(), None
        s[_ID] = i  # last: a reader on another thread sees either the old event or the whole new one
        return i

    def done(self, event_id: int) -> None:
        """End event ``event_id`` (nothing happens when the ring has reused its slot)."""
        if event_id >= 0:
            s = self._slots[event_id % self.capacity]
            if s[_ID] == event_id:
                s[_END] = time.time()
                if s[_KIND] == "wait":
                    self.waited += s[_END] - s[_START]

    def collective(self, op: str, group: str, async_op: bool = False) -> int:
        """Start collective ``op`` on ``group``: the group's next sequence number is stamped on it."""
        if not self.enabled:
            return -1
        n = self.seq.get(group, 0) + 1
        self.seq[group] = n
        return self.record("coll", op=op, group=group, seq=n, async_op=async_op)

    def call(self, name: str, fn, /, *args, **kwargs):
        """Run collective ``fn(*args, **kwargs)`` recorded on the group called ``name`` (dp_cp, pp, ...: the
        ParallelState axis); one line at a call site. An ``async_op=True`` call returns a handle whose
        ``wait()`` is recorded as the wait.
        """
        if not self.enabled:
            return fn(*args, **kwargs)
        is_async = bool(kwargs.get("async_op"))
        eid = self.collective(getattr(fn, "__name__", "collective"), name, is_async)
        if is_async:
            return _RecordedWork(fn(*args, **kwargs), self, eid)
        w = self._wait = self.record(
            "wait", on="coll", op=getattr(fn, "__name__", "collective"), group=name, seq=self.seq[name]
        )
        out = fn(*args, **kwargs)
        self.done(w)
        self.done(eid)
        return out

    def started(self, op: str, group: str, works: list) -> "_RecordedWork":
        """Transfers ``works`` already posted on ``group`` (the CP ring's send/recv pair), recorded as one
        asynchronous collective ``op``; the handle's ``wait()`` waits for all of them (recorded)."""
        return _RecordedWork(works, self, self.collective(op, group, True))

    def transfer(self, op: str, peer: int, what: str, mb: int, stage: int) -> int:
        """A posted send or recv to/from global rank ``peer`` (its ordinal between the pair is stamped)."""
        if not self.enabled:
            return -1
        counts = self.sent if op == "send" else self.received
        n = counts.get(peer, 0)
        counts[peer] = n + 1
        return self.record(op, peer=peer, what=what, mb=mb, stage=stage, run=self.run, n=n)

    def wait_on(self, event_id: int) -> int:
        """This rank starts blocking on the transfer or collective ``event_id`` (copied into the wait)."""
        if not self.enabled:
            return -1
        s = self._slots[event_id % self.capacity] if event_id >= 0 else None
        fields = dict(s[_FIELDS]) if s is not None and s[_ID] == event_id else {}
        self._wait = self.record("wait", on=s[_KIND] if fields else "?", **fields)
        return self._wait

    def begin_run(self, plan: Dict[str, Dict[int, List[Tuple[str, int, int]]]]) -> int:
        """An executor run starts; ``plan``: its transfers per direction and peer, in schedule order."""
        self.run += 1
        self.plan = plan
        return self.run

    # -- phases ----------------------------------------------------------------------------------
    def enter_phase(self, name: str) -> None:
        """Mark the iteration's top-level phase (ends the previous one): one line at a call site."""
        if not self.enabled:
            return
        if self._top is not None:
            self.done(self._top[0])
        self._top = (self.record("phase", name=name), name, time.time())

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A nested phase for the duration of a ``with`` block."""
        if not self.enabled:
            yield
            return
        entry = (self.record("phase", name=name), name, time.time())
        self._nested.append(entry)
        try:
            yield
        finally:
            self._nested.remove(entry)
            self.done(entry[0])

    # -- reading ---------------------------------------------------------------------------------
    def events(self, last: Optional[int] = None) -> List[dict]:
        """The events still in the ring, oldest first (at most ``last``), as dicts."""
        n, cap = self._next, self.capacity
        first = max(0, n - cap, n - (last if last is not None else cap))
        out = []
        for i in range(first, n):
            s = list(self._slots[i % cap])  # one C-level copy: consistent under the GIL
            if s[_ID] == i:
                out.append({"id": i, "kind": s[_KIND], "start": s[_START], "end": s[_END], **(s[_FIELDS] or {})})
        return out

    def current_wait(self) -> Optional[dict]:
        """The latest wait when it has not ended (what this rank blocks in now), else None."""
        i = self._wait
        s = list(self._slots[i % self.capacity]) if i >= 0 else None
        if s is None or s[_ID] != i or s[_END] is not None:
            return None
        return {"id": i, "kind": s[_KIND], "start": s[_START], "end": None, **(s[_FIELDS] or {})}

    def snapshot(self, recent: Optional[int] = 64) -> dict:
        """What this rank did and does now: the last ``recent`` events (None: the whole ring), the open
        ones, the phases, and the counters. Plain JSON-able data."""
        evs = self.events()
        open_events = [e for e in evs if e["end"] is None and e["kind"] != "phase"]
        phases = ([self._top] if self._top is not None else []) + list(self._nested)
        return {
            "time": time.time(),
            "recorded": self._next,
            "capacity": self.capacity,
            "phases": [{"id": i, "name": name, "start": t} for i, name, t in phases],
            "open": open_events[-32:],
            "events": evs if recent is None else evs[-recent:],
            "seq": dict(self.seq),
            "sent": {str(p): n for p, n in dict(self.sent).items()},
            "received": {str(p): n for p, n in dict(self.received).items()},
            "run": self.run,
            "plan": {d: {str(p): [list(k) for k in keys] for p, keys in by.items()} for d, by in self.plan.items()},
        }


class _RecordedWork:
    """An async collective's handle: its wait() is recorded (the wait a hang would show)."""

    __slots__ = ("_work", "_rec", "_eid")

    def __init__(self, work, rec: FlightRecorder, eid: int):
        self._work, self._rec, self._eid = work, rec, eid

    def wait(self, *args, **kwargs):
        w = self._rec.wait_on(self._eid)
        if isinstance(self._work, list):  # started(): several transfers, one wait
            out = [work.wait(*args, **kwargs) for work in self._work]
        else:
            out = self._work.wait(*args, **kwargs)
        self._rec.done(w)
        self._rec.done(self._eid)
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)
