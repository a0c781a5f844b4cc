"""Megatron-compatible command line -> typed ``Config`` sections, validated up front.

Flag names follow Megatron-LM so launch scripts port with few edits. Every
check here runs before any process group exists and fails with one line
(``ConfigError``) saying what is wrong and what to do. Flags that belong to
features not built yet are accepted by name only to say so, never ignored.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import textwrap
from dataclasses import replace
from typing import Dict, List, Optional, Sequence

from megalite.config import (CheckpointConfig, Config, ConfigError, DataConfig, LoggingConfig,
                             ModelConfig, OptimConfig, ParallelConfig, TrainConfig)
from megalite.parallel_state import grid_groups
from megalite.pipeline.schedules import SCHEDULES, SPLIT_BACKWARD
from megalite.pipeline.stage_layout import V_SCHEDULES

# Flags a later milestone implements: recognised so they fail loudly instead of being ignored.
NOT_IMPLEMENTED: Dict[str, str] = {
    "--context-parallel-size": "context parallelism",
    "--expert-model-parallel-size": "expert parallelism", "--num-experts": "mixture of experts",
    "--async-save": "asynchronous checkpoint saving",
}

_M, _P, _O, _D, _T, _L, _C = (ModelConfig(), ParallelConfig(), OptimConfig(), DataConfig(), TrainConfig(),
                              LoggingConfig(), CheckpointConfig())  # the single source of every default below


def _add_network_size_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("network size")
    g.add_argument("--num-layers", type=int, default=_M.num_layers, help="transformer layers")
    g.add_argument("--hidden-size", type=int, default=_M.hidden_size, help="transformer hidden size")
    g.add_argument("--ffn-hidden-size", type=int, default=_M.ffn_hidden_size,
                   help="MLP hidden size; default 4 x hidden (8/3 x hidden rounded up to 64 with --swiglu)")
    g.add_argument("--num-attention-heads", type=int, default=_M.num_attention_heads, help="attention heads")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention: heads share --num-query-groups key/value groups")
    g.add_argument("--num-query-groups", type=int, default=_M.num_query_groups,
                   help="key/value groups with --group-query-attention (default: one per head)")
    g.add_argument("--seq-length", type=int, default=_M.seq_length, help="tokens per sample")
    g.add_argument("--max-position-embeddings", type=int, default=_M.max_position_embeddings,
                   help="learned position table size (default: --seq-length)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary for --mock-data and NullTokenizer (default 4096 for mock data; otherwise "
                        "the tokenizer's)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=_M.make_vocab_size_divisible_by,
                   help="pad the vocabulary to a multiple of this x --tensor-model-parallel-size")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default=_M.normalization,
                   help="normalization layer")
    g.add_argument("--norm-epsilon", type=float, default=_M.layernorm_epsilon, help="epsilon of the norms")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (gated, SiLU) instead of GeLU")
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"),
                   default=_M.position_embedding_type, help="position embedding")
    g.add_argument("--rotary-base", type=int, default=_M.rotary_base, help="RoPE base period")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output layer weights (default: the output layer reuses the embedding)")
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in the linear layers")
    g.add_argument("--attention-backend", choices=("auto", "flash", "fused", "unfused", "local"),
                   default=_M.attention_backend,
                   help="auto/flash/fused: torch scaled_dot_product_attention (flash kernels where the "
                        "device has them); unfused/local: explicit QK^T, softmax, dropout, x V")


def _add_regularization_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("regularization")
    g.add_argument("--hidden-dropout", type=float, default=_M.hidden_dropout,
                   help="dropout after attention and MLP, in [0, 1) (0 for layout-identical losses)")
    g.add_argument("--attention-dropout", type=float, default=_M.attention_dropout,
                   help="dropout on attention probabilities, in [0, 1)")
    g.add_argument("--weight-decay", type=float, default=_O.weight_decay, help="AdamW weight decay")
    g.add_argument("--clip-grad", type=float, default=_O.clip_grad, help="gradient norm clipping (0: off)")
    g.add_argument("--adam-beta1", type=float, default=_O.adam_beta1, help="Adam beta1, in [0, 1)")
    g.add_argument("--adam-beta2", type=float, default=_O.adam_beta2, help="Adam beta2, in [0, 1)")
    g.add_argument("--adam-eps", type=float, default=_O.adam_eps, help="Adam epsilon")


def _add_initialization_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("initialization")
    g.add_argument("--seed", type=int, default=_T.seed,
                   help="random seed of weights, data order and dropout (the same for every layout)")
    g.add_argument("--init-method-std", type=float, default=_M.init_method_std,
                   help="standard deviation of the normal weight initialization")


def _add_mixed_precision_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and activations, fp32 main weights")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 parameters and activations, fp32 main weights, dynamic loss scaling")
    g.add_argument("--loss-scale", type=float, default=_O.loss_scale,
                   help="constant fp16 loss scale (default: dynamic scaling)")
    g.add_argument("--initial-loss-scale", type=float, default=_O.initial_loss_scale,
                   help="first dynamic fp16 loss scale")
    g.add_argument("--min-loss-scale", type=float, default=_O.min_loss_scale,
                   help="the dynamic fp16 loss scale never goes below this")
    g.add_argument("--loss-scale-window", type=int, default=_O.loss_scale_window,
                   help="iterations without overflow before the scale doubles")
    g.add_argument("--hysteresis", type=int, default=_O.hysteresis,
                   help="overflows since the last growth needed before the scale halves "
                        "(then every further overflow halves it)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="fp32 gradient accumulation and reduction (always on with --bf16)")


def _add_memory_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("activation recomputation")
    g.add_argument("--recompute-activations", action="store_true",
                   help="alias of --recompute-granularity selective")
    g.add_argument("--recompute-granularity", choices=("full", "selective"),
                   default=_M.recompute_granularity,
                   help="full: recompute whole layers (needs --recompute-method); selective: core attention")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=_M.recompute_method,
                   help="uniform: checkpoint every group of --recompute-num-layers layers; block: "
                        "recompute the first --recompute-num-layers layers of each pipeline chunk")
    g.add_argument("--recompute-num-layers", type=int, default=_M.recompute_num_layers,
                   help="layers per recomputed group (uniform) or recomputed layers per chunk (block)")
    g.add_argument("--torch-compile", action="store_true",
                   help="torch.compile each transformer layer (needs a C++ compiler on CPU)")


def _add_distributed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=_P.tp,
                   help="ranks sharing each layer (tensor parallelism)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=_P.pp,
                   help="pipeline stages (the data-parallel size is the rest of the world)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="layers per virtual stage for the interleaved schedule (or give "
                        "--virtual-pipeline-model-parallel-size)")
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="model chunks per pipeline rank for the interleaved schedule")
    g.add_argument("--pipeline-schedule", choices=SCHEDULES, default=_P.pipeline_schedule,
                   help="pipeline schedule; default: 1f1b, or interleaved_1f1b with virtual stages")
    g.add_argument("--overlap-p2p-communication", dest="overlap_p2p_comm", action="store_true",
                   default=_P.overlap_p2p_comm,
                   help="send each activation/gradient as soon as its compute ends and post receives one "
                        "compute ahead, overlapping transfers with compute")
    g.add_argument("--no-overlap-p2p-communication", dest="overlap_p2p_comm", action="store_false",
                   help="place pipeline transfers as Megatron's non-overlapped schedules do (the default)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers on the first pipeline stage (uneven split; the rest are spread evenly)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers on the last pipeline stage (uneven split; the rest are spread evenly)")
    g.add_argument("--pipeline-stage-layers", type=_layer_list, default=None,
                   help="layers of every virtual pipeline stage, comma-separated in stage order "
                        "(pp x vp entries, each >= 1, summing to --num-layers), e.g. 5,3")
    g.add_argument("--pipeline-balance", choices=("even", "measured"), default=_P.pipeline_balance,
                   help="measured: time the embedding, a transformer layer and the output layer + loss at "
                        "startup and train with the split of layers the simulator finds fastest")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split norms, dropout and residuals along the sequence over the TP group")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard fp32 main weights and Adam states over the data-parallel group (ZeRO-1)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="start each bucket's gradient reduction as soon as backward has filled it")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer: gather updated weights in the background, "
                        "each bucket waited for by the first forward that uses it")
    g.add_argument("--ddp-bucket-size", type=int, default=_O.ddp_bucket_size,
                   help="gradient bucket size in elements (default max(40M, 1M x data-parallel size))")
    g.add_argument("--distributed-backend", choices=("gloo", "nccl"), default=_P.distributed_backend,
                   help="default: nccl when CUDA is available, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=float, default=_P.distributed_timeout_minutes,
                   help="a collective or transfer that waits longer fails and ends the job (a hung or "
                        "stopped rank)")


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=_T.micro_batch_size,
                   help="samples per micro-batch on one data-parallel rank")
    g.add_argument("--global-batch-size", type=int, default=_T.global_batch_size,
                   help="samples per iteration over all data-parallel ranks and micro-batches")
    g.add_argument("--train-iters", type=int, default=_T.train_iters, help="iterations to train (0: none)")
    g.add_argument("--exit-interval", type=int, default=_T.exit_interval,
                   help="stop (after saving, with --save) when the iteration is a multiple of this")
    g.add_argument("--exit-duration-in-mins", type=float, default=_T.exit_duration_in_mins,
                   help="stop (after saving, with --save) once training has run this many minutes")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM or SIGINT, finish the iteration, save a checkpoint and exit 0 "
                        "(without it: exit at once without saving)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", help="count non-finite losses/grad norms and skip those updates instead of "
                                              "stopping the run at the first one")
    g.add_argument("--num-threads", type=int, default=_T.num_threads,
                   help="torch intra-op threads (default: left to OMP_NUM_THREADS / torch)")


def _add_learning_rate_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=_O.lr, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=_O.min_lr, help="learning rate at the end of the decay")
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default=_O.lr_decay_style,
                   help="decay from --lr to --min-lr after warmup")
    g.add_argument("--lr-warmup-iters", type=int, default=_O.lr_warmup_iters,
                   help="iterations of linear warmup from 0 to --lr")
    g.add_argument("--lr-decay-iters", type=int, default=_O.lr_decay_iters,
                   help="iterations over which the rate decays (default: --train-iters)")


def _add_validation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("validation")
    g.add_argument("--eval-interval", type=int, default=_T.eval_interval,
                   help="iterations between evaluations on the validation split (and once at the end)")
    g.add_argument("--eval-iters", type=int, default=_T.eval_iters,
                   help="global batches per evaluation (0: none); the test split is evaluated once, at the end")
    g.add_argument("--skip-train", action="store_true",
                   help="no training: evaluate --load's checkpoint on the validation and test splits, exit unsaved")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data and dataloader")
    g.add_argument("--mock-data", action="store_true",
                   help="synthetic deterministic samples (needs no files; --vocab-size sets the vocabulary)")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="dataset prefixes (without .bin/.idx), optionally weighted: w1 p1 w2 p2 ...; "
                        "default: the embedded default corpus")
    g.add_argument("--train-data-path", nargs="*", default=None, help="the train split's own (weighted) prefixes")
    g.add_argument("--valid-data-path", nargs="*", default=None,
                   help="the validation split's own (weighted) prefixes")
    g.add_argument("--test-data-path", nargs="*", default=None, help="the test split's own (weighted) prefixes")
    g.add_argument("--split", default=_D.split, help="train,valid,test document proportions of --data-path")
    g.add_argument("--data-cache-path", default=_D.data_cache_path,
                   help="where index caches go (default: a cache/ directory next to each dataset)")
    g.add_argument("--num-workers", type=int, default=_D.num_workers,
                   help="DataLoader worker processes per rank (0: load in the training process)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default=_D.tokenizer_type,
                   help="GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer, Llama2Tokenizer or "
                        "NullTokenizer")
    g.add_argument("--vocab-file", default=_D.vocab_file, help="vocab.json of a GPT2BPETokenizer")
    g.add_argument("--merge-file", default=_D.merge_file, help="merges.txt of a GPT2BPETokenizer")
    g.add_argument("--tokenizer-model", default=_D.tokenizer_model,
                   help="SentencePiece .model file, or a Hugging Face tokenizer directory")


def _add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=_C.save, help="directory to save checkpoints to")
    g.add_argument("--save-interval", type=int, default=_C.save_interval,
                   help="iterations between checkpoints (a checkpoint is also saved at the end and at "
                        "--exit-interval)")
    g.add_argument("--load", default=_C.load, help="directory to resume from (its latest checkpoint)")
    g.add_argument("--ckpt-format", choices=("sharded", "torch"), default=_C.ckpt_format,
                   help="sharded: layout-free, loads into any tp/pp/vp/dp; torch: Megatron-LM's legacy "
                        "mp_rank_XX/model_optim_rng.pt files (same tp/pp/vp to load)")
    g.add_argument("--ckpt-step", type=int, default=_C.ckpt_step, help="load this iteration, not the latest")
    g.add_argument("--finetune", action="store_true",
                   help="load the weights only: iteration 0, fresh optimizer and random state")
    g.add_argument("--no-load-optim", action="store_true", help="do not load optimizer and LR-schedule state")
    g.add_argument("--no-load-rng", action="store_true", help="do not load random-number-generator states")
    g.add_argument("--ckpt-keep-last", type=int, default=_C.ckpt_keep_last,
                   help="keep only the newest K checkpoints (the latest is never deleted)")


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=_L.log_interval, help="iterations between log lines")
    g.add_argument("--tensorboard-dir", default=_L.tensorboard_dir,
                   help="write the log line's scalars as TensorBoard events here")
    g.add_argument("--timeline-out", default=_L.timeline_out,
                   help="write the measured pipeline timeline (JSON) of the last iteration here")
    g.add_argument("--peak-tflops", type=float, default=_L.peak_tflops,
                   help="peak TFLOP/s of one device for the MFU in the log line (default: the bf16 dense peak "
                        "of an A100/H100/H200/B200 by its name; no MFU on CPU unless given)")


class _HelpFormatter(argparse.HelpFormatter):
    """Every option that takes a value shows its default (the config dataclasses' value); lines
    never break inside a flag name (argparse would split --context-parallel-size at a hyphen)."""

    def _split_lines(self, text: str, width: int) -> List[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if text and action.option_strings and action.nargs != 0 and action.default is not argparse.SUPPRESS \
                and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    """The full CLI (Megatron flag names)."""
    p = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False, exit_on_error=False,
                                description="Pretrain a GPT with tensor, pipeline and data parallelism.",
                                formatter_class=_HelpFormatter)
    for add in (_add_network_size_args, _add_regularization_args, _add_training_args, _add_initialization_args,
                _add_learning_rate_args, _add_checkpoint_args, _add_mixed_precision_args, _add_memory_args,
                _add_distributed_args, _add_validation_args, _add_data_args, _add_logging_args):
        add(p)
    for flag in NOT_IMPLEMENTED:  # recognised to fail with a clear line; listed in the epilog, not as options
        p.add_argument(flag, nargs="?", const=True, default=None, help=argparse.SUPPRESS)
    p.epilog = ("Recognised but not implemented yet (they stop with an error): "
                + ", ".join(f"{f} ({what})" for f, what in NOT_IMPLEMENTED.items()) + ".")
    return p


def _layer_list(text: str) -> tuple:
    """``5,3`` -> (5, 3) for --pipeline-stage-layers."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer counts such as 5,3, got {text!r}") from None


def _virtual_size(a: argparse.Namespace) -> int:
    if a.num_layers_per_virtual_pipeline_stage is not None and a.virtual_pipeline_model_parallel_size:
        raise ConfigError("give --num-layers-per-virtual-pipeline-stage or "
                          "--virtual-pipeline-model-parallel-size, not both")
    if a.num_layers_per_virtual_pipeline_stage is not None:
        per = a.num_layers_per_virtual_pipeline_stage
        stage_layers = a.num_layers // max(1, a.pipeline_model_parallel_size)
        if per < 1 or a.num_layers % a.pipeline_model_parallel_size or stage_layers % per:
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage {per} must divide the layers per pipeline "
                f"stage ({a.num_layers} layers / {a.pipeline_model_parallel_size} stages)")
        return stage_layers // per
    return a.virtual_pipeline_model_parallel_size or 1


def _to_config(a: argparse.Namespace) -> Config:
    vocab = a.vocab_size if a.vocab_size is not None else (4096 if a.mock_data else 0)
    model = ModelConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, ffn_hidden_size=a.ffn_hidden_size,
        num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups if a.group_query_attention else None,
        seq_length=a.seq_length, max_position_embeddings=a.max_position_embeddings, vocab_size=vocab,
        make_vocab_size_divisible_by=a.make_vocab_size_divisible_by, init_method_std=a.init_method_std,
        hidden_dropout=a.hidden_dropout, attention_dropout=a.attention_dropout,
        normalization=a.normalization, layernorm_epsilon=a.norm_epsilon, swiglu=a.swiglu,
        position_embedding_type=a.position_embedding_type, rotary_base=a.rotary_base,
        untie_embeddings_and_output_weights=a.untie_embeddings_and_output_weights,
        add_bias_linear=not a.disable_bias_linear,
        params_dtype="bfloat16" if a.bf16 else "float16" if a.fp16 else "float32",
        attention_backend=a.attention_backend,
        recompute_granularity="selective" if a.recompute_activations else a.recompute_granularity,
        recompute_method=a.recompute_method, recompute_num_layers=a.recompute_num_layers,
        torch_compile=a.torch_compile)
    parallel = ParallelConfig(
        tp=a.tensor_model_parallel_size, pp=a.pipeline_model_parallel_size, vp=_virtual_size(a),
        distributed_backend=a.distributed_backend, pipeline_schedule=a.pipeline_schedule,
        overlap_p2p_comm=a.overlap_p2p_comm,
        decoder_first_pipeline_num_layers=a.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=a.decoder_last_pipeline_num_layers,
        pipeline_stage_layers=a.pipeline_stage_layers, pipeline_balance=a.pipeline_balance,
        sequence_parallel=a.sequence_parallel, distributed_timeout_minutes=a.distributed_timeout_minutes)
    optim = OptimConfig(lr=a.lr, min_lr=a.min_lr, lr_decay_style=a.lr_decay_style,
                        lr_warmup_iters=a.lr_warmup_iters, lr_decay_iters=a.lr_decay_iters,
                        weight_decay=a.weight_decay, adam_beta1=a.adam_beta1, adam_beta2=a.adam_beta2,
                        adam_eps=a.adam_eps, clip_grad=a.clip_grad, loss_scale=a.loss_scale,
                        initial_loss_scale=a.initial_loss_scale, min_loss_scale=a.min_loss_scale,
                        loss_scale_window=a.loss_scale_window, hysteresis=a.hysteresis,
                        accumulate_allreduce_grads_in_fp32=a.accumulate_allreduce_grads_in_fp32 or a.bf16,
                        use_distributed_optimizer=a.use_distributed_optimizer,
                        overlap_grad_reduce=a.overlap_grad_reduce, overlap_param_gather=a.overlap_param_gather,
                        ddp_bucket_size=a.ddp_bucket_size)
    data = DataConfig(
        mock_data=a.mock_data, data_path=tuple(a.data_path or ()),
        train_data_path=tuple(a.train_data_path or ()), valid_data_path=tuple(a.valid_data_path or ()),
        test_data_path=tuple(a.test_data_path or ()), split=a.split, data_cache_path=a.data_cache_path,
        tokenizer_type=a.tokenizer_type, vocab_file=a.vocab_file, merge_file=a.merge_file,
        tokenizer_model=a.tokenizer_model, num_workers=a.num_workers)
    train = TrainConfig(micro_batch_size=a.micro_batch_size, global_batch_size=a.global_batch_size,
                        train_iters=a.train_iters, seed=a.seed, eval_interval=a.eval_interval,
                        eval_iters=a.eval_iters, num_threads=a.num_threads, exit_interval=a.exit_interval,
                        check_for_nan_in_loss_and_grad=a.check_for_nan_in_loss_and_grad,
                        exit_signal_handler=a.exit_signal_handler, exit_duration_in_mins=a.exit_duration_in_mins,
                        skip_train=a.skip_train)
    logging_cfg = LoggingConfig(log_interval=a.log_interval, tensorboard_dir=a.tensorboard_dir,
                                timeline_out=a.timeline_out, peak_tflops=a.peak_tflops)
    ckpt = CheckpointConfig(save=a.save, load=a.load, save_interval=a.save_interval, ckpt_format=a.ckpt_format,
                            finetune=a.finetune, no_load_optim=a.no_load_optim, no_load_rng=a.no_load_rng,
                            ckpt_step=a.ckpt_step, ckpt_keep_last=a.ckpt_keep_last)
    return Config(model, parallel, optim, data, train, ckpt, logging_cfg)


def _positive(**values: Optional[float]) -> None:
    for flag, v in values.items():
        if v is not None and v <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be > 0, got {v:g}")


def _in_range(flag: str, value: Optional[float], lo: float, hi: float, hi_open: bool = True) -> None:
    if value is not None and not (lo <= value < hi if hi_open else lo <= value <= hi):
        raise ConfigError(f"{flag} must be in [{lo:g}, {hi:g}{')' if hi_open else ']'}, got {value:g}")


def _at_least(value: Optional[float], low: float, flag: str) -> None:
    if value is not None and value < low:
        raise ConfigError(f"{flag} must be >= {low:g}, got {value:g}")


def _validate_ranges(cfg: Config) -> None:
    """Value ranges of single flags (one line naming the flag and the legal range)."""
    m, o, t, lg = cfg.model, cfg.optim, cfg.train, cfg.logging
    _positive(lr=o.lr, ffn_hidden_size=m.ffn_hidden_size, make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
              rotary_base=m.rotary_base, init_method_std=m.init_method_std, norm_epsilon=m.layernorm_epsilon,
              max_position_embeddings=m.max_position_embeddings, log_interval=lg.log_interval,
              num_threads=t.num_threads, exit_interval=t.exit_interval, lr_decay_iters=o.lr_decay_iters,
              adam_eps=o.adam_eps, exit_duration_in_mins=t.exit_duration_in_mins,
              distributed_timeout_minutes=cfg.parallel.distributed_timeout_minutes, peak_tflops=lg.peak_tflops)
    _in_range("--hidden-dropout", m.hidden_dropout, 0.0, 1.0)
    _in_range("--attention-dropout", m.attention_dropout, 0.0, 1.0)
    _in_range("--adam-beta1", o.adam_beta1, 0.0, 1.0)
    _in_range("--adam-beta2", o.adam_beta2, 0.0, 1.0)
    for flag, v in (("--lr-warmup-iters", o.lr_warmup_iters), ("--clip-grad", o.clip_grad),
                    ("--weight-decay", o.weight_decay), ("--min-lr", o.min_lr), ("--eval-interval", t.eval_interval),
                    ("--eval-iters", t.eval_iters), ("--seed", t.seed)):
        _at_least(v, 0, flag)
    if o.min_lr > o.lr:
        raise ConfigError(f"--min-lr {o.min_lr:g} is above --lr {o.lr:g}; the schedule decays from --lr to --min-lr")


def validate(cfg: Config, world_size: int) -> None:
    """Check every flag combination that would otherwise fail later; raise ConfigError (one line)."""
    m, par, t = cfg.model, cfg.parallel, cfg.train
    _validate_ranges(cfg)
    _positive(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
              seq_length=m.seq_length, micro_batch_size=t.micro_batch_size,
              global_batch_size=t.global_batch_size, tensor_model_parallel_size=par.tp,
              pipeline_model_parallel_size=par.pp, lr=cfg.optim.lr)
    if t.train_iters < 0:
        raise ConfigError(f"--train-iters must be >= 0, got {t.train_iters}")
    if t.skip_train and (t.eval_iters <= 0 or t.eval_interval <= 0):
        raise ConfigError("--skip-train only evaluates, but --eval-iters or --eval-interval is 0; give both > 0")
    if t.skip_train and not cfg.checkpoint.load:
        raise ConfigError("--skip-train evaluates a trained model: give its checkpoint with --load DIR")
    grid_groups(world_size, par.tp, par.pp)
    dp = world_size // (par.tp * par.pp)
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
                          f"{m.num_attention_heads}")
    if m.num_attention_heads % par.tp:
        raise ConfigError(f"--num-attention-heads {m.num_attention_heads} is not divisible by "
                          f"--tensor-model-parallel-size {par.tp}")
    if m.num_query_groups is not None:
        if m.num_query_groups % par.tp:
            raise ConfigError(f"--num-query-groups {m.num_query_groups} is not divisible by "
                              f"--tensor-model-parallel-size {par.tp}")
        if m.num_query_groups < 1 or m.num_attention_heads % m.num_query_groups:
            raise ConfigError(f"--num-attention-heads {m.num_attention_heads} is not divisible by "
                              f"--num-query-groups {m.num_query_groups}")
    if m.ffn_size % par.tp:
        raise ConfigError(f"ffn hidden size {m.ffn_size} is not divisible by --tensor-model-parallel-size "
                          f"{par.tp}; set --ffn-hidden-size")
    if m.position_embedding_type == "rope" and m.head_dim % 2:
        raise ConfigError(f"rope needs an even head dim, got {m.head_dim}; change --hidden-size")
    if m.position_embedding_type == "learned_absolute" and m.seq_length > m.max_positions:
        raise ConfigError(f"--seq-length {m.seq_length} exceeds --max-position-embeddings "
                          f"{m.max_positions}")
    from megalite.pipeline.partition import validate_partition
    _validate_balance(cfg)
    try:
        if par.pipeline_balance != "measured":  # measured: the split is chosen at startup
            validate_partition(m.num_layers, par.pp, par.vp, par.decoder_first_pipeline_num_layers,
                               par.decoder_last_pipeline_num_layers, par.pipeline_stage_layers)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
            f"{t.micro_batch_size} x data-parallel size {dp}; change one of them")
    from megalite.pipeline.schedules import default_schedule_name, validate_schedule
    num_mb = t.global_batch_size // (t.micro_batch_size * dp)
    name = par.pipeline_schedule or default_schedule_name(par.pp, par.vp)
    try:
        validate_schedule(name, par.pp, par.vp, num_mb)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _validate_zero_bubble(cfg, name, dp)
    _validate_precision_and_memory(cfg, dp)
    if cfg.data.mock_data and (cfg.data.data_path or cfg.data.train_data_path):
        raise ConfigError("--mock-data and --data-path/--train-data-path are exclusive; pass one")
    if cfg.data.mock_data and m.vocab_size < 2:
        raise ConfigError("--mock-data needs --vocab-size >= 2")


def _validate_balance(cfg: Config) -> None:
    """--pipeline-balance measured chooses the split itself: it needs stages to split and no split given."""
    par, layers = cfg.parallel, cfg.model.num_layers
    if par.pipeline_balance != "measured":
        return
    given = [f for f, v in (("--pipeline-stage-layers", par.pipeline_stage_layers),
                            ("--decoder-first-pipeline-num-layers", par.decoder_first_pipeline_num_layers),
                            ("--decoder-last-pipeline-num-layers", par.decoder_last_pipeline_num_layers)) if v]
    if given:
        raise ConfigError(f"--pipeline-balance measured chooses the split of layers itself; drop {given[0]}")
    if par.pp == 1:
        raise ConfigError("--pipeline-balance measured needs --pipeline-model-parallel-size > 1 (one stage has "
                          "nothing to balance)")
    if layers < par.pp * par.vp:
        raise ConfigError(f"--pipeline-balance measured needs --num-layers >= pp x vp = {par.pp * par.vp} (one "
                          f"layer per virtual stage), got {layers}")


def _validate_zero_bubble(cfg: Config, name: str, dp: int) -> None:
    """Combinations the split backward (SPLIT_BACKWARD) or the V layout (V_SCHEDULES) cannot run."""
    par = cfg.parallel
    if name not in SPLIT_BACKWARD:
        return
    if cfg.model.torch_compile:
        raise ConfigError(f"--pipeline-schedule {name} splits each backward into input and weight gradients, "
                          f"which torch.compile'd layers do not support; drop --torch-compile")
    if name not in V_SCHEDULES:
        return
    if par.decoder_first_pipeline_num_layers or par.decoder_last_pipeline_num_layers:
        raise ConfigError(f"--decoder-first/last-pipeline-num-layers are not supported with --pipeline-schedule "
                          f"{name} (a V puts the first and last stage on one rank); use --pipeline-stage-layers")
    if cfg.model.tied_embeddings and cfg.optim.overlap_grad_reduce and dp > 1:
        raise ConfigError(f"--pipeline-schedule {name} with tied embeddings uses the embedding twice on rank 0, "
                          "which --overlap-grad-reduce cannot count; add --untie-embeddings-and-output-weights "
                          "or drop --overlap-grad-reduce")
    if cfg.checkpoint.ckpt_format == "torch" and (cfg.checkpoint.save or cfg.checkpoint.load):
        raise ConfigError(f"--ckpt-format torch stores Megatron's interleaved chunk layout, not {name}'s V; "
                          f"use --ckpt-format sharded with --pipeline-schedule {name}")


def _validate_precision_and_memory(cfg: Config, dp: int) -> None:
    m, o, par = cfg.model, cfg.optim, cfg.parallel
    if m.recompute_granularity == "full" and m.recompute_method is None:
        raise ConfigError("--recompute-granularity full needs --recompute-method uniform or block")
    if m.recompute_method is not None and m.recompute_granularity != "full":
        raise ConfigError("--recompute-method applies to --recompute-granularity full only; "
                          "drop it or add --recompute-granularity full")
    if m.recompute_num_layers < 1:
        raise ConfigError(f"--recompute-num-layers must be >= 1, got {m.recompute_num_layers}")
    if par.sequence_parallel and m.seq_length % par.tp:
        raise ConfigError(f"--sequence-parallel needs --seq-length {m.seq_length} divisible by "
                          f"--tensor-model-parallel-size {par.tp}")
    if o.overlap_param_gather and not (o.use_distributed_optimizer and o.overlap_grad_reduce):
        raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce")
    if m.params_dtype == "float16":
        _positive(initial_loss_scale=o.initial_loss_scale, min_loss_scale=o.min_loss_scale,
                  loss_scale_window=o.loss_scale_window, hysteresis=o.hysteresis, loss_scale=o.loss_scale)
    _positive(ddp_bucket_size=o.ddp_bucket_size, save_interval=cfg.checkpoint.save_interval,
              ckpt_keep_last=cfg.checkpoint.ckpt_keep_last)
    if cfg.checkpoint.save_interval and not cfg.checkpoint.save:
        raise ConfigError("--save-interval needs --save DIR")
    if cfg.data.num_workers < 0:
        raise ConfigError(f"--num-workers must be >= 0, got {cfg.data.num_workers}")


def _join_negative_values(argv: Sequence[str]) -> List[str]:
    """``--lr -1e-3`` -> ``--lr=-1e-3``: argparse would take a negative exponent literal for a flag."""
    out: List[str] = []
    for tok in argv:
        # argparse itself takes -1 and -0.5 as values (and a weighted --data-path needs them as
        # separate tokens); only forms it would read as flags, like -1e-3, are joined.
        if out and out[-1].startswith("--") and "=" not in out[-1] \
                and re.fullmatch(r"-(\d+\.?\d*|\.\d+)e[-+]?\d+|-inf|-nan", tok, re.IGNORECASE):
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


def _unknown_flag_error(parser: argparse.ArgumentParser, unknown: List[str]) -> ConfigError:
    flags = [u.split("=")[0] for u in unknown if u.startswith("-")]
    known = [o for a in parser._actions for o in a.option_strings]
    for flag in flags:
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        if close:
            return ConfigError(f"unrecognized argument {flag}; did you mean {close[0]}? (see --help)")
    return ConfigError(f"unrecognized arguments: {' '.join(unknown)} (see --help)")


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> Config:
    """Parse and validate a command line; ``world_size`` defaults to $WORLD_SIZE (or 1)."""
    parser = build_parser()
    argv = _join_negative_values(sys.argv[1:] if argv is None else list(argv))
    try:
        args, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ConfigError(str(e)) from None
    if unknown:
        raise _unknown_flag_error(parser, unknown)
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ConfigError("--num-query-groups needs --group-query-attention (without it every head has its own "
                          "key/value group)")
    used: List[str] = [f for f in NOT_IMPLEMENTED if getattr(args, f[2:].replace("-", "_")) is not None]
    if used:
        flag = used[0]
        raise ConfigError(f"{flag} is not implemented yet ({NOT_IMPLEMENTED[flag]} is on the roadmap); "
                          f"remove the flag")
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive; pass one")
    cfg = _to_config(args)
    if cfg.parallel.sequence_parallel and cfg.parallel.tp == 1:  # as Megatron: nothing to split
        cfg = cfg.with_(parallel=replace(cfg.parallel, sequence_parallel=False))
    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size)
    return cfg
