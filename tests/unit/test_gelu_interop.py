"""GeLU's tanh approximation (--openai-gelu) across megalite, Megatron-LM and Hugging Face files.

Megatron-Core's GPT computes the tanh form whenever its default --bias-gelu-fusion meets biases;
HF GPT-2's default "gelu_new" is the tanh form too. megalite keeps the exact GeLU by default and
carries the choice through conversion; logits are compared with what each tool's own model gave.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megalite.checkpointing.run_state import SHAPE_FIELDS, check_model_shape
from megalite.checkpointing.safe_load import CheckpointError, load_megatron_file
from megalite.config import ModelConfig
from megalite.inference import build_model, config_from_dict, read_checkpoint
from megalite.interop.hf import config_from_hf, hf_config
from megalite.interop.interchange import Layout
from megalite.interop.megatron import args_for, config_from_args, tanh_gelu
from megalite.model.transformer import MLP
from megalite.parallel.state import ParallelState

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "megatron_lm"


def convert(loader: str, saver: str, src, dst) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "checkpoint" / "convert.py"),
            "--model-type",
            "GPT",
            "--loader",
            loader,
            "--saver",
            saver,
            "--load-dir",
            str(src),
            "--save-dir",
            str(dst),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done


def megalite_logits(root, tokens: torch.Tensor, **model_changes) -> torch.Tensor:
    """[s, padded vocab] logits of the megalite checkpoint at ``root`` (its model changed by ``model_changes``)."""
    cfg, _, full = read_checkpoint(str(root))
    cfg = replace(cfg, model=replace(cfg.model, **model_changes))
    with torch.no_grad():
        return build_model(cfg, full)(tokens[None]).transpose(0, 1)[0]


# -- the model and its flag ------------------------------------------------------------------------------
def test_flag_selects_the_tanh_form_in_the_mlp():
    from megalite.config.arguments import parse_args

    base = [
        "--num-layers",
        "1",
        "--hidden-size",
        "16",
        "--num-attention-heads",
        "2",
        "--mock-data",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
    ]
    assert not parse_args(base, world_size=1).model.openai_gelu  # megalite's default: the exact GeLU
    cfg = parse_args(base + ["--openai-gelu"], world_size=1)
    assert cfg.model.openai_gelu
    mlp = MLP(cfg.model, ParallelState.single().tp, seed=1, prefix="decoder.layers.0.mlp")
    x = torch.randn(3, 1, 16)
    with torch.no_grad():
        h = mlp.linear_fc1(x)
        want = mlp.linear_fc2(F.gelu(h, approximate="tanh"))
        assert torch.equal(mlp(x), want)
        assert not torch.allclose(mlp.linear_fc2(F.gelu(h)), want, atol=0, rtol=0)


def test_checkpoints_without_the_field_load_as_exact_and_the_shape_check_names_it():
    saved = {k: v for k, v in asdict(ModelConfig()).items() if k != "openai_gelu"}  # written before the field
    assert not config_from_dict({"model": saved}).model.openai_gelu
    old_shape = {f: getattr(ModelConfig(), f) for f in SHAPE_FIELDS if f != "openai_gelu"}
    check_model_shape(old_shape, ModelConfig(openai_gelu=True), "old")  # absent: not compared
    new_shape = {f: getattr(ModelConfig(), f) for f in SHAPE_FIELDS}
    with pytest.raises(CheckpointError, match="openai_gelu False .checkpoint. vs True .run."):
        check_model_shape(new_shape, ModelConfig(openai_gelu=True), "iter_1")


# -- Megatron-LM -----------------------------------------------------------------------------------------
def test_megatron_rule_on_stored_args():
    ns = argparse.Namespace
    assert tanh_gelu(ns(bias_gelu_fusion=True, add_bias_linear=True, swiglu=False))  # Megatron's default
    assert not tanh_gelu(ns(bias_gelu_fusion=False, add_bias_linear=True, swiglu=False))  # --no-bias-gelu-fusion
    assert not tanh_gelu(ns(bias_gelu_fusion=True, add_bias_linear=False, swiglu=False))  # no bias: F.gelu
    assert not tanh_gelu(ns(bias_gelu_fusion=True, add_bias_linear=True, swiglu=True))
    assert not tanh_gelu(ns(openai_gelu=True, bias_gelu_fusion=False, add_bias_linear=True))  # legacy models only
    assert not tanh_gelu(ns(add_bias_linear=True))  # not Megatron's parser (an older megalite export): exact


def test_megatron_args_we_write_say_the_same_function():
    layout, tok = Layout(), {"tokenizer_type": "NullTokenizer"}
    for cfg in (
        ModelConfig(vocab_size=64),
        ModelConfig(vocab_size=64, openai_gelu=True),
        ModelConfig(vocab_size=64, swiglu=True, add_bias_linear=False),
    ):
        ns = args_for(cfg, layout, tok)
        assert ns.bias_gelu_fusion == cfg.openai_gelu  # what Megatron-Core's MLP reads
        assert config_from_args(ns, 64, "x")[0].openai_gelu == cfg.openai_gelu
    with pytest.raises(CheckpointError, match="--openai-gelu without biases"):
        args_for(ModelConfig(vocab_size=64, openai_gelu=True, add_bias_linear=False), layout, tok)
    with pytest.raises(CheckpointError, match="squared_relu"):
        config_from_args(
            argparse.Namespace(**vars(args_for(ModelConfig(vocab_size=64), layout, tok)), squared_relu=True), 64, "x"
        )


def test_megatron_lm_fixtures_read_their_gelu():
    exact = load_megatron_file(str(FIXTURES / "gpt2" / "ckpt" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"))
    fused = load_megatron_file(
        str(FIXTURES / "gpt2_tanh" / "ckpt" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")
    )
    assert not exact["args"].bias_gelu_fusion and fused["args"].bias_gelu_fusion  # as make_fixture.py ran them
    assert not config_from_args(exact["args"], None, "gpt2")[0].openai_gelu
    assert config_from_args(fused["args"], None, "gpt2_tanh")[0].openai_gelu


def test_megatron_lm_checkpoint_with_bias_gelu_fusion_converts_with_its_logits(tmp_path):
    convert("megatron", "megalite", FIXTURES / "gpt2_tanh" / "ckpt", tmp_path / "ml")
    ref = torch.load(FIXTURES / "gpt2_tanh" / "logits.pt", weights_only=True)
    vocab = ref["vocab"]
    theirs = ref["logits"][:, :vocab]  # Megatron's padding rows are random, ours zero: not the model's
    assert theirs.abs().max() > 1.0
    assert (megalite_logits(tmp_path / "ml", ref["tokens"])[:, :vocab] - theirs).abs().max() < 1e-4
    # the exact GeLU on the same weights misses by more than the tolerance: the test tells them apart
    assert (megalite_logits(tmp_path / "ml", ref["tokens"], openai_gelu=False)[:, :vocab] - theirs).abs().max() > 1e-3


# -- Hugging Face ----------------------------------------------------------------------------------------
def test_hf_activation_names():
    c = {
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": 1,
        "n_embd": 16,
        "n_head": 2,
        "n_positions": 16,
        "vocab_size": 64,
    }
    for act, tanh in (
        ("gelu", False),
        ("gelu_python", False),
        ("gelu_new", True),
        ("gelu_pytorch_tanh", True),
        ("gelu_fast", True),
        (None, True),
    ):  # no key: GPT2Config's default, "gelu_new"
        cfg, arch = config_from_hf({**c, **({"activation_function": act} if act else {})}, "config.json", 128)
        assert cfg.openai_gelu == tanh, act
        assert hf_config(cfg, arch)["activation_function"] == ("gelu_new" if tanh else "gelu")
    for act in ("quick_gelu", "relu", "gelu_10"):
        with pytest.raises(CheckpointError, match=f"activation '{act}' is used"):
            config_from_hf({**c, "activation_function": act}, "config.json", 128)


@pytest.mark.slow
def test_hf_gelu_new_gpt2_converts_both_ways_with_equal_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    c = transformers.GPT2Config(
        vocab_size=100,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=32,
        initializer_range=0.3,
        activation_function="gelu_new",
        bos_token_id=None,
        eos_token_id=None,
    )
    hf = transformers.GPT2LMHeadModel(c).eval()
    with torch.no_grad():  # biases and norms away from 0/1, where a mix-up would not show
        for name, p in hf.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.2 * torch.randn(p.shape))
    hf.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 100, (12,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    assert want.abs().max() > 1.0
    convert("hf", "megalite", tmp_path / "hf", tmp_path / "ml")
    assert read_checkpoint(str(tmp_path / "ml"))[0].model.openai_gelu
    assert (megalite_logits(tmp_path / "ml", ids)[:, :100] - want).abs().max() < 1e-4
    assert (megalite_logits(tmp_path / "ml", ids, openai_gelu=False)[:, :100] - want).abs().max() > 1e-4

    convert("megalite", "hf", tmp_path / "ml", tmp_path / "back")  # an --openai-gelu run exported
    assert json.loads((tmp_path / "back" / "config.json").read_text())["activation_function"] == "gelu_new"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (back(ids[None]).logits[0] - want).abs().max() < 1e-4
