"""Tensor parallelism: autograd collectives, sharded layers, vocab-parallel loss, RNG."""

from megalite.tensor_parallel.comms import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
)
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    is_counted_once,
    set_tp_attributes,
)
from megalite.tensor_parallel.random import RNGTracker, full_normal

__all__ = [
    "copy_to_tp_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "vocab_parallel_cross_entropy",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "is_counted_once",
    "set_tp_attributes",
    "RNGTracker",
    "full_normal",
]
