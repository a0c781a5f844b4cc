"""Which samples each data-parallel rank reads, micro-batch by micro-batch.

Global batch ``g`` (of size G) is samples [g*G, (g+1)*G) of the dataset. It is
cut into micro-steps of ``micro_batch_size * dp`` samples; in each, DP rank r
takes the r-th slice of ``micro_batch_size``::

    micro-step k of a global batch:  | dp0: mbs | dp1: mbs | ... |

So the union over DP ranks of a global batch is the same whatever the layout,
and a run resumed at ``consumed_samples`` reads exactly what it would have
(Megatron's MegatronPretrainingSampler).
"""

from __future__ import annotations

from typing import Iterator, List


class PretrainingSampler:
    """Yields, for this DP rank, the list of sample indices of each micro-batch, in order."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        if consumed_samples >= total_samples:
            raise ValueError(f"no samples left: consumed {consumed_samples} of {total_samples}")
        self.total, self.consumed = total_samples, consumed_samples
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __len__(self) -> int:
        return (self.total - self.consumed) // (self.mbs * self.dp_size)

    def __iter__(self) -> Iterator[List[int]]:
        step = self.mbs * self.dp_size
        for start in range(self.consumed, self.total - step + 1, step):
            first = start + self.dp_rank * self.mbs
            yield list(range(first, first + self.mbs))
