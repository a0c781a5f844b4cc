"""Checkpoints in one process: a save that fails half-way leaves the previous checkpoint loadable and
``latest`` unchanged; pickled code in any file a load reads is refused and never runs; damaged or missing
checkpoints are one-line errors; ``--ckpt-keep-last`` keeps the newest and never the latest; --finetune into
bf16 takes the weights as fp32 main weights. (Exact resume and layout changes: tests/distributed.)
"""

import os
import pickle
from dataclasses import replace

import pytest
import torch

from megalite.checkpointing import CheckpointError, read_latest
from tests.helpers.checkpointing import _trainer


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
        return b"\x8c" + bytes([len(module)]) + module.encode() + b"\x8c" + bytes([len(name)]) + name.encode() + b"\x93"

    for module, name in [
        ("torch.distributed.checkpoint.filesystem", "operator.methodcaller"),
        ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),
        ("builtins", "eval"),
        ("os", "system"),
    ]:
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
