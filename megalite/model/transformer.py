"""Transformer layer pieces: norms, rotary embeddings, attention and MLP.

Activations are laid out [s, b, h] (sequence first, as Megatron) so that
sequence parallelism can later split dim 0. Inside a layer::

    x [s,b,h] -> norm -> linear_qkv (column) -> q [s,b,nq/tp,d] k,v [s,b,nkv/tp,d]
              -> rotary (opt.) -> causal SDPA per local head -> [s,b,nq*d/tp]
              -> linear_proj (row, all-reduce) -> [s,b,h] -> dropout -> + x
      then    -> norm -> linear_fc1 (column) -> GELU or SwiGLU -> [s,b,ffn/tp]
              -> linear_fc2 (row, all-reduce) -> [s,b,h] -> dropout -> + x

Both GPT-2 (LayerNorm, GELU, learned positions) and Llama (RMSNorm, SwiGLU,
RoPE, grouped-query attention, no biases) are the same classes with other flags.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.parallel_state import AxisGroup
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, set_tp_attributes
from megalite.tensor_parallel.random import RNGTracker

try:  # NVIDIA apex is optional; torch's own norms are the complete fallback.
    from apex.normalization import FusedLayerNorm as _ApexLayerNorm  # type: ignore
    from apex.normalization import FusedRMSNorm as _ApexRMSNorm  # type: ignore
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _ApexLayerNorm = _ApexRMSNorm = None


def build_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """LayerNorm or RMSNorm (apex fused kernels when importable and on GPU)."""
    use_apex = torch.cuda.is_available()
    if cfg.normalization == "LayerNorm":
        norm = (_ApexLayerNorm(dim, eps=cfg.layernorm_epsilon) if use_apex and _ApexLayerNorm
                else nn.LayerNorm(dim, eps=cfg.layernorm_epsilon))
    elif cfg.normalization == "RMSNorm":
        norm = (_ApexRMSNorm(dim, eps=cfg.layernorm_epsilon) if use_apex and _ApexRMSNorm
                else nn.RMSNorm(dim, eps=cfg.layernorm_epsilon))
    else:
        raise ValueError(f"unknown --normalization {cfg.normalization!r}; use LayerNorm or RMSNorm")
    for p in norm.parameters():
        set_tp_attributes(p, False)
    return norm


def rotary_cos_sin(seq_len: int, head_dim: int, base: int, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [s, 1, 1, d] for rotate-half RoPE (Megatron's default, non-interleaved)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [s, b, n, d] by position: x*cos + rotate_half(x)*sin."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with heads (and query groups) split across the TP group."""

    def __init__(self, cfg: ModelConfig, tp: AxisGroup, tracker: RNGTracker, seed: int, prefix: str):
        super().__init__()
        d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.query_groups
        self.cfg, self.tracker = cfg, tracker
        self.nq_local, self.nkv_local = nq // tp.size, nkv // tp.size
        self.linear_qkv = ColumnParallelLinear(
            cfg.hidden_size, [nq * d, nkv * d, nkv * d], tp, bias=cfg.add_bias_linear,
            init_std=cfg.init_method_std, seed=seed, name=f"{prefix}.linear_qkv")
        self.linear_proj = RowParallelLinear(
            nq * d, cfg.hidden_size, tp, bias=cfg.add_bias_linear,
            init_std=cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers), seed=seed,
            name=f"{prefix}.linear_proj")

    def forward(self, x: torch.Tensor, rope: Tuple[torch.Tensor, torch.Tensor] = None) -> torch.Tensor:
        s, b, _ = x.shape
        d = self.cfg.head_dim
        q, k, v = self.linear_qkv(x).split(
            [self.nq_local * d, self.nkv_local * d, self.nkv_local * d], dim=-1)
        q = q.view(s, b, self.nq_local, d)
        k = k.view(s, b, self.nkv_local, d)
        v = v.view(s, b, self.nkv_local, d)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        # [s, b, n, d] -> [b, n, s, d] for SDPA
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if self.nkv_local != self.nq_local:
            rep = self.nq_local // self.nkv_local
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        p = self.cfg.attention_dropout if self.training else 0.0
        # Heads differ per TP rank, so their dropout masks must too.
        with self.tracker.fork("tp"):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.nq_local * d)  # [s, b, nq*d/tp]
        return self.linear_proj(out)


class MLP(nn.Module):
    """GELU MLP or SwiGLU (gate and up fused in one column-parallel matmul)."""

    def __init__(self, cfg: ModelConfig, tp: AxisGroup, seed: int, prefix: str):
        super().__init__()
        ffn = cfg.ffn_size
        self.swiglu = cfg.swiglu
        self.linear_fc1 = ColumnParallelLinear(
            cfg.hidden_size, [ffn, ffn] if cfg.swiglu else ffn, tp, bias=cfg.add_bias_linear,
            init_std=cfg.init_method_std, seed=seed, name=f"{prefix}.linear_fc1")
        self.linear_fc2 = RowParallelLinear(
            ffn, cfg.hidden_size, tp, bias=cfg.add_bias_linear,
            init_std=cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers), seed=seed,
            name=f"{prefix}.linear_fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.linear_fc2(h)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

    def __init__(self, cfg: ModelConfig, tp: AxisGroup, tracker: RNGTracker, seed: int, layer: int):
        super().__init__()
        prefix = f"decoder.layers.{layer}"
        self.input_layernorm = build_norm(cfg, cfg.hidden_size)
        self.self_attention = Attention(cfg, tp, tracker, seed, f"{prefix}.self_attention")
        self.pre_mlp_layernorm = build_norm(cfg, cfg.hidden_size)
        self.mlp = MLP(cfg, tp, seed, f"{prefix}.mlp")
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        x = x + self.dropout(self.self_attention(self.input_layernorm(x), rope))
        return x + self.dropout(self.mlp(self.pre_mlp_layernorm(x)))
