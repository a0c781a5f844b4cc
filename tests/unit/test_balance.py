"""Balanced stages: general per-stage splits, the split search, the measurement, the flags."""

import itertools
import random
from dataclasses import replace

import pytest
import torch

from megalite.analysis.balance import LayerCosts, _simulator_options, choose_split, even_split, stage_costs
from megalite.analysis.measure import measure_layer_costs, plan_for
from megalite.analysis.simulate import simulate
from megalite.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from megalite.config.arguments import parse_args
from megalite.config.settings import resolve_settings
from megalite.parallel.state import ParallelState
from megalite.pipeline.partition import stage_layer_counts, validate_partition
from megalite.pipeline.registry import SCHEDULES, build_schedule
from megalite.pipeline.stage_layout import StageLayout


# -- partition: a general split --------------------------------------------------------------------
def test_stage_layers_fill_stages_in_stage_order():
    # pp=2, vp=2: stage s = chunk * pp + rank holds the s-th run of layers
    layout = {
        (r, c): list(StageLayout(2, 2).layers(8, r, c, stage_layers=(3, 1, 2, 2))) for r in range(2) for c in range(2)
    }
    assert layout == {(0, 0): [0, 1, 2], (1, 0): [3], (0, 1): [4, 5], (1, 1): [6, 7]}
    assert stage_layer_counts(10, 4, 1, first=1, last=3) == [1, 3, 3, 3]
    assert stage_layer_counts(16, 4, 2) == [2] * 8


@pytest.mark.parametrize(
    "args, message",
    [
        ((8, 2, 1, None, None, (3, 4)), "sums to 7 layers, not --num-layers=8"),
        ((8, 2, 1, None, None, (8,)), "has 1 entries; it needs one per virtual pipeline stage (pp x vp = 2 x 1 = 2)"),
        ((8, 2, 1, None, None, (8, 0)), "gives stage 1 0 layers"),
        ((8, 2, 1, 3, None, (4, 4)), "are exclusive"),
        ((8, 1, 1, None, None, (8,)), "needs --pipeline-model-parallel-size > 1"),
    ],
)
def test_bad_stage_layers_are_one_line_errors(args, message):
    with pytest.raises(ValueError) as e:
        validate_partition(*args)
    assert message in str(e.value) and "--pipeline-stage-layers" in str(e.value) and "\n" not in str(e.value)


# -- the search --------------------------------------------------------------------------------------
def _schedules(vp):
    """Every schedule with a backward for this vp, the zero-bubble ones too once they exist."""
    if vp == 1:
        return [s for s in ("1f1b", "gpipe", "zb_h1") if s in SCHEDULES]
    return [s for s in ("interleaved_1f1b", "gpipe", "zbv") if s in SCHEDULES]


def _random_costs(rng):
    """Layer costs 1/2 (forward/backward, jittered), embedding and head anywhere from free to 6 layers."""
    f = rng.uniform(0.5, 1.5)
    return LayerCosts(
        (rng.uniform(0, 2) * f, rng.uniform(0, 4) * f),
        (f, rng.uniform(1.5, 2.5) * f),
        (rng.uniform(0, 6) * f, rng.uniform(0, 12) * f),
    )


def _simulated(schedule, pp, vp, m, counts, costs, overlap=False):
    """A fresh simulation of the split, under the placement and mode the search uses."""
    return simulate(
        build_schedule(schedule, pp, vp, m, overlap_p2p=overlap),
        pp,
        vp,
        stage_costs=stage_costs(counts, costs),
        **_simulator_options(schedule, pp, vp),
    ).makespan


@pytest.mark.slow
def test_balanced_split_is_never_slower_than_even_and_deterministic():
    rng = random.Random(12)
    improved = cases = 0
    for pp in range(2, 9):
        for vp in (1, 2):
            layers = 2 * pp * vp
            for schedule in _schedules(vp):
                for m in (pp, 2 * pp) if pp <= 4 else (pp + vp * pp,):  # m = 2pp or 3pp when pp > 4
                    costs, overlap = _random_costs(rng), pp % 2 == 1  # odd pp: --overlap-p2p-communication
                    plan = choose_split(layers, pp, vp, m, schedule, costs, overlap_p2p=overlap)
                    counts = plan.chosen.counts
                    assert sum(counts) == layers and min(counts) >= 1 and len(counts) == pp * vp
                    assert plan.baseline.counts == (2,) * (pp * vp)
                    # checked by a simulation of its own, not the plan's numbers
                    even = _simulated(schedule, pp, vp, m, plan.baseline.counts, costs, overlap)
                    chosen = _simulated(schedule, pp, vp, m, counts, costs, overlap)
                    assert chosen <= even, (schedule, pp, vp, m, costs, counts)
                    assert abs(chosen - plan.chosen.step_time) <= 1e-9 * chosen
                    improved, cases = improved + (chosen < 0.99 * even), cases + 1
                    if pp in (2, 5, 8):  # same costs, same answer (a fresh search, nothing shared)
                        again = choose_split(
                            layers, pp, vp, m, schedule, LayerCosts.from_list(costs.as_list()), overlap_p2p=overlap
                        )
                        assert again == plan
    assert cases >= 50 and improved >= 0.75 * cases, (improved, cases)  # random end costs: most gain over 1%


def _compositions(total, parts):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        b = (0,) + cuts + (total,)
        yield tuple(b[i + 1] - b[i] for i in range(parts))


@pytest.mark.parametrize(
    "layers, pp, vp, m, schedule",
    [
        (10, 2, 1, 6, "1f1b"),
        (9, 3, 1, 6, "1f1b"),
        (10, 4, 1, 8, "1f1b"),
        (8, 2, 2, 4, "interleaved_1f1b"),
        (9, 3, 1, 3, "gpipe"),
    ],
)
def test_balanced_split_is_the_best_split_on_small_cases(layers, pp, vp, m, schedule):
    rng = random.Random(layers * 100 + pp * 10 + vp)
    for _ in range(3):
        costs = _random_costs(rng)
        plan = choose_split(layers, pp, vp, m, schedule, costs)
        best = min(_simulated(schedule, pp, vp, m, c, costs) for c in _compositions(layers, pp * vp))
        assert plan.chosen.step_time <= best * (1 + 1e-9), (costs, plan.chosen)


def test_heavy_output_layer_moves_layers_off_the_last_stage():
    costs = LayerCosts((0.1, 0.1), (1.0, 2.0), (4.0, 8.0))  # the head costs 4 layers
    plan = choose_split(8, 2, 1, 8, "1f1b", costs)
    assert plan.chosen.counts == (6, 2)  # 6 x 3 = 18.2 vs 2 x 3 + 12 = 18: the closest to equal
    assert plan.speedup > 1.2 and plan.chosen.bubble < plan.baseline.bubble
    text = plan.describe()
    assert "even      4,4 layers per stage" in text and "balanced  6,2 layers per stage" in text
    assert "training with --pipeline-stage-layers 6,2" in text and "bubble" in text


def test_equal_stages_stay_even():
    costs = LayerCosts((0.0, 0.0), (1.0, 2.0), (0.0, 0.0))
    for pp, vp, schedule in ((4, 1, "1f1b"), (4, 2, "interleaved_1f1b"), (3, 2, "gpipe")):
        plan = choose_split(4 * pp * vp, pp, vp, 2 * pp, schedule, costs)
        assert plan.chosen == plan.baseline and plan.speedup == 1.0


def test_layers_not_divisible_start_from_near_even():
    assert even_split(10, 4) == (3, 3, 2, 2)
    plan = choose_split(10, 4, 1, 8, "1f1b", LayerCosts((0, 0), (1, 2), (0, 0)))
    assert max(plan.chosen.counts) == 3 and plan.chosen.step_time <= plan.baseline.step_time
    with pytest.raises(ValueError, match="cannot give each of the pp x vp = 8 virtual stages a layer"):
        choose_split(7, 4, 2, 4, "interleaved_1f1b", LayerCosts((0, 0), (1, 2), (0, 0)))


def test_measured_weight_parts_reach_the_simulator():
    plain = LayerCosts((0.1, 0.2), (1.0, 2.0), (4.0, 8.0))
    split = LayerCosts((0.1, 0.2), (1.0, 2.0), (4.0, 8.0), weight=(0.0, 0.5, 6.0))
    assert LayerCosts.from_list(split.as_list()) == split and len(split.as_list()) == 9
    assert stage_costs((3, 1), plain) == [(3.1, 6.2), (5.0, 10.0)]
    assert stage_costs((3, 1), split) == [(3.1, 6.2, 1.5), (5.0, 10.0, 6.5)]
    assert "output layer + loss 4e+03/8e+03 (W 6e+03)" in split.describe()
    # B is the backward less W: a small measured W leaves a long B on the critical path
    light_w = LayerCosts((0.1, 0.2), (1.0, 2.0), (0.5, 1.0), weight=(0.0, 0.2, 0.1))
    half_w = LayerCosts((0.1, 0.2), (1.0, 2.0), (0.5, 1.0))
    a, b = (choose_split(8, 2, 1, 4, "zb_h1", c).baseline.step_time for c in (half_w, light_w))
    assert b > a * 1.05  # 58.1 -> 64.5: less of the backward can move into the gaps
    with pytest.raises(ValueError, match="6 or 9 numbers"):
        LayerCosts.from_list([1.0] * 7)


# -- measurement ----------------------------------------------------------------------------------
def _tiny(vocab=4096, **model):
    m = ModelConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        vocab_size=vocab,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        **model,
    )
    return Config(
        model=m,
        parallel=ParallelConfig(pp=2, pipeline_balance="measured"),
        train=TrainConfig(micro_batch_size=2, global_batch_size=8),
    )


@pytest.mark.parametrize(
    "model",
    [
        {},
        {
            "untie_embeddings_and_output_weights": True,
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "position_embedding_type": "rope",
        },
    ],
)
def test_measurement_times_every_kind_and_leaves_random_state_alone(model):
    cfg = _tiny(**model)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    costs = measure_layer_costs(cfg, ParallelState.single(), resolve_settings(cfg, 2), warmup=1, reps=2)
    assert torch.equal(torch.get_rng_state(), before)  # dropout masks of the run are untouched
    assert all(c > 0 for c in costs.as_list())
    plan = plan_for(cfg, resolve_settings(cfg, 2), costs)
    assert plan.m == 4 and plan.schedule == "1f1b" and sum(plan.chosen.counts) == 4
    assert costs.weight is None  # a whole backward: no W part


def test_split_backward_schedules_measure_the_weight_part():
    cfg = _tiny()
    cfg = cfg.with_(parallel=replace(cfg.parallel, pipeline_schedule="zb_h1"))
    costs = measure_layer_costs(cfg, ParallelState.single(), resolve_settings(cfg, 2), warmup=1, reps=2)
    w_emb, w_layer, w_head = costs.weight
    assert 0 < w_layer < costs.layer[1] and 0 < w_head < costs.head[1]  # the weight GEMMs, run in W
    assert w_emb < w_layer  # the embedding's gradient stays in B
    assert plan_for(cfg, resolve_settings(cfg, 2), costs).schedule == "zb_h1"


# -- flags ------------------------------------------------------------------------------------------
BASE = ["--mock-data", "--num-layers", "10", "--pipeline-model-parallel-size", "2"]


def test_flags_reach_the_config():
    cfg = parse_args(BASE + ["--pipeline-stage-layers", "7,3"], world_size=2)
    assert cfg.parallel.pipeline_stage_layers == (7, 3) and cfg.parallel.pipeline_balance == "even"
    cfg = parse_args(BASE + ["--pipeline-balance", "measured"], world_size=2)  # 10 % 2 == 0 not needed
    assert cfg.parallel.pipeline_balance == "measured" and cfg.parallel.pipeline_stage_layers is None


@pytest.mark.parametrize(
    "extra, world, message",
    [
        (["--pipeline-stage-layers", "7,x"], 2, "--pipeline-stage-layers: expected comma-separated layer counts"),
        (["--pipeline-stage-layers", "7,2"], 2, "--pipeline-stage-layers sums to 9 layers"),
        (["--pipeline-balance", "measured", "--pipeline-stage-layers", "7,3"], 2, "drop --pipeline-stage-layers"),
        (
            ["--pipeline-balance", "measured", "--decoder-last-pipeline-num-layers", "3"],
            2,
            "drop --decoder-last-pipeline-num-layers",
        ),
        (
            ["--pipeline-balance", "measured", "--pipeline-model-parallel-size", "1"],
            1,
            "--pipeline-balance measured needs --pipeline-model-parallel-size > 1",
        ),
        (
            [
                "--pipeline-balance",
                "measured",
                "--virtual-pipeline-model-parallel-size",
                "6",
                "--pipeline-schedule",
                "interleaved_1f1b",
                "--global-batch-size",
                "16",
            ],
            2,
            "needs --num-layers >= pp x vp = 12",
        ),
        (["--pipeline-balance", "fast"], 2, "--pipeline-balance: invalid choice"),
    ],
)
def test_bad_balance_flags_are_one_line_errors(extra, world, message):
    with pytest.raises(ConfigError) as e:
        parse_args(BASE + extra, world_size=world)
    assert message in str(e.value) and "\n" not in str(e.value)


# -- resuming a balanced run ------------------------------------------------------------------------
def test_resume_keeps_the_checkpoints_split_and_torch_format_compares_resolved_splits(tmp_path):
    """--pipeline-balance measured must not measure again on resume (noise could pick another split)."""
    import json

    from megalite.checkpointing import saved_stage_layers, stage_counts

    d = tmp_path / "iter_0000007"
    d.mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    layout = {"pp": 2, "vp": 1, "first": 0, "last": 0, "stage_layers": [6, 2]}
    (d / "meta.json").write_text(json.dumps({"layout": layout}))
    assert saved_stage_layers(str(tmp_path), None, 2, 1) == (6, 2)
    assert saved_stage_layers(str(tmp_path), None, 4, 1) is None  # another pipeline: measure
    assert saved_stage_layers(str(tmp_path / "none"), None, 2, 1) is None
    even_by_default = {"pp": 2, "vp": 1, "first": 0, "last": 0, "stage_layers": []}
    even_as_list = {**even_by_default, "stage_layers": [4, 4]}
    assert stage_counts(even_by_default, 8) == stage_counts(even_as_list, 8) == "4,4"
    assert stage_counts(layout, 8) == "6,2"
