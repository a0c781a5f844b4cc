"""Global batches for one data-parallel rank, as the micro-batch dicts the pipeline executor reads.

A DataLoader over Megatron's pretraining sampler reads the samples of this DP rank
(``--num-workers`` processes ahead of the loop); the sampler is walked a second time
alongside so that a sample holding a bad token id can be named in the error.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import torch

from megalite.context_parallel.sequence import SequenceOptions
from megalite.data.samplers import PretrainingSampler
from megalite.parallel.state import ParallelState


def _collate(samples: List[dict]) -> torch.Tensor:
    return torch.from_numpy(np.stack([s["text"] for s in samples]).astype(np.int64))


def eod_token(cfg) -> int:
    """The end-of-document id of a run's tokenizer (Megatron's pretrain_gpt: ``tokenizer.eod``).

    Without a tokenizer (--mock-data) the vocabulary is read as NullTokenizer's: its last id is eod.
    """
    data, vocab = cfg.data, cfg.model.vocab_size
    if not data.tokenizer_type or data.tokenizer_type == "NullTokenizer":
        return vocab - 1  # NullTokenizer --vocab-size N: N + 1 ids, eod N
    from megalite.data.tokenizers import build_tokenizer

    return build_tokenizer(data, vocab).eod


def sequence_options(cfg, ps: ParallelState) -> Optional[SequenceOptions]:
    """How this rank's micro-batches are laid out (packed documents, CP chunks); None: plain batches."""
    d = cfg.data
    flags = dict(
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss,
    )
    if ps.cp_size == 1 and not any(flags.values()):
        return None
    return SequenceOptions(
        eod=eod_token(cfg) if any(flags.values()) else None, cp_size=ps.cp_size, cp_rank=ps.cp_rank, **flags
    )


class MicroBatches:
    """Global batches for this DP rank, as lists of m micro-batch dicts (tokens, labels, loss_mask).

    Samples are read by a DataLoader over the pretraining sampler; ``num_workers``
    > 0 reads them in worker processes ahead of the training loop (``--num-workers``).
    The sampler is walked a second time alongside, so a bad sample can be named.
    ``sequence`` (packed documents, CP) adds position_ids / segment_ids / num_tokens and keeps
    this CP rank's chunks of each sample; the CP ranks of one DP rank read the same samples.
    """

    def __init__(
        self,
        dataset,
        consumed: int,
        mbs: int,
        m: int,
        ps: ParallelState,
        num_workers: int = 0,
        name: str = "train",
        sequence: Optional[SequenceOptions] = None,
    ):
        self.m, self.device, self.dataset, self.name, self.sequence = m, ps.device, dataset, name, sequence
        sampler = PretrainingSampler(len(dataset), consumed, mbs, ps.dp_rank, ps.dp_size)
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=num_workers,
            collate_fn=_collate,
            pin_memory=ps.device.type == "cuda",
            # its own generator: starting a loader must not draw from
            # the global RNG, or a resumed run's dropout would differ
            generator=torch.Generator(),
        )
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
            tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
            loss_mask = torch.ones(text.shape[0], text.shape[1] - 1, device=self.device)
            if self.sequence is None:
                out.append({"tokens": tokens, "labels": labels, "loss_mask": loss_mask})
            else:
                out.append(self.sequence.build(tokens, labels, loss_mask))
        return out

    def bad_token(self, batches: List[Dict[str, torch.Tensor]], vocab: int) -> Optional[str]:
        """A one-line description of the first token id outside [0, vocab) in ``batches``, the last ones
        ``next()`` returned (None: all fine)."""
        for mb, text in enumerate(self.last_host[: len(batches)]):
            if int(text.min()) >= 0 and int(text.max()) < vocab:
                continue
            row = int(((text < 0) | (text >= vocab)).any(dim=1).nonzero()[0])
            ids = text[row]
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            sample = self.last_indices[mb][row]
            return (
                f"{self.name} sample {sample} ({describe_sample(self.dataset, sample)}) holds token id {bad}, "
                f"outside the model's vocabulary [0, {vocab}): the data was tokenized with another "
                f"tokenizer than the one given (--tokenizer-type / --vocab-file / --vocab-size)"
            )
        return None


def describe_sample(dataset, idx: int) -> str:
    """Where sample ``idx`` of a (blended) dataset comes from, for error messages."""
    if hasattr(dataset, "dataset_index"):  # a blend: find the part and its own sample number
        part, inner = int(dataset.dataset_index[idx]), int(dataset.dataset_sample_index[idx])
        return f"blend part {part}, its sample {inner}, " + describe_sample(dataset.datasets[part], inner)
    indexed = getattr(dataset, "indexed", None)
    return f"from {indexed.prefix}.bin" if indexed is not None else f"from a {type(dataset).__name__}"
