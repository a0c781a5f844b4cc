"""Typed, frozen configuration sections.

Each component receives only its own section (DESIGN principle 3). The CLI in
``arguments.py`` fills these from Megatron-compatible flags; tests and tools
may build them directly.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Tuple


class ConfigError(ValueError):
    """A bad flag or flag combination; the message is one line saying what to change."""


DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = 4
    hidden_size: int = 256
    ffn_hidden_size: Optional[int] = None  # default 4h (or 8h/3 rounded for SwiGLU)
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # None: multi-head attention (groups == heads)
    seq_length: int = 128
    max_position_embeddings: Optional[int] = None  # default seq_length
    vocab_size: int = 0  # the tokenizer's (unpadded) vocabulary size
    make_vocab_size_divisible_by: int = 128
    init_method_std: float = 0.02
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    normalization: str = "LayerNorm"  # or "RMSNorm"
    layernorm_epsilon: float = 1e-5
    swiglu: bool = False
    position_embedding_type: str = "learned_absolute"  # or "rope"
    rotary_base: int = 10000
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    params_dtype: str = "float32"  # float32 | bfloat16 (--bf16) | float16 (--fp16)
    attention_backend: str = "auto"  # auto/flash/fused: torch SDPA; unfused/local: explicit softmax
    recompute_granularity: Optional[str] = None  # None | "full" | "selective" (core attention)
    recompute_method: Optional[str] = None  # "uniform" | "block" (full granularity)
    recompute_num_layers: int = 1
    torch_compile: bool = False  # torch.compile each transformer layer

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.params_dtype)

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
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    vp: int = 1  # virtual pipeline chunks per pipeline rank
    distributed_backend: Optional[str] = None  # None: nccl if CUDA else gloo
    pipeline_schedule: Optional[str] = None  # None: 1f1b, or interleaved when vp > 1
    overlap_p2p_comm: bool = False  # sends right after their compute, receives posted one compute ahead
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    pipeline_stage_layers: Optional[Tuple[int, ...]] = None  # layers per virtual stage, in stage order
    pipeline_balance: str = "even"  # even | measured (time layer kinds at startup, choose the split)
    sequence_parallel: bool = False
    distributed_timeout_minutes: float = 10.0  # a collective waiting longer fails (a hung or stopped rank)


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_decay_style: str = "cosine"  # constant | linear | cosine
    lr_warmup_iters: int = 20
    lr_decay_iters: Optional[int] = None  # default train_iters
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # fp16 loss scaling (Megatron's flags and defaults); loss_scale set = a constant scale
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    # gradient reduction and the distributed optimizer (ZeRO-1)
    accumulate_allreduce_grads_in_fp32: bool = False  # forced on for bf16, as Megatron
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    ddp_bucket_size: Optional[int] = None  # elements; None: max(40M, 1M x dp)


@dataclass(frozen=True)
class DataConfig:
    mock_data: bool = False
    data_path: Tuple[str, ...] = ()  # Megatron style: [w1 p1 w2 p2 ...] or [p1 p2 ...]
    train_data_path: Tuple[str, ...] = ()
    valid_data_path: Tuple[str, ...] = ()
    test_data_path: Tuple[str, ...] = ()
    split: str = "969,30,1"
    data_cache_path: Optional[str] = None
    tokenizer_type: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    num_workers: int = 0  # DataLoader worker processes per rank


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = 8
    global_batch_size: int = 16
    train_iters: int = 200
    seed: int = 1234
    eval_interval: int = 50
    eval_iters: int = 5
    num_threads: Optional[int] = None  # None: leave torch's default (OMP_NUM_THREADS)
    exit_interval: Optional[int] = None
    check_for_nan_in_loss_and_grad: bool = True  # stop at the first non-finite loss or grad norm (Megatron)
    exit_signal_handler: bool = False  # SIGTERM/SIGINT: save a checkpoint at the end of the iteration, exit
    exit_duration_in_mins: Optional[float] = None  # stop (and save) once the run has trained this long
    skip_train: bool = False  # no training loop: evaluate (validation, then test split) and exit (Megatron)


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    ckpt_format: str = "sharded"  # sharded (layout-free, torch.distributed.checkpoint) | torch (Megatron legacy)
    finetune: bool = False  # load weights only; iteration, optimizer and RNG start fresh
    no_load_optim: bool = False
    no_load_rng: bool = False
    ckpt_step: Optional[int] = None  # load this iteration instead of the latest
    ckpt_keep_last: Optional[int] = None  # keep only the newest K checkpoints


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 10
    tensorboard_dir: Optional[str] = None
    timeline_out: Optional[str] = None
    log_timers: bool = True
    peak_tflops: Optional[float] = None  # per-device peak for MFU; None: the bf16 table for the GPU (none on CPU)


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
