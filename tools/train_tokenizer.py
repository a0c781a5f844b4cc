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
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megalite.data.preprocess import iter_json_texts  # noqa: E402

PROG = "train_tokenizer.py"
# Smallest vocabularies that can work: byte-level BPE needs its 256 byte tokens
# and <|endoftext|>; SentencePiece with byte fallback needs unk/bos/eos, 256
# byte pieces and at least one character of the corpus (it says how many more).
MIN_VOCAB = {"bpe": 256 + 1, "sentencepiece": 3 + 256 + 1}


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help=".jsonl, .jsonl.gz or .txt files")
    p.add_argument("--json-key", default="text")
    p.add_argument("--type", choices=("bpe", "sentencepiece"), default="bpe")
    p.add_argument("--vocab-size", type=int, default=4096,
                   help="total vocabulary including special tokens")
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
            return ("--type sentencepiece needs the sentencepiece package, which is not "
                    "installed: pip install sentencepiece (or use --type bpe)")
    low = MIN_VOCAB[args.type]
    if args.vocab_size < low:
        return (f"--vocab-size {args.vocab_size} is too small for --type {args.type}: "
                f"it needs at least {low} (byte tokens and special tokens included)")
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


def _read(path: str, key: str) -> Iterator[str]:
    """iter_json_texts, with a read failure (bad gzip, I/O error) naming the file."""
    try:
        yield from iter_json_texts(path, key)
    except (OSError, EOFError) as e:
        raise ValueError(f"cannot read --input {path}: {e}") from None


def _texts(args: argparse.Namespace) -> Optional[Iterator[str]]:
    """The documents to train on, or None when the input holds no text at all."""
    texts = itertools.chain.from_iterable(_read(f, args.json_key) for f in args.input)
    texts = (t for t in itertools.islice(texts, args.max_documents) if t and not t.isspace())
    first = next(texts, None)
    return None if first is None else itertools.chain([first], texts)


def _train(args: argparse.Namespace, texts: Iterator[str]) -> None:
    t0 = time.time()
    if args.type == "bpe":
        from megalite.data.tokenizers.bpe_trainer import save_bpe, train_bpe
        vocab, merges = train_bpe(texts, args.vocab_size, args.min_frequency)
        vocab_file, merge_file = save_bpe(vocab, merges, args.output_dir)
        print(f"wrote {vocab_file} ({len(vocab)} tokens) and {merge_file} ({len(merges)} merges)"
              f" in {time.time() - t0:.1f}s; use --tokenizer-type GPT2BPETokenizer")
    else:
        from megalite.data.tokenizers.sentencepiece import train_sentencepiece
        used = train_sentencepiece(texts, os.path.join(args.output_dir, "tokenizer"),
                                   args.vocab_size, args.sp_model_type)
        print(f"wrote {used.model} in {time.time() - t0:.1f}s; use --tokenizer-type "
              "Llama2Tokenizer or SentencePieceTokenizer --tokenizer-model " + used.model)


def main(argv: Optional[list[str]] = None) -> int:
    """CLI entry point; returns the exit code (2 with one line on stderr for bad input)."""
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    problem = _check_args(args)
    try:
        texts = None if problem else _texts(args)
        if not problem and texts is None:
            problem = (f"no text in {' '.join(args.input)}: every document is empty (a .jsonl "
                       f"line must be a JSON object with a string under --json-key "
                       f"{args.json_key!r}; a .txt file is one document a line)")
        if not problem:
            _train(args, texts)
    except (ValueError, RuntimeError, OSError, EOFError) as e:
        # bad vocabulary for this corpus, a gzip cut short, a disk that filled up
        problem = str(e).splitlines()[0] if str(e) else type(e).__name__
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
