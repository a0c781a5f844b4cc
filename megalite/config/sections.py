"""Typed, frozen configuration sections, each field declared together with its command-line flag.

Each component receives only its own section (README, Architecture). A field the CLI sets says,
right next to its default, everything about its flag (flags.py): name, help group and sentence,
argparse options and the range its value must lie in. ``arguments.py`` builds the parser from these
declarations and ``validate.py`` checks the ranges, so adding a plain flag is adding one field.
A flag that does not map one-to-one onto a field (``--bf16``, ``--group-query-attention``, ...) is
declared as a companion of the field it sets, with the function that works that field out.
Within a help group the fields are listed in --help order. Tests and tools build sections directly.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import Optional, Tuple

from megalite.checkpointing.format_info import ckpt_format_help, format_names
from megalite.config.flags import HelpGroup, derived
from megalite.config.moe import MOE, ExpertParallelFields, MoELoggingFields, MoEModelFields


class ConfigError(ValueError):
    """A bad flag or flag combination; the message is one line saying what to change."""


DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# Megatron's names; the last two run on torch's FSDP2 (data_parallel/fsdp.py)
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


# Megatron's argument groups, in --help order.
(
    NETWORK,
    REGULARIZATION,
    TRAINING,
    INITIALIZATION,
    LEARNING_RATE,
    CHECKPOINTING,
    PRECISION,
    RECOMPUTE,
    DISTRIBUTED,
    VALIDATION,
    DATA,
    TOKENIZER,
    LOGGING,
) = HELP_GROUPS = tuple(
    HelpGroup(t)
    for t in (
        "network size",
        "regularization",
        "training",
        "initialization",
        "learning rate",
        "checkpointing",
        "mixed precision",
        "activation recomputation",
        "distributed",
        "validation",
        "data and dataloader",
        "tokenizer",
        "logging",
    )
)
HELP_GROUPS = HELP_GROUPS + (MOE,)  # Megatron's "moe" group (config_moe.py)


def _query_groups(a: argparse.Namespace) -> Optional[int]:
    if a.num_query_groups is not None and not a.group_query_attention:
        raise ConfigError(
            "--num-query-groups needs --group-query-attention (without it every head has its own key/value group)"
        )
    return a.num_query_groups if a.group_query_attention else None


def _params_dtype(a: argparse.Namespace) -> str:
    if a.bf16 and a.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive; pass one")
    return "bfloat16" if a.bf16 else "float16" if a.fp16 else "float32"


def _virtual_size(a: argparse.Namespace) -> int:
    """vp from --virtual-pipeline-model-parallel-size or from --num-layers-per-virtual-pipeline-stage."""
    per = a.num_layers_per_virtual_pipeline_stage
    if per is not None and a.virtual_pipeline_model_parallel_size:
        raise ConfigError(
            "give --num-layers-per-virtual-pipeline-stage or --virtual-pipeline-model-parallel-size, not both"
        )
    if per is not None:
        stage_layers = a.num_layers // max(1, a.pp)
        if per < 1 or a.num_layers % a.pp or stage_layers % per:
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage {per} must divide the layers per "
                f"pipeline stage ({a.num_layers} layers / {a.pp} stages)"
            )
        return stage_layers // per
    return a.virtual_pipeline_model_parallel_size or 1


def _checkpoint_scheduler(a: argparse.Namespace) -> bool:
    if a.override_opt_param_scheduler and a.use_checkpoint_opt_param_scheduler:
        raise ConfigError(
            "--override-opt_param-scheduler (use the learning-rate settings given) and "
            "--use-checkpoint-opt_param-scheduler (keep the checkpoint's) are exclusive; pass one"
        )
    return a.use_checkpoint_opt_param_scheduler


def layer_list(text: str) -> Tuple[int, ...]:
    """``5,3`` -> (5, 3) for --pipeline-stage-layers."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer counts such as 5,3, got {text!r}") from None


@dataclass(frozen=True)
class ModelConfig(MoEModelFields):
    num_layers: int = NETWORK("--num-layers", 4, "transformer layers", gt=0)
    hidden_size: int = NETWORK("--hidden-size", 256, "transformer hidden size", gt=0)
    ffn_hidden_size: Optional[int] = NETWORK(  # None: 4h (or 8h/3 rounded for SwiGLU)
        "--ffn-hidden-size",
        None,
        "MLP hidden size; default 4 x hidden (8/3 x hidden rounded up to 64 with --swiglu)",
        gt=0,
    )
    num_attention_heads: int = NETWORK("--num-attention-heads", 4, "attention heads", gt=0)
    num_query_groups: Optional[int] = NETWORK(  # None: multi-head attention (groups == heads)
        "--num-query-groups",
        None,
        "key/value groups with --group-query-attention (default: one per head)",
        before=NETWORK.flag(
            "--group-query-attention",
            "grouped-query attention: heads share --num-query-groups key/value groups",
            action="store_true",
        ),
        value=_query_groups,
    )
    seq_length: int = NETWORK("--seq-length", 128, "tokens per sample", gt=0)
    max_position_embeddings: Optional[int] = NETWORK(
        "--max-position-embeddings", None, "learned position table size (default: --seq-length)", gt=0
    )
    vocab_size: int = NETWORK(  # the tokenizer's (unpadded) vocabulary size
        "--vocab-size",
        0,
        "vocabulary for --mock-data and NullTokenizer (default 4096 for mock data; otherwise the tokenizer's)",
        parser_default=None,
        value=lambda a: a.vocab_size if a.vocab_size is not None else (4096 if a.mock_data else 0),
    )
    make_vocab_size_divisible_by: int = NETWORK(
        "--make-vocab-size-divisible-by",
        128,
        "pad the vocabulary to a multiple of this x --tensor-model-parallel-size",
        gt=0,
    )
    init_method_std: float = INITIALIZATION(
        "--init-method-std", 0.02, "standard deviation of the normal weight initialization", gt=0, listed_after="--seed"
    )
    hidden_dropout: float = REGULARIZATION(
        "--hidden-dropout",
        0.1,
        "dropout after attention and MLP, in [0, 1) (0 for layout-identical losses)",
        ge=0,
        lt=1,
    )
    attention_dropout: float = REGULARIZATION(
        "--attention-dropout", 0.1, "dropout on attention probabilities, in [0, 1)", ge=0, lt=1
    )
    normalization: str = NETWORK(
        "--normalization", "LayerNorm", "normalization layer", choices=("LayerNorm", "RMSNorm")
    )
    layernorm_epsilon: float = NETWORK("--norm-epsilon", 1e-5, "epsilon of the norms", gt=0)
    swiglu: bool = NETWORK("--swiglu", False, "SwiGLU MLP (gated, SiLU) instead of GeLU")
    openai_gelu: bool = NETWORK(
        "--openai-gelu",
        False,
        "GeLU's tanh approximation instead of the exact (erf) GeLU in the MLP (what "
        "Megatron-LM's default --bias-gelu-fusion and HF GPT-2's gelu_new compute)",
    )
    position_embedding_type: str = NETWORK(
        "--position-embedding-type", "learned_absolute", "position embedding", choices=("learned_absolute", "rope")
    )
    rotary_base: int = NETWORK("--rotary-base", 10000, "RoPE base period", gt=0)
    untie_embeddings_and_output_weights: bool = NETWORK(
        "--untie-embeddings-and-output-weights",
        False,
        "separate output layer weights (default: the output layer reuses the embedding)",
    )
    add_bias_linear: bool = NETWORK("--disable-bias-linear", True, "no biases in the linear layers")
    params_dtype: str = derived(  # float32 | bfloat16 (--bf16) | float16 (--fp16)
        "float32",
        PRECISION.flag("--bf16", "bf16 parameters and activations, fp32 main weights", action="store_true"),
        PRECISION.flag(
            "--fp16", "fp16 parameters and activations, fp32 main weights, dynamic loss scaling", action="store_true"
        ),
        value=_params_dtype,
    )
    # FP8 GEMMs in the transformer layers' linears (tensor_parallel/fp8.py; Megatron's flags)
    fp8_format: Optional[str] = PRECISION(  # None: no FP8
        "--fp8-format",
        None,
        "FP8 GEMMs in the transformer layers' linears (needs --bf16): e4m3 everywhere, or hybrid "
        "(e4m3 inputs and weights, e5m2 output gradients)",
        choices=("e4m3", "hybrid"),
    )
    fp8_recipe: str = PRECISION(
        "--fp8-recipe",
        "delayed",
        "FP8 scaling: delayed (amax history), tensorwise (current amax per tensor), rowwise (per "
        "row); mxfp8 and blockwise are Megatron's names for recipes megalite does not run",
        choices=("tensorwise", "delayed", "rowwise", "mxfp8", "blockwise"),
    )
    fp8_margin: int = PRECISION("--fp8-margin", 0, "delayed scaling: scale divided by 2**margin")
    fp8_amax_history_len: int = PRECISION(
        "--fp8-amax-history-len", 1, "delayed scaling: amaxes kept per tensor (one per micro-batch pass)", ge=1
    )
    fp8_amax_compute_algo: str = PRECISION(
        "--fp8-amax-compute-algo",
        "most_recent",
        "delayed scaling: the amax a scale comes from (the newest of the history, or its max)",
        choices=("most_recent", "max"),
    )
    first_last_layers_bf16: bool = PRECISION(
        "--first-last-layers-bf16", False, "with FP8: keep the first and last transformer layers in bf16"
    )
    num_layers_at_start_in_bf16: int = PRECISION(
        "--num-layers-at-start-in-bf16", 1, "with --first-last-layers-bf16: bf16 layers at the start", ge=0
    )
    num_layers_at_end_in_bf16: int = PRECISION(
        "--num-layers-at-end-in-bf16", 1, "with --first-last-layers-bf16: bf16 layers at the end", ge=0
    )
    attention_backend: str = NETWORK(  # auto/flash/fused: fused kernels; unfused/local: explicit softmax
        "--attention-backend",
        "auto",
        "auto/flash/fused: torch scaled_dot_product_attention for causal attention (flash kernels where "
        "the device has them), FlashAttention-2 varlen for packed documents and context-parallel blocks "
        "(CUDA, fp16/bf16; else fp32 tiles, with one warning); unfused/local: explicit QK^T, softmax, "
        "dropout, x V (masked blocks in fp32 tiles)",
        choices=("auto", "flash", "fused", "unfused", "local"),
    )
    recompute_granularity: Optional[str] = RECOMPUTE(  # None | "full" | "selective" (core attention)
        "--recompute-granularity",
        None,
        "full: recompute whole layers (needs --recompute-method); selective: core attention",
        choices=("full", "selective"),
        before=RECOMPUTE.flag(
            "--recompute-activations", "alias of --recompute-granularity selective", action="store_true"
        ),
        value=lambda a: "selective" if a.recompute_activations else a.recompute_granularity,
    )
    recompute_method: Optional[str] = RECOMPUTE(
        "--recompute-method",
        None,
        "uniform: checkpoint every group of --recompute-num-layers layers; block: "
        "recompute the first --recompute-num-layers layers of each pipeline chunk",
        choices=("uniform", "block"),
    )
    recompute_num_layers: int = RECOMPUTE(
        "--recompute-num-layers",
        1,
        "layers per recomputed group (uniform) or recomputed layers per chunk (block)",
        ge=1,
    )
    torch_compile: bool = RECOMPUTE(
        "--compile",
        False,
        "torch.compile each transformer layer on its own (regional; inductor, which needs a C++ compiler on "
        "CPU); collectives, the selectively recomputed attention, CP attention and MoE blocks run eagerly",
        then=RECOMPUTE.flag("--torch-compile", "alias of --compile", action="store_true"),
    )

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.params_dtype)

    def fp8_layer(self, layer: int) -> bool:
        """Whether global transformer layer ``layer`` runs its linears' GEMMs in FP8."""
        if self.fp8_format is None:
            return False
        if not self.first_last_layers_bf16:
            return True
        return self.num_layers_at_start_in_bf16 <= layer < self.num_layers - self.num_layers_at_end_in_bf16

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            # Llama's 8h/3, rounded up to a multiple of 64 (Megatron's convention).
            return ((int(8 * self.hidden_size / 3) + 63) // 64) * 64
        return 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    @property
    def tied_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def padded_vocab_size(self, tp_size: int) -> int:
        """Vocabulary padded to a multiple of make_vocab_size_divisible_by * tp (as Megatron)."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return ((self.vocab_size + multiple - 1) // multiple) * multiple


@dataclass(frozen=True)
class ParallelConfig(ExpertParallelFields):
    tp: int = DISTRIBUTED("--tensor-model-parallel-size", 1, "ranks sharing each layer (tensor parallelism)", gt=0)
    pp: int = DISTRIBUTED(
        "--pipeline-model-parallel-size", 1, "pipeline stages (the data-parallel size is the rest of the world)", gt=0
    )
    vp: int = derived(  # virtual pipeline chunks per pipeline rank
        1,
        DISTRIBUTED.flag(
            "--num-layers-per-virtual-pipeline-stage",
            "layers per virtual stage for the interleaved schedule (or give --virtual-pipeline-model-parallel-size)",
            type=int,
        ),
        DISTRIBUTED.flag(
            "--virtual-pipeline-model-parallel-size",
            "model chunks per pipeline rank for the interleaved schedule",
            type=int,
        ),
        value=_virtual_size,
    )
    pipeline_schedule: Optional[str] = DISTRIBUTED(  # None: 1f1b, or interleaved when vp > 1
        "--pipeline-schedule",
        None,
        "pipeline schedule; default: 1f1b, or interleaved_1f1b with virtual stages",
        choices="schedules",
    )  # the pipeline registry's names, filled in by arguments.py
    overlap_p2p_comm: bool = DISTRIBUTED(  # sends right after their compute, receives posted one compute ahead
        "--overlap-p2p-communication",
        False,
        "send each activation/gradient as soon as its compute ends and post "
        "receives one compute ahead, overlapping transfers with compute",
        then=DISTRIBUTED.flag(
            "--no-overlap-p2p-communication",
            "place pipeline transfers as Megatron's non-overlapped schedules do (the default)",
            action="store_false",
            dest="overlap_p2p_comm",
        ),
    )
    decoder_first_pipeline_num_layers: Optional[int] = DISTRIBUTED(
        "--decoder-first-pipeline-num-layers",
        None,
        "layers on the first pipeline stage (uneven split; the rest are spread evenly)",
    )
    decoder_last_pipeline_num_layers: Optional[int] = DISTRIBUTED(
        "--decoder-last-pipeline-num-layers",
        None,
        "layers on the last pipeline stage (uneven split; the rest are spread evenly)",
    )
    pipeline_stage_layers: Optional[Tuple[int, ...]] = DISTRIBUTED(  # layers per virtual stage, in stage order
        "--pipeline-stage-layers",
        None,
        "layers of every virtual pipeline stage, comma-separated in stage order "
        "(pp x vp entries, each >= 1, summing to --num-layers), e.g. 5,3",
        type=layer_list,
    )
    pipeline_balance: str = DISTRIBUTED(
        "--pipeline-balance",
        "even",
        "measured: time the embedding, a transformer layer and the output layer + "
        "loss at startup and train with the split of layers the simulator finds fastest",
        choices=("even", "measured"),
    )
    sequence_parallel: bool = DISTRIBUTED(  # as Megatron: off when there is no tensor parallelism to split over
        "--sequence-parallel",
        False,
        "split norms, dropout and residuals along the sequence over the TP group",
        value=lambda a: a.sequence_parallel and a.tp != 1,
    )
    cp: int = DISTRIBUTED(
        "--context-parallel-size",
        1,
        "ranks splitting each sequence (context parallelism); the data-parallel size is world / (tp x pp x cp)",
        gt=0,
    )
    cp_comm_type: str = DISTRIBUTED(  # how attention sees the other CP ranks' keys and values
        "--cp-comm-type",
        "p2p",
        "p2p: ring attention (K/V passed around the CP group); all_gather: gather K/V; "
        "a2a: all-to-all over heads (Ulysses); one value for all layers (no per-layer list)",
        choices=("p2p", "all_gather", "a2a"),
    )
    distributed_backend: Optional[str] = DISTRIBUTED(  # None: nccl if CUDA else gloo
        "--distributed-backend",
        None,
        "default: nccl when CUDA is available, else gloo",
        choices=("gloo", "nccl"),
        listed_after="--ddp-bucket-size",
    )
    distributed_timeout_minutes: float = DISTRIBUTED(  # a collective waiting longer fails (a hung or stopped rank)
        "--distributed-timeout-minutes",
        10.0,
        "a collective or transfer that waits longer fails and ends the job (a hung or stopped rank)",
        gt=0,
        listed_after="--distributed-backend",
    )
    debug_dir: Optional[str] = DISTRIBUTED(  # None: <--save>/debug, else <tmp>/megalite_debug (hang_watch.py)
        "--debug-dir",
        None,
        "where each rank writes its flight recorder (JSON) when a job hangs, is ended by a "
        "signal or gets SIGUSR1; read them with tools/diagnose.py (default: <--save>/debug, else "
        "$TMPDIR/megalite_debug)",
        listed_after="--distributed-timeout-minutes",
    )
    flight_recorder_size: int = DISTRIBUTED(  # megalite/observability/flight_recorder.py
        "--flight-recorder-size",
        2000,
        "events each rank's flight recorder keeps for the hang diagnosis (0: no recorder and no diagnosis)",
        ge=0,
        listed_after="--debug-dir",
    )


@dataclass(frozen=True)
class OptimConfig:
    lr: float = LEARNING_RATE("--lr", 1e-3, "peak learning rate", gt=0)
    min_lr: float = LEARNING_RATE("--min-lr", 1e-4, "learning rate at the end of the decay", ge=0)
    lr_decay_style: str = LEARNING_RATE(
        "--lr-decay-style",
        "cosine",
        "decay from --lr to --min-lr after warmup",
        choices=("constant", "linear", "cosine"),
    )
    lr_warmup_iters: int = LEARNING_RATE("--lr-warmup-iters", 20, "iterations of linear warmup from 0 to --lr", ge=0)
    lr_decay_iters: Optional[int] = LEARNING_RATE(  # None: train_iters
        "--lr-decay-iters", None, "iterations over which the rate decays (default: --train-iters)", gt=0
    )
    override_opt_param_scheduler: bool = LEARNING_RATE(  # Megatron's flag names and meaning
        "--override-opt_param-scheduler",
        False,
        "on resume, use the learning-rate settings given (--lr, --min-lr, warmup, decay) instead of the checkpoint's",
    )
    use_checkpoint_opt_param_scheduler: bool = LEARNING_RATE(
        "--use-checkpoint-opt_param-scheduler",
        False,
        "on resume, keep the checkpoint's learning-rate settings and "
        "ignore the ones given (without either flag, settings that differ are refused)",
        value=_checkpoint_scheduler,
    )
    weight_decay: float = REGULARIZATION("--weight-decay", 0.01, "AdamW weight decay", ge=0)
    clip_grad: float = REGULARIZATION("--clip-grad", 1.0, "gradient norm clipping (0: off)", ge=0)
    adam_beta1: float = REGULARIZATION("--adam-beta1", 0.9, "Adam beta1, in [0, 1)", ge=0, lt=1)
    adam_beta2: float = REGULARIZATION("--adam-beta2", 0.999, "Adam beta2, in [0, 1)", ge=0, lt=1)
    adam_eps: float = REGULARIZATION("--adam-eps", 1e-8, "Adam epsilon", gt=0)
    # fp16 loss scaling (Megatron's flags and defaults); loss_scale set = a constant scale.
    # Their ranges apply with --fp16 only (validate.py).
    loss_scale: Optional[float] = PRECISION("--loss-scale", None, "constant fp16 loss scale (default: dynamic scaling)")
    initial_loss_scale: float = PRECISION("--initial-loss-scale", 2.0**32, "first dynamic fp16 loss scale")
    min_loss_scale: float = PRECISION("--min-loss-scale", 1.0, "the dynamic fp16 loss scale never goes below this")
    loss_scale_window: int = PRECISION(
        "--loss-scale-window", 1000, "iterations without overflow before the scale doubles"
    )
    hysteresis: int = PRECISION(
        "--hysteresis",
        2,
        "overflows since the last growth needed before the scale halves (then every further overflow halves it)",
    )
    accumulate_allreduce_grads_in_fp32: bool = PRECISION(  # forced on for bf16, as Megatron
        "--accumulate-allreduce-grads-in-fp32",
        False,
        "fp32 gradient accumulation and reduction (always on with --bf16)",
        value=lambda a: a.accumulate_allreduce_grads_in_fp32 or a.bf16,
    )
    # gradient reduction and the distributed optimizer (ZeRO-1)
    use_distributed_optimizer: bool = DISTRIBUTED(
        "--use-distributed-optimizer",
        False,
        "shard fp32 main weights and Adam states over the data-parallel group (x the context-parallel group; ZeRO-1)",
        value=lambda a: a.use_distributed_optimizer or a.data_parallel_sharding_strategy == "optim",
    )
    # None: worked out by ``sharding`` (optim with --use-distributed-optimizer, no_shard otherwise)
    data_parallel_sharding_strategy: Optional[str] = DISTRIBUTED(
        "--data-parallel-sharding-strategy",
        None,
        "what the data-parallel (x context-parallel) ranks shard: no_shard (all-reduce), optim (the distributed "
        "optimizer, ZeRO-1), optim_grads (+ gradients reduce-scattered, ZeRO-2), optim_grads_params (+ weights "
        "gathered per layer, ZeRO-3); the last two on torch's FSDP2 (default: optim with "
        "--use-distributed-optimizer, else no_shard)",
        choices=SHARDING_STRATEGIES,
    )
    use_torch_fsdp2: bool = DISTRIBUTED(
        "--use-torch-fsdp2", False, "Megatron's name for --data-parallel-sharding-strategy optim_grads_params"
    )
    reshard_after_forward: bool = DISTRIBUTED(
        "--no-reshard-after-forward",
        True,
        "optim_grads_params: keep each layer's gathered weights from its forward to its backward (one gather "
        "fewer per micro-batch, more memory)",
        action="store_false",
        dest="reshard_after_forward",
    )
    num_distributed_optimizer_instances: int = DISTRIBUTED(
        "--num-distributed-optimizer-instances",
        1,
        "optim_grads / optim_grads_params: shard within dp x cp / N consecutive ranks and replicate over N such "
        "groups (hybrid sharding, HSDP: e.g. shard within a node)",
        gt=0,
    )
    overlap_grad_reduce: bool = DISTRIBUTED(
        "--overlap-grad-reduce", False, "start each bucket's gradient reduction as soon as backward has filled it"
    )
    overlap_param_gather: bool = DISTRIBUTED(
        "--overlap-param-gather",
        False,
        "with --use-distributed-optimizer: gather updated weights in the "
        "background, each bucket waited for by the first forward that uses it",
    )
    ddp_bucket_size: Optional[int] = DISTRIBUTED(  # elements; None: max(40M, 1M x dp)
        "--ddp-bucket-size", None, "gradient bucket size in elements (default max(40M, 1M x data-parallel size))", gt=0
    )

    @property
    def sharding(self) -> str:
        """The effective --data-parallel-sharding-strategy."""
        if self.use_torch_fsdp2:
            return "optim_grads_params"
        if self.data_parallel_sharding_strategy is not None:
            return self.data_parallel_sharding_strategy
        return "optim" if self.use_distributed_optimizer else "no_shard"

    @property
    def fsdp(self) -> bool:
        """Gradients (and weights) sharded over the replicas through torch's FSDP2."""
        return self.sharding in ("optim_grads", "optim_grads_params")


@dataclass(frozen=True)
class DataConfig:
    mock_data: bool = DATA(
        "--mock-data", False, "synthetic deterministic samples (needs no files; --vocab-size sets the vocabulary)"
    )
    # Megatron style: [w1 p1 w2 p2 ...] or [p1 p2 ...]
    data_path: Tuple[str, ...] = DATA(
        "--data-path",
        (),
        "dataset prefixes (without .bin/.idx), optionally "
        "weighted: w1 p1 w2 p2 ...; default: the embedded default corpus",
    )
    train_data_path: Tuple[str, ...] = DATA("--train-data-path", (), "the train split's own (weighted) prefixes")
    valid_data_path: Tuple[str, ...] = DATA("--valid-data-path", (), "the validation split's own (weighted) prefixes")
    test_data_path: Tuple[str, ...] = DATA("--test-data-path", (), "the test split's own (weighted) prefixes")
    split: str = DATA("--split", "969,30,1", "train,valid,test document proportions of --data-path")
    data_cache_path: Optional[str] = DATA(
        "--data-cache-path", None, "where index caches go (default: a cache/ directory next to each dataset)"
    )
    num_workers: int = DATA(
        "--num-workers", 0, "DataLoader worker processes per rank (0: load in the training process)", ge=0
    )
    reset_position_ids: bool = DATA(
        "--reset-position-ids", False, "positions restart at 0 after each end-of-document token"
    )
    reset_attention_mask: bool = DATA(
        "--reset-attention-mask",
        False,
        "tokens attend only within their own document (no attention across end-of-document tokens)",
    )
    eod_mask_loss: bool = DATA("--eod-mask-loss", False, "no loss on end-of-document tokens")
    tokenizer_type: Optional[str] = TOKENIZER(
        "--tokenizer-type",
        None,
        "GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer, Llama2Tokenizer or NullTokenizer",
    )
    vocab_file: Optional[str] = TOKENIZER("--vocab-file", None, "vocab.json of a GPT2BPETokenizer")
    merge_file: Optional[str] = TOKENIZER("--merge-file", None, "merges.txt of a GPT2BPETokenizer")
    tokenizer_model: Optional[str] = TOKENIZER(
        "--tokenizer-model", None, "SentencePiece .model file, or a Hugging Face tokenizer directory"
    )


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = TRAINING("--micro-batch-size", 8, "samples per micro-batch on one data-parallel rank", gt=0)
    global_batch_size: int = TRAINING(
        "--global-batch-size", 16, "samples per iteration over all data-parallel ranks and micro-batches", gt=0
    )
    train_iters: int = TRAINING("--train-iters", 200, "iterations to train (0: none)", ge=0)
    seed: int = INITIALIZATION(
        "--seed", 1234, "random seed of weights, data order and dropout (the same for every layout)", ge=0
    )
    eval_interval: int = VALIDATION(
        "--eval-interval",
        50,
        "iterations between evaluations on the validation split "
        "(and once at the end); 0 is refused while --eval-iters > 0 (Megatron reads it "
        "as 'no periodic evaluation'): turn evaluation off with --eval-iters 0, or give "
        "--eval-interval >= --train-iters to evaluate only at the end",
        ge=0,
    )
    eval_iters: int = VALIDATION(
        "--eval-iters", 5, "global batches per evaluation (0: none); the test split is evaluated once, at the end", ge=0
    )
    exit_interval: Optional[int] = TRAINING(
        "--exit-interval", None, "stop (after saving, with --save) when the iteration is a multiple of this", gt=0
    )
    exit_duration_in_mins: Optional[float] = TRAINING(  # stop (and save) once the run has trained this long
        "--exit-duration-in-mins",
        None,
        "stop (after saving, with --save) once training has run this many minutes",
        gt=0,
    )
    exit_signal_handler: bool = TRAINING(  # SIGTERM/SIGINT: save a checkpoint at the end of the iteration, exit
        "--exit-signal-handler",
        False,
        "on SIGTERM or SIGINT, finish the iteration, save a checkpoint and exit 0 "
        "(without it: exit at once without saving)",
    )
    check_for_nan_in_loss_and_grad: bool = TRAINING(  # stop at the first non-finite loss or grad norm (Megatron)
        "--no-check-for-nan-in-loss-and-grad",
        True,
        "count non-finite losses/grad norms and skip those updates instead of stopping the run at the first one",
    )
    num_threads: Optional[int] = TRAINING(  # None: leave torch's default (OMP_NUM_THREADS)
        "--num-threads", None, "torch intra-op threads (default: left to OMP_NUM_THREADS / torch)", gt=0
    )
    skip_train: bool = VALIDATION(  # evaluate (validation, then test split) and exit (Megatron)
        "--skip-train",
        False,
        "no training: evaluate --load's checkpoint on the validation and test splits, exit unsaved",
    )
    inject_fault_at_iteration: Optional[int] = TRAINING(  # tests of in-job restart; faults.inject_fault
        "--inject-fault-at-iteration",
        None,
        "for tests: --inject-fault-rank fails as this iteration begins, in "
        "torchrun's first round only (TORCHELASTIC_RESTART_COUNT 0), so a restarted job trains on",
        gt=0,
    )
    inject_fault_rank: int = TRAINING(
        "--inject-fault-rank", 0, "the global rank --inject-fault-at-iteration strikes", ge=0
    )
    inject_fault_kind: str = TRAINING(
        "--inject-fault-kind",
        "kill",
        "kill: the rank dies (SIGKILL); hang: its "
        "forward computes without end (the others wait out "
        "--distributed-timeout-minutes); exception: it raises an error and exits 1; "
        "skip-send: its schedule drops one send (a deadlock)",
        choices=("kill", "hang", "exception", "skip-send"),
    )
    plan_check: Optional[bool] = TRAINING(  # None: on on GPUs, off on CPU (megalite/analysis/plan_check.py)
        "--plan-check",
        None,
        "before building the model, refuse a layout whose planned memory exceeds the "
        "device's free memory (naming layouts that fit); after the first iterations, log the planner's memory, "
        "step time and bubble beside the measured ones (default: on on GPUs)",
        then=TRAINING.flag("--no-plan-check", "skip those checks", action="store_false", dest="plan_check"),
    )


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str] = CHECKPOINTING("--save", None, "directory to save checkpoints to")
    save_interval: Optional[int] = CHECKPOINTING(
        "--save-interval",
        None,
        "iterations between checkpoints (a checkpoint is also saved at the end and at --exit-interval)",
        gt=0,
    )
    load: Optional[str] = CHECKPOINTING("--load", None, "directory to resume from (its latest checkpoint)")
    ckpt_format: str = CHECKPOINTING(  # the run formats of checkpointing/formats.py; the first is the default
        "--ckpt-format", format_names()[0], ckpt_format_help(), choices=format_names()
    )
    ckpt_step: Optional[int] = CHECKPOINTING("--ckpt-step", None, "load this iteration, not the latest", ge=0)
    finetune: bool = CHECKPOINTING(
        "--finetune", False, "load the weights only: iteration 0, fresh optimizer and random state"
    )
    no_load_optim: bool = CHECKPOINTING("--no-load-optim", False, "do not load optimizer and LR-schedule state")
    no_load_rng: bool = CHECKPOINTING("--no-load-rng", False, "do not load random-number-generator states")
    ckpt_keep_last: Optional[int] = CHECKPOINTING(
        "--ckpt-keep-last", None, "keep only the newest K checkpoints (the latest is never deleted)", gt=0
    )
    async_save: bool = CHECKPOINTING(  # snapshot to host memory, write in a background thread (Megatron's flag)
        "--async-save",
        False,
        "write checkpoints in the background: training waits only for a copy of the state "
        "in host memory; latest names the checkpoint once every rank has written it",
    )


@dataclass(frozen=True)
class LoggingConfig(MoELoggingFields):
    log_interval: int = LOGGING("--log-interval", 10, "iterations between log lines", gt=0)
    tensorboard_dir: Optional[str] = LOGGING(
        "--tensorboard-dir", None, "write the log line's scalars as TensorBoard events here"
    )
    timeline_out: Optional[str] = LOGGING(
        "--timeline-out", None, "write the measured pipeline timeline (JSON) of the last iteration here"
    )
    log_timers: bool = True  # no flag
    peak_tflops: Optional[float] = LOGGING(  # None: the bf16 table for the GPU (none on CPU)
        "--peak-tflops",
        None,
        "peak TFLOP/s of one device for the MFU in the log line (default: the bf16 dense "
        "peak of an A100/H100/H200/B200 by its name; no MFU on CPU unless given)",
        gt=0,
    )
    straggler_threshold: float = LOGGING(  # stragglers.py
        "--straggler-threshold",
        1.5,
        "at each log line, name a rank that makes the others wait: its own time per iteration (outside waits "
        "on other ranks) this many times its peers' median (above 1; the rest of its pipeline stage, else the "
        "other stages per model FLOP) while they wait on it, at two log lines running; 0: off",
        ge=0,
    )
    profile: bool = LOGGING(  # profiling.py; Megatron's flags and defaults (its nsys mode is not offered)
        "--profile",
        False,
        "trace iterations --profile-step-start + 1 to --profile-step-end of --profile-ranks "
        "with torch.profiler: one Chrome/Perfetto JSON per rank",
        value=lambda a: a.profile,
        then=LOGGING.flag(
            "--use-pytorch-profiler",
            "accepted for Megatron's scripts: --profile always uses torch.profiler",
            action="store_true",
        ),
    )
    profile_step_start: int = LOGGING("--profile-step-start", 10, "iterations done before tracing starts", ge=0)
    profile_step_end: int = LOGGING("--profile-step-end", 12, "the last traced iteration", gt=0)
    profile_ranks: Tuple[int, ...] = LOGGING(
        "--profile-ranks",
        (0,),
        "global ranks to trace",
        nargs="+",
        type=int,
        parser_default=[0],
        value=lambda a: tuple(a.profile_ranks),
    )
    profile_dir: Optional[str] = LOGGING(
        "--profile-dir", None, "the traces' directory; when unset, --tensorboard-dir (as Megatron), else ./profile"
    )
    record_memory_history: bool = LOGGING(
        "--record-memory-history",
        False,
        "CUDA only: record the allocator's history on the last rank and write "
        "it to --memory-snapshot-path at each log line (view it at pytorch.org/memory_viz)",
    )
    memory_snapshot_path: str = LOGGING("--memory-snapshot-path", "snapshot.pickle", "where the snapshot goes")
    wandb_project: Optional[str] = LOGGING(
        "--wandb-project",
        None,
        "also log the TensorBoard scalars to this Weights & Biases project (needs pip "
        "install wandb; offline, for a later wandb sync, when no API key is set)",
    )
    wandb_exp_name: Optional[str] = LOGGING("--wandb-exp-name", None, "the wandb run's name")
    wandb_save_dir: Optional[str] = LOGGING(
        "--wandb-save-dir", None, "the wandb files' directory; when unset, <--save>/wandb, else ./wandb"
    )


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def with_(self, **sections) -> "Config":
        """Return a copy with whole sections replaced (``cfg.with_(model=...)``)."""
        return replace(self, **sections)
