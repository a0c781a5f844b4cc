"""How many embedding rows a Megatron-LM run's vocabulary really holds, per tokenizer type.

Megatron-LM (``megatron/training/tokenizer/tokenizer.py``) builds the tokenizer
from the run's flags and pads ``tokenizer.vocab_size`` to a multiple of
``make_vocab_size_divisible_by * tp`` for the table (``padded_vocab_size``,
stored in the checkpoint's args). ``args.vocab_size`` is only its
``--vocab-size`` flag ("size of vocab before EOD or padding"), which most
tokenizers ignore::

    tokenizer_type               vocabulary (eod)                        args.vocab_size
    NullTokenizer                --vocab-size N + 1 (eod = N)            N
    GPT2BPETokenizer             entries of --vocab-file (<|endoftext|>)  ignored (usually None)
    SentencePieceTokenizer       model pieces + added <CLS> <SEP> <EOD>   ignored
                                 <MASK> (and pad/bos/eos when missing)
    Llama2Tokenizer,             the model's pieces (eos)                ignored
    GPTSentencePieceTokenizer
    HuggingFaceTokenizer         len(tokenizer) (eos)                    ignored
    TikTokenizer                 --vocab-size (default 2**17)            the vocabulary

megalite's ModelConfig.vocab_size is the tokenizer's vocabulary (eod
included), so converting keeps exactly the rows Megatron's tokenizer can
produce and drops only the padding. A megalite run's own size is written back
the same way (NullTokenizer: one less) so that Megatron rebuilds the same
tokenizer.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional, Tuple

NULL_TYPES = ("NullTokenizer", "NullMultimodalTokenizer")
_FILE_TYPES = {
    "GPT2BPETokenizer": "vocab_file",
    "SentencePieceTokenizer": "tokenizer_model",
    "GPTSentencePieceTokenizer": "tokenizer_model",
    "Llama2Tokenizer": "tokenizer_model",
    "HuggingFaceTokenizer": "tokenizer_model",
}
_TIKTOKEN_DEFAULT = 2**17  # Megatron's TikTokenizer without --vocab-size


def with_tokenizer_files(ns: argparse.Namespace, files: Optional[dict]) -> argparse.Namespace:
    """``ns`` with the tokenizer files given to the converter in place of the stored paths.

    A checkpoint copied to another machine names its tokenizer files where they were when it was
    saved; Megatron's own converter takes ``--vocab-file`` for that, and so does ours.
    """
    # a path that exists is made absolute (the converted checkpoint records it); a hub name stays as given
    given = {k: os.path.abspath(v) if os.path.exists(v) else v for k, v in (files or {}).items() if v}
    return argparse.Namespace(**{**vars(ns), **given}) if given else ns


def check_vocab_fits(vocab: Optional[int], rows: Optional[int], note: str, where: str) -> None:
    """One line when the vocabulary found (``note`` says how) has more ids than the stored table has rows."""
    if vocab and rows and vocab > rows:
        from megalite.checkpointing.safe_load import CheckpointError

        raise CheckpointError(
            f"{where}: the vocabulary ({note}) has {vocab} ids but the embedding table holds "
            f"{rows} rows; pass --true-vocab-size"
        )


def vocab_size_arg(tokenizer_type: Optional[str], vocab: int) -> int:
    """``args.vocab_size`` that makes Megatron's tokenizer of this type hold ``vocab`` ids (eod included)."""
    return vocab - 1 if tokenizer_type in NULL_TYPES else vocab


def _files_vocab(kind: str, ns: argparse.Namespace) -> Tuple[Optional[int], str]:
    """(vocabulary from the tokenizer's files, or None; why) for a file-based tokenizer type."""
    path = getattr(ns, _FILE_TYPES[kind], None)
    flag = "--" + _FILE_TYPES[kind].replace("_", "-")
    if not path or not os.path.exists(path):
        return None, f"{kind}'s {flag} {path or '(not stored)'} is not on this machine"
    from megalite.config import DataConfig
    from megalite.data.tokenizers import build_tokenizer

    mine = "Llama2Tokenizer" if kind == "GPTSentencePieceTokenizer" else kind  # same pieces, same size
    try:
        if kind == "GPT2BPETokenizer":  # Megatron counts the vocabulary file's entries; merges do not matter
            from megalite.data.tokenizers.gpt2_bpe import read_vocab

            return len(read_vocab(path)), f"{kind}: {path} holds the ids"
        tok = build_tokenizer(DataConfig(tokenizer_type=mine, tokenizer_model=path))
        extra = int(getattr(ns, "vocab_extra_ids", 0) or 0) if kind == "SentencePieceTokenizer" else 0
        if extra:  # Megatron appends <extra_id_0..N-1> to a SentencePieceTokenizer's pieces
            return tok.vocab_size + extra, f"{kind}: {path} holds the ids, plus --vocab-extra-ids {extra}"
        return tok.vocab_size, f"{kind}: {path} holds the ids"
    except (ImportError, OSError, ValueError, KeyError, RuntimeError) as e:
        return None, f"{kind}'s {flag} {path} cannot be read ({type(e).__name__})"


def megatron_vocab(
    ns: argparse.Namespace, table_rows: Optional[int], true_vocab: Optional[int] = None
) -> Tuple[Optional[int], str]:
    """(the rows of the embedding table that are vocabulary, eod included; how that was found).

    None means nothing says: the caller keeps the whole (padded) table and says so.
    ``table_rows`` is the stored table's height (``padded_vocab_size``) when known.
    """
    kind = getattr(ns, "tokenizer_type", None)
    stored = getattr(ns, "vocab_size", None)
    if true_vocab:
        return int(true_vocab), f"--true-vocab-size {true_vocab}"
    if kind in NULL_TYPES and stored:
        return int(stored) + 1, f"{kind}: --vocab-size {stored} ids plus eod {stored}"
    if kind == "TikTokenizer":
        return int(stored or _TIKTOKEN_DEFAULT), f"{kind}: --vocab-size {stored or _TIKTOKEN_DEFAULT}"
    if kind in _FILE_TYPES:
        found, why = _files_vocab(kind, ns)
    else:
        found, why = None, f"tokenizer {kind}" if kind else "no tokenizer"
    # a stored --vocab-size (megalite writes the vocabulary there) may count rows the files lack:
    # keeping rows is lossless, dropping a real one is not
    if stored and (found is None or int(stored) > found) and (table_rows is None or int(stored) <= table_rows):
        return int(stored), f"{why}; the stored --vocab-size {stored}"
    return found, why
