"""FP8 GEMMs for the tensor-parallel linears (``--fp8-format``, ``--fp8-recipe``; README, FP8 training).

Each of a linear's three GEMMs (forward ``y = x W^T``, input gradient ``g W``, weight gradient
``g^T x``) runs on float8 copies of its two operands with bf16 master weights and a bf16 result::

    scale = fp8_max / amax            (delayed: / 2**margin, amax from the history of earlier steps)
    q     = clamp(t * scale, -fp8_max, fp8_max) -> float8      (saturating cast)
    a @ b = (q_a @ q_b) / (scale_a * scale_b)                  (torch._scaled_mm on CUDA)

Formats (Megatron's): ``e4m3`` quantizes all three tensors to float8_e4m3fn; ``hybrid`` keeps e4m3
for inputs and weights and uses float8_e5m2 (more range, less precision) for output gradients.
Recipes: ``tensorwise`` one scale per tensor from its current amax; ``delayed`` one scale per
tensor from an amax history (``--fp8-amax-history-len``, ``--fp8-amax-compute-algo``): the state
a checkpoint saves (``fp8_states``); ``rowwise`` one scale per row along each GEMM's contraction
dimension, rounded down to a power of two (torchao's recipe of that name).

Tensor parallelism: a scale must not depend on how a tensor is sharded, so amaxes taken over a
sharded dimension are reduced (max) over the TP group first. Tensorwise/delayed: the weight (both
layers), the output gradient (column-parallel) and the input (row-parallel); rowwise: the GEMM
whose contraction dimension is sharded (column-parallel input gradient, row-parallel forward).
A sharded layer then computes exactly what the unsharded one does, up to fp32 summation order.

The GEMM is ``torch._scaled_mm`` on CUDA when every dimension is a multiple of 16; elsewhere
(CPU, odd shapes) the float8 values are multiplied in fp32, which is the same math (products of
two float8 values are exact in fp32) with another summation order. Why this module and not
torchao's Float8Linear: the README's FP8 section.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megalite.parallel.eager import eager
from megalite.parallel.state import AxisGroup
from megalite.tensor_parallel.comms import all_gather_first, reduce_scatter_first

FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "delayed", "rowwise")
ROLES = ("input", "weight", "grad_output")  # the rows of a delayed-scaling amax history
E4M3 = getattr(torch, "float8_e4m3fn", None)
E5M2 = getattr(torch, "float8_e5m2", None)


def fp8_supported_by_torch() -> bool:
    """Whether this torch has the float8 dtypes (torch >= 2.1)."""
    return E4M3 is not None and E5M2 is not None


@dataclass(frozen=True)
class Fp8Recipe:
    """The FP8 settings of a run (ModelConfig's fp8 fields)."""

    fp8_format: str = "hybrid"
    recipe: str = "tensorwise"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"

    def dtype(self, role: str) -> torch.dtype:
        """float8_e5m2 for output gradients under ``hybrid``, float8_e4m3fn otherwise."""
        return E5M2 if role == "grad_output" and self.fp8_format == "hybrid" else E4M3


def fp8_recipe_of(cfg) -> Fp8Recipe:
    """The Fp8Recipe of a ModelConfig with --fp8-format set."""
    return Fp8Recipe(
        cfg.fp8_format, cfg.fp8_recipe, cfg.fp8_margin, cfg.fp8_amax_history_len, cfg.fp8_amax_compute_algo
    )


def describe_fp8(cfg, device: torch.device) -> str:
    """The start line of an FP8 run: format, recipe, which transformer layers, and how the GEMMs run here."""
    layers = [i for i in range(cfg.num_layers) if cfg.fp8_layer(i)]
    span = f"layers {layers[0]}-{layers[-1]} of {cfg.num_layers}" if layers else "no layer"
    gemm = (
        "torch._scaled_mm"
        if device.type == "cuda"
        else f"emulated on {device.type} (float8 values multiplied in fp32: for tests and debugging)"
    )
    extra = (
        f", amax history {cfg.fp8_amax_history_len} ({cfg.fp8_amax_compute_algo})"
        if cfg.fp8_recipe == "delayed"
        else ""
    )
    return (
        f"fp8: --fp8-format {cfg.fp8_format}, --fp8-recipe {cfg.fp8_recipe}{extra}: the linears of {span} in FP8 "
        f"(embedding, output layer and norms in bf16), GEMMs {gemm}"
    )


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of a float8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def amax_of(t: torch.Tensor, dim: Optional[int] = None, group: Optional[AxisGroup] = None) -> torch.Tensor:
    """max |t| in fp32: over the whole tensor (a 0-dim tensor) or along ``dim`` (kept, size 1);
    reduced (max) over ``group`` when given, for a tensor sharded over it."""
    a = t.detach().abs()
    amax = (a.amax() if dim is None else a.amax(dim=dim, keepdim=True)).float()
    if group is not None and group.size > 1:
        group.collective(dist.all_reduce, amax, op=dist.ReduceOp.MAX)
    return amax


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """fp8_max / amax / 2**margin (fp32); 1 where amax is 0 or not finite (nothing to scale)."""
    ok = (amax > 0) & torch.isfinite(amax)
    scale = fp8_max(dtype) / torch.where(ok, amax, torch.ones_like(amax)) / (2.0**margin)
    return torch.where(ok, scale, torch.ones_like(scale))


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t * scale cast to ``dtype``, saturating at +-fp8_max (torch's cast does not saturate everywhere)."""
    m = fp8_max(dtype)
    return (t.float() * scale).clamp(-m, m).to(dtype)


def _torch_at_least(major: int, minor: int) -> bool:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (major, minor)


_SCALED_MM_FAILS: Dict[str, str] = {}  # device -> why torch._scaled_mm is not used there (probe_scaled_mm)


def _use_scaled_mm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor) -> bool:
    """torch._scaled_mm runs it: CUDA, every dimension a multiple of 16, row scales only from torch 2.5, and
    the start-of-run probe passed on this device."""
    if not (a.is_cuda and hasattr(torch, "_scaled_mm") and all(n % 16 == 0 for n in (*a.shape, b.shape[1]))):
        return False
    if str(a.device) in _SCALED_MM_FAILS:
        return False
    return a_scale.numel() == 1 or _torch_at_least(2, 5)


def probe_scaled_mm(device: torch.device, recipe: Fp8Recipe) -> str:
    """Why torch._scaled_mm cannot run this recipe's GEMMs on ``device`` ("" when it can): the three GEMM
    kinds of a linear (e4m3 x e4m3 forward; output gradient x weight and x input in the format's dtype) at a
    small shape, against the emulation. Run once at start, eagerly (never inside a compiled graph); a failure
    is remembered and the GEMMs are emulated on that device instead of stopping the run."""
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    g = torch.Generator().manual_seed(0)
    rowwise = recipe.recipe == "rowwise"
    try:
        for a_dtype in (recipe.dtype("input"), recipe.dtype("grad_output")):
            a32, b32 = torch.randn(32, 64, generator=g), torch.randn(64, 48, generator=g)
            a_dim, b_dim = (1, 0) if rowwise else (None, None)
            a_scale = scale_from_amax(amax_of(a32, a_dim), a_dtype).to(device)
            b_scale = scale_from_amax(amax_of(b32, b_dim), E4M3).to(device)
            a8, b8 = quantize(a32.to(device), a_scale, a_dtype), quantize(b32.to(device), b_scale, E4M3)
            want = ((a8.float() @ b8.float()) / (a_scale * b_scale)).to(torch.bfloat16)
            got = torch._scaled_mm(
                a8.contiguous(),
                b8.t().contiguous().t(),
                scale_a=a_scale.reciprocal().contiguous(),
                scale_b=b_scale.reciprocal().contiguous(),
                out_dtype=torch.bfloat16,
            )
            got = got[0] if isinstance(got, tuple) else got
            if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
                return f"its {str(a_dtype).replace('torch.', '')} result differs from the emulation"
    except Exception as e:  # noqa: BLE001 - any failure means "emulate on this device"
        return f"it fails here: {str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__}"
    return ""


def check_scaled_mm(device: torch.device, recipe: Fp8Recipe) -> Optional[str]:
    """Probe ``device`` once (CUDA only); the warning to log when its GEMMs will be emulated, else None."""
    if device.type != "cuda" or str(device) in _SCALED_MM_FAILS:
        return None
    why = probe_scaled_mm(device, recipe)
    if not why:
        return None
    _SCALED_MM_FAILS[str(device)] = why
    return f"fp8: torch._scaled_mm is not used on {device}: {why}; the FP8 GEMMs are emulated (slower than bf16)"


def scaled_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
) -> torch.Tensor:
    """(a @ b) / (a_scale * b_scale) of float8 ``a`` [M, K] and ``b`` [K, N]; scales 0-dim (tensorwise)
    or [M, 1] and [1, N] (rowwise). ``fast_accum``: the GPU's faster, less precise FP8 accumulation
    (the forward GEMM only, as torchao's default)."""
    if _use_scaled_mm(a, b, a_scale):
        out = torch._scaled_mm(
            a.contiguous(),
            b.t().contiguous().t(),  # column-major second operand
            scale_a=a_scale.reciprocal().contiguous(),
            scale_b=b_scale.reciprocal().contiguous(),
            out_dtype=out_dtype,
            use_fast_accum=fast_accum,
        )
        return out[0] if isinstance(out, tuple) else out  # torch < 2.4 also returned the amax
    return ((a.float() @ b.float()) / (a_scale * b_scale)).to(out_dtype)


class Fp8Linear:
    """The FP8 settings and (delayed scaling) amax history of one TP linear layer.

    ``kind`` is ``column`` or ``row`` (which tensors are sharded over ``tp``). ``history`` is
    [3, amax_history_len] fp32, one row per ROLES entry, newest first; all zeros until a step
    records an amax. Only forwards and backwards run with grad enabled record (``record``):
    evaluation and the no-grad first pass of activation recomputation leave it unchanged, so a
    recomputed forward quantizes exactly as the first one did.
    """

    def __init__(self, recipe: Fp8Recipe, tp: AxisGroup, kind: str, device=None):
        self.recipe, self.tp, self.kind = recipe, tp, kind
        self.history: Optional[torch.Tensor] = None
        if recipe.recipe == "delayed":
            self.history = torch.zeros(len(ROLES), recipe.amax_history_len, dtype=torch.float32, device=device)

    def sharded(self, role: str) -> Optional[AxisGroup]:
        """The TP group when ``role``'s tensor is sharded over it (its whole-tensor amax is reduced)."""
        shard = ("weight", "grad_output") if self.kind == "column" else ("input", "weight")
        return self.tp if role in shard and self.tp.size > 1 else None

    def tensor_scale(self, role: str, t: torch.Tensor, record: bool) -> torch.Tensor:
        """The tensorwise/delayed scale of ``t`` in ``role``; delayed: records its amax when ``record``."""
        dtype = self.recipe.dtype(role)
        amax = amax_of(t, None, self.sharded(role))
        if self.history is None:
            return scale_from_amax(amax, dtype)
        row = ROLES.index(role)
        if self.history.device != amax.device:
            self.history = self.history.to(amax.device)
        past = self.history[row]
        known = past[0] if self.recipe.amax_compute_algo == "most_recent" else past.max()
        scale = scale_from_amax(torch.where(past.max() > 0, known, amax), dtype, self.recipe.margin)
        if record:
            self.history[row] = torch.cat([amax.reshape(1), past[:-1]])
        return scale


def _rowwise(t: torch.Tensor, dim: int, dtype: torch.dtype, group: Optional[AxisGroup]):
    """(float8 t, scale) with one scale per slice along the contraction dimension ``dim``, each rounded
    down to a power of two (as torchao's rowwise recipe: dequantizing is then exact)."""
    scale = torch.exp2(torch.floor(torch.log2(scale_from_amax(amax_of(t, dim, group), dtype))))
    return quantize(t, scale, dtype), scale


def _forward_gemm(fp8: Fp8Linear, x2: torch.Tensor, weight: torch.Tensor, record: bool):
    """y = x W^T in float8; returns (y, (float8 x, float8 W, their scales)) for tensorwise/delayed
    scaling (backward reuses them), (y, None) for rowwise (backward scales along other dimensions)."""
    r = fp8.recipe
    if r.recipe == "rowwise":
        group = fp8.tp if fp8.kind == "row" and fp8.tp.size > 1 else None  # contraction (in) sharded
        x8, xs = _rowwise(x2, -1, r.dtype("input"), group)
        w8, ws = _rowwise(weight, -1, r.dtype("weight"), group)
        return scaled_matmul(x8, xs, w8.t(), ws.t(), x2.dtype, fast_accum=True), None
    xs, ws = fp8.tensor_scale("input", x2, record), fp8.tensor_scale("weight", weight, record)
    x8, w8 = quantize(x2, xs, r.dtype("input")), quantize(weight, ws, r.dtype("weight"))
    y = scaled_matmul(x8, xs, w8.t(), ws, x2.dtype, fast_accum=True)
    return y, (x8, w8, xs, ws)


def _rowwise_backward(fp8: Fp8Linear, g2, x2, weight, need_w: bool):
    """(grad_x, grad_w or None) with row scales along each GEMM's contraction dimension."""
    r, dt = fp8.recipe, g2.dtype
    group = fp8.tp if fp8.kind == "column" and fp8.tp.size > 1 else None  # contraction (out) sharded
    g8, gs = _rowwise(g2, -1, r.dtype("grad_output"), group)
    w8, ws = _rowwise(weight, 0, r.dtype("weight"), group)
    grad_x = scaled_matmul(g8, gs, w8, ws, dt)
    if not need_w:
        return grad_x, None
    gt8, gts = _rowwise(g2, 0, r.dtype("grad_output"), None)  # contraction over tokens: never sharded
    x8, xs = _rowwise(x2, 0, r.dtype("input"), None)
    return grad_x, scaled_matmul(gt8.t(), gts.t(), x8, xs, weight.dtype)


def _tensorwise_backward(fp8: Fp8Linear, g2, x8, w8, xs, ws, w_dtype, need_w: bool):
    """(grad_x, grad_w or None) from the forward's float8 x [M, in] and W and their scales."""
    gs = fp8.tensor_scale("grad_output", g2, True)
    g8 = quantize(g2, gs, fp8.recipe.dtype("grad_output"))
    grad_x = scaled_matmul(g8, gs, w8, ws, g2.dtype)
    return grad_x, scaled_matmul(g8.t(), gs, x8, xs, w_dtype) if need_w else None


class _Fp8Function(torch.autograd.Function):
    """y = gather(x) W^T + b with all three GEMMs in float8 (``group``: the sequence-parallel gather).

    Tensorwise/delayed scaling keeps the float8 x and W of the forward for backward (as torchao: half
    the bytes of bf16, no second cast), except x under SP: its bf16 shard, gathered again in backward.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, fp8, group, record):
        total = all_gather_first(x, group) if group is not None else x
        x2 = total.reshape(-1, total.shape[-1])
        y, kept = _forward_gemm(fp8, x2, weight, record)
        if bias is not None:
            y = y + bias
        ctx.fp8, ctx.group, ctx.has_bias, ctx.w_dtype = fp8, group, bias is not None, weight.dtype
        ctx.shape, ctx.scales = total.shape, None
        if kept is None:
            ctx.save_for_backward(x, weight)
        else:
            x8, w8, xs, ws = kept
            ctx.scales = (xs, ws)
            ctx.save_for_backward(x if group is not None else x8, w8)
        return y.reshape(*total.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        total = all_gather_first(x, ctx.group) if ctx.group is not None else x
        g2 = grad.reshape(-1, grad.shape[-1])
        x2 = total.reshape(-1, total.shape[-1])
        need_w = ctx.needs_input_grad[1]
        if ctx.scales is None:
            grad_x, grad_w = _rowwise_backward(ctx.fp8, g2, x2, w, need_w)
        else:
            xs, ws = ctx.scales
            if ctx.group is not None:  # the gathered bf16 x, quantized again with the forward's scale
                x2 = quantize(x2, xs, ctx.fp8.recipe.dtype("input"))
            grad_x, grad_w = _tensorwise_backward(ctx.fp8, g2, x2, w, xs, ws, ctx.w_dtype, need_w)
        grad_x = grad_x.reshape(ctx.shape)
        if ctx.group is not None:
            grad_x = reduce_scatter_first(grad_x, ctx.group)
        grad_b = g2.sum(dim=0).to(grad.dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    fp8: Fp8Linear,
    group: Optional[AxisGroup] = None,
) -> torch.Tensor:
    """x W^T + b with float8 GEMMs; ``group`` all-gathers a sequence shard x first (SP). Under tensor
    parallelism (amaxes reduced over TP, SP's gather) it runs eagerly inside a compiled layer, behind one
    graph break, as every TP collective does (parallel/eager.py)."""
    if group is not None or fp8.tp.size > 1:
        return _fp8_with_collectives(x, weight, bias, fp8, group, torch.is_grad_enabled())
    return _Fp8Function.apply(x, weight, bias, fp8, group, torch.is_grad_enabled())


@eager
def _fp8_with_collectives(x, weight, bias, fp8: Fp8Linear, group: Optional[AxisGroup], record: bool) -> torch.Tensor:
    return _Fp8Function.apply(x, weight, bias, fp8, group, record)


def fp8_layers(modules: Iterable[nn.Module]) -> Dict[str, Fp8Linear]:
    """{'<chunk>.<module name>': Fp8Linear} of every FP8 linear in the model chunks ``modules``."""
    found: Dict[str, Fp8Linear] = {}
    for i, chunk in enumerate(modules):
        for name, m in chunk.named_modules():
            if getattr(m, "fp8", None) is not None:
                found[f"{i}.{name}"] = m.fp8
    return found


def fp8_states(modules: Iterable[nn.Module]) -> Dict[str, torch.Tensor]:
    """The delayed-scaling amax histories of the model chunks (empty for stateless recipes)."""
    return {k: f.history.detach().cpu().clone() for k, f in fp8_layers(modules).items() if f.history is not None}


def load_fp8_states(modules: Iterable[nn.Module], states: Dict[str, torch.Tensor]) -> Tuple[int, int]:
    """Restore the amax histories saved by ``fp8_states``; returns (restored, layers with history)."""
    restored, total = 0, 0
    for k, f in fp8_layers(modules).items():
        if f.history is None:
            continue
        total += 1
        if k in states and states[k].shape == f.history.shape:
            f.history.copy_(states[k].to(f.history.device))
            restored += 1
    return restored, total
