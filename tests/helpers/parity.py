"""Shared pieces of the parity tests: a tiny config, a reference run, a layout run."""

from __future__ import annotations

from dataclasses import replace
from typing import Dict

import torch

from megalite.config import CheckpointConfig, Config, DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from megalite.data.loading import build_datasets
from megalite.data.mock_dataset import MockGPTDataset
from megalite.data_parallel.fsdp import unsharded
from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from megalite.training.mock import train_mock

GPT2_STYLE = dict()
LLAMA_STYLE = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    untie_embeddings_and_output_weights=True,
    add_bias_linear=False,
    num_query_groups=2,
)
REFERENCE_STEPS = 5  # the gpt2_reference fixture's run (tests/conftest.py), which the TP x DP layouts reproduce


def tiny_config(
    model: Dict = None,
    gbs: int = 8,
    mbs: int = 2,
    num_layers: int = 2,
    schedule: str = None,
    tp: int = 1,
    pp: int = 1,
    vp: int = 1,
    first: int = None,
    last: int = None,
) -> Config:
    """A model small enough for 8 CPU ranks: hidden 32, 4 heads, seq 16, vocab 250 (padded per TP)."""
    m = ModelConfig(
        num_layers=num_layers,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        vocab_size=250,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **(model or {}),
    )
    return Config(
        model=m,
        parallel=ParallelConfig(
            tp=tp,
            pp=pp,
            vp=vp,
            pipeline_schedule=schedule,
            decoder_first_pipeline_num_layers=first,
            decoder_last_pipeline_num_layers=last,
        ),
        optim=OptimConfig(lr=1e-2, lr_warmup_iters=1, min_lr=1e-3, clip_grad=1.0),
        data=DataConfig(mock_data=True),
        train=TrainConfig(micro_batch_size=mbs, global_batch_size=gbs, train_iters=5, seed=7, eval_iters=0),
    )


def _train(cfg: Config, ps: ParallelState, steps: int):
    """``steps`` iterations on mock data (or the run's real .bin/.idx data); returns the trainer, losses
    and grad norms."""
    dataset = None
    if not cfg.data.mock_data:  # real data: index caches built by rank 0 while the others wait
        dataset = build_datasets(cfg.with_(train=replace(cfg.train, train_iters=steps, eval_iters=0)), ps).train
    return train_mock(cfg, ps, steps, dataset=dataset)


def run_steps(ps: ParallelState, cfg: Config, steps: int, reference: Dict[str, torch.Tensor] = None, inspect=None):
    """Train ``steps`` iterations; return losses, grad norms and the max relative parameter error.

    The error compares this rank's parameters with ``reference`` (the full state
    dict the single-process run ended with), sharded for this rank's layout.
    ``inspect(trainer)`` (a module-level function) may add entries to the result.
    """
    trainer, losses, norms = _train(cfg, ps, steps)
    trainer.optimizer.finish_param_gather()
    err = param_error(trainer, reference) if reference is not None else 0.0
    extra = inspect(trainer) if inspect is not None else {}
    return {
        "losses": losses,
        "norms": norms,
        "param_err": err,
        "rank": ps.rank,
        "last_stage": ps.is_last_stage,
        **extra,
    }


def param_error(trainer, reference: Dict[str, torch.Tensor]) -> float:
    """Relative L2 error of this rank's parameters against ``reference`` (a full state dict), sharded
    for the trainer's layout. (Per tensor would be meaningless for the attention key bias: its true
    gradient is zero, so Adam turns round-off noise into updates.)"""
    diff_sq = ref_sq = 0.0
    for chunk in trainer.chunks:
        expected = chunk.local_from_full(reference)
        for name, p in chunk.named_parameters():
            diff_sq += float((unsharded(p.detach()) - expected[name]).square().sum())
            ref_sq += float(expected[name].square().sum())
    return (diff_sq / ref_sq) ** 0.5


def full_params(trainer) -> torch.Tensor:
    """This rank's parameters, flattened in registration order (for comparing two runs of one layout)."""
    trainer.optimizer.finish_param_gather()
    return torch.cat([unsharded(p.detach()).float().reshape(-1) for c in trainer.chunks for p in c.parameters()])


_REFERENCES: Dict[tuple, dict] = {}


def reference_run(cfg: Config, steps: int):
    """The same run in one process; also returns its final full state dict.

    Cached for the session by (config, steps): parametrized tests of many layouts share one
    reference (callers must not change what it returns).
    """
    cfg = cfg.with_(parallel=replace(cfg.parallel, tp=1, pp=1, vp=1, pipeline_schedule=None))
    key = (repr(cfg), steps)
    if key not in _REFERENCES:
        trainer, losses, norms = _train(cfg, ParallelState.single(), steps)
        state = {k: v.detach().clone() for k, v in trainer.chunks[0].state_dict().items()}
        _REFERENCES[key] = {"losses": losses, "norms": norms, "state": state}
    return _REFERENCES[key]


def assert_close_run(results, ref, rtol: float = 1e-5, param_rtol: float = 1e-5) -> None:
    """Every last-stage rank's losses and every rank's grad norms match the reference."""
    for r in results:
        if r["last_stage"]:
            for step, (a, b) in enumerate(zip(r["losses"], ref["losses"])):
                assert abs(a - b) <= rtol * abs(b), f"rank {r['rank']} step {step}: loss {a} != {b}"
        for step, (a, b) in enumerate(zip(r["norms"], ref["norms"])):
            assert abs(a - b) <= 1e-4 * abs(b), f"rank {r['rank']} step {step}: grad norm {a} != {b}"
        assert r["param_err"] <= param_rtol, f"rank {r['rank']}: parameters differ by {r['param_err']:.2e}"


def train_losses(
    ps: ParallelState,
    cfg: Config,
    save=None,
    load=None,
    fmt="sharded",
    exit_at=None,
    save_interval=None,
    async_save=False,
):
    """Trainer.train on mock data, from scratch or from ``load``; returns the per-iteration losses
    (last stage). ``save``/``save_interval``/``fmt``/``async_save`` and ``exit_at`` (--exit-interval) as
    the flags."""
    cfg = cfg.with_(
        checkpoint=CheckpointConfig(
            save=save, load=load, ckpt_format=fmt, save_interval=save_interval, async_save=async_save
        ),
        train=replace(cfg.train, exit_interval=exit_at),
    )
    trainer = Trainer(cfg, ps)
    if load:
        trainer.checkpointer.load()
    ds = MockGPTDataset(
        cfg.model.seq_length, cfg.model.vocab_size, cfg.train.seed, cfg.train.train_iters * cfg.train.global_batch_size
    )
    return [h["loss"] for h in trainer.train(ds, None)]
