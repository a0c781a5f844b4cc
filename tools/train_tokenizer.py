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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megalite.data.preprocess import iter_json_texts  # noqa: E402


def main(argv=None) -> int:
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
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    texts = itertools.chain.from_iterable(iter_json_texts(f, args.json_key) for f in args.input)
    texts = itertools.islice(texts, args.max_documents)
    t0 = time.time()
    if args.type == "bpe":
        from megalite.data.tokenizers.bpe_trainer import save_bpe, train_bpe
        vocab, merges = train_bpe(texts, args.vocab_size, args.min_frequency)
        vocab_file, merge_file = save_bpe(vocab, merges, args.output_dir)
        print(f"wrote {vocab_file} ({len(vocab)} tokens) and {merge_file} ({len(merges)} merges)"
              f" in {time.time() - t0:.1f}s; use --tokenizer-type GPT2BPETokenizer")
    else:
        from megalite.data.tokenizers.sentencepiece import train_sentencepiece
        model = train_sentencepiece(texts, os.path.join(args.output_dir, "tokenizer"),
                                    args.vocab_size, args.sp_model_type)
        print(f"wrote {model} in {time.time() - t0:.1f}s; use --tokenizer-type "
              "Llama2Tokenizer or SentencePieceTokenizer --tokenizer-model " + model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
