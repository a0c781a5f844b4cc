"""Up-front checks of --data-parallel-sharding-strategy and its companions (validate.py calls them)."""

from __future__ import annotations

from typing import Sequence

from megalite.config import Config, ConfigError
from megalite.config.settings import RunSettings

STRATEGY = "--data-parallel-sharding-strategy"


def validate_sharding(cfg: Config, settings: RunSettings) -> None:
    """The strategy against the other flags and the rank grid; one ConfigError line each."""
    o, par = cfg.optim, cfg.parallel
    given = o.data_parallel_sharding_strategy
    if o.use_torch_fsdp2 and given not in (None, "optim_grads_params"):
        raise ConfigError(
            f"--use-torch-fsdp2 means {STRATEGY} optim_grads_params, but {STRATEGY} {given} was given; drop one"
        )
    if given == "no_shard" and o.use_distributed_optimizer:
        raise ConfigError(
            f"{STRATEGY} no_shard contradicts --use-distributed-optimizer (which shards the optimizer: optim); drop one"
        )
    strategy, replicas = o.sharding, settings.dp * par.cp
    n = o.num_distributed_optimizer_instances
    check_sharding_companions((strategy,), o.reshard_after_forward, n)
    if n > 1 and (replicas % n or replicas // n < 2):
        raise ConfigError(
            f"--num-distributed-optimizer-instances {n} must divide the data-parallel x context-parallel size "
            f"{replicas} and leave at least 2 ranks per instance to shard over; choose a divisor of {replicas} "
            f"below {replicas}"
        )
    if o.fsdp and settings.spec.split_backward:
        raise ConfigError(
            f"{STRATEGY} {strategy} cannot run --pipeline-schedule {settings.schedule}: its split backward "
            f"computes weight gradients after FSDP has reduced them; use 1f1b or interleaved, or {STRATEGY} optim"
        )


def check_sharding_companions(
    strategies: Sequence[str], reshard_after_forward: bool, instances: int, who: str = "this run"
) -> None:
    """--no-reshard-after-forward and --num-distributed-optimizer-instances against the strategies a run uses
    (one) or tools/plan.py searches (``who``: whose strategies the message names); one ConfigError line each."""
    names = ", ".join(strategies)
    if not reshard_after_forward and "optim_grads_params" not in strategies:
        raise ConfigError(
            f"--no-reshard-after-forward applies to {STRATEGY} optim_grads_params ({who}: {names}); drop it"
        )
    if instances > 1 and not any(s in ("optim_grads", "optim_grads_params") for s in strategies):
        raise ConfigError(
            f"--num-distributed-optimizer-instances {instances} (hybrid sharding) needs {STRATEGY} optim_grads or "
            f"optim_grads_params ({who}: {names})"
        )
