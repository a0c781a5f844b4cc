"""Run settings derived from the configuration and the world size, worked out once.

The data-parallel size, the micro-batches per step, the pipeline schedule (its
name, registry entry and stage layout) and the layers of every virtual stage
follow from a ``Config`` and the number of processes. ``resolve_settings``
computes them in one place (validation calls it, training reads its result)
instead of every consumer repeating ``global_batch // (micro_batch * dp)`` or
``pipeline_schedule or default_schedule_name(pp, vp)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from megalite.config import Config, ConfigError
from megalite.parallel.state import grid_groups
from megalite.pipeline.partition import stage_layer_counts
from megalite.pipeline.registry import ScheduleSpec, default_schedule_name, get_schedule, layout_for, validate_schedule
from megalite.pipeline.stage_layout import StageLayout


@dataclass(frozen=True)
class RunSettings:
    """Everything derived from (Config, world size).

    ``stage_layers`` lists the layers of every virtual stage in stage order; it is
    None while ``--pipeline-balance measured`` has not chosen the split yet (the
    trainer measures at startup and resolves again with the chosen split).
    """

    dp: int
    num_microbatches: int
    schedule: str
    spec: ScheduleSpec
    layout: StageLayout
    stage_layers: Optional[Tuple[int, ...]]


def resolve_settings(cfg: Config, world_size: int) -> RunSettings:
    """Work out the derived settings of ``cfg`` on ``world_size`` processes.

    Raises ConfigError (one line naming the flags) when they cannot be derived:
    a world not divisible by tp x pp x cp, an illegal split of layers, a global batch
    not divisible by micro-batch x dp, or a schedule that cannot run (pp, vp, m).
    """
    par, t, m = cfg.parallel, cfg.train, cfg.model
    grid_groups(world_size, par.tp, par.pp, par.cp)  # raises the one-line error for a bad world size
    dp = world_size // (par.tp * par.pp * par.cp)  # the CP ranks of a replica read the same samples
    stage_layers = None
    try:
        if par.pipeline_balance != "measured" or par.pipeline_stage_layers is not None:
            stage_layers = tuple(
                stage_layer_counts(
                    m.num_layers,
                    par.pp,
                    par.vp,
                    par.decoder_first_pipeline_num_layers,
                    par.decoder_last_pipeline_num_layers,
                    par.pipeline_stage_layers,
                )
            )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
            f"{t.micro_batch_size} x data-parallel size {dp}; change one of them"
        )
    num_microbatches = t.global_batch_size // (t.micro_batch_size * dp)
    name = par.pipeline_schedule or default_schedule_name(par.pp, par.vp)
    try:
        validate_schedule(name, par.pp, par.vp, num_microbatches)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return RunSettings(
        dp=dp,
        num_microbatches=num_microbatches,
        schedule=name,
        spec=get_schedule(name),
        layout=layout_for(name, par.pp, par.vp),
        stage_layers=stage_layers,
    )
