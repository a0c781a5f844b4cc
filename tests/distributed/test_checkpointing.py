"""Checkpoints: exact resume, loading into other layouts, crash-safe saving, safe loading, retention.

* exact resume: N steps == N/2 steps + save + load + N/2 steps, loss for loss (bit for bit in
  fp32, dropout on), for (tp, pp, vp, dp) = (1,1,1,1), (2,2,1,1), (1,2,2,2) with the distributed
  optimizer, fp16 loss scaling, and both formats;
* layout change: saved at (2,2,2,1), loaded in one process, saved again, loaded at (4,1,1,1),
  (1,4,1,1) and dp 2 with the distributed optimizer: evaluation loss on fixed batches and the
  losses of continued training equal the uninterrupted single-process run within 1e-5;
* model-shape and layout mismatches are one-line errors.

(Crash-safe saving, safe loading and retention in one process: tests/unit/test_checkpointing.py.)
"""

from dataclasses import replace

import pytest

from megalite.checkpointing import CheckpointError
from megalite.config import CheckpointConfig
from megalite.data.batches import MicroBatches
from megalite.data.mock_dataset import MockGPTDataset
from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from megalite.training.mock import MockFeed
from tests.helpers.checkpointing import STEPS, _cfg, _trainer
from tests.helpers.parity import GPT2_STYLE, LLAMA_STYLE, train_losses


def _resume_run(ps, cfg, root, fmt):
    whole = train_losses(ps, cfg)
    first = train_losses(ps, cfg, save=root, fmt=fmt, exit_at=STEPS // 2)
    second = train_losses(ps, cfg, load=root)
    return {"whole": whole, "resumed": first + second, "last": ps.is_last_stage}


RESUME_CASES = [  # (style, tp, pp, vp, dp, optim overrides, dtype, format)
    ("gpt2", 1, 1, 1, 1, {}, "float32", "sharded"),
    ("gpt2", 1, 1, 1, 1, {}, "float32", "torch"),
    ("llama", 2, 2, 1, 1, {}, "float32", "sharded"),
    ("gpt2", 1, 2, 2, 2, {"use_distributed_optimizer": True}, "float32", "sharded"),
    ("gpt2", 1, 2, 1, 2, {"use_distributed_optimizer": True}, "float32", "torch"),
    ("gpt2", 1, 2, 1, 2, {"initial_loss_scale": 2.0**20}, "float16", "sharded"),
]


@pytest.mark.parametrize(
    "style,tp,pp,vp,dp,optim,dtype,fmt",
    RESUME_CASES,
    ids=[
        f"{c[0]}-tp{c[1]}pp{c[2]}vp{c[3]}dp{c[4]}-{c[6]}-{c[7]}"
        + ("-distopt" if c[5].get("use_distributed_optimizer") else "")
        for c in RESUME_CASES
    ],
)
def test_resume_is_exact(tmp_path, style, tp, pp, vp, dp, optim, dtype, fmt, run_distributed):
    cfg = _cfg(GPT2_STYLE if style == "gpt2" else LLAMA_STYLE, tp, pp, vp, dp, **optim)
    cfg = cfg.with_(model=replace(cfg.model, params_dtype=dtype))
    world = tp * pp * dp
    if world == 1:
        results = [_resume_run(ParallelState.single(), cfg, str(tmp_path), fmt)]
    else:
        results = run_distributed(_resume_run, world, cfg, str(tmp_path), fmt, tp=tp, pp=pp)
    for r in results:
        if r["last"]:
            assert len(r["resumed"]) == STEPS and r["resumed"] == r["whole"], (r["resumed"], r["whole"])


# -- layout changes -------------------------------------------------------------------------------
def _eval_and_continue(ps, cfg, load, save=None, steps=2):
    """Load, evaluate fixed batches, save again (optional), then train ``steps`` more iterations."""
    cfg = cfg.with_(checkpoint=CheckpointConfig(load=load), train=replace(cfg.train, eval_iters=2))
    trainer = Trainer(cfg, ps)
    assert trainer.checkpointer.load() == STEPS // 2
    ds = MockGPTDataset(cfg.model.seq_length, cfg.model.vocab_size, 99, 2 * cfg.train.global_batch_size)
    valid = MicroBatches(ds, 0, cfg.train.micro_batch_size, trainer.m, ps) if trainer.needs_data else None
    eval_loss = trainer.evaluate(valid)
    if save:
        trainer.checkpointer.cfg = trainer.cfg.with_(checkpoint=CheckpointConfig(save=save))
        trainer.checkpointer.save()
    feed = MockFeed(trainer, steps, consumed=trainer.state.consumed_samples)  # resumed at iteration STEPS // 2
    losses = [trainer.train_step(feed.next())["loss"] for _ in range(steps)]
    return {"eval": eval_loss, "losses": losses, "last": ps.is_last_stage}


def _save_after(ps, cfg, root):
    train_losses(ps, cfg, save=root, exit_at=STEPS // 2)
    return True


def _close(a, b, tol=1e-5):
    return all(abs(x - y) <= tol * abs(y) for x, y in zip(a, b)) and len(a) == len(b)


def test_sharded_checkpoint_loads_into_other_layouts(tmp_path, run_distributed):
    src, one = str(tmp_path / "tp2pp2vp2"), str(tmp_path / "single")
    base = _cfg(GPT2_STYLE, dropout=0.0)
    # the uninterrupted reference: one process, STEPS // 2 steps, then evaluate and continue
    ref_root = str(tmp_path / "ref")
    train_losses(ParallelState.single(), base, save=ref_root, exit_at=STEPS // 2)
    ref = _eval_and_continue(ParallelState.single(), base, ref_root)
    run_distributed(_save_after, 8, _cfg(GPT2_STYLE, tp=2, pp=2, vp=2, dp=2, dropout=0.0), src, tp=2, pp=2)
    got = _eval_and_continue(ParallelState.single(), base, src, save=one)
    assert _close([got["eval"]], [ref["eval"]]) and _close(got["losses"], ref["losses"]), (got, ref)
    for layout in [dict(tp=4), dict(pp=4), dict(dp=2, use_distributed_optimizer=True)]:
        cfg = _cfg(GPT2_STYLE, dropout=0.0, **layout)
        world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1)
        res = run_distributed(_eval_and_continue, world, cfg, one, tp=layout.get("tp", 1), pp=layout.get("pp", 1))
        for r in res:
            if r["last"]:
                assert _close([r["eval"]], [ref["eval"]]) and _close(r["losses"], ref["losses"]), (layout, r, ref)


def test_model_shape_and_layout_mismatch_are_clear_errors(tmp_path, run_distributed):
    root = str(tmp_path / "a")
    _trainer(root).checkpointer.save()
    with pytest.raises(CheckpointError, match=r"hidden_size 32 \(checkpoint\) vs 64 \(run\)"):
        _trainer(root, hidden_size=64).checkpointer.load()
    legacy = str(tmp_path / "b")
    _trainer(legacy, "torch").checkpointer.save()
    cfg = _cfg(GPT2_STYLE, dropout=0.0, pp=2).with_(checkpoint=CheckpointConfig(load=legacy))
    errors = run_distributed(_load_error, 2, cfg, pp=2)
    assert all("tp=1 pp=1 vp=1" in e and "--ckpt-format sharded" in e and "\n" not in e for e in errors), errors


def _load_error(ps, cfg):
    try:
        Trainer(cfg, ps).checkpointer.load()
    except CheckpointError as e:
        return str(e)
    return "loaded"


def test_llama_gqa_uneven_stages_load_into_one_process(tmp_path, run_distributed):
    """Fused QKV with 2 query groups and gate/up split by tp=2, uneven stages (1 + 3 layers), untied output."""
    root, ref_root = str(tmp_path / "src"), str(tmp_path / "ref")
    base = _cfg(LLAMA_STYLE, dropout=0.0)
    train_losses(ParallelState.single(), base, save=ref_root, exit_at=STEPS // 2)
    ref = _eval_and_continue(ParallelState.single(), base, ref_root)
    src = _cfg(LLAMA_STYLE, tp=2, pp=2, dropout=0.0)
    src = src.with_(
        parallel=replace(src.parallel, decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=3)
    )
    run_distributed(_save_after, 4, src, root, tp=2, pp=2)
    got = _eval_and_continue(ParallelState.single(), base, root)
    assert _close([got["eval"]], [ref["eval"]]) and _close(got["losses"], ref["losses"]), (got, ref)
