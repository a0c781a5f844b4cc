"""The planner with experts: weights, gradient buffers and optimizer state against the real Trainer's
(one process, and expert parallelism with the distributed optimizer on gloo ranks), the search over
expert-parallel sizes, tools/plan.py's MoE flags and preset, --plan-check's layout of an MoE run."""

from __future__ import annotations

import shlex
from dataclasses import replace

import pytest

from megalite.analysis.moe_plan import dispatch_bytes_per_layer
from megalite.analysis.plan_check import layout_of
from megalite.analysis.planner import Hardware, Layout, estimate_memory, estimate_step_time, memory_per_rank
from megalite.analysis.search import candidate_layouts, plan
from megalite.config import ModelConfig
from megalite.config.arguments import parse_args
from megalite.config.settings import resolve_settings
from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from megalite.training.mock import MockFeed
from tests.helpers.parity import LLAMA_STYLE, tiny_config

MOE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_ffn_hidden_size=48)


def moe_cfg(model=None, dist_opt=False, **parallel):
    cfg = tiny_config({**LLAMA_STYLE, **MOE, **(model or {})}, gbs=8, mbs=2, num_layers=2)
    cfg = cfg.with_(optim=replace(cfg.optim, use_distributed_optimizer=dist_opt))
    return cfg.with_(parallel=replace(cfg.parallel, **parallel)) if parallel else cfg


def measure(ps: ParallelState, cfg):
    """This rank's bytes after one step: weights, gradient buffers (dense and experts'), optimizer state;
    and the planner's for the same layout and pipeline rank."""
    trainer = Trainer(cfg, ps)
    trainer.train_step(MockFeed(trainer, 1).next())
    buffers = trainer.optimizer.grads.parts
    got = {
        "weights": sum(p.numel() * p.element_size() for p in trainer.params),
        "grads": sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
        "optimizer": trainer.optimizer.state_bytes(),
    }
    layout = layout_of(cfg, resolve_settings(cfg, ps.world_size))
    est = memory_per_rank(cfg.model, layout, cfg.train.global_batch_size, "cpu")[ps.pp_rank]
    return got, {"weights": est.weights, "grads": est.grads, "optimizer": est.optimizer}, layout


def _check(got, est, sharded=False):
    assert est["weights"] == got["weights"]
    # ZeRO-1: each rank's shard of the padded buckets holds within a few elements of 1/dp of them
    assert est["optimizer"] == (pytest.approx(got["optimizer"], rel=5e-3) if sharded else got["optimizer"])
    assert est["grads"] == pytest.approx(got["grads"], rel=5e-3)  # the buffers pad each bucket to dp x 64 elements


@pytest.mark.parametrize(
    "model",
    [
        {},
        {"params_dtype": "bfloat16"},
        {"moe_layer_freq": 2, "moe_shared_expert_intermediate_size": 32, "params_dtype": "bfloat16"},
        {"moe_shared_expert_intermediate_size": 32, "moe_shared_expert_gate": True},
        {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True, "params_dtype": "bfloat16"},
        {"add_bias_linear": True, "swiglu": False, "normalization": "LayerNorm"},
    ],
)
def test_state_bytes_equal_the_trainers_in_one_process(model):
    got, est, _ = measure(ParallelState.single(), moe_cfg(model))
    _check(got, est)


@pytest.mark.parametrize(
    "world,tp,ep,etp,dist_opt", [(4, 1, 2, None, True), (4, 2, 2, 1, True), (2, 1, 2, None, False)]
)
def test_state_bytes_with_expert_parallelism_equal_the_trainers(world, tp, ep, etp, dist_opt, run_distributed):
    cfg = moe_cfg(
        {"params_dtype": "bfloat16"},
        dist_opt=dist_opt,
        tp=tp,
        ep=ep,
        etp=etp,
        sequence_parallel=tp > 1,
        moe_token_dispatcher_type="alltoall",
    )
    results = run_distributed(measure, world, cfg, tp=tp, ep=ep, etp=etp)
    for got, est, layout in results:
        assert (layout.ep, layout.expert_tp) == (ep, etp or tp)
        _check(got, est, sharded=dist_opt)
    if dist_opt:  # experts' Adam state is sharded over expert-DP, so it is below the unsharded count
        plain = memory_per_rank(cfg.model, replace(results[0][2], dist_opt=False), 8, "cpu")[0]
        assert results[0][1]["optimizer"] < plain.optimizer


MIXTRAL_SMALL = dict(
    num_layers=8,
    hidden_size=1024,
    num_attention_heads=16,
    num_query_groups=4,
    ffn_hidden_size=3584,
    seq_length=2048,
    vocab_size=32000,
    params_dtype="bfloat16",
    num_experts=8,
    moe_router_topk=2,
    **{k: v for k, v in LLAMA_STYLE.items() if k != "num_query_groups"},
)


def test_experts_split_over_ep_and_their_buffers():
    cfg = ModelConfig(**MIXTRAL_SMALL)
    one, four = (estimate_memory(cfg, Layout(1, 1, 8, ep=ep, moe_dispatcher="alltoall"), 64) for ep in (1, 4))
    dense = replace(cfg, num_experts=None)
    base = estimate_memory(dense, Layout(1, 1, 8), 64)
    # all 8 experts on one rank: ~8x the dense MLP weights; split over 4: a quarter of the experts
    assert one.weights > four.weights > base.weights
    zero = estimate_memory(cfg, Layout(1, 1, 8, ep=4, dist_opt=True, moe_dispatcher="alltoall"), 64)
    assert zero.optimizer < four.optimizer  # dense over dp 8, experts over expert-DP 2
    gather = estimate_memory(cfg, Layout(1, 1, 8, ep=4), 64)
    assert gather.activations > four.activations  # the all-gathered tokens of the expert-MP group
    # top-2 routing through experts of the dense MLP's size: more activation memory than the dense model
    assert one.activations > base.activations
    assert dispatch_bytes_per_layer(cfg, 1024, 1, 1, "alltoall", 2) == 0  # no exchange without a group
    assert (
        0
        < dispatch_bytes_per_layer(cfg, 1024, 4, 1, "alltoall", 2)
        < dispatch_bytes_per_layer(cfg, 1024, 4, 1, "allgather", 2)
    )
    slow, fast = (
        estimate_step_time(
            cfg,
            Layout(1, 1, 8, ep=8, moe_dispatcher="alltoall"),
            64,
            Hardware(intra_node_gbps=gbps, inter_node_gbps=gbps),
        )[0]
        for gbps in (5, 500)
    )
    assert slow > fast


def test_search_covers_expert_parallel_sizes_and_its_flags_parse():
    cfg = ModelConfig(**MIXTRAL_SMALL)
    layouts = list(candidate_layouts(cfg, 8, 32, micro_batches=(1,)))
    assert {lay.ep for lay in layouts} == {1, 2, 4, 8}
    assert all(lay.sp for lay in layouts if lay.tp > 1)  # an MoE with tp needs sequence parallelism
    assert all((lay.tp * lay.cp * lay.dp) % (lay.ep * lay.expert_tp) == 0 for lay in layouts)
    plans = plan(cfg, num_gpus=8, gpu_memory_gib=24, global_batch_size=32, micro_batches=(1,), ep_sizes=(2, 4))
    assert plans and {p.layout.ep for p in plans} <= {2, 4}
    best = plans[0].layout
    flags = [
        "--mock-data",
        "--num-layers",
        "8",
        "--hidden-size",
        "1024",
        "--num-attention-heads",
        "16",
        "--group-query-attention",
        "--num-query-groups",
        "4",
        "--ffn-hidden-size",
        "3584",
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--disable-bias-linear",
        "--seq-length",
        "2048",
        "--global-batch-size",
        "32",
        "--num-experts",
        "8",
    ] + best.flags(8)
    parsed = parse_args(flags, world_size=8)
    assert (parsed.parallel.ep, parsed.parallel.expert_tp) == (best.ep, best.expert_tp)
    assert layout_of(parsed, resolve_settings(parsed, 8)).ep == best.ep


def test_plan_cli_with_the_mixtral_preset(capsys):
    import tools.plan as cli

    assert (
        cli.main(
            shlex.split(
                "--num-gpus 64 --gpu-memory 80 --model-size mixtral-8x7b --global-batch-size 256 "
                "--seq-length 4096 --expert-model-parallel-size 8 --top 3"
            )
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "8 experts of ffn 14336 (top-2) in 32 layers" in out and " ep8 " in out
    cmd = out.strip().splitlines()[-1]
    assert "--num-experts 8 --moe-router-topk 2" in cmd and "--expert-model-parallel-size 8" in cmd
    args = cmd.split("pretrain_gpt.py ")[1].split()
    cfg = parse_args(["--mock-data"] + args, world_size=64)
    assert cfg.model.num_experts == 8 and cfg.parallel.ep == 8
    assert (
        cli.main(
            shlex.split(
                "--num-gpus 8 --gpu-memory 80 --num-layers 4 --hidden-size 512 "
                "--num-attention-heads 8 --global-batch-size 16 --seq-length 1024 "
                "--moe-router-topk 2"
            )
        )
        == 2
    )
    assert "give --num-experts" in capsys.readouterr().err


def test_plan_check_block_for_an_moe_run():
    from megalite.analysis.plan_check import PlanCheck

    cfg = moe_cfg({"params_dtype": "bfloat16"})
    check = PlanCheck(cfg, ParallelState.single(), resolve_settings(cfg, 1))
    lines = check.block([[0.0, 12e6, 5e6, 0.05, 0.0]], 3, probed=1.0)
    assert lines[0].startswith("plan check after iteration 3: tp1 pp1 vp1 dp1 mbs2")
    assert any("of which activations" in ln for ln in lines)
    ep2 = layout_of(moe_cfg(ep=2, moe_token_dispatcher_type="alltoall"), resolve_settings(moe_cfg(), 2))
    assert (ep2.ep, ep2.moe_dispatcher) == (2, "alltoall") and "--expert-model-parallel-size" in " ".join(ep2.flags(2))
