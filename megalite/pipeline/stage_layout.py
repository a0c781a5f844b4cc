"""Which global stage each (pipeline rank, local chunk) runs: the one seam for stage placement.

Two placements of S = pp * vp stages, drawn for pp = 4::

    interleaved (Megatron, vp chunks):  stage = chunk * pp + rank
        chunk 0: rank0 s0  rank1 s1  rank2 s2  rank3 s3
        chunk 1: rank0 s4  rank1 s5  rank2 s6  rank3 s7
    V (zero-bubble ZB-V, exactly 2 chunks): chunk 0 at stage rank, chunk 1 at 2pp-1-rank
        chunk 0: rank0 s0  rank1 s1  rank2 s2  rank3 s3
        chunk 1: rank0 s7  rank1 s6  rank2 s5  rank3 s4

In the V the activations go down the ranks and come back up, so rank 0 holds
both the first stage (embedding) and the last (output layer and loss), and the
turn (s3 -> s4) stays on the last rank. Layers are assigned by global stage
(stage s holds the s-th run of consecutive layers) in both placements, so a
model split either way holds the same layers per stage; only the rank differs.
Schedules, the simulator, the executor, model building and checkpoint
conversion all ask a ``StageLayout`` rather than computing ``chunk * pp +
rank`` themselves: it is the only stage <-> rank mapping. Which layout a
schedule runs on is its registry entry's ``v_shape`` (registry.layout_for).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from megalite.pipeline.partition import layers_of_stage


@dataclass(frozen=True)
class StageLayout:
    """Stage placement for ``pp`` ranks with ``vp`` chunks each; ``v_shape`` needs vp == 2."""

    pp: int
    vp: int = 1
    v_shape: bool = False

    def __post_init__(self) -> None:
        if self.v_shape and self.vp != 2:
            raise ValueError(f"a V-shaped stage layout has exactly 2 chunks per rank (got vp={self.vp})")

    @property
    def whole_first_backward(self) -> bool:
        """In a split-backward schedule, does the first stage run its backward whole in W?

        Nothing waits for its input gradient, so with one stage per rank the split only costs
        time; in a V (or interleaved) rank 0 runs other stages too and the split leaves it
        fewer idle gaps (ZB-V's greedy order, pp 4, m 4: simulated bubble 12.5% split vs 25.0% whole).
        """
        return self.vp == 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.vp

    def stage(self, rank: int, chunk: int) -> int:
        """Global stage of (rank, local chunk)."""
        if not (0 <= rank < self.pp and 0 <= chunk < self.vp):
            raise ValueError(f"pp_rank={rank}, chunk={chunk} out of range for pp={self.pp}, vp={self.vp}")
        if self.v_shape and chunk == 1:
            return 2 * self.pp - 1 - rank
        return chunk * self.pp + rank

    def rank_of(self, stage: int) -> int:
        """Pipeline rank that runs global ``stage``."""
        if self.v_shape and stage >= self.pp:
            return 2 * self.pp - 1 - stage
        return stage % self.pp

    def chunk_of(self, stage: int) -> int:
        """Local chunk index of global ``stage`` on its rank."""
        return stage // self.pp

    def layers(
        self,
        num_layers: int,
        rank: int,
        chunk: int,
        first: Optional[int] = None,
        last: Optional[int] = None,
        stage_layers: Optional[Sequence[int]] = None,
    ) -> range:
        """Global layer indices of (rank, chunk): the layers partition.py gives its global stage.

        partition.py numbers stages chunk-major (stage s at rank s % pp, chunk s // pp); the
        V keeps that per-stage split (``stage_layers`` lists it in stage order) and only moves
        the stage to another rank. An uneven first/last split names pipeline ranks, which a
        V does not keep in order: refused.
        """
        s = self.stage(rank, chunk)
        if self.v_shape and (first is not None or last is not None):
            raise ValueError(
                "--decoder-first/last-pipeline-num-layers are not supported with the V-shaped "
                "schedules zbv and dualpipev; drop them or use --pipeline-stage-layers"
            )
        return layers_of_stage(num_layers, self.pp, self.vp, s, first, last, stage_layers)
