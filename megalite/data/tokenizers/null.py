"""NullTokenizer: text is already token ids, written as space-separated integers."""

from __future__ import annotations

from typing import Sequence

from megalite.data.tokenizers.base import Tokenizer


class NullTokenizer(Tokenizer):
    """Megatron's ``NullTokenizer``: ``--vocab-size N`` ids, eod is ``N``.

    The text "3 1 4" tokenizes to [3, 1, 4]; the vocabulary is ``N + 1`` ids
    because eod takes the id right after the given ones. Ids outside
    ``[0, N]`` are refused, so a bad corpus fails early instead of
    overflowing the uint16 .bin.
    """

    def __init__(self, vocab_size: int):
        if vocab_size is None or int(vocab_size) <= 0:
            raise ValueError("NullTokenizer needs --vocab-size > 0")
        self._n = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._n + 1

    @property
    def eod(self) -> int:
        return self._n

    def tokenize(self, text: str) -> list[int]:
        ids = [int(tok) for tok in text.split()]
        for i in ids:
            if not 0 <= i <= self._n:
                raise ValueError(f"NullTokenizer: id {i} outside [0, {self._n}] (--vocab-size {self._n})")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)
