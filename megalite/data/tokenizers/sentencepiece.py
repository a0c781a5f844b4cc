"""SentencePiece tokenizers: Megatron's SentencePieceTokenizer and Llama2Tokenizer.

``SentencePieceTokenizer`` appends Megatron's special tokens (<CLS>, <SEP>,
<EOD>, <MASK>, and pad/bos/eos when the model lacks them) after the model's
pieces and recognizes them literally in text; eod is <EOD>.
``Llama2Tokenizer`` uses the model's own ids: every text starts with bos, eod
is the model's eos, and the vocabulary is exactly the model's.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence

from megalite.data.tokenizers.base import Tokenizer

logger = logging.getLogger(__name__)


def _load(model_file: str):
    import sentencepiece as spm  # optional dependency: only needed for these tokenizers

    if not os.path.isfile(model_file):
        if os.path.isdir(model_file):
            raise ValueError(f"--tokenizer-model {model_file} is a directory, not a file")
        raise ValueError(f"--tokenizer-model file not found: {model_file}")
    try:
        return spm.SentencePieceProcessor(model_file=model_file)
    except (RuntimeError, OSError) as e:  # the library's parse error names neither flag nor remedy
        reason = (str(e).splitlines() or [type(e).__name__])[0].replace(f" from {model_file}", "")
        reason = reason.removeprefix("INTERNAL: ")
        raise ValueError(
            f"--tokenizer-model {model_file} is not a SentencePiece model ({reason}); give the "
            f".model file written by SentencePiece's trainer (e.g. tools/train_tokenizer.py "
            f"--type sentencepiece)"
        ) from None


def _piece_or(sp, piece_id: int, fallback: str) -> str:
    if 0 <= piece_id < sp.get_piece_size():
        return sp.id_to_piece(piece_id)
    return fallback


class SentencePieceTokenizer(Tokenizer):
    """SentencePiece model plus Megatron's appended special tokens."""

    def __init__(self, model_file: str):
        self.sp = _load(model_file)
        self.vocab = {self.sp.id_to_piece(i): i for i in range(self.sp.get_piece_size())}
        self.special: dict[str, int] = {}
        for tok in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            self._add_special(tok)
        self._pad = self._add_special(_piece_or(self.sp, self.sp.pad_id(), "<PAD>"))
        self._bos = self._add_special(_piece_or(self.sp, self.sp.bos_id(), "<BOS>"))
        self._eos = self._add_special(_piece_or(self.sp, self.sp.eos_id(), "<EOS>"))
        self.inv_special = {v: k for k, v in self.special.items()}

    def _add_special(self, tok: str) -> int:
        if tok not in self.vocab:
            self.vocab[tok] = len(self.vocab)
        self.special[tok] = self.vocab[tok]
        return self.vocab[tok]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def eod(self) -> int:
        return self.special["<EOD>"]

    @property
    def pad(self) -> Optional[int]:
        return self._pad

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        idx = 0
        while True:
            # The earliest special token occurring in the rest of the text.
            hits = [(text.find(t, idx), t) for t in self.special]
            hits = [(pos, t) for pos, t in hits if pos >= 0]
            if not hits:
                break
            pos, tok = min(hits)
            ids.extend(self.sp.encode(text[idx:pos]))
            ids.append(self.special[tok])
            idx = pos + len(tok)
        ids.extend(self.sp.encode(text[idx:]))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        parts, run = [], []
        for i in map(int, ids):
            if i in self.inv_special:
                parts.append(self.sp.decode(run))
                parts.append(self.inv_special[i])
                run = []
            else:
                run.append(i)
        parts.append(self.sp.decode(run))
        return " ".join(p for p in parts if p)


class Llama2Tokenizer(Tokenizer):
    """Llama-2 style: model ids only, bos prepended, eod = eos."""

    def __init__(self, model_file: str):
        self.sp = _load(model_file)
        self.bos_id = self.sp.bos_id()
        self.eos_id = self.sp.eos_id()
        if self.eos_id < 0:
            raise ValueError(f"{model_file}: SentencePiece model has no eos id (needed as eod)")

    @property
    def vocab_size(self) -> int:
        return self.sp.vocab_size()

    @property
    def eod(self) -> int:
        return self.eos_id

    @property
    def pad(self) -> Optional[int]:
        pad = self.sp.pad_id()
        return pad if pad >= 0 else None

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = self.sp.encode(text)
        if bos and self.bos_id >= 0:
            ids = [self.bos_id] + ids
        if eos:
            ids = ids + [self.eos_id]
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.sp.decode([int(i) for i in ids])


# SentencePiece's default max_sentence_length: longer inputs are skipped, with only
# a log line at a level we silence. We pass it explicitly and cut documents to fit.
SP_MAX_SENTENCE_BYTES = 4192
# Units a document is cut at, coarsest first: lines, then whitespace-ended words,
# then characters. With split_by_whitespace (the default) no learned piece spans
# whitespace, so cutting there loses no statistics.
_CUT_LEVELS = (re.compile(r"[^\n]*\n|[^\n]+"), re.compile(r"\S*\s+|\S+"), re.compile(r".", re.S))


def split_for_sentencepiece(text: str, max_bytes: int = SP_MAX_SENTENCE_BYTES, level: int = 0) -> Iterator[str]:
    """Cut ``text`` into pieces of at most ``max_bytes`` UTF-8 bytes that join back to it.

    Pieces are packed greedily from whole lines; a line longer than the limit
    is cut after whitespace, and a word longer than the limit between characters.
    """
    if not text:
        return
    if len(text) * 4 <= max_bytes or len(text.encode("utf-8")) <= max_bytes:
        yield text
        return
    buf: list[str] = []
    size = 0
    for unit in _CUT_LEVELS[level].findall(text):
        n = len(unit.encode("utf-8"))
        if size + n > max_bytes and buf:
            yield "".join(buf)
            buf, size = [], 0
        if n > max_bytes:  # only below the character level
            yield from split_for_sentencepiece(unit, max_bytes, level + 1)
            continue
        buf.append(unit)
        size += n
    if buf:
        yield "".join(buf)


@dataclass
class SentencePieceInput:
    """What the trainer was fed: every document, cut into pieces under the limit."""

    documents: int = 0
    characters: int = 0
    bytes: int = 0
    pieces: int = 0
    split_documents: int = 0  # documents longer than the limit, fed in several pieces
    max_bytes: int = SP_MAX_SENTENCE_BYTES
    model: str = ""

    def summary(self) -> str:
        return (
            f"SentencePiece trained on {self.documents} documents, {self.characters} "
            f"characters ({self.bytes} bytes) fed as {self.pieces} pieces of <= "
            f"{self.max_bytes} bytes ({self.split_documents} documents longer than that "
            "were cut at line/whitespace boundaries, none dropped)"
        )


def _pieces(texts: Iterable[str], stats: SentencePieceInput) -> Iterator[str]:
    for text in texts:
        if not text or text.isspace():
            continue
        try:
            nbytes = len(text.encode("utf-8"))
        except UnicodeEncodeError:  # lone surrogates from JSON escapes
            text = text.encode("utf-8", "replace").decode("utf-8")
            nbytes = len(text.encode("utf-8"))
        stats.documents += 1
        stats.characters += len(text)
        stats.bytes += nbytes
        stats.split_documents += nbytes > stats.max_bytes
        for piece in split_for_sentencepiece(text, stats.max_bytes):
            stats.pieces += 1
            yield piece


def train_sentencepiece(
    texts: Iterable[str], model_prefix: str, vocab_size: int, model_type: str = "bpe"
) -> SentencePieceInput:
    """Train a SentencePiece model offline; return what it was fed (``.model`` is its path).

    Uses Llama's id layout (unk 0, bos 1, eos 2, no pad) and full character
    coverage with byte fallback, so no input character is ever unknown. Long
    documents are cut into pieces under SentencePiece's sentence limit rather
    than skipped. Raises ValueError for an empty corpus or a vocabulary too
    small for the corpus's characters.
    """
    import sentencepiece as spm

    stats = SentencePieceInput()
    pieces = _pieces(texts, stats)
    first = next(pieces, None)
    if first is None:
        raise ValueError("no text to train on: every document is empty")
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    tmp_prefix = f"{model_prefix}.tmp-{os.getpid()}"
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=itertools.chain([first], pieces),
            model_prefix=tmp_prefix,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=1.0,
            byte_fallback=True,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            # Llama's settings: text kept as it is (the default NFKC rule would fold newlines and
            # tabs into spaces, so decode(encode(text)) would lose them), digits split, runs of
            # spaces kept as pieces.
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            max_sentence_length=stats.max_bytes,
            input_sentence_size=0,
            hard_vocab_limit=False,
            minloglevel=2,
            num_threads=os.cpu_count() or 1,
        )
    except RuntimeError as e:
        need = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", str(e))
        if need:
            raise ValueError(
                f"vocabulary size {need[1]} is too small for this corpus: 3 special tokens, "
                f"256 byte-fallback pieces and its {int(need[2]) - 259} distinct characters "
                f"need at least {need[2]}; raise --vocab-size"
            ) from None
        raise RuntimeError(f"SentencePiece training failed: {str(e).splitlines()[0]}") from None
    for ext in (".vocab", ".model"):  # .model last: its presence means complete
        os.replace(tmp_prefix + ext, model_prefix + ext)
    stats.model = model_prefix + ".model"
    logger.info("%s", stats.summary())
    return stats
