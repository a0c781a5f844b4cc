"""The common currency of checkpoint conversion: a model as a stream of full tensors.

Every loader (megalite, Megatron-LM, Hugging Face) turns its files into the
same stream, and every saver shards that stream into its own files::

    source.pre()      embedding.word_embeddings.weight [vocab, h]   (real rows only, no padding)
                      embedding.position_embeddings.weight [p, h]   (learned positions only)
    source.layer(i)   input_layernorm.*, self_attention.linear_qkv.* [(nq + 2 nkv) d, h] as [Q; K; V],
                      self_attention.linear_proj.*, pre_mlp_layernorm.*,
                      mlp.linear_fc1.* ([gate; up] for SwiGLU), mlp.linear_fc2.*
                      an MoE layer instead: mlp.router.weight [E, h] (+ router.expert_bias [E], fp32),
                      mlp.experts.local_experts.<e>.linear_fc{1,2}.* (e global; expert ffn),
                      mlp.shared_experts.linear_fc{1,2}.* (+ shared_experts.gate_weight [1, h])
    source.post()     decoder.final_layernorm.*, output_layer.weight [vocab, h] (untied only)

Names and layouts are megalite's full (tp = 1) ones (the model's spec, model/spec.py, describes
them), so a megalite -> megalite conversion is a pure reshard; a saver holds about one layer at a time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megalite.checkpointing.safe_load import CheckpointError
from megalite.config import ModelConfig
from megalite.model.spec import OUTPUT_LAYER, POSITION_EMBEDDINGS, WORD_EMBEDDINGS, ModelSpec, layer_prefix
from megalite.model.spec import expert_of as expert_of  # re-exported: the loaders' and savers' name
from megalite.pipeline.partition import validate_partition
from megalite.pipeline.stage_layout import StageLayout

WORD, POSITIONS, OUTPUT = WORD_EMBEDDINGS, POSITION_EMBEDDINGS, OUTPUT_LAYER


def layer_names(cfg: ModelConfig, i: Optional[int] = None) -> List[str]:
    """Names (relative to ``decoder.layers.N.``) of layer ``i``'s tensors (``i`` None: a dense layer's)."""
    return [p.name for p in ModelSpec.of(cfg).layer(i).params()]


def pre_names(cfg: ModelConfig) -> List[str]:
    return [p.name for p in ModelSpec.of(cfg).pre_params()]


def post_names(cfg: ModelConfig) -> List[str]:
    return [p.name for p in ModelSpec.of(cfg).post_params()]


def full_shape(cfg: ModelConfig, name: str) -> Tuple[int, ...]:
    """The full (unsharded, unpadded) shape of tensor ``name`` (global or layer-relative)."""
    return ModelSpec.of(cfg).shape_of(name)


def column_pieces(cfg: ModelConfig, name: str) -> Optional[List[int]]:
    """Row counts of the fused pieces of a column-parallel tensor (each split over tp separately)."""
    return ModelSpec.of(cfg).pieces_of(name)


def is_row_parallel(name: str) -> bool:
    return name.endswith(("linear_proj.weight", "linear_fc2.weight"))


def is_vocab(name: str) -> bool:
    return name in (WORD, OUTPUT)


def split_tp(cfg: ModelConfig, name: str, full: torch.Tensor, tp: int) -> List[torch.Tensor]:
    """megalite's tp shards of a full tensor: what rank r's state dict holds (vocab padded for tp)."""
    if is_vocab(name):
        padded = cfg.padded_vocab_size(tp)
        table = torch.zeros(padded, full.shape[1], dtype=full.dtype)
        table[: full.shape[0]] = full
        return list(table.chunk(tp, dim=0))
    pieces = column_pieces(cfg, name)
    if pieces is not None:
        parts = [p.chunk(tp, dim=0) for p in full.split(pieces, dim=0)]
        return [torch.cat([p[r] for p in parts], dim=0) for r in range(tp)]
    if is_row_parallel(name):
        return list(full.chunk(tp, dim=1))
    return [full] * tp


def merge_tp(cfg: ModelConfig, name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The inverse of :func:`split_tp`: the full tensor from every tp rank's shard (padding dropped)."""
    tp = len(shards)
    if is_vocab(name):
        return torch.cat(list(shards), dim=0)[: cfg.vocab_size]
    pieces = column_pieces(cfg, name)
    if pieces is not None:
        local = [p // tp for p in pieces]
        split = [s.split(local, dim=0) for s in shards]
        return torch.cat([torch.cat([sp[j] for sp in split], dim=0) for j in range(len(pieces))], dim=0)
    if is_row_parallel(name):
        return torch.cat(list(shards), dim=1)
    return shards[0]


@dataclass(frozen=True)
class Layout:
    """A target (or source) parallel layout: tp, pp, virtual stages and an uneven first/last stage."""

    tp: int = 1
    pp: int = 1
    vp: int = 1
    first: Optional[int] = None
    last: Optional[int] = None
    stage_layers: Optional[Tuple[int, ...]] = None  # a general split (--pipeline-stage-layers)
    ep: int = 1  # expert parallel: the torch formats write one file per (tp, pp, ep) rank
    etp: Optional[int] = None  # expert tensor parallel (None: tp)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def files(self) -> int:
        """Files per pipeline rank in the per-rank formats: tp x ep, indexed tp rank + tp x ep rank."""
        return self.tp * self.ep

    def stages(self, num_layers: int) -> List[Tuple[int, int, range]]:
        """(pp_rank, chunk, global layers) of every chunk, in the order the layers run."""
        out = [
            (r, c, StageLayout(self.pp, self.vp).layers(num_layers, r, c, self.first, self.last, self.stage_layers))
            for c in range(self.vp)
            for r in range(self.pp)
        ]
        return out

    def stage_of_layer(self, num_layers: int) -> Dict[int, Tuple[int, int, int]]:
        """layer -> (pp_rank, chunk, index inside the chunk)."""
        return {layer: (r, c, j) for r, c, rng in self.stages(num_layers) for j, layer in enumerate(rng)}


def check_fits(cfg: ModelConfig, layout: Layout) -> None:
    """One line when the model cannot be split as ``layout`` asks (nothing written yet)."""
    tp, etp = layout.tp, layout.expert_tp
    problems = []
    if cfg.num_attention_heads % tp:
        problems.append(f"{cfg.num_attention_heads} attention heads")
    if cfg.query_groups % tp:
        problems.append(f"{cfg.query_groups} query groups")
    if cfg.ffn_size % tp and not all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        problems.append(f"ffn hidden size {cfg.ffn_size}")
    if cfg.is_moe and (cfg.moe_shared_expert_intermediate_size or 0) % tp:
        problems.append(f"shared expert size {cfg.moe_shared_expert_intermediate_size}")
    if problems:
        raise CheckpointError(
            f"target tensor-parallel size {tp} does not divide the model's "
            f"{' and '.join(problems)}; choose a tp that divides them"
        )
    if (layout.ep > 1 or layout.etp is not None) and not cfg.is_moe:
        raise CheckpointError(
            "--target-expert-parallel-size / --target-expert-tensor-parallel-size need a "
            "mixture-of-experts model; this one is dense"
        )
    if cfg.is_moe and (cfg.num_experts % layout.ep or cfg.moe_ffn_size % etp):
        raise CheckpointError(
            f"target expert-parallel size {layout.ep} x expert tensor-parallel size {etp} does "
            f"not fit the model's {cfg.num_experts} experts of ffn {cfg.moe_ffn_size} (ep must "
            f"divide the experts, etp the expert ffn)"
        )
    try:
        validate_partition(cfg.num_layers, layout.pp, layout.vp, layout.first, layout.last, layout.stage_layers)
    except ValueError as e:
        raise CheckpointError(f"target pipeline layout does not fit the model: {e}") from None


def model_config_from_dict(d: dict) -> ModelConfig:
    """A ModelConfig from a saved dict, ignoring fields this version does not know."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    # JSON holds tuples (moe_layer_freq's pattern, ...) as lists
    return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in known})


@dataclass
class SourceInfo:
    """What travels with the weights: counters, tokenizer, the source's own description."""

    iteration: int = 0
    tokenizer: Dict[str, Optional[str]] = field(default_factory=dict)  # DataConfig tokenizer fields
    tokenizer_files: List[str] = field(default_factory=list)  # files to copy next to an HF export
    kind: str = ""


class ModelSource:
    """A loaded checkpoint read lazily: ``pre``, ``layer(i)`` and ``post`` return full tensors."""

    cfg: ModelConfig
    info: SourceInfo

    def pre(self) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def layer(self, i: int) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def post(self) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        """Drop whatever the source keeps open (memory maps, cached stage files)."""


def check_tensors(cfg: ModelConfig, tensors: Dict[str, torch.Tensor], names: Sequence[str], where: str) -> None:
    """Every expected tensor present with its full shape; one line naming the first that is not."""
    for n in names:
        if n not in tensors:
            raise CheckpointError(f"{where} has no tensor {n!r}: it does not hold the model its config describes")
        if tuple(tensors[n].shape) != full_shape(cfg, n):
            raise CheckpointError(
                f"{where}: {n} has shape {tuple(tensors[n].shape)}, the config implies {full_shape(cfg, n)}"
            )


TIED_COPY = "output_weight"  # megalite's name for the last stage's copy of a tied embedding
Sharder = Callable[[Dict[str, torch.Tensor], Optional[int]], List[Dict[str, torch.Tensor]]]


def stream_to_ranks(
    source: ModelSource,
    layout: Layout,
    sharder: Sharder,
    write: Callable[[int, List[Dict[int, Dict[str, torch.Tensor]]]], None],
    progress: Callable[[str], None],
) -> None:
    """Read ``source`` in layer order and hand each pipeline rank's shards to ``write`` once complete.

    ``sharder(full tensors, index of the layer inside its chunk or None)`` returns every file's
    entries (``layout.files``: tp rank + tp x ep rank); ``write(pp_rank, [per file: {chunk: {name:
    tensor}}])`` is called
    when the rank's last chunk is filled, so only unfinished ranks are held in memory.
    A tied embedding is handed to the last stage again as ``TIED_COPY`` when it is not the first.
    """
    cfg = source.cfg
    stages = layout.stages(cfg.num_layers)
    pending: Dict[int, List[Dict[int, Dict[str, torch.Tensor]]]] = {}
    word: Optional[torch.Tensor] = None
    for s, (r, c, layers) in enumerate(stages):
        chunk = [f.setdefault(c, {}) for f in pending.setdefault(r, [{} for _ in range(layout.files)])]

        def add(parts: List[Dict[str, torch.Tensor]]) -> None:
            for rank, part in enumerate(parts):
                chunk[rank].update(part)

        if s == 0:
            pre = source.pre()
            word = pre[WORD] if cfg.tied_embeddings and len(stages) > 1 else None
            add(sharder(pre, None))
            progress("embeddings")
        for j, i in enumerate(layers):
            add(sharder({layer_prefix(i) + n: t for n, t in source.layer(i).items()}, j))
            progress(f"layer {i}")
        if s == len(stages) - 1:
            post = source.post()
            if word is not None:
                post[TIED_COPY] = word
            add(sharder(post, None))
            progress("final norm and head")
        if c == layout.vp - 1:
            write(r, pending.pop(r))
