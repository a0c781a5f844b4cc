"""The torch format: Megatron-LM's legacy ``mp_rank_XX`` layout (loads only into the same tp, pp, vp).

::

    iter_0000100/mp_rank_<tp:02d>[_<pp:03d>]/model_optim_rng.pt    one file per (tp, pp) rank, by DP rank 0
      args  checkpoint_version (3.0)  iteration  consumed_samples
      model | model0, model1, ...     each chunk's state_dict (one per virtual stage)
      optimizer: {state: full per-parameter fp32 state, scaler, group_steps}
      opt_param_scheduler  rng_state (one RandomStates per DP rank)  counters  layout  model_shape

The directory naming is Megatron's (:func:`legacy_dir`), which the Megatron-LM
reader and writer (``megatron.py``) and the converter (``native_io.py``) share.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

import torch.distributed as dist
from torch import nn

from megalite.checkpointing.protocol import save_synced
from megalite.checkpointing.run_state import RandomStates, stage_counts
from megalite.checkpointing.safe_load import CheckpointError, safe_torch_load
from megalite.parallel_state import ParallelState

__all__ = ["legacy_dir", "write_torch", "read_torch", "check_same_layout"]


def legacy_dir(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """Megatron's per-rank directory name: ``mp_rank_TT`` (no pipeline) or ``mp_rank_TT_PPP``."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")


def _model_key(i: int, n_chunks: int) -> str:
    return "model" if n_chunks == 1 else f"model{i}"


def write_torch(tmp: str, ps: ParallelState, chunks: Sequence[nn.Module], full_opt: dict, meta: dict,
                rng: RandomStates) -> None:
    """Write this (tp, pp) rank's ``model_optim_rng.pt`` into ``tmp`` (collective over the DP group).

    ``meta`` is ``run_meta``'s content; ``rng`` this rank's RandomStates, gathered over DP.
    """
    rngs: List[Optional[dict]] = [None] * ps.dp_size
    if ps.dp_size > 1:
        dist.all_gather_object(rngs, rng.state_dict(), group=ps.dp_group)
    else:
        rngs = [rng.state_dict()]
    if ps.dp_rank != 0:
        return
    models = {_model_key(i, len(chunks)): c.state_dict() for i, c in enumerate(chunks)}
    state = {"args": meta["config"], "checkpoint_version": 3.0, "iteration": meta["iteration"],
             "consumed_samples": meta["consumed_samples"], **models,
             "optimizer": {"state": full_opt, "scaler": meta["scaler"], "group_steps": meta["group_steps"]},
             "opt_param_scheduler": meta["scheduler"], "rng_state": rngs,
             "counters": {"skipped_iters": meta["skipped_iters"], "nan_iters": meta["nan_iters"]},
             "layout": meta["layout"], "model_shape": meta["model_shape"]}
    d = os.path.join(tmp, legacy_dir(ps.tp_rank, ps.pp_rank, ps.pp_size))
    os.makedirs(d, exist_ok=True)
    save_synced(state, os.path.join(d, "model_optim_rng.pt"))


def check_same_layout(d: str, saved: dict, here: dict, num_layers: int) -> None:
    """A torch-format checkpoint loads only into its own tp, pp, vp and layers per stage: one line otherwise."""
    split = lambda layout: stage_counts(layout, num_layers)  # noqa: E731
    if any(saved[k] != here[k] for k in ("tp", "pp", "vp")) or split(saved) != split(here):
        raise CheckpointError(
            f"{d} is a torch-format checkpoint saved with tp={saved['tp']} pp={saved['pp']} vp={saved['vp']} "
            f"(layers per stage: {split(saved)}); this run has tp={here['tp']} pp={here['pp']} vp={here['vp']} "
            f"({split(here)}): run with the saved layout (--pipeline-stage-layers) or save with --ckpt-format "
            f"sharded, which loads into any layout")


def _load_models(path: str, state: dict, chunks: Sequence[nn.Module]) -> List[Dict[str, object]]:
    models = [state[_model_key(i, len(chunks))] for i in range(len(chunks))]
    for chunk, sd in zip(chunks, models):
        for name, p in chunk.named_parameters():
            if name not in sd or tuple(sd[name].shape) != tuple(p.shape):
                got = tuple(sd[name].shape) if name in sd else "missing"
                raise CheckpointError(f"{path}: {name} is {got} in the checkpoint, {tuple(p.shape)} in this run "
                                      f"(check --make-vocab-size-divisible-by and the model flags)")
        chunk.load_state_dict(sd)
    return models


def read_torch(d: str, saved: dict, here: dict, ps: ParallelState, chunks: Sequence[nn.Module], optimizer,
               load_optim: bool, num_layers: int) -> Optional[dict]:
    """Load this rank's ``model_optim_rng.pt`` of ``d`` into ``chunks`` and (with ``load_optim``) ``optimizer``.

    ``saved``/``here`` are the checkpoint's and this run's layouts. Returns this rank's saved
    random states when the DP size matches, else None. The optimizer's step counts and
    scaler are the caller's (``meta.json``).
    """
    check_same_layout(d, saved, here, num_layers)
    path = os.path.join(d, legacy_dir(ps.tp_rank, ps.pp_rank, ps.pp_size), "model_optim_rng.pt")
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
    state = safe_torch_load(path)
    models = _load_models(path, state, chunks)
    opt_state = state["optimizer"]["state"] if load_optim else {}
    optimized = {n for n, _ in optimizer.named}
    for sd in models:  # no fp32 main weights saved (fp32 run, or optimizer not loaded): the weights are them
        for name, t in sd.items():
            if "param" not in opt_state.get(name, {}) and (load_optim or optimizer.half) and name in optimized:
                opt_state.setdefault(name, {})["param"] = t.float()
    if opt_state:
        optimizer.load_full_state_dict(opt_state)
    rngs = state["rng_state"]
    return rngs[ps.dp_rank] if saved["dp"] == here["dp"] and len(rngs) == ps.dp_size else None
