"""The sharded MoE checkpoint written before issue 30 (tests/unit/test_moe_fixture.py) loads bit-equal at
another expert-parallel size: each EP rank gets its experts (global names) and the shared tensors."""

import os
from dataclasses import replace

import pytest
import torch

from megalite.checkpointing import load_checkpoint
from megalite.training import Trainer
from tests.helpers.moe_fixture import STEPS, assert_same, extract_fixture, fixture_config


def _load_and_compare(ps, root):
    """The experts this rank loaded (compared bit for bit in the worker: tensors stay there)."""
    cfg = fixture_config("sharded")
    trainer = Trainer(cfg.with_(parallel=replace(cfg.parallel, ep=2)), ps)
    assert load_checkpoint(trainer.run_parts, os.path.join(root, "sharded")) == STEPS
    state = {n: t for c in trainer.chunks for n, t in c.state_dict().items() if torch.is_tensor(t)}
    expected = torch.load(os.path.join(root, "expected.pt"), weights_only=False)["model"]
    assert_same(state, {n: expected[n] for n in state}, f"rank {ps.rank}")
    assert {n for n in expected if ".local_experts." not in n} <= set(state)
    return sorted({int(n.split(".local_experts.")[1].split(".")[0]) for n in state if ".local_experts." in n})


@pytest.mark.slow
def test_saved_before_loads_bit_equal_at_ep2(tmp_path, run_distributed):
    experts = run_distributed(_load_and_compare, 2, extract_fixture(tmp_path), ep=2)
    assert experts == [[0, 1], [2, 3]]
