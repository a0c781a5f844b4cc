"""Schedules as data: builders, the registry, communication insertion, validation, text form."""

from collections import Counter

import pytest

from megalite.analysis.simulate import DeadlockError, simulate
from megalite.pipeline.actions import Comm, Compute, P2POp, format_schedule
from megalite.pipeline.communication import add_communication
from megalite.pipeline.registry import (
    SCHEDULES,
    ScheduleSpec,
    build_compute,
    build_schedule,
    default_schedule_name,
    get_schedule,
    layout_for,
    validate_schedule,
)
from megalite.pipeline.schedules import (
    build_1f1b,
    build_gpipe,
    build_interleaved_1f1b,
    build_no_pipelining,
    interleaved_warmup,
)
from megalite.pipeline.stage_layout import StageLayout
from megalite.pipeline.zero_bubble import greedy_schedule, step_time

SPLIT_BACKWARD = tuple(name for name, spec in SCHEDULES.items() if spec.split_backward)


def _ms(name, pp, vp):
    """Every m in 1..4*pp, except a sample for GPipe with vp > 1 (keeps the test fast)."""
    if name == "gpipe" and vp > 1:
        return sorted({m for m in (1, 2, pp - 1, pp, pp + 1, 2 * pp + 1, 4 * pp) if m >= 1})
    return range(1, 4 * pp + 1)


def _legal_configs(names=tuple(n for n in SCHEDULES if n not in SPLIT_BACKWARD)):
    for name in names:
        for pp in range(1, 9):
            for vp in range(1, 5):
                for m in _ms(name, pp, vp):
                    try:
                        validate_schedule(name, pp, vp, m)
                    except ValueError:
                        continue
                    yield name, pp, vp, m


def test_every_schedule_is_deadlock_free_and_complete():
    seen = Counter()
    for name, pp, vp, m in _legal_configs():
        actions = build_schedule(name, pp, vp, m)
        simulate(actions, pp, vp, schedule=name)  # raises on deadlock / mismatch / dataflow error
        for rank_actions in actions:
            computes = Counter((a.kind, a.mb, a.chunk) for a in rank_actions if isinstance(a, Compute))
            assert computes == Counter((k, mb, c) for k in "FB" for mb in range(m) for c in range(vp))
        seen[name] += 1
    assert seen["no_pipelining"] == 4 and seen["1f1b"] > 100
    assert seen["gpipe"] > 250 and seen["interleaved_1f1b"] > 50


def test_no_pipelining_is_gradient_accumulation():
    assert format_schedule(build_schedule("no_pipelining", 1, 1, 3)) == "rank 0: F0.0 B0.0 F1.0 B1.0 F2.0 B2.0"
    assert build_no_pipelining(2) == [[Compute("F", 0, 0), Compute("B", 0, 0), Compute("F", 1, 0), Compute("B", 1, 0)]]


def test_1f1b_pp2_m4_text():
    assert format_schedule(build_schedule("1f1b", 2, 1, 4)).splitlines() == [
        "rank 0: F0.0 [sF0->1] F1.0 [sF1->1 rB0<-1] B0.0 F2.0 [sF2->1 rB1<-1] B1.0 "
        "F3.0 [sF3->1 rB2<-1] B2.0 [rB3<-1] B3.0",
        "rank 1: [rF0<-0] F0.0 B0.0 [sB0->0 rF1<-0] F1.0 B1.0 [sB1->0 rF2<-0] F2.0 B2.0 "
        "[sB2->0 rF3<-0] F3.0 B3.0 [sB3->0]",
    ]


def test_1f1b_warmup_counts():
    for pp, m in [(4, 8), (4, 2), (8, 3)]:
        for rank, order in enumerate(build_1f1b(pp, m)):
            first_b = next(i for i, a in enumerate(order) if a.kind == "B")
            # warmup forwards plus the first steady forward precede the first backward
            assert first_b == min(pp - rank - 1, m) + (1 if pp - rank - 1 < m else 0)


def test_gpipe_all_forwards_first():
    for order in build_gpipe(3, 2, 4):
        kinds = "".join(a.kind for a in order)
        assert kinds == "F" * 8 + "B" * 8
    assert [(a.mb, a.chunk) for a in build_gpipe(2, 2, 3)[0][:6]] == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1)]


def test_interleaved_matches_megatron_order():
    pp, vp, m = 4, 2, 8
    order = build_interleaved_1f1b(pp, vp, m)
    fwd = [(a.mb, a.chunk) for a in order[0] if a.kind == "F"]
    assert fwd[:12] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1), (4, 0), (5, 0), (6, 0), (7, 0)]
    bwd = [(a.mb, a.chunk) for a in order[0] if a.kind == "B"]
    assert bwd[:5] == [(0, 1), (1, 1), (2, 1), (3, 1), (0, 0)]
    for rank in range(pp):
        warmup = interleaved_warmup(pp, vp, m, rank)
        assert warmup == min((pp - rank - 1) * 2 + (vp - 1) * pp, m * vp)
        assert all(a.kind == "F" for a in order[rank][:warmup])
        assert order[rank][warmup].kind == "F" and order[rank][warmup + 1].kind == "B"


def test_interleaved_steady_state_pairs_share_one_comm():
    actions = build_schedule("interleaved_1f1b", 2, 2, 4)[1]
    text = format_schedule(actions)
    assert "F2.0 B0.0 [sF2->0 sB0->0 rF3<-0 rB1<-0]" in text


def test_add_communication_rules():
    pp, vp = 3, 1
    actions = add_communication(build_1f1b(pp, 2), pp, vp)
    # middle rank: first a Comm with F0's recv, every compute followed by its sends
    assert actions[1][0] == Comm((P2POp("recv", "F", 0, 0, 1, 0),))
    assert actions[1][1] == Compute("F", 0, 0)
    assert actions[1][2].ops[0] == P2POp("send", "F", 0, 1, 2, 2)
    for rank_actions in actions:
        for comm in (a for a in rank_actions if isinstance(a, Comm)):
            assert comm.ops, "empty Comms are dropped"
            kinds = [op.op for op in comm.ops]
            assert kinds == sorted(kinds, key=lambda k: k != "send")  # sends first
    assert add_communication(build_1f1b(1, 2), 1, 1) == build_1f1b(1, 2)
    with pytest.raises(ValueError, match="expected compute lists for 2"):
        add_communication(build_1f1b(3, 2), 2, 1)


def test_registry_describes_every_schedule_once():
    assert list(SCHEDULES) == ["no_pipelining", "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev"]
    for name, spec in SCHEDULES.items():
        assert isinstance(spec, ScheduleSpec) and spec.name == name and get_schedule(name) is spec
        assert spec.description and "\n" not in spec.description
        assert layout_for(name, 4, 2 if spec.v_shape else 1).v_shape == spec.v_shape
    assert [n for n, s in SCHEDULES.items() if s.v_shape] == ["zbv", "dualpipev"]
    assert SPLIT_BACKWARD == ("zb_h1", "zbv", "dualpipev")
    with pytest.raises(ValueError, match="unknown pipeline schedule 'nope'; valid: no_pipelining, gpipe"):
        get_schedule("nope")
    assert layout_for(default_schedule_name(4, 2), 4, 2) == StageLayout(4, 2)  # the default: never a V


def test_default_schedule_name():
    assert default_schedule_name(1, 1) == "no_pipelining"
    assert default_schedule_name(4, 1) == "1f1b"
    assert default_schedule_name(4, 2) == "interleaved_1f1b"


@pytest.mark.parametrize(
    "name, pp, vp, m, text",
    [
        ("zero_bubble", 2, 1, 4, "valid: no_pipelining, gpipe, 1f1b, interleaved_1f1b"),
        ("interleaved_1f1b", 4, 2, 6, "a multiple of --pipeline-model-parallel-size (4)"),
        ("interleaved_1f1b", 4, 1, 8, "needs vp > 1"),
        ("1f1b", 4, 2, 8, "needs one chunk per rank (got --virtual-pipeline-model-parallel-size 2)"),
        ("zb_h1", 4, 2, 8, "needs one chunk per rank"),
        ("zbv", 4, 1, 8, "needs --virtual-pipeline-model-parallel-size 2 (got vp=1)"),
        ("zbv", 4, 3, 8, "needs --virtual-pipeline-model-parallel-size 2 (got vp=3)"),
        ("zbv", 1, 2, 8, "zbv needs --pipeline-model-parallel-size >= 2"),
        ("dualpipev", 4, 2, 7, "dualpipev needs at least 2 x pp = 8 micro-batches per step (got 7)"),
        ("dualpipev", 4, 1, 8, "needs --virtual-pipeline-model-parallel-size 2 (got vp=1)"),
        ("no_pipelining", 2, 1, 4, "needs pp=1"),
        ("gpipe", 1, 2, 4, "needs --pipeline-model-parallel-size > 1"),
        ("1f1b", 2, 1, 0, "must be >= 1"),
    ],
)
def test_validate_schedule_errors(name, pp, vp, m, text):
    with pytest.raises(ValueError) as err:
        validate_schedule(name, pp, vp, m)
    assert text in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError):
        build_schedule(name, pp, vp, m)


def test_small_m_is_legal_for_gpipe_and_1f1b():
    validate_schedule("1f1b", 8, 1, 1)
    validate_schedule("gpipe", 8, 3, 5)


def test_format_schedule_flat_list():
    assert format_schedule([Compute("F", 3, 1), Comm((P2POp("send", "F", 3, 5, 6, 2),))]) == "F3.1 [sF3->2]"


def test_forward_only_schedules_for_evaluation():
    for pp in range(1, 9):
        for vp in range(1, 5 if pp > 1 else 2):
            for m in (1, pp - 1, pp, pp + 1, 3 * pp):
                if m < 1:
                    continue
                actions = build_schedule("interleaved_1f1b", pp, vp, m, forward_only=True)
                r = simulate(actions, pp, vp, forward_only=True)
                assert all(a.kind == "F" for rank in actions for a in rank if isinstance(a, Compute))
                assert len(r.events) == pp * vp * m
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build_schedule("nope", 2, 1, 2, forward_only=True)


def test_interleaved_needs_paired_comms():
    # Why interleaved_groups exists: the one-Comm-per-action rule deadlocks here.
    with pytest.raises(DeadlockError):
        simulate(add_communication(build_interleaved_1f1b(2, 2, 4), 2, 2), 2, 2)
    simulate(build_schedule("interleaved_1f1b", 2, 2, 4), 2, 2)


# -- zero-bubble schedules (B: input gradients, W: weight gradients) -------------------------------


def test_zero_bubble_schedules_are_deadlock_free_under_executor_semantics():
    """The proof for zb_h1 (pp 1..8) and zbv (pp 2..8), m in 1..3pp, in the executor's model.

    zb_h1 is also proven under the conservative rendezvous model; zbv is not
    (its channels carry two streams, see test_zbv_needs_executor_semantics).
    """
    seen = Counter()
    for name, pp, vp, m in _legal_configs(SPLIT_BACKWARD):
        if m > 3 * pp:
            continue
        actions = build_schedule(name, pp, vp, m)
        layout = layout_for(name, pp, vp)
        simulate(actions, pp, vp, schedule=name, layout=layout, mode="executor")
        if name == "zb_h1":
            simulate(actions, pp, vp, schedule=name, layout=layout)
        for rank_actions in actions:
            computes = Counter((a.kind, a.mb, a.chunk) for a in rank_actions if isinstance(a, Compute))
            assert computes == Counter((k, mb, c) for k in "FBW" for mb in range(m) for c in range(vp))
        seen[name] += 1
    assert seen["zb_h1"] == sum(3 * pp for pp in range(1, 9)) and seen["zbv"] == sum(3 * pp for pp in range(2, 9))
    assert seen["dualpipev"] == sum(pp + 1 for pp in range(2, 9))  # m in 2pp..3pp


def _torch_dualpipev_order(pp, m):
    """torch.distributed.pipelining's ScheduleDualPipeV per-rank order, as megalite Computes.

    Its order is computed without a process group (the two attributes it reads are set by
    hand); an overlapped F&B pair becomes F then the backward, a whole backward B then W.
    """
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(sched, "ScheduleDualPipeV"):
        pytest.skip("this torch has no ScheduleDualPipeV")
    oracle = object.__new__(sched.ScheduleDualPipeV)
    oracle.pp_group_size, oracle._n_microbatches = pp, m
    T = sched._ComputationType
    out = []
    for rank in range(pp):
        order = []
        for action in oracle._calculate_single_rank_operations(rank):
            for a in action.sub_actions or (action,):
                chunk = 0 if a.stage_index < pp else 1
                kinds = {T.FORWARD: "F", T.BACKWARD_INPUT: "B", T.BACKWARD_WEIGHT: "W", T.FULL_BACKWARD: "BW"}
                order += [Compute(k, a.microbatch_index, chunk) for k in kinds[a.computation_type]]
        out.append(order)
    return out


def test_dualpipev_order_equals_torch_schedule_dualpipev():
    for pp in range(2, 9):
        for m in (2 * pp, 2 * pp + 1, 3 * pp, 4 * pp):
            assert build_compute("dualpipev", pp, 2, m) == _torch_dualpipev_order(pp, m), (pp, m)


def _torch_zbv_order(pp, m):
    """torch.distributed.pipelining's ScheduleZBVZeroBubble per-rank order (the paper's ZB-V phases)."""
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(sched, "ScheduleZBVZeroBubble"):
        pytest.skip("this torch has no ScheduleZBVZeroBubble")
    oracle = object.__new__(sched.ScheduleZBVZeroBubble)
    oracle.pp_group_size, oracle._n_microbatches, oracle.num_stages, oracle.n_local_stages = pp, m, 2 * pp, 2
    kinds = {
        sched._ComputationType.FORWARD: "F",
        sched._ComputationType.BACKWARD_INPUT: "B",
        sched._ComputationType.BACKWARD_WEIGHT: "W",
    }
    return [
        [
            Compute(kinds[a.computation_type], a.microbatch_index, 0 if a.stage_index < pp else 1)
            for a in oracle._calculate_single_rank_operations(rank)
            if a is not None
        ]
        for rank in range(pp)
    ]


def _simulated_zbv_time(order, layout, costs, max_alive):
    """The analysis simulator's step time of a V compute order, executor semantics (inf: over max_alive)."""
    f, b, w = costs
    r = simulate(
        add_communication(order, layout.pp, 2, None, layout),
        layout.pp,
        2,
        layout=layout,
        stage_costs=[(f, b + w, w)] * layout.num_stages,
        mode="executor",
    )
    return r.makespan if max(r.peak_in_flight) <= max_alive else float("inf")


@pytest.mark.slow
def test_zbv_is_the_papers_phase_order_unless_the_greedy_one_is_faster():
    """The builder's own timer (zero_bubble.step_time) never drifts from the analysis simulator.

    For pp 2..8 and m 1..4pp both candidate orders get the same step time from both, and the
    builder picks exactly the order the simulator's executor mode picks.
    """
    unit, chosen_phases = (1.0, 1.0, 1.0), 0
    for pp in range(2, 9):
        layout = layout_for("zbv", pp, 2)
        for m in range(1, 4 * pp + 1):
            phases, greedy = _torch_zbv_order(pp, m), greedy_schedule(layout, m, unit, 2 * pp)
            t_phases, t_greedy = (_simulated_zbv_time(o, layout, unit, 2 * pp) for o in (phases, greedy))
            assert (step_time(phases, layout, unit, 2 * pp), step_time(greedy, layout, unit, 2 * pp)) == (
                t_phases,
                t_greedy,
            ), (pp, m)
            got = build_compute("zbv", pp, 2, m)
            assert got == (phases if t_phases <= t_greedy else greedy), (pp, m)
            if m <= 3 * pp:
                chosen_phases += got == phases
                if pp < 8 and m > pp:
                    assert got == phases, (pp, m)
    assert chosen_phases == 69  # of 105 with m <= 3pp: all but m <= pp (35) and pp 8, m 11
    # e.g. pp 6, m 12: bubble 6.9% with the phases, 11.1% with the greedy order
    r = simulate(build_schedule("zbv", 6, 2, 12), 6, 2, layout=layout_for("zbv", 6, 2), mode="executor")
    assert max(r.bubble_fraction) == pytest.approx(2.5 / 36)


def test_zbv_step_time_with_unequal_costs_and_the_activation_cap():
    costs = (1.0, 1.3, 0.7)
    for pp in range(2, 6):
        layout = layout_for("zbv", pp, 2)
        for m in range(1, 4 * pp + 1, 3):
            for order in (_torch_zbv_order(pp, m), greedy_schedule(layout, m, costs, 2 * pp)):
                assert step_time(order, layout, costs, 2 * pp) == _simulated_zbv_time(order, layout, costs, 2 * pp)
    assert step_time(_torch_zbv_order(4, 8), layout_for("zbv", 4, 2), (1.0, 1.0, 1.0), 2) == float("inf")


def test_dualpipev_bubble_equals_zbv_for_one_more_activation():
    for pp in range(2, 9):
        for m in (2 * pp, 3 * pp):
            d = simulate(
                build_schedule("dualpipev", pp, 2, m), pp, 2, layout=layout_for("dualpipev", pp, 2), mode="executor"
            )
            v = simulate(build_schedule("zbv", pp, 2, m), pp, 2, layout=layout_for("zbv", pp, 2), mode="executor")
            assert max(d.bubble_fraction) == pytest.approx(max(v.bubble_fraction)), (pp, m)
            assert max(d.peak_in_flight) == 2 * pp + 1 and max(v.peak_in_flight) == 2 * pp, (pp, m)


def test_zb_h1_is_1f1b_order_with_held_back_weight_gradients():
    pp, m = 4, 8
    for rank, order in enumerate(build_compute("zb_h1", pp, 1, m)):
        fb = [a for a in order if a.kind != "W"]
        assert fb == [Compute("B" if a.kind == "B" else "F", a.mb, 0) for a in build_1f1b(pp, m)[rank]]
        kinds = "".join(a.kind for a in order)
        assert kinds.endswith("W" * (rank + 1))  # r held-back W's plus the last B's own
        assert kinds.count("W") == m and kinds.index("W") > kinds.index("B")


def test_zbv_runs_both_arms_of_the_v():
    order = build_compute("zbv", 2, 2, 4)
    layout = layout_for("zbv", 2, 2)
    assert [layout.stage(r, c) for r in range(2) for c in range(2)] == [0, 3, 1, 2]
    # rank 0 starts with forwards of the first arm; rank 1 turns the V: its chunk 1 reads its own chunk 0
    assert order[0][0] == Compute("F", 0, 0)
    assert Compute("F", 0, 1) in order[1]
    text = format_schedule(build_schedule("zbv", 2, 2, 4))
    assert "rF0<-0" in text.splitlines()[1] and "sF0->1" in text.splitlines()[0]
    lines = text.splitlines()  # the turn is handed over in memory, never sent to oneself
    assert "->1" not in lines[1] and "<-1" not in lines[1] and "->0" not in lines[0]


def test_zbv_needs_executor_semantics():
    # rank 0 -> 1 carries first-arm activations and second-arm gradients; receives follow the
    # sender's order, so a Comm may wait on a send posted much later: rendezvous deadlocks.
    actions = build_schedule("zbv", 2, 2, 4)
    with pytest.raises(DeadlockError):
        simulate(actions, 2, 2, layout=layout_for("zbv", 2, 2))
    simulate(actions, 2, 2, layout=layout_for("zbv", 2, 2), mode="executor")


def test_stage_layout_v_round_trip_and_layers():
    for pp in range(1, 9):
        for v in (False, True):
            layout = StageLayout(pp, 2, v_shape=v)
            stages = sorted(layout.stage(r, c) for r in range(pp) for c in range(2))
            assert stages == list(range(2 * pp))
            for s in stages:
                assert layout.stage(layout.rank_of(s), layout.chunk_of(s)) == s
    v = StageLayout(4, 2, v_shape=True)
    assert [v.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert list(v.layers(16, 0, 1)) == [14, 15] and list(v.layers(16, 3, 1)) == [8, 9]
    with pytest.raises(ValueError, match="not supported with the V-shaped"):
        v.layers(16, 0, 0, first=3)
    with pytest.raises(ValueError, match="exactly 2 chunks"):
        StageLayout(4, 3, v_shape=True)


# -- overlapped p2p (--overlap-p2p-communication) ----------------------------------------------------


def test_overlapped_placement_is_deadlock_free_under_executor_semantics():
    n = 0
    for name in SCHEDULES:
        for pp in range(1, 9):
            for vp in (1, 2, 3):
                for m in sorted({1, pp, 2 * pp + 1, 3 * pp}):
                    try:
                        validate_schedule(name, pp, vp, m)
                    except ValueError:
                        continue
                    layout = layout_for(name, pp, vp)
                    for forward_only in (False, True):
                        actions = build_schedule(name, pp, vp, m, forward_only=forward_only, overlap_p2p=True)
                        simulate(actions, pp, vp, layout=layout, mode="executor", forward_only=forward_only)
                        n += 1
    assert n > 300


def test_overlapped_sends_follow_their_compute_and_receives_come_one_compute_early():
    for name, pp, vp, m in (("interleaved_1f1b", 4, 2, 8), ("1f1b", 4, 1, 8), ("zbv", 4, 2, 8)):
        layout = layout_for(name, pp, vp)
        for rank, actions in enumerate(build_schedule(name, pp, vp, m, overlap_p2p=True)):
            computes = [i for i, a in enumerate(actions) if isinstance(a, Compute)]
            for k, i in enumerate(computes):
                a = actions[i]
                s = layout.stage(rank, a.chunk)
                dst = s + 1 if a.kind == "F" else s - 1
                if a.kind != "W" and 0 <= dst < layout.num_stages and layout.rank_of(dst) != rank:
                    nxt = actions[i + 1]
                    assert isinstance(nxt, Comm) and any(
                        o.op == "send" and o.mb == a.mb and o.src_stage == s for o in nxt.ops
                    ), (name, rank, a)
                src = s - 1 if a.kind == "F" else s + 1
                if a.kind != "W" and 0 <= src < layout.num_stages and layout.rank_of(src) != rank and k > 0:
                    posted = next(
                        j
                        for j, b in enumerate(actions)
                        if isinstance(b, Comm)
                        and any(
                            o.op == "recv" and o.kind == a.kind and o.mb == a.mb and o.dst_stage == s for o in b.ops
                        )
                    )
                    assert posted < computes[k - 1], (name, rank, a)  # before the compute before it
    # the interleaved pair Comm is gone: a forward's activation no longer waits for the paired backward
    text = format_schedule(build_schedule("interleaved_1f1b", 2, 2, 4, overlap_p2p=True)[1])
    assert "F2.0 [sF2->0" in text


def test_overlapped_placement_needs_executor_semantics():
    # a send posted right after its compute, alone, would block a rendezvous rank until the
    # receiver gets there: the conservative model deadlocks, the executor's does not
    actions = build_schedule("1f1b", 2, 1, 4, overlap_p2p=True)
    with pytest.raises(DeadlockError):
        simulate(actions, 2, 1)
    simulate(actions, 2, 1, mode="executor")
