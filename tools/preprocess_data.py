#!/usr/bin/env python
"""Tokenize a jsonl corpus into Megatron .bin/.idx files (Megatron's flags).

Example:
  python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
      --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
      --append-eod --workers 8
writes data/corpus_text_document.bin/.idx (one pair per --json-keys key).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megalite.config import DataConfig  # noqa: E402
from megalite.data.preprocess import PreprocessError, PreprocessOptions, preprocess  # noqa: E402
from megalite.data.tokenizers import TOKENIZER_TYPES  # noqa: E402

PROG = "preprocess_data.py"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    g = p.add_argument_group("input/output")
    g.add_argument("--input", required=True, help=".jsonl or .jsonl.gz, one JSON object a line")
    g.add_argument("--output-prefix", required=True)
    g.add_argument("--json-keys", nargs="+", default=["text"])
    g.add_argument(
        "--split-sentences",
        action="store_true",
        help="not supported (Megatron's needs nltk's punkt model): give each document "
        "as a JSON list of sentences instead; lists are read as Megatron reads "
        "the output of its sentence splitter, one sequence a sentence",
    )
    g.add_argument(
        "--skip-invalid",
        action="store_true",
        help="skip (and count) invalid JSON lines / lines missing a key, instead of stopping at the first one",
    )
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file")
    g.add_argument("--merge-file")
    g.add_argument("--tokenizer-model")
    g.add_argument("--vocab-size", type=int, help="NullTokenizer: ids are 0..N-1, eod is N")
    g.add_argument("--append-eod", action="store_true")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1)
    g.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="split the input into this many parts, each with --workers/partitions "
        "workers; lines go round robin to the parts (Megatron's order)",
    )
    g.add_argument(
        "--keep-sequential-samples",
        action="store_true",
        help="with --partitions: give each part a consecutive run of lines, so the "
        "output keeps the input's order (Megatron's flag)",
    )
    g.add_argument("--log-interval", type=int, default=10000, help="documents between lines")
    return p.parse_args(argv)


def _error(message: str) -> int:
    """Bad input: one line on stderr, exit status 2, no traceback (outputs stay under temporary names)."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.split_sentences:
        return _error(
            "--split-sentences is not supported; give each document as a JSON list "
            "of sentences (one sequence each, as Megatron writes split sentences)"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    tok = DataConfig(
        tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
    )
    opts = PreprocessOptions(
        input=args.input,
        output_prefix=args.output_prefix,
        tokenizer=tok,
        json_keys=tuple(args.json_keys),
        append_eod=args.append_eod,
        workers=args.workers,
        partitions=args.partitions,
        keep_sequential_samples=args.keep_sequential_samples,
        log_interval=args.log_interval,
        skip_invalid=args.skip_invalid,
        vocab_size=args.vocab_size,
    )
    try:
        stats = preprocess(opts)
    except (PreprocessError, ValueError, OSError) as e:  # OSError: a disk that filled up, a file gone
        return _error(" ".join(str(e).split()) or type(e).__name__)
    print(f"summary: {stats.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
