"""Byte-level BPE trainer (pure Python) writing GPT-2-format vocab.json + merges.txt.

The corpus is pre-tokenized with GPT-2's pattern and reduced to a table of
distinct words with frequencies, so each merge touches only the words that
contain the merged pair (an inverted index), and pair counts are updated
incrementally. The best pair is taken from a max-heap with lazy deletion:
stale entries are skipped when their count no longer matches. Ties go to the
lexicographically smallest pair, so training is deterministic.
"""

from __future__ import annotations

import heapq
import json
import logging
import os
from collections import Counter, defaultdict
from typing import Iterable, Sequence

import regex

from megalite.data.tokenizers.gpt2_bpe import EOT_TOKEN, GPT2_PATTERN, MERGES_HEADER, bytes_to_unicode

logger = logging.getLogger(__name__)

Pair = tuple[str, str]


def count_words(texts: Iterable[str]) -> Counter:
    """Frequencies of byte-mapped GPT-2 pre-tokens over all texts."""
    pattern = regex.compile(GPT2_PATTERN)
    raw: Counter = Counter()
    for text in texts:
        raw.update(pattern.findall(text))
    benc = bytes_to_unicode()
    mapped: Counter = Counter()
    for word, freq in raw.items():
        mapped["".join(benc[b] for b in word.encode("utf-8", "replace"))] += freq
    return mapped


def _merge_word(symbols: list[str], pair: Pair, new: str) -> list[str]:
    out, i, n = [], 0, len(symbols)
    a, b = pair
    while i < n:
        if i < n - 1 and symbols[i] == a and symbols[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return out


class _PairStats:
    """Pair counts, pair -> word ids, and the lazy max-heap over counts."""

    def __init__(self, words: list[list[str]], freqs: list[int]):
        self.counts: dict[Pair, int] = defaultdict(int)
        self.where: dict[Pair, set[int]] = defaultdict(set)
        for wi, (w, f) in enumerate(zip(words, freqs)):
            for p in zip(w, w[1:]):
                self.counts[p] += f
                self.where[p].add(wi)
        self.heap = [(-c, p) for p, c in self.counts.items()]
        heapq.heapify(self.heap)

    def pop_best(self) -> tuple[Pair, int] | None:
        """The most frequent pair and its count (None when no pair is left)."""
        while self.heap:
            negc, pair = heapq.heappop(self.heap)
            if self.counts.get(pair, 0) == -negc:
                return pair, -negc
        return None

    def apply(self, pair: Pair, new: str, words: list[list[str]], freqs: list[int]) -> None:
        """Merge ``pair`` in every word holding it, updating counts incrementally."""
        changed: set[Pair] = set()
        for wi in self.where.pop(pair, ()):
            old = words[wi]
            merged = _merge_word(old, pair, new)
            if len(merged) == len(old):
                continue  # stale entry: the word lost this pair in an earlier merge
            f = freqs[wi]
            for p in zip(old, old[1:]):
                self.counts[p] -= f
                changed.add(p)
            for p in zip(merged, merged[1:]):
                self.counts[p] += f
                self.where[p].add(wi)
                changed.add(p)
            words[wi] = merged
        for p in changed:
            c = self.counts[p]
            if c > 0:
                heapq.heappush(self.heap, (-c, p))
            else:
                del self.counts[p]
                self.where.pop(p, None)


def _early_stop_message(
    reached: int, wanted: int, merges: int, words: int, best: tuple[Pair, int] | None, min_frequency: int
) -> str:
    """One line: how far training got, why it stopped, what to do."""
    head = f"BPE stopped at a vocabulary of {reached} of the {wanted} requested after {merges} merges: "
    if best is None:
        return head + (
            f"no pair left to merge (each of the corpus's {words} distinct words is "
            "already one token); give more text or ask for a smaller --vocab-size"
        )
    times = "time" if best[1] == 1 else "times"
    return head + (
        f"the most frequent remaining pair occurs {best[1]} {times}, below "
        f"--min-frequency {min_frequency} ({words} distinct words); give more text, "
        "lower --min-frequency or ask for a smaller --vocab-size"
    )


def train_bpe(
    texts: Iterable[str], vocab_size: int, min_frequency: int = 2, special_tokens: Sequence[str] = (EOT_TOKEN,)
) -> tuple[dict[str, int], list[Pair]]:
    """Train a byte-level BPE; return (vocab token -> id, ordered merges).

    The vocabulary is the 256 byte symbols (GPT-2 order), then one token per
    merge, then ``special_tokens``; ``vocab_size`` counts all of them. Training
    stops early, with a warning that says why, when no pair occurs
    ``min_frequency`` times.
    """
    base = list(bytes_to_unicode().values())
    if vocab_size < len(base) + len(special_tokens):
        raise ValueError(f"vocab_size {vocab_size} < 256 bytes + {len(special_tokens)} specials")
    word_freqs = count_words(texts)
    words = [list(w) for w in word_freqs]
    freqs = list(word_freqs.values())
    stats = _PairStats(words, freqs)
    vocab = {s: i for i, s in enumerate(base)}
    merges: list[Pair] = []
    target = vocab_size - len(special_tokens)
    best = None
    while len(vocab) < target:
        best = stats.pop_best()
        if best is None or best[1] < min_frequency:
            logger.warning(
                "%s",
                _early_stop_message(
                    len(vocab) + len(special_tokens), vocab_size, len(merges), len(words), best, min_frequency
                ),
            )
            break
        pair = best[0]
        new = pair[0] + pair[1]
        merges.append(pair)
        if new not in vocab:  # two merge paths can build the same string
            vocab[new] = len(vocab)
        stats.apply(pair, new, words, freqs)
    for tok in special_tokens:
        vocab.setdefault(tok, len(vocab))
    logger.info("BPE: %d merges, vocabulary %d (%d distinct words)", len(merges), len(vocab), len(words))
    return vocab, merges


def save_bpe(vocab: dict[str, int], merges: list[Pair], out_dir: str) -> tuple[str, str]:
    """Write vocab.json and merges.txt (with the ``#version`` header) atomically."""
    os.makedirs(out_dir, exist_ok=True)
    vocab_file = os.path.join(out_dir, "vocab.json")
    merge_file = os.path.join(out_dir, "merges.txt")
    tmp_v, tmp_m = vocab_file + f".tmp-{os.getpid()}", merge_file + f".tmp-{os.getpid()}"
    with open(tmp_v, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(tmp_m, "w", encoding="utf-8") as f:
        f.write(MERGES_HEADER + "\n")
        f.writelines(f"{a} {b}\n" for a, b in merges)
    os.replace(tmp_m, merge_file)
    os.replace(tmp_v, vocab_file)
    return vocab_file, merge_file
