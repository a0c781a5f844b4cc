"""Where each of a rank's local tensors sits inside the full, layout-free tensor.

A local parameter is one or more rectangular blocks of its global tensor::

    ColumnParallelLinear  [sum(o_i), in]: piece i's rows on TP rank r start at
                          sum(o_<i) + r * o_i / tp  (fused Q,K,V or gate,up: one block per piece)
    RowParallelLinear     [out, in]: columns r * in/tp ...
    vocabulary tables     [vocab, h]: the real rows this rank owns (TP padding is never saved)
    replicated            the whole tensor (written by TP rank 0 only)

Expert weights (MoE) are sharded over the expert tensor-parallel group instead of TP: their
linear modules carry that group as ``module.tp``, so blocks use the module's own group (for
dense modules it is the chunk's TP group). Their names carry the global expert index, so a
name exists only on the EP rank holding that expert.

The last stage's copy of a tied embedding is not saved; it is read from the
word embeddings. The same blocks describe what a rank writes and what it needs
to read, in any (tp, pp, vp) layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

from megalite.model.gpt import WORD_EMBEDDINGS, GPTModel
from megalite.moe.experts import GroupedLinear
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
        """This block's part of the local tensor ``t`` (a view). A grouped parameter ([E_local, ...], one
        block per expert) is seen with its leading dimensions flattened, so an expert's rows follow the
        previous expert's and a block stays one run of rows of the flat parameter."""
        if t.dim() > len(self.sizes):
            t = t.flatten(0, t.dim() - len(self.sizes))
        return t[self.local_rows[0] : self.local_rows[1]]

    @property
    def row(self) -> int:
        """Elements in one of its local rows (a local row of a grouped parameter is one of its flattened rows)."""
        return math.prod(self.sizes[1:])

    @property
    def key(self) -> str:
        return f"{self.name}@{','.join(map(str, self.offsets))}"


def _rows(name, global_shape, row_offset, a, b) -> Block:
    return Block(
        name,
        tuple(global_shape),
        (row_offset,) + (0,) * (len(global_shape) - 1),
        (a, b),
        (b - a,) + tuple(global_shape[1:]),
    )


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
    if isinstance(module, GroupedLinear):
        return _grouped_blocks(module, name, pname, p, for_write)
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        tp = module.tp  # the group the module shards over: TP, or ETP for an expert's linear layers
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
        return []  # replicated over TP (ETP for an expert's bias): written once
    return [_rows(name, tuple(p.shape), 0, 0, p.shape[0])]


def _grouped_blocks(module: GroupedLinear, name: str, pname: str, p: nn.Parameter, for_write: bool) -> List[Block]:
    """A grouped expert parameter [E_local, ...]: each local expert's blocks under its own global per-expert
    name, as a Column/RowParallelLinear of that expert would hold them, its rows after the previous expert's."""
    head = name[: len(name) - len(f"linear_fc{module.fc}.{pname}")]  # "...mlp.experts."
    rows = p.shape[1]
    tp, out = module.tp, []
    for i, e in enumerate(module.experts):
        ename = f"{head}local_experts.{e}.linear_fc{module.fc}.{pname}"
        if module.fc == 1:
            shape = (sum(module.output_sizes),) + tuple(p.shape[2:])
            local, before = i * rows, 0
            for full, loc in zip(module.output_sizes, module.local_sizes):
                out.append(_rows(ename, shape, before + tp.rank * loc, local, local + loc))
                local, before = local + loc, before + full
        elif pname == "weight":
            loc = p.shape[2]
            out.append(Block(ename, (rows, loc * tp.size), (0, tp.rank * loc), (i * rows, (i + 1) * rows), (rows, loc)))
        elif not (for_write and tp.rank != 0):  # fc2's bias: replicated over ETP, written once
            out.append(_rows(ename, (rows,), 0, i * rows, (i + 1) * rows))
    return out


def chunk_blocks(chunks: Sequence[GPTModel], for_write: bool) -> Dict[Tuple[int, str], List[Block]]:
    """(chunk index, parameter name) -> its blocks, for every parameter of this rank."""
    return {(i, n): param_blocks(c, n, p, for_write) for i, c in enumerate(chunks) for n, p in c.named_parameters()}


def saved_order(blocks: Dict[Tuple[int, str], List[Block]]) -> List[Tuple[Tuple[int, str], List[Block]]]:
    """``chunk_blocks``'s items in the order per-expert parameters had: a layer's grouped expert parameters
    (fc1 weight, bias, fc2 weight, bias) cut per expert and interleaved, expert by expert, so a checkpoint
    writes the same entries in the same order (and hands replicas the same blocks) as before grouping."""
    out: List[Tuple[Tuple[int, str], List[Block]]] = []
    run: List[Tuple[Tuple[int, str], List[Block]]] = []

    def flush() -> None:
        experts: Dict[str, List[Tuple[Tuple[int, str], List[Block]]]] = {}
        for key, bs in run:
            for b in bs:
                e = b.name.split(".local_experts.", 1)[1].split(".", 1)[0]
                group = experts.setdefault(e, [])
                if not group or group[-1][0] != key:
                    group.append((key, []))
                group[-1][1].append(b)
        out.extend(item for group in experts.values() for item in group)
        run.clear()

    for key, bs in blocks.items():
        grouped = ".experts.linear_fc" in key[1]  # a grouped expert parameter (per-expert ones: .local_experts.)
        if run and (not grouped or run[-1][0][0] != key[0] or _module(run[-1][0][1]) != _module(key[1])):
            flush()
        if grouped:
            run.append((key, bs))
        else:
            out.append((key, bs))
    flush()
    return out


def _module(name: str) -> str:
    return name.rpartition(".linear_fc")[0]


def overlap(offsets_a: Sequence[int], sizes_a: Sequence[int], offsets_b: Sequence[int], sizes_b: Sequence[int]):
    """Slices (into box a, into box b) of two boxes' overlap in global coordinates, or None."""
    sa, sb = [], []
    for o, s, so, ss in zip(offsets_a, sizes_a, offsets_b, sizes_b):
        lo, hi = max(o, so), min(o + s, so + ss)
        if lo >= hi:
            return None
        sa.append(slice(lo - o, hi - o))
        sb.append(slice(lo - so, hi - so))
    return tuple(sa), tuple(sb)


def flat_boxes(offsets: Sequence[int], sizes: Sequence[int], lo: int, hi: int) -> List[Tuple[tuple, tuple, int]]:
    """Elements [lo, hi) of box (offsets, sizes)'s row-major flattening as boxes, in order.

    Each is (global offsets, sizes, its first element's place in [lo, hi)), contiguous in that
    flattening: at most one partial run per dimension at each end, full rows in between.
    """
    out: List[Tuple[tuple, tuple, int]] = []

    def walk(dim: int, head: tuple, a: int, b: int) -> None:  # [a, b) of the sub-box at index ``head``
        stride = math.prod(sizes[dim + 1 :])
        first, last = a // stride, (b - 1) // stride
        if dim == len(sizes) - 1 or (a % stride == 0 and b % stride == 0):
            out.append(
                (
                    tuple(o + h for o, h in zip(offsets, head + (first,))) + tuple(offsets[dim + 1 :]),
                    (1,) * dim + (last + 1 - first,) + tuple(sizes[dim + 1 :]),
                    0,
                )
            )
        elif first == last:
            walk(dim + 1, head + (first,), a - first * stride, b - first * stride)
        else:
            full_a = first + (a % stride != 0)
            if a % stride:
                walk(dim + 1, head + (first,), a % stride, stride)
            if full_a < b // stride:
                walk(dim, head, full_a * stride, b // stride * stride)
            if b % stride:
                walk(dim + 1, head + (last,), 0, b % stride)

    if hi > lo:
        walk(0, (), lo, hi)
    place = 0
    for i, (o, s, _) in enumerate(out):
        out[i] = (o, s, place)
        place += math.prod(s)
    return out
