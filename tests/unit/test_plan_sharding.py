"""The planner's data-parallel sharding strategies (issue 31): per-rank state bytes and traffic of no_shard,
optim, optim_grads and optim_grads_params (HSDP too), the search's choice, and tools/plan.py's flags."""

from __future__ import annotations

import shlex
from dataclasses import replace

import pytest

from megalite.analysis.planner import (
    Hardware,
    Layout,
    data_parallel_seconds,
    estimate_memory,
    fsdp_transient_bytes,
    memory_per_rank,
    params_per_rank,
)
from megalite.analysis.search import plan
from megalite.config import ModelConfig
from megalite.config.arguments import parse_args
from tools.plan import PRESETS

LLAMA_7B = ModelConfig(seq_length=4096, params_dtype="bfloat16", attention_backend="auto", **PRESETS["llama2-7b"])
TINY = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256)


def layout(strategy: str, dp: int = 8, **kw) -> Layout:
    fsdp = strategy in ("optim_grads", "optim_grads_params")
    return Layout(1, 1, dp, dist_opt=strategy == "optim", sharding=strategy if fsdp else None, **kw)


@pytest.mark.parametrize("dtype,half", [("bfloat16", True), ("float32", False)])
def test_state_bytes_per_parameter_of_each_strategy(dtype, half):
    cfg = replace(TINY, params_dtype=dtype)
    n = params_per_rank(cfg, layout("no_shard"))[0]
    e, main = (2, 4) if half else (4, 0)
    expect = {
        "no_shard": (e, 4, 8 + main),
        "optim": (e, 4, (8 + main) / 4),
        "optim_grads": (1, 1, 2),  # the fp32 shard is the main weight: 4 + 4 + 8 bytes over 4 ranks
        "optim_grads_params": (1, 1, 2),
    }
    for strategy, (w, g, o) in expect.items():
        mem = memory_per_rank(cfg, layout(strategy, dp=4), 4)[0]
        assert (mem.weights, mem.grads, mem.optimizer) == pytest.approx((w * n, g * n, o * n)), strategy


def test_7b_at_dp8_fully_sharded_keeps_an_eighth_of_no_shard():
    plain, zero1, zero2, zero3 = (
        estimate_memory(LLAMA_7B, layout(s), 64) for s in ("no_shard", "optim", "optim_grads", "optim_grads_params")
    )
    assert plain.state / 8 * 0.85 < zero3.state < plain.state / 8  # 16 bytes / 8 against 18
    assert plain.state > zero1.state > zero2.state == zero3.state
    # optim_grads keeps the whole model gathered through the step; optim_grads_params a root and two layers
    n = params_per_rank(LLAMA_7B, layout("no_shard"))[0]
    assert 2 * n < zero2.gathered < 2 * n * 1.25 and 0 < zero3.gathered < zero2.gathered / 4
    assert plain.gathered == zero1.gathered == 0
    keep = estimate_memory(LLAMA_7B, layout("optim_grads_params", reshard=False), 64)
    assert keep.gathered == pytest.approx(zero2.gathered)


def test_shards_span_dp_x_cp_and_hsdp_shards_over_a_group():
    n = params_per_rank(TINY, layout("no_shard"))[0]
    cp = memory_per_rank(TINY, layout("optim_grads_params", dp=2, cp=2), 4)[0]
    assert cp.state == pytest.approx(16 * n / 4)
    hsdp = layout("optim_grads_params", dp=8, instances=2)
    assert hsdp.shard_ways == 4 and memory_per_rank(TINY, hsdp, 8)[0].state == pytest.approx(16 * n / 4)
    assert "--num-distributed-optimizer-instances" in hsdp.flags(4) and "hsdp2" in hsdp.describe()
    one = layout("optim_grads_params", dp=1)  # one replica: nothing to shard, the Trainer runs no FSDP
    assert one.strategy == "no_shard" and fsdp_transient_bytes(TINY, one) == [0.0]


def test_traffic_of_each_strategy():
    slow = Hardware(intra_node_gbps=0.001, inter_node_gbps=0.001)  # nothing hides behind compute
    n, m = params_per_rank(TINY, layout("no_shard"))[0], 4
    ring = 7 / 8 / 1e6  # seconds per byte of a full tensor over 8 ranks at 1 MB/s

    def secs(strategy, **kw):
        return data_parallel_seconds(TINY, layout(strategy, **kw), slow, m, 0.0, 0.0)

    assert secs("no_shard") == pytest.approx(ring * 2 * 4 * n)  # fp32 all-reduce
    assert secs("optim") == pytest.approx(ring * 8 * n)  # fp32 reduce-scatter + fp32 weights gathered
    assert secs("optim_grads") == pytest.approx(ring * (m * 4 * n + 4 * n))  # reduce-scatter per micro-batch
    assert secs("optim_grads_params") == pytest.approx(ring * m * (4 + 2 * 4) * n)  # + a gather per F and B
    assert secs("optim_grads_params", reshard=False) == pytest.approx(ring * m * (4 + 4) * n)
    hsdp = secs("optim_grads_params", instances=2) - data_parallel_seconds(
        TINY, layout("optim_grads_params", dp=4), slow, m, 0.0, 0.0
    )
    assert hsdp == pytest.approx(2 * 1 / 2 * 4 * n / 4 / 1e6)  # the shards' all-reduce over 2 replicas
    # behind compute that is long enough, FSDP's per-micro-batch traffic costs nothing
    assert data_parallel_seconds(TINY, layout("optim_grads_params"), slow, m, 1e9, 1e9) == 0.0


@pytest.mark.slow
def test_search_picks_a_sharded_strategy_at_tp1_on_80gb(capsys):
    plans = plan(LLAMA_7B, 8, 80, 64, micro_batches=(1,), max_vp=1)
    tp1 = [p for p in plans if p.layout.tp == 1 and p.layout.pp == 1]
    assert tp1 and all(p.layout.strategy != "no_shard" for p in tp1)  # 18 bytes a parameter: no fit at tp 1
    # ZeRO-1 fits only with full recompute; sharding gradients and weights too needs none, so it is faster
    assert all(p.layout.fsdp or p.layout.recompute == "full" for p in tp1)
    best = plans[0].layout
    assert best.tp == 1 and best.recompute == "none" and best.strategy in ("optim_grads", "optim_grads_params")
    plain = estimate_memory(LLAMA_7B, layout("no_shard"), 64)
    assert plain.total > 80 * 2**30 > plans[0].memory.total
    from tools.plan import main

    args = ["--num-gpus", "8", "--gpu-memory", "80", "--model-size", "llama2-7b"]
    args += ["--global-batch-size", "64", "--seq-length", "4096", "--top", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "data-parallel sharding: optim_grads" in out
    command = out.strip().splitlines()[-1]
    argv = shlex.split(command.split("pretrain_gpt.py", 1)[1])
    assert "--data-parallel-sharding-strategy" in argv
    cfg = parse_args(argv + ["--mock-data", "--vocab-size", "32000"], world_size=8)  # pretrain_gpt.py takes it
    assert cfg.optim.fsdp and cfg.optim.sharding == argv[argv.index("--data-parallel-sharding-strategy") + 1]


BASE = ["--num-gpus", "8", "--gpu-memory", "80", "--model-size", "gpt3-125m", "--global-batch-size", "8"]
BASE += ["--seq-length", "128", "--top", "1"]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--no-reshard-after-forward", "--data-parallel-sharding-strategy", "optim"], "applies to"),
        (["--num-distributed-optimizer-instances", "2", "--data-parallel-sharding-strategy", "optim"], "needs"),
        (["--num-distributed-optimizer-instances", "3"], "does not divide --num-gpus 8"),
        (["--data-parallel-sharding-strategy", "zero3"], "invalid choice"),
        (["--num-distributed-optimizer-instances", "0"], "--num-distributed-optimizer-instances"),
    ],
)
def test_plan_refuses_bad_sharding_flags_in_one_line(extra, message, capsys):
    from tools.plan import main

    try:
        code = main(BASE + extra)
    except SystemExit as e:  # argparse's own refusals (choices, ranges)
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_plan_searches_only_the_strategies_asked(capsys):
    from tools.plan import main

    assert main(BASE + ["--data-parallel-sharding-strategy", "optim_grads_params", "--no-reshard-after-forward"]) == 0
    out = capsys.readouterr().out
    assert "--data-parallel-sharding-strategy optim_grads_params --no-reshard-after-forward" in out


def _measure(ps, cfg):
    """This rank's resident weights, gradients and optimizer state after a step, and the planner's."""
    from megalite.analysis.plan_check import layout_of, resident_state_bytes
    from megalite.training import Trainer
    from megalite.training.mock import MockFeed

    trainer = Trainer(cfg, ps)
    trainer.train_step(MockFeed(trainer, 1).next())
    est = memory_per_rank(cfg.model, layout_of(cfg, trainer.settings), cfg.train.global_batch_size, "cpu")
    return sum(resident_state_bytes(trainer)), est[ps.pp_rank].state


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy,model,parallel",
    [
        ("optim_grads", {}, dict(tp=2, sequence_parallel=True)),  # FSDP shards the TP-local tensors
        ("optim_grads_params", {"num_experts": 4, "moe_ffn_hidden_size": 48}, dict(ep=2)),  # experts over edp 2
        ("optim_grads_params", {}, dict(num_distributed_optimizer_instances=2)),  # HSDP: 2 copies of 2 shards
    ],
)
def test_planner_state_equals_the_trainers_under_fsdp(strategy, model, parallel, run_distributed):
    from tests.helpers.parity import LLAMA_STYLE, tiny_config

    cfg = tiny_config({**LLAMA_STYLE, **model, "params_dtype": "bfloat16"}, gbs=8, mbs=2, num_layers=2)
    parallel = dict(parallel)  # the parametrized dict is shared: leave it whole
    instances = parallel.pop("num_distributed_optimizer_instances", 1)
    cfg = cfg.with_(
        optim=replace(
            cfg.optim, data_parallel_sharding_strategy=strategy, num_distributed_optimizer_instances=instances
        ),
        parallel=replace(cfg.parallel, **parallel),
    )
    for got, est in run_distributed(_measure, 4, cfg, tp=parallel.get("tp", 1), ep=parallel.get("ep", 1)):
        assert got == pytest.approx(est, rel=0.05)  # FSDP gives the first ranks ceil(rows / dp) rows
