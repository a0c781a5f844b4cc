"""Mixture-of-experts checkpoint conversion (tools/checkpoint/convert.py) as users run it: the CLI in a
fresh interpreter on files another tool wrote.

- transformers' MixtralForCausalLM and Qwen2MoeForCausalLM (shared expert with its sigmoid gate;
  norm_topk_prob False = --moe-router-pre-softmax, True = the Mixtral rule; dense layers through
  mlp_only_layers), random init, save_pretrained -> megalite: the same logits as transformers within
  1e-4; exported back, from_pretrained loads every tensor and gives the same logits again;
- Megatron-LM's legacy layout (tp2 x pp2 x ep2: mp_rank_TT_PPP_EEE, local expert numbering) and
  megalite's torch format at ep2: lossless round trips, expert bias and ungated shared expert included;
- MoE features the target cannot hold: one line, exit 1, nothing written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megalite.checkpointing import save_checkpoint
from megalite.inference import build_model, read_checkpoint
from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from tests.helpers import REPO
from tests.helpers.convert import convert_argv
from tests.helpers.convert_moe import CONVERT, IDS, hf_model, logits, run_cli
from tests.helpers.parity import LLAMA_STYLE, tiny_config


def megalite_model(root):
    cfg, _, full = read_checkpoint(str(root))
    return build_model(cfg, full), cfg


CASES = {
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),  # norm_topk_prob False: pre-softmax
    "qwen2_moe_renorm_dense_layer": ("qwen2_moe", dict(norm_topk_prob=True, mlp_only_layers=[1])),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_hf_moe_import_and_export_keep_transformers_logits(tmp_path, case):
    import transformers

    kind, over = CASES[case]
    hf = hf_model(kind, **over)
    hf.save_pretrained(tmp_path / "hf")
    theirs = logits(hf, IDS, True)
    assert theirs.abs().max() > 1.0  # far from trivially equal
    done = run_cli("hf", "megalite", tmp_path / "hf", tmp_path / "ml")
    assert done.returncode == 0, done.stderr
    model, cfg = megalite_model(tmp_path / "ml")
    m = cfg.model
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_size) == (4, 2, 32)
    if kind == "qwen2_moe":
        assert (m.moe_shared_expert_intermediate_size, m.moe_shared_expert_gate) == (40, True)
        assert m.moe_router_pre_softmax == (not over.get("norm_topk_prob", False))
        assert m.moe_layer_freq == ((1, 0, 1) if over.get("mlp_only_layers") else 1)
    diff_in = (logits(model, IDS, False) - theirs).abs().max().item()
    assert diff_in < 1e-4, diff_in
    done = run_cli("megalite", "hf", tmp_path / "ml", tmp_path / "back")
    assert done.returncode == 0, done.stderr
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "back", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(back) is type(hf)
    diff_out = (logits(back.eval(), IDS, True) - theirs).abs().max().item()
    assert diff_out < 1e-4, diff_out
    print(f"{case}: max |logit diff| import {diff_in:.2e}, export {diff_out:.2e}")


def _moe_trainer(**model) -> Trainer:
    cfg = tiny_config(
        dict(LLAMA_STYLE, init_method_std=0.3, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, **model),
        num_layers=4,
    )
    return Trainer(cfg, ParallelState.single())


def _full(t: Trainer) -> dict:
    return {k: v.clone() for k, v in t.chunks[0].state_dict().items()}


def _save(t: Trainer, root) -> None:
    save_checkpoint(t.run_parts, str(root))


def _same_weights(root, want: dict) -> None:
    model, _ = megalite_model(root)
    got = model.state_dict()
    assert got.keys() == want.keys()
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, bad


@pytest.mark.slow
def test_megatron_legacy_moe_round_trip_tp2_pp2_ep2(tmp_path):
    """Expert bias, an ungated shared expert and every other layer dense, through Megatron's files."""
    t = _moe_trainer(moe_layer_freq=2, moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=24)
    with torch.no_grad():
        for m in t.chunks[0].modules():
            if getattr(m, "expert_bias", None) is not None:
                m.expert_bias.copy_(torch.arange(4.0) / 10)
    want = _full(t)
    _save(t, tmp_path / "ml")
    done = run_cli(
        "megalite",
        "megatron",
        tmp_path / "ml",
        tmp_path / "mt",
        "--target-tensor-parallel-size",
        2,
        "--target-pipeline-parallel-size",
        2,
        "--target-expert-parallel-size",
        2,
    )
    assert done.returncode == 0, done.stderr
    it = tmp_path / "mt" / "iter_0000000"
    assert sorted(os.listdir(it)) == [
        f"mp_rank_{a:02d}_{p:03d}_{e:03d}" for a in range(2) for p in range(2) for e in range(2)
    ]
    sd = torch.load(it / "mp_rank_01_001_001" / "model_optim_rng.pt", weights_only=False)
    model, args = sd["model"], sd["args"]
    assert (args.num_experts, args.expert_model_parallel_size, args.moe_layer_freq) == (4, 2, 2)
    # pp rank 1 holds layers 2, 3 as its 0, 1; ep rank 1 holds experts 2, 3 as local 0, 1 (tp shard 1)
    fc1 = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    full = want["decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"]
    gate, up = full.chunk(2)
    assert torch.equal(model[fc1], torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight" not in model
    assert torch.equal(model["decoder.layers.0.mlp.router.expert_bias"], torch.arange(4.0) / 10)
    assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2._extra_state" in model  # as megatron-core
    assert "decoder.layers.1.mlp.linear_fc1.weight" in model  # layer 3: dense
    done = run_cli(
        "megatron", "megalite", tmp_path / "mt", tmp_path / "back", "--true-vocab-size", t.cfg.model.vocab_size
    )
    assert done.returncode == 0, done.stderr
    _same_weights(tmp_path / "back", want)


@pytest.mark.slow
def test_megalite_torch_format_ep2_round_trip(tmp_path):
    t = _moe_trainer(moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True)
    want = _full(t)
    _save(t, tmp_path / "ml")
    done = run_cli(
        "megalite",
        "megalite",
        tmp_path / "ml",
        tmp_path / "ep2",
        "--ckpt-format",
        "torch",
        "--target-tensor-parallel-size",
        2,
        "--target-expert-parallel-size",
        2,
        "--target-expert-tensor-parallel-size",
        1,
    )
    assert done.returncode == 0, done.stderr
    it = tmp_path / "ep2" / "iter_0000000"
    assert sorted(n for n in os.listdir(it) if n.startswith("mp_rank")) == [
        "mp_rank_00_000",
        "mp_rank_00_001",
        "mp_rank_01_000",
        "mp_rank_01_001",
    ]
    meta = json.loads((it / "meta.json").read_text())
    assert (meta["layout"]["ep"], meta["layout"]["etp"], meta["model_shape"]["num_experts"]) == (2, 1, 4)
    sd = torch.load(it / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=False)["model"]
    name = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight"
    assert torch.equal(sd[name.format(3)], want[name.format(3)])  # etp 1: whole experts, global numbering
    assert name.format(1) not in sd
    done = run_cli("megalite", "megalite", tmp_path / "ep2", tmp_path / "back")
    assert done.returncode == 0, done.stderr
    _same_weights(tmp_path / "back", want)


def _one_line_error(code: int, out: str, err: str, *words: str) -> None:
    assert code == 1 and out.count("\n") <= 2, (out, err)
    err = err.strip()
    assert err.startswith("convert.py: error:") and "\n" not in err and "Traceback" not in err, err
    assert all(w in err for w in words), err


def test_moe_features_a_target_cannot_hold_fail_in_one_line(tmp_path, capsys):
    """Checked before anything is written (in-process: the CLI's own main)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_cli_moe", CONVERT)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)

    def fails(loader, saver, src, dst, *extra, words):
        code = cli.main(convert_argv(loader, saver, src, dst, *extra))
        captured = capsys.readouterr()
        _one_line_error(code, captured.out, captured.err, *words)

    hf = hf_model("qwen2_moe")
    with torch.no_grad():
        hf.model.layers[1].self_attn.k_proj.bias.fill_(0.5)
    hf.save_pretrained(tmp_path / "qkv")
    capsys.readouterr()
    fails("hf", "megalite", tmp_path / "qkv", tmp_path / "x1", words=("k_proj", "qkv"))
    cfg = json.loads((tmp_path / "qkv" / "config.json").read_text())
    (tmp_path / "win").mkdir()
    (tmp_path / "win" / "config.json").write_text(json.dumps(dict(cfg, use_sliding_window=True)))
    fails("hf", "megalite", tmp_path / "win", tmp_path / "x2", words=("sliding-window",))
    _save(_moe_trainer(moe_router_score_function="sigmoid"), tmp_path / "sig")
    fails("megalite", "hf", tmp_path / "sig", tmp_path / "x3", words=("sigmoid", "MixtralForCausalLM"))
    fails(
        "megalite",
        "megatron",
        tmp_path / "sig",
        tmp_path / "x4",
        "--target-format",
        "torch_dist",
        words=("torch_dist",),
    )
    fails(
        "megalite",
        "megalite",
        tmp_path / "sig",
        tmp_path / "x5",
        "--target-expert-parallel-size",
        3,
        words=("expert-parallel size 3",),
    )
    fails(
        "megalite",
        "megalite",
        tmp_path / "sig",
        tmp_path / "x6",
        "--ckpt-format",
        "torch",
        "--target-tensor-parallel-size",
        2,
        "--target-expert-tensor-parallel-size",
        4,
        words=("etp",),
    )
    fails(
        "megalite",
        "megatron",
        tmp_path / "sig",
        tmp_path / "x7",
        "--target-tensor-parallel-size",
        2,
        "--target-expert-tensor-parallel-size",
        1,
        words=("expert tp = tp",),
    )
    assert not any((tmp_path / f"x{i}").exists() for i in range(1, 8))


@pytest.mark.slow
def test_generate_and_evaluate_run_on_a_converted_mixtral(tmp_path):
    """tools/generate.py (KV cache) continues greedily as transformers' generate; tools/evaluate.py runs."""
    hf = hf_model("mixtral")
    hf.save_pretrained(tmp_path / "hf")
    assert run_cli("hf", "megalite", tmp_path / "hf", tmp_path / "ml").returncode == 0
    tool = lambda name, *args: subprocess.run(  # noqa: E731
        [sys.executable, str(REPO / "tools" / name), "--load", str(tmp_path / "ml"), "--device", "cpu", *args],
        capture_output=True,
        text=True,
        cwd=str(REPO),
        timeout=120,
    )
    done = tool("generate.py", "--prompt", "1 2 3", "--max-new-tokens", "8", "--greedy")
    assert done.returncode == 0, done.stderr
    prompt = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        want = hf.generate(
            prompt, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0
        )[0, 3:].tolist()
    assert " ".join(map(str, want)) in done.stdout, (want, done.stdout)
    done = tool(
        "evaluate.py", "--mock-data", "--eval-iters", "1", "--micro-batch-size", "1", "--global-batch-size", "1"
    )
    assert done.returncode == 0 and "lm loss value" in done.stdout, (done.stdout, done.stderr)
