"""Synthetic, learnable GPT samples for ``--mock-data`` (benchmarks, layout comparisons).

Sample i is an arithmetic sequence modulo the vocabulary with a start and a
stride drawn from a generator seeded by (seed, i): the same sample for the same
seed whatever the parallel layout, and a pattern a model can learn, so the
loss falls as it should.
"""

from __future__ import annotations

from typing import Dict

import numpy as np


class MockGPTDataset:
    """``num_samples`` deterministic samples of ``seq_length + 1`` token ids in [0, vocab_size)."""

    def __init__(self, seq_length: int, vocab_size: int, seed: int, num_samples: int):
        self.seq_length, self.vocab_size, self.seed, self.num_samples = seq_length, vocab_size, seed, num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> Dict[str, np.ndarray]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, i])
        start = int(rng.integers(self.vocab_size))
        stride = int(rng.integers(1, 8))
        text = (start + stride * np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size
        return {"text": text}
