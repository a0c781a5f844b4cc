"""FP8 linears at any TP size against the same FP8 linears in one process (the worker of the TP parity
test), and an independent reference of tensorwise FP8 GEMMs written from the formulas alone."""

import torch
import torch.nn.functional as F

from megalite.parallel.state import ParallelState
from megalite.tensor_parallel.fp8 import Fp8Recipe, fp8_layers
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, enable_fp8


def reference_quantize(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Tensorwise FP8 round trip from the formulas: s = max/amax, cast(clamp(t s)), back / s (fp32)."""
    top = torch.finfo(dtype).max
    s = top / float(t.abs().max())
    return torch.clamp(t.double() * s, -top, top).float().to(dtype).double() / s


def reference_fp8_linear(x, w, g, grad_dtype):
    """(y, dx, dw) of y = x w^T with each GEMM's operands rounded through tensorwise FP8 (e4m3 for x, w)."""
    e4m3 = torch.float8_e4m3fn
    xq, wq, gq = reference_quantize(x, e4m3), reference_quantize(w, e4m3), reference_quantize(g, grad_dtype)
    return xq @ wq.t(), gq @ wq, gq.t() @ xq


def _layers(tp, recipe, sp, fp8=True):
    col = ColumnParallelLinear(32, 64, tp, seed=1, name="c", sequence_parallel=sp)
    row = RowParallelLinear(64, 32, tp, seed=1, name="r", sequence_parallel=sp)
    if fp8:
        enable_fp8(col, recipe)
        enable_fp8(row, recipe)
    return col, row


def _run(tp, recipe, sp, fp8=True):
    """Two steps of row(gelu(col(x))) (the second sees a delayed recipe's history); returns the last
    step's full output and input gradient, and both weights' accumulated gradients (this rank's part)."""
    col, row = _layers(tp, recipe, sp, fp8)
    shard = sp and tp.size > 1
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(8, 2, 32, generator=gen) * (1 + 3 * step)
        g = torch.randn(8, 2, 32, generator=gen)
        xl = (x.chunk(tp.size, dim=0)[tp.rank] if shard else x).clone().requires_grad_()
        y = row(F.gelu(col(xl)))
        y.backward(g.chunk(tp.size, dim=0)[tp.rank] if shard else g)
    return y.detach(), xl.grad, col.weight.grad, row.weight.grad, (col, row)


def _err(a, b):
    return float((a - b).abs().max() / b.abs().max())


def fp8_tp_parity(ps: ParallelState, recipe_name: str, fp8_format: str, sp: bool) -> dict:
    """Relative errors of the sharded FP8 layers against one process's FP8 layers (``*_tp``) and of
    one process's FP8 layers against plain ones (``fp8_vs_plain``, the size of FP8's own error)."""
    recipe = Fp8Recipe(fp8_format, recipe_name, amax_history_len=2)
    single = ParallelState.single().tp
    y, dx, dwc, dwr, (col, row) = _run(ps.tp, recipe, sp)
    y1, dx1, dwc1, dwr1, _ = _run(single, recipe, sp)
    shard = sp and ps.tp_size > 1
    part = (lambda t: t.chunk(ps.tp_size, dim=0)[ps.tp_rank]) if shard else (lambda t: t)
    plain = _run(single, recipe, sp, fp8=False)
    return {
        "y_tp": _err(y, part(y1)),
        "dx_tp": _err(dx, part(dx1)),
        "dw_col_tp": _err(dwc, col.local_from_full("weight", dwc1)),
        "dw_row_tp": _err(dwr, row.local_from_full("weight", dwr1)),
        "fp8_vs_plain": _err(y1, plain[0]),
    }


def fp8_count(trainer) -> dict:
    """``run_steps``'s inspect: how many of the trainer's linears run in FP8."""
    return {"fp8_linears": len(fp8_layers(trainer.chunks))}
