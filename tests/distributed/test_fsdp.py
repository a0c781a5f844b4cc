"""Sharded data parallelism on FSDP2 (--data-parallel-sharding-strategy optim_grads / optim_grads_params)
reproduces the one-process run: losses, grad norms and final weights within 1e-5 (fp32, dropout 0), on
every axis it composes with. One launch per rank grid; the cases of a grid run one after the other:

    dp4           optim_grads, optim_grads_params, the same without resharding after forward with full
                  recompute, hybrid sharding (2 copies of 2 shards, full recompute); two micro-batches per
                  rank: gradients accumulate in the reduced shards
    tp2 x dp2     Llama-style (GQA, SwiGLU, RoPE, untied) with sequence parallelism
    pp2 x dp2     1F1B and interleaved (vp 2), GPT-2 style: the tied embedding's shards summed over stages
    cp2 x dp2     ring attention: shards over the dp x cp replicas
    ep2 x dp2     MoE, alltoall: experts sharded over expert DP (2), dense weights over dp (2)
    ep2 (dp2)     MoE, one rank per expert DP group: experts left out of FSDP
"""

from dataclasses import replace

import pytest
import torch

from megalite.data_parallel.fsdp import DTensor
from megalite.parallel.state import ParallelState
from megalite.training.mock import train_mock
from tests.helpers.moe_parity import assert_matches, moe_config, reference, train
from tests.helpers.parity import (
    GPT2_STYLE,
    LLAMA_STYLE,
    assert_close_run,
    param_error,
    reference_run,
    tiny_config,
)

STEPS = 2


def _sharded(cfg, strategy: str, **optim):
    return cfg.with_(optim=replace(cfg.optim, data_parallel_sharding_strategy=strategy, **optim))


def _train_cases(ps: ParallelState, cases) -> list:
    """Each (cfg, reference state) trained STEPS iterations on this grid; checks the weights are FSDP shards."""
    out = []
    for cfg, state in cases:
        trainer, losses, norms = train_mock(cfg, ps, STEPS)
        params = [p for c in trainer.chunks for p in c.parameters() if p.requires_grad]
        out.append(
            {
                "losses": losses,
                "norms": norms,
                "param_err": param_error(trainer, state),
                "rank": ps.rank,
                "last_stage": ps.is_last_stage,
                "sharded": sum(isinstance(p, DTensor) for p in params),
                "params": len(params),
                "local": sum(p._local_tensor.numel() if isinstance(p, DTensor) else p.numel() for p in params),
                "full": sum(p.numel() for p in params),
            }
        )
    return out


def _check(run_distributed, world: int, cases, **grid) -> list:
    refs = [reference_run(cfg.with_(parallel=replace(cfg.parallel, cp=1)), STEPS) for _, cfg in cases]
    per_rank = run_distributed(_train_cases, world, [(cfg, ref["state"]) for (_, cfg), ref in zip(cases, refs)], **grid)
    for i, ((name, _), ref) in enumerate(zip(cases, refs)):
        results = [r[i] for r in per_rank]
        try:
            assert_close_run(results, ref, rtol=1e-5, param_rtol=1e-5)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
        for r in results:
            assert r["sharded"] == r["params"], f"{name}: {r['params'] - r['sharded']} parameters are not sharded"
    return per_rank


@pytest.mark.slow
def test_dp4_each_strategy_with_accumulation_and_recompute(run_distributed):
    base = tiny_config(GPT2_STYLE, gbs=16, mbs=2)
    recompute = base.with_(model=replace(base.model, recompute_granularity="full", recompute_method="uniform"))
    cases = [
        ("optim_grads", _sharded(base, "optim_grads")),
        ("optim_grads_params", _sharded(base, "optim_grads_params")),
        ("no reshard, full recompute", _sharded(recompute, "optim_grads_params", reshard_after_forward=False)),
        (
            "hybrid: 2 copies of 2 shards, full recompute",
            _sharded(recompute, "optim_grads_params", num_distributed_optimizer_instances=2),
        ),
    ]
    per_rank = _check(run_distributed, 4, cases)
    for r in per_rank:  # each rank holds about a quarter of every weight (half of it with 2 copies)
        assert r[1]["local"] <= r[1]["full"] / 4 + 64 * 4, r[1]
        assert r[3]["full"] / 2 - 64 * 2 <= r[3]["local"] <= r[3]["full"] / 2 + 64 * 2, r[3]


def test_tp2_dp2_sequence_parallel(run_distributed):
    cfg = tiny_config(LLAMA_STYLE, tp=2)
    cfg = cfg.with_(parallel=replace(cfg.parallel, sequence_parallel=True))
    _check(run_distributed, 4, [("tp2 x dp2 SP", _sharded(cfg, "optim_grads_params"))], tp=2)


@pytest.mark.slow
def test_pp2_dp2_1f1b_and_interleaved(run_distributed):
    cases = [
        ("pp2 x dp2 1f1b", _sharded(tiny_config(GPT2_STYLE, gbs=4, mbs=1, num_layers=2, pp=2), "optim_grads_params")),
        (
            "pp2 x dp2 interleaved",
            _sharded(tiny_config(GPT2_STYLE, gbs=4, mbs=1, num_layers=4, pp=2, vp=2), "optim_grads"),
        ),
    ]
    _check(run_distributed, 4, cases, pp=2)


def test_cp2_dp2(run_distributed):
    cfg = tiny_config(LLAMA_STYLE, gbs=4, mbs=2)
    cfg = cfg.with_(parallel=replace(cfg.parallel, cp=2))
    _check(run_distributed, 4, [("cp2 x dp2", _sharded(cfg, "optim_grads_params"))], cp=2)


def _moe_cases(ps: ParallelState, cases) -> list:
    return [train(ps, cfg, 2, state) for cfg, state in cases]


@pytest.mark.parametrize("world", [4, 2])
def test_ep2_experts_over_expert_data_parallel(world, run_distributed):
    cfg = moe_config(ep=2, optim={"data_parallel_sharding_strategy": "optim_grads_params"})
    ref = reference(cfg)
    results = run_distributed(_moe_cases, world, [(cfg, ref["state"])], ep=2)
    assert_matches([r[0] for r in results], ref, f"ep2 world {world} optim_grads_params")


def _bf16_losses(ps: ParallelState, cfgs) -> list:
    return [train_mock(cfg, ps, STEPS)[1] for cfg in cfgs]


def test_bf16_and_fp16_match_the_distributed_optimizer(run_distributed):
    """16-bit compute, fp32 main weights and fp32 gradient reduction (fp16: with dynamic loss scaling): FSDP's
    run follows ZeRO-1's (the same casts, another summation order)."""
    cfgs = []
    for dtype in ("bfloat16", "float16"):
        base = tiny_config(GPT2_STYLE, gbs=8, mbs=2)
        base = base.with_(
            model=replace(base.model, params_dtype=dtype), optim=replace(base.optim, initial_loss_scale=2.0**16)
        )
        cfgs += [_sharded(base, "optim"), _sharded(base, "optim_grads_params")]
    losses = run_distributed(_bf16_losses, 2, cfgs)[-1]
    for dtype, zero1, fsdp in [("bf16", *losses[:2]), ("fp16", *losses[2:])]:
        assert all(torch.isfinite(torch.tensor(fsdp))), (dtype, fsdp)
        for a, b in zip(fsdp, zero1):
            assert abs(a - b) <= 2e-3 * abs(b), (dtype, fsdp, zero1)
