"""tools/checkpoint/convert.py in one process: HF export/import against transformers, lossless round
trips through every format, resharding, and bad input refused before anything is written."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from megalite.checkpointing import save_checkpoint
from tests.helpers import REPO
from tests.helpers.convert import VOCAB, convert, convert_cli, loaded, make_trainer, megalite_logits, parts, state


def greedy(step, ids: torch.Tensor, n: int) -> torch.Tensor:
    """n greedy tokens without a cache: the whole sequence again at every step."""
    for _ in range(n):
        ids = torch.cat([ids, step(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_hf_export_matches_transformers_and_round_trips(tmp_path, style):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    t = make_trainer(style)
    save_checkpoint(parts(t), str(tmp_path / "ml"))
    assert convert("megalite", "hf", tmp_path / "ml", tmp_path / "hf") == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == [{"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[style]]
    assert cfg["vocab_size"] == VOCAB  # padding (to 256) removed
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = megalite_logits(t, ids)
    with torch.no_grad():
        theirs = hf(ids).logits
    assert ours.abs().max() > 1.0  # logits far from trivially equal
    assert (ours - theirs).abs().max() < 1e-4
    prompt = ids[:, :4]
    with torch.no_grad():
        want = greedy(lambda x: megalite_logits(t, x), prompt, 10)
        got = hf.generate(
            prompt, max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0
        )
    assert torch.equal(got, want)
    # back to megalite: identical tensors, vocabulary padding re-added
    assert convert("hf", "megalite", tmp_path / "hf", tmp_path / "back") == 0
    before, after = state(t), state(loaded(style, tmp_path / "back"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_megatron_round_trip_through_sharded_files_is_lossless(tmp_path, style):
    t = make_trainer(style, num_layers=4)
    save_checkpoint(parts(t), str(tmp_path / "ml"))
    assert (
        convert(
            "megalite",
            "megatron",
            tmp_path / "ml",
            tmp_path / "mt",
            "--target-tensor-parallel-size",
            2,
            "--target-pipeline-parallel-size",
            2,
            "--target-num-layers-per-virtual-pipeline-stage",
            1,
        )
        == 0
    )
    files = sorted(str(p.relative_to(tmp_path / "mt")) for p in (tmp_path / "mt").rglob("*.pt"))
    assert files == [f"iter_0000000/mp_rank_{t:02d}_{p:03d}/model_optim_rng.pt" for t in range(2) for p in range(2)]
    sd = torch.load(tmp_path / "mt" / files[1], weights_only=False)  # tp 0, pp 1: layers 1 and 3
    assert isinstance(sd["args"], argparse.Namespace) and sd["args"].virtual_pipeline_model_parallel_size == 2
    assert {"model0", "model1"} <= sd.keys()
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in sd["model1"]  # chunk-local numbering
    assert "decoder.layers.1.self_attention.linear_qkv.weight" not in sd["model1"]
    # fused QKV per query group on each tp rank: rank 0 of a 2-group model holds group 0 = [q0 q1 k0 v0]
    full = t.chunks[0].state_dict()["decoder.layers.3.self_attention.linear_qkv.weight"]
    d, groups = 8, 4 if style == "gpt2" else 2
    q, k, v = full.split([32, groups * d, groups * d])
    per = 4 // groups
    want = torch.cat([q[: per * d], k[:d], v[:d]])
    assert torch.equal(sd["model1"]["decoder.layers.0.self_attention.linear_qkv.weight"][: want.shape[0]], want)
    assert convert("megatron", "megalite", tmp_path / "mt", tmp_path / "back") == 0
    before, after = state(t), state(loaded(style, tmp_path / "back", num_layers=4))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_reshard_to_torch_format_and_back(tmp_path):
    t = make_trainer("gpt2", num_layers=4)  # tied embeddings: the last stage keeps its own copy
    save_checkpoint(parts(t), str(tmp_path / "ml"))
    assert (
        convert(
            "megalite",
            "megalite",
            tmp_path / "ml",
            tmp_path / "tp2pp2",
            "--ckpt-format",
            "torch",
            "--target-tensor-parallel-size",
            2,
            "--target-pipeline-parallel-size",
            2,
            "--target-virtual-pipeline-model-parallel-size",
            2,
        )
        == 0
    )
    last = torch.load(tmp_path / "tp2pp2" / "iter_0000000" / "mp_rank_01_001" / "model_optim_rng.pt")
    assert last["model1"]["output_weight"].shape == (128, 32)  # vocab 250 padded to 256 over tp 2
    assert convert("megalite", "megalite", tmp_path / "tp2pp2", tmp_path / "one") == 0
    before, after = state(t), state(loaded("gpt2", tmp_path / "one", num_layers=4))
    assert all(torch.equal(before[k], after[k]) for k in before)


def _run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "tools/checkpoint/convert.py", "--model-type", "GPT", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    t = make_trainer("llama")  # 4 heads, 2 query groups, 2 layers
    save_checkpoint(parts(t), str(tmp_path / "ml"))
    cases = [
        (["--loader", "megatron", "--saver", "hf"], "not a Megatron-LM"),
        (["--loader", "hf", "--saver", "megalite"], "no config.json"),
        (["--loader", "megalite", "--saver", "megatron", "--target-tensor-parallel-size", 4], "query groups"),
        (["--loader", "megalite", "--saver", "megalite", "--target-pipeline-parallel-size", 3], "num-layers"),
    ]
    for i, (args, words) in enumerate(cases):
        if i == 0:  # the real command line: exit status 1, one line, no traceback
            r = _run_cli(*args, "--load-dir", tmp_path / "ml", "--save-dir", tmp_path / "out")
            code, err = r.returncode, r.stderr
        else:
            code = convert_cli.main(
                [
                    "--model-type",
                    "GPT",
                    *map(str, args),
                    "--load-dir",
                    str(tmp_path / "ml"),
                    "--save-dir",
                    str(tmp_path / "out"),
                ]
            )
            err = capsys.readouterr().err
        assert code == 1 and words in err, (args, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp-convert").exists()
    # a missing shard file
    assert convert("megalite", "megatron", tmp_path / "ml", tmp_path / "mt", "--target-tensor-parallel-size", 2) == 0
    os.remove(tmp_path / "mt" / "iter_0000000" / "mp_rank_01" / "model_optim_rng.pt")
    capsys.readouterr()
    assert convert("megatron", "hf", tmp_path / "mt", tmp_path / "hf") == 1
    err = capsys.readouterr().err
    assert "missing" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp-convert").exists()
    # an existing target is never overwritten
    assert convert("megalite", "hf", tmp_path / "ml", tmp_path / "mt") == 1
    assert "not empty" in capsys.readouterr().err


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/megalite_convert_pwned",))


def test_megatron_file_with_pickled_code_is_refused(tmp_path):
    t = make_trainer("gpt2")
    save_checkpoint(parts(t), str(tmp_path / "ml"))
    assert convert("megalite", "megatron", tmp_path / "ml", tmp_path / "mt") == 0
    path = tmp_path / "mt" / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt"
    sd = torch.load(path, weights_only=False)
    sd["args"].evil = _Boom()
    torch.save(sd, path)  # Megatron's protocol (2)
    r = _run_cli("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "mt", "--save-dir", tmp_path / "hf")
    assert r.returncode == 1 and "refusing" in r.stderr and "system" in r.stderr, r.stderr
    assert not os.path.exists("/tmp/megalite_convert_pwned")
