"""Simulator: formulas, deadlock and mismatch detection, timeline, plot tool."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from megalite.analysis.simulate import (
    DeadlockError,
    ScheduleError,
    simulate,
    simulate_schedule,
    timeline_bubble,
)
from megalite.pipeline.actions import Comm, Compute, P2POp
from megalite.pipeline.communication import add_communication
from megalite.pipeline.registry import build_schedule
from megalite.pipeline.schedules import build_1f1b, interleaved_warmup
from tests.helpers import REPO


def _approx_all(values, expected):
    return all(v == pytest.approx(expected) for v in values)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_and_busy_vp1(name):
    for pp in range(1, 9):
        for m in range(1, 4 * pp + 1):
            r = simulate_schedule(name, pp, 1, m)
            assert _approx_all(r.busy, 3.0 * m)
            assert _approx_all(r.bubble_fraction, (pp - 1) / m), (name, pp, m)
            assert r.makespan == pytest.approx(3.0 * (m + pp - 1))


def test_bubble_interleaved():
    for pp in range(2, 9):
        for vp in range(2, 5):
            for m in range(pp, 4 * pp + 1, pp):
                r = simulate_schedule("interleaved_1f1b", pp, vp, m)
                assert _approx_all(r.busy, 3.0 * m)
                assert _approx_all(r.bubble_fraction, (pp - 1) / (vp * m)), (pp, vp, m)


def test_peak_in_flight():
    for pp in range(1, 9):
        for m in range(1, 3 * pp + 1):
            assert simulate_schedule("gpipe", pp, 1, m).peak_in_flight == [m] * pp
            assert simulate_schedule("1f1b", pp, 1, m).peak_in_flight == [min(pp - rank, m) for rank in range(pp)]
    assert simulate_schedule("gpipe", 3, 2, 5).peak_in_flight == [10] * 3
    for pp, vp, m in [(4, 2, 8), (2, 3, 4), (4, 2, 4), (3, 4, 9)]:
        # warmup forwards plus the first steady forward are in flight before the first backward
        assert simulate_schedule("interleaved_1f1b", pp, vp, m).peak_in_flight == [
            min(interleaved_warmup(pp, vp, m, rank) + 1, m * vp) for rank in range(pp)
        ]


def test_costs_scale_with_vp():
    r = simulate_schedule("interleaved_1f1b", 2, 2, 2, f_cost=1.0, b_cost=2.0)
    durations = {(e["kind"]): e["end"] - e["start"] for e in r.events}
    assert durations == {"F": 0.5, "B": 1.0}


def test_deadlock_both_ranks_wait_to_receive():
    recv_b = Comm((P2POp("recv", "B", 0, 1, 0, 1),))
    send_f = Comm((P2POp("send", "F", 0, 0, 1, 1),))
    actions = [
        [Compute("F", 0, 0), recv_b, send_f, Compute("B", 0, 0)],
        [
            Comm((P2POp("recv", "F", 0, 0, 1, 0),)),
            Compute("F", 0, 0),
            Compute("B", 0, 0),
            Comm((P2POp("send", "B", 0, 1, 0, 0),)),
        ],
    ]
    with pytest.raises(DeadlockError) as err:
        simulate(actions, 2, 1)
    msg = str(err.value)
    assert "rank 0 at action 1 [rB0<-1]" in msg and "rank 1 at action 0 [rF0<-0]" in msg


def test_mismatch_when_one_side_swaps_microbatch_order():
    # add_communication posts receives in each channel's send order, so swap rank 1's list by hand
    def swap(a):
        if isinstance(a, Compute):
            return Compute(a.kind, 1 - a.mb, a.chunk)
        return Comm(tuple(P2POp(o.op, o.kind, 1 - o.mb, o.src_stage, o.dst_stage, o.peer) for o in a.ops))

    good = add_communication(build_1f1b(2, 2), 2, 1)
    actions = [good[0], [swap(a) for a in good[1]]]
    with pytest.raises(ScheduleError) as err:
        simulate(actions, 2, 1)
    msg = str(err.value)
    assert not isinstance(err.value, DeadlockError)
    assert "mismatch" in msg and "sends [sF0->1]" in msg and "receives [rF1<-0]" in msg
    assert "rank 0 action" in msg and "rank 1 action" in msg


def test_dataflow_errors():
    good = build_schedule("1f1b", 2, 1, 2)
    no_recv = [good[0], [a for a in good[1] if not isinstance(a, Comm)]]
    with pytest.raises(ScheduleError, match="forward before its input was received"):
        simulate(no_recv, 2, 1)
    missing_b = [good[0][:-1], good[1]]
    with pytest.raises(ScheduleError, match="never runs B1.0"):
        simulate(missing_b, 2, 1)
    twice = [good[0] + [Compute("F", 0, 0)], good[1]]
    with pytest.raises(ScheduleError, match="runs twice"):
        simulate(twice, 2, 1)
    with pytest.raises(ScheduleError, match="B0.0: compute outside kinds F,"):
        simulate(good, 2, 1, forward_only=True)
    b_first = [[Compute("B", 0, 0), Compute("F", 0, 0)]]
    with pytest.raises(ScheduleError, match="backward before its forward"):
        simulate(b_first, 1, 1)
    extra_send = [good[0] + [Comm((P2POp("send", "F", 1, 0, 1, 1),))], good[1]]
    with pytest.raises(ScheduleError, match="no matching recv"):
        simulate(extra_send, 2, 1)
    early_send = [[Comm((P2POp("send", "F", 0, 0, 1, 1),))] + good[0], good[1]]
    with pytest.raises(ScheduleError, match="before computing it"):
        simulate(early_send, 2, 1)
    wrong_peer = [[Comm((P2POp("recv", "B", 0, 1, 0, 0),))] + good[0], good[1]]
    with pytest.raises(ScheduleError, match="does not connect"):
        simulate(wrong_peer, 2, 1)


def test_timeline_format():
    r = simulate_schedule("1f1b", 4, 1, 8)
    t = json.loads(json.dumps(r.to_timeline()))
    assert {k: t[k] for k in ("schedule", "pp", "vp", "m", "source")} == {
        "schedule": "1f1b",
        "pp": 4,
        "vp": 1,
        "m": 8,
        "source": "simulated",
    }
    assert len(t["events"]) == 4 * 2 * 8
    assert set(t["events"][0]) == {"rank", "kind", "mb", "chunk", "start", "end"}
    assert timeline_bubble(t) == pytest.approx(r.bubble_fraction)


def _run_tool(*args):
    return subprocess.run(
        [sys.executable, "tools/plot_pipeline.py", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def _load_tool():
    path = os.path.join(REPO, "tools", "plot_pipeline.py")
    spec = importlib.util.spec_from_file_location("plot_pipeline", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_plot_tool_from_simulator_and_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png, js, png2 = tmp_path / "a.png", tmp_path / "a.json", tmp_path / "b.png"
    # in-process: a fresh interpreter per call would re-import matplotlib (slow);
    # running as a script is covered by test_plot_tool_rejects_bad_schedule.
    tool = _load_tool()
    assert (
        tool.main(
            [
                "--schedule",
                "interleaved_1f1b",
                "--pp",
                "2",
                "--vp",
                "2",
                "--num-microbatches",
                "4",
                "--out",
                str(png),
                "--save-json",
                str(js),
                "--print",
            ]
        )
        == 0
    )
    assert "rank 0: F0.0" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert json.loads(js.read_text())["source"] == "simulated"
    assert tool.main(["--timeline", str(js), "--out", str(png2)]) == 0
    assert png2.read_bytes()[:4] == b"\x89PNG" and png2.stat().st_size > 1000


def test_plot_tool_rejects_bad_schedule(tmp_path):
    out = _run_tool("--schedule", "interleaved_1f1b", "--pp", "4", "--vp", "2", "--num-microbatches", "6", "--print")
    assert out.returncode == 2 and "a multiple of --pipeline-model-parallel-size (4)" in out.stderr


def test_stage_costs_model_a_heavier_last_stage():
    even = simulate_schedule("1f1b", 2, 1, 8)
    same = simulate_schedule("1f1b", 2, 1, 8, stage_costs=[(1.0, 2.0), (1.0, 2.0)])
    assert same.makespan == even.makespan and same.bubble_fraction == even.bubble_fraction
    heavy = simulate_schedule("1f1b", 2, 1, 8, stage_costs=[(1.0, 2.0), (1.5, 3.0)])
    # The heavy stage sets the pace: 8 micro-batches x 4.5 plus the first stage's first forward
    # and last backward around it; the light stage idles more than in the even case.
    assert heavy.makespan == pytest.approx(8 * 4.5 + 1.0 + 2.0)
    assert heavy.bubble_fraction[0] > even.bubble_fraction[0] > heavy.bubble_fraction[1]
    with pytest.raises(Exception, match="stage_costs needs 2"):
        simulate_schedule("1f1b", 2, 1, 8, stage_costs=[(1.0, 2.0)])


# -- zero-bubble schedules and the executor's semantics ------------------------------------------


def test_zb_h1_bubble_is_a_third_of_1f1b_at_the_same_memory():
    """F = B = W = 1 (b_cost 2 split in half): 1F1B idles (pp-1)*3 units, ZB-H1 (pp-1)*1."""
    for pp in range(2, 9):
        for m in (pp, 2 * pp, 3 * pp):
            zb = simulate_schedule("zb_h1", pp, 1, m, mode="executor")
            one = simulate_schedule("1f1b", pp, 1, m, mode="executor")
            assert _approx_all(zb.bubble_fraction, (pp - 1) / (3 * m)), (pp, m, zb.bubble_fraction)
            assert _approx_all(one.bubble_fraction, (pp - 1) / m)
            assert max(zb.peak_in_flight) == max(one.peak_in_flight) == pp


def test_zbv_beats_zb_h1_with_1f1b_memory():
    for pp in range(2, 9):
        for m in (2 * pp, 3 * pp):
            v = simulate_schedule("zbv", pp, 2, m, mode="executor")
            h1 = simulate_schedule("zb_h1", pp, 1, m, mode="executor")
            assert max(v.bubble_fraction) < min(h1.bubble_fraction), (pp, m)
            assert max(v.peak_in_flight) <= 2 * pp  # chunks of half a rank: pp micro-batches, as 1F1B
            assert _approx_all(v.busy, 3.0 * m)


def test_executor_semantics_never_slower_than_rendezvous():
    for name, vp in (("1f1b", 1), ("interleaved_1f1b", 2), ("gpipe", 2), ("zb_h1", 1)):
        for pp in (2, 3, 4):
            for m in (pp, 2 * pp):
                strict = simulate_schedule(name, pp, vp, m)
                loose = simulate_schedule(name, pp, vp, m, mode="executor")
                assert loose.makespan <= strict.makespan + 1e-9, (name, pp, m)


def test_w_cost_and_three_part_stage_costs():
    r = simulate_schedule("zb_h1", 2, 1, 4, b_cost=2.0, w_cost=0.5)
    assert {e["end"] - e["start"] for e in r.events if e["kind"] == "W"} == {0.5}
    assert {e["end"] - e["start"] for e in r.events if e["kind"] == "B"} == {1.5}
    # The executor runs a lone first stage's backward whole in W (nothing waits for its B);
    # the other stages keep the split, and so does a V's first stage.
    r = simulate_schedule("zb_h1", 2, 1, 4, b_cost=2.0, w_cost=0.5, mode="executor")
    durations = {(e["rank"], e["kind"], e["end"] - e["start"]) for e in r.events if e["kind"] != "F"}
    assert durations == {(0, "B", 0.0), (0, "W", 2.0), (1, "B", 1.5), (1, "W", 0.5)}
    r = simulate_schedule("zbv", 2, 2, 4, b_cost=2.0, w_cost=0.5, mode="executor")
    assert {e["end"] - e["start"] for e in r.events if e["kind"] == "W"} == {0.25}
    costs = [(1.0, 2.0, 1.5), (1.0, 3.0, 1.0)]
    r = simulate_schedule("zb_h1", 2, 1, 2, stage_costs=costs, mode="executor")
    assert r.busy == [2 * 3.0, 2 * 4.0]


def _zb_h1(pp=2, m=2):
    return [list(rank) for rank in build_schedule("zb_h1", pp, 1, m)]


def test_broken_zero_bubble_lists_are_reported():
    actions = _zb_h1()
    w = next(i for i, a in enumerate(actions[1]) if isinstance(a, Compute) and a.kind == "W")
    b = next(i for i, a in enumerate(actions[1]) if isinstance(a, Compute) and a.kind == "B")
    early = [list(r) for r in actions]
    early[1].insert(b, early[1].pop(w))  # W before its B
    with pytest.raises(ScheduleError, match="weight gradient before its input-gradient backward"):
        simulate(early, 2, 1, mode="executor")
    missing = [list(r) for r in actions]
    del missing[0][next(i for i, a in enumerate(missing[0]) if isinstance(a, Compute) and a.kind == "W")]
    with pytest.raises(ScheduleError, match="never runs W"):
        simulate(missing, 2, 1, mode="executor")


def test_executor_semantics_deadlock_is_reported():
    # each rank reads a gradient before it posts the activation its peer needs to produce it
    f0, b0 = Compute("F", 0, 0), Compute("B", 0, 0)
    recv_b = Comm((P2POp("recv", "B", 0, 1, 0, 1),))
    send_f = Comm((P2POp("send", "F", 0, 0, 1, 1),))
    rank0 = [f0, recv_b, b0, send_f]  # B0 waits for rank 1's gradient, which needs sF0, posted after B0
    rank1 = [Comm((P2POp("recv", "F", 0, 0, 1, 0),)), f0, b0, Comm((P2POp("send", "B", 0, 1, 0, 0),))]
    with pytest.raises(DeadlockError, match="executor semantics"):
        simulate([rank0, rank1], 2, 1, mode="executor")


def test_plot_tool_draws_weight_gradients(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    tool = _load_tool()
    out = tmp_path / "zbv.png"
    assert (
        tool.main(
            [
                "--schedule",
                "zbv",
                "--pp",
                "2",
                "--vp",
                "2",
                "-m",
                "4",
                "--out",
                str(out),
                "--save-json",
                str(tmp_path / "t.json"),
            ]
        )
        == 0
    )
    events = json.load(open(tmp_path / "t.json"))["events"]
    assert {e["kind"] for e in events} == {"F", "B", "W"} and out.stat().st_size > 0
    assert tool._HATCH["W"] != tool._HATCH["B"] and tool._colour(0, "W") != tool._colour(0, "B")
