"""Generation and evaluation from checkpoints (megalite/inference.py, tools/generate.py, tools/evaluate.py).

* the KV cache changes nothing: cached logits equal the full forward's at every position (prompt in
  one step or several), and generation gives the same tokens with and without it, GPT-2 style
  (learned positions, tied) and Llama style (RoPE, GQA, SwiGLU, RMSNorm, untied), SDPA and unfused;
* greedy decoding is the argmax of the full forward at each step; top-k 1 is greedy; a seed fixes
  the sampled text and another seed changes it; top-p keeps the smallest set holding p;
* the CLIs end to end on a checkpoint trained here on real text: evaluate.py prints the loss the
  training log printed, generate.py prints the API's continuation, with or without the cache;
* bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from dataclasses import replace

import pytest
import torch

from megalite.config import ModelConfig
from megalite.inference import Sampling, build_model, generate, next_token, read_checkpoint, run_tokenizer
from megalite.model.gpt import GPTModel
from megalite.model.kv_cache import KVCache
from megalite.parallel.state import ParallelState
from megalite.tensor_parallel.random import RNGTracker

GPT2 = dict()
LLAMA = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    num_query_groups=2,
    untie_embeddings_and_output_weights=True,
    add_bias_linear=False,
)
STYLES = {
    "gpt2": (GPT2, "auto"),
    "llama": (LLAMA, "auto"),
    "llama-unfused": (LLAMA, "unfused"),
    "gpt2-unfused": (GPT2, "unfused"),
}


def _model(style: dict, backend: str = "auto", seed: int = 3) -> GPTModel:
    """A tiny random model with peaked outputs (large init), so wrong positions change the tokens."""
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=32,
        vocab_size=97,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.3,
        attention_backend=backend,
        **style,
    )
    ps = ParallelState.single()
    return GPTModel(cfg, ps, RNGTracker(seed, 0, 0, ps.device), seed).eval()


@pytest.mark.parametrize("name", list(STYLES))
@torch.no_grad()
def test_cached_logits_equal_full_forward(name):
    model = _model(*STYLES[name])
    tokens = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(0))
    full = model(tokens)  # [s, b, V]
    cache = KVCache.for_model(model, batch=2, max_len=20)
    pieces = [model(tokens[:, a:b], kv_cache=cache) for a, b in [(0, 7), (7, 8), (8, 13), (13, 20)]]
    assert cache.seq_len == 20
    torch.testing.assert_close(torch.cat(pieces, dim=0), full, atol=1e-5, rtol=1e-5)
    # grouped-query attention caches only the query groups' keys and values
    groups = model.cfg.query_groups
    assert cache.nbytes() == 2 * 2 * 2 * groups * 20 * model.cfg.head_dim * 4  # layers x (k, v) x b x ...


@pytest.mark.parametrize("name", list(STYLES))
def test_generation_with_cache_equals_without(name):
    model = _model(*STYLES[name])
    prompt = [5, 17, 3, 44]
    for sampling in [Sampling(greedy=True), Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=10, top_p=0.9)]:
        cached = generate(model, prompt, 24, sampling, seed=11)
        plain = generate(model, prompt, 24, sampling, seed=11, use_kv_cache=False)
        assert cached == plain and len(cached) == 24, (sampling, cached, plain)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@torch.no_grad()
def test_greedy_is_argmax_of_full_forward_each_step(name):
    model = _model(*STYLES[name])
    prompt = [1, 2, 3]
    out = generate(model, prompt, 16, Sampling(greedy=True))
    assert len(set(out)) > 1  # a constant sequence would not test positions
    for i, token in enumerate(out):
        seq = torch.tensor([prompt + out[:i]])
        assert int(model(seq)[-1, 0, :97].argmax()) == token, i


def test_seed_top_k_1_and_top_p():
    model = _model(LLAMA)
    prompt = [7, 8, 9]
    hot = Sampling(temperature=1.5)
    a, b, c = (generate(model, prompt, 20, hot, seed=s) for s in (5, 5, 6))
    assert a == b and a != c
    greedy = generate(model, prompt, 20, Sampling(greedy=True))
    assert generate(model, prompt, 20, Sampling(temperature=1.5, top_k=1), seed=5) == greedy
    assert generate(model, prompt, 20, Sampling(temperature=0.0), seed=5) == greedy
    # top-p: probabilities 0.5, 0.3, 0.15, 0.05 -> p=0.6 keeps {0, 1}, p=0.4 keeps {0} only
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    g = torch.Generator().manual_seed(0)
    assert {next_token(logits, Sampling(top_p=0.6), g) for _ in range(300)} == {0, 1}
    assert {next_token(logits, Sampling(top_p=0.4), g) for _ in range(50)} == {0}
    assert {next_token(logits, Sampling(top_k=3), g) for _ in range(300)} == {0, 1, 2}
    assert {next_token(logits, Sampling(), g) for _ in range(300)} == {0, 1, 2, 3}
    for bad in [Sampling(top_p=0.0), Sampling(top_p=1.5), Sampling(temperature=-0.1), Sampling(top_k=-1)]:
        with pytest.raises(ValueError):
            bad.check()


# -- the command lines, on a checkpoint trained here on real text ----------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 6-iteration run on pydoc text with its own BPE, saved: (checkpoint dir, training log, tokenizer flags)."""
    from pydoc_data.topics import topics

    import pretrain_gpt
    from megalite.config import DataConfig
    from megalite.data.preprocess import PreprocessOptions, preprocess
    from megalite.data.tokenizers.bpe_trainer import save_bpe, train_bpe

    root = tmp_path_factory.mktemp("gen")
    texts = [topics[k] for k in sorted(topics)[:40]]
    vocab_file, merge_file = save_bpe(*train_bpe(texts, 400), str(root))
    with open(root / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    tok = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    preprocess(
        PreprocessOptions(
            input=str(root / "docs.jsonl"),
            output_prefix=str(root / "docs"),
            tokenizer=tok,
            append_eod=True,
            workers=1,
            log_interval=0,
        )
    )
    tok_flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file, "--merge-file", merge_file]
    args = tok_flags + [
        "--data-path",
        str(root / "docs_text_document"),
        "--split",
        "90,8,2",
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--train-iters",
        "6",
        "--eval-interval",
        "6",
        "--eval-iters",
        "2",
        "--lr",
        "5e-3",
        "--lr-warmup-iters",
        "1",
        "--log-interval",
        "3",
        "--save",
        str(root / "ck"),
        "--ckpt-format",
        "torch",
    ]
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # the run's logger writes to the stdout it finds at start
        assert pretrain_gpt.main(args) == 0
    return str(root / "ck"), log.getvalue(), tok_flags


def _loss_line(text: str) -> str:
    return re.search(r"validation loss at iteration 6 \| lm loss value: \S+ \| lm loss PPL: \S+ \|", text).group(0)


def test_evaluate_cli_prints_the_training_runs_validation_loss(trained, capsys):
    from tools import evaluate

    ckpt, log, _ = trained
    assert evaluate.main(["--load", ckpt]) == 0
    out = capsys.readouterr().out
    assert _loss_line(out) == _loss_line(log)  # same samples, same loss, same wording
    assert evaluate.main(["--load", ckpt, "--split-name", "test", "--eval-iters", "1"]) == 0
    test_line = capsys.readouterr().out
    value = float(re.search(r"iteration 6 for test data \| lm loss value: (\S+) \|", test_line).group(1))
    assert 0 < value < 10 and f"{value:.6E}" not in _loss_line(log)


def test_generate_cli_prints_the_continuation(trained, capsys):
    from tools import generate as cli

    ckpt, _, _ = trained
    cfg, it, full = read_checkpoint(ckpt)
    assert it == 6 and cfg.model.vocab_size == run_tokenizer(cfg).vocab_size
    tokenizer, model = run_tokenizer(cfg), build_model(cfg, full)
    prompt = "The for statement"
    ids = generate(
        model, tokenizer.tokenize(prompt), 12, Sampling(temperature=0.9, top_k=40), seed=3, eod=tokenizer.eod
    )
    expected = tokenizer.detokenize([i for i in ids if i != tokenizer.eod])
    texts = []
    for extra in ([], ["--no-kv-cache"]):
        assert (
            cli.main(
                [
                    "--load",
                    ckpt,
                    "--prompt",
                    prompt,
                    "--max-new-tokens",
                    "12",
                    "--temperature",
                    "0.9",
                    "--top-k",
                    "40",
                    "--seed",
                    "3",
                ]
                + extra
            )
            == 0
        )
        captured = capsys.readouterr()
        texts.append(captured.out)
        assert "tokens/s" in captured.err
    assert texts[0] == texts[1] == expected + "\n"
    assert cli.main(["--load", ckpt, "--prompt", prompt, "--max-new-tokens", "12", "--seed", "4"]) == 0
    assert capsys.readouterr().out != texts[0]  # another seed, another text (default: sampling at temperature 1)


def _exit_code(main, args) -> int:
    """A CLI's exit code, whether returned or raised (argparse exits itself)."""
    try:
        return main(args)
    except SystemExit as e:
        return e.code


BAD_GENERATE = [
    (["--load", "{missing}"], "no such directory"),
    (["--load", "{empty}"], "no checkpoint there"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top-k", "-2"], "--top-k must be >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "the " * 40], "the model holds at most 32 positions"),
    (["--max-new-tokens", "40"], "lower --max-new-tokens to"),
    (["--top-k", "many"], "invalid int value"),
    (["--tokenizer-type", "NullTokenizer"], "--prompt cannot be tokenized by the NullTokenizer"),
    (["--ckpt-step", "3"], "not a complete megalite checkpoint"),
]


@pytest.mark.parametrize("args,message", BAD_GENERATE, ids=[m for _, m in BAD_GENERATE])
def test_bad_generate_input_is_one_line_exit_2(trained, tmp_path, capsys, args, message):
    from tools import generate as cli

    ckpt, _, _ = trained
    (tmp_path / "empty").mkdir()
    args = [a.format(missing=tmp_path / "missing", empty=tmp_path / "empty") for a in args]
    base = ["--load", ckpt, "--prompt", "The", "--max-new-tokens", "4"]
    assert _exit_code(cli.main, base + args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_bad_evaluate_input_is_one_line_exit_2(trained, tmp_path, capsys):
    from tools import evaluate

    ckpt, _, _ = trained
    for args, message in [
        (["--load", str(tmp_path / "none")], "no such directory"),
        (["--load", ckpt, "--eval-iters", "0"], "--eval-iters 0 must be >= 1"),
        (["--load", ckpt, "--split", "1,0,0", "--split-name", "test"], "test split has no"),
        (["--load", ckpt, "--split-name", "dev"], "invalid choice"),
    ]:
        assert _exit_code(evaluate.main, args) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_default_run_tokenizer_is_rebuilt_when_its_cache_is_gone(tmp_path, monkeypatch):
    from megalite.config import Config, DataConfig

    monkeypatch.setenv("MEGALITE_CACHE", str(tmp_path))
    gone = str(tmp_path / "elsewhere" / "pydoc_topics_text_document")  # the saving machine's cache
    cfg = Config(
        data=DataConfig(
            data_path=(gone,),
            tokenizer_type="GPT2BPETokenizer",
            vocab_file=gone + "/../vocab.json",
            merge_file=gone + "/../merges.txt",
        )
    )
    cfg = cfg.with_(model=replace(cfg.model, vocab_size=4096))
    tokenizer = run_tokenizer(cfg)
    assert (
        tokenizer.vocab_size == 4096
        and tokenizer.detokenize(tokenizer.tokenize("The for statement")) == "The for statement"
    )
