#!/usr/bin/env python
"""Train a tokenizer offline from jsonl (or plain text, one document a line).

Examples:
  python tools/train_tokenizer.py --input corpus.jsonl --type bpe --vocab-size 4096 \
      --output-dir tok/            # -> tok/vocab.json, tok/merges.txt (GPT2BPETokenizer)
  python tools/train_tokenizer.py --input corpus.jsonl --type sentencepiece \
      --vocab-size 8000 --output-dir tok/   # -> tok/tokenizer.model (Llama2Tokenizer)
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megalite.data.preprocess import open_binary  # noqa: E402

PROG = "train_tokenizer.py"
# Smallest vocabularies that can work: byte-level BPE needs its 256 byte tokens
# and <|endoftext|>; SentencePiece with byte fallback needs unk/bos/eos, 256
# byte pieces and at least one character of the corpus (it says how many more).
MIN_VOCAB = {"bpe": 256 + 1, "sentencepiece": 3 + 256 + 1}


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help=".jsonl, .jsonl.gz or .txt files")
    p.add_argument(
        "--json-key",
        default="text",
        help="the key holding each document's text (a string or a list of strings).\n"
        "A .jsonl line without one is skipped and counted; when more than half of\n"
        "the non-blank lines are invalid, nothing is trained (exit code 2)",
    )
    p.add_argument("--type", choices=("bpe", "sentencepiece"), default="bpe")
    p.add_argument("--vocab-size", type=int, default=4096, help="total vocabulary including special tokens")
    p.add_argument("--min-frequency", type=int, default=2, help="bpe: rarest pair merged")
    p.add_argument("--sp-model-type", default="bpe", choices=("bpe", "unigram"))
    p.add_argument("--max-documents", type=int, default=None, help="train on the first N only")
    p.add_argument("--output-dir", required=True)
    return p.parse_args(argv)


def _check_args(args: argparse.Namespace) -> Optional[str]:
    """The first problem with the arguments, as one line, or None."""
    for f in args.input:
        if not os.path.exists(f):
            return f"--input file not found: {f}"
        if not os.path.isfile(f):
            return f"--input {f} is not a file (give the .jsonl/.txt files themselves)"
    if args.type == "sentencepiece":
        try:
            import sentencepiece  # noqa: F401  (optional dependency)
        except ImportError:
            return (
                "--type sentencepiece needs the sentencepiece package, which is not "
                "installed: pip install sentencepiece (or use --type bpe)"
            )
    low = MIN_VOCAB[args.type]
    if args.vocab_size < low:
        return (
            f"--vocab-size {args.vocab_size} is too small for --type {args.type}: "
            f"it needs at least {low} (byte tokens and special tokens included)"
        )
    if args.min_frequency < 1:
        return f"--min-frequency must be >= 1 (got {args.min_frequency})"
    if args.max_documents is not None and args.max_documents < 1:
        return f"--max-documents must be >= 1 (got {args.max_documents})"
    # Checked now, not after an hour of training.
    try:
        os.makedirs(args.output_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=args.output_dir):
            pass
    except OSError as e:
        return f"--output-dir {args.output_dir} is not a writable directory ({e.strerror})"
    return None


def _json_text(line: str, key: str):
    """The text(s) under ``key`` of one jsonl line, or the reason the line is invalid (a str)."""
    try:
        obj = json.loads(line)
    except ValueError:
        return "not JSON"
    if not isinstance(obj, dict):
        return f"a JSON {type(obj).__name__}, not an object"
    if key not in obj:
        return f"no key {key!r} (keys: {', '.join(sorted(obj)[:5])})"
    value = obj[key]
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value  # a document of sentences, as preprocess_data.py reads it
    return f"{key!r} holds a {type(value).__name__}, not a string"


class Corpus:
    """The --input files' documents, counting the .jsonl lines that are skipped as invalid.

    A .txt file is one document a line. A .jsonl line that is not a JSON object with a string
    (or list of strings) under --json-key is skipped and counted; when more than half of the
    non-blank lines read are invalid, reading stops with a ValueError instead (wrong file or key).
    """

    def __init__(self, paths: list[str], key: str):
        self.paths, self.key = paths, key
        self.lines = self.invalid = 0
        self.first_invalid = ""

    def _read(self, path: str) -> Iterator[str]:
        plain = not path.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz"))
        try:
            with open_binary(path) as f:
                for lineno, raw in enumerate(f, 1):
                    line = raw.decode("utf-8", errors="replace")
                    if plain:
                        yield line
                        continue
                    if not line.strip():
                        continue
                    self.lines += 1
                    got = _json_text(line, self.key)
                    if isinstance(got, str):
                        self.invalid += 1
                        self.first_invalid = self.first_invalid or f"{path}:{lineno}: {got}"
                        continue
                    yield from got
        except (OSError, EOFError) as e:  # a bad gzip, an I/O error
            raise ValueError(f"cannot read --input {path}: {e}") from None

    def texts(self) -> Iterator[str]:
        yield from itertools.chain.from_iterable(self._read(p) for p in self.paths)

    def _what(self) -> str:
        return f"not a JSON object with a string under --json-key {self.key!r} (first: {self.first_invalid})"

    def skipped(self) -> str:
        """What was skipped, for the log (empty when nothing was)."""
        return f"skipped {self.invalid} of {self.lines} .jsonl lines: {self._what()}" if self.invalid else ""

    def refusal(self) -> str:
        """Why a corpus of mostly invalid lines (more than half of those read) is refused; empty if it is not."""
        if self.invalid * 2 <= self.lines:
            return ""
        return (
            f"{self.invalid} of {self.lines} .jsonl lines are {self._what()}; more than half are invalid, "
            f"so nothing is trained: check --input and --json-key"
        )

    def check(self) -> None:
        if self.refusal():
            raise ValueError(self.refusal())


def _texts(args: argparse.Namespace, corpus: Corpus) -> Optional[Iterator[str]]:
    """The documents to train on, or None when the input holds no text at all.

    The corpus is checked when the trainer has read it all (or --max-documents), before training.
    """

    def checked(texts: Iterator[str]) -> Iterator[str]:
        yield from texts
        corpus.check()

    texts = checked(itertools.islice(corpus.texts(), args.max_documents))
    texts = (t for t in texts if t and not t.isspace())
    first = next(texts, None)
    return None if first is None else itertools.chain([first], texts)


def _train(args: argparse.Namespace, texts: Iterator[str]) -> None:
    t0 = time.time()
    if args.type == "bpe":
        from megalite.data.tokenizers.bpe_trainer import save_bpe, train_bpe

        vocab, merges = train_bpe(texts, args.vocab_size, args.min_frequency)
        vocab_file, merge_file = save_bpe(vocab, merges, args.output_dir)
        print(
            f"wrote {vocab_file} ({len(vocab)} tokens) and {merge_file} ({len(merges)} merges)"
            f" in {time.time() - t0:.1f}s; use --tokenizer-type GPT2BPETokenizer"
        )
    else:
        from megalite.data.tokenizers.sentencepiece import train_sentencepiece

        used = train_sentencepiece(
            texts, os.path.join(args.output_dir, "tokenizer"), args.vocab_size, args.sp_model_type
        )
        print(
            f"wrote {used.model} in {time.time() - t0:.1f}s; use --tokenizer-type "
            "Llama2Tokenizer or SentencePieceTokenizer --tokenizer-model " + used.model
        )


def main(argv: Optional[list[str]] = None) -> int:
    """CLI entry point; returns the exit code (2 with one line on stderr for bad input)."""
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    problem = _check_args(args)
    corpus = Corpus(args.input, args.json_key)
    try:
        texts = None if problem else _texts(args, corpus)
        if not problem and texts is None:
            problem = (
                f"no text in {' '.join(args.input)}: every document is empty (a .jsonl "
                f"line must be a JSON object with a string under --json-key "
                f"{args.json_key!r}; a .txt file is one document a line)"
            )
        if not problem:
            _train(args, texts)
    except (ValueError, RuntimeError, OSError, EOFError) as e:
        # bad vocabulary for this corpus, a gzip cut short, a disk that filled up; SentencePiece
        # reports the corpus's refusal (raised in its reading loop) as its own RuntimeError
        problem = corpus.refusal() or (str(e).splitlines()[0] if str(e) else type(e).__name__)
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    if corpus.invalid:
        print(f"{PROG}: warning: {corpus.skipped()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
