"""Where each of a rank's local tensors sits inside the full, layout-free tensor.

A local parameter is one or more rectangular blocks of its global tensor::

    ColumnParallelLinear  [sum(o_i), in]: piece i's rows on TP rank r start at
                          sum(o_<i) + r * o_i / tp  (fused Q,K,V or gate,up: one block per piece)
    RowParallelLinear     [out, in]: columns r * in/tp ...
    vocabulary tables     [vocab, h]: the real rows this rank owns (TP padding is never saved)
    replicated            the whole tensor (written by TP rank 0 only)

The last stage's copy of a tied embedding is not saved; it is read from the
word embeddings. The same blocks describe what a rank writes and what it needs
to read, in any (tp, pp, vp) layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

from megalite.model.gpt import WORD_EMBEDDINGS, GPTModel
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, vocab_range

VOCAB_TABLES = (WORD_EMBEDDINGS, "output_layer.weight", "output_weight")


@dataclass(frozen=True)
class Block:
    name: str  # global tensor name (the full model's state-dict key)
    global_shape: Tuple[int, ...]
    offsets: Tuple[int, ...]  # where the block starts in the global tensor
    local_rows: Tuple[int, int]  # rows [a, b) of the local tensor (all columns but for RowParallel)
    sizes: Tuple[int, ...]

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This block's part of the local tensor ``t`` (a view)."""
        return t[self.local_rows[0]:self.local_rows[1]]

    @property
    def key(self) -> str:
        return f"{self.name}@{','.join(map(str, self.offsets))}"


def _rows(name, global_shape, row_offset, a, b) -> Block:
    return Block(name, tuple(global_shape), (row_offset,) + (0,) * (len(global_shape) - 1), (a, b),
                 (b - a,) + tuple(global_shape[1:]))


def param_blocks(chunk: GPTModel, name: str, p: nn.Parameter, for_write: bool) -> List[Block]:
    """The blocks of global tensors that parameter ``name`` of ``chunk`` holds on this rank."""
    tp = chunk.tp
    if name in VOCAB_TABLES:
        if name == "output_weight" and for_write:
            return []  # the tied copy: the first stage saves the word embeddings
        vocab, h = chunk.cfg.vocab_size, p.shape[1]
        start, end = vocab_range(chunk.padded_vocab, tp)
        real_end = min(end, vocab)
        if real_end <= start:
            return []
        return [_rows(WORD_EMBEDDINGS if name == "output_weight" else name, (vocab, h), start, 0, real_end - start)]
    module_name, _, pname = name.rpartition(".")
    module = chunk.get_submodule(module_name)
    if isinstance(module, ColumnParallelLinear):
        total = sum(module.output_sizes)
        shape = (total,) + tuple(p.shape[1:])
        blocks, local, before = [], 0, 0
        for full, loc in zip(module.output_sizes, module.local_sizes):
            blocks.append(_rows(name, shape, before + tp.rank * loc, local, local + loc))
            local, before = local + loc, before + full
        return blocks
    if isinstance(module, RowParallelLinear) and pname == "weight":
        out, loc = p.shape
        return [Block(name, (out, loc * tp.size), (0, tp.rank * loc), (0, out), (out, loc))]
    if for_write and tp.rank != 0:
        return []  # replicated over TP: written once
    return [_rows(name, tuple(p.shape), 0, 0, p.shape[0])]


def chunk_blocks(chunks: Sequence[GPTModel], for_write: bool) -> Dict[Tuple[int, str], List[Block]]:
    """(chunk index, parameter name) -> its blocks, for every parameter of this rank."""
    return {(i, n): param_blocks(c, n, p, for_write) for i, c in enumerate(chunks) for n, p in c.named_parameters()}


def intersect(block: Block, saved_offsets: Sequence[int], saved_sizes: Sequence[int]):
    """Slices (into the needed block, into the saved block) of their overlap, or None."""
    dst, src = [], []
    for o, s, so, ss in zip(block.offsets, block.sizes, saved_offsets, saved_sizes):
        lo, hi = max(o, so), min(o + s, so + ss)
        if lo >= hi:
            return None
        dst.append(slice(lo - o, hi - o))
        src.append(slice(lo - so, hi - so))
    return tuple(dst), tuple(src)
