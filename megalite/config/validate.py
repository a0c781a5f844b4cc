"""Up-front validation of a ``Config``: every flag combination that would fail later, refused first.

It runs before any process group exists; each failure is one ``ConfigError`` line naming
the flag(s) at fault and what to change. The range of a single flag is declared next to its
field in config.py (``gt``/``ge``/``lt``) and checked here in field order; the rest are rules
between flags. The derived settings (data-parallel size, micro-batches, schedule, split of
layers) are worked out by settings.resolve_settings, which raises for those that cannot be.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Iterator, Optional, Tuple

from megalite.checkpointing.format_info import format_info, layout_free_format
from megalite.config import Config, ConfigError, ModelConfig
from megalite.config.checks import check_fault_flags, check_profiling_flags
from megalite.config.flags import FieldFlags, flag_fields
from megalite.config.settings import RunSettings, resolve_settings
from megalite.config.validate_fp8 import check_fp8
from megalite.config.validate_moe import validate_moe
from megalite.config.validate_sharding import validate_sharding
from megalite.parallel.state import grid_groups


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _ranged_fields(section: object) -> Iterator[Tuple[str, FieldFlags, object]]:
    """(flag, declaration, value) of every field of one config section that declares a range, in field order."""
    for f, cli in flag_fields(section):
        if cli.own is not None and (cli.gt, cli.ge, cli.lt) != (None, None, None):
            yield cli.own.name, cli, getattr(section, f.name)


def check_section_ranges(section: object) -> None:
    """Raise ConfigError for the first field of one config section outside its declared range (None: unset)."""
    for flag, cli, v in _ranged_fields(section):
        if v is None:
            continue
        if cli.gt is not None and not v > cli.gt:
            raise ConfigError(f"{flag} must be > {cli.gt:g}, got {_number(v)}")
        if cli.lt is not None and not (cli.ge <= v < cli.lt):
            raise ConfigError(f"{flag} must be in [{cli.ge:g}, {cli.lt:g}), got {_number(v)}")
        if cli.ge is not None and not v >= cli.ge:
            raise ConfigError(f"{flag} must be >= {cli.ge:g}, got {_number(v)}")


def check_ranges(cfg: Config) -> None:
    """Raise ConfigError for the first field outside its declared range, in section and field order."""
    for section in fields(cfg):
        check_section_ranges(getattr(cfg, section.name))


def check_model(m: ModelConfig) -> None:
    """The model's own rules, with no rank grid, data or device: its flags' declared ranges, heads and
    query groups, rope's even head dimension, the activation, the position table. ``validate`` applies
    them for pretrain_gpt.py; tools/plan.py applies the same to the model it plans (a model the run
    would refuse must not get a launch command). ConfigError (one line) at the first broken rule."""
    check_section_ranges(m)
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}"
        )
    if m.num_query_groups is not None and (m.num_query_groups < 1 or m.num_attention_heads % m.num_query_groups):
        raise ConfigError(
            f"--num-attention-heads {m.num_attention_heads} is not divisible by --num-query-groups {m.num_query_groups}"
        )
    if m.position_embedding_type == "rope" and m.head_dim % 2:
        raise ConfigError(f"rope needs an even head dim, got {m.head_dim}; change --hidden-size")
    if m.openai_gelu and m.swiglu:
        raise ConfigError("--openai-gelu selects the GeLU of the plain MLP, but --swiglu uses SiLU; drop one of them")
    if m.position_embedding_type == "learned_absolute" and m.seq_length > m.max_positions:
        raise ConfigError(f"--seq-length {m.seq_length} exceeds --max-position-embeddings {m.max_positions}")


def _positive(**values: Optional[float]) -> None:
    for flag, v in values.items():
        if v is not None and v <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be > 0, got {_number(v)}")


def validate(cfg: Config, world_size: int) -> RunSettings:
    """Check every flag combination that would otherwise fail later; raise ConfigError (one line).

    Returns the run's derived settings (settings.resolve_settings), worked out on the way.
    """
    m, par, t, o = cfg.model, cfg.parallel, cfg.train, cfg.optim
    check_ranges(cfg)
    if o.min_lr > o.lr:
        raise ConfigError(f"--min-lr {o.min_lr:g} is above --lr {o.lr:g}; the schedule decays from --lr to --min-lr")
    if t.skip_train and (t.eval_iters <= 0 or t.eval_interval <= 0):
        raise ConfigError("--skip-train only evaluates, but --eval-iters or --eval-interval is 0; give both > 0")
    if t.eval_interval == 0 and t.eval_iters > 0:  # Megatron's loop skips it, but its split sizing divides by it
        raise ConfigError(
            f"--eval-interval 0 with --eval-iters {t.eval_iters}: give --eval-interval N > 0 to "
            "evaluate every N iterations (N >= --train-iters: only at the end), or --eval-iters 0 "
            "for no evaluation"
        )
    if t.skip_train and not cfg.checkpoint.load:
        raise ConfigError("--skip-train evaluates a trained model: give its checkpoint with --load DIR")
    if par.cp > 1 and par.tp * par.pp * par.cp > world_size:
        raise ConfigError(
            f"--tensor-model-parallel-size {par.tp} x --pipeline-model-parallel-size {par.pp} x "
            f"--context-parallel-size {par.cp} = {par.tp * par.pp * par.cp} ranks, more than the world "
            f"size {world_size}; lower the parallel sizes or launch more processes"
        )
    grid_groups(world_size, par.tp, par.pp, par.cp)
    check_model(m)
    if m.num_attention_heads % par.tp:
        raise ConfigError(
            f"--num-attention-heads {m.num_attention_heads} is not divisible by --tensor-model-parallel-size {par.tp}"
        )
    if m.num_query_groups is not None and m.num_query_groups % par.tp:
        raise ConfigError(
            f"--num-query-groups {m.num_query_groups} is not divisible by --tensor-model-parallel-size {par.tp}"
        )
    if m.ffn_size % par.tp:
        raise ConfigError(
            f"ffn hidden size {m.ffn_size} is not divisible by --tensor-model-parallel-size "
            f"{par.tp}; set --ffn-hidden-size"
        )
    validate_moe(cfg, world_size)
    _validate_balance(cfg)
    _validate_context_parallel(cfg)
    check_profiling_flags(cfg, world_size)  # --profile-*, --wandb-* (checks.py)
    check_fault_flags(cfg)  # --inject-fault-* that could never fire
    settings = resolve_settings(cfg, world_size)  # split of layers, micro-batches, schedule
    _validate_zero_bubble(cfg, settings)
    check_fp8(cfg, settings)
    validate_sharding(cfg, settings)
    _validate_precision_and_memory(cfg)
    if cfg.data.mock_data and (cfg.data.data_path or cfg.data.train_data_path):
        raise ConfigError("--mock-data and --data-path/--train-data-path are exclusive; pass one")
    if cfg.data.mock_data and m.vocab_size < 2:
        raise ConfigError("--mock-data needs --vocab-size >= 2")
    return settings


def _validate_context_parallel(cfg: Config) -> None:
    """What splitting every sequence over --context-parallel-size ranks needs (nothing when cp is 1)."""
    m, par = cfg.model, cfg.parallel
    if par.cp == 1:
        return
    chunks = 2 * par.cp * (par.tp if par.sequence_parallel else 1)
    if m.seq_length % chunks:
        sp = " x --tensor-model-parallel-size (with --sequence-parallel)" if par.sequence_parallel else ""
        raise ConfigError(
            f"--seq-length {m.seq_length} is not divisible by 2 x --context-parallel-size{sp} = "
            f"{chunks} (each CP rank holds two of 2 x CP load-balanced chunks); change --seq-length "
            f"or --context-parallel-size"
        )
    if par.cp_comm_type == "a2a":
        for flag, n in (("--num-attention-heads", m.num_attention_heads), ("--num-query-groups", m.query_groups)):
            if (n // par.tp) % par.cp:
                raise ConfigError(
                    f"--cp-comm-type a2a splits the heads of each rank over the CP group, but {flag} "
                    f"{n} / --tensor-model-parallel-size {par.tp} is not divisible by "
                    f"--context-parallel-size {par.cp}; use --cp-comm-type p2p or all_gather"
                )
    if par.cp_comm_type == "p2p" and m.attention_dropout > 0:
        raise ConfigError(
            f"--cp-comm-type p2p (ring attention) does not support --attention-dropout "
            f"{m.attention_dropout:g}; set --attention-dropout 0 or use --cp-comm-type all_gather/a2a"
        )


def _validate_balance(cfg: Config) -> None:
    """--pipeline-balance measured chooses the split itself: it needs stages to split and no split given."""
    par, layers = cfg.parallel, cfg.model.num_layers
    if par.pipeline_balance != "measured":
        return
    given = [
        f
        for f, v in (
            ("--pipeline-stage-layers", par.pipeline_stage_layers),
            ("--decoder-first-pipeline-num-layers", par.decoder_first_pipeline_num_layers),
            ("--decoder-last-pipeline-num-layers", par.decoder_last_pipeline_num_layers),
        )
        if v
    ]
    if given:
        raise ConfigError(f"--pipeline-balance measured chooses the split of layers itself; drop {given[0]}")
    if par.pp == 1:
        raise ConfigError(
            "--pipeline-balance measured needs --pipeline-model-parallel-size > 1 (one stage has nothing to balance)"
        )
    if layers < par.pp * par.vp:
        raise ConfigError(
            f"--pipeline-balance measured needs --num-layers >= pp x vp = {par.pp * par.vp} (one "
            f"layer per virtual stage), got {layers}"
        )


def _validate_zero_bubble(cfg: Config, settings: RunSettings) -> None:
    """Combinations a split backward or a V stage layout (the schedule's registry entry) cannot run."""
    par, name = cfg.parallel, settings.schedule
    if not settings.spec.split_backward:
        return
    if cfg.model.torch_compile:
        raise ConfigError(
            f"--pipeline-schedule {name} splits each backward into input and weight gradients, "
            f"which torch.compile'd layers do not support; drop --compile (--torch-compile)"
        )
    if not settings.spec.v_shape:
        return
    if par.decoder_first_pipeline_num_layers or par.decoder_last_pipeline_num_layers:
        raise ConfigError(
            f"--decoder-first/last-pipeline-num-layers are not supported with --pipeline-schedule "
            f"{name} (a V puts the first and last stage on one rank); use --pipeline-stage-layers"
        )
    if cfg.model.tied_embeddings and cfg.optim.overlap_grad_reduce and settings.dp > 1:
        raise ConfigError(
            f"--pipeline-schedule {name} with tied embeddings uses the embedding twice on rank 0, "
            "which --overlap-grad-reduce cannot count; add --untie-embeddings-and-output-weights "
            "or drop --overlap-grad-reduce"
        )
    fmt = format_info(cfg.checkpoint.ckpt_format)
    if not fmt.layout_free and (cfg.checkpoint.save or cfg.checkpoint.load):
        raise ConfigError(
            f"--ckpt-format {fmt.name} stores Megatron's interleaved chunk layout, not {name}'s V; "
            f"use --ckpt-format {layout_free_format()} with --pipeline-schedule {name}"
        )


def _validate_precision_and_memory(cfg: Config) -> None:
    m, o, par = cfg.model, cfg.optim, cfg.parallel
    if m.recompute_granularity == "full" and m.recompute_method is None:
        raise ConfigError("--recompute-granularity full needs --recompute-method uniform or block")
    if m.recompute_method is not None and m.recompute_granularity != "full":
        raise ConfigError(
            "--recompute-method applies to --recompute-granularity full only; "
            "drop it or add --recompute-granularity full"
        )
    if par.sequence_parallel and m.seq_length % par.tp:
        raise ConfigError(
            f"--sequence-parallel needs --seq-length {m.seq_length} divisible by --tensor-model-parallel-size {par.tp}"
        )
    if o.overlap_param_gather and not o.fsdp and not (o.use_distributed_optimizer and o.overlap_grad_reduce):
        raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce")
    if m.params_dtype == "float16":  # loss scaling is used with fp16 only
        _positive(
            initial_loss_scale=o.initial_loss_scale,
            min_loss_scale=o.min_loss_scale,
            loss_scale_window=o.loss_scale_window,
            hysteresis=o.hysteresis,
            loss_scale=o.loss_scale,
        )
    if cfg.checkpoint.save_interval and not cfg.checkpoint.save:
        raise ConfigError("--save-interval needs --save DIR")
