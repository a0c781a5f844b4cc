"""Simulator: formulas, deadlock and mismatch detection, timeline, plot tool."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from megalite.pipeline.schedules import (
    Comm,
    Compute,
    P2POp,
    add_communication,
    build_1f1b,
    build_schedule,
    interleaved_warmup,
)
from megalite.pipeline.simulate import (
    DeadlockError,
    ScheduleError,
    simulate,
    simulate_schedule,
    timeline_bubble,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
            assert simulate_schedule("1f1b", pp, 1, m).peak_in_flight == \
                [min(pp - rank, m) for rank in range(pp)]
    assert simulate_schedule("gpipe", 3, 2, 5).peak_in_flight == [10] * 3
    for pp, vp, m in [(4, 2, 8), (2, 3, 4), (4, 2, 4), (3, 4, 9)]:
        # warmup forwards plus the first steady forward are in flight before the first backward
        assert simulate_schedule("interleaved_1f1b", pp, vp, m).peak_in_flight == \
            [min(interleaved_warmup(pp, vp, m, rank) + 1, m * vp) for rank in range(pp)]


def test_costs_scale_with_vp():
    r = simulate_schedule("interleaved_1f1b", 2, 2, 2, f_cost=1.0, b_cost=2.0)
    durations = {(e["kind"]): e["end"] - e["start"] for e in r.events}
    assert durations == {"F": 0.5, "B": 1.0}


def test_deadlock_both_ranks_wait_to_receive():
    recv_b = Comm((P2POp("recv", "B", 0, 1, 0, 1),))
    send_f = Comm((P2POp("send", "F", 0, 0, 1, 1),))
    actions = [
        [Compute("F", 0, 0), recv_b, send_f, Compute("B", 0, 0)],
        [Comm((P2POp("recv", "F", 0, 0, 1, 0),)), Compute("F", 0, 0), Compute("B", 0, 0),
         Comm((P2POp("send", "B", 0, 1, 0, 0),))],
    ]
    with pytest.raises(DeadlockError) as err:
        simulate(actions, 2, 1)
    msg = str(err.value)
    assert "rank 0 at action 1 [rB0<-1]" in msg and "rank 1 at action 0 [rF0<-0]" in msg


def test_mismatch_when_one_side_swaps_microbatch_order():
    swapped = [[Compute(a.kind, 1 - a.mb, a.chunk) for a in build_1f1b(2, 2)[1]]]
    compute = [build_1f1b(2, 2)[0]] + swapped
    actions = add_communication(compute, 2, 1)
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
    assert {k: t[k] for k in ("schedule", "pp", "vp", "m", "source")} == \
        {"schedule": "1f1b", "pp": 4, "vp": 1, "m": 8, "source": "simulated"}
    assert len(t["events"]) == 4 * 2 * 8
    assert set(t["events"][0]) == {"rank", "kind", "mb", "chunk", "start", "end"}
    assert timeline_bubble(t) == pytest.approx(r.bubble_fraction)


def _run_tool(*args):
    return subprocess.run([sys.executable, "tools/plot_pipeline.py", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


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
    assert tool.main(["--schedule", "interleaved_1f1b", "--pp", "2", "--vp", "2",
                      "--num-microbatches", "4", "--out", str(png), "--save-json", str(js),
                      "--print"]) == 0
    assert "rank 0: F0.0" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert json.loads(js.read_text())["source"] == "simulated"
    assert tool.main(["--timeline", str(js), "--out", str(png2)]) == 0
    assert png2.read_bytes()[:4] == b"\x89PNG" and png2.stat().st_size > 1000


def test_plot_tool_rejects_bad_schedule(tmp_path):
    out = _run_tool("--schedule", "interleaved_1f1b", "--pp", "4", "--vp", "2",
                    "--num-microbatches", "6", "--print")
    assert out.returncode == 2 and "a multiple of --pipeline-model-parallel-size (4)" in out.stderr


def test_stage_costs_model_a_heavier_last_stage():
    from megalite.pipeline.simulate import simulate_schedule

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
