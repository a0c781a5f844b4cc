"""Throughput reporting: Megatron's FLOPs count, hardware FLOPs under recompute, MFU, the log line, TensorBoard.

Two outside references for the FLOPs: Megatron-LM's ``num_floating_point_operations``
(transcribed below from megatron/training/training.py of core_r0.16.0, the dense
GPT path, term by term as Megatron writes it; the real function is used too when
Megatron-LM's training package is importable), and torch's FLOP counter run over a
real forward and backward of the model (unfused attention: plain matmuls it can count).
"""

from __future__ import annotations

import argparse
import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megalite.config import ModelConfig
from megalite.observability.throughput import (
    Throughput,
    device_peak_tflops,
    flops_per_iteration,
    format_memory_report,
    peak_tflops_for,
    recompute_flops_per_iteration,
)
from megalite.parallel.state import ParallelState
from megalite.tensor_parallel.random import RNGTracker


def megatron_016_flops(args: argparse.Namespace, batch_size: int) -> float:
    """Megatron-LM core_r0.16.0 transformer_flops(), dense layers, no MTP, BSHD (as written there)."""
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    forward_backward_expansion_factor, fma_expansion_factor = 3, 2
    ffn_expansion_factor = 3 if args.swiglu else 2
    query_projection_size = args.kv_channels * args.num_attention_heads
    key_projection_size = value_projection_size = args.kv_channels * args.num_query_groups
    standard_self_attn_term = (
        forward_backward_expansion_factor
        * fma_expansion_factor
        * (
            args.hidden_size * (query_projection_size + key_projection_size + value_projection_size)
            + query_projection_size * args.hidden_size
        )
    )
    standard_self_attn_core_term = (
        forward_backward_expansion_factor * fma_expansion_factor * query_projection_size / 2 * 2
    )
    tokens = batch_size * args.seq_length
    return (
        tokens
        * (
            forward_backward_expansion_factor
            * fma_expansion_factor
            * args.hidden_size
            * args.ffn_hidden_size
            * ffn_expansion_factor
            * args.num_layers
            + standard_self_attn_term * args.num_layers
            + forward_backward_expansion_factor * fma_expansion_factor * args.hidden_size * args.padded_vocab_size
        )
        + batch_size * args.seq_length * args.seq_length * standard_self_attn_core_term * args.num_layers
    )


def megatron_015_flops(args: argparse.Namespace, batch_size: int) -> float:
    """Megatron-LM up to core_r0.15.0: the closed form with the full s x s attention square."""
    q_ratio = args.kv_channels * args.num_attention_heads / args.hidden_size
    gated = 3 / 2 if args.swiglu else 1
    return (
        12
        * batch_size
        * args.seq_length
        * args.num_layers
        * args.hidden_size**2
        * (
            (1 + args.num_query_groups / args.num_attention_heads + args.seq_length / args.hidden_size) * q_ratio
            + args.ffn_hidden_size / args.hidden_size * gated
            + args.padded_vocab_size / (2 * args.num_layers * args.hidden_size)
        )
    )


CONFIGS = {  # name: (ModelConfig kwargs, global batch)
    "gpt3-1.3b": (
        dict(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=50257),
        512,
    ),
    "llama2-7b": (
        dict(
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            seq_length=4096,
            ffn_hidden_size=11008,
            swiglu=True,
            vocab_size=32000,
        ),
        1024,
    ),
    "llama2-70b-gqa": (
        dict(
            num_layers=80,
            hidden_size=8192,
            num_attention_heads=64,
            num_query_groups=8,
            seq_length=4096,
            ffn_hidden_size=28672,
            swiglu=True,
            vocab_size=32000,
        ),
        1024,
    ),
    "tiny-gqa-swiglu": (
        dict(
            num_layers=3,
            hidden_size=96,
            num_attention_heads=6,
            num_query_groups=2,
            seq_length=40,
            swiglu=True,
            vocab_size=500,
        ),
        6,
    ),
}


def _megatron_args(cfg: ModelConfig, tp: int) -> argparse.Namespace:
    return argparse.Namespace(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        group_query_attention=cfg.num_query_groups is not None,
        num_query_groups=cfg.query_groups,
        kv_channels=cfg.head_dim,
        seq_length=cfg.seq_length,
        ffn_hidden_size=cfg.ffn_size,
        swiglu=cfg.swiglu,
        padded_vocab_size=cfg.padded_vocab_size(tp),
        num_experts=None,
        mtp_num_layers=None,
        multi_latent_attention=False,
        experimental_attention_variant=None,
        attention_output_gate=False,
        moe_ffn_hidden_size=None,
        moe_latent_size=None,
        moe_shared_expert_intermediate_size=None,
    )


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("tp", [1, 8])
def test_model_flops_equal_megatron_formula(name, tp):
    kw, gbs = CONFIGS[name]
    cfg = ModelConfig(**kw)
    args = _megatron_args(cfg, tp)
    ours = flops_per_iteration(cfg, gbs, cfg.padded_vocab_size(tp))
    assert ours == pytest.approx(megatron_016_flops(args, gbs), rel=1e-12)
    full_square = flops_per_iteration(cfg, gbs, cfg.padded_vocab_size(tp), causal=False)
    assert full_square == pytest.approx(megatron_015_flops(args, gbs), rel=1e-12)
    assert full_square > ours  # the causal count halves only the core attention


def test_model_flops_known_value_gpt3_1_3b():
    """Hand count for GPT-3 XL (24 x 2048, s 2048, V 50304): 72 b s L h^2 (1 + s/(12h)... ) expanded."""
    cfg = ModelConfig(**CONFIGS["gpt3-1.3b"][0])
    h, s, L, V = 2048, 2048, 24, 50304
    per_token = 6 * L * (4 * h * h + s * h + 8 * h * h) + 6 * h * V
    assert flops_per_iteration(cfg, 1, cfg.padded_vocab_size(1)) == pytest.approx(per_token * s, rel=1e-12)


def test_against_megatron_lm_itself_when_importable():
    training = pytest.importorskip(
        "megatron.training.training",
        reason="Megatron-LM's training package is not installed (megatron-core's wheel does not ship it)",
    )
    for name, (kw, gbs) in CONFIGS.items():
        cfg = ModelConfig(**kw)
        args = _megatron_args(cfg, 1)
        assert flops_per_iteration(cfg, gbs, args.padded_vocab_size) == pytest.approx(
            training.num_floating_point_operations(args, gbs), rel=1e-12
        ), name


RECOMPUTE = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "full-uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
}


@pytest.mark.parametrize("model", ["gpt2", "llama-gqa"])
@pytest.mark.parametrize("recompute", list(RECOMPUTE))
def test_hardware_flops_equal_torch_flop_counter(model, recompute):
    """One forward + backward counted by torch: model FLOPs (full square) + what recompute re-runs."""
    from megalite.model.gpt import GPTModel

    base = dict(
        num_layers=3,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=24,
        vocab_size=300,
        attention_backend="unfused",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    if model == "llama-gqa":
        base.update(
            normalization="RMSNorm",
            swiglu=True,
            position_embedding_type="rope",
            num_query_groups=2,
            untie_embeddings_and_output_weights=True,
            add_bias_linear=False,
        )
    cfg = ModelConfig(**base, **RECOMPUTE[recompute])
    ps = ParallelState.single()
    gpt = GPTModel(cfg, ps, RNGTracker(1, 0, 0, ps.device), seed=1)
    b = 2
    tokens = torch.randint(0, 300, (b, cfg.seq_length))
    with FlopCounterMode(display=False) as counter:
        gpt.loss(gpt(tokens), tokens, torch.ones_like(tokens, dtype=torch.float32)).backward()
    measured = counter.get_total_flops()
    model_flops = flops_per_iteration(cfg, b, gpt.padded_vocab, causal=False)
    extra = recompute_flops_per_iteration(cfg, b, num_chunks=1, causal=False)
    assert measured == pytest.approx(model_flops + extra, rel=1e-9)
    assert (extra > 0) == (recompute != "none")
    if recompute == "full-block":  # 2 of the 3 layers are re-run
        assert extra == pytest.approx(
            recompute_flops_per_iteration(ModelConfig(**base, **RECOMPUTE["full-uniform"]), b, causal=False) * 2 / 3
        )


def test_peak_table_and_override():
    assert peak_tflops_for("NVIDIA A100-SXM4-80GB") == 312
    assert peak_tflops_for("NVIDIA H100 80GB HBM3") == 989
    assert peak_tflops_for("NVIDIA H100 PCIe") == 756
    assert peak_tflops_for("NVIDIA H200") == 989
    assert peak_tflops_for("NVIDIA B200") == 2250
    assert peak_tflops_for("NVIDIA GeForce RTX 3090") is None
    assert device_peak_tflops(torch.device("cpu")) is None  # no MFU on CPU ...
    assert device_peak_tflops(torch.device("cpu"), 2.5) == 2.5  # ... unless --peak-tflops


def test_throughput_figures_and_fields():
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=32,
        vocab_size=256,
        recompute_granularity="selective",
    )
    tp = Throughput(cfg, global_batch_size=8, padded_vocab=256, world_size=4, peak_tflops=0.5)
    f = tp.figures(sec_per_iter=0.25)
    assert f["tokens_per_s"] == 8 * 32 / 0.25
    assert f["tflops"] == pytest.approx(flops_per_iteration(cfg, 8, 256) / 0.25 / 1e12 / 4)
    assert f["hw_tflops"] > f["tflops"] and f["mfu"] == pytest.approx(f["tflops"] / 0.5)
    fields = tp.log_fields(f)
    assert "hardware TFLOP/s/GPU (with recompute)" in fields and "MFU:" in fields
    plain = Throughput(
        ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256), 8, 256, 4
    )
    text = plain.log_fields(plain.figures(0.25))
    assert "MFU" not in text and "hardware" not in text  # no peak, no recompute: nothing extra to say


def test_memory_report_line():
    line = format_memory_report(
        3, 10, {"allocated": 2**30, "max_allocated": 1.5 * 2**30, "reserved": 2**31, "max_reserved": 2**31}
    )
    assert line == (
        "[Rank 3] (after 10 iterations) memory (MB) | allocated: 1024.0 | max allocated: 1536.0 | "
        "reserved: 2048.0 | max reserved: 2048.0"
    )


def test_log_line_and_tensorboard_of_a_run(tmp_path, capsys):
    """A real 2-iteration run: MFU and hardware TFLOP/s in the log line after Megatron's fields, and in TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megalite.config.arguments import parse_args
    from megalite.data.loading import build_datasets
    from megalite.observability.logging import setup_logging
    from megalite.training import Trainer

    cfg = parse_args(
        [
            "--mock-data",
            "--vocab-size",
            "256",
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "2",
            "--seq-length",
            "16",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "4",
            "--train-iters",
            "2",
            "--log-interval",
            "1",
            "--eval-iters",
            "0",
            "--recompute-activations",
            "--peak-tflops",
            "0.001",
            "--tensorboard-dir",
            str(tmp_path),
        ]
    )
    ps = ParallelState.single()
    setup_logging(True, 0)
    trainer = Trainer(cfg, ps)
    trainer.train(*build_datasets(cfg, ps)[:2])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(" iteration")]
    assert len(lines) == 2
    line = lines[-1]
    order = [
        line.index(k)
        for k in (
            "throughput per GPU (TFLOP/s/GPU):",
            "tokens per second:",
            "hardware TFLOP/s/GPU (with recompute):",
            "MFU:",
        )
    ]
    assert order == sorted(order)  # our fields follow Megatron's
    ms = float(re.search(r"elapsed time per iteration \(ms\): ([\d.]+)", line).group(1))
    mfu = float(re.search(r"MFU: ([\d.]+)%", line).group(1))
    flops = flops_per_iteration(cfg.model, 4, 256)
    assert mfu == pytest.approx(100 * flops / (ms / 1e3) / 1e12 / 0.001, rel=0.02, abs=0.06)
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"throughput", "hardware-throughput", "mfu", "tokens-per-second"} <= tags
    assert acc.Scalars("hardware-throughput")[-1].value > acc.Scalars("throughput")[-1].value
