"""A GPT model chunk: some consecutive layers, plus embedding and/or head.

The model knows nothing of pipelining (README, Architecture: design rules). A chunk is told
which global layers it holds and whether it is the first (``pre_process``:
embeddings) and/or last (``post_process``: final norm + output layer) stage.
The single-process model is simply the chunk with every layer, pre and post::

    tokens [b,s] -> word emb (vocab-parallel) + pos emb -> [s,b,h]
                 -> layers[i] for i in this chunk's range
                 -> final norm -> output layer (column-parallel) -> logits [s,b,V/tp]

Under sequence parallelism (tp > 1) the embedding output is reduce-scattered
to sequence shards [s/tp, b, h] and the output layer all-gathers them back;
every replicated parameter (norms, row-parallel biases, position embeddings)
then sees only its shard's positions, so it is marked ``sequence_parallel``
and its gradient is summed over the TP group by the optimizer layer.

Parameter names use global layer numbers (``decoder.layers.7...``) so that a
state dict means the same thing for every pipeline layout.

For generation, ``forward(tokens, kv_cache)`` runs only the new tokens: their
positions (learned or RoPE) start at ``kv_cache.seq_len``, and every attention
layer attends over the cached keys and values (kv_cache.py).

Under context parallelism (cp > 1) a chunk holds s/cp tokens of each sequence, chunks r and
2CP-1-r (context_parallel/sequence.py); their positions are their global indices, and attention
runs over the whole sequence through the CP group. Packed documents give each token its
``position_ids`` (restarting per document) and ``segment_ids`` (attention stays within a
document); every stage receives them, since RoPE and attention act in every layer::

    tokens [b, s/cp] -> emb + pos(position_ids or global index) -> [s/cp, b, h] (SP: [s/cp/tp, b, h])
                     -> layers (RoPE by position, attention over the CP group) -> logits [s/cp, b, V/tp]
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.context_parallel.sequence import cp_token_index
from megalite.model.compile import cannot_compile, compile_layer
from megalite.model.kv_cache import KVCache
from megalite.model.spec import OUTPUT_LAYER, POSITION_EMBEDDINGS, WORD_EMBEDDINGS, ModelSpec, layer_prefix
from megalite.model.transformer import TransformerLayer, build_norm, dropout, rotary_cos_sin
from megalite.moe import MoELayer
from megalite.moe.router import Router
from megalite.parallel.state import AxisGroup, ParallelState
from megalite.tensor_parallel.comms import reduce_scatter_to_sequence_parallel_region
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.tensor_parallel.fp8 import fp8_recipe_of
from megalite.tensor_parallel.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    enable_fp8,
    init_vocab_rows,
    linear_with_tp_weight,
    per_expert_names,
    set_tp_attributes,
    vocab_range,
    vocab_shard,
)
from megalite.tensor_parallel.random import RNGTracker, checkpoint, full_normal


class GPTModel(nn.Module):
    """One pipeline chunk of a GPT (or the whole model when it holds every layer)."""

    def __init__(
        self,
        cfg: ModelConfig,
        ps: ParallelState,
        tracker: RNGTracker,
        seed: int,
        layers: Optional[Iterable[int]] = None,
        pre_process: bool = True,
        post_process: bool = True,
        sequence_parallel: bool = False,
        cp_comm_type: str = "p2p",
        moe_dispatcher: str = "allgather",
    ):
        super().__init__()
        self.cfg, self.tp, self.tracker = cfg, ps.tp, tracker
        self.cp: AxisGroup = ps.cp
        self.sequence_parallel = sequence_parallel and ps.tp_size > 1
        self.pre_process, self.post_process = pre_process, post_process
        self.padded_vocab = cfg.padded_vocab_size(ps.tp_size)
        self.vocab_start, _ = vocab_range(self.padded_vocab, ps.tp)
        layer_ids = list(range(cfg.num_layers) if layers is None else layers)
        spec = ModelSpec.of(cfg)  # what each layer holds (model/spec.py)

        self._build_embedding(ps, spec, seed)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleDict(
            {str(i): self._build_layer(ps, spec, seed, i, cp_comm_type, moe_dispatcher) for i in layer_ids}
        )
        self.output_weight = None
        self.split_wgrad = None  # the output GEMM's weight gradient may wait for W (enable_weight_grad_split)
        self._tied_to: list = []  # [VocabParallelEmbedding of another local chunk] (tie_output_to)
        self._output_is_local = False  # this chunk's embedding also serves a local last stage
        if post_process:
            self._build_output(ps, seed)
        self._finish(ps.device)

    def _build_embedding(self, ps: ParallelState, spec: ModelSpec, seed: int) -> None:
        """The first stage's word (and learned position) embeddings."""
        if not self.pre_process:
            return
        cfg, h, std = self.cfg, self.cfg.hidden_size, self.cfg.init_method_std
        self.embedding = nn.Module()
        self.embedding.word_embeddings = VocabParallelEmbedding(
            cfg.vocab_size, self.padded_vocab, h, ps.tp, init_std=std, seed=seed
        )
        if spec.learned_positions:
            pos = nn.Embedding(cfg.max_positions, h)
            pos.weight.data.copy_(full_normal((cfg.max_positions, h), std, seed, POSITION_EMBEDDINGS))
            set_tp_attributes(pos.weight, False)
            self.embedding.position_embeddings = pos

    def _build_layer(
        self, ps: ParallelState, spec: ModelSpec, seed: int, i: int, cp_comm_type: str, moe_dispatcher: str
    ) -> TransformerLayer:
        """Global layer ``i``, with an MoE block in place of its MLP where the spec says so."""
        cfg, sp, tracker = self.cfg, self.sequence_parallel, self.tracker
        moe = None
        if spec.layer(i).moe is not None:
            moe = MoELayer(cfg, ps, seed, layer_prefix(i) + "mlp", sp, moe_dispatcher, i, tracker=tracker)
        layer = TransformerLayer(cfg, ps.tp, tracker, seed, i, sp, ps.device, self.cp, cp_comm_type, mlp=moe)
        if cfg.fp8_layer(i):  # the embedding and output layer stay bf16, as Megatron's
            enable_fp8(layer, fp8_recipe_of(cfg))
        return layer

    def _build_output(self, ps: ParallelState, seed: int) -> None:
        """The last stage's final norm and output layer (or its copy of the tied word embedding)."""
        cfg, h, std = self.cfg, self.cfg.hidden_size, self.cfg.init_method_std
        self.decoder.final_layernorm = build_norm(cfg, h, ps.device)
        if not cfg.tied_embeddings:
            self.output_layer = ColumnParallelLinear(
                h,
                self.padded_vocab,
                ps.tp,
                bias=False,
                init_std=std,
                seed=seed,
                name="output_layer",
                sequence_parallel=self.sequence_parallel,
            )
            self.output_layer.weight.data.copy_(
                init_vocab_rows(cfg.vocab_size, self.padded_vocab, h, ps.tp, std, seed, OUTPUT_LAYER)
            )
        elif not self.pre_process:
            # Last stage's copy of the tied word embedding: same initial values as the
            # first stage's (same seed and name); gradients are summed over the
            # embedding group every step so the copies stay equal.
            self.output_weight = nn.Parameter(
                init_vocab_rows(cfg.vocab_size, self.padded_vocab, h, ps.tp, std, seed, WORD_EMBEDDINGS)
            )
            set_tp_attributes(self.output_weight, True, 0)
            self.output_weight.shared = True

    def _finish(self, device: torch.device) -> None:
        """Sequence-parallel tags, the parameter dtype, fp32 routers, compiled layers."""
        for p in self.parameters():  # an expert's weights see whole tokens of their own group, never SP shards
            p.sequence_parallel = (
                self.sequence_parallel and not p.tensor_parallel and not getattr(p, "expert_parallel", False)
            )
        self.to(dtype=self.cfg.torch_dtype)
        for m in self.modules():
            if isinstance(m, Router):
                m.keep_fp32()
        self.compile_skipped = cannot_compile(device) if self.cfg.torch_compile else None  # why not (the log says)
        if self.cfg.torch_compile and not self.compile_skipped:
            for layer in self.decoder.layers.values():  # regional: each layer on its own (model/compile.py)
                compile_layer(layer)

    def shared_embedding_weight(self) -> Optional[nn.Parameter]:
        """The parameter that must stay equal across the embedding group (tied, pp > 1)."""
        if not self.cfg.tied_embeddings:
            return None
        if self.output_weight is not None:
            return self.output_weight
        if self.pre_process and not self.post_process and not self._output_is_local:
            return self.embedding.word_embeddings.weight
        return None

    def tie_output_to(self, first: "GPTModel") -> None:
        """Use ``first``'s word embedding itself as this last stage's output weight.

        For a stage layout that puts the first and last stage on one rank (the V of
        ZB-V): one parameter, whose gradient autograd accumulates from both uses, instead
        of a copy kept equal by an all-reduce over the embedding group.
        """
        if not (self.cfg.tied_embeddings and self.post_process and first.pre_process):
            raise ValueError("tie_output_to needs tied embeddings, a last stage and a first stage")
        del self.output_weight  # the copy: no longer a parameter of this chunk
        self.output_weight = None
        self._tied_to = [first.embedding.word_embeddings]  # a list: not registered as a submodule
        first._output_is_local = True

    def local_from_full(self, full: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """This chunk's local tensors from a full (unsharded) state dict of the whole model.

        Vocabulary tables may carry any amount of padding: only the first
        ``vocab_size`` rows are used and re-padded for this TP size.
        """
        out = {}
        for name, p in self.named_parameters():
            experts = per_expert_names(name, p)
            if experts:  # a grouped expert parameter: from each local expert's full tensor
                module_name, _, pname = name.rpartition(".")
                out[name] = self.get_submodule(module_name).local_from_full(pname, [full[e] for e in experts])
                continue
            src = full[WORD_EMBEDDINGS if name == "output_weight" else name]
            if name in (WORD_EMBEDDINGS, "output_weight", OUTPUT_LAYER):
                out[name] = vocab_shard(src[: self.cfg.vocab_size], self.padded_vocab, self.tp)
                continue
            module_name, _, pname = name.rpartition(".")
            module = self.get_submodule(module_name)
            out[name] = module.local_from_full(pname, src) if hasattr(module, "local_from_full") else src
        return out

    def embed(self, tokens: torch.Tensor, offset: int = 0, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens [b, s] at positions offset.. (or ``positions`` [s] / [b, s]) -> hidden [s, b, h]
        (or the shard [s/tp, b, h] under SP)."""
        sp = self.sequence_parallel
        x = self.embedding.word_embeddings(tokens, reduce=not sp).transpose(0, 1).contiguous()
        s = tokens.shape[1]
        if positions is None:
            positions = torch.arange(offset, offset + s, device=tokens.device)
        if sp:  # each rank keeps its slice of the (summed) sequence
            x = reduce_scatter_to_sequence_parallel_region(x, self.tp)
            positions = positions.chunk(self.tp.size, dim=-1)[self.tp.rank]
        if self.cfg.position_embedding_type == "learned_absolute":
            pos = self.embedding.position_embeddings(positions)  # [s, h] or [b, s, h]
            x = x + (pos[:, None] if positions.dim() == 1 else pos.transpose(0, 1))
        if sp and self.cfg.hidden_dropout > 0 and self.training:  # each TP rank's own mask
            with self.tracker.fork("tp"):
                return dropout(x, self.cfg.hidden_dropout, self.training)
        return dropout(x, self.cfg.hidden_dropout, self.training)

    def _run_layers(self, x: torch.Tensor, rope, span=None) -> torch.Tensor:
        """The chunk's layers, with full recomputation as --recompute-method asks."""
        cfg, layers = self.cfg, list(self.decoder.layers.values())
        if cfg.recompute_granularity != "full":
            for layer in layers:
                x = layer(x, rope, span=span)
            return x
        n = cfg.recompute_num_layers
        if cfg.recompute_method == "uniform":  # checkpoint the input of every group of n layers
            for i in range(0, len(layers), n):
                group = layers[i : i + n]
                x = checkpoint(lambda h, g=group: _run_all(g, h, rope, span), self.tracker, x)
            return x
        for i, layer in enumerate(layers):  # block: the first n layers of the chunk
            x = (
                checkpoint(lambda h, m=layer: m(h, rope, span=span), self.tracker, x)
                if i < n
                else layer(x, rope, span=span)
            )
        return x

    def _sequence(self, x: torch.Tensor, position_ids, segment_ids):
        """(positions, span) of this chunk's tokens: positions [s] / [b, s] for embeddings and RoPE
        (None: 0..s-1), span (q_index, segment_ids) for the CP / document attention (None: plain causal)."""
        if self.cp.size == 1 and position_ids is None and segment_ids is None:
            return None, None
        s = x.shape[1] if self.pre_process else x.shape[0] * (self.tp.size if self.sequence_parallel else 1)
        index = cp_token_index(s * self.cp.size, self.cp.size, self.cp.rank, x.device)
        positions = position_ids if position_ids is not None else (index if self.cp.size > 1 else None)
        span = (index, segment_ids) if self.cp.size > 1 or segment_ids is not None else None
        return positions, span

    def forward(
        self,
        x: torch.Tensor,
        kv_cache: Optional[KVCache] = None,
        position_ids: Optional[torch.Tensor] = None,
        segment_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Run the chunk: tokens [b,s] (first stage) or hidden [s,b,h] in; hidden or logits out.

        With ``kv_cache`` (inference) the input is the tokens after the cached ones. ``position_ids``
        [b, s] and ``segment_ids`` [b, s*cp] are a packed micro-batch's (context_parallel/sequence.py).
        """
        offset = kv_cache.seq_len if kv_cache is not None else 0
        positions, span = self._sequence(x, position_ids, segment_ids)
        if self.pre_process:
            x = self.embed(x, offset, positions)
        rope = None
        if self.cfg.position_embedding_type == "rope":
            s = x.shape[0] * (self.tp.size if self.sequence_parallel else 1)  # RoPE acts on the full sequence
            rope = self._rope(s, offset, positions, x.device)
        if kv_cache is None:
            x = self._run_layers(x, rope, span)
        else:  # no recomputation in inference; each layer appends its keys and values
            for layer in self.decoder.layers.values():
                x = layer(x, rope, kv_cache)
            kv_cache.advance(x.shape[0])
        if not self.post_process:
            return x
        x = self.decoder.final_layernorm(x)
        if not self.cfg.tied_embeddings:
            return self.output_layer(x)  # [s, b, V/tp]
        if self.output_weight is not None:
            weight = self.output_weight
        else:
            weight = (self._tied_to[0] if self._tied_to else self.embedding.word_embeddings).weight
        # The chunk's own embedding also gets a gradient in B: deferring only this half would
        # accumulate it twice per micro-batch, which the overlapped DP reduction counts on not happening.
        return linear_with_tp_weight(
            x,
            weight,
            self.tp,
            sequence_parallel=self.sequence_parallel,
            split_wgrad=None if self.pre_process else self.split_wgrad,
        )

    def _rope(self, s: int, offset: int, positions: Optional[torch.Tensor], device):
        """cos/sin for this chunk's s tokens: [s, 1, 1, d] by position (offset.. or ``positions`` [s]),
        or [s, b, 1, d] for per-row ``positions`` [b, s]."""
        cfg = self.cfg
        if positions is None:
            cos, sin = rotary_cos_sin(offset + s, cfg.head_dim, cfg.rotary_base, device)
            return cos[offset:], sin[offset:]
        cos, sin = rotary_cos_sin(s * self.cp.size, cfg.head_dim, cfg.rotary_base, device)  # every position < s
        if positions.dim() == 1:
            return cos[positions], sin[positions]
        return tuple(t[:, 0, 0][positions].transpose(0, 1)[:, :, None] for t in (cos, sin))

    def loss(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        num_tokens: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Mean cross entropy over unmasked tokens; logits [s,b,V/tp], labels/mask [b,s].

        Under CP (``num_tokens``: the whole sequence's unmasked count) this rank's sum over its
        s/cp tokens / num_tokens x cp: averaged over the CP group it is the whole sequence's mean.
        """
        per_token = vocab_parallel_cross_entropy(
            logits, labels.t(), self.tp, self.vocab_start, self.cfg.vocab_size
        )  # [s, b]
        mask = loss_mask.t().float()
        if num_tokens is None:
            return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
        return (per_token * mask).sum() / num_tokens.clamp(min=1.0) * self.cp.size


def _run_all(layers, x: torch.Tensor, rope, span=None) -> torch.Tensor:
    for layer in layers:
        x = layer(x, rope, span=span)
    return x
