"""Megatron-LM legacy (``torch`` format) checkpoints as a conversion source and target.

Megatron-LM writes ``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt``, each a
dict with ``args`` (an ``argparse.Namespace`` of the run's flags), the model
(``model``, or ``model0``, ``model1``.. with virtual stages; layer numbers are
local to each chunk), optimizer and ``rng_state`` (numpy states included).
Megatron-Core's tensors differ from megalite's full ones in two places::

    linear_qkv rows   megalite [Q (all heads); K; V]
                      Megatron for each query group g: [q heads of g; k_g; v_g]
                      (tp rank r holds groups r*G/tp .. contiguously)
    norms             local spec: input_layernorm / pre_mlp_layernorm;
                      transformer_engine spec: linear_qkv.layer_norm_* / linear_fc1.layer_norm_*

SwiGLU's ``linear_fc1`` is [gate_r; up_r] on each tp rank, exactly as megalite.

Mixtures of experts (``--num-experts``, SequentialMLP, expert TP = TP): with ep > 1 the directories
are ``mp_rank_TT[_PPP]_EEE`` and each holds its EP rank's experts under their *local* index
(``mlp.experts.local_experts.<e mod E/ep>.*``; TEGroupedMLP's ``mlp.experts.linear_fc1.weight<e>``
is read too); ``mlp.router.expert_bias`` is a (persistent) buffer; ``router.local_tokens_per_expert``, run state
that older megatron-core versions saved, is not read. Under the transformer_engine spec an MoE layer keeps its own
``pre_mlp_layernorm`` (only the dense MLP fuses it into ``linear_fc1``).
Files are read with ``weights_only`` plus the allow-list of ``safe_load.py``
(Namespace, signal enums, numpy arrays and dtypes, inert stand-ins for
Megatron's own enums); nothing in them runs. Optimizer and RNG state are not converted (as Megatron's
own converter): load the result with ``--finetune`` or ``--no-load-optim --no-load-rng``.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megalite.checkpointing.safe_load import CheckpointError, MegatronValue, load_megatron_file
from megalite.checkpointing.torch_format import legacy_dir  # Megatron's mp_rank_TT[_PPP] naming, which ours is
from megalite.config import ModelConfig
from megalite.interop.interchange import (
    TIED_COPY,
    WORD,
    Layout,
    ModelSource,
    SourceInfo,
    check_tensors,
    expert_of,
    layer_names,
    merge_tp,
    post_names,
    pre_names,
    split_tp,
    stream_to_ranks,
)
from megalite.interop.tokenizer_vocab import check_vocab_fits, megatron_vocab, vocab_size_arg, with_tokenizer_files
from megalite.model.spec import DENSE_LINEARS, megatron_name


# -- shapes from the stored arguments -------------------------------------------------------------
def _arg(ns, *names, default=None):
    for n in names:
        v = getattr(ns, n, None)
        if v is not None:
            return v
    return default


def tanh_gelu(ns: argparse.Namespace) -> bool:
    """Whether a Megatron-Core GPT of these args computes GeLU's tanh approximation (README, conversion).

    Its MLP calls the fused bias-GeLU kernel, which is the tanh form, when ``bias_gelu_fusion`` (on
    by default; validate_args turns it off without biases) and biases are on; otherwise ``F.gelu``,
    the exact one. ``--openai-gelu`` only reaches the legacy (non-Core) models, whose files megalite
    does not read. Args without the key were not written by Megatron's parser but by an older
    megalite, whose model was exact.
    """
    return (
        bool(getattr(ns, "bias_gelu_fusion", False))
        and bool(_arg(ns, "add_bias_linear", default=True))
        and not getattr(ns, "swiglu", False)
    )


def config_from_args(
    ns: argparse.Namespace, true_vocab: Optional[int], where: str, moe: bool = False
) -> Tuple[ModelConfig, Layout]:
    """megalite's ModelConfig and the files' layout from a Megatron run's arguments (``moe``: the reader
    handles mixtures of experts; torch_dist's does not yet, so without it ``num_experts`` is refused)."""
    heads, hidden = ns.num_attention_heads, ns.hidden_size
    unsupported = [
        f
        for f, bad in (
            ("qk_layernorm", getattr(ns, "qk_layernorm", False)),
            ("num_experts (in this format)", getattr(ns, "num_experts", None) and not moe),
            ("moe_grouped_gemm with the legacy GroupedMLP", getattr(ns, "moe_use_legacy_grouped_gemm", False)),
            ("moe_router_topk_scaling_factor", _arg(ns, "moe_router_topk_scaling_factor", default=1.0) != 1.0),
            ("moe_router_num_groups", _arg(ns, "moe_router_num_groups", default=1) > 1),
            (
                "expert_tensor_parallel_size != tensor_model_parallel_size",
                _arg(ns, "expert_tensor_parallel_size", default=ns.tensor_model_parallel_size)
                != ns.tensor_model_parallel_size
                and getattr(ns, "num_experts", None),
            ),
            (
                "moe_router_load_balancing_type " + str(getattr(ns, "moe_router_load_balancing_type", "")),
                _arg(ns, "moe_router_load_balancing_type", default="aux_loss")
                not in ("aux_loss", "seq_aux_loss", "none"),
            ),
            ("apply_layernorm_1p", getattr(ns, "apply_layernorm_1p", False)),
            ("rotary_percent != 1", _arg(ns, "rotary_percent", default=1.0) != 1.0),
            ("kv_channels != hidden/heads", _arg(ns, "kv_channels", default=hidden // heads) != hidden // heads),
            (
                "add_qkv_bias without add_bias_linear",
                getattr(ns, "add_qkv_bias", False) and not getattr(ns, "add_bias_linear", True),
            ),
            ("squared_relu", getattr(ns, "squared_relu", False)),
            ("quick_geglu", getattr(ns, "quick_geglu", False)),
        )
        if bad
    ]
    if unsupported:
        raise CheckpointError(f"{where} uses {', '.join(unsupported)}, which megalite's model does not have")
    bf16, fp16 = getattr(ns, "bf16", False), getattr(ns, "fp16", False)
    # the tokenizer's vocabulary as Megatron builds it (README, conversion); else the whole padded table
    vocab = true_vocab or megatron_vocab(ns, None)[0] or _arg(ns, "padded_vocab_size", "vocab_size")
    cfg = ModelConfig(
        num_layers=ns.num_layers,
        hidden_size=hidden,
        ffn_hidden_size=_arg(ns, "ffn_hidden_size"),
        num_attention_heads=heads,
        num_query_groups=ns.num_query_groups if getattr(ns, "group_query_attention", False) else None,
        seq_length=ns.seq_length,
        max_position_embeddings=_arg(ns, "max_position_embeddings"),
        vocab_size=vocab,
        make_vocab_size_divisible_by=_arg(ns, "make_vocab_size_divisible_by", default=128),
        init_method_std=_arg(ns, "init_method_std", default=0.02),
        hidden_dropout=_arg(ns, "hidden_dropout", default=0.1),
        attention_dropout=_arg(ns, "attention_dropout", default=0.1),
        normalization=_arg(ns, "normalization", default="LayerNorm"),
        layernorm_epsilon=_arg(ns, "norm_epsilon", "layernorm_epsilon", default=1e-5),
        swiglu=bool(getattr(ns, "swiglu", False)),
        openai_gelu=tanh_gelu(ns),
        position_embedding_type=_arg(ns, "position_embedding_type", default="learned_absolute"),
        rotary_base=int(_arg(ns, "rotary_base", default=10000)),
        untie_embeddings_and_output_weights=bool(getattr(ns, "untie_embeddings_and_output_weights", False)),
        add_bias_linear=bool(_arg(ns, "add_bias_linear", default=True)),
        params_dtype="bfloat16" if bf16 else "float16" if fp16 else "float32",
        **_moe_from_args(ns),
    )
    vp = _arg(ns, "virtual_pipeline_model_parallel_size", default=1)
    ep = _arg(ns, "expert_model_parallel_size", default=1) if cfg.is_moe else 1
    layout = Layout(
        tp=ns.tensor_model_parallel_size,
        pp=ns.pipeline_model_parallel_size,
        vp=vp,
        first=_arg(ns, "decoder_first_pipeline_num_layers"),
        last=_arg(ns, "decoder_last_pipeline_num_layers"),
        ep=ep,
    )
    return cfg, layout


_MOE_ARGS = (
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_router_bias_update_rate",
    "moe_expert_capacity_factor",
    "moe_token_drop_policy",
)


def _moe_from_args(ns: argparse.Namespace) -> dict:
    """ModelConfig's MoE fields from Megatron's args (nothing for a dense run)."""
    if not getattr(ns, "num_experts", None):
        return {}
    freq = _arg(ns, "moe_layer_freq", default=1)
    out = {k: getattr(ns, k) for k in _MOE_ARGS if getattr(ns, k, None) is not None}
    return dict(
        out,
        num_experts=ns.num_experts,
        moe_ffn_hidden_size=_arg(ns, "moe_ffn_hidden_size"),
        moe_layer_freq=tuple(freq) if isinstance(freq, (list, tuple)) else int(freq),
        moe_router_pre_softmax=bool(getattr(ns, "moe_router_pre_softmax", False)),
        moe_shared_expert_intermediate_size=_arg(ns, "moe_shared_expert_intermediate_size"),
        moe_shared_expert_gate=bool(getattr(ns, "moe_shared_expert_gate", False)),
        moe_router_enable_expert_bias=bool(getattr(ns, "moe_router_enable_expert_bias", False)),
        moe_grouped_gemm=bool(getattr(ns, "moe_grouped_gemm", False)),
    )


def _moe_args(cfg: ModelConfig, layout: Layout) -> dict:
    """The MoE entries of Megatron's args for ``cfg`` (the dense defaults for a dense model)."""
    if not cfg.is_moe:
        return dict(num_experts=None, expert_model_parallel_size=1)
    freq = cfg.moe_layer_freq
    return dict(
        {k: getattr(cfg, k) for k in _MOE_ARGS},
        num_experts=cfg.num_experts,
        moe_ffn_hidden_size=cfg.moe_ffn_size,
        moe_layer_freq=list(freq) if isinstance(freq, tuple) else freq,
        moe_router_pre_softmax=cfg.moe_router_pre_softmax,
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=cfg.moe_shared_expert_gate,
        moe_shared_expert_overlap=False,
        moe_router_enable_expert_bias=cfg.moe_router_enable_expert_bias,
        moe_grouped_gemm=False,
        moe_use_legacy_grouped_gemm=False,
        moe_router_topk_scaling_factor=None,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.tp,
    )


def args_for(
    cfg: ModelConfig, layout: Layout, tokenizer: Dict[str, Optional[str]], base: Optional[argparse.Namespace] = None
) -> argparse.Namespace:
    """The ``args`` Namespace a Megatron-LM run of this model and layout would store."""
    if cfg.openai_gelu and not cfg.add_bias_linear and not cfg.swiglu:
        raise CheckpointError(
            "this model uses --openai-gelu without biases: Megatron-Core computes GeLU's tanh "
            "form only in its bias-GeLU fusion, which needs biases, so it would compute another "
            "function; convert to --saver hf or megalite instead"
        )
    # a Megatron source's other flags are kept (as Megatron's saver does), but not our inert stand-ins
    kept = {k: v for k, v in vars(base).items() if not isinstance(v, MegatronValue)} if base is not None else {}
    ns = argparse.Namespace(**kept)
    vp = layout.vp if layout.vp > 1 else None
    kind = tokenizer.get("tokenizer_type") or getattr(ns, "tokenizer_type", None)
    vals = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_size,
        num_attention_heads=cfg.num_attention_heads,
        kv_channels=cfg.head_dim,
        group_query_attention=cfg.query_groups != cfg.num_attention_heads,
        num_query_groups=cfg.query_groups,
        seq_length=cfg.seq_length,
        max_position_embeddings=cfg.max_positions,
        position_embedding_type=cfg.position_embedding_type,
        rotary_base=cfg.rotary_base,
        rotary_percent=1.0,
        normalization=cfg.normalization,
        norm_epsilon=cfg.layernorm_epsilon,
        swiglu=cfg.swiglu,
        # Megatron-Core's MLP computes the tanh GeLU exactly when its bias-GeLU fusion is on (tanh_gelu)
        bias_gelu_fusion=cfg.openai_gelu and cfg.add_bias_linear and not cfg.swiglu,
        openai_gelu=cfg.openai_gelu,
        untie_embeddings_and_output_weights=not cfg.tied_embeddings,
        add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_bias_linear,
        vocab_size=vocab_size_arg(kind, cfg.vocab_size),
        padded_vocab_size=cfg.padded_vocab_size(layout.tp),
        make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
        init_method_std=cfg.init_method_std,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        params_dtype=cfg.torch_dtype,
        bf16=cfg.params_dtype == "bfloat16",
        fp16=cfg.params_dtype == "float16",
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=vp,
        num_layers_per_virtual_pipeline_stage=(
            cfg.num_layers // (layout.pp * layout.vp) if vp and layout.first is None and layout.last is None else None
        ),
        decoder_first_pipeline_num_layers=layout.first,
        decoder_last_pipeline_num_layers=layout.last,
        transformer_impl=getattr(ns, "transformer_impl", "local"),
        data_parallel_size=1,
        world_size=layout.tp * layout.pp,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        **_moe_args(cfg, layout),
    )
    vals.update({k: v for k, v in tokenizer.items() if v is not None})
    for k, v in vals.items():
        setattr(ns, k, v)
    return ns


# -- the fused QKV order ----------------------------------------------------------------------------
def qkv_to_megatron(cfg: ModelConfig, full: torch.Tensor) -> torch.Tensor:
    """[Q; K; V] rows -> per query group [q heads of the group; k; v] rows (weight or bias)."""
    g, d = cfg.query_groups, cfg.head_dim
    q, k, v = full.split([cfg.num_attention_heads * d, g * d, g * d], dim=0)
    rest = full.shape[1:]
    parts = [q.reshape(g, -1, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def qkv_from_megatron(cfg: ModelConfig, full: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`qkv_to_megatron`."""
    g, d = cfg.query_groups, cfg.head_dim
    rest = full.shape[1:]
    grouped = full.reshape(g, -1, *rest)
    q, k, v = grouped.split([cfg.num_attention_heads // g * d, d, d], dim=1)
    return torch.cat([q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)], dim=0)


def _split(cfg: ModelConfig, name: str, full: torch.Tensor, tp: int) -> List[torch.Tensor]:
    if "layer_norm_" in name:  # transformer_engine's fused norm: replicated
        return [full] * tp
    if ".linear_qkv." in name:
        return [s.clone() for s in qkv_to_megatron(cfg, full).chunk(tp, dim=0)]
    return [s.clone() for s in split_tp(cfg, name, full, tp)]


def _merge(cfg: ModelConfig, name: str, shards: List[torch.Tensor]) -> torch.Tensor:
    if "layer_norm_" in name:
        return shards[0].clone()
    if ".linear_qkv." in name:
        return qkv_from_megatron(cfg, torch.cat(shards, dim=0))
    return merge_tp(cfg, name, shards).clone()


# -- reading ----------------------------------------------------------------------------------------
LATEST = "latest_checkpointed_iteration.txt"
TOKENIZER_FIELDS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")


def find_megatron_iteration(root: str) -> Tuple[str, int]:
    """(directory, iteration) that ``latest_checkpointed_iteration.txt`` names (``release`` is iteration 0)."""
    if not os.path.isdir(root):
        raise CheckpointError(f"--load-dir {root} does not exist")
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        raise CheckpointError(f"{root} has no {LATEST}: it is not a Megatron-LM checkpoint")
    text = open(path).read().strip()
    if text == "release":
        d, it = os.path.join(root, "release"), 0
    elif text.isdigit():
        d, it = os.path.join(root, f"iter_{int(text):07d}"), int(text)
    else:
        raise CheckpointError(f"{path} should hold an iteration number or 'release', found {text[:40]!r}")
    if not os.path.isdir(d):
        raise CheckpointError(f"{path} names {os.path.basename(d)} but {d} is missing: the checkpoint is incomplete")
    return d, it


class MegatronSource(ModelSource):
    """A Megatron-LM legacy checkpoint, one pipeline rank's files mapped at a time."""

    def __init__(self, root: str, true_vocab: Optional[int] = None, tokenizer_files: Optional[dict] = None):
        self.dir, it = find_megatron_iteration(root)
        if not any(n.startswith("mp_rank_") for n in os.listdir(self.dir)):
            raise CheckpointError(
                f"{self.dir} holds no mp_rank_* folders (torch format) nor metadata.json + "
                f"common.pt (torch_dist format): it is not a Megatron-LM checkpoint (megalite's "
                f"checkpoints convert with --loader megalite)"
            )
        single = os.path.join(self.dir, "mp_rank_00", "model_optim_rng.pt")
        first = next(
            (
                p
                for p in (
                    os.path.join(self.dir, d, "model_optim_rng.pt")
                    for d in ("mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000")  # (ep: _EEE last)
                )
                if os.path.exists(p)
            ),
            single,
        )
        state = load_megatron_file(first)
        ns = state.get("args") if isinstance(state, dict) else None
        if not isinstance(ns, argparse.Namespace):
            raise CheckpointError(
                f"{first} stores no argparse Namespace 'args': it was not written by Megatron-LM "
                f"(megalite's torch-format checkpoints load with --loader megalite)"
            )
        self.args = ns = with_tokenizer_files(ns, tokenizer_files)
        model = state.get("model", state.get("model0", {}))
        table = model.get(WORD)
        rows = table.shape[0] * ns.tensor_model_parallel_size if table is not None else _arg(ns, "padded_vocab_size")
        vocab, self.vocab_note = megatron_vocab(ns, rows, true_vocab)
        check_vocab_fits(vocab, rows, self.vocab_note, first)
        self.vocab_guessed = not vocab  # nothing says which rows are padding: all are kept
        self.cfg, self.layout = config_from_args(ns, vocab or rows, first, moe=True)
        self.te = any(k.endswith("layer_norm_weight") for k in model)
        self.where = self.layout.stage_of_layer(self.cfg.num_layers)
        for r in range(self.layout.pp):  # every file present before anything is converted
            for t, e in self._ranks():
                path = self._path(t, r, e)
                if not os.path.exists(path):
                    raise CheckpointError(
                        f"{path} is missing: the checkpoint is incomplete (its args say "
                        f"tp={self.layout.tp} pp={self.layout.pp} ep={self.layout.ep})"
                    )
        self.info = SourceInfo(
            iteration=it, kind="megatron", tokenizer={k: getattr(ns, k, None) for k in TOKENIZER_FIELDS}
        )
        self._open_rank: Optional[int] = None
        self._files: Dict[Tuple[int, int], dict] = {}

    def _ranks(self) -> List[Tuple[int, int]]:
        return [(t, e) for e in range(self.layout.ep) for t in range(self.layout.tp)]

    def _path(self, t: int, pp_rank: int, e: int) -> str:
        lay = self.layout
        return os.path.join(self.dir, legacy_dir(t, pp_rank, lay.pp, e, lay.ep), "model_optim_rng.pt")

    def _chunk(self, pp_rank: int, chunk: int) -> Dict[Tuple[int, int], dict]:
        if self._open_rank != pp_rank:
            self._files = {}  # release the previous rank's maps first
            for t, e in self._ranks():
                self._files[(t, e)] = load_megatron_file(self._path(t, pp_rank, e))
            self._open_rank = pp_rank
        key = "model" if self.layout.vp == 1 else f"model{chunk}"
        if key not in self._files[(0, 0)]:
            raise CheckpointError(
                f"{self.dir}: pipeline rank {pp_rank}'s files have no {key!r}; their args say vp={self.layout.vp}"
            )
        return {te: f[key] for te, f in self._files.items()}

    def _read(self, pp_rank: int, chunk: int, names: Dict[str, str]) -> Dict[str, torch.Tensor]:
        """megalite name -> full tensor, for {megalite name: Megatron name in that chunk}."""
        files, tp = self._chunk(pp_rank, chunk), self.layout.tp
        out = {}
        for ours, theirs in names.items():
            g = expert_of(ours)  # an expert's shards are in its EP rank's files (expert TP = TP)
            e = 0 if g is None else g // (self.cfg.num_experts // self.layout.ep)
            shards = [files[(t, e)] for t in range(tp)]
            if theirs not in shards[0] and g is not None:  # TEGroupedMLP: mlp.experts.linear_fc1.weight<local e>
                head, tail = theirs.split(".local_experts.", 1)
                local, rest = tail.split(".", 1)
                theirs = f"{head}.{rest}{local}"
            if theirs not in shards[0]:
                raise CheckpointError(
                    f"{self.dir}: pipeline rank {pp_rank} chunk {chunk} has no tensor {theirs!r}; "
                    f"the files do not match their stored args"
                )
            out[ours] = _merge(self.cfg, ours if g is not None else theirs, [s[theirs] for s in shards])
        return out

    def pre(self) -> Dict[str, torch.Tensor]:
        out = self._read(0, 0, {n: n for n in pre_names(self.cfg)})
        check_tensors(self.cfg, out, pre_names(self.cfg), self.dir)
        return out

    def layer(self, i: int) -> Dict[str, torch.Tensor]:
        r, c, j = self.where[i]
        rel = layer_names(self.cfg, i)
        per = self.cfg.num_experts // self.layout.ep if self.cfg.is_moe_layer(i) else 0
        out = self._read(r, c, {n: f"decoder.layers.{j}." + megatron_name(n, self.te, per) for n in rel})
        check_tensors(self.cfg, out, rel, f"{self.dir} layer {i}")
        return out

    def post(self) -> Dict[str, torch.Tensor]:
        out = self._read(self.layout.pp - 1, self.layout.vp - 1, {n: n for n in post_names(self.cfg)})
        check_tensors(self.cfg, out, post_names(self.cfg), self.dir)
        return out

    def close(self) -> None:
        self._files, self._open_rank = {}, None


# -- writing ----------------------------------------------------------------------------------------
LINEARS = DENSE_LINEARS  # the linear layers whose _extra_state Megatron-Core's state dicts hold


def save_megatron(
    source: ModelSource,
    out: str,
    layout: Layout,
    tokenizer: Dict[str, Optional[str]],
    progress: Callable[[str], None],
    base_args: Optional[argparse.Namespace] = None,
) -> None:
    """Write ``source`` as Megatron-LM would save it (local transformer spec), without optimizer or RNG."""
    cfg, it, tp = source.cfg, source.info.iteration, layout.tp
    ns = args_for(cfg, layout, tokenizer, base_args)
    d = os.path.join(out, f"iter_{it:07d}")

    per = cfg.num_experts // layout.ep if cfg.is_moe else 0

    def shard(tensors: Dict[str, torch.Tensor], j: Optional[int]) -> List[Dict[str, torch.Tensor]]:
        parts: List[Dict[str, object]] = [{} for _ in range(layout.files)]  # file t + tp x ep rank
        moe = j is not None and any(".mlp.router." in n for n in tensors)
        for name, t in tensors.items():
            ours = WORD if name == TIED_COPY else name
            g = expert_of(name)
            if j is not None:  # a layer: Megatron numbers layers from 0 inside each chunk (experts per EP rank)
                name = f"decoder.layers.{j}." + megatron_name(name.split(".", 3)[3], False, per if moe else 0)
            name = "output_layer.weight" if name == TIED_COPY else name
            files = range(layout.files) if g is None else range(g // per * tp, g // per * tp + tp)
            for f, s in zip(files, _split(cfg, ours, t, tp) * layout.ep):
                parts[f][name] = s
        extra = []
        if j is not None:
            linears = [m for m in LINEARS if not (moe and m.startswith("mlp."))]
            if moe and cfg.moe_shared_expert_intermediate_size:
                linears += [f"mlp.shared_experts.linear_fc{k}" for k in (1, 2)]
            extra = [f"decoder.layers.{j}.{m}._extra_state" for m in linears]
        if any(n.startswith("decoder.final_layernorm") for n in tensors):  # the last stage, tied or not
            extra.append("output_layer._extra_state")
        for p in parts:
            p.update({e: None for e in extra})  # what Megatron-Core's linear layers put in their state dicts
            if moe:
                p.update(
                    {
                        f"decoder.layers.{j}.mlp.experts.local_experts.{e}.linear_fc{k}._extra_state": None
                        for e in range(per)
                        for k in (1, 2)
                    }
                )
        return parts

    def write(pp_rank: int, files: List[Dict[int, Dict[str, torch.Tensor]]]) -> None:
        for f, chunks in enumerate(files):
            models = {("model" if layout.vp == 1 else f"model{c}"): sd for c, sd in sorted(chunks.items())}
            path = os.path.join(d, legacy_dir(f % tp, pp_rank, layout.pp, f // tp, layout.ep), "model_optim_rng.pt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(
                {
                    "args": ns,
                    "checkpoint_version": 3.0,
                    "iteration": it,
                    **models,
                    "num_floating_point_operations_so_far": 0,
                },
                path,
            )

    stream_to_ranks(source, layout, shard, write, progress)
    with open(os.path.join(out, LATEST), "w") as f:
        f.write(str(it))
