"""Global batches for one data-parallel rank, as the micro-batch dicts the pipeline executor reads.

A DataLoader over Megatron's pretraining sampler reads the samples of this DP rank
(``--num-workers`` processes ahead of the loop); the sampler is walked a second time
alongside so that a sample holding a bad token id can be named in the error.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import torch

from megalite.data.samplers import PretrainingSampler
from megalite.parallel_state import ParallelState


def _collate(samples: List[dict]) -> torch.Tensor:
    return torch.from_numpy(np.stack([s["text"] for s in samples]).astype(np.int64))


class MicroBatches:
    """Global batches for this DP rank, as lists of m micro-batch dicts (tokens, labels, loss_mask).

    Samples are read by a DataLoader over the pretraining sampler; ``num_workers``
    > 0 reads them in worker processes ahead of the training loop (``--num-workers``).
    The sampler is walked a second time alongside, so a bad sample can be named.
    """

    def __init__(self, dataset, consumed: int, mbs: int, m: int, ps: ParallelState, num_workers: int = 0,
                 name: str = "train"):
        self.m, self.device, self.dataset, self.name = m, ps.device, dataset, name
        sampler = PretrainingSampler(len(dataset), consumed, mbs, ps.dp_rank, ps.dp_size)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                             collate_fn=_collate, pin_memory=ps.device.type == "cuda",
                                             # its own generator: starting a loader must not draw from
                                             # the global RNG, or a resumed run's dropout would differ
                                             generator=torch.Generator())
        self.it = iter(loader)
        self.indices = iter(PretrainingSampler(len(dataset), consumed, mbs, ps.dp_rank, ps.dp_size))
        self.last_indices: List[List[int]] = []
        self.last_host: List[torch.Tensor] = []

    def next(self) -> List[Dict[str, torch.Tensor]]:
        out, self.last_indices, self.last_host = [], [], []
        for _ in range(self.m):
            host = next(self.it)
            self.last_host.append(host)  # checked on the host: no device sync per micro-batch
            text = host.to(self.device, non_blocking=True)
            self.last_indices.append(list(next(self.indices)))
            out.append({"tokens": text[:, :-1].contiguous(), "labels": text[:, 1:].contiguous(),
                        "loss_mask": torch.ones(text.shape[0], text.shape[1] - 1, device=self.device)})
        return out

    def bad_token(self, batches: List[Dict[str, torch.Tensor]], vocab: int) -> Optional[str]:
        """A one-line description of the first token id outside [0, vocab) in ``batches``, the last ones
        ``next()`` returned (None: all fine)."""
        for mb, text in enumerate(self.last_host[:len(batches)]):
            if int(text.min()) >= 0 and int(text.max()) < vocab:
                continue
            row = int(((text < 0) | (text >= vocab)).any(dim=1).nonzero()[0])
            ids = text[row]
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            sample = self.last_indices[mb][row]
            return (f"{self.name} sample {sample} ({describe_sample(self.dataset, sample)}) holds token id {bad}, "
                    f"outside the model's vocabulary [0, {vocab}): the data was tokenized with another "
                    f"tokenizer than the one given (--tokenizer-type / --vocab-file / --vocab-size)")
        return None


def describe_sample(dataset, idx: int) -> str:
    """Where sample ``idx`` of a (blended) dataset comes from, for error messages."""
    if hasattr(dataset, "dataset_index"):  # a blend: find the part and its own sample number
        part, inner = int(dataset.dataset_index[idx]), int(dataset.dataset_sample_index[idx])
        return f"blend part {part}, its sample {inner}, " + describe_sample(dataset.datasets[part], inner)
    indexed = getattr(dataset, "indexed", None)
    return f"from {indexed.prefix}.bin" if indexed is not None else f"from a {type(dataset).__name__}"
