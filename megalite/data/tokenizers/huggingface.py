"""HuggingFaceTokenizer: a tokenizer.json (HF ``tokenizers``) or a local transformers dir."""

from __future__ import annotations

import os
from typing import Optional, Sequence

from megalite.data.tokenizers.base import Tokenizer

_VOCAB_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt")  # a folder without them has none
_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")


class HuggingFaceTokenizer(Tokenizer):
    """Wraps a local HF tokenizer; ``--tokenizer-model`` is a tokenizer.json or a directory.

    A directory holding tokenizer.json is read with the ``tokenizers``
    library; anything else needs ``transformers`` (AutoTokenizer, local files
    only: nothing is downloaded). eod is the first of the usual end tokens
    found in the vocabulary.
    """

    def __init__(self, path: str):
        json_path = path if path.endswith(".json") else os.path.join(path, "tokenizer.json")
        self._hf = None
        if os.path.isfile(json_path):
            from tokenizers import Tokenizer as HFTok

            self._tok = HFTok.from_file(json_path)
            vocab = self._tok.get_vocab(with_added_tokens=True)
        elif os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, n)) for n in _VOCAB_FILES):
            raise ValueError(
                f"HuggingFaceTokenizer: {path} holds no tokenizer files ({', '.join(_VOCAB_FILES)}); "
                f"give --tokenizer-model a folder with them, or --tokenizer-type NullTokenizer "
                f"--vocab-size N for token ids"
            )
        else:
            try:
                from transformers import AutoTokenizer
            except ImportError as e:
                raise ValueError(
                    f"HuggingFaceTokenizer: {path} has no tokenizer.json and transformers is not installed"
                ) from e
            self._hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
            vocab = self._hf.get_vocab()
        self._vocab_size = max(vocab.values()) + 1
        eod = next((vocab[t] for t in _EOD_CANDIDATES if t in vocab), None)
        if eod is None:
            raise ValueError(f"HuggingFaceTokenizer: no end-of-document token in {path}")
        self._eod = eod
        self._pad = next((vocab[t] for t in ("<pad>", "[PAD]", "<|pad|>") if t in vocab), None)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> Optional[int]:
        return self._pad

    def tokenize(self, text: str) -> list[int]:
        if self._hf is not None:
            return self._hf(text, add_special_tokens=False)["input_ids"]
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self._hf is not None:
            return self._hf.decode(ids)
        return self._tok.decode(ids, skip_special_tokens=False)
