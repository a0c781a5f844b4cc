"""Rank grid membership (Megatron's documented layout) and the one-place-for-groups rule."""

import re

import pytest

from megalite.config import ConfigError
from megalite.parallel.state import ParallelState, grid_groups
from tests.helpers import REPO


def test_world16_tp2_pp4_matches_megatron_example():
    g = grid_groups(16, tp=2, pp=4)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g["mp"] == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert g["embedding"] == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert g["position_embedding"] == [[0], [1], [2], [3]]


def test_world8_tp2_pp2_dp2():
    g = grid_groups(8, tp=2, pp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_every_rank_in_exactly_one_group_per_axis():
    for world, tp, pp in [(8, 2, 2), (12, 3, 2), (16, 4, 1), (6, 1, 3)]:
        g = grid_groups(world, tp, pp)
        for axis in ("tp", "dp", "pp", "mp"):
            flat = sorted(r for grp in g[axis] for r in grp)
            assert flat == list(range(world)), (axis, world, tp, pp)


def test_rank_coordinates_and_flags_without_communication():
    # create_groups=False builds the same views without torch.distributed.
    ps = ParallelState(16, rank=13, tp=2, pp=4, create_groups=False)
    assert (ps.tp_rank, ps.dp_rank, ps.pp_rank) == (1, 0, 3)  # 13 = 1 + 0*2 + 3*4
    assert ps.tp.ranks == [12, 13] and ps.dp.ranks == [13, 15] and ps.pp.ranks == [1, 5, 9, 13]
    assert ps.is_last_stage and not ps.is_first_stage
    assert ps.next_pp_rank == 1 and ps.prev_pp_rank == 9
    assert ps.embedding.ranks == [1, 13]


def test_world_not_divisible_is_one_line_error():
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by .* \(4\) x .* \(1\)"):
        grid_groups(6, tp=4, pp=1)


def test_only_parallel_state_creates_groups_or_asks_the_world():
    pattern = re.compile(r"\b(dist|torch\.distributed)\.(new_group|get_rank|get_world_size|init_process_group)\(")
    files = {p.relative_to(REPO).as_posix(): p.read_text() for p in (REPO / "megalite").rglob("*.py")}
    assert pattern.search(files["megalite/parallel/state.py"])  # the rule still names the right file
    offenders = [name for name, text in files.items() if name != "megalite/parallel/state.py" and pattern.search(text)]
    assert offenders == []


def test_world16_tp2_cp2_pp2_layout():
    # tp-cp-dp-pp: global = tp + cp*2 + dp*4 + pp*8 (the module docstring's picture).
    g = grid_groups(16, tp=2, pp=2, cp=2)
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert g["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g["pp"] == [[r, r + 8] for r in range(8)]
    assert g["mp"] == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    assert g["embedding"] == [[r, r + 8] for r in range(8)]
    ps = ParallelState(16, rank=13, tp=2, pp=2, cp=2, create_groups=False)
    assert (ps.tp_rank, ps.cp_rank, ps.dp_rank, ps.pp_rank) == (1, 0, 1, 1)  # 13 = 1 + 0*2 + 1*4 + 1*8
    assert ps.dp_cp.ranks == [9, 11, 13, 15] and ps.dp_cp_rank == 2  # cp fastest inside dp_cp
    assert "cp=0/2" in repr(ps)


@pytest.mark.parametrize("world,tp,cp,pp", [(16, 2, 2, 2), (8, 2, 2, 1), (16, 1, 4, 2), (24, 2, 3, 2)])
def test_cp_memberships_equal_megatron_core_rank_generator(world, tp, cp, pp):
    pytest.importorskip("megatron.core")
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order="tp-cp-dp-pp")
    ours = grid_groups(world, tp, pp, cp)
    for token, key in [("tp", "tp"), ("cp", "cp"), ("dp", "dp"), ("pp", "pp"), ("dp-cp", "dp_cp"), ("tp-pp", "mp")]:
        assert sorted(sorted(g) for g in gen.get_ranks(token)) == ours[key], token


def test_cp1_is_the_old_grid_and_shares_dp_communicator():
    for world, tp, pp in [(16, 2, 4), (8, 2, 2), (12, 3, 2)]:
        g = grid_groups(world, tp, pp)
        assert g["dp_cp"] == g["dp"] and g["cp"] == [[r] for r in range(world)]
    ps = ParallelState(16, rank=13, tp=2, pp=4, create_groups=False)
    assert ps.dp_cp.ranks == ps.dp.ranks and ps.dp_cp.handle is ps.dp.handle and ps.cp_size == 1 and ps.cp.ranks == [13]
    assert (ps.dp_cp.name, ps.dp.name) == ("dp_cp", "dp") and ps.dp_cp.recorder is ps.recorder


def test_world_not_divisible_by_cp_is_one_line_error():
    with pytest.raises(
        ConfigError,
        match=r"^world size 8 is not divisible by tensor-model-parallel-size \(2\) x "
        r"pipeline-model-parallel-size \(1\) x context-parallel-size \(3\); ",
    ):
        grid_groups(8, tp=2, pp=1, cp=3)


@pytest.mark.parametrize(
    "argv,world,message",
    [
        (
            ["--context-parallel-size", "4", "--tensor-model-parallel-size", "2"],
            4,
            r"^--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 1 x --context-parallel-size 4 = 8 ranks, "
            r"more than the world size 4; ",
        ),
        (["--context-parallel-size", "3"], 4, r"^world size 4 is not divisible by .* x context-parallel-size \(3\); "),
        (
            ["--context-parallel-size", "4", "--seq-length", "20", "--attention-dropout", "0"],
            4,
            r"^--seq-length 20 is not divisible by 2 x --context-parallel-size = 8 \(each CP rank",
        ),
        (
            [
                "--context-parallel-size",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--seq-length",
                "36",
                "--max-position-embeddings",
                "36",
                "--attention-dropout",
                "0",
            ],
            4,
            r"^--seq-length 36 is not divisible by 2 x --context-parallel-size x --tensor-model-parallel-size \(with "
            r"--sequence-parallel\) = 8 ",
        ),
        (
            [
                "--context-parallel-size",
                "4",
                "--cp-comm-type",
                "a2a",
                "--num-attention-heads",
                "2",
                "--hidden-size",
                "32",
            ],
            4,
            r"^--cp-comm-type a2a splits the heads of each rank over the CP group, but --num-attention-heads 2 / "
            r"--tensor-model-parallel-size 1 is not divisible by --context-parallel-size 4; use --cp-comm-type p2p or "
            r"all_gather$",
        ),
        (
            [
                "--context-parallel-size",
                "2",
                "--cp-comm-type",
                "a2a",
                "--group-query-attention",
                "--num-query-groups",
                "1",
            ],
            2,
            r"^--cp-comm-type a2a .* but --num-query-groups 1 / --tensor-model-parallel-size 1 is not divisible",
        ),
        (
            ["--context-parallel-size", "2"],
            2,
            r"^--cp-comm-type p2p \(ring attention\) does not support "
            r"--attention-dropout 0.1; set --attention-dropout 0 or use --cp-comm-type all_gather/a2a$",
        ),
        (["--cp-comm-type", "ring"], 1, r"invalid choice: 'ring'"),
    ],
)
def test_context_parallel_flags_refused_in_one_line(argv, world, message):
    from megalite.config.arguments import parse_args

    with pytest.raises((ConfigError, SystemExit)) as err:
        parse_args(["--mock-data", *argv], world_size=world)
    if err.type is ConfigError:
        assert "\n" not in str(err.value) and re.search(message, str(err.value)), str(err.value)


def test_context_parallel_flags_map_to_config_and_dp():
    from megalite.config.arguments import parse_args
    from megalite.config.settings import resolve_settings

    cfg = parse_args(
        [
            "--mock-data",
            "--context-parallel-size",
            "2",
            "--cp-comm-type",
            "all_gather",
            "--tensor-model-parallel-size",
            "2",
            "--global-batch-size",
            "16",
            "--micro-batch-size",
            "2",
            "--reset-position-ids",
            "--reset-attention-mask",
            "--eod-mask-loss",
        ],
        world_size=16,
    )
    assert (cfg.parallel.cp, cfg.parallel.cp_comm_type) == (2, "all_gather")
    assert cfg.data.reset_position_ids and cfg.data.reset_attention_mask and cfg.data.eod_mask_loss
    settings = resolve_settings(cfg, 16)
    assert (settings.dp, settings.num_microbatches) == (4, 2)  # dp = 16 / (tp 2 x cp 2): cp ranks share samples
    plain = parse_args(["--mock-data"], world_size=1)
    assert (plain.parallel.cp, plain.parallel.cp_comm_type) == (1, "p2p")
    assert not (plain.data.reset_position_ids or plain.data.reset_attention_mask or plain.data.eod_mask_loss)


def test_rank_grid_coordinates_and_groups():
    from megalite.parallel.grid import RankGrid

    grid = RankGrid((("tp", 2), ("cp", 1), ("dp", 2), ("pp", 4)))
    assert grid.world_size == 16 and grid.names == ("tp", "cp", "dp", "pp")
    assert grid.coords_of(13) == {"tp": 1, "cp": 0, "dp": 0, "pp": 3} and grid.rank_of({"tp": 1, "pp": 3}) == 13
    assert all(grid.rank_of(grid.coords_of(r)) == r for r in range(16))
    assert grid.groups(("tp", "pp")) == grid_groups(16, tp=2, pp=4)["mp"]
    assert grid.group_of(13, ("dp",)) == [13, 15] and grid.groups(()) == [[r] for r in range(16)]
    with pytest.raises(ValueError, match="unknown axes"):
        grid.groups(("ep",))


class _Groups:
    """A fake torch.distributed.new_group that numbers the communicators it is asked for."""

    def __init__(self, monkeypatch):
        import torch.distributed as dist

        self.calls = []
        monkeypatch.setattr(dist, "new_group", self.new_group)
        monkeypatch.setattr(dist, "is_initialized", lambda: True)

    def new_group(self, ranks=None, timeout=None, backend=None):
        self.calls.append((tuple(ranks), backend))
        return len(self.calls) - 1


@pytest.mark.parametrize(
    "world,tp,pp,cp,ep,etp", [(8, 2, 2, 1, 2, 1), (16, 2, 2, 2, 2, 2), (8, 1, 2, 2, 4, 1), (4, 1, 1, 1, 1, None)]
)
def test_expert_groups_are_created_up_front_the_same_on_every_rank(monkeypatch, world, tp, pp, cp, ep, etp):
    fake = _Groups(monkeypatch)
    per_rank = []
    for rank in range(world):
        fake.calls.clear()
        ps = ParallelState(world, rank, tp, pp, cp=cp, ep=ep, etp=etp, experts=True)
        made = list(fake.calls)
        ps.init_shadow_groups()
        assert (ps.ep.ranks, ps.edp.ranks, ps.stage.ranks) == tuple(
            next(g for g in ps.expert_memberships[a] if rank in g) for a in ("ep", "edp", "stage")
        )
        assert fake.calls[: len(made)] == made  # reading the expert axes created nothing more
        per_rank.append(list(fake.calls))
    assert all(calls == per_rank[0] for calls in per_rank)  # new_group is collective: same calls, same order
    every = {
        tuple(g) for part in (*ps.memberships.values(), *ps.expert_memberships.values()) for g in part if len(g) > 1
    }
    assert {ranks for ranks, _ in per_rank[0]} == every  # each multi-rank group has a communicator


def test_a_run_without_experts_creates_no_expert_group(monkeypatch):
    fake = _Groups(monkeypatch)
    dense = ParallelState(8, 5, tp=2, pp=2)
    assert {ranks for ranks, _ in fake.calls} == {
        tuple(g) for part in dense.memberships.values() for g in part if len(g) > 1
    }
    with pytest.raises(RuntimeError, match="no expert groups"):
        dense.ep
    assert dense.ep_size == 1 and dense.etp_size == 2 and dense.edp_size == 2  # the sizes are data
    assert ParallelState(8, 5, tp=2, pp=2, create_groups=False).ep.ranks == [5]  # views: every axis
    n = len(fake.calls)
    assert dense.background_group() == n and fake.calls[n] == (tuple(range(8)), "gloo")
    assert dense.background_group() == n and dense.background_dp_group() == n + 4  # after [0,2] [1,3] [4,6]: [5,7]


def test_shadow_groups_are_per_state_and_per_thread(monkeypatch):
    import threading

    _Groups(monkeypatch)
    ps = ParallelState(4, 1, tp=2, pp=1, ep=2, etp=1, experts=True)
    ps.init_shadow_groups()
    seen = []
    with ps.shadow_groups():
        worker = threading.Thread(target=lambda: seen.append(ps.tp.group))
        worker.start()
        worker.join()
        assert ps.tp.group == ps.tp.shadow != ps.tp.handle and ps.ep.group == ps.ep.shadow
    assert seen == [ps.tp.handle] and ps.tp.group == ps.tp.handle
