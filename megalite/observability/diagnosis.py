"""Hang diagnosis: from every rank's flight-recorder snapshot, name the rank the job waits for.

A snapshot is ``FlightRecorder.snapshot()`` plus the rank's place (``rank``, ``grid``, ``groups``);
a rank that did not answer (stopped, dead, or its host gone) has none. Each rank that answered is
either *blocked* (its latest open ``wait``: a receive, a send, a collective) or *running* (no open
wait: computing, or in Python). A blocked rank waits for::

    recv from / send to rank p          rank p
    collective #s of group G            the members of G that have not started their #s yet
                                        (per-group sequence numbers agree on every member)

Following those edges from the blocked ranks ends at the culprit: a silent rank (it stopped or
died), or a running rank everyone waits on (an endless compute or loop). When the edges only go
round a cycle, nobody is at fault at runtime: the ranks deadlocked through their schedules, and the
culprit is the rank whose schedule for this step sends (receives) fewer transfers to a neighbour
than the neighbour's schedule receives (sends). One sentence says it, e.g.::

    rank 3 (stage 1, dp 1) stopped progressing in F micro-batch 5 chunk 0 (busy in it for 41 s ...);
    rank 1 waits for it in recv from rank 3 (F micro-batch 5), rank 2 in all_reduce #812 (dp group)

The collectives inside the model (tensor and sequence parallel, the CP ring's exchanges and its
all-gather/all-to-all, the MoE dispatch) are recorded by their AxisGroup, so a rank stuck inside a
layer is named with the TP/CP/EP collective its peers wait in (``all_reduce #12 (tp group)``,
``ring_exchange #3 (cp group)``).

Used at runtime (megalite.observability.hang_watch) and offline on the dumped files (tools/diagnose.py): the same
function, so both say the same.
"""

from __future__ import annotations

import glob
import json
import os
from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple

AXIS_ORDER = ("tp", "cp", "dp", "pp")  # fastest first (ParallelState's rank order)


def rank_list(ranks: Sequence[int]) -> str:
    """``1, 2`` / ``4-7, 9``: runs of three or more as ranges."""
    ranks, out, i = sorted(ranks), [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.extend([f"{ranks[i]}-{ranks[j]}"] if j - i >= 2 else [str(r) for r in ranks[i : j + 1]])
        i = j + 1
    return ", ".join(out)


def _ranks_word(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_list(ranks)}"


class Diagnosis:
    """The analysis of one set of snapshots (``snaps``: rank -> snapshot; absent: silent)."""

    def __init__(
        self,
        snaps: Dict[int, dict],
        world_size: int,
        silent_detail: Optional[Dict[int, str]] = None,
        min_wait_s: float = 0.0,
    ):
        self.snaps, self.world = snaps, world_size
        self.silent = [r for r in range(world_size) if r not in snaps]
        self.silent_detail = silent_detail or {}
        any_snap = next(iter(snaps.values()), {})
        self.grid = any_snap.get("grid", {"tp": 1, "cp": 1, "dp": world_size, "pp": 1})
        self.blocked = {
            r: e
            for r, e in ((r, blocked_in(s)) for r, s in snaps.items())
            if e is not None and snaps[r].get("time", 0.0) - e["start"] >= min_wait_s
        }
        self.edges = {r: self._waits_for(r, e) for r, e in self.blocked.items()}
        for r in [r for r, q in self.edges.items() if not q]:  # everyone it needs has arrived: in flight, not stuck
            del self.blocked[r], self.edges[r]

    # -- who is who -----------------------------------------------------------------------------
    def coords(self, rank: int) -> Dict[str, int]:
        out, stride = {}, 1
        for axis in AXIS_ORDER:
            size = int(self.grid.get(axis, 1))
            out[axis] = (rank // stride) % size
            stride *= size
        return out

    def who(self, rank: int) -> str:
        c = self.coords(rank)
        extra = "".join(f", {a} {c[a]}" for a in ("tp", "cp") if int(self.grid.get(a, 1)) > 1)
        return f"rank {rank} (stage {c['pp']}, dp {c['dp']}{extra})"

    # -- the wait graph -------------------------------------------------------------------------
    def _waits_for(self, rank: int, e: dict) -> List[int]:
        if e.get("on") in ("recv", "send"):
            p = int(e["peer"])
            posted = self.snaps.get(p, {}).get("sent" if e["on"] == "recv" else "received", {}).get(str(rank), -1)
            return [p] if posted <= e.get("n", 0) else []  # the peer posted its side: the transfer is in flight
        if e.get("on") == "coll":
            groups, name = self.snaps[rank].get("groups", {}), str(e.get("group"))
            members = groups.get(name) or groups.get(name.split("/")[0], [])  # tp/shadow: tp's members
            return [
                q
                for q in members
                if q != rank and (q not in self.snaps or self.snaps[q].get("seq", {}).get(e["group"], 0) < e["seq"])
            ]
        return []

    def _reachable(self, start: int) -> List[int]:
        seen, todo, order = {start}, [start], []
        while todo:
            r = todo.pop()
            for q in self.edges.get(r, []):
                if q not in seen:
                    seen.add(q)
                    order.append(q)
                    todo.append(q)
        return order

    def culprits(self) -> List[int]:
        """Ranks the blocked ranks end up waiting for: the silent ones, else the running ones (a rank waiting
        for a silent one in a wait nobody records looks busy; the model's TP/CP/EP collectives are recorded)."""
        found = set()
        for r in self.blocked:
            found.update(q for q in self._reachable(r) if q not in self.blocked)
        silent = sorted(q for q in found if q not in self.snaps)
        return silent or sorted(found)

    # -- the sentence ---------------------------------------------------------------------------
    def sentence(self) -> str:
        culprits = self.culprits()
        if culprits:
            return "; also ".join(self._culprit(c) for c in culprits)
        if self.blocked:
            return self._deadlock()
        if self.silent:
            return (
                "; also ".join(
                    f"{self.who(r)} stopped progressing: it does not answer{self._silent_note(r)}" for r in self.silent
                )
                + "; no rank waits for it yet"
            )
        doing = ", ".join(f"rank {r} {activity(s)[0]}" for r, s in sorted(self.snaps.items())[:8])
        more = ", ..." if self.world > 8 else ""
        return f"no hang: all {self.world} ranks answered and none is waiting ({doing}{more})"

    def _silent_note(self, rank: int) -> str:
        detail = self.silent_detail.get(rank)
        return f" ({detail})" if detail else ""

    def _culprit(self, c: int) -> str:
        if c in self.snaps:
            what, busy = activity(self.snaps[c])
            head = (
                f"{self.who(c)} stopped progressing {what} (busy in it for {busy:.0f} s and still answering: "
                f"a long or endless computation or loop)"
            )
        else:
            head = f"{self.who(c)} stopped progressing: it does not answer{self._silent_note(c)}"
        return head + self._waiters(c)

    def _waiters(self, c: int) -> str:
        direct = [r for r in sorted(self.blocked) if c in self.edges[r]]
        indirect = [r for r in sorted(self.blocked) if r not in direct and c in self._reachable(r)]
        parts = []
        for i, (label, ranks) in enumerate(_by_label(direct, self.blocked)):
            verb = ("waits" if len(ranks) == 1 else "wait") + " for it in " if i == 0 else "in "
            parts.append(f"{_ranks_word(ranks)} {verb}{label}")
        out = "; " + ", ".join(parts)  # a culprit is reached through a rank that waits for it
        behind = [f"{_ranks_word(ranks)} in {label}" for label, ranks in _by_label(indirect, self.blocked)]
        if behind:
            out += "; behind them " + ", ".join(behind)
        return out

    def _deadlock(self) -> str:
        groups = _by_label(sorted(self.blocked), self.blocked)
        verb = ("waits in " if len(groups[0][1]) == 1 else "wait in ") if groups else ""
        waits = ", ".join(
            f"{_ranks_word(ranks)} {verb if i == 0 else 'in '}{label}" for i, (label, ranks) in enumerate(groups)
        )
        for r in sorted(self.blocked):
            for p in self.edges[r]:
                found = self._plan_mismatch(r, p) or self._plan_mismatch(p, r)
                if found:
                    return f"{found}; {waits}"
        return (
            f"deadlock: every rank that answered waits and none is busy or silent ({waits}); the ranks issued "
            f"their transfers or collectives in orders that do not match"
        )

    def _plan_mismatch(self, a: int, b: int) -> Optional[str]:
        """Rank a's schedule (this run) against rank b's: a send of a's that b never receives, or the reverse."""
        sa, sb = self.snaps.get(a), self.snaps.get(b)
        if sa is None or sb is None or sa.get("run") != sb.get("run"):
            return None
        for mine, theirs, verb, peer_verb in (
            ("send", "recv", "send", "receives"),
            ("recv", "send", "receive", "sends"),
        ):
            have = Counter(tuple(k) for k in sa.get("plan", {}).get(mine, {}).get(str(b), []))
            need = Counter(tuple(k) for k in sb.get("plan", {}).get(theirs, {}).get(str(a), []))
            missing = need - have
            if missing:
                kind, mb, _ = sorted(missing)[0]
                return (
                    f"{self.who(a)} deadlocked the job through its schedule: it has no {verb} of {kind} "
                    f"micro-batch {mb} {'to' if verb == 'send' else 'from'} rank {b}, which rank {b}'s "
                    f"schedule {peer_verb} in the same step"
                )
        return None


def blocked_in(snap: dict) -> Optional[dict]:
    """The wait this rank is stuck in: its latest open ``wait`` event (None: it is not waiting)."""
    for e in reversed(snap.get("open", [])):
        if e.get("kind") == "wait":
            return e
    return None


def wait_label(e: dict) -> str:
    """``recv from rank 3 (F micro-batch 5)`` / ``all_reduce #812 (dp group)``."""
    if e.get("on") in ("recv", "send"):
        direction = "from" if e["on"] == "recv" else "to"
        return f"{e['on']} {direction} rank {e['peer']} ({e.get('what')} micro-batch {e.get('mb')})"
    if e.get("on") == "coll":
        return f"{e.get('op')} #{e.get('seq')} ({e.get('group')} group)"
    return "an unrecorded wait"


def activity(snap: dict) -> Tuple[str, float]:
    """What a rank that is not waiting does (``in F micro-batch 5 chunk 0``) and for how long (s)."""
    now = snap.get("time", 0.0)
    for e in reversed(snap.get("open", [])):
        if e.get("kind") in ("F", "B", "W"):
            return f"in {e['kind']} micro-batch {e.get('mb')} chunk {e.get('chunk')}", now - e["start"]
    phases = snap.get("phases", [])
    if phases:
        return f"in the {phases[-1]['name']} phase", now - phases[-1]["start"]
    return "outside any recorded phase", 0.0


def _by_label(ranks: Sequence[int], blocked: Dict[int, dict]) -> List[Tuple[str, List[int]]]:
    groups: Dict[str, List[int]] = {}
    for r in ranks:
        groups.setdefault(wait_label(blocked[r]), []).append(r)
    return sorted(groups.items(), key=lambda kv: kv[1][0])


def diagnose(
    snaps: Dict[int, dict], world_size: int, silent_detail: Optional[Dict[int, str]] = None, min_wait_s: float = 0.0
) -> str:
    """The one-sentence diagnosis of a job from its ranks' snapshots (a rank absent from ``snaps`` is silent;
    waits shorter than ``min_wait_s`` count as progress)."""
    return Diagnosis(snaps, world_size, silent_detail, min_wait_s).sentence()


def rank_table(snaps: Dict[int, dict], world_size: int, last: int = 3) -> List[str]:
    """One line per rank: waiting in what / doing what, and its last few events (tools/diagnose.py)."""
    d, lines = Diagnosis(snaps, world_size), []
    for r in range(world_size):
        s = snaps.get(r)
        if s is None:
            lines.append(f"  {d.who(r)}: no record")
            continue
        e = d.blocked.get(r)
        state = (
            f"waits in {wait_label(e)} for {s['time'] - e['start']:.1f} s"
            if e is not None
            else "running, {} ({:.1f} s)".format(*activity(s))
        )
        recent = " ".join(_short(ev) for ev in s.get("events", [])[-last:])
        lines.append(f"  {d.who(r)}: {state}; last events: {recent}")
    return lines


def _short(e: dict) -> str:
    k = e.get("kind")
    if k in ("F", "B", "W"):
        s = f"{k}{e.get('mb')}.{e.get('chunk')}"
    elif k in ("send", "recv"):
        s = f"{k}:{e.get('what')}{e.get('mb')}{'->' if k == 'send' else '<-'}{e.get('peer')}"
    elif k == "coll":
        s = f"{e.get('op')}#{e.get('seq')}({e.get('group')})"
    elif k == "wait":
        s = f"wait[{wait_label(e)}]"
    else:
        s = f"{k}:{e.get('name', '')}"
    return s + ("" if e.get("end") is not None else "(open)")


class DumpError(ValueError):
    """A file named like a flight-recorder dump whose JSON is not one (one line naming the file and what is wrong)."""


_NUMBER = (int, float)
# The dump's fields the diagnosis reads, and their JSON types; the first five every dump has.
_DUMP_FIELDS = {
    "rank": int,
    "world_size": int,
    "time": _NUMBER,
    "events": list,
    "open": list,
    "phases": list,
    "grid": dict,
    "groups": dict,
    "seq": dict,
    "sent": dict,
    "received": dict,
    "plan": dict,
    "gen": int,
}
_REQUIRED = ("rank", "world_size", "time", "events", "open")


def check_dump(path: str, d: object) -> dict:
    """``d`` (a file's JSON) if it has the shape of a flight-recorder dump, else DumpError naming ``path``
    and the first field at fault: the diagnosis indexes these fields, so another JSON file (or one of
    another version) would otherwise end in a traceback deep inside it."""

    def bad(what: str) -> DumpError:
        return DumpError(
            f"{path}: not a flight-recorder dump ({what}); give the run's --debug-dir, whose "
            "flight_recorder_rank_<N>.json files the job wrote, or move this file out of it"
        )

    if not isinstance(d, dict):
        raise bad(f"a JSON {type(d).__name__}, not an object")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise bad(f"no {', '.join(repr(k) for k in missing)}")
    for key, kind in _DUMP_FIELDS.items():
        v = d.get(key)
        if key in d and (not isinstance(v, kind) or isinstance(v, bool)):
            raise bad(f"{key!r} is a JSON {type(v).__name__}, not {'a number' if kind is _NUMBER else kind.__name__}")
    if not 0 <= d["rank"] < d["world_size"]:
        raise bad(f"rank {d['rank']} outside world_size {d['world_size']}")
    for key in ("events", "open", "phases"):
        for e in d.get(key, []):
            if not isinstance(e, dict) or not isinstance(e.get("start"), _NUMBER):
                raise bad(f"an entry of {key!r} is not an event with a numeric 'start'")
    return d


def read_dumps(directory: str) -> Tuple[Dict[int, dict], int, Dict[int, str], List[str]]:
    """The flight-recorder files of the newest job in ``directory``: (snapshots by rank, world size,
    notes on ranks without a current record, problems with the files). A rank's file counts when it
    answered the latest request or is its final word; an older one (an earlier SIGUSR1) is stale.
    A file that is valid JSON but not a dump raises DumpError (check_dump)."""
    found, problems = [], []
    for path in sorted(glob.glob(os.path.join(directory, "flight_recorder_rank_*.json"))):
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:  # a rank killed while writing: its record is lost, the rest count
            problems.append(f"{path}: unreadable ({e})")
            continue
        found.append(check_dump(path, d))
    if not found:
        return {}, 0, {}, problems + [f"{directory}: no flight_recorder_rank_*.json files"]
    job = max(found, key=lambda d: d.get("time", 0.0)).get("job")
    others = [d for d in found if d.get("job") != job]
    if others:
        problems.append(f"{len(others)} file(s) of an earlier job ignored")
    found = [d for d in found if d.get("job") == job]
    latest = max(d.get("gen", 0) for d in found)
    snaps, notes = {}, {}
    for d in found:
        if d.get("gen", 0) >= latest or d.get("final"):
            snaps[d["rank"]] = d
        else:
            notes[d["rank"]] = f"its last record, {d.get('reason')!r}, predates the others"
    world = max(d.get("world_size", 0) for d in found)
    for r in range(world):
        if r not in snaps and r not in notes:
            notes[r] = "it left no flight record"
    return snaps, world, notes, problems
