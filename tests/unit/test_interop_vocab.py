"""Vocabulary and tokenizer across conversions (issue 22, items 3-4): Megatron's NullTokenizer keeps its
eod row, each tokenizer type's vocabulary is read as Megatron builds it, and an HF folder records a
tokenizer only when it has one. Every conversion runs the CLI in a fresh interpreter, as users do."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from megalite.checkpointing import save_checkpoint
from megalite.data.tokenizers.bpe_trainer import save_bpe, train_bpe
from megalite.inference import build_model, read_checkpoint, run_tokenizer
from megalite.interop.interchange import WORD
from megalite.interop.tokenizer_vocab import megatron_vocab, vocab_size_arg
from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from tests.helpers import REPO
from tests.helpers.parity import LLAMA_STYLE, tiny_config

N = 249  # NullTokenizer --vocab-size: ids 0..248 and eod 249, a vocabulary of 250 padded to 256
MEGATRON_FILE = "iter_0000000/mp_rank_00/model_optim_rng.pt"


def run(*cmd, check=True) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, *map(str, cmd)], cwd=REPO, capture_output=True, text=True, timeout=180)
    if check:
        assert out.returncode == 0, out.stderr
    return out


def convert(loader: str, saver: str, src, dst, *extra) -> subprocess.CompletedProcess:
    return run(
        "tools/checkpoint/convert.py",
        "--model-type",
        "GPT",
        "--loader",
        loader,
        "--saver",
        saver,
        "--load-dir",
        src,
        "--save-dir",
        dst,
        *extra,
    )


def megatron_args(root, rank_dir: str = "mp_rank_00") -> argparse.Namespace:
    return torch.load(root / "iter_0000000" / rank_dir / "model_optim_rng.pt", weights_only=False)["args"]


def null_run(tmp_path) -> Trainer:
    """A megalite NullTokenizer run (vocabulary N + 1, eod N) saved under tmp_path/ml."""
    cfg = tiny_config(dict(LLAMA_STYLE, init_method_std=0.3))  # vocabulary 250 = N + 1
    cfg = cfg.with_(data=replace(cfg.data, tokenizer_type="NullTokenizer"))
    t = Trainer(cfg, ParallelState.single())
    with torch.no_grad():  # an eod row unlike the others, so losing it shows
        t.chunks[0].state_dict()[WORD][N].fill_(1.5)
    save_checkpoint(t.run_parts, str(tmp_path / "ml"))
    return t


@pytest.mark.slow
def test_null_tokenizer_keeps_its_eod_row_through_megatron(tmp_path):
    t = null_run(tmp_path)
    convert("megalite", "megatron", tmp_path / "ml", tmp_path / "mt")
    ns = megatron_args(tmp_path / "mt")  # what Megatron-LM itself stores for --vocab-size N
    assert (ns.tokenizer_type, ns.vocab_size, ns.padded_vocab_size) == ("NullTokenizer", N, 256)
    out = convert("megatron", "megalite", tmp_path / "mt", tmp_path / "back")
    assert f"vocabulary: {N + 1} ids (NullTokenizer: --vocab-size {N} ids plus eod {N})" in out.stdout
    cfg, _, full = read_checkpoint(str(tmp_path / "back"))
    assert cfg.model.vocab_size == N + 1 and full[WORD].shape[0] == N + 1
    tok = run_tokenizer(cfg)
    assert (tok.eod, tok.vocab_size) == (N, N + 1)
    ids = torch.randint(0, N + 1, (1, 12), generator=torch.Generator().manual_seed(0))
    ids[0, 5] = N
    model = build_model(cfg, full)
    with torch.no_grad():
        want = t.chunks[0].eval()(ids)[..., : N + 1]
        got = model(ids)[..., : N + 1]
    assert (got - want).abs().max() < 1e-5 and want[..., N].abs().max() > 0.1  # eod's logit included
    # and back to Megatron: still --vocab-size N
    convert("megalite", "megatron", tmp_path / "back", tmp_path / "mt2", "--target-tensor-parallel-size", 2)
    ns = megatron_args(tmp_path / "mt2", "mp_rank_01")
    assert (ns.vocab_size, ns.padded_vocab_size) == (N, 256)


@pytest.mark.slow
def test_megatron_gpt2_bpe_run_reads_its_vocabulary_file(tmp_path):
    """Megatron-LM stores no --vocab-size for GPT2BPETokenizer: the vocabulary is the vocab file's."""
    null_run(tmp_path)
    convert("megalite", "megatron", tmp_path / "ml", tmp_path / "mt")
    vocab = {f"t{i}": i for i in range(N)} | {"<|endoftext|>": N}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    path = tmp_path / "mt" / MEGATRON_FILE
    sd = torch.load(path, weights_only=False)
    sd["args"].tokenizer_type, sd["args"].vocab_size = "GPT2BPETokenizer", None
    sd["args"].vocab_file, sd["args"].merge_file = str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")
    torch.save(sd, path)
    out = convert("megatron", "megalite", tmp_path / "mt", tmp_path / "back")
    assert f"vocabulary: {N + 1} ids (GPT2BPETokenizer" in out.stdout
    cfg, _, full = read_checkpoint(str(tmp_path / "back"))
    assert full[WORD].shape[0] == N + 1 and run_tokenizer(cfg).eod == N


def test_vocabulary_rule_per_tokenizer_type(tmp_path):
    ns = argparse.Namespace
    assert megatron_vocab(ns(tokenizer_type="NullTokenizer", vocab_size=100), 128)[0] == 101
    assert megatron_vocab(ns(tokenizer_type="NullTokenizer", vocab_size=100), 128, true_vocab=100)[0] == 100
    assert megatron_vocab(ns(tokenizer_type="TikTokenizer", vocab_size=None), None)[0] == 2**17
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "<|endoftext|>": 2}))
    gpt2 = dict(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"))
    assert megatron_vocab(ns(**gpt2, vocab_size=None), 128)[0] == 3
    assert megatron_vocab(ns(**gpt2, vocab_size=5), 128)[0] == 5  # rows the run recorded are kept
    missing = dict(gpt2, vocab_file=str(tmp_path / "gone.json"))
    vocab, why = megatron_vocab(ns(**missing, vocab_size=None), 128)
    assert vocab is None and "not on this machine" in why  # the caller keeps the padded table and warns
    assert megatron_vocab(ns(**missing, vocab_size=7), 128)[0] == 7
    assert megatron_vocab(ns(tokenizer_type=None, vocab_size=4096), 4096)[0] == 4096  # megalite mock runs
    assert (vocab_size_arg("NullTokenizer", 101), vocab_size_arg("GPT2BPETokenizer", 101), vocab_size_arg(None, 9)) == (
        100,
        101,
        9,
    )


# -- Hugging Face folders with and without a tokenizer --------------------------------------------------
def tiny_hf(style: str, vocab: int):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if style == "gpt2":
        c = transformers.GPT2Config(
            vocab_size=vocab,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            initializer_range=0.3,
            bos_token_id=None,
            eos_token_id=None,
        )
        return transformers.GPT2LMHeadModel(c).eval()
    c = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return transformers.LlamaForCausalLM(c).eval()


def hf_greedy(model, prompt, n: int) -> list:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_hf_folder_without_tokenizer_records_none(tmp_path, style):
    hf = tiny_hf(style, 100)
    hf.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "generation_config.json").exists()  # save_pretrained's, not a tokenizer
    out = convert("hf", "megalite", tmp_path / "hf", tmp_path / "ml")
    assert "tokenizer: none found" in out.stdout and "--vocab-size 100" in out.stdout
    assert not (tmp_path / "ml" / "tokenizer").exists()
    prompt = [5, 17, 42, 8]
    gen = run(
        "tools/generate.py",
        "--load",
        tmp_path / "ml",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        100,
        "--prompt",
        " ".join(map(str, prompt)),
        "--greedy",
        "--max-new-tokens",
        10,
        "--device",
        "cpu",
    )
    got = [int(x) for x in gen.stdout.split()]
    want = hf_greedy(hf, prompt, 10)
    assert got == want and len(set(want)) > 1
    if style == "gpt2":  # no tokenizer flags: ids all the same, and a word saying so
        plain = run(
            "tools/generate.py",
            "--load",
            tmp_path / "ml",
            "--prompt",
            "5 17 42 8",
            "--greedy",
            "--max-new-tokens",
            10,
            "--device",
            "cpu",
        )
        assert [int(x) for x in plain.stdout.split()] == want and "records no tokenizer" in plain.stderr


@pytest.mark.slow
def test_hf_folder_with_tokenizer_files_records_and_uses_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    words = "the quick brown fox jumps over the lazy dog while a red cat sleeps near the warm door".split()
    texts = [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    (tmp_path / "tok").mkdir()
    save_bpe(*train_bpe(texts, 300), str(tmp_path / "tok"))  # what tools/train_tokenizer.py --type bpe writes
    tok = transformers.GPT2TokenizerFast(
        vocab=str(tmp_path / "tok" / "vocab.json"), merges=str(tmp_path / "tok" / "merges.txt")
    )
    assert len(tok) == len(json.loads((tmp_path / "tok" / "vocab.json").read_text())) > 256
    hf = tiny_hf("gpt2", len(tok))
    hf.save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    out = convert("hf", "megalite", tmp_path / "hf", tmp_path / "ml")
    assert "tokenizer: HuggingFaceTokenizer recorded" in out.stdout
    assert {p.name for p in (tmp_path / "ml" / "tokenizer").iterdir()} == {"tokenizer.json", "tokenizer_config.json"}
    prompt = "the lazy dog"
    ids = tok(prompt)["input_ids"]
    end = tok.convert_tokens_to_ids("<|endoftext|>")
    want = hf_greedy(hf, ids, 8)
    want = want[: want.index(end)] if end in want else want  # megalite stops at eod
    gen = run(
        "tools/generate.py",
        "--load",
        tmp_path / "ml",
        "--prompt",
        prompt,
        "--greedy",
        "--max-new-tokens",
        8,
        "--device",
        "cpu",
    )
    assert gen.stdout.rstrip("\n") == tok.decode(want) and len(set(want)) > 1
    # vocab.json + merges.txt alone (no tokenizer.json): Megatron's GPT2BPETokenizer on the same files
    shutil.copytree(tmp_path / "hf", tmp_path / "hf2")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / "hf2" / name).unlink(missing_ok=True)
    shutil.copy(tmp_path / "tok" / "vocab.json", tmp_path / "hf2")
    shutil.copy(tmp_path / "tok" / "merges.txt", tmp_path / "hf2")
    out = convert("hf", "megalite", tmp_path / "hf2", tmp_path / "ml2")
    assert "tokenizer: GPT2BPETokenizer recorded" in out.stdout
    gen2 = run(
        "tools/generate.py",
        "--load",
        tmp_path / "ml2",
        "--prompt",
        prompt,
        "--greedy",
        "--max-new-tokens",
        8,
        "--device",
        "cpu",
    )
    assert gen2.stdout == gen.stdout
