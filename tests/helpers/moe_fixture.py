"""The MoE checkpoint fixture of tests/fixtures/megalite_moe (written by make_fixture.py there at commit 65e33c2):
its config, its unpacking, and a bit-for-bit comparison of nested tensors."""

from __future__ import annotations

import os
import tarfile
from dataclasses import replace

import torch

from megalite.config import CheckpointConfig
from tests.helpers.parity import tiny_config

HERE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "megalite_moe")
STEPS = 2
MOE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_ffn_hidden_size=8, moe_z_loss_coeff=1e-3)


def fixture_config(fmt: str = "sharded", save=None, load=None):
    """GPT-2 style (expert biases), hidden 16, 2 heads, one MoE layer of 4 experts (ffn 8), vocabulary 32,
    fp32, dropout 0."""
    cfg = tiny_config(MOE, gbs=2, mbs=1, num_layers=1)
    return cfg.with_(
        model=replace(
            cfg.model,
            vocab_size=32,
            seq_length=8,
            hidden_size=16,
            num_attention_heads=2,
            make_vocab_size_divisible_by=8,
        ),
        train=replace(cfg.train, train_iters=STEPS + 1),
        checkpoint=CheckpointConfig(save=save, load=load, ckpt_format=fmt),
    )


def extract_fixture(out) -> str:
    """The fixture's files (expected.pt, sharded/, torch/) unpacked into ``out``."""
    with tarfile.open(os.path.join(HERE, "moe_65e33c2.tar.xz")) as tar:
        tar.extractall(out, filter="data")
    return str(out)


def assert_same(a, b, where=""):
    """Nested dicts/lists of tensors equal bit for bit."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
