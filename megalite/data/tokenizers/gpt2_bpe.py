"""GPT-2 byte-level BPE: reads GPT-2-format vocab.json + merges.txt.

Text is split into pre-tokens with GPT-2's regular expression, each pre-token
is turned into bytes, each byte into one printable unicode character (so the
vocabulary is plain JSON), and merges are applied lowest rank first. The same
files load in HF ``tokenizers``' ByteLevelBPETokenizer and give the same ids.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Optional, Sequence

import regex

from megalite.data.tokenizers.base import Tokenizer

# GPT-2's pre-tokenization pattern (contractions, letters, numbers, other, spaces).
GPT2_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"""
    r"""|\s+(?!\S)|\s+"""
)
EOT_TOKEN = "<|endoftext|>"
MERGES_HEADER = "#version: 0.2"
_CACHE_LIMIT = 65_536  # entries; bounds worker memory (~20 MB) on code-like text


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table.

    Printable Latin-1 bytes map to themselves; the other 68 bytes (controls,
    space, ...) map to code points from 256 upward, in byte order. The dict's
    insertion order (printable bytes first) is the id order of the base
    vocabulary our trainer writes, as in GPT-2's own vocab.json.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _open_text(path: str, flag: str):
    """Open a UTF-8 text file, or raise a one-line ValueError naming ``flag`` and the file."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory, not a file")
    try:
        return open(path, encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None


def read_merges(merge_file: str) -> list[tuple[str, str]]:
    """Read merges.txt (optional ``#version`` header line, one ``a b`` pair a line).

    A malformed file raises a one-line ValueError naming ``--merge-file``, the line and the fix.
    """
    merges = []
    with _open_text(merge_file, "--merge-file") as f:
        try:
            lines = list(f)
        except UnicodeDecodeError:
            raise ValueError(
                f"--merge-file {merge_file} is not UTF-8 text; give GPT-2's merges.txt (one 'a b' pair a line)"
            ) from None
    for lineno, line in enumerate(lines, 1):
        line = line.rstrip("\r\n")
        if (lineno == 1 and line.startswith("#version")) or not line:
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise ValueError(
                f"--merge-file {merge_file} line {lineno}: expected two symbols "
                f"separated by one space, got {line[:60]!r}; give GPT-2's merges.txt"
            )
        merges.append((parts[0], parts[1]))
    return merges


def read_vocab(vocab_file: str) -> dict[str, int]:
    """Read vocab.json (a JSON object token -> id); a bad file is a one-line ValueError naming it."""
    with _open_text(vocab_file, "--vocab-file") as f:
        try:
            encoder = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            # json's own message ("Expecting value: line 1 column 1") names no file
            reason = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8 text"
            where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
            raise ValueError(
                f"--vocab-file {vocab_file} is not JSON ({reason}{where}); give "
                "GPT-2's vocab.json (an object mapping each token to its id)"
            ) from None
    if not isinstance(encoder, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in encoder.items()
    ):
        raise ValueError(
            f"--vocab-file {vocab_file} is JSON but not a vocabulary; give GPT-2's "
            "vocab.json (an object mapping each token to its integer id)"
        )
    return encoder


class GPT2BPETokenizer(Tokenizer):
    """Byte-level BPE tokenizer from ``--vocab-file`` and ``--merge-file``.

    eod is the id of ``<|endoftext|>`` (required in the vocabulary). Encoded
    pre-tokens are cached, since natural text repeats words constantly; the
    cache is cleared when it grows past a limit to keep memory bounded.
    """

    def __init__(self, vocab_file: str, merge_file: str):
        self.encoder: dict[str, int] = read_vocab(vocab_file)
        if EOT_TOKEN not in self.encoder:
            raise ValueError(
                f"--vocab-file {vocab_file}: vocabulary has no {EOT_TOKEN} token (GPT2BPETokenizer's end-of-document)"
            )
        self.decoder = {v: k for k, v in self.encoder.items()}
        self.bpe_ranks = {pair: i for i, pair in enumerate(read_merges(merge_file))}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self.pattern = regex.compile(GPT2_PATTERN)
        self._cache: dict[str, list[int]] = {}
        self._eod = self.encoder[EOT_TOKEN]

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> Optional[int]:
        return None

    def _bpe(self, word: str) -> list[str]:
        """Apply merges to one byte-mapped pre-token, lowest rank first."""
        symbols = list(word)
        ranks = self.bpe_ranks
        while len(symbols) > 1:
            best, best_rank = None, None
            for pair in zip(symbols, symbols[1:]):
                r = ranks.get(pair)
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = pair, r
            if best is None:
                break
            first, second = best
            merged, i, n = [], 0, len(symbols)
            while i < n:
                if i < n - 1 and symbols[i] == first and symbols[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return symbols

    def _encode_word(self, piece: str) -> list[int]:
        # Lone surrogates (from JSON "\ud800") cannot be UTF-8: they become "?".
        mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8", "replace"))
        ids = [self.encoder[s] for s in self._bpe(mapped)]
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[piece] = ids
        return ids

    def tokenize(self, text: str) -> list[int]:
        # The cache lookup is inlined: this loop runs once per pre-token.
        out: list[int] = []
        cache = self._cache
        for piece in self.pattern.findall(text):
            ids = cache.get(piece)
            out += ids if ids is not None else self._encode_word(piece)
        return out

    def detokenize(self, ids: Sequence[int]) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytes(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")
