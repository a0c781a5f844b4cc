"""Tokenizers behind one small interface, selected with ``--tokenizer-type``.

======================  ==========================================  ==============
--tokenizer-type        files / flags                               eod
======================  ==========================================  ==============
GPT2BPETokenizer        --vocab-file vocab.json --merge-file        <|endoftext|>
SentencePieceTokenizer  --tokenizer-model x.model                   <EOD> (added)
Llama2Tokenizer         --tokenizer-model x.model                   model's eos
HuggingFaceTokenizer    --tokenizer-model tokenizer.json or dir     </s>, ...
NullTokenizer           --vocab-size N (text is "3 1 4")            N
======================  ==========================================  ==============
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

from megalite.data.tokenizers.base import Tokenizer

if TYPE_CHECKING:
    from megalite.config import DataConfig

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
)

__all__ = ["Tokenizer", "build_tokenizer", "TOKENIZER_TYPES"]


def _need_file(value: str | None, flag: str, kind: str) -> str:
    if not value:
        raise ValueError(f"{kind} needs {flag}")
    if not os.path.exists(value):
        raise ValueError(f"{flag} {value}: file not found")
    return value


def build_tokenizer(cfg: "DataConfig", vocab_size: Optional[int] = None) -> Tokenizer:
    """Build the tokenizer named by ``cfg.tokenizer_type`` from the config's files/flags.

    ``vocab_size`` (``--vocab-size``) is read by the NullTokenizer only.

    Raises a one-line ValueError naming the missing flag (e.g. "GPT2BPETokenizer
    needs --merge-file") or an unknown type. Imports of optional libraries
    (sentencepiece, tokenizers, transformers) happen only for the type chosen.
    """
    kind = cfg.tokenizer_type
    if kind == "GPT2BPETokenizer":
        from megalite.data.tokenizers.gpt2_bpe import GPT2BPETokenizer

        return GPT2BPETokenizer(
            _need_file(cfg.vocab_file, "--vocab-file", kind), _need_file(cfg.merge_file, "--merge-file", kind)
        )
    if kind in ("SentencePieceTokenizer", "Llama2Tokenizer"):
        from megalite.data.tokenizers import sentencepiece as sp

        model = _need_file(cfg.tokenizer_model, "--tokenizer-model", kind)
        return getattr(sp, kind)(model)
    if kind == "HuggingFaceTokenizer":
        from megalite.data.tokenizers.huggingface import HuggingFaceTokenizer

        return HuggingFaceTokenizer(_need_file(cfg.tokenizer_model, "--tokenizer-model", kind))
    if kind == "NullTokenizer":
        from megalite.data.tokenizers.null import NullTokenizer

        if not vocab_size:
            raise ValueError("NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise ValueError(f"unknown --tokenizer-type {kind!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
