"""Saving and loading a whole run from explicit state objects, and the Checkpointer a run holds.

A run is: the model chunks, the optimizer (MegatronOptimizer: fp32 main weights,
Adam moments and step counts, loss scaler), the LR schedule, the TrainState
counters and the random states (the RNGTracker plus the process-wide generators).
:func:`save_checkpoint` and :func:`load_checkpoint` take exactly those objects;
:class:`Checkpointer` binds them to the run's config (``--save``, ``--load``,
``--save-interval``, ``--ckpt-*``) and remembers the iteration last on disk.
The directory protocol is ``protocol.py``'s, the files the formats'
(``sharded.py``, ``torch_format.py``), ``meta.json`` and the random states
``run_state.py``'s.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Optional, Sequence

from torch import nn

from megalite.agreement import flag_on_any_rank
from megalite.checkpointing.protocol import LATEST, begin_save, iteration_dir, publish_save, read_json, read_latest, \
    saved_iterations, write_json
from megalite.checkpointing.run_state import RandomStates, check_model_shape, layout_of, run_meta
from megalite.checkpointing.safe_load import CheckpointError
from megalite.checkpointing.sharded_read import read_sharded
from megalite.checkpointing.sharded_write import write_sharded
from megalite.checkpointing.torch_dist import load_torch_dist_weights, open_for_run, torch_dist_dir
from megalite.checkpointing.torch_dist_optim import load_torch_dist_optimizer
from megalite.checkpointing.torch_format import read_torch, write_torch
from megalite.config import Config
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel.random import RNGTracker

if TYPE_CHECKING:  # megalite.training imports this package: type hints only, no runtime import back
    from megalite.optim.lr_scheduler import LRScheduler
    from megalite.optim.optimizer import MegatronOptimizer
    from megalite.training.state import TrainState

logger = logging.getLogger("megalite")
FORMATS = ("sharded", "torch")

__all__ = ["FORMATS", "Checkpointer", "save_checkpoint", "load_checkpoint"]


def save_checkpoint(cfg: Config, ps: ParallelState, model_parts: Sequence[nn.Module], optimizer: "MegatronOptimizer",
                    scheduler: "LRScheduler", train_state: "TrainState", rng_tracker: RNGTracker, root: str,
                    fmt: str = "sharded", keep_last: Optional[int] = None) -> str:
    """Save the run at ``train_state.iteration`` under ``root``; returns its directory (collective).

    Every rank writes into ``iter_XXXXXXX.tmp``, which is renamed into place before
    ``latest_checkpointed_iteration.txt`` names it; ``keep_last`` prunes older ones.
    """
    if fmt not in FORMATS:
        raise CheckpointError(f"unknown --ckpt-format {fmt!r}; use sharded or torch")
    it = train_state.iteration
    tmp = begin_save(root, it, ps)
    optimizer.finish_param_gather()
    # fp32 main weights are the model weights: not stored twice (collective over DP, one key at a time on CPU)
    full_opt = optimizer.full_state_dict(include_main=optimizer.half, to_cpu=True)
    meta = run_meta(cfg, ps, optimizer, scheduler, train_state)
    rng = RandomStates(rng_tracker)
    if fmt == "sharded":
        write_sharded(tmp, ps, model_parts, full_opt, rng)
    else:
        write_torch(tmp, ps, model_parts, full_opt, meta, rng)
    if ps.rank == 0:
        write_json(os.path.join(tmp, "meta.json"), {**meta, "format": fmt})
    final = publish_save(root, it, ps, keep_last)
    logger.info(f"saved checkpoint at iteration {it} to {root} ({fmt} format)")
    return final


def _read_meta(root: str, it: int) -> tuple:
    d = iteration_dir(root, it)
    meta_path = os.path.join(d, "meta.json")
    if not os.path.exists(meta_path):
        have = [x for x in saved_iterations(root) if int(x) != it]  # never the one just refused
        raise CheckpointError(f"{d} is not a complete megalite checkpoint (no meta.json; a Megatron-LM torch-format "
                              f"one converts with tools/checkpoint/convert.py --loader megatron); other iterations "
                              f"in {root}: {', '.join(have) or 'none'}; pick one with --ckpt-step or check --load")
    return d, read_json(meta_path)


def load_checkpoint(cfg: Config, ps: ParallelState, model_parts: Sequence[nn.Module], optimizer: "MegatronOptimizer",
                    scheduler: "LRScheduler", train_state: "TrainState", rng_tracker: RNGTracker, root: str, *,
                    step: Optional[int] = None, finetune: bool = False, load_optim: bool = True,
                    load_rng: bool = True) -> Optional[int]:
    """Load ``root`` (latest, or iteration ``step``) into the given objects; returns the iteration loaded.

    With no checkpoint there, warns and returns None (the run starts from scratch,
    as Megatron does). ``finetune`` loads the weights only and leaves the counters,
    optimizer state, schedule and random states as they are (collective).
    """
    td = torch_dist_dir(root, step)
    if td is not None:  # Megatron-LM's default --ckpt-format: read in place
        return _load_torch_dist(td, cfg, ps, model_parts, optimizer, scheduler, train_state, finetune,
                                load_optim and not finetune)
    it = step if step is not None else read_latest(root)
    if it is None:
        if finetune:
            raise CheckpointError(f"--finetune: no checkpoint in {root} (no {LATEST}); check --load")
        if ps.is_logging_rank:  # every rank finds the same: say it once per job
            logger.warning(f"no {LATEST} in {root}: starting from scratch")
        return None
    d, meta = _read_meta(root, it)
    check_model_shape(meta["model_shape"], cfg.model, d)
    load_optim = load_optim and not finetune
    here = layout_of(cfg, ps)
    optimizer.finish_param_gather()
    if meta.get("format") == "torch":
        rng = read_torch(d, meta["layout"], here, ps, model_parts, optimizer, load_optim, cfg.model.num_layers)
    else:
        rng = read_sharded(d, meta, ps, model_parts, optimizer, load_optim, meta["layout"] == here)
    if load_optim:
        optimizer.load_step_state(meta)
    if not finetune:
        train_state.load_state_dict(meta)
    if load_optim:
        scheduler.load_state_dict(meta["scheduler"])
    if load_rng and not finetune:
        if rng is not None:
            RandomStates(rng_tracker).load_state_dict(rng)
        else:
            logger.warning("checkpoint saved in another layout: random states are not restored")
    logger.info(f"loaded checkpoint {d} (iteration {meta['iteration']}, {meta.get('format')} format)")
    return it


def _load_torch_dist(d: str, cfg: Config, ps: ParallelState, model_parts: Sequence[nn.Module],
                     optimizer: "MegatronOptimizer", scheduler: "LRScheduler", train_state: "TrainState",
                     finetune: bool, load_optim: bool = False) -> int:
    """Weights from a Megatron-Core torch_dist directory, its distributed-optimizer state when it can be
    mapped (``load_optim``); counters unless ``finetune`` (collective)."""
    optimizer.finish_param_gather()
    error, counters, skipped = None, {}, "--no-load-optim" if not finetune else "--finetune"
    try:
        src = open_for_run(d, cfg.model)  # common.pt and the index read once for weights and optimizer
        counters = load_torch_dist_weights(src, cfg.model, model_parts, optimizer)
        if load_optim:  # the same answer on every rank: the layout is the file's, not the rank's
            skipped = load_torch_dist_optimizer(src, model_parts, optimizer)
    except CheckpointError as e:
        error = e
    failed = flag_on_any_rank(error is not None, ps)  # no rank goes on to train while another failed
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"another rank could not read {d} (its error is printed above)")
    if not finetune:
        train_state.load_state_dict(counters)
        scheduler.load_state_dict({"num_steps": counters["iteration"]})  # the LR schedule follows the iteration
    if ps.is_logging_rank and skipped is None:
        logger.warning(f"loaded Megatron-Core torch_dist checkpoint {d} (iteration {counters['iteration']}): "
                       f"weights and distributed-optimizer state; its random states are not restored")
    elif ps.is_logging_rank:
        logger.warning(f"loaded the weights of Megatron-Core torch_dist checkpoint {d} (iteration "
                       f"{counters['iteration']}); its optimizer state is not restored ({skipped}) nor its random "
                       f"states: Adam starts fresh, as with --no-load-optim --no-load-rng")
    return counters["iteration"]


class Checkpointer:
    """When to save, saving and loading, for one rank's part of a run.

    Reads ``cfg.checkpoint`` at each call (``--save``, ``--save-interval``, ``--ckpt-format``,
    ``--ckpt-keep-last``; ``--load``, ``--ckpt-step``, ``--finetune``, ``--no-load-optim``,
    ``--no-load-rng``). ``saved_at`` is the iteration last saved to ``--save`` (or loaded
    from it: already on disk, not saved again at the end), None before.
    """

    def __init__(self, cfg: Config, ps: ParallelState, model_parts: Sequence[nn.Module],
                 optimizer: "MegatronOptimizer", scheduler: "LRScheduler", train_state: "TrainState",
                 rng_tracker: RNGTracker):
        self.cfg, self.ps = cfg, ps
        self.model_parts, self.optimizer, self.scheduler = list(model_parts), optimizer, scheduler
        self.train_state, self.rng_tracker = train_state, rng_tracker
        self.saved_at: Optional[int] = None

    def _parts(self) -> tuple:
        return (self.cfg, self.ps, self.model_parts, self.optimizer, self.scheduler, self.train_state,
                self.rng_tracker)

    def due(self, iteration: int) -> bool:
        """True when ``--save`` and ``--save-interval`` ask for a checkpoint after ``iteration``."""
        ck = self.cfg.checkpoint
        return bool(ck.save and ck.save_interval and iteration % ck.save_interval == 0)

    def save(self) -> str:
        """Save the run to ``--save`` at the current iteration (collective); returns the directory."""
        ck = self.cfg.checkpoint
        if not ck.save:
            raise CheckpointError("no --save directory to save the checkpoint to")
        final = save_checkpoint(*self._parts(), ck.save, ck.ckpt_format, ck.ckpt_keep_last)
        self.saved_at = self.train_state.iteration
        return final

    def load(self) -> Optional[int]:
        """Resume from ``--load`` (collective); returns the iteration loaded, or None when there is none."""
        ck = self.cfg.checkpoint
        if not ck.load:
            return None
        it = load_checkpoint(*self._parts(), ck.load, step=ck.ckpt_step, finetune=ck.finetune,
                             load_optim=not ck.no_load_optim, load_rng=not ck.no_load_rng)
        if it is not None and not ck.finetune and os.path.abspath(ck.load) == os.path.abspath(ck.save or ""):
            self.saved_at = self.train_state.iteration  # already on disk: do not save it again at the end
        return it
