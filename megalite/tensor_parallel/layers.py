"""Tensor-parallel building blocks (Megatron's names and semantics).

::

    ColumnParallelLinear   Y = X A,  A split by columns:  A = [A_0 | A_1 | ...]
        x [.., in] --copy_to--> each rank: x A_r -> [.., out/tp]  (--gather--> [.., out])
    RowParallelLinear      Y = X A,  A split by rows:  A = [A_0; A_1; ...]
        x [.., in/tp] on rank r: x_r A_r -> partial [.., out] --reduce_from (sum)--> [.., out]
    VocabParallelEmbedding table split by vocabulary rows; each rank looks up the
        ids it owns, zeros the rest, and the partial results are summed.

With ``sequence_parallel`` the input of a column-parallel layer is a sequence
shard [s/tp, b, h]: it is all-gathered inside the matmul and only the shard is
kept for backward (gathered again there), and a row-parallel layer ends with
a reduce-scatter to [s/tp, b, h] instead of an all-reduce.

Parameters carry ``tensor_parallel`` (sharded across the TP group or replicated)
and ``partition_dim`` so that gradient clipping, checkpoint resharding and the
distributed optimizer can treat them correctly without knowing the layer.
Weights are initialised from the full, layout-independent matrix
(``random.full_normal``) and sliced, so every TP size builds the same model.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from megalite.parallel.eager import eager
from megalite.parallel.state import AxisGroup
from megalite.tensor_parallel.comms import (
    all_gather_first,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_first,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from megalite.tensor_parallel.fp8 import Fp8Linear, Fp8Recipe, fp8_linear
from megalite.tensor_parallel.random import full_normal


def set_tp_attributes(param: nn.Parameter, tensor_parallel: bool, partition_dim: int = -1) -> None:
    """Mark a parameter as sharded over the TP group (along ``partition_dim``) or replicated."""
    param.tensor_parallel = tensor_parallel
    param.partition_dim = partition_dim if tensor_parallel else -1


def per_expert_names(name: str, param: nn.Parameter) -> List[str]:
    """The per-expert names a grouped expert parameter (``...experts.linear_fcK.weight``, [E_local, ...]) is
    saved under, in local order (``...experts.local_experts.<e>.linear_fcK.weight``, e global); [] for
    any other parameter. Checkpoints and optimizer state keep these names whatever the storage."""
    experts = getattr(param, "grouped_experts", None)
    if experts is None:
        return []
    head, _, tail = name.rpartition(".linear_fc")
    return [f"{head}.local_experts.{e}.linear_fc{tail}" for e in experts]


def is_counted_once(param: nn.Parameter, tp_rank: int) -> bool:
    """True where this rank's copy counts toward model-wide sums (grad norm, parameter count).

    Replicated parameters are counted on TP rank 0 only, and a stage's copy of a
    tied embedding (``param.shared``) not at all: the first stage counts it.
    """
    if getattr(param, "shared", False):
        return False
    if getattr(param, "expert_parallel", False):  # an expert's: its own grid (the optimizer counts it over edp);
        return getattr(param, "tensor_parallel", False) or getattr(param, "first_of_etp", True)  # fc2 bias: once
    return getattr(param, "tensor_parallel", False) or tp_rank == 0


class WeightGradStore:
    """Weight-gradient GEMMs that a split backward (action B) leaves for its W action.

    While a store is collecting (``WeightGradSplit.collecting``), the backward of every linear
    layer split through that WeightGradSplit returns the input gradient only and keeps (input,
    output gradient) here; ``run`` later computes ``dW = g^T x`` for each and hands the
    sums to autograd as the gradients of the (leaf) weights, so they land
    exactly where a plain backward puts them: in-place into ``param.grad`` (the
    grad buffer's ``main_grad`` view) or through the post-accumulate hooks
    (fp32 accumulation of 16-bit grads, overlapped DP reduction), once per
    weight per micro-batch. Biases, norms and embeddings are cheap and stay in B.
    """

    def __init__(self) -> None:
        # (weight, x, grad, group, expert): ``expert`` is the index of a grouped expert weight's slice, else None
        self.pending: List[Tuple[nn.Parameter, torch.Tensor, torch.Tensor, Optional[AxisGroup], Optional[int]]] = []

    def run(self) -> None:
        """Compute the deferred weight gradients and accumulate them (one autograd call)."""
        sums: Dict[int, Tuple[nn.Parameter, torch.Tensor]] = {}
        for weight, x, grad, group, expert in self.pending:
            with torch.no_grad():  # as inside backward (gloo's all-gather writes into views)
                gw = _weight_grad(x, grad, group)
                if id(weight) not in sums:
                    sums[id(weight)] = (weight, torch.zeros_like(weight) if expert is not None else gw)
                    if expert is None:
                        continue
                total = sums[id(weight)][1]
                if expert is None:
                    sums[id(weight)] = (weight, total + gw)
                else:  # a grouped expert weight: each expert's dW into its slice of one gradient
                    total[expert].add_(gw)
        self.pending.clear()
        if sums:
            params, grads = zip(*sums.values())
            torch.autograd.backward(list(params), list(grads))


class WeightGradSplit:
    """Where the weight GEMMs of the linear layers split through it go: the store collecting now, or
    (none collecting) straight into the weights' gradients as a plain backward does.

    The run owns it (one per PipelineExecutor) and hands it to its chunks' layers with
    enable_weight_grad_split; a backward sees the store of the split its layers were built on.
    A plain object, not thread-local: on CUDA autograd runs backward functions on its own
    device threads.
    """

    def __init__(self) -> None:
        self.store: Optional[WeightGradStore] = None

    @contextlib.contextmanager
    def collecting(self, store: WeightGradStore) -> Iterator[WeightGradStore]:
        """Defer the weight GEMMs of every backward run inside the block into ``store``."""
        previous, self.store = self.store, store
        try:
            yield store
        finally:
            self.store = previous


def _weight_grad(x: torch.Tensor, grad: torch.Tensor, group: Optional[AxisGroup]) -> torch.Tensor:
    """dW = g^T x over all tokens; under SP the saved shard x is all-gathered again first."""
    total = all_gather_first(x, group) if group is not None else x  # [s, b, in]
    g2 = grad.reshape(-1, grad.shape[-1])
    return g2.t().matmul(total.reshape(-1, total.shape[-1]))


class _Linear(torch.autograd.Function):
    """y = gather(x) W^T + b whose weight gradient may be deferred to a WeightGradStore.

    ``group`` (sequence parallelism) all-gathers the sequence shard x inside the
    matmul and keeps only the shard for backward (gathered again there).
    ``owner`` = (param, WeightGradSplit) marks a splittable matmul, (param, WeightGradSplit, i) one on
    local expert i's slice of a grouped expert parameter: ``weight`` is then the parameter's (slice's)
    detached data, so the weight is not an input of the graph at all
    (autograd runs a leaf's post-accumulate hooks even for a missing gradient,
    and the grad buffer counts those calls); its gradient reaches it through
    autograd.backward on the leaf, in W, or right away when the split's store is not collecting.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, owner):
        ctx.group, ctx.owner, ctx.has_bias = group, owner, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(all_gather_first(x, group) if group is not None else x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight)
        if ctx.group is not None:
            grad_x = reduce_scatter_first(grad_x, ctx.group)
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(dim=0) if ctx.has_bias else None
        grad_w = None
        if ctx.owner is None:
            if ctx.needs_input_grad[1]:
                grad_w = _weight_grad(x, grad, ctx.group)
        elif ctx.owner[0].requires_grad:
            store = WeightGradStore() if ctx.owner[1].store is None else ctx.owner[1].store
            expert = ctx.owner[2] if len(ctx.owner) > 2 else None
            store.pending.append((ctx.owner[0], x, grad, ctx.group, expert))
            if ctx.owner[1].store is None:  # no split backward running: accumulate now, as a plain backward would
                store.run()
        return grad_x, grad_w, grad_b, None, None


@eager  # its SP all-gather (and a deferred weight gradient): eager inside a compiled layer
def _matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    group: Optional[AxisGroup],
    split_wgrad: Optional[WeightGradSplit],
) -> torch.Tensor:
    """x W^T + b through ``_Linear`` (splittable through ``split_wgrad`` when given)."""
    if split_wgrad:
        return _Linear.apply(x, weight.detach(), bias, group, (weight, split_wgrad))
    return _Linear.apply(x, weight, bias, group, None)


def linear_with_input_gather(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    tp: AxisGroup,
    sequence_parallel: bool,
    split_wgrad: Optional[WeightGradSplit] = None,
) -> torch.Tensor:
    """Column-parallel matmul: enter the TP region by copy (plain) or sequence all-gather (SP).

    ``split_wgrad`` routes the matmul through ``_Linear`` so a split backward can defer its
    weight gradient; otherwise the plain path keeps autograd's own F.linear backward.
    """
    if sequence_parallel and tp.size > 1:
        return _matmul(x, weight, bias, tp, split_wgrad)
    x = copy_to_tp_region(x, tp)
    return _matmul(x, weight, bias, None, split_wgrad) if split_wgrad else F.linear(x, weight, bias)


def _divide(n: int, d: int, what: str) -> int:
    if n % d != 0:
        raise ValueError(f"{what} ({n}) is not divisible by tensor-model-parallel-size ({d})")
    return n // d


def _shard_rows(full: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
    return full.chunk(tp.size, dim=0)[tp.rank].clone()


class ColumnParallelLinear(nn.Module):
    """Linear layer whose output features are split across the TP group.

    ``output_sizes`` may list several fused matrices (e.g. Q, K, V or gate, up);
    each is split separately so rank r holds [A_0_r; A_1_r; ...] and can split its
    local output the same way whatever the TP size.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Union[int, Sequence[int]],
        tp: AxisGroup,
        *,
        bias: bool = True,
        gather_output: bool = False,
        init_std: float = 0.02,
        seed: int = 0,
        name: str = "linear",
        dtype: torch.dtype = torch.float32,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        sizes: List[int] = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.tp, self.gather_output, self.output_sizes = tp, gather_output, sizes
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.local_sizes = [_divide(o, tp.size, f"{name} output size") for o in sizes]
        pieces = [
            _shard_rows(
                full_normal((o, input_size), init_std, seed, f"{name}.weight" + (f".{i}" if len(sizes) > 1 else "")), tp
            )
            for i, o in enumerate(sizes)
        ]
        self.weight = nn.Parameter(torch.cat(pieces, dim=0).to(dtype))  # [out/tp, in]
        set_tp_attributes(self.weight, True, 0)
        self.bias = nn.Parameter(torch.zeros(sum(self.local_sizes), dtype=dtype)) if bias else None
        if self.bias is not None:
            set_tp_attributes(self.bias, True, 0)
        self.split_wgrad: Optional[WeightGradSplit] = None  # set by enable_weight_grad_split (zero-bubble)
        self.fp8: Optional[Fp8Linear] = None  # set by enable_fp8: float8 GEMMs

    def local_from_full(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full ``weight``/``bias`` (each fused piece split separately)."""
        return torch.cat(
            [piece.chunk(self.tp.size, dim=0)[self.tp.rank] for piece in full.split(self.output_sizes, dim=0)], dim=0
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            y = self._fp8_forward(x)
        else:
            y = linear_with_input_gather(
                x, self.weight, self.bias, self.tp, self.sequence_parallel, self.split_wgrad
            )  # [.., out/tp]
        return gather_from_tp_region(y, self.tp) if self.gather_output else y

    def _fp8_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The column-parallel matmul with float8 GEMMs (tensor_parallel/fp8.py)."""
        if self.sequence_parallel:
            return fp8_linear(x, self.weight, self.bias, self.fp8, self.tp)
        return fp8_linear(copy_to_tp_region(x, self.tp), self.weight, self.bias, self.fp8)


class RowParallelLinear(nn.Module):
    """Linear layer whose input features are split across the TP group; output summed."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp: AxisGroup,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        init_std: float = 0.02,
        seed: int = 0,
        name: str = "linear",
        dtype: torch.dtype = torch.float32,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        _divide(input_size, tp.size, f"{name} input size")
        self.tp, self.input_is_parallel = tp, input_is_parallel
        self.sequence_parallel = sequence_parallel and tp.size > 1
        full = full_normal((output_size, input_size), init_std, seed, f"{name}.weight")
        self.weight = nn.Parameter(full.chunk(tp.size, dim=1)[tp.rank].clone().to(dtype))  # [out, in/tp]
        set_tp_attributes(self.weight, True, 1)
        # The bias is added once, after the sum, so it is replicated.
        self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype)) if bias else None
        if self.bias is not None:
            set_tp_attributes(self.bias, False)
        self.split_wgrad: Optional[WeightGradSplit] = None  # set by enable_weight_grad_split (zero-bubble)
        self.fp8: Optional[Fp8Linear] = None  # set by enable_fp8: float8 GEMMs

    def local_from_full(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full ``weight`` (input columns); the bias is replicated."""
        return full.chunk(self.tp.size, dim=1)[self.tp.rank] if name == "weight" else full

    def _linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.fp8 is not None:
            return fp8_linear(x, self.weight, bias, self.fp8)
        if self.split_wgrad:
            return _matmul(x, self.weight, bias, None, self.split_wgrad)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._linear(x, self.bias)  # fused bias add, nothing to reduce
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp)
        y = self._linear(x, None)
        y = (
            reduce_scatter_to_sequence_parallel_region(y, self.tp)
            if self.sequence_parallel
            else reduce_from_tp_region(y, self.tp)
        )
        return y + self.bias if self.bias is not None else y


def vocab_range(padded_vocab: int, tp: AxisGroup) -> tuple:
    """[start, end) of the vocabulary ids this TP rank owns."""
    per = _divide(padded_vocab, tp.size, "padded vocabulary size")
    return tp.rank * per, (tp.rank + 1) * per


def vocab_shard(real_rows: torch.Tensor, padded_vocab: int, tp: AxisGroup) -> torch.Tensor:
    """This rank's rows of a table whose first rows are ``real_rows`` and the rest zero padding."""
    start, end = vocab_range(padded_vocab, tp)
    out = torch.zeros(end - start, real_rows.shape[1], dtype=real_rows.dtype)
    if start < real_rows.shape[0]:
        out[: min(end, real_rows.shape[0]) - start] = real_rows[start:end]
    return out


def init_vocab_rows(
    vocab_size: int, padded_vocab: int, dim: int, tp: AxisGroup, std: float, seed: int, name: str
) -> torch.Tensor:
    """This rank's rows of a [padded_vocab, dim] table: real rows from the full draw, padding zero."""
    return vocab_shard(full_normal((vocab_size, dim), std, seed, name), padded_vocab, tp)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary across the TP group."""

    def __init__(
        self,
        vocab_size: int,
        padded_vocab: int,
        dim: int,
        tp: AxisGroup,
        *,
        init_std: float = 0.02,
        seed: int = 0,
        name: str = "embedding.word_embeddings",
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.tp = tp
        self.start, self.end = vocab_range(padded_vocab, tp)
        rows = init_vocab_rows(vocab_size, padded_vocab, dim, tp, init_std, seed, f"{name}.weight")
        self.weight = nn.Parameter(rows.to(dtype))  # [V/tp, h]
        set_tp_attributes(self.weight, True, 0)

    def forward(self, ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """Embeddings of ``ids``; with ``reduce=False`` this rank's partial sum (the caller reduces)."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.tp) if reduce else out


def linear_with_tp_weight(
    x: torch.Tensor,
    weight: torch.Tensor,
    tp: AxisGroup,
    bias: Optional[torch.Tensor] = None,
    sequence_parallel: bool = False,
    split_wgrad: Optional[WeightGradSplit] = None,
) -> torch.Tensor:
    """Column-parallel matmul against a weight owned elsewhere (the tied output layer)."""
    return linear_with_input_gather(x, weight, bias, tp, sequence_parallel, split_wgrad)


def enable_weight_grad_split(module: nn.Module, split: Optional[WeightGradSplit] = None) -> WeightGradSplit:
    """Let every linear layer in ``module`` defer its weight GEMM to the store ``split`` collects into
    (a new WeightGradSplit when None); returns the split.

    While no store collects the layers still compute every gradient in one backward,
    so turning this on never changes results, only where the weight GEMMs can run.
    """
    split = split if split is not None else WeightGradSplit()
    for m in module.modules():
        if hasattr(m, "split_wgrad"):
            m.split_wgrad = split
    return split


def enable_fp8(module: nn.Module, recipe: Fp8Recipe) -> int:
    """Run the GEMMs of every column/row-parallel linear in ``module`` in float8 (fp8.py); returns how
    many. The caller picks the modules: the output layer and the embedding stay high precision."""
    count = 0
    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            kind = "column" if isinstance(m, ColumnParallelLinear) else "row"
            m.fp8 = Fp8Linear(recipe, m.tp, kind, m.weight.device)
            count += 1
    return count
