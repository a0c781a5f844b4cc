"""MoE checkpoints: both native formats hold expert weights; the sharded one loads into any layout.

* sharded: a tiny MoE GPT (hidden 32, 4 experts, 2 layers, fp32, dropout 0) trained 2 steps at one
  layout, saved, loaded at another (ep2 x dp2 with the distributed optimizer -> ep4 without it;
  tp2 SP x ep2 etp1 -> one process) and trained 2 more steps: the losses equal the uninterrupted
  single-process run within 1e-5;
* meta.json records ep, etp and the MoE model fields;
* torch: saved and loaded at the same ep2 x dp2 layout (directories mp_rank_00_000 / _001, one per EP
  rank, as Megatron-LM names them): resume is exact; loaded at another ep: a one-line error.
"""

import json
import os
from dataclasses import replace

import pytest

from megalite.checkpointing import CheckpointError, read_latest
from megalite.config import CheckpointConfig
from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from tests.helpers.parity import tiny_config, train_losses

STEPS = 4
MOE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2)


def _cfg(tp=1, ep=1, etp=None, sp=False, **optim):
    cfg = tiny_config(MOE, gbs=4, mbs=1, num_layers=2, tp=tp)
    return cfg.with_(
        parallel=replace(cfg.parallel, ep=ep, etp=etp, sequence_parallel=sp),
        optim=replace(cfg.optim, **optim),
        train=replace(cfg.train, train_iters=STEPS),
    )


def _close(a, b, tol=1e-5):
    return len(a) == len(b) and all(abs(x - y) <= tol * abs(y) for x, y in zip(a, b))


def _save_after(ps, cfg, root, fmt="sharded"):
    return train_losses(ps, cfg, save=root, fmt=fmt, exit_at=STEPS // 2)


def _resume(ps, cfg, root):
    return {"losses": train_losses(ps, cfg, load=root), "last": ps.is_last_stage}


def _last(results):
    return [r["losses"] for r in results if r["last"]]


@pytest.mark.slow
def test_sharded_moe_checkpoint_loads_into_other_layouts(tmp_path, run_distributed):
    whole = train_losses(ParallelState.single(), _cfg())  # the uninterrupted reference
    # ep2 x dp2 (edp 2), distributed optimizer -> ep4 (edp 1), plain optimizer
    src = str(tmp_path / "ep2dp2")
    run_distributed(_save_after, 4, _cfg(ep=2, use_distributed_optimizer=True), src, ep=2)
    meta = json.load(open(os.path.join(src, f"iter_{read_latest(src):07d}", "meta.json")))
    assert (meta["layout"]["ep"], meta["layout"]["etp"]) == (2, 1), meta["layout"]
    assert meta["model_shape"]["num_experts"] == 4 and meta["config"]["model"]["num_experts"] == 4
    for got in _last(run_distributed(_resume, 4, _cfg(ep=4), src, ep=4)):
        assert _close(got, whole[STEPS // 2 :]), (got, whole)
    # tp2 with sequence parallelism x ep2 etp1 -> one process
    src = str(tmp_path / "tp2ep2")
    run_distributed(_save_after, 2, _cfg(tp=2, ep=2, etp=1, sp=True), src, tp=2, ep=2, etp=1)
    got = train_losses(ParallelState.single(), _cfg(), load=src)
    assert _close(got, whole[STEPS // 2 :]), (got, whole)


def _torch_round_trip(ps, cfg, root):
    first = train_losses(ps, cfg, save=root, fmt="torch", exit_at=STEPS // 2)
    return {
        "losses": first + train_losses(ps, cfg, load=root),
        "whole": train_losses(ps, cfg),
        "last": ps.is_last_stage,
    }


def _load_error(ps, cfg, root):
    try:
        Trainer(cfg.with_(checkpoint=CheckpointConfig(load=root)), ps).checkpointer.load()
    except CheckpointError as e:
        return str(e)
    return "loaded"


def test_torch_format_moe_round_trip_and_other_ep_error(tmp_path, run_distributed):
    root = str(tmp_path / "torch")
    results = run_distributed(_torch_round_trip, 2, _cfg(ep=2), root, ep=2)
    for r in results:
        if r["last"]:
            assert r["losses"] == r["whole"], r
    it = os.path.join(root, f"iter_{read_latest(root):07d}")
    assert sorted(d for d in os.listdir(it) if d.startswith("mp_rank")) == ["mp_rank_00_000", "mp_rank_00_001"]
    errors = run_distributed(_load_error, 2, _cfg(ep=1), root, experts=True)
    assert all(
        "ep=2 etp=1" in e and "ep=1 etp=1" in e and "--ckpt-format sharded" in e and "\n" not in e for e in errors
    ), errors


def _async_torch_round_trip(ps, cfg, root):
    first = train_losses(ps, cfg, save=root, fmt="torch", exit_at=STEPS // 2, async_save=True)
    return {
        "losses": first + train_losses(ps, cfg, load=root),
        "whole": train_losses(ps, cfg),
        "last": ps.is_last_stage,
    }


@pytest.mark.slow
def test_async_torch_format_gathers_expert_optimizer_shards_over_expert_dp(tmp_path, run_distributed):
    """ep2 on 4 ranks (expert DP 2) with the distributed optimizer: the background write gathers the dense
    shards over dp x cp and the experts' over expert DP (their own gloo groups); the resume is exact."""
    root = str(tmp_path / "async")
    results = run_distributed(_async_torch_round_trip, 4, _cfg(ep=2, use_distributed_optimizer=True), root, ep=2)
    for r in results:
        if r["last"]:
            assert r["losses"] == r["whole"], r
