"""A rank grid declared as data: named axes, fastest first (Megatron-Core's HyperCommGrid, torch's DeviceMesh).

::

    RankGrid((("tp", 2), ("cp", 1), ("dp", 2), ("pp", 4)))      16 ranks, tp fastest

    rank = sum(coord[axis] * stride[axis]),  stride[axis] = product of the sizes of the axes before it
    rank 13 -> {"tp": 1, "cp": 0, "dp": 0, "pp": 3}
    groups(("tp",))        [0,1] [2,3] ... [14,15]          (the ranks that differ only along tp)
    groups(("tp", "pp"))   [0,1,4,5,8,9,12,13] [2,3,6,7,...]

Pure Python, no torch.distributed: ParallelState (state.py) declares its dense and expert grids
with it and creates the process groups; validation, the planner and the tests read the same
memberships without any process.
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Mapping, Sequence, Tuple


class RankGrid:
    """Named axes with their sizes, fastest varying first; the world is their product."""

    def __init__(self, axes: Sequence[Tuple[str, int]]):
        self.axes: Tuple[Tuple[str, int], ...] = tuple((name, int(size)) for name, size in axes)
        names = [name for name, _ in self.axes]
        if len(set(names)) != len(names) or any(size < 1 for _, size in self.axes):
            raise ValueError(f"a rank grid needs distinct axis names and sizes >= 1, got {self.axes}")
        self.sizes: Dict[str, int] = dict(self.axes)
        self.strides: Dict[str, int] = {}
        stride = 1
        for name, size in self.axes:
            self.strides[name] = stride
            stride *= size
        self.world_size = stride

    @property
    def names(self) -> Tuple[str, ...]:
        """The axis names, fastest first."""
        return tuple(name for name, _ in self.axes)

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """The global rank at ``coords`` (an axis left out is at 0)."""
        return sum(coords.get(name, 0) * self.strides[name] for name in self.names)

    def coords_of(self, rank: int) -> Dict[str, int]:
        """The coordinates of global ``rank`` along every axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a grid of {self.world_size} ranks")
        return {name: rank // self.strides[name] % size for name, size in self.axes}

    def groups(self, along: Sequence[str]) -> List[List[int]]:
        """Every group of ranks that differ only along the axes ``along`` (a partition of the world),
        each group's ranks ascending and the groups ordered by their first rank."""
        unknown = [a for a in along if a not in self.sizes]
        if unknown:
            raise ValueError(f"unknown axes {unknown}; the grid has {list(self.names)}")
        fixed = [name for name in self.names if name not in along]
        out = []
        for at in itertools.product(*(range(self.sizes[a]) for a in fixed)):
            base = self.rank_of(dict(zip(fixed, at)))
            out.append(
                sorted(
                    base + self.rank_of(dict(zip(along, c)))
                    for c in itertools.product(*(range(self.sizes[a]) for a in along))
                )
            )
        return sorted(out)

    def group_of(self, rank: int, along: Sequence[str]) -> List[int]:
        """The ranks of ``rank``'s group along ``along`` (ascending)."""
        mine = self.coords_of(rank)
        fixed = {name: c for name, c in mine.items() if name not in along}
        return sorted(
            self.rank_of({**fixed, **dict(zip(along, c))})
            for c in itertools.product(*(range(self.sizes[a]) for a in along))
        )

    def __repr__(self) -> str:
        return "RankGrid(" + "-".join(f"{name}{size}" for name, size in self.axes) + ")"
