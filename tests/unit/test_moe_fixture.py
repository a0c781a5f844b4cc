"""MoE checkpoints written before issue 30's changes still load bit-equal and save back the same.

tests/fixtures/megalite_moe/moe_65e33c2.tar.xz was written by megalite at commit 65e33c2 (per-expert
parameters; make_fixture.py there): one process, 2 iterations, both native formats. Whatever the
experts' in-memory layout, loading must give every per-expert tensor bit-equal, the next iteration
the loss recorded then, and saving again the same tensors under the same names.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megalite.checkpointing import load_checkpoint, save_checkpoint
from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from megalite.training.mock import MockFeed
from tests.helpers.moe_fixture import STEPS, assert_same, extract_fixture, fixture_config


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    return extract_fixture(tmp_path_factory.mktemp("moe_fixture"))


def _tensors(fmt: str, root: str, tmp: str) -> dict:
    """Every tensor a saved iteration holds (model and optimizer), by its saved name."""
    d = os.path.join(root, f"iter_{STEPS:07d}")
    if fmt == "torch":
        saved = torch.load(os.path.join(d, "mp_rank_00", "model_optim_rng.pt"), weights_only=False)
        return {"model": saved["model"], "optimizer": saved["optimizer"]}
    flat = os.path.join(tmp, "flat.pt")
    dcp_to_torch_save(d, flat)
    return torch.load(flat, weights_only=False)


@pytest.mark.parametrize("fmt", ["sharded", "torch"])
def test_checkpoint_saved_before_loads_bit_equal_and_saves_back_the_same(fmt, fixture_dir, tmp_path):
    expected = torch.load(os.path.join(fixture_dir, "expected.pt"), weights_only=False)
    src = os.path.join(fixture_dir, fmt)
    trainer = Trainer(fixture_config(fmt), ParallelState.single())
    assert load_checkpoint(trainer.run_parts, src) == STEPS
    state = {n: t for c in trainer.chunks for n, t in c.state_dict().items() if torch.is_tensor(t)}
    assert any(".experts.local_experts.3.linear_fc2.bias" in n for n in state)
    assert_same(state, expected["model"], "model")
    again = str(tmp_path / "again")
    save_checkpoint(trainer.run_parts, again, fmt)
    if fmt == "sharded":
        index = [json.load(open(os.path.join(r, f"iter_{STEPS:07d}", "index_00000.json"))) for r in (src, again)]
        assert index[0] == index[1]
    os.makedirs(tmp_path / "a")
    os.makedirs(tmp_path / "b")
    assert_same(_tensors(fmt, again, str(tmp_path / "a")), _tensors(fmt, src, str(tmp_path / "b")), fmt)
    loss = trainer.train_step(MockFeed(trainer, 1, consumed=STEPS * trainer.cfg.train.global_batch_size).next())["loss"]
    assert loss == pytest.approx(expected["next_loss"], rel=1e-6)
