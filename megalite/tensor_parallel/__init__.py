"""Tensor parallelism: autograd collectives, sharded layers, vocab-parallel loss, RNG."""
from megalite.tensor_parallel.comms import (copy_to_tp_region, gather_from_tp_region,  # noqa: F401
                                            reduce_from_tp_region, scatter_to_tp_region)
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy  # noqa: F401
from megalite.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,  # noqa: F401
                                             VocabParallelEmbedding, is_counted_once,
                                             set_tp_attributes)
from megalite.tensor_parallel.random import RNGTracker, full_normal  # noqa: F401
