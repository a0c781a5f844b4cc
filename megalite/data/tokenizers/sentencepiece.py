"""SentencePiece tokenizers: Megatron's SentencePieceTokenizer and Llama2Tokenizer.

``SentencePieceTokenizer`` appends Megatron's special tokens (<CLS>, <SEP>,
<EOD>, <MASK>, and pad/bos/eos when the model lacks them) after the model's
pieces and recognizes them literally in text; eod is <EOD>.
``Llama2Tokenizer`` uses the model's own ids: every text starts with bos, eod
is the model's eos, and the vocabulary is exactly the model's.
"""
from __future__ import annotations

import logging
import os
from typing import Iterable, Optional, Sequence

from megalite.data.tokenizers.base import Tokenizer

logger = logging.getLogger(__name__)


def _load(model_file: str):
    import sentencepiece as spm  # optional dependency: only needed for these tokenizers
    if not os.path.isfile(model_file):
        raise ValueError(f"--tokenizer-model file not found: {model_file}")
    return spm.SentencePieceProcessor(model_file=model_file)


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


def train_sentencepiece(texts: Iterable[str], model_prefix: str, vocab_size: int,
                        model_type: str = "bpe") -> str:
    """Train a SentencePiece model offline; return the path of ``{model_prefix}.model``.

    Uses Llama's id layout (unk 0, bos 1, eos 2, no pad) and full character
    coverage with byte fallback, so no input character is ever unknown.
    """
    import sentencepiece as spm
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    tmp_prefix = f"{model_prefix}.tmp-{os.getpid()}"
    spm.SentencePieceTrainer.train(
        sentence_iterator=(t for t in texts if t), model_prefix=tmp_prefix,
        vocab_size=vocab_size, model_type=model_type, character_coverage=1.0,
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        hard_vocab_limit=False, minloglevel=2, num_threads=os.cpu_count() or 1)
    for ext in (".vocab", ".model"):  # .model last: its presence means complete
        os.replace(tmp_prefix + ext, model_prefix + ext)
    return model_prefix + ".model"
