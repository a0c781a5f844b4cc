"""Flag checks that need what only a starting job knows: the world, the device, the data found, the built model.

They are flag errors all the same, so they live here and raise :class:`ConfigError` (one line naming
the flag and what to do), and every ConfigError of a run comes from this package. validate.py runs
the ones it can before any process group exists; the runtime calls the rest at the point it learns
the fact (the ParallelState it was handed, the dataset split it built, the parameter it looked for).
"""

from __future__ import annotations

import importlib.util
from typing import Tuple

from megalite.config.sections import Config, ConfigError, DataConfig, TrainConfig

__all__ = [
    "check_profiling_flags",
    "require_wandb",
    "check_fault_injection",
    "check_fault_flags",
    "check_tokenizer_given",
    "check_training_documents",
    "parse_perturb",
    "check_perturb_found",
    "check_layout_matches",
    "check_dense_sizes",
    "check_expert_sizes",
]

_PERTURB_EXAMPLE = "decoder.layers.1.mlp.linear_fc1.weight"


def check_profiling_flags(cfg: Config, world_size: int) -> None:
    """--profile-* and --wandb-* against each other, the world and the installed packages (ConfigError)."""
    lg = cfg.logging
    if lg.profile and lg.profile_step_end <= lg.profile_step_start:
        raise ConfigError(
            f"--profile-step-end {lg.profile_step_end} must be above --profile-step-start "
            f"{lg.profile_step_start}: the traced iterations are start + 1 to end"
        )
    outside = [r for r in lg.profile_ranks if not 0 <= r < world_size]
    if lg.profile and outside:
        raise ConfigError(
            f"--profile-ranks {outside[0]} is not a rank of this world of {world_size} (ranks 0 to {world_size - 1})"
        )
    if lg.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--wandb-project needs the wandb package: pip install wandb (or drop the --wandb-* flags)")
    if (lg.wandb_exp_name or lg.wandb_save_dir) and not lg.wandb_project:
        raise ConfigError("--wandb-exp-name and --wandb-save-dir need --wandb-project (the project to log to)")
    if 0 < lg.straggler_threshold <= 1:  # at 1 or below every rank, the fastest too, is at its peers' median or over
        raise ConfigError(
            f"--straggler-threshold {lg.straggler_threshold:g} must be above 1: a rank is named at that many times "
            "its peers' median (default 1.5); 0 turns the check off"
        )


def require_wandb():
    """The wandb module for --wandb-project; a broken install is one ConfigError line."""
    try:
        import wandb
    except ImportError as e:
        raise ConfigError("--wandb-project needs the wandb package: pip install wandb") from e
    return wandb


def check_fault_injection(train_cfg: TrainConfig, world_size: int) -> None:
    """Refuse --inject-fault-rank outside the world before any iteration runs (ConfigError)."""
    if train_cfg.inject_fault_at_iteration is not None and train_cfg.inject_fault_rank >= world_size:
        raise ConfigError(
            f"--inject-fault-rank {train_cfg.inject_fault_rank} is not a rank of this world of "
            f"{world_size}; give 0..{world_size - 1}"
        )


def check_fault_flags(cfg: Config) -> None:
    """Refuse --inject-fault-* flags that could never fire (ConfigError): a test that injects no fault passes.

    The fault strikes as iteration K begins, so K must be one of the run's --train-iters; skip-send
    drops a pipeline send, so it needs pipeline stages; and a kind or rank without the iteration names
    no moment at all. Rank against the world is check_fault_injection's (it needs the world size).
    """
    t = cfg.train
    at, kind = t.inject_fault_at_iteration, t.inject_fault_kind
    if at is None:
        given = [
            f
            for f, set_ in (("--inject-fault-kind", kind != "kill"), ("--inject-fault-rank", t.inject_fault_rank))
            if set_
        ]
        if given:
            raise ConfigError(f"{given[0]} needs --inject-fault-at-iteration K (the iteration the fault strikes)")
        return
    if t.skip_train or at > t.train_iters:
        runs = "no iterations (--skip-train)" if t.skip_train else f"iterations 1 to {t.train_iters} (--train-iters)"
        raise ConfigError(
            f"--inject-fault-at-iteration {at} never comes: the run trains {runs}; give an iteration it reaches"
        )
    if kind == "skip-send" and cfg.parallel.pp == 1:
        raise ConfigError(
            "--inject-fault-kind skip-send drops a pipeline send, but --pipeline-model-parallel-size is 1 "
            "(no sends); use --pipeline-model-parallel-size > 1 or another --inject-fault-kind"
        )


def check_tokenizer_given(data: DataConfig) -> None:
    """Real data (after the default corpus was filled in) needs a tokenizer to size the vocabulary."""
    if not data.tokenizer_type:
        raise ConfigError(
            "--data-path needs --tokenizer-type (e.g. GPT2BPETokenizer with --vocab-file and --merge-file)"
        )


def check_training_documents(data: DataConfig, found: bool) -> None:
    """The --split's training part must hold documents when training iterations are asked for."""
    if not found:
        raise ConfigError(
            f"--split {data.split!r} leaves no training documents; give the train "
            f"part a weight or pass --train-data-path"
        )


def parse_perturb(text: str) -> Tuple[str, float]:
    """``NAME=EPS`` (--perturb) -> (global parameter name, eps); ConfigError naming the flag otherwise."""
    name, sep, eps = text.partition("=")
    try:
        value = float(eps)
    except ValueError:
        value = None
    if not sep or not name or value is None:
        raise ConfigError(
            f"--perturb {text!r}: give NAME=EPS, a global parameter name and the size of the change, "
            f"e.g. {_PERTURB_EXAMPLE}=1e-3"
        )
    return name, value


def check_perturb_found(name: str, found: bool) -> None:
    """--perturb names a parameter some rank holds."""
    if not found:
        raise ConfigError(
            f"--perturb: the model has no parameter named {name!r}; give a global name such as {_PERTURB_EXAMPLE}"
        )


def check_layout_matches(cfg: Config, tp: int, pp: int, cp: int, ep: int, etp: int) -> None:
    """The config and the ParallelState handed to the Trainer describe the same grid."""
    par = cfg.parallel
    if (par.tp, par.pp, par.cp) != (tp, pp, cp):
        raise ConfigError(
            f"the config asks for tp {par.tp} x pp {par.pp} x cp {par.cp} "
            f"but the ParallelState has tp {tp} x pp {pp} x cp {cp}; "
            "build both from the same flags"
        )
    if cfg.model.is_moe and (par.ep, par.expert_tp) != (ep, etp):
        raise ConfigError(
            f"the config asks for ep {par.ep} x etp {par.expert_tp} but the "
            f"ParallelState has ep {ep} x etp {etp}; build both from the same flags"
        )


def check_fsdp_leaves_out(cfg: Config, supported: bool) -> None:
    """An MoE under FSDP keeps some parameters out of it (the router's expert bias; experts with one rank per
    expert data-parallel group), which needs ``fully_shard(ignored_params=...)`` (torch >= 2.7)."""
    if not supported:
        import torch

        raise ConfigError(
            f"--data-parallel-sharding-strategy {cfg.optim.sharding} with this mixture of experts needs torch >= 2.7 "
            f"(FSDP2's ignored_params; this is torch {torch.__version__}): upgrade torch or use "
            "--data-parallel-sharding-strategy optim"
        )


def check_dense_sizes(world_size: int, tp: int, pp: int, cp: int) -> None:
    """tp x pp x cp divides the world (the rest is data parallel)."""
    if tp < 1 or pp < 1 or cp < 1 or world_size % (tp * pp * cp) != 0:
        with_cp = f" x context-parallel-size ({cp})" if cp != 1 else ""
        raise ConfigError(
            f"world size {world_size} is not divisible by tensor-model-parallel-size ({tp}) x "
            f"pipeline-model-parallel-size ({pp}){with_cp}; change the parallel sizes or the number of "
            f"processes"
        )


def check_expert_sizes(stage_ranks: int, ep: int, etp: int) -> None:
    """ep x etp divides the ranks of a pipeline stage (the rest is expert data parallel)."""
    if ep < 1 or etp < 1 or stage_ranks % (ep * etp):
        raise ConfigError(
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} does not "
            f"divide the {stage_ranks} ranks of a pipeline stage (tp x cp x dp); change ep or etp"
        )
