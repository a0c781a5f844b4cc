"""Checkpoints: exact resume, loading into other layouts, crash-safe saving, safe loading, retention.

* exact resume: N steps == N/2 steps + save + load + N/2 steps, loss for loss (bit for bit in
  fp32, dropout on), for (tp, pp, vp, dp) = (1,1,1,1), (2,2,1,1), (1,2,2,2) with the distributed
  optimizer, fp16 loss scaling, and both formats;
* layout change: saved at (2,2,2,1), loaded in one process, saved again, loaded at (4,1,1,1),
  (1,4,1,1) and dp 2 with the distributed optimizer: evaluation loss on fixed batches and the
  losses of continued training equal the uninterrupted single-process run within 1e-5;
* a save that fails half-way leaves the previous checkpoint loadable and ``latest`` unchanged;
* pickled code in any file a load reads is refused and never runs; model-shape and layout
  mismatches are one-line errors; ``--ckpt-keep-last`` keeps the newest and never the latest.
"""
import os
import pickle
from dataclasses import replace

import pytest
import torch

from megalite.checkpointing import CheckpointError, read_latest
from megalite.config import CheckpointConfig
from megalite.data.mock_dataset import MockGPTDataset
from megalite.parallel_state import ParallelState
from megalite.data.batches import MicroBatches
from megalite.training.mock import MockFeed
from megalite.training import Trainer
from megalite.testing import run_distributed
from tests.distributed.common import GPT2_STYLE, LLAMA_STYLE, tiny_config, train_losses

STEPS = 4


def _cfg(style, tp=1, pp=1, vp=1, dp=1, dropout=0.1, **optim):
    cfg = tiny_config(style, gbs=4, mbs=1 if dp * pp > 1 else 2, num_layers=4, tp=tp, pp=pp, vp=vp,
                      schedule="interleaved_1f1b" if vp > 1 else None)
    return cfg.with_(model=replace(cfg.model, hidden_dropout=dropout, attention_dropout=dropout),
                     optim=replace(cfg.optim, **optim), train=replace(cfg.train, train_iters=STEPS))


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
    ("gpt2", 1, 2, 1, 2, {"initial_loss_scale": 2.0 ** 20}, "float16", "sharded"),
]


@pytest.mark.parametrize("style,tp,pp,vp,dp,optim,dtype,fmt", RESUME_CASES,
                         ids=[f"{c[0]}-tp{c[1]}pp{c[2]}vp{c[3]}dp{c[4]}-{c[6]}-{c[7]}"
                              + ("-distopt" if c[5].get("use_distributed_optimizer") else "") for c in RESUME_CASES])
@pytest.mark.multiprocess
def test_resume_is_exact(tmp_path, style, tp, pp, vp, dp, optim, dtype, fmt):
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


@pytest.mark.multiprocess
def test_sharded_checkpoint_loads_into_other_layouts(tmp_path):
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


# -- failures and safety (one process) ------------------------------------------------------------
def _trainer(root, fmt="sharded", **model):
    cfg = _cfg(GPT2_STYLE, dropout=0.0)
    cfg = cfg.with_(model=replace(cfg.model, **model), checkpoint=CheckpointConfig(save=root, load=root, ckpt_format=fmt))
    return Trainer(cfg, ParallelState.single())


def test_failed_save_keeps_previous_checkpoint_and_latest(tmp_path, monkeypatch):
    root = str(tmp_path)
    t = _trainer(root)
    t.state.iteration = 2
    t.checkpointer.save()
    before = {n: p.detach().clone() for n, p in t.chunks[0].named_parameters()}
    t.state.iteration = 4
    with torch.no_grad():
        for p in t.params:
            p.add_(1.0)
    import megalite.checkpointing.sharded_write as ck

    def dying_save(*args, **kwargs):
        raise OSError("disk full (simulated)")
    monkeypatch.setattr(ck.dcp, "save", dying_save)
    with pytest.raises(CheckpointError, match="disk full"):  # one line naming --save, not a traceback
        t.checkpointer.save()
    monkeypatch.undo()
    assert read_latest(root) == 2 and not os.path.exists(os.path.join(root, "iter_0000004"))
    fresh = _trainer(root)
    assert fresh.checkpointer.load() == 2 and fresh.state.iteration == 2
    for n, p in fresh.chunks[0].named_parameters():
        assert torch.equal(p, before[n]), n
    t.checkpointer.save()  # the next save cleans up the half-written directory
    assert read_latest(root) == 4 and not os.path.exists(os.path.join(root, "iter_0000004.tmp"))


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {_Evil.marker}",))


@pytest.mark.parametrize("fmt", ["torch", "sharded"])
def test_pickled_code_is_refused_and_never_runs(tmp_path, fmt):
    root = str(tmp_path / "ck")
    t = _trainer(root, fmt)
    t.checkpointer.save()
    _Evil.marker = str(tmp_path / "pwned")
    d = os.path.join(root, "iter_0000000")
    if fmt == "torch":
        torch.save({"model": _Evil()}, os.path.join(d, "mp_rank_00", "model_optim_rng.pt"))
    else:
        with open(os.path.join(d, ".metadata"), "wb") as f:
            pickle.dump(_Evil(), f)
    with pytest.raises(CheckpointError, match="refusing to load") as e:
        _trainer(root, fmt).checkpointer.load()
    assert "\n" not in str(e.value)
    assert not os.path.exists(_Evil.marker)


@pytest.mark.multiprocess
def test_model_shape_and_layout_mismatch_are_clear_errors(tmp_path):
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


def test_keep_last_never_deletes_latest(tmp_path):
    root = str(tmp_path)
    t = _trainer(root)
    t.checkpointer.cfg = t.cfg.with_(checkpoint=replace(t.cfg.checkpoint, ckpt_keep_last=2))
    for it in (1, 2, 3, 4):
        t.state.iteration = it
        t.checkpointer.save()
    assert sorted(d for d in os.listdir(root) if d.startswith("iter_")) == ["iter_0000003", "iter_0000004"]
    assert read_latest(root) == 4
    assert _trainer(root).checkpointer.load() == 4


@pytest.mark.parametrize("fmt", ["sharded", "torch"])
def test_finetune_into_bf16_takes_weights_as_fp32_main_weights(tmp_path, fmt):
    root = str(tmp_path)
    t = _trainer(root, fmt)
    t.state.iteration = 3
    t.checkpointer.save()
    b = _trainer(root, fmt, params_dtype="bfloat16")
    b.checkpointer.cfg = b.cfg.with_(checkpoint=replace(b.cfg.checkpoint, finetune=True))
    assert b.checkpointer.load() == 3 and b.state.iteration == 0 and b.state.consumed_samples == 0
    saved = dict(t.chunks[0].named_parameters())
    for pc in b.optimizer.pieces:  # the optimizer continues from the checkpoint, not from the random init
        assert torch.equal(pc.main.detach(), saved[pc.name].detach()), pc.name
    assert not b.optimizer.optimizer.state  # --finetune: fresh Adam moments


def test_index_unpickler_refuses_dotted_names_and_unlisted_classes(tmp_path):
    import io

    from megalite.checkpointing.safe_load import _MetadataUnpickler

    def global_ref(module, name):  # protocol 4 STACK_GLOBAL, as a crafted file would use
        return (b"\x8c" + bytes([len(module)]) + module.encode() + b"\x8c" + bytes([len(name)]) + name.encode()
                + b"\x93")
    for module, name in [("torch.distributed.checkpoint.filesystem", "operator.methodcaller"),
                         ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),
                         ("builtins", "eval"), ("os", "system")]:
        with pytest.raises(pickle.UnpicklingError, match="not allowed"):
            _MetadataUnpickler(io.BytesIO(b"\x80\x04" + global_ref(module, name) + b".")).load()


def test_damaged_or_missing_checkpoints_are_one_line_errors(tmp_path):
    root = str(tmp_path)
    t = _trainer(root)
    t.state.iteration = 2
    t.checkpointer.save()
    t.checkpointer.cfg = t.cfg.with_(checkpoint=replace(t.cfg.checkpoint, ckpt_step=7))
    with pytest.raises(CheckpointError, match=r"iter_0000007 is not a complete.*iterations in .*: 0000002"):
        t.checkpointer.load()
    with open(os.path.join(root, "iter_0000002", "meta.json"), "w") as f:
        f.write("{ truncated")
    with pytest.raises(CheckpointError, match=r"cannot read .*meta.json.*--ckpt-step") as e:
        _trainer(root).checkpointer.load()
    assert "\n" not in str(e.value)


@pytest.mark.multiprocess
def test_llama_gqa_uneven_stages_load_into_one_process(tmp_path):
    """Fused QKV with 2 query groups and gate/up split by tp=2, uneven stages (1 + 3 layers), untied output."""
    root, ref_root = str(tmp_path / "src"), str(tmp_path / "ref")
    base = _cfg(LLAMA_STYLE, dropout=0.0)
    train_losses(ParallelState.single(), base, save=ref_root, exit_at=STEPS // 2)
    ref = _eval_and_continue(ParallelState.single(), base, ref_root)
    src = _cfg(LLAMA_STYLE, tp=2, pp=2, dropout=0.0)
    src = src.with_(parallel=replace(src.parallel, decoder_first_pipeline_num_layers=1,
                                     decoder_last_pipeline_num_layers=3))
    run_distributed(_save_after, 4, src, root, tp=2, pp=2)
    got = _eval_and_continue(ParallelState.single(), base, root)
    assert _close([got["eval"]], [ref["eval"]]) and _close(got["losses"], ref["losses"]), (got, ref)
