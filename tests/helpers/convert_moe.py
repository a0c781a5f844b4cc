"""Mixture-of-experts conversion in the tests: the CLI in a fresh interpreter, a tiny random transformers
MoE model (Mixtral or Qwen2-MoE) and the logits of either side on fixed ids."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO
from tests.helpers.convert import convert_argv

VOCAB = 256
CONVERT = str(REPO / "tools" / "checkpoint" / "convert.py")


def run_cli(loader: str, saver: str, src, dst, *extra) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, CONVERT, *convert_argv(loader, saver, src, dst, *extra)],
        capture_output=True,
        text=True,
        cwd=str(REPO),
        timeout=120,
    )


def hf_model(kind: str, **over):
    """A tiny random transformers MoE model (hidden 64, 4 experts, top-2, vocab 256, fp32)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        initializer_range=0.1,
        dtype="float32",
    )
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=4, **over)
        return transformers.MixtralForCausalLM(cfg).eval()
    cfg = transformers.Qwen2MoeConfig(
        **{**common, "num_hidden_layers": 3},
        intermediate_size=48,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=40,
        num_experts=4,
        **over,
    )
    return transformers.Qwen2MoeForCausalLM(cfg).eval()


def logits(model, ids, hf: bool) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits if hf else model(ids).transpose(0, 1)[..., :VOCAB]


IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
