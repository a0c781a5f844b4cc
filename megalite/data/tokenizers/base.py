"""The small tokenizer interface every tokenizer in megalite implements."""

from __future__ import annotations

import abc
from typing import Optional, Sequence


class Tokenizer(abc.ABC):
    """vocab_size / tokenize / detokenize / eod / pad, as Megatron's MegatronTokenizer.

    ``vocab_size`` counts every id the tokenizer can emit, special tokens such
    as eod included (the model pads it further for tensor parallelism).
    """

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of distinct ids, special tokens included."""

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Text to token ids."""

    @abc.abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Token ids back to text."""

    @property
    @abc.abstractmethod
    def eod(self) -> int:
        """End-of-document id appended by ``--append-eod``."""

    @property
    def pad(self) -> Optional[int]:
        """Padding id, or None when the tokenizer defines none."""
        return None
