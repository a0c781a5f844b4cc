"""The model family, described once: what every layer holds, what its parameters are called here and in
Megatron-LM's and Hugging Face's files, and how many parameters and FLOPs the model has.

The model (gpt.py, transformer.py) builds what a :class:`ModelSpec` describes; throughput (FLOPs),
the planner (parameters per rank), checkpoints (the shape fields) and interop (names in other
projects' files) read it instead of repeating GPT's assumptions. One family with options: GPT-2
style (LayerNorm, GeLU, learned positions, biases), Llama style (RMSNorm, SwiGLU, RoPE, grouped-query
attention, no biases), and mixtures of experts in either (Mixtral: every layer MoE; Qwen2-MoE: a gated
shared expert, dense layers by --moe-layer-freq). Global parameter names and full shapes::

    embedding.word_embeddings.weight         [V, h]    vocabulary rows split over tp (padded per tp)
    embedding.position_embeddings.weight     [p, h]    learned positions only
    decoder.layers.N.  input_layernorm.{weight,bias}           (bias: LayerNorm only)
                       self_attention.linear_qkv.*  [(nq + 2 nkv) d, h]   column: [Q; K; V] each split over tp
                       self_attention.linear_proj.* [h, nq d]             row (its bias whole)
                       pre_mlp_layernorm.*
                       mlp.linear_fc1.*  [ffn, h] or [2 ffn, h] ([gate; up], SwiGLU)   column
                       mlp.linear_fc2.*  [h, ffn]                                       row
      an MoE layer's mlp instead:
                       mlp.router.weight [E, h] (+ mlp.router.expert_bias [E]: fp32, not trained)
                       mlp.experts.local_experts.<e>.linear_fc{1,2}.*   e global; split over expert TP
                       mlp.shared_experts.linear_fc{1,2}.* (+ mlp.shared_experts.gate_weight [1, h])
    decoder.final_layernorm.*, output_layer.weight [V, h] (untied only)

FLOPs are Megatron-LM's ``num_floating_point_operations`` (megatron-core 0.16 and later), so that
TFLOP/s/GPU compares with Megatron's log. Per token and layer, x3 (forward, weight grad, input grad) x2
(multiply-add) = 6 x the weights a token multiplies, plus the core attention::

    attention projections   h * (q + 2 kv) + q * h        (q = heads x head dim, kv = groups x head dim)
    core attention          s * q                         (QK^T and PV over a causal mask: half of 2 s q)
    MLP                     h * ffn * (3 with SwiGLU, else 2)
    per token, once:        h * V_padded                  (output layer)

An MoE layer's MLP term counts the parameters a token is active in: h x (moe_ffn x topk + shared
expert size) x (3 with SwiGLU, else 2); the router (h x E) is left out, as Megatron does. Megatron up
to core 0.15 counted the core attention over the full square (``causal=False``: twice the term above).

Names of other projects (``megatron_name``, ``hf_layer_map``, ``hf_top_map``): Megatron-LM's legacy
files use these names, with Transformer Engine's norms fused into the next linear layer and a routed
expert numbered within its EP rank; Hugging Face's GPT-2 (Conv1D: transposed), Llama (Q, K, V and
gate, up as separate tensors), Mixtral and Qwen2-MoE classes name them their own way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from megalite.config import ModelConfig

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm"
EXPERTS = "experts.local_experts"  # a routed expert's module: mlp.experts.local_experts.<e> (e global)
SHARED_EXPERTS = "shared_experts"
DENSE_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")

# The ModelConfig fields a model's parameters depend on (meta.json's model_shape, in its order): a
# checkpoint loads into a model only when they agree. Checkpoints older than a field lack it.
SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "query_groups",
    "ffn_size",
    "vocab_size",
    "normalization",
    "swiglu",
    "position_embedding_type",
    "tied_embeddings",
    "add_bias_linear",
    "max_positions",
    "openai_gelu",
)
# recorded (and compared, a missing one read as dense) only when either side is MoE, so a dense
# checkpoint's meta.json stays as it was
MOE_SHAPE_FIELDS = (
    "num_experts",
    "moe_ffn_size",
    "moe_layer_freq",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_router_enable_expert_bias",
)

# How tensor parallelism splits a parameter: output rows (each fused piece apart), input columns, the
# vocabulary rows (padded to a multiple of tp), or not at all.
COLUMN, ROW, VOCAB, REPLICATED = "column", "row", "vocab", "replicated"


class SpecError(ValueError):
    """A model this family (or the external family asked for) cannot describe; one line saying why."""


def layer_prefix(i: int) -> str:
    """The global name prefix of layer ``i``'s parameters."""
    return f"decoder.layers.{i}."


def is_expert(name: str) -> bool:
    """A routed expert's tensor (any prefix): sharded over expert TP and EP, not TP."""
    return f".{EXPERTS}." in "." + name


def expert_of(name: str) -> Optional[int]:
    """The global expert index of a routed expert's tensor (any prefix), else None."""
    if not is_expert(name):
        return None
    return int(("." + name).split(f".{EXPERTS}.", 1)[1].split(".", 1)[0])


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its name (global, or relative to its layer), its full unpadded shape and how tensor
    parallelism splits it. ``pieces``: a column-parallel tensor's fused blocks ([Q; K; V], [gate; up]),
    each split over tp separately. ``expert``: a routed expert's global index (split over expert TP,
    held by one EP rank). ``trainable`` False: the router's expert bias (fp32, moved by its own rule)."""

    name: str
    shape: Tuple[int, ...]
    split: str = REPLICATED
    pieces: Tuple[int, ...] = ()
    expert: Optional[int] = None
    trainable: bool = True

    @property
    def numel(self) -> int:
        """Elements of the full tensor."""
        return math.prod(self.shape)


def split_counts(params: Sequence[ParamSpec]) -> Tuple[int, int]:
    """(elements tensor parallelism splits, elements every rank holds whole) of ``params``; one rank of tp
    holds ``split // tp + whole`` (the planner's count)."""
    split = sum(p.numel for p in params if p.split != REPLICATED)
    return split, sum(p.numel for p in params if p.split == REPLICATED)


def _linear(
    name: str, rows: Tuple[int, ...], cols: int, bias: bool, column: bool, expert: Optional[int] = None
) -> List[ParamSpec]:
    """A Column/RowParallelLinear's weight [sum(rows), cols] (and bias): a row-parallel bias is whole."""
    out = sum(rows)
    kind, pieces = (COLUMN, rows) if column else (ROW, ())
    params = [ParamSpec(f"{name}.weight", (out, cols), kind, pieces, expert)]
    if bias:
        params.append(ParamSpec(f"{name}.bias", (out,), kind if column else REPLICATED, pieces, expert))
    return params


@dataclass(frozen=True)
class AttentionSpec:
    """Self-attention: ``heads`` query heads sharing ``groups`` key/value groups (GQA when fewer),
    RoPE or none (learned positions are added at the embedding)."""

    hidden: int
    heads: int
    groups: int
    head_dim: int
    bias: bool
    rope: bool

    @property
    def qkv_pieces(self) -> Tuple[int, int, int]:
        """Rows of linear_qkv's fused blocks [Q; K; V]."""
        return (self.heads * self.head_dim, self.groups * self.head_dim, self.groups * self.head_dim)

    @property
    def matmul_weights(self) -> int:
        """Weights a token multiplies in linear_qkv and linear_proj (its multiply-adds per token)."""
        q, kv = self.heads * self.head_dim, self.groups * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden

    def params(self, prefix: str = "self_attention") -> List[ParamSpec]:
        """linear_qkv (column, [Q; K; V]) and linear_proj (row), under ``prefix``."""
        return _linear(f"{prefix}.linear_qkv", self.qkv_pieces, self.hidden, self.bias, True) + _linear(
            f"{prefix}.linear_proj", (self.hidden,), self.heads * self.head_dim, self.bias, False
        )


@dataclass(frozen=True)
class MLPSpec:
    """An MLP of hidden size ``ffn``: ``activation`` gelu (exact), gelu_tanh (--openai-gelu) or swiglu
    (gated: linear_fc1 holds [gate; up])."""

    hidden: int
    ffn: int
    activation: str
    bias: bool

    @property
    def gated(self) -> bool:
        """SwiGLU: silu(gate) x up, the two halves of linear_fc1's output."""
        return self.activation == "swiglu"

    @property
    def fc1_pieces(self) -> Tuple[int, ...]:
        """Rows of linear_fc1's fused blocks: [gate; up] with SwiGLU, else one."""
        return (self.ffn, self.ffn) if self.gated else (self.ffn,)

    @property
    def matmul_weights(self) -> int:
        """Weights a token multiplies in linear_fc1 and linear_fc2: h x ffn x (3 with SwiGLU, else 2)."""
        return self.hidden * self.ffn * (3 if self.gated else 2)

    def params(self, prefix: str = "mlp", expert: Optional[int] = None) -> List[ParamSpec]:
        """linear_fc1 (column) and linear_fc2 (row), under ``prefix``."""
        return _linear(f"{prefix}.linear_fc1", self.fc1_pieces, self.hidden, self.bias, True, expert) + _linear(
            f"{prefix}.linear_fc2", (self.hidden,), self.ffn, self.bias, False, expert
        )


@dataclass(frozen=True)
class MoESpec:
    """An MoE block: a router (``score_function`` softmax or sigmoid; ``pre_softmax``: over all experts
    before the top-k) over ``num_experts`` experts (each an ``expert`` MLP), ``topk`` of them per token,
    an optional shared expert every token passes through (its output optionally gated)."""

    hidden: int
    num_experts: int
    topk: int
    expert: MLPSpec
    shared: Optional[MLPSpec]
    shared_gate: bool
    expert_bias: bool
    score_function: str
    pre_softmax: bool

    def router_params(self, prefix: str = "mlp") -> List[ParamSpec]:
        """The router's weight [E, h] and, for aux-loss-free balancing, its fp32 expert bias [E]."""
        out = [ParamSpec(f"{prefix}.router.weight", (self.num_experts, self.hidden))]
        if self.expert_bias:
            out.append(ParamSpec(f"{prefix}.router.expert_bias", (self.num_experts,), trainable=False))
        return out

    def expert_params(self, e: int, prefix: str = "mlp") -> List[ParamSpec]:
        """Routed expert ``e``'s MLP (``e`` global)."""
        return self.expert.params(f"{prefix}.{EXPERTS}.{e}", expert=e)

    def shared_params(self, prefix: str = "mlp") -> List[ParamSpec]:
        """The shared expert's MLP and its gate [1, h] (none without a shared expert)."""
        if self.shared is None:
            return []
        gate = [ParamSpec(f"{prefix}.{SHARED_EXPERTS}.gate_weight", (1, self.hidden))] if self.shared_gate else []
        return self.shared.params(f"{prefix}.{SHARED_EXPERTS}") + gate

    def params(self, prefix: str = "mlp") -> List[ParamSpec]:
        """Router, every routed expert (in expert order), shared expert (its gate last)."""
        experts = [p for e in range(self.num_experts) for p in self.expert_params(e, prefix)]
        return self.router_params(prefix) + experts + self.shared_params(prefix)


@dataclass(frozen=True)
class LayerSpec:
    """One transformer layer: pre-norm attention, then pre-norm MLP or (``moe`` set) an MoE block."""

    index: Optional[int]
    norm: str
    attention: AttentionSpec
    mlp: MLPSpec
    moe: Optional[MoESpec]

    def params(self) -> List[ParamSpec]:
        """The layer's parameters, names relative to ``decoder.layers.N.``, in the order conversions stream them
        (the model's, except that torch lists the shared expert's gate before its linear layers)."""
        norm = ["weight", "bias"] if self.norm == "LayerNorm" else ["weight"]
        h = self.attention.hidden
        out = [ParamSpec(f"input_layernorm.{p}", (h,)) for p in norm] + self.attention.params()
        out += [ParamSpec(f"pre_mlp_layernorm.{p}", (h,)) for p in norm]
        return out + (self.moe.params() if self.moe is not None else self.mlp.params())


@dataclass(frozen=True)
class ModelSpec:
    """The model a ModelConfig describes (build it with :meth:`of`): its layers, parameters and FLOPs."""

    cfg: ModelConfig
    attention: AttentionSpec
    mlp: MLPSpec
    moe: Optional[MoESpec]

    @classmethod
    def of(cls, cfg: ModelConfig) -> "ModelSpec":
        """The spec of ``cfg``'s model (cheap: build one wherever a config is at hand)."""
        h = cfg.hidden_size
        activation = "swiglu" if cfg.swiglu else "gelu_tanh" if cfg.openai_gelu else "gelu"
        attention = AttentionSpec(
            h,
            cfg.num_attention_heads,
            cfg.query_groups,
            cfg.head_dim,
            cfg.add_bias_linear,
            cfg.position_embedding_type == "rope",
        )
        moe = None
        if cfg.is_moe:
            size = cfg.moe_shared_expert_intermediate_size
            moe = MoESpec(
                h,
                cfg.num_experts,
                cfg.moe_router_topk,
                MLPSpec(h, cfg.moe_ffn_size, activation, cfg.add_bias_linear),
                MLPSpec(h, size, activation, cfg.add_bias_linear) if size else None,
                cfg.moe_shared_expert_gate,
                cfg.moe_router_enable_expert_bias,
                cfg.moe_router_score_function,
                cfg.moe_router_pre_softmax,
            )
        return cls(cfg, attention, MLPSpec(h, cfg.ffn_size, activation, cfg.add_bias_linear), moe)

    # -- layers and parameters -----------------------------------------------------------------
    @property
    def norm(self) -> str:
        """LayerNorm or RMSNorm (every norm of the model)."""
        return self.cfg.normalization

    @property
    def learned_positions(self) -> bool:
        """A learned position table at the embedding (else RoPE inside attention)."""
        return self.cfg.position_embedding_type == "learned_absolute"

    def mlp_of_size(self, ffn: int) -> MLPSpec:
        """An MLP of this family at hidden size ``ffn`` (the shared expert's, a test's)."""
        return MLPSpec(self.mlp.hidden, ffn, self.mlp.activation, self.mlp.bias)

    def layer(self, i: Optional[int] = None) -> LayerSpec:
        """Layer ``i`` (global, 0-based); None: a dense layer of this model."""
        moe = self.moe if i is not None and self.cfg.is_moe_layer(i) else None
        return LayerSpec(i, self.norm, self.attention, self.mlp, moe)

    def pre_params(self, padded_vocab: Optional[int] = None) -> List[ParamSpec]:
        """The first stage's embeddings (``padded_vocab``: the table as a run holds it, else the real rows)."""
        h = self.cfg.hidden_size
        out = [ParamSpec(WORD_EMBEDDINGS, (padded_vocab or self.cfg.vocab_size, h), VOCAB)]
        if self.learned_positions:
            out.append(ParamSpec(POSITION_EMBEDDINGS, (self.cfg.max_positions, h)))
        return out

    def post_params(self, padded_vocab: Optional[int] = None) -> List[ParamSpec]:
        """The last stage's final norm and (untied embeddings only) output layer."""
        h = self.cfg.hidden_size
        norm = ["weight", "bias"] if self.norm == "LayerNorm" else ["weight"]
        out = [ParamSpec(f"{FINAL_NORM}.{p}", (h,)) for p in norm]
        if not self.cfg.tied_embeddings:
            out.append(ParamSpec(OUTPUT_LAYER, (padded_vocab or self.cfg.vocab_size, h), VOCAB))
        return out

    def params(self, padded_vocab: Optional[int] = None) -> List[ParamSpec]:
        """Every parameter of the whole model under its global name, in layer order (LayerSpec.params)."""
        layers = [
            replace(p, name=layer_prefix(i) + p.name)
            for i in range(self.cfg.num_layers)
            for p in self.layer(i).params()
        ]
        return self.pre_params(padded_vocab) + layers + self.post_params(padded_vocab)

    def num_params(self, padded_vocab: Optional[int] = None) -> int:
        """Parameters of the whole model (one copy of a tied embedding; the expert bias included)."""
        return sum(p.numel for p in self.params(padded_vocab))

    def num_active_params(self, padded_vocab: Optional[int] = None) -> int:
        """Parameters one token is computed with: an MoE layer's ``topk`` routed experts instead of all."""
        idle = 0
        if self.moe is not None:
            per_expert = sum(p.numel for p in self.moe.expert_params(0))
            idle = self.cfg.num_moe_layers * (self.moe.num_experts - self.moe.topk) * per_expert
        return self.num_params(padded_vocab) - idle

    # -- shapes by name --------------------------------------------------------------------------
    def mlp_of(self, name: str) -> MLPSpec:
        """The MLP tensor ``name`` belongs to: a routed expert's, the shared expert's or the dense one."""
        if is_expert(name):
            return self.moe.expert if self.moe is not None else self.mlp_of_size(self.cfg.moe_ffn_size)
        if f".{SHARED_EXPERTS}." in "." + name:
            return self.mlp_of_size(self.cfg.moe_shared_expert_intermediate_size)
        return self.mlp

    def shape_of(self, name: str) -> Tuple[int, ...]:
        """The full (unsharded, unpadded) shape of ``name`` (global or layer-relative)."""
        cfg, h = self.cfg, self.cfg.hidden_size
        if name in (WORD_EMBEDDINGS, OUTPUT_LAYER):
            return (cfg.vocab_size, h)
        if name == POSITION_EMBEDDINGS:
            return (cfg.max_positions, h)
        if name.endswith(("router.weight", "router.expert_bias")):
            return (cfg.num_experts, h) if name.endswith("weight") else (cfg.num_experts,)
        if name.endswith(f"{SHARED_EXPERTS}.gate_weight"):
            return (1, h)
        module, _, param = name.rpartition(".")
        kind = module.rpartition(".")[2]
        if kind in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"):
            rows, cols = self._linear_shape(kind, name)
            return (rows, cols) if param == "weight" else (rows,)
        return (h,)  # norms

    def _linear_shape(self, kind: str, name: str) -> Tuple[int, int]:
        """[out, in] of the linear layer of ``kind`` that ``name`` belongs to."""
        h, att = self.cfg.hidden_size, self.attention
        if kind == "linear_qkv":
            return sum(att.qkv_pieces), h
        if kind == "linear_proj":
            return h, att.heads * att.head_dim
        mlp = self.mlp_of(name)
        return (sum(mlp.fc1_pieces), h) if kind == "linear_fc1" else (h, mlp.ffn)

    def pieces_of(self, name: str) -> Optional[List[int]]:
        """Row counts of the fused pieces of a column-parallel tensor (each split over tp separately)."""
        if ".linear_qkv." in "." + name:
            return list(self.attention.qkv_pieces)
        if ".linear_fc1." in "." + name:
            return list(self.mlp_of(name).fc1_pieces)
        return None

    # -- FLOPs (Megatron's count, the module docstring) ----------------------------------------
    def mlp_flops_per_token(self) -> float:
        """Forward+backward MLP FLOPs per token over all layers: the dense layers' MLP, and for an MoE layer
        the ``topk`` routed experts plus the shared expert."""
        dense = 6.0 * self.mlp.matmul_weights
        if self.moe is None:
            return self.cfg.num_layers * dense
        n_moe = self.cfg.num_moe_layers
        shared = self.moe.shared.matmul_weights if self.moe.shared is not None else 0
        moe = 6.0 * (self.moe.expert.matmul_weights * self.moe.topk + shared)
        return (self.cfg.num_layers - n_moe) * dense + n_moe * moe

    def layer_flops_per_token(self, causal: bool = True) -> Tuple[float, float, float]:
        """(projections, core attention, MLP) forward+backward FLOPs per token of one layer (an MoE model's
        MLP term: the mean over its layers); ``causal`` False: the core attention over the whole square."""
        proj = 6.0 * self.attention.matmul_weights
        core = 6.0 * self.cfg.seq_length * (self.attention.heads * self.attention.head_dim) * (1.0 if causal else 2.0)
        if self.moe is not None:
            return proj, core, self.mlp_flops_per_token() / self.cfg.num_layers
        return proj, core, 6.0 * self.mlp.matmul_weights

    def flops(self, tokens: int, padded_vocab: int, causal: bool = True) -> float:
        """Model FLOPs of ``tokens`` tokens forward and backward (one iteration: global batch x seq)."""
        proj, core, mlp = self.layer_flops_per_token(causal)
        head = 6.0 * self.cfg.hidden_size * padded_vocab
        if self.moe is not None:  # the layers' MLP terms differ: summed exactly rather than L x their mean
            return tokens * (self.cfg.num_layers * (proj + core) + self.mlp_flops_per_token() + head)
        return tokens * (self.cfg.num_layers * (proj + core + mlp) + head)

    def layer_macs_per_token(self) -> int:
        """A dense layer's forward multiply-adds per token: its matmul weights and the causal core attention
        (s x q): the FLOPs above / 6."""
        return (
            self.attention.matmul_weights
            + self.mlp.matmul_weights
            + self.cfg.seq_length * self.attention.heads * self.attention.head_dim
        )


# -- Megatron-LM's names ------------------------------------------------------------------------------
_TE_NORMS = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)


def megatron_name(rel: str, te: bool, experts_per_rank: int = 0) -> str:
    """Megatron-Core's name of a layer-relative parameter; with ``te`` the norms fused into the next
    linear layer (Transformer Engine's and torch_dist's names; an MoE layer's pre-MLP norm stays its
    own). ``experts_per_rank``: a routed expert's index becomes local to its EP rank."""
    if te:
        for local, fused in _TE_NORMS:
            if rel.startswith(local) and not (experts_per_rank and local == "pre_mlp_layernorm."):
                return fused + rel[len(local) :]
    g = expert_of(rel)
    if g is not None:
        head, tail = rel.split(f".local_experts.{g}.", 1)
        return f"{head}.local_experts.{g % experts_per_rank}.{tail}"
    return rel


# -- Hugging Face's names ------------------------------------------------------------------------------
GPT2, LLAMA = "GPT2LMHeadModel", "LlamaForCausalLM"
MIXTRAL, QWEN2_MOE = "MixtralForCausalLM", "Qwen2MoeForCausalLM"
HF_MOE_ARCHS = (MIXTRAL, QWEN2_MOE)
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_GPT2_LAYER = {
    "input_layernorm": "ln_1",
    "self_attention.linear_qkv": "attn.c_attn",
    "self_attention.linear_proj": "attn.c_proj",
    "pre_mlp_layernorm": "ln_2",
    "mlp.linear_fc1": "mlp.c_fc",
    "mlp.linear_fc2": "mlp.c_proj",
}
_LLAMA_LAYER = {
    "input_layernorm": "input_layernorm",
    "self_attention.linear_proj": "self_attn.o_proj",
    "pre_mlp_layernorm": "post_attention_layernorm",
    "mlp.linear_fc2": "mlp.down_proj",
}


@dataclass(frozen=True)
class NameMap:
    """One megalite tensor (layer-relative or global) and the Hugging Face tensors that hold it: one
    (``transpose``: GPT-2's Conv1D stores the transpose), or several whose rows, ``rows`` each, it
    concatenates (Llama's q/k/v_proj, gate/up_proj)."""

    ours: str
    theirs: Tuple[str, ...]
    rows: Tuple[int, ...] = ()
    transpose: bool = False


def hf_architecture(spec: ModelSpec) -> str:
    """The Hugging Face class that holds this model exactly; a SpecError line saying why none can."""
    if spec.moe is not None:
        return _hf_moe_architecture(spec)
    att = spec.attention
    if (
        spec.norm == "LayerNorm"
        and not spec.mlp.gated
        and spec.learned_positions
        and att.bias
        and att.groups == att.heads
    ):
        return GPT2
    if spec.norm == "RMSNorm" and spec.mlp.gated and att.rope:
        return LLAMA
    raise SpecError(
        f"this model ({spec.norm}, {'SwiGLU' if spec.mlp.gated else 'GELU'}, {spec.cfg.position_embedding_type} "
        f"positions, biases {'on' if att.bias else 'off'}, {att.groups} query groups) is neither "
        f"GPT-2 style (LayerNorm, GELU, learned positions, biases, no GQA) nor Llama style (RMSNorm, SwiGLU, RoPE)"
    )


def _hf_moe_architecture(spec: ModelSpec) -> str:
    """Mixtral (no shared expert, every layer MoE) or Qwen2-MoE (a gated shared expert); else SpecError."""
    moe, common = spec.moe, []
    if moe.score_function != "softmax":
        common.append(f"a {moe.score_function} router")
    if moe.expert_bias:
        common.append("an expert bias (--moe-router-enable-expert-bias)")
    if spec.attention.bias:
        common.append("linear biases")
    if not (spec.norm == "RMSNorm" and spec.mlp.gated and spec.attention.rope):
        common.append("not Llama-style layers (RMSNorm, SwiGLU, RoPE)")
    if moe.shared is not None:
        if not moe.shared_gate:
            common.append("a shared expert without --moe-shared-expert-gate (Qwen2-MoE's is always gated)")
        if not common:
            return QWEN2_MOE
    else:
        if moe.pre_softmax:
            common.append("--moe-router-pre-softmax without a shared expert (Mixtral renormalises the top-k)")
        if not all(spec.cfg.is_moe_layer(i) for i in range(spec.cfg.num_layers)):
            common.append("dense layers without a shared expert (every Mixtral layer is MoE)")
        if not common:
            return MIXTRAL
    raise SpecError(
        f"this mixture-of-experts model has {', '.join(common)}, which neither {MIXTRAL} nor "
        f"{QWEN2_MOE} (gated shared expert) can hold"
    )


def hf_top_map(spec: ModelSpec, arch: str) -> Dict[str, str]:
    """megalite's embedding, final norm and output names -> the HF class's (every one the model may have)."""
    if arch == GPT2:
        m = {
            WORD_EMBEDDINGS: "transformer.wte.weight",
            POSITION_EMBEDDINGS: "transformer.wpe.weight",
            f"{FINAL_NORM}.weight": "transformer.ln_f.weight",
            f"{FINAL_NORM}.bias": "transformer.ln_f.bias",
        }
    else:
        m = {WORD_EMBEDDINGS: "model.embed_tokens.weight", f"{FINAL_NORM}.weight": "model.norm.weight"}
    m[OUTPUT_LAYER] = "lm_head.weight"
    return m


def hf_layer_map(spec: ModelSpec, arch: str, i: int) -> List[NameMap]:
    """Layer ``i``'s tensors (layer-relative names) and the HF class's, in the order its files list them."""
    layer = spec.layer(i)
    names = [p.name for p in layer.params()]
    if arch == GPT2:
        return [
            NameMap(n, (t,), transpose=t.endswith(_CONV1D))
            for n, t in _renamed(names, f"transformer.h.{i}.", _GPT2_LAYER)
        ]
    p = f"model.layers.{i}."
    out = [NameMap(n, (t,)) for n, t in _renamed(names, p, _LLAMA_LAYER)]
    for param in ("weight", "bias") if spec.attention.bias else ("weight",):
        out.append(
            NameMap(
                f"self_attention.linear_qkv.{param}",
                tuple(f"{p}self_attn.{n}.{param}" for n in ("q_proj", "k_proj", "v_proj")),
                spec.attention.qkv_pieces,
            )
        )
        if layer.moe is None:
            out.append(
                NameMap(
                    f"mlp.linear_fc1.{param}",
                    (f"{p}mlp.gate_proj.{param}", f"{p}mlp.up_proj.{param}"),
                    spec.mlp.fc1_pieces,
                )
            )
    return out + (_hf_moe_map(layer.moe, arch, i) if layer.moe is not None else [])


def _renamed(names: List[str], prefix: str, modules: Dict[str, str]) -> List[Tuple[str, str]]:
    """(ours, theirs) for the tensors of ``names`` whose module ``modules`` renames one to one."""
    out = []
    for n in names:
        module, _, param = n.rpartition(".")
        if module in modules:
            out.append((n, prefix + modules[module] + "." + param))
    return out


def hf_moe_block(arch: str, i: int) -> str:
    """The HF prefix of MoE layer ``i``'s router and experts."""
    return f"model.layers.{i}." + ("block_sparse_moe." if arch == MIXTRAL else "mlp.")


def hf_expert_projections(arch: str) -> Tuple[str, str, str]:
    """The HF names of a routed expert's gate, up and down projections."""
    return ("w1", "w3", "w2") if arch == MIXTRAL else ("gate_proj", "up_proj", "down_proj")


def _hf_moe_map(moe: MoESpec, arch: str, i: int) -> List[NameMap]:
    """An MoE layer's router, experts (per expert: fc1 = [gate; up], fc2 = down) and Qwen2-MoE's shared
    expert with its gate; HF's MoE classes have no linear biases."""
    b = hf_moe_block(arch, i)
    gate, up, down = hf_expert_projections(arch)
    out = [NameMap("mlp.router.weight", (f"{b}gate.weight",))]
    for e in range(moe.num_experts):
        x, theirs = f"mlp.{EXPERTS}.{e}.", f"{b}experts.{e}."
        out += [
            NameMap(x + "linear_fc1.weight", (f"{theirs}{gate}.weight", f"{theirs}{up}.weight"), moe.expert.fc1_pieces),
            NameMap(x + "linear_fc2.weight", (f"{theirs}{down}.weight",)),
        ]
    if arch == QWEN2_MOE:
        s, x = f"{b}shared_expert.", f"mlp.{SHARED_EXPERTS}."
        out += [
            NameMap(x + "linear_fc1.weight", (s + "gate_proj.weight", s + "up_proj.weight"), moe.shared.fc1_pieces),
            NameMap(x + "linear_fc2.weight", (s + "down_proj.weight",)),
            NameMap(x + "gate_weight", (f"{b}shared_expert_gate.weight",)),
        ]
    return out
