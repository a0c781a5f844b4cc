"""Checkpoints of sharded data-parallel runs (FSDP2): exact resume in both formats, and a ZeRO-3 checkpoint
loading bit for bit into ZeRO-1 and into one process.

* exact resume: STEPS iterations == STEPS/2 + save + load + STEPS/2, loss for loss, bit for bit (dropout
  on): dp2 optim_grads_params in the torch format (fp32), dp2 optim_grads in bf16 in the sharded format
  (fp32 main weights in the checkpoint's ``optim.param``), both saved with --async-save, and hybrid
  sharding (dp4: 2 copies of 2 shards, fp32, sharded format, saved synchronously);
* strategy and layout change: saved at dp4 optim_grads_params (each rank writes its shards), loaded at dp2
  optim (the distributed optimizer) and in one process, and the dp2 optim run's save loaded back at dp2
  optim_grads: every weight, fp32 main weight and Adam moment the loading run holds equals the first
  saving run's, and the runs continue alike (1e-5).
"""

from dataclasses import replace

import numpy as np
import pytest
import torch

from megalite.config import CheckpointConfig
from megalite.data_parallel.fsdp import unsharded
from megalite.parallel.state import ParallelState
from megalite.tensor_parallel.layers import per_expert_names
from megalite.training import Trainer
from megalite.training.mock import MockFeed
from tests.helpers.checkpointing import STEPS, _cfg
from tests.helpers.moe_parity import moe_config, one_process
from tests.helpers.parity import GPT2_STYLE, train_losses


def _sharded(cfg, strategy: str):
    return cfg.with_(optim=replace(cfg.optim, data_parallel_sharding_strategy=strategy))


def _resume_run(ps, cfg, root, fmt, async_save=False):
    whole = train_losses(ps, cfg)
    first = train_losses(ps, cfg, save=root, fmt=fmt, exit_at=STEPS // 2, async_save=async_save)
    second = train_losses(ps, cfg, load=root)
    return {"whole": whole, "resumed": first + second}


@pytest.mark.parametrize(
    "strategy,dtype,fmt,dp,instances,async_save",
    [
        ("optim_grads_params", "float32", "torch", 2, 1, True),
        ("optim_grads", "bfloat16", "sharded", 2, 1, True),
        ("optim_grads_params", "float32", "sharded", 4, 2, False),  # hybrid: the first copy of each shard writes
    ],
)
def test_resume_is_exact(tmp_path, strategy, dtype, fmt, dp, instances, async_save, run_distributed):
    cfg = _sharded(_cfg(GPT2_STYLE, dp=dp), strategy)
    cfg = cfg.with_(
        model=replace(cfg.model, params_dtype=dtype),
        optim=replace(cfg.optim, num_distributed_optimizer_instances=instances),
    )
    for r in run_distributed(_resume_run, dp, cfg, str(tmp_path), fmt, async_save):
        assert len(r["resumed"]) == STEPS and r["resumed"] == r["whole"], (r["resumed"], r["whole"])


def _state(trainer) -> dict:
    """Every weight (whole TP-local tensors) and the optimizer's whole fp32 state (collective), as numpy
    arrays (tensors would cross to the test process as shared memory of a worker that has exited)."""
    trainer.optimizer.finish_param_gather()
    weights = {}
    for c in trainer.chunks:
        for n, p in c.named_parameters():  # a grouped expert parameter under its per-expert names
            t, names = unsharded(p.detach()), per_expert_names(n, p)
            weights.update({e: t[i].numpy().copy() for i, e in enumerate(names)} if names else {n: t.numpy().copy()})
    optim = {
        n: {k: v.numpy().copy() for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0}
        for n, s in trainer.optimizer.full_state_dict().items()
    }
    return {"weights": weights, "optim": optim}


def _save(ps, cfg, root):
    cfg = cfg.with_(checkpoint=CheckpointConfig(save=root))
    trainer = Trainer(cfg, ps)
    feed = MockFeed(trainer, STEPS // 2)
    for _ in range(STEPS // 2):
        trainer.train_step(feed.next())
        trainer.state.advance(cfg.train.global_batch_size)
    trainer.checkpointer.save()
    return _state(trainer)


def _load_and_continue(ps, cfg, root, save=None):
    """Load ``root``, note the state, save it to ``save`` (if given), then train two more iterations."""
    trainer = Trainer(cfg.with_(checkpoint=CheckpointConfig(load=root, save=save)), ps)
    assert trainer.checkpointer.load() == STEPS // 2
    out = _state(trainer)
    if save:
        trainer.checkpointer.save()
    feed = MockFeed(trainer, 2, consumed=trainer.state.consumed_samples)
    out["losses"] = [trainer.train_step(feed.next())["loss"] for _ in range(2)]
    return out


def _assert_same_state(got: dict, want: dict, what: str) -> None:
    assert got["weights"].keys() == want["weights"].keys(), what
    for n, t in want["weights"].items():
        assert np.array_equal(got["weights"][n], t), f"{what}: weight {n} differs"
    for n, s in want["optim"].items():
        assert s.keys() == got["optim"][n].keys() and {"exp_avg", "exp_avg_sq"} <= s.keys(), (what, n, s.keys())
        for k, t in s.items():
            assert np.array_equal(got["optim"][n][k], t), f"{what}: {k} of {n} differs"


def test_zero3_checkpoint_loads_bit_equal_into_zero1_and_one_process(tmp_path, run_distributed):
    root = str(tmp_path / "zero3")
    base = _cfg(GPT2_STYLE, dropout=0.0)
    saved = run_distributed(_save, 4, _sharded(_cfg(GPT2_STYLE, dp=4, dropout=0.0), "optim_grads_params"), root)[0]
    one = _load_and_continue(ParallelState.single(), base, root)
    _assert_same_state(one, saved, "one process")
    back = str(tmp_path / "zero1")
    zero1 = run_distributed(_load_and_continue, 2, _sharded(_cfg(GPT2_STYLE, dp=2, dropout=0.0), "optim"), root, back)
    for r in zero1:
        _assert_same_state(r, saved, "dp2 optim")
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r["losses"], one["losses"])), (r["losses"], one)
    # and back: the ZeRO-1 run's checkpoint into ZeRO-2 at dp 2
    again = run_distributed(_load_and_continue, 2, _sharded(_cfg(GPT2_STYLE, dp=2, dropout=0.0), "optim_grads"), back)
    for r in again:
        _assert_same_state(r, saved, "dp2 optim_grads from dp2 optim")


def test_moe_experts_sharded_over_expert_dp_load_into_one_process(tmp_path, run_distributed):
    """ep2 x dp2 under FSDP: dense shards over dp, expert shards over expert DP, each written by its owner."""
    root = str(tmp_path / "moe")
    cfg = moe_config(ep=2, optim={"data_parallel_sharding_strategy": "optim_grads_params"})
    cfg = cfg.with_(train=replace(cfg.train, train_iters=STEPS))
    saved = run_distributed(_save, 4, cfg, root, ep=2)
    whole = {**saved[0]["weights"], **saved[1]["weights"]}  # the two EP ranks' experts
    one = _load_and_continue(ParallelState.single(), one_process(cfg), root)
    _assert_same_state(one, {"weights": whole, "optim": {}}, "MoE in one process")
