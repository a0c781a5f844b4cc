"""What a mixture of experts adds to the log line, TensorBoard and the FLOP count: Megatron-LM's
load_balancing_loss / z_loss fields (its formats and placement), --moe-per-layer-logging, tokens per
expert, the stats reduced every iteration and averaged over the log interval; MoE FLOPs against
Megatron's num_floating_point_operations written out by hand."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from megalite.config import LoggingConfig
from megalite.data.mock_dataset import MockGPTDataset
from megalite.moe import moe_layers
from megalite.observability.logging import format_log_line, format_moe_fields, format_moe_layers, moe_tensorboard
from megalite.observability.throughput import flops_per_iteration
from megalite.parallel.state import ParallelState
from megalite.training import Trainer, reporting
from tests.helpers.parity import LLAMA_STYLE, tiny_config

MOE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_ffn_hidden_size=48)


def moe_cfg(model=None, iters=4, log_interval=2, per_layer=False):
    cfg = tiny_config({**LLAMA_STYLE, **MOE, **(model or {})}, gbs=8, mbs=2, num_layers=2)
    return cfg.with_(
        train=replace(cfg.train, train_iters=iters),
        logging=LoggingConfig(log_interval=log_interval, moe_per_layer_logging=per_layer),
    )


def test_dense_log_line_is_unchanged():
    line = format_log_line(10, 100, 80, 12.5, 0.25, 1e-4, 8, 2.5, 0.75, 0, 0, 1000.0)
    assert line == (
        " iteration       10/     100 | consumed samples:           80 | elapsed time per iteration (ms): "
        "12.5 | throughput per GPU (TFLOP/s/GPU): 0.250 | learning rate: 1.000000E-04 | global batch "
        "size:     8 | lm loss: 2.500000E+00 | loss scale: 1.0 | grad norm: 0.750 | number of skipped "
        "iterations:   0 | number of nan iterations:   0 | tokens per second: 1000.0 |"
    )


def test_moe_fields_follow_the_lm_loss_in_megatrons_formats():
    values = {
        "load_balancing_loss": 1.0123456,
        "load_balancing_loss layer 0": 1.1,
        "z_loss": 0.5,
        "z_loss layer 0": 0.5,
        "tokens_per_expert_min": 12.0,
        "tokens_per_expert_mean": 16.0,
        "tokens_per_expert_max": 20.25,
    }
    fields = format_moe_fields(values)
    # Megatron: losses as ' {key}: {avg:.6E} |' (total_loss_dict), its other MoE metrics ' {k}: {v:.2f} |'
    assert fields == (
        " load_balancing_loss: 1.012346E+00 | z_loss: 5.000000E-01 | tokens_per_expert_min: 12.00 |"
        " tokens_per_expert_mean: 16.00 | tokens_per_expert_max: 20.25 |"
    )
    line = format_log_line(10, 100, 80, 12.5, 0.25, 1e-4, 8, 2.5, 0.75, 0, 0, 1000.0, after_loss=fields)
    assert "| lm loss: 2.500000E+00 | load_balancing_loss: 1.012346E+00 | z_loss:" in line
    assert "tokens_per_expert_max: 20.25 | loss scale: 1.0 |" in line
    assert format_moe_layers(values) == ["    moe layer 0: load_balancing_loss: 1.100000E+00 | z_loss: 5.000000E-01 |"]
    # TensorBoard: Megatron's tags, per layer moe/<name>_layer_<i> (0-based global layer)
    assert moe_tensorboard(values, per_layer=False) == {k: v for k, v in values.items() if " layer " not in k}
    tags = moe_tensorboard(values, per_layer=True)
    assert tags["moe/load_balancing_loss_layer_0"] == 1.1 and tags["moe/z_loss_layer_0"] == 0.5


class _Board:
    """Stands in for TensorBoard: keeps every scalar written."""

    points: list = []

    def __init__(self, log_dir):
        pass

    def scalars(self, values, step):
        _Board.points += [(step, k, v) for k, v in values.items() if v is not None]

    def close(self):
        pass


def _train(cfg, monkeypatch):
    monkeypatch.setattr(reporting, "TensorBoard", _Board)
    _Board.points = []
    trainer = Trainer(cfg, ParallelState.single())
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("megalite")
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.INFO)
    try:
        ds = MockGPTDataset(
            cfg.model.seq_length,
            cfg.model.vocab_size,
            cfg.train.seed,
            cfg.train.train_iters * cfg.train.global_batch_size,
        )
        history = trainer.train(ds, None)
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    return trainer, history, lines


def test_log_line_shows_the_interval_mean_of_per_iteration_stats(monkeypatch):
    trainer, history, lines = _train(moe_cfg({"moe_layer_freq": (0, 1)}, per_layer=True), monkeypatch)
    moe = [h["moe"] for h in history]
    assert len(moe) == 4 and all(set(m) >= {"load_balancing_loss", "z_loss", "tokens_per_expert_mean"} for m in moe)
    # every iteration's routed tokens: gbs x s x topk over E experts (layer 1 only is MoE)
    assert all(m["tokens_per_expert_mean"] == pytest.approx(8 * 16 * 2 / 4) for m in moe)
    assert all(m["tokens_per_expert_min"] <= m["tokens_per_expert_mean"] <= m["tokens_per_expert_max"] for m in moe)
    assert set(k for m in moe for k in m if " layer " in k) == {
        "load_balancing_loss layer 1",
        "z_loss layer 1",
        "tokens_per_expert_min layer 1",
        "tokens_per_expert_max layer 1",
    }
    iteration_lines = [ln for ln in lines if ln.startswith(" iteration")]
    assert len(iteration_lines) == 2
    for line, window in zip(iteration_lines, (moe[:2], moe[2:])):
        mean = {k: sum(w[k] for w in window) / 2 for k in window[0]}
        assert format_moe_fields(mean) in line
        assert line.index("| lm loss:") < line.index("| load_balancing_loss:") < line.index("| loss scale:")
    assert any(ln.startswith("    moe layer 1: load_balancing_loss:") for ln in lines)
    assert not any(layer.stats for layer in moe_layers(trainer.chunks))  # reset after each step
    tags = {(step, k) for step, k, _ in _Board.points}
    for step in (2, 4):
        assert {
            (step, "load_balancing_loss"),
            (step, "z_loss"),
            (step, "moe/load_balancing_loss_layer_1"),
            (step, "moe/z_loss_layer_1"),
            (step, "tokens_per_expert_max"),
        } <= tags


def test_without_z_loss_only_the_balancing_loss_is_logged(monkeypatch):
    _, history, lines = _train(moe_cfg({"moe_z_loss_coeff": None}, iters=2), monkeypatch)
    line = next(ln for ln in lines if ln.startswith(" iteration"))
    assert "load_balancing_loss:" in line and "z_loss" not in line
    assert "moe/" not in " ".join(k for _, k, _ in _Board.points)  # no per-layer tags without the flag


def test_dense_run_logs_no_moe_field(monkeypatch):
    cfg = tiny_config(LLAMA_STYLE, gbs=8, mbs=2, num_layers=2)
    cfg = cfg.with_(train=replace(cfg.train, train_iters=2), logging=LoggingConfig(log_interval=2))
    _, history, lines = _train(cfg, monkeypatch)
    line = next(ln for ln in lines if ln.startswith(" iteration"))
    assert "moe" not in history[0] and "loss |" not in line.split("lm loss:")[1].split("loss scale")[0]


def megatron_flops(a: dict, batch: int) -> float:
    """Megatron-LM's num_floating_point_operations (training.py, MHA/GQA, no MTP/MLA/latent, BSHD), written
    out for the terms a GPT with experts uses."""
    pattern = (
        [1 if i % a["moe_layer_freq"] == 0 else 0 for i in range(a["num_layers"])]
        if isinstance(a["moe_layer_freq"], int)
        else list(a["moe_layer_freq"])
    )
    num_moe = sum(pattern)
    num_dense = a["num_layers"] - num_moe
    ffn_exp = 3 if a["swiglu"] else 2
    shared = a["moe_shared_expert_intermediate_size"] or 0
    q = a["kv_channels"] * a["num_attention_heads"]
    kv = a["kv_channels"] * a["num_query_groups"]
    attn = 3 * 2 * (a["hidden_size"] * (q + kv + kv) + q * a["hidden_size"])
    core = 3 * 2 * q / 2 * 2
    tokens, s = batch * a["seq_length"], a["seq_length"]
    return (
        tokens
        * (
            3
            * 2
            * a["hidden_size"]
            * (
                a["ffn_hidden_size"] * ffn_exp * num_dense
                + a["moe_ffn_hidden_size"] * a["moe_router_topk"] * ffn_exp * num_moe
                + shared * ffn_exp * num_moe
            )
            + attn * a["num_layers"]
            + 3 * 2 * a["hidden_size"] * a["padded_vocab_size"]
        )
        + batch * s * s * core * a["num_layers"]
    )


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"moe_layer_freq": 2, "moe_shared_expert_intermediate_size": 64},
        {"moe_layer_freq": (0, 1, 1, 1), "moe_router_topk": 1, "swiglu": False, "normalization": "LayerNorm"},
        {"moe_ffn_hidden_size": None},
    ],
)
def test_moe_flops_equal_megatrons_formula(extra):
    from megalite.config import ModelConfig

    kw = dict(
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=704,
        seq_length=512,
        vocab_size=1000,
        swiglu=True,
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=128,
    )
    kw.update(extra)
    cfg = ModelConfig(**kw)
    args = dict(
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        num_query_groups=4,
        kv_channels=32,
        ffn_hidden_size=704,
        seq_length=512,
        swiglu=kw["swiglu"],
        moe_router_topk=kw["moe_router_topk"],
        moe_ffn_hidden_size=kw["moe_ffn_hidden_size"] or 704,
        moe_layer_freq=kw.get("moe_layer_freq", 1),
        moe_shared_expert_intermediate_size=kw.get("moe_shared_expert_intermediate_size"),
        padded_vocab_size=cfg.padded_vocab_size(1),
    )
    assert flops_per_iteration(cfg, 16, cfg.padded_vocab_size(1)) == pytest.approx(megatron_flops(args, 16), rel=1e-12)
    dense = replace(cfg, num_experts=None)  # experts at top-k x moe ffn: active, not total, parameters
    assert flops_per_iteration(cfg, 16, 1024) != flops_per_iteration(dense, 16, 1024)


def _history_moe(ps: ParallelState, cfg):
    trainer = Trainer(cfg, ps)
    ds = MockGPTDataset(
        cfg.model.seq_length, cfg.model.vocab_size, cfg.train.seed, cfg.train.train_iters * cfg.train.global_batch_size
    )
    return [h["moe"] for h in trainer.train(ds, None)]


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_every_rank_reduces_the_same_figures_as_one_process(dispatcher, run_distributed):
    """Expert parallelism over 2 ranks (data-parallel for the dense layers): each rank routes its own
    micro-batches and the reduction over the world gives the one-process figures, on every rank."""
    cfg = moe_cfg(iters=2)
    one = _history_moe(ParallelState.single(), cfg)
    cfg2 = cfg.with_(parallel=replace(cfg.parallel, ep=2, moe_token_dispatcher_type=dispatcher))
    ranks = run_distributed(_history_moe, 2, cfg2, ep=2)
    for got in ranks:
        for step, ref in zip(got, one):
            assert set(step) == set(ref)
            for k, v in ref.items():
                assert step[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
