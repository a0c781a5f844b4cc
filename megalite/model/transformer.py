"""Transformer layer pieces: norms, rotary embeddings, attention and MLP.

Activations are laid out [s, b, h] (sequence first, as Megatron) so that
sequence parallelism can later split dim 0. Inside a layer::

    x [s,b,h] -> norm -> linear_qkv (column) -> q [s,b,nq/tp,d] k,v [s,b,nkv/tp,d]
              -> rotary (opt.) -> causal SDPA per local head -> [s,b,nq*d/tp]
              -> linear_proj (row, all-reduce) -> [s,b,h] -> dropout -> + x
      then    -> norm -> linear_fc1 (column) -> GELU or SwiGLU -> [s,b,ffn/tp]
              -> linear_fc2 (row, all-reduce) -> [s,b,h] -> dropout -> + x

Both GPT-2 (LayerNorm, GELU, learned positions) and Llama (RMSNorm, SwiGLU,
RoPE, grouped-query attention, no biases) are the same classes with other flags; the
fused blocks and activation each layer gets come from the model's spec (spec.py).

With sequence parallelism the layer's input, norms, dropout and residuals are
sequence shards [s/tp, b, h]; linear_qkv / linear_fc1 all-gather the sequence
and linear_proj / linear_fc2 reduce-scatter it back. In half precision the
norms, softmax and loss accumulate in fp32 inside their kernels (torch's
layer_norm/rms_norm/softmax/SDPA do for bf16 and fp16 inputs) while the saved
activations stay 16-bit. Recomputation (``checkpoint``) wraps either the core
attention (selective; the CP and packed-document attention too) or whole layers (full,
chosen in gpt.py).

Under context parallelism or with packed documents (a ``span``: the local tokens' global indices
and the documents of the whole sequence) the core attention is context_parallel_attention, over
the CP group; the layer around it is unchanged (its sequence is the local s/cp tokens). Its blocks
run in the kernel --attention-backend picks (context_parallel/kernels.py: FlashAttention-2 varlen on
CUDA in fp16/bf16, else fp32 tiles).

Generation passes a ``KVCache`` (kv_cache.py): each attention layer appends its
new keys and values and attends over every cached position; queries then
start at the cache's offset, so the causal mask is aligned to the bottom right.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.context_parallel.attention import context_parallel_attention
from megalite.model.compile import run_compiled
from megalite.model.kv_cache import KVCache
from megalite.model.spec import ModelSpec, layer_prefix
from megalite.parallel.state import AxisGroup
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, set_tp_attributes
from megalite.tensor_parallel.random import RNGTracker, checkpoint

try:  # NVIDIA apex is optional; torch's own norms are the complete fallback.
    from apex.normalization import FusedLayerNorm as _ApexLayerNorm  # type: ignore
    from apex.normalization import FusedRMSNorm as _ApexRMSNorm  # type: ignore
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _ApexLayerNorm = _ApexRMSNorm = None


_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")  # torch >= 2.5


def build_norm(cfg: ModelConfig, dim: int, device: Optional[torch.device] = None) -> nn.Module:
    """LayerNorm or RMSNorm (apex fused kernels when importable and the run is on GPU)."""
    use_apex = device is not None and device.type == "cuda"
    if cfg.normalization == "LayerNorm":
        norm = (
            _ApexLayerNorm(dim, eps=cfg.layernorm_epsilon)
            if use_apex and _ApexLayerNorm
            else nn.LayerNorm(dim, eps=cfg.layernorm_epsilon)
        )
    elif cfg.normalization == "RMSNorm":
        norm = (
            _ApexRMSNorm(dim, eps=cfg.layernorm_epsilon)
            if use_apex and _ApexRMSNorm
            else nn.RMSNorm(dim, eps=cfg.layernorm_epsilon)
        )
    else:
        raise ValueError(f"unknown --normalization {cfg.normalization!r}; use LayerNorm or RMSNorm")
    for p in norm.parameters():
        set_tp_attributes(p, False)
    return norm


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Inverted dropout. On CPU the mask is kept as bool (1 byte, as CUDA's fused kernel does)
    rather than in the activation dtype, so saved-activation memory matches GPU accounting."""
    if not training or p == 0.0:
        return x
    if x.is_cuda:
        return F.dropout(x, p, True)
    keep = torch.rand_like(x, dtype=torch.float32) >= p
    return x * keep * (1.0 / (1.0 - p))


def rotary_cos_sin(seq_len: int, head_dim: int, base: int, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [s, 1, 1, d] for rotate-half RoPE (Megatron's default, non-interleaved)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
    return emb.cos(), emb.sin()


def _cached_causal_mask(s: int, sk: int, device) -> torch.Tensor:
    """[s, sk] bool, True where query i (position sk - s + i) may attend key j: j <= sk - s + i."""
    return torch.ones(s, sk, dtype=torch.bool, device=device).tril_(sk - s)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [s, b, n, d] by position: x*cos + rotate_half(x)*sin."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with heads (and query groups) split across the TP group."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp: AxisGroup,
        tracker: RNGTracker,
        seed: int,
        prefix: str,
        sequence_parallel: bool = False,
        cp: Optional[AxisGroup] = None,
        cp_comm_type: str = "p2p",
    ):
        super().__init__()
        d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.query_groups
        self.cfg, self.tracker = cfg, tracker
        self.cp, self.cp_comm_type = cp if cp is not None else AxisGroup([0], 0), cp_comm_type
        self.nq_local, self.nkv_local = nq // tp.size, nkv // tp.size
        self.unfused = cfg.attention_backend in ("unfused", "local")
        self.recompute = cfg.recompute_granularity == "selective"
        self.linear_qkv = ColumnParallelLinear(
            cfg.hidden_size,
            list(ModelSpec.of(cfg).attention.qkv_pieces),
            tp,
            bias=cfg.add_bias_linear,
            init_std=cfg.init_method_std,
            seed=seed,
            name=f"{prefix}.linear_qkv",
            sequence_parallel=sequence_parallel,
        )
        self.linear_proj = RowParallelLinear(
            nq * d,
            cfg.hidden_size,
            tp,
            bias=cfg.add_bias_linear,
            init_std=cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers),
            seed=seed,
            name=f"{prefix}.linear_proj",
            sequence_parallel=sequence_parallel,
        )

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal softmax(q k^T / sqrt(d)) v over this rank's heads; q [b,nq,s,d], k/v [b,nkv,sk,d].

        ``sk > s`` only with a KV cache: the queries are the last s of the sk positions.
        """
        p = self.cfg.attention_dropout if self.training else 0.0
        if p == 0.0:  # no random state touched
            return self._attend(q, k, v, 0.0)
        # Heads differ per TP rank, so their dropout masks must too: drawn from the tracker's "tp" stream
        # (eager inside a compiled layer, so the masks are eager's).
        return self.tracker.forked("tp", self._attend, q, k, v, p)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
        sk = k.shape[2]
        # SDPA's is_causal aligns its mask top-left: right when s == sk; a cached step (s < sk) needs its own.
        mask = None if sk == q.shape[2] else _cached_causal_mask(q.shape[2], sk, q.device)
        causal = dict(attn_mask=mask, is_causal=mask is None)
        if not self.unfused:
            if self.nkv_local == self.nq_local:
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, **causal)
            if _SDPA_GQA:  # query groups passed natively: no copies of k and v
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, enable_gqa=True, **causal)
            rep = self.nq_local // self.nkv_local
            return F.scaled_dot_product_attention(
                q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), dropout_p=p, **causal
            )
        # Explicit path (Megatron's unfused attention): groups by broadcasting, not copies.
        b, nq, s, d = q.shape
        rep = nq // k.shape[1]
        qg = q.view(b, k.shape[1], rep, s, d)
        if q.dtype == torch.float16:  # scale first: unscaled fp16 logits can overflow (bf16 cannot)
            scores = torch.matmul(qg * (1.0 / math.sqrt(d)), k.unsqueeze(2).transpose(-1, -2))
        else:
            scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * (1.0 / math.sqrt(d))
        future = torch.ones(s, sk, dtype=torch.bool, device=q.device).triu_(sk - s + 1)
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        probs = dropout(probs, p, self.training)
        return torch.matmul(probs, v.unsqueeze(2)).view(b, nq, s, d)

    def span_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_index: torch.Tensor,
        segment_ids: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """Attention over the whole sequence split across the CP group, and/or within documents:
        query at global index i attends key j iff j <= i (and both lie in one segment)."""
        p = self.cfg.attention_dropout if self.training else 0.0  # its dropout draws from the "tp" stream
        return context_parallel_attention(
            q,
            k,
            v,
            self.cp,
            self.cp_comm_type,
            q_index,
            segment_ids,
            dropout_p=p,
            tracker=self.tracker,
            backend=self.cfg.attention_backend,
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: Tuple[torch.Tensor, torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
        span: Optional[tuple] = None,
    ) -> torch.Tensor:
        """``span`` = (q_index [s], segment_ids [b, s_full] or None): this rank's tokens' global
        indices and the documents of the whole sequence (CP and/or packed documents)."""
        d = self.cfg.head_dim
        qkv = self.linear_qkv(x)  # [s, b, (nq + 2 nkv) d / tp]; s is the full sequence under SP
        s, b, _ = qkv.shape
        q, k, v = qkv.split([self.nq_local * d, self.nkv_local * d, self.nkv_local * d], dim=-1)
        q = q.view(s, b, self.nq_local, d)
        k = k.view(s, b, self.nkv_local, d)
        v = v.view(s, b, self.nkv_local, d)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        # [s, b, n, d] -> [b, n, s, d] for SDPA
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if kv_cache is not None:  # attend over the cached positions too (rope already applied to them)
            k, v = kv_cache.append(self, k, v)
        attend = self.core_attention
        if span is not None:
            attend = lambda q_, k_, v_: self.span_attention(q_, k_, v_, *span)  # noqa: E731
        out = checkpoint(attend, self.tracker, q, k, v) if self.recompute else attend(q, k, v)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.nq_local * d)  # [s, b, nq*d/tp]
        return self.linear_proj(out)


class MLP(nn.Module):
    """GELU MLP or SwiGLU (gate and up fused in one column-parallel matmul)."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp: AxisGroup,
        seed: int,
        prefix: str,
        sequence_parallel: bool = False,
        ffn: Optional[int] = None,
    ):
        super().__init__()
        spec = ModelSpec.of(cfg).mlp_of_size(ffn or cfg.ffn_size)
        ffn, self.swiglu = spec.ffn, spec.gated
        # "tanh": Megatron-LM's fused bias-GeLU and HF GPT-2's "gelu_new" (README, conversion)
        self.gelu_approximate = "tanh" if spec.activation == "gelu_tanh" else "none"
        self.linear_fc1 = ColumnParallelLinear(
            cfg.hidden_size,
            list(spec.fc1_pieces),
            tp,
            bias=cfg.add_bias_linear,
            init_std=cfg.init_method_std,
            seed=seed,
            name=f"{prefix}.linear_fc1",
            sequence_parallel=sequence_parallel,
        )
        self.linear_fc2 = RowParallelLinear(
            ffn,
            cfg.hidden_size,
            tp,
            bias=cfg.add_bias_linear,
            init_std=cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers),
            seed=seed,
            name=f"{prefix}.linear_fc2",
            sequence_parallel=sequence_parallel,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate=self.gelu_approximate)
        return self.linear_fc2(h)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))); ``mlp`` may be given (an MoE
    block, megalite.moe, built by the model)."""

    compiled_call = None  # --compile: a torch.compile'd caller every layer shares (model/compile.py)

    def __init__(
        self,
        cfg: ModelConfig,
        tp: AxisGroup,
        tracker: RNGTracker,
        seed: int,
        layer: int,
        sequence_parallel: bool = False,
        device: Optional[torch.device] = None,
        cp: Optional[AxisGroup] = None,
        cp_comm_type: str = "p2p",
        mlp: Optional[nn.Module] = None,
    ):
        super().__init__()
        prefix, self.layer_number = layer_prefix(layer), layer
        self.tracker, self.p = tracker, cfg.hidden_dropout
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.input_layernorm = build_norm(cfg, cfg.hidden_size, device)
        self.self_attention = Attention(
            cfg, tp, tracker, seed, f"{prefix}self_attention", sequence_parallel, cp, cp_comm_type
        )
        self.pre_mlp_layernorm = build_norm(cfg, cfg.hidden_size, device)
        self.mlp = mlp if mlp is not None else MLP(cfg, tp, seed, f"{prefix}mlp", sequence_parallel)  # or MoE

    def __call__(self, *args, **kwargs):
        if self.compiled_call is not None:
            return run_compiled(self, *args, **kwargs)
        return super().__call__(*args, **kwargs)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and self.p > 0 and self.training:  # each TP rank holds other positions
            return self.tracker.forked("tp", dropout, x, self.p, self.training)
        return dropout(x, self.p, self.training)

    def forward(
        self, x: torch.Tensor, rope=None, kv_cache: Optional[KVCache] = None, span: Optional[tuple] = None
    ) -> torch.Tensor:
        x = x + self._dropout(self.self_attention(self.input_layernorm(x), rope, kv_cache, span))
        return x + self._dropout(self.mlp(self.pre_mlp_layernorm(x)))
