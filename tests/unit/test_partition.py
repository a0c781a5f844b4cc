"""Layer partition over virtual stages, placed on (pipeline rank, chunk) by StageLayout (Megatron layout)."""

import pytest

from megalite.pipeline.partition import layers_of_stage, num_stages, validate_partition
from megalite.pipeline.stage_layout import StageLayout


def _layout(num_layers, pp, vp, first=None, last=None):
    return {
        (r, c): list(StageLayout(pp, vp).layers(num_layers, r, c, first, last)) for r in range(pp) for c in range(vp)
    }


def test_megatron_interleaved_example():
    layout = _layout(16, 4, 2)
    assert layout[(0, 0)] + layout[(0, 1)] == [0, 1, 8, 9]
    assert layout[(1, 0)] + layout[(1, 1)] == [2, 3, 10, 11]
    assert layout[(3, 0)] + layout[(3, 1)] == [6, 7, 14, 15]


def test_stage_helpers():
    assert num_stages(4, 2) == 8
    layout = StageLayout(4, 2)
    assert layout.stage(1, 1) == 5
    assert layout.rank_of(5) == 1 and layout.chunk_of(5) == 1
    with pytest.raises(ValueError):
        layout.stage(4, 0)
    assert list(layers_of_stage(16, 4, 2, 5)) == [10, 11]
    with pytest.raises(ValueError, match="out of range"):
        layers_of_stage(16, 4, 2, 8)


def test_uneven_first_last_vp1():
    layout = _layout(10, 4, 1, first=1, last=3)
    assert [layout[(r, 0)] for r in range(4)] == [[0], [1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert _layout(7, 3, 1, first=1)[(1, 0)] == [1, 2, 3]
    assert _layout(7, 3, 1, last=1)[(2, 0)] == [6]


def test_uneven_with_virtual_pipeline_follows_megatron_offsets():
    # first=2, last=4 over vp=2: rank 0 holds 1 layer per chunk, last rank 2,
    # the 12 middle layers go 3 per chunk over ranks 1 and 2.
    layout = _layout(18, 4, 2, first=2, last=4)
    assert [layout[(r, 0)] for r in range(4)] == [[0], [1, 2, 3], [4, 5, 6], [7, 8]]
    assert [layout[(r, 1)] for r in range(4)] == [[9], [10, 11, 12], [13, 14, 15], [16, 17]]


def test_uneven_pp2_both_given():
    layout = _layout(5, 2, 1, first=2, last=3)
    assert layout[(0, 0)] == [0, 1] and layout[(1, 0)] == [2, 3, 4]


@pytest.mark.parametrize(
    "args, flag",
    [
        ((10, 4, 1, None, None), "--num-layers=10 must be divisible"),
        ((16, 4, 3, None, None), "x vp=3"),
        ((8, 1, 2, None, None), "needs --pipeline-model-parallel-size > 1"),
        ((8, 1, 1, 2, None), "need --pipeline-model-parallel-size > 1"),
        ((8, 4, 1, 0, None), "leaves a pipeline stage empty"),
        ((8, 4, 1, 7, None), "too big"),
        ((8, 4, 1, 3, 4), "too big"),
        ((8, 4, 1, 1, None), "not divisible by 3 middle"),
        ((8, 4, 2, 3, None), "--decoder-first-pipeline-num-layers=3 must be divisible"),
        ((8, 4, 2, None, 1), "--decoder-last-pipeline-num-layers=1 must be divisible"),
        ((6, 2, 1, 2, 3), "must equal --num-layers=6"),
        ((0, 1, 1, None, None), "--num-layers must be >= 1"),
        ((8, 0, 1, None, None), "--pipeline-model-parallel-size must be >= 1"),
        ((8, 2, 0, None, None), "must be >= 1"),
    ],
)
def test_illegal_layouts(args, flag):
    with pytest.raises(ValueError) as err:
        validate_partition(*args)
    assert flag in str(err.value)
    assert "\n" not in str(err.value)


def _all_layouts():
    for num_layers in range(1, 25):
        for pp in range(1, 7):
            for vp in range(1, 5):
                for first in (None, 1, 2, 4):
                    for last in (None, 1, 2, 4):
                        try:
                            validate_partition(num_layers, pp, vp, first, last)
                        except ValueError:
                            continue
                        yield num_layers, pp, vp, first, last


def test_every_layer_exactly_once_in_stage_order():
    count = 0
    for num_layers, pp, vp, first, last in _all_layouts():
        count += 1
        by_stage = sorted(
            (StageLayout(pp, vp).stage(r, c), StageLayout(pp, vp).layers(num_layers, r, c, first, last))
            for r in range(pp)
            for c in range(vp)
        )
        flat = [layer for _, rng in by_stage for layer in rng]
        assert flat == list(range(num_layers)), (num_layers, pp, vp, first, last)
        assert all(len(rng) > 0 for _, rng in by_stage)
    assert count > 200
