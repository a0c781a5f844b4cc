"""Schedules as data: builders, communication insertion, validation, text form."""
from collections import Counter

import pytest

from megalite.pipeline.schedules import (
    SCHEDULES,
    Comm,
    Compute,
    P2POp,
    add_communication,
    build_1f1b,
    build_gpipe,
    build_interleaved_1f1b,
    build_no_pipelining,
    build_schedule,
    default_schedule_name,
    format_schedule,
    interleaved_warmup,
    validate_schedule,
)
from megalite.pipeline.simulate import DeadlockError, simulate


def _ms(name, pp, vp):
    """Every m in 1..4*pp, except a sample for GPipe with vp > 1 (keeps the test fast)."""
    if name == "gpipe" and vp > 1:
        return sorted({m for m in (1, 2, pp - 1, pp, pp + 1, 2 * pp + 1, 4 * pp) if m >= 1})
    return range(1, 4 * pp + 1)


def _legal_configs():
    for name in SCHEDULES:
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
    assert format_schedule(build_schedule("no_pipelining", 1, 1, 3)) == \
        "rank 0: F0.0 B0.0 F1.0 B1.0 F2.0 B2.0"
    assert build_no_pipelining(2) == [[Compute("F", 0, 0), Compute("B", 0, 0),
                                       Compute("F", 1, 0), Compute("B", 1, 0)]]


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
    assert [(a.mb, a.chunk) for a in build_gpipe(2, 2, 3)[0][:6]] == \
        [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1)]


def test_interleaved_matches_megatron_order():
    pp, vp, m = 4, 2, 8
    order = build_interleaved_1f1b(pp, vp, m)
    fwd = [(a.mb, a.chunk) for a in order[0] if a.kind == "F"]
    assert fwd[:12] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1),
                        (4, 0), (5, 0), (6, 0), (7, 0)]
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


def test_default_schedule_name():
    assert default_schedule_name(1, 1) == "no_pipelining"
    assert default_schedule_name(4, 1) == "1f1b"
    assert default_schedule_name(4, 2) == "interleaved_1f1b"


@pytest.mark.parametrize("name, pp, vp, m, text", [
    ("zero_bubble", 2, 1, 4, "valid: no_pipelining, gpipe, 1f1b, interleaved_1f1b"),
    ("interleaved_1f1b", 4, 2, 6, "a multiple of --pipeline-model-parallel-size (4)"),
    ("interleaved_1f1b", 4, 1, 8, "needs vp > 1"),
    ("1f1b", 4, 2, 8, "needs vp=1"),
    ("no_pipelining", 2, 1, 4, "needs pp=1"),
    ("gpipe", 1, 2, 4, "needs --pipeline-model-parallel-size > 1"),
    ("1f1b", 2, 1, 0, "must be >= 1"),
])
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
    assert format_schedule([Compute("F", 3, 1), Comm((P2POp("send", "F", 3, 5, 6, 2),))]) == \
        "F3.1 [sF3->2]"


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
