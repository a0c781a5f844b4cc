"""Rank grid membership (Megatron's documented layout) and the one-place-for-groups rule."""
import re

import pytest

from megalite.parallel_state import ConfigError, ParallelState, grid_groups

from tests.conftest import REPO


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
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "megalite").rglob("*.py")
                 if p.name != "parallel_state.py" and pattern.search(p.read_text())]
    assert offenders == []
