"""The flight recorder's ring and the hang diagnosis from synthetic buffers (megalite.observability.diagnosis)."""

import json
import time

from megalite.observability.diagnosis import diagnose, rank_list, rank_table, read_dumps
from megalite.observability.flight_recorder import FlightRecorder
from tools import diagnose as diagnose_tool

GRID = {"tp": 1, "cp": 1, "dp": 2, "pp": 2}  # 4 ranks: dp groups [0,1] [2,3], pp groups [0,2] [1,3]
GROUPS = {
    0: {"dp": [0, 1], "pp": [0, 2]},
    1: {"dp": [0, 1], "pp": [1, 3]},
    2: {"dp": [2, 3], "pp": [0, 2]},
    3: {"dp": [2, 3], "pp": [1, 3]},
}


def snap(rec: FlightRecorder, rank: int, age: float = 30.0) -> dict:
    """The recorder's snapshot as the hang watch publishes it, taken ``age`` seconds after its events."""
    s = rec.snapshot()
    s.update(rank=rank, grid=GRID, groups={**GROUPS[rank], "world": [0, 1, 2, 3]}, time=s["time"] + age, world_size=4)
    return json.loads(json.dumps(s))  # what crosses the store: plain JSON


def waiting_recv(rec: FlightRecorder, peer: int, what: str, mb: int, stage: int) -> None:
    rec.wait_on(rec.transfer("recv", peer, what, mb, stage))


def test_ring_wraps_and_keeps_the_newest_events_and_counters():
    rec = FlightRecorder(capacity=8)
    for i in range(20):
        rec.done(rec.record("F", mb=i, chunk=0))
    events = rec.events()
    assert [e["mb"] for e in events] == list(range(12, 20))
    assert all(e["end"] is not None for e in events) and events[0]["id"] == 12
    old = rec.record("B", mb=0, chunk=0)
    for _ in range(8):
        rec.record("W", mb=1, chunk=0)
    rec.done(old)  # its slot was reused: nothing changes
    assert all(e["kind"] == "W" and e["end"] is None for e in rec.events())
    for _ in range(3):
        rec.collective("all_reduce", "dp")
    assert rec.snapshot()["seq"] == {"dp": 3}  # counters never wrap with the ring
    assert rec.events(last=2)[-1]["kind"] == "coll"


def test_recorder_off_records_nothing_and_calls_through():
    rec = FlightRecorder(capacity=0)
    assert rec.record("F", mb=0, chunk=0) == -1
    assert rec.call("dp", lambda x: x + 1, 1) == 2
    with rec.phase("optimizer"):
        pass
    assert rec.events() == [] and rec.snapshot()["seq"] == {}


def test_phases_and_recorded_calls():
    rec = FlightRecorder(16)
    rec.enter_phase("data")
    rec.enter_phase("schedule")
    with rec.phase("evaluation"):
        assert [p["name"] for p in rec.snapshot()["phases"]] == ["schedule", "evaluation"]
    assert [p["name"] for p in rec.snapshot()["phases"]] == ["schedule"]
    assert rec.call("pp", max, 3, 4) == 4

    class Work:
        def wait(self):
            return "done"

    work = rec.call("dp", lambda async_op: Work(), async_op=True)
    assert rec.snapshot()["open"][-1]["kind"] == "coll"  # posted, not waited
    assert work.wait() == "done" and rec.snapshot()["open"] == []
    assert rec.snapshot()["seq"] == {"pp": 1, "dp": 1}


def test_rank_lists():
    assert rank_list([2, 1]) == "1, 2" and rank_list([4, 5, 6, 7, 9]) == "4-7, 9"


def _pipeline(stopped_in=None):
    """Four recorders: rank 1 (stage 0, dp 1) got as far as ``stopped_in``; rank 3 (stage 1, dp 1) waits
    for its activation; ranks 0 and 2 (dp 0) finished the schedule and wait in the dp / pp collectives."""
    recs = [FlightRecorder(64) for _ in range(4)]
    for rec in recs:
        rec.begin_run({"send": {}, "recv": {}})
        rec.enter_phase("schedule")
        for _ in range(811):
            rec.collective("all_reduce", "dp")
    recs[0].call("dp", lambda: None)  # rank 0's 812th dp all-reduce needs rank 1
    recs[0].wait_on(recs[0].collective("all_reduce", "dp"))
    recs[2].wait_on(recs[2].collective("all_reduce", "dp"))  # rank 2's needs rank 3
    waiting_recv(recs[3], 1, "F", 5, 1)
    if stopped_in:
        recs[1].record(stopped_in, mb=5, chunk=0)
    return recs


def test_a_silent_rank_is_named_with_who_waits_for_it_and_on_what():
    recs = _pipeline()
    snaps = {r: snap(recs[r], r) for r in (0, 2, 3)}
    assert diagnose(snaps, 4, {1: "its process is stopped"}) == (
        "rank 1 (stage 0, dp 1) stopped progressing: it does not answer (its process is stopped); "
        "rank 0 waits for it in all_reduce #813 (dp group), rank 3 in recv from rank 1 (F micro-batch 5); "
        "behind them rank 2 in all_reduce #812 (dp group)"
    )


def test_a_busy_rank_is_named_with_what_it_is_stuck_in():
    recs = _pipeline(stopped_in="F")
    snaps = {r: snap(recs[r], r) for r in range(4)}
    line = diagnose(snaps, 4)
    assert line.startswith(
        "rank 1 (stage 0, dp 1) stopped progressing in F micro-batch 5 chunk 0 (busy in it for 30 s and still answering"
    )
    assert "rank 0 waits for it in all_reduce #813 (dp group), rank 3 in recv from rank 1 (F micro-batch 5)" in line
    table = rank_table(snaps, 4)
    assert table[1].startswith("  rank 1 (stage 0, dp 1): running, in F micro-batch 5 chunk 0")
    assert table[3].startswith("  rank 3 (stage 1, dp 1): waits in recv from rank 1 (F micro-batch 5) for 30.0 s")


def test_who_is_behind_in_a_collective():
    # Ranks 0 and 1 wait in dp all-reduce #3; rank 1 arrived, rank 0... both did: nobody is behind, so the
    # rank that has not arrived at pp #2 (rank 2, busy in the optimizer phase) is the one they wait for.
    recs = [FlightRecorder(32) for _ in range(4)]
    for r in (0, 2):
        recs[r].collective("broadcast", "pp")
    recs[0].wait_on(recs[0].collective("broadcast", "pp"))
    recs[2].enter_phase("optimizer")
    snaps = {r: snap(recs[r], r, age=12.0) for r in range(4)}
    assert diagnose(snaps, 4) == (
        "rank 2 (stage 1, dp 0) stopped progressing in the optimizer phase (busy in it "
        "for 12 s and still answering: a long or endless computation or loop); rank 0 "
        "waits for it in broadcast #2 (pp group)"
    )


def _deadlock(skip_in_plan: bool):
    """pp 2: rank 0 (stage 0) and rank 2 (stage 1) wait for each other; rank 0's plan lacks its F0 send."""
    recs = [FlightRecorder(32) for _ in range(4)]
    full = [("F", mb, 1) for mb in range(4)]
    recs[0].begin_run({"send": {2: full[1:] if skip_in_plan else full}, "recv": {2: [("B", mb, 0) for mb in range(4)]}})
    recs[2].begin_run({"send": {0: [("B", mb, 0) for mb in range(4)]}, "recv": {0: full}})
    waiting_recv(recs[0], 2, "B", 3, 0)
    waiting_recv(recs[2], 0, "F", 3, 1)
    return {r: snap(recs[r], r) for r in (0, 2)}


def test_a_deadlock_through_a_bad_schedule_names_the_rank_that_skipped_the_send():
    snaps = _deadlock(skip_in_plan=True)
    snaps.update({r: snap(FlightRecorder(4), r) for r in (1, 3)})
    assert diagnose(snaps, 4) == (
        "rank 0 (stage 0, dp 0) deadlocked the job through its schedule: it has no send of F micro-batch 0 to rank "
        "2, which rank 2's schedule receives in the same step; rank 0 waits in recv from rank 2 (B micro-batch 3), "
        "rank 2 in recv from rank 0 (F micro-batch 3)"
    )
    plain = _deadlock(skip_in_plan=False)
    plain.update({r: snap(FlightRecorder(4), r) for r in (1, 3)})
    assert diagnose(plain, 4).startswith("deadlock: every rank that answered waits and none is busy or silent")


def test_no_hang_and_short_waits():
    recs = [FlightRecorder(8) for _ in range(4)]
    recs[0].record("F", mb=2, chunk=0)
    waiting_recv(recs[2], 0, "F", 2, 1)
    snaps = {r: snap(recs[r], r, age=0.01) for r in range(4)}
    assert diagnose(snaps, 4, min_wait_s=1.0).startswith(
        "no hang: all 4 ranks answered and none is waiting (rank 0 in F micro-batch 2 chunk 0, rank 1 outside"
    )
    del snaps[3]  # silent, but nobody has noticed yet
    assert diagnose(snaps, 4, min_wait_s=1.0) == (
        "rank 3 (stage 1, dp 1) stopped progressing: it does not answer; no rank waits for it yet"
    )


def test_offline_tool_reads_the_newest_job_and_ignores_stale_records(tmp_path, capsys):
    recs = _pipeline()
    now = time.time()
    for r in (0, 2, 3):
        (tmp_path / f"flight_recorder_rank_{r}.json").write_text(
            json.dumps({**snap(recs[r], r), "job": "b", "gen": 2, "final": r == 0, "time": now})
        )
    (tmp_path / "flight_recorder_rank_1.json").write_text(
        json.dumps(  # an earlier SIGUSR1 dump
            {**snap(recs[1], 1), "job": "b", "gen": 1, "final": False, "reason": "SIGUSR1", "time": now - 50}
        )
    )
    snaps, world, notes, problems = read_dumps(str(tmp_path))
    assert sorted(snaps) == [0, 2, 3] and world == 4 and problems == []
    assert diagnose_tool.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "diagnosis: rank 1 (stage 0, dp 1) stopped progressing: it does not answer (its last record, "
        "'SIGUSR1', predates the others); rank 0 waits for it in all_reduce #813 (dp group), rank 3 in "
        "recv from rank 1 (F micro-batch 5); behind them rank 2 in all_reduce #812 (dp group)"
    )
    assert out[1] == "ranks (3 of 4 with a current record):" and out[3] == "  rank 1 (stage 0, dp 1): no record"
    assert diagnose_tool.main([str(tmp_path / "none")]) == 1


def test_the_watch_diagnoses_once_through_a_store_and_writes_every_file(tmp_path, capfd):
    """Two ranks' watches on one store (no threads): rank 1 is stuck in a forward, rank 0 waits for it."""
    import torch.distributed as dist

    from megalite.observability.hang_watch import HangWatch
    from megalite.parallel.state import ParallelState

    store = dist.HashStore()
    recs, watches = [FlightRecorder(16), FlightRecorder(16)], []
    waiting_recv(recs[0], 1, "B", 0, 0)
    recs[1].record("F", mb=0, chunk=0)
    for r in (0, 1):
        w = HangWatch(ParallelState(2, r, pp=2, create_groups=False), recs[r], str(tmp_path), timeout_s=6.0)
        w.store = store
        watches.append(w)
    watches[1].publish(1)  # what rank 1's thread does when it sees request 1
    time.sleep(0.05)
    assert watches[0].diagnose("a wait on rank 0 passed --distributed-timeout-minutes", fatal=True) == (
        "rank 1 (stage 1, dp 0) stopped progressing in F micro-batch 0 chunk 0 (busy in it for 0 s and still "
        "answering: a long or endless computation or loop); rank 0 waits for it in recv from rank 1 (B micro-batch 0)"
    )
    watches[0].publish(0, final=True)  # rank 0 is leaving: its last snapshot answers any later request
    assert watches[1].diagnose("rank 1: timed out", fatal=True) is not None  # computed, not printed again
    err = capfd.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in err] == [
        "hang diagnosis",
        "hang diagnosis (a wait on rank 0 passed --distributed-timeout-minutes)",
    ]
    assert err[1].endswith(f"are in {tmp_path} (python tools/diagnose.py {tmp_path})")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flight_recorder_rank_0.json", "flight_recorder_rank_1.json"]
    assert watches[0].diagnose("again", fatal=True) is None  # one fatal diagnosis per rank


def test_skip_send_fault_drops_exactly_the_first_send(capfd):
    from megalite.pipeline.actions import Comm, Compute, P2POp
    from megalite.training.faults import ScheduleFault

    recv, send = P2POp("recv", "B", 0, 1, 0, 1), P2POp("send", "F", 1, 0, 1, 1)
    actions = [Compute("F", 0, 0), Comm((P2POp("send", "F", 0, 0, 1, 1),)), Compute("F", 1, 0), Comm((send, recv))]
    out = ScheduleFault("skip-send", "rank 0: test").actions(actions)
    assert out == [actions[0], Comm(()), actions[2], actions[3]] and len(actions[1].ops) == 1
    assert capfd.readouterr().err == (
        "pretrain_gpt.py: rank 0: test: this rank's schedule drops its send of F micro-batch 0 to pipeline rank 1\n"
    )
    assert ScheduleFault("hang", "x").actions(actions) == actions


def test_recorded_calls_pass_group_keywords_through():
    rec = FlightRecorder(8)
    assert rec.call("dp_cp", lambda t, group=None, op=None: (t, group, op), 1, group="g", op="sum") == (1, "g", "sum")
    assert rec.snapshot()["seq"] == {"dp_cp": 1}


def test_each_parallel_state_holds_its_own_recorder():
    """A run records into its ParallelState's recorder (schedule actions, phases); no process-wide one."""
    from megalite.parallel.state import ParallelState
    from megalite.training import Trainer
    from megalite.training.mock import MockFeed
    from tests.helpers.parity import tiny_config

    trainer, other = Trainer(tiny_config(gbs=4, mbs=2), ParallelState.single()), ParallelState.single()
    trainer.train_step(MockFeed(trainer, 1).next())
    kinds = [e["kind"] for e in trainer.ps.recorder.events()]
    assert kinds == ["phase", "F", "B", "F", "B", "phase", "phase"] and trainer.ps.recorder.run == 1
    assert other.recorder.events() == [] and other.recorder is not trainer.ps.recorder


class _Work:
    """A posted transfer's handle: counts its waits."""

    waits = 0

    def wait(self):
        _Work.waits += 1


def test_an_axis_group_records_its_collectives_and_a_paired_forward_counts_its_own():
    """AxisGroup.collective records on ps.recorder under the axis name; on the second communicator (a paired
    forward's thread) as ``<axis>/shadow``, whose members the diagnosis reads from the axis; started() (the CP
    ring's send/recv pair) is one collective with one recorded wait for all its transfers."""
    import threading

    from megalite.parallel.state import AxisGroup

    recs, threads = [FlightRecorder(32), FlightRecorder(32)], threading.local()
    g = AxisGroup([0, 1], 0, handle="main", shadow="second", threads=threads, name="tp", recorder=recs[0])
    assert g.collective(lambda x, group=None: (x, group), 1) == (1, "main") and g.label == "tp"
    g.started("ring_exchange", [_Work(), _Work()]).wait()
    assert _Work.waits == 2 and [e["kind"] for e in recs[0].events()] == ["coll", "wait", "coll", "wait"]
    assert all(e["end"] is not None for e in recs[0].events()) and recs[0].seq == {"tp": 2}
    threads.shadow = True
    assert g.collective(lambda x, group=None: group, 1) == "second" and g.label == "tp/shadow"
    recs[0].wait_on(recs[0].collective("all_gather", g.label))  # rank 0 blocks in the paired forward's #2
    recs[1].record("F", mb=1, chunk=0)  # rank 1 computes, its forward's collectives at #1
    recs[1].collective("all_gather", "tp/shadow")
    snaps = {}
    for r, rec in enumerate(recs):
        s = rec.snapshot()
        grid, groups = {"tp": 2, "cp": 1, "dp": 1, "pp": 1}, {"tp": [0, 1], "world": [0, 1]}
        snaps[r] = {**s, "rank": r, "grid": grid, "groups": groups, "time": s["time"] + 30, "world_size": 2}
    assert diagnose(snaps, 2) == (
        "rank 1 (stage 0, dp 0, tp 1) stopped progressing in F micro-batch 1 chunk 0 (busy in it for 30 s and still "
        "answering: a long or endless computation or loop); rank 0 waits for it in all_gather #2 (tp/shadow group)"
    )
