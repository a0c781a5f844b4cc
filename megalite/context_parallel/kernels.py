"""Variable-length attention kernels: the seam the packed-document and context-parallel paths call.

A kernel attends segments of a token-major layout: q [Tq, nq, d], k and v [Tk, nkv, d] (nkv divides
nq: grouped-query attention without copies), ``cu_q`` / ``cu_k`` int32 [n + 1] the cumulative
segment lengths (segment i: queries cu_q[i]:cu_q[i+1] attend keys cu_k[i]:cu_k[i+1]), causal
aligned bottom-right within a segment. ``forward`` returns the output (q's dtype) and the
log-sum-exp, fp32 [nq, Tq]; ``backward`` takes the FINAL output and log-sum-exp of the rows (after
every block of a ring or a blockwise merge), FlashAttention's recipe, so a block's gradient needs
only its own inputs.

    FlashKernel      CUDA, fp16/bf16: FlashAttention-2's variable-length kernels in torch
                     (aten._flash_attention_forward / _backward with cumulative sequence lengths)
    ReferenceKernel  any device and dtype: explicit fp32 math over a dense segment mask (tests, the
                     benchmark's CPU smoke run); never chosen for training

``kernel_for`` picks the kernel a call uses from --attention-backend, the device and the dtype (None:
the tiles of blocks.py run instead); ``describe`` is the line the run logs about it.
"""

from __future__ import annotations

import math
import warnings

import torch

from megalite.context_parallel.blocks import fused

_FWD = getattr(torch.ops.aten, "_flash_attention_forward", None)
_BWD = getattr(torch.ops.aten, "_flash_attention_backward", None)
_FWD_ARGS = ("cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "return_debug_mask", "scale")
_BWD_ARGS = ("grad_out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "is_causal", "scale")


def _schema_ok() -> bool:
    """Whether this torch's FlashAttention ops take the arguments FlashKernel passes (they changed
    between torch versions; a mismatch means the tiles run instead)."""
    if _FWD is None or _BWD is None:
        return False
    fwd, bwd = str(_FWD.default._schema), str(_BWD.default._schema)
    return all(a in fwd for a in _FWD_ARGS) and all(a in bwd for a in _BWD_ARGS)


class ReferenceKernel:
    """Explicit fp32 varlen attention over a dense [Tq, Tk] segment mask: small inputs only."""

    name = "reference (explicit fp32 varlen math)"

    @staticmethod
    def _mask(cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool) -> torch.Tensor:
        """[Tq, Tk] bool: query and key in one segment (and, causal, key not after the query, the
        segment's last query aligned with its last key)."""
        cu_q, cu_k = cu_q.long(), cu_k.long()
        n = cu_q.numel() - 1
        ids = torch.arange(n, device=cu_q.device)
        seg_q = torch.repeat_interleave(ids, cu_q.diff())
        seg_k = torch.repeat_interleave(ids, cu_k.diff())
        allowed = seg_q[:, None] == seg_k[None, :]
        if causal:  # distance from the segment's end: a key may be no nearer the end than its query
            to_end_q = cu_q[1:][seg_q] - torch.arange(seg_q.numel(), device=cu_q.device)
            to_end_k = cu_k[1:][seg_k] - torch.arange(seg_k.numel(), device=cu_k.device)
            allowed &= to_end_k[None, :] >= to_end_q[:, None]
        return allowed

    @staticmethod
    def _probs(q, k, cu_q, cu_k, causal, scale, lse=None):
        """(scores or probabilities [g, r, Tq, Tk], lse [g, r, Tq]) in fp32; q [Tq, nq, d], k [Tk, g, d]."""
        tq, nq, d = q.shape
        g = k.shape[1]
        qg = q.float().permute(1, 0, 2).reshape(g, nq // g, tq, d)
        s = torch.matmul(qg, k.float().permute(1, 2, 0).unsqueeze(1)).mul_(scale)
        s.masked_fill_(~ReferenceKernel._mask(cu_q, cu_k, causal), float("-inf"))
        if lse is None:
            lse = torch.logsumexp(s, dim=-1)
        finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        return torch.exp(s - finite.unsqueeze(-1)), lse

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        tq, nq, d = q.shape
        p, lse = self._probs(q, k, cu_q, cu_k, causal, scale)
        out = torch.matmul(p, v.float().permute(1, 0, 2).unsqueeze(1))  # [g, r, Tq, d]; empty rows 0
        return out.reshape(nq, tq, d).permute(1, 0, 2).to(q.dtype), lse.reshape(nq, tq)

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        tq, nq, d = q.shape
        g = k.shape[1]
        p, _ = self._probs(q, k, cu_q, cu_k, causal, scale, lse.reshape(g, nq // g, tq))
        do = dout.float().permute(1, 0, 2).reshape(g, nq // g, tq, d)
        delta = (do * out.float().permute(1, 0, 2).reshape(g, nq // g, tq, d)).sum(-1, keepdim=True)
        dv = torch.matmul(p.transpose(-1, -2), do).sum(1)  # [g, Tk, d]
        ds = p * (torch.matmul(do, v.float().permute(1, 2, 0).unsqueeze(1)) - delta)
        dk = torch.matmul(ds.transpose(-1, -2), q.float().permute(1, 0, 2).reshape(g, nq // g, tq, d)).sum(1)
        dq = torch.matmul(ds, k.float().permute(1, 0, 2).unsqueeze(1)).reshape(nq, tq, d)
        return (
            (dq * scale).permute(1, 0, 2).to(q.dtype),
            (dk * scale).permute(1, 0, 2).to(k.dtype),
            dv.permute(1, 0, 2).to(v.dtype),
        )


class FlashKernel:
    """FlashAttention-2 varlen (CUDA, fp16/bf16, head dim a multiple of 8 up to 256)."""

    name = "FlashAttention-2 varlen (torch aten._flash_attention_forward, cu_seqlens)"

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        out, lse = _FWD(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)[:2]
        return out, lse

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        rng, unused = torch.zeros(2, dtype=torch.int64, device=q.device), torch.empty(0, device=q.device)
        dq, dk, dv = _BWD(
            dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused, scale=scale
        )
        return dq, dk, dv


REFERENCE, FLASH = ReferenceKernel(), FlashKernel()
_probe_result: dict = {}  # device index -> "" (works) or why not
_warned: set = set()


def _probe(device: torch.device) -> str:
    """Why FlashKernel cannot run on ``device`` ("" when it can): a two-segment call, checked against
    the reference (catches a GPU without the kernel, a build without it, an unexpected LSE layout)."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _probe_result:
        _probe_result[key] = _probe_once(torch.device("cuda", key))
    return _probe_result[key]


def _probe_once(device: torch.device) -> str:
    if not _schema_ok():
        return f"torch {torch.__version__} has no aten._flash_attention_forward/_backward with cu_seqlens"
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(24, n, 64, generator=g).to(device, torch.bfloat16) for n in (4, 2, 2))
        cu = torch.tensor([0, 10, 24], dtype=torch.int32, device=device)
        out, lse = FLASH.forward(q, k, v, cu, cu, 14, 14, True, 0.125)
        ref_out, ref_lse = REFERENCE.forward(q, k, v, cu, cu, 14, 14, True, 0.125)
        if tuple(lse.shape) != tuple(ref_lse.shape):
            return f"its log-sum-exp has shape {tuple(lse.shape)}, not [heads, tokens]"
        if not _close(out, ref_out) or not _close(lse, ref_lse):
            return "its output differs from the reference"
        grads = FLASH.backward(out, q, k, v, out, lse, cu, cu, 14, 14, True, 0.125)
        want = REFERENCE.backward(out, q, k, v, out, lse, cu, cu, 14, 14, True, 0.125)
        if not all(_close(a, b) for a, b in zip(grads, want)):
            return "its gradients differ from the reference"
    except Exception as e:  # noqa: BLE001 - any failure means "not on this device"
        return f"it fails on {torch.cuda.get_device_name(device)}: {str(e).splitlines()[0][:160]}"
    return ""


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=5e-2, atol=5e-2)


def flash_unavailable(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """Why FlashKernel does not apply to these inputs ("" when it does)."""
    if device.type != "cuda":
        return f"it needs CUDA (the run is on {device.type})"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"it takes fp16/bf16, not {str(dtype).replace('torch.', '')}"
    if head_dim % 8 or head_dim > 256:
        return f"it takes head dims that are multiples of 8 up to 256, not {head_dim}"
    return _probe(device)


def kernel_for(backend: str, q: torch.Tensor):
    """The kernel packed-document / CP blocks of ``q`` run in (None: fp32 tiles); see ``choose``."""
    return choose(backend, q.device, q.dtype, q.shape[-1])


def choose(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int):
    """``backend`` is --attention-backend: unfused/local always tile; auto/flash/fused take FlashKernel
    where it applies, else the tiles with one warning on CUDA (on CPU the tiles are the expected path).
    "reference" (not a flag value) selects ReferenceKernel on any device: tests."""
    if backend == "reference":
        return REFERENCE
    if backend in ("unfused", "local"):
        return None
    why = flash_unavailable(device, dtype, head_dim)
    if not why:
        return FLASH
    if device.type == "cuda" and why not in _warned:
        _warned.add(why)
        warnings.warn(f"FlashAttention-2 varlen is not used: {why}; {TILES} run instead", stacklevel=3)
    return None


TILES = "fp32 tiles (blocks.py)"


def describe(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """One line: which kernel runs causal attention, and packed-document and CP blocks."""
    causal = "explicit softmax (unfused)" if backend in ("unfused", "local") else "torch SDPA (is_causal)"
    why = flash_unavailable(device, dtype, head_dim) if backend not in ("unfused", "local") else "not asked"
    if not why:
        masked = FLASH.name
    elif device.type == "cpu":
        masked = f"{TILES[:-1]}; torch's fused CPU flash kernel per tile)" if fused(device) else TILES
    else:
        masked = TILES if why == "not asked" else f"{TILES} (FlashAttention-2 varlen not used: {why})"
    return (
        f"attention kernels (--attention-backend {backend}): causal: {causal}; packed documents / CP blocks: {masked}"
    )


def scale_of(q: torch.Tensor) -> float:
    return 1.0 / math.sqrt(q.shape[-1])
