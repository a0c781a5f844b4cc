"""Tokenizers: GPT-2 BPE against HF tokenizers, SentencePiece, Null, build_tokenizer errors."""

from __future__ import annotations

import json

import pytest

from megalite.config import DataConfig
from megalite.data.tokenizers import build_tokenizer
from megalite.data.tokenizers.gpt2_bpe import EOT_TOKEN, bytes_to_unicode, read_merges


def _gpt2(files):
    return build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=files[0], merge_file=files[1]))


def test_bytes_to_unicode_is_gpt2_table():
    table = bytes_to_unicode()
    assert len(table) == 256 and len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"
    assert list(table)[:3] == [ord("!"), ord('"'), ord("#")]


def test_trained_files_follow_gpt2_conventions(data_bpe_files):
    vocab_file, merge_file = data_bpe_files
    vocab = json.load(open(vocab_file, encoding="utf-8"))
    assert len(vocab) == 800 and vocab[EOT_TOKEN] == 799
    assert sorted(vocab.values()) == list(range(800))
    assert open(merge_file, encoding="utf-8").readline().startswith("#version")
    for a, b in read_merges(merge_file):
        assert a in vocab and b in vocab and a + b in vocab


def test_gpt2_bpe_ids_match_hf_tokenizers(data_bpe_files, data_texts):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.ByteLevelBPETokenizer(*data_bpe_files)
    tok = _gpt2(data_bpe_files)
    extra = ["x" * 300, "   ", "\n", "aaaaaaaa", "'s'S 'LL", "\x00\x01 control \x7f"]
    for text in data_texts + extra:
        assert tok.tokenize(text) == hf.encode(text).ids, text[:40]


def test_gpt2_bpe_round_trip_and_specials(data_bpe_files, data_texts):
    tok = _gpt2(data_bpe_files)
    assert tok.vocab_size == 800 and tok.eod == 799 and tok.pad is None
    for text in data_texts:
        assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.tokenize("\ud800x")  # lone surrogate does not crash


def test_null_tokenizer_megatron_semantics():
    tok = build_tokenizer(DataConfig(tokenizer_type="NullTokenizer"), 100)
    assert tok.vocab_size == 101 and tok.eod == 100
    assert tok.tokenize("3 1 4  1 5") == [3, 1, 4, 1, 5]
    assert tok.detokenize([3, 1, 4]) == "3 1 4"
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("101")


@pytest.mark.parametrize(
    "cfg, flag",
    [
        (DataConfig(tokenizer_type="GPT2BPETokenizer"), "--vocab-file"),
        (DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=__file__), "--merge-file"),
        (DataConfig(tokenizer_type="SentencePieceTokenizer"), "--tokenizer-model"),
        (DataConfig(tokenizer_type="Llama2Tokenizer", tokenizer_model="/nonexistent.model"), "--tokenizer-model"),
        (DataConfig(tokenizer_type="HuggingFaceTokenizer"), "--tokenizer-model"),
        (DataConfig(tokenizer_type="NullTokenizer"), "--vocab-size"),
        (DataConfig(tokenizer_type="Bogus"), "--tokenizer-type"),
    ],
)
def test_build_tokenizer_names_missing_flag(cfg, flag):
    with pytest.raises(ValueError, match=flag) as e:
        build_tokenizer(cfg)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory, data_texts):
    pytest.importorskip("sentencepiece")
    from megalite.data.tokenizers.sentencepiece import train_sentencepiece

    return train_sentencepiece(data_texts, str(tmp_path_factory.mktemp("sp") / "tok"), 500).model


def test_llama2_tokenizer_bos_eos(sp_model):
    tok = build_tokenizer(DataConfig(tokenizer_type="Llama2Tokenizer", tokenizer_model=sp_model))
    assert tok.vocab_size == 500 and tok.eod == 2 and tok.pad is None
    ids = tok.tokenize("Hello world")
    assert ids[0] == 1 and 2 not in ids
    assert tok.tokenize("Hello world", bos=False, eos=True)[-1] == 2
    assert tok.detokenize(ids) == "Hello world"
    assert tok.detokenize(tok.tokenize("日本語 🎉")) == "日本語 🎉"  # byte fallback


def test_trained_sentencepiece_keeps_newlines_tabs_and_spaces(sp_model):
    """Llama's identity normalization: code and multi-line text decode to exactly what was encoded."""
    tok = build_tokenizer(DataConfig(tokenizer_type="Llama2Tokenizer", tokenizer_model=sp_model))
    text = "def f(x):\n\treturn x  *  2\n\nend 12345"
    assert tok.detokenize(tok.tokenize(text)) == text


def test_sentencepiece_tokenizer_megatron_specials(sp_model):
    tok = build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model))
    # <CLS> <SEP> <EOD> <MASK> <PAD> appended; bos/eos exist in the model already.
    assert tok.vocab_size == 505 and tok.eod == 502 and tok.pad == 504
    ids = tok.tokenize("one<EOD>two")
    assert tok.eod in ids and ids.index(tok.eod) > 0
    assert tok.detokenize(ids) == "one <EOD> two"


def test_huggingface_tokenizer_from_json(tmp_path, data_bpe_files):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.ByteLevelBPETokenizer(*data_bpe_files)
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path)))
    gpt2 = _gpt2(data_bpe_files)
    assert tok.vocab_size == gpt2.vocab_size and tok.eod == gpt2.eod
    assert tok.tokenize("Some text, 日本") == gpt2.tokenize("Some text, 日本")


def test_train_tokenizer_tool_bpe(tmp_path, data_texts):
    import subprocess
    import sys

    from tests.helpers import REPO

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in data_texts) + "not json\n")
    out = subprocess.run(
        [
            sys.executable,
            "tools/train_tokenizer.py",
            "--input",
            str(corpus),
            "--vocab-size",
            "400",
            "--output-dir",
            str(tmp_path / "tok"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    tok = _gpt2((str(tmp_path / "tok" / "vocab.json"), str(tmp_path / "tok" / "merges.txt")))
    assert tok.vocab_size == 400 and tok.detokenize(tok.tokenize(data_texts[0])) == data_texts[0]


def test_megatron_sentencepiece_vocabulary_counts_its_extra_ids(sp_model):
    """A Megatron run's SentencePieceTokenizer holds the model's pieces, the added <CLS> <SEP> <EOD> <MASK>,
    and --vocab-extra-ids <extra_id_N> tokens: a converter keeps all of those rows."""
    import argparse

    from megalite.interop.tokenizer_vocab import megatron_vocab

    plain = build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model)).vocab_size
    ns = argparse.Namespace(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model, vocab_size=None)
    assert megatron_vocab(ns, 1024)[0] == plain
    ns.vocab_extra_ids = 7
    vocab, why = megatron_vocab(ns, 1024)
    assert vocab == plain + 7 and "--vocab-extra-ids 7" in why
