"""Where megatron-core's DistributedDataParallel puts each parameter in its gradient buckets.

Megatron-LM's distributed optimizer saves its state (``dp_reshardable``, torch_dist) as one flat
tensor per bucket and state key, per model-parallel rank ``dp_group_idx_<m>``; which parameter
sits where is not recorded, only each bucket's unpadded length. This module rebuilds the
placement as megatron-core 0.16's ``_ParamAndGradBuffer`` makes it:

- the parameters of one model chunk (one pipeline stage; virtual stages are not mapped) are
  taken in reverse ``named_parameters()`` order, each tp-local (Megatron's own tensor-parallel
  shapes: vocabulary and column-parallel rows, row-parallel columns split; norms and
  row-parallel biases whole);
- each start is padded to a multiple of 64 elements;
- a bucket closes after the parameter that reaches its size (the recorded length tells where),
  and a tied embedding split over pipeline stages (``shared_embedding``) sits in a bucket of
  its own, the open bucket closing, padding included, before it;
- model-parallel rank ``m`` is tensor rank ``m % tp`` of pipeline stage ``m // tp``.

megatron-core's local layer spec (``--transformer-impl local``) registers a layer's modules as
``_LOCAL_LAYER_ORDER`` (checked against files Megatron-LM wrote); the transformer_engine spec as
``_TE_LAYER_ORDER`` (from the two libraries' sources; not run here: Transformer Engine needs CUDA).
The caller checks the result against the saved weights before use, so a wrong order is refused,
never loaded.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

from megalite.interop.interchange import (
    OUTPUT,
    WORD,
    column_pieces,
    full_shape,
    is_row_parallel,
    layer_names,
    layer_prefix,
    post_names,
    pre_names,
)

# megatron-core's TransformerLayer (local spec) registers its modules in this order; Attention
# builds linear_proj before SelfAttention adds linear_qkv
_LOCAL_LAYER_ORDER = (
    "input_layernorm",
    "self_attention.linear_proj",
    "self_attention.linear_qkv",
    "pre_mlp_layernorm",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
# transformer_engine's spec fuses each norm into the next linear layer (TELayerNormColumnParallelLinear
# registers layer_norm_weight/_bias before weight/bias), so the input norm follows linear_proj
_TE_LAYER_ORDER = (
    "self_attention.linear_proj",
    "input_layernorm",
    "self_attention.linear_qkv",
    "pre_mlp_layernorm",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
TIED_COPY = OUTPUT + " (tied copy)"  # the last stage's duplicate of a tied embedding when pp > 1

__all__ = ["Unmappable", "rank_order", "bucket_layout", "TIED_COPY"]


class Unmappable(Exception):
    """The optimizer state is there but cannot be mapped exactly; the message says why (one clause)."""


def _local_shape(cfg, name: str, rows: int, tp: int) -> Tuple[int, ...]:
    """Megatron's tp-local shape of megalite's global ``name`` (``rows``: the padded vocabulary)."""
    if name in (WORD, OUTPUT):
        return (rows // tp, cfg.hidden_size)
    shape = full_shape(cfg, name)
    if column_pieces(cfg, name) is not None:
        return (shape[0] // tp,) + shape[1:]
    if is_row_parallel(name):
        return (shape[0], shape[1] // tp)
    return shape


def rank_order(
    cfg, layers: Sequence[int], first: bool, last: bool, rows: int, tp: int, te: bool = False
) -> List[Tuple[str, Tuple[int, ...], bool]]:
    """(megalite global name, Megatron tp-local shape, shared embedding) of one pipeline stage's
    parameters in megatron-core GPTModel's ``named_parameters()`` order (``te``: the
    transformer_engine spec's)."""
    rel = layer_names(cfg)
    in_layer = [n for m in (_TE_LAYER_ORDER if te else _LOCAL_LAYER_ORDER) for n in rel if n.rpartition(".")[0] == m]
    shared = cfg.tied_embeddings and not (first and last)
    names = [(n, shared and n == WORD) for n in pre_names(cfg)] if first else []
    names += [(layer_prefix(i) + n, False) for i in layers for n in in_layer]
    if last:
        names += [(n, False) for n in post_names(cfg)]
        if shared:
            names.append((TIED_COPY, True))
    return [(n, _local_shape(cfg, OUTPUT if n == TIED_COPY else n, rows, tp), s) for n, s in names]


def bucket_layout(order, sizes: Sequence[int]) -> Dict[str, Tuple[int, int, int]]:
    """name -> (bucket, start, end) as megatron-core's _ParamAndGradBuffer places ``order`` (from
    :func:`rank_order`), checked against the saved (unpadded) bucket lengths ``sizes``."""
    out, b, pos = {}, 0, 0
    for name, shape, shared in reversed(order):
        if b >= len(sizes):
            raise Unmappable(f"its buckets end before parameter {name}")
        pos = -(-pos // 64) * 64
        if shared and pos:  # the open bucket closes (its padding counted) before a shared embedding
            if pos != sizes[b]:
                raise Unmappable(f"bucket {b} ({sizes[b]} elements) does not close before the shared {name}")
            b, pos = b + 1, 0
            if b >= len(sizes):
                raise Unmappable(f"its buckets end before parameter {name}")
        end = pos + math.prod(shape)
        if end > sizes[b] or (shared and end != sizes[b]):
            raise Unmappable(f"parameter {name} would cross the end of bucket {b} ({sizes[b]} elements)")
        out[name] = (b, pos, end)
        b, pos = (b + 1, 0) if end == sizes[b] else (b, end)
    if b != len(sizes):
        raise Unmappable(f"{len(sizes) - b} bucket(s) are left over after the last parameter")
    return out
