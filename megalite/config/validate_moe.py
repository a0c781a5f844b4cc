"""Up-front checks of the mixture-of-experts flags (validate.py calls them): one ConfigError line each."""

from __future__ import annotations

from dataclasses import fields

from megalite.checkpointing.format_info import format_info, layout_free_format
from megalite.config import Config, ConfigError
from megalite.config.moe import ExpertParallelFields, MoEModelFields


def _flag(cls, name: str) -> str:
    return next(f.metadata["cli"].own.name for f in fields(cls) if f.name == name)


def validate_moe(cfg: Config, world_size: int) -> None:
    """Experts against the rank grid and the model; MoE flags without --num-experts are refused."""
    m, par = cfg.model, cfg.parallel
    if not m.is_moe:
        defaults = MoEModelFields()
        given = [
            _flag(MoEModelFields, f.name)
            for f in fields(MoEModelFields)
            if f.name != "num_experts" and getattr(m, f.name) != getattr(defaults, f.name)
        ]
        given += [_flag(ExpertParallelFields, f) for f in ("ep", "etp") if getattr(par, f) not in (1, None)]
        given += [
            _flag(ExpertParallelFields, f)
            for f in ("moe_token_dispatcher_type", "overlap_moe_expert_parallel_comm")
            if getattr(par, f) != getattr(ExpertParallelFields(), f)
        ]
        given += ["--moe-per-layer-logging"] if cfg.logging.moe_per_layer_logging else []
        if given:
            raise ConfigError(
                f"{given[0]} is a mixture-of-experts flag but --num-experts is not set; add "
                f"--num-experts N or drop {given[0]}"
            )
        return
    if par.overlap_moe_expert_parallel_comm:
        if par.pipeline_schedule != "dualpipev":
            raise ConfigError(
                "--overlap-moe-expert-parallel-comm overlaps the forward and backward DualPipeV "
                "pairs; add --pipeline-schedule dualpipev"
            )
        if m.hidden_dropout or m.attention_dropout:
            raise ConfigError(
                "--overlap-moe-expert-parallel-comm runs two micro-batches at once, which dropout's "
                "shared random state does not allow; set --hidden-dropout 0 --attention-dropout 0"
            )
    n, ep, etp = m.num_experts, par.ep, par.expert_tp
    if n % ep:
        raise ConfigError(
            f"--num-experts {n} is not divisible by --expert-model-parallel-size {ep}; each "
            f"expert-parallel rank holds num_experts / ep experts"
        )
    per_stage = (
        par.tp
        * par.cp
        * (world_size // (par.tp * par.pp * par.cp) if world_size % (par.tp * par.pp * par.cp) == 0 else 1)
    )
    if per_stage % (ep * etp):
        raise ConfigError(
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} = {ep * etp} "
            f"does not divide the {per_stage} ranks of a pipeline stage (tp x cp x dp); change ep "
            f"or etp"
        )
    check_moe_model(m)
    if par.tp > 1 and not par.sequence_parallel:
        raise ConfigError(
            "mixture of experts with --tensor-model-parallel-size > 1 needs --sequence-parallel "
            "(each rank routes its own sequence shard)"
        )
    if m.moe_ffn_size % etp:
        raise ConfigError(
            f"--moe-ffn-hidden-size {m.moe_ffn_size} is not divisible by --expert-tensor-parallel-size {etp}"
        )
    shared = m.moe_shared_expert_intermediate_size
    if shared is not None and shared % par.tp:
        raise ConfigError(
            f"--moe-shared-expert-intermediate-size {shared} is not divisible by --tensor-model-parallel-size {par.tp}"
        )
    ck = cfg.checkpoint
    fmt = format_info(ck.ckpt_format)
    if fmt.files_per_tp_rank and (ck.save or ck.load) and par.tp % etp:
        raise ConfigError(
            f"--ckpt-format {fmt.name} writes one file per tensor-parallel rank, which cannot hold "
            f"the expert shards of --expert-tensor-parallel-size {etp} (not a divisor of "
            f"--tensor-model-parallel-size {par.tp}); use --ckpt-format {layout_free_format()}"
        )


def check_moe_model(m) -> None:
    """The MoE model's own rules (no rank grid): validate_moe's, and tools/plan.py's for its model flags."""
    n, k = m.num_experts, m.moe_router_topk
    for flag, v in (
        ("--num-experts", n),
        ("--moe-router-topk", k),
        ("--moe-ffn-hidden-size", m.moe_ffn_size),
        ("--moe-shared-expert-intermediate-size", m.moe_shared_expert_intermediate_size),
    ):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} must be > 0, got {v}")
    if k > n:
        raise ConfigError(f"--moe-router-topk {k} is more than --num-experts {n}; lower the top-k")
    if m.moe_expert_capacity_factor is not None and not 0 < m.moe_expert_capacity_factor < float("inf"):
        raise ConfigError(
            f"--moe-expert-capacity-factor must be > 0, got {m.moe_expert_capacity_factor:g}; "
            f"leave it unset for dropless routing"
        )
    if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        raise ConfigError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    defaults = MoEModelFields()
    unused = [
        (
            "--moe-token-drop-policy",
            m.moe_token_drop_policy != defaults.moe_token_drop_policy and m.moe_expert_capacity_factor is None,
            "--moe-expert-capacity-factor (dropless routing drops nothing)",
        ),
        (
            "--moe-router-bias-update-rate",
            m.moe_router_bias_update_rate != defaults.moe_router_bias_update_rate
            and not m.moe_router_enable_expert_bias,
            "--moe-router-enable-expert-bias",
        ),
        (
            "--moe-aux-loss-coeff",
            m.moe_aux_loss_coeff > 0 and m.moe_router_load_balancing_type == "none",
            "--moe-router-load-balancing-type aux_loss or seq_aux_loss (it is none)",
        ),
        (
            "--moe-router-pre-softmax",
            m.moe_router_pre_softmax and m.moe_router_score_function == "sigmoid",
            "--moe-router-score-function softmax (the sigmoid router has no softmax)",
        ),
    ]
    for flag, bad, needs in unused:
        if bad:
            raise ConfigError(f"{flag} has no effect without {needs}; add it or drop {flag}")
    if isinstance(m.moe_layer_freq, tuple) and len(m.moe_layer_freq) != m.num_layers:
        raise ConfigError(
            f"--moe-layer-freq lists {len(m.moe_layer_freq)} layers but --num-layers is "
            f"{m.num_layers}; give one 0/1 per layer"
        )
    if m.num_moe_layers == 0:
        raise ConfigError("--moe-layer-freq makes no layer an MoE layer; mark at least one layer 1")
    if m.moe_shared_expert_gate and m.moe_shared_expert_intermediate_size is None:
        raise ConfigError("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        raise ConfigError(
            "--moe-router-enable-expert-bias (auxiliary-loss-free balancing) needs --moe-router-score-function sigmoid"
        )
