"""What a checkpoint stores about the run besides tensors: ``meta.json`` and the random states.

``meta.json`` (one per checkpoint, both formats; written by rank 0)::

    format_version  iteration consumed_samples skipped_iters nan_iters   (the TrainState counters)
    scheduler       the LR schedule's state_dict: num_steps and its settings (lr, min_lr, lr_warmup_iters,
                    lr_decay_iters, lr_decay_style; older checkpoints hold num_steps only)
    scaler adam_step group_steps   (the optimizer's step_state(): fp16 loss scale, Adam step counts)
    layout          world tp pp vp dp cp first last stage_layers   (the parallel layout it was saved in;
                    cp absent in older checkpoints: read as 1)
    config          the whole Config; model_shape: the fields a model must share to load it
    format          sharded | torch

:class:`RandomStates` captures and restores every generator a rank draws from
(Python, NumPy, torch CPU, this rank's CUDA device and the tensor-parallel
tracker's), so a resumed run draws the same dropout masks as an uninterrupted one.
:func:`check_meta` validates every field a load uses before anything uses it (one line naming
the file and the field).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict
from typing import TYPE_CHECKING, Dict, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from megalite.checkpointing.format_info import SHARDED_INFO, format_names
from megalite.checkpointing.protocol import iteration_dir, read_json, read_latest
from megalite.checkpointing.safe_load import CheckpointError
from megalite.config import Config, ModelConfig
from megalite.model.spec import MOE_SHAPE_FIELDS, SHAPE_FIELDS  # the fields a model's parameters depend on
from megalite.parallel.state import ParallelState
from megalite.pipeline.partition import stage_layer_counts
from megalite.tensor_parallel.fp8 import fp8_states
from megalite.tensor_parallel.random import RNGTracker

if TYPE_CHECKING:  # the training package imports this one: no runtime import back
    from megalite.training.state import TrainState

FORMAT_VERSION = 1

__all__ = [
    "FORMAT_VERSION",
    "SHAPE_FIELDS",
    "RandomStates",
    "layout_of",
    "run_meta",
    "check_meta",
    "check_model_shape",
    "stage_counts",
    "saved_stage_layers",
]


class RandomStates:
    """Every random generator of this rank, as one plain-data state (``rng_<rank>.pt``'s content).

    ``state_dict()`` holds Python's, NumPy's (its key array as an int64 tensor, so the file
    loads with ``weights_only``), torch's CPU state, this rank's CUDA state (a list, empty
    without CUDA), the tracker's tensor-parallel states and, with ``model_parts``, the amax histories
    of FP8 delayed scaling (tensor_parallel/fp8.py): per rank, like the generators, so a resume in
    the same layout continues exactly.
    """

    def __init__(self, tracker: RNGTracker, model_parts: Sequence[nn.Module] = ()):
        self.tracker, self.model_parts = tracker, list(model_parts)

    def state_dict(self) -> dict:
        np_state = np.random.get_state()
        return {
            "python": random.getstate(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
            "torch": torch.get_rng_state(),
            "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_available() else [],  # this rank's device
            "tracker": self.tracker.get_states(),
            "fp8": fp8_states(self.model_parts),  # delayed scaling's amax histories ({} otherwise)
        }

    def load_state_dict(self, state: dict) -> None:
        random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
        n = state["numpy"]
        np.random.set_state((n[0], n[1].numpy().astype(np.uint32), int(n[2]), int(n[3]), float(n[4])))
        torch.set_rng_state(state["torch"])
        if state["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"][0])
        self.tracker.set_states(state["tracker"])  # FP8 amax histories: restored with the model (manager.py)


def layout_of(cfg: Config, ps: ParallelState) -> Dict[str, object]:
    """The parallel layout of this run as ``meta.json`` records it (``first``/``last`` 0 when unset)."""
    par = cfg.parallel
    out = {
        "world": ps.world_size,
        "tp": ps.tp_size,
        "pp": ps.pp_size,
        "vp": par.vp,
        "dp": ps.dp_size,
        "cp": ps.cp_size,
        "first": par.decoder_first_pipeline_num_layers or 0,
        "last": par.decoder_last_pipeline_num_layers or 0,
        "stage_layers": list(par.pipeline_stage_layers or ()),
    }
    if getattr(cfg.model, "num_experts", None) is not None:  # dense layouts keep their old keys
        out.update(ep=ps.ep_size, etp=ps.etp_size)
    return out


def _shape_of(model: ModelConfig) -> Dict[str, object]:
    """``meta.json``'s ``model_shape``: the dense fields, plus the MoE ones for an MoE model."""
    fields = SHAPE_FIELDS + (MOE_SHAPE_FIELDS if getattr(model, "num_experts", None) is not None else ())
    return {f: _plain(getattr(model, f)) for f in fields}


def _plain(v: object) -> object:
    return list(v) if isinstance(v, tuple) else v  # as JSON reads it back (moe_layer_freq may be a tuple)


def run_meta(cfg: Config, ps: ParallelState, optimizer, scheduler, train_state: "TrainState") -> dict:
    """``meta.json``'s content without ``format`` (the keys in the order they are written).

    ``optimizer`` is anything with ``step_state()`` (MegatronOptimizer), ``scheduler`` and
    ``train_state`` anything with ``state_dict()`` and TrainState's counters.
    """
    steps = optimizer.step_state()
    counters = train_state.state_dict()
    return {
        "format_version": FORMAT_VERSION,
        "iteration": counters["iteration"],
        "consumed_samples": counters["consumed_samples"],
        "skipped_iters": counters["skipped_iters"],
        "nan_iters": counters["nan_iters"],
        "scheduler": scheduler.state_dict(),
        "scaler": steps["scaler"],
        "adam_step": steps["adam_step"],
        "group_steps": steps["group_steps"],
        "layout": layout_of(cfg, ps),
        "config": json.loads(json.dumps(asdict(cfg), default=str)),
        "model_shape": _shape_of(cfg.model),
    }


def check_model_shape(saved: dict, model: ModelConfig, where: str) -> None:
    """One line naming every model-shape field that differs between a checkpoint and the run."""
    fields = [f for f in SHAPE_FIELDS if f != "max_positions" or model.position_embedding_type == "learned_absolute"]
    diffs = [
        f"{f} {saved[f]} (checkpoint) vs {getattr(model, f)} (run)"
        for f in fields
        if f in saved and saved[f] != getattr(model, f)
    ]
    if saved.get("num_experts") is not None or getattr(model, "num_experts", None) is not None:
        here = _shape_of(model)  # a dense side reads as num_experts None: then only that differs
        moe = MOE_SHAPE_FIELDS if saved.get("num_experts") and here.get("num_experts") else ("num_experts",)
        diffs += [
            f"{f} {saved.get(f)} (checkpoint) vs {here.get(f)} (run)"
            for f in moe
            if (f in saved or f == "num_experts") and saved.get(f) != here.get(f)
        ]
    if diffs:
        raise CheckpointError(
            f"{where} does not fit this model: {'; '.join(diffs)}; pass the model flags it was saved with"
        )


_NUM = (int, float)
_META_FIELDS = (  # (field, types, required): what load_checkpoint reads from meta.json
    ("iteration", int, True),
    ("consumed_samples", int, True),
    ("skipped_iters", int, False),
    ("nan_iters", int, False),
    ("scheduler", dict, True),
    ("scaler", (dict, type(None)), False),
    ("adam_step", _NUM, False),
    ("group_steps", (list, type(None)), False),
    ("layout", dict, True),
    ("model_shape", dict, True),
    ("format", str, False),
)
_LAYOUT_FIELDS = ("world", "tp", "pp", "vp", "dp", "first", "last")


def check_meta(meta: object, path: str) -> dict:
    """``meta`` as read from ``path``, with every field load_checkpoint uses present and of the right type;
    otherwise one CheckpointError naming the file and the field."""

    def bad(field: str, what: str) -> CheckpointError:
        return CheckpointError(
            f"{path}: {field} {what}; the checkpoint is damaged: load another iteration with --ckpt-step"
        )

    def typed(value: object, types) -> bool:
        return isinstance(value, types) and not isinstance(value, bool)

    if not isinstance(meta, dict):
        raise bad("the file", f"holds a JSON {type(meta).__name__}, not an object")
    for name, types, required in _META_FIELDS:
        if name not in meta:
            if required:
                raise bad(f"field {name!r}", "is missing")
        elif not typed(meta[name], types):
            raise bad(f"field {name!r}", f"has the wrong type ({type(meta[name]).__name__}: {str(meta[name])[:40]})")
    for name in ("iteration", "consumed_samples", "skipped_iters", "nan_iters"):
        if meta.get(name, 0) < 0:
            raise bad(f"field {name!r}", f"is negative ({meta[name]})")
    sched = meta["scheduler"]
    if not typed(sched.get("num_steps"), int):
        raise bad("field 'scheduler.num_steps'", "is missing or not an integer")
    for name, types in (
        ("lr", _NUM),
        ("min_lr", _NUM),
        ("lr_warmup_iters", int),
        ("lr_decay_iters", int),
        ("lr_decay_style", str),
    ):  # the schedule's settings (absent in older checkpoints)
        if name in sched and not typed(sched[name], types):
            raise bad(f"field 'scheduler.{name}'", f"has the wrong type ({type(sched[name]).__name__})")
    if sched.get("lr_decay_style", "constant") not in ("constant", "linear", "cosine"):
        raise bad("field 'scheduler.lr_decay_style'", f"is {sched['lr_decay_style']!r}")
    for name in _LAYOUT_FIELDS:
        if not typed(meta["layout"].get(name), int):
            raise bad(f"field 'layout.{name}'", "is missing or not an integer")
    meta["layout"].setdefault("cp", 1)  # saved before context parallelism existed
    if not typed(meta["layout"]["cp"], int) or meta["layout"]["cp"] < 1:
        raise bad("field 'layout.cp'", "is not a positive integer")
    stage_layers = meta["layout"].get("stage_layers")
    if stage_layers is not None and not (isinstance(stage_layers, list) and all(typed(n, int) for n in stage_layers)):
        raise bad("field 'layout.stage_layers'", "is not a list of integers")
    scaler = meta.get("scaler")
    if scaler and not all(typed(scaler.get(k, 0), _NUM) for k in ("scale", "growth_tracker", "hysteresis_tracker")):
        raise bad("field 'scaler'", "has a non-numeric value")
    if any(g is not None and not typed(g, _NUM) for g in meta.get("group_steps") or []):
        raise bad("field 'group_steps'", "is not a list of numbers")
    if meta.get("format", SHARDED_INFO.name) not in format_names():
        raise bad("field 'format'", f"is {meta['format']!r}, not {' or '.join(format_names())}")
    return meta


def stage_counts(layout: dict, num_layers: int) -> str:
    """Layers of every virtual stage, resolved (``2,2``), so an even split given as a list and the
    same split given by default compare equal; older files lack the list."""
    try:
        counts = stage_layer_counts(
            num_layers,
            layout["pp"],
            layout["vp"],
            layout["first"] or None,
            layout["last"] or None,
            layout.get("stage_layers") or None,
        )
    except ValueError:  # a layout this model cannot have: show it as saved
        return f"first {layout['first']} last {layout['last']} list {layout.get('stage_layers')}"
    return ",".join(map(str, counts))


def saved_stage_layers(root: str, step: Optional[int], pp: int, vp: int) -> Optional[Tuple[int, ...]]:
    """The per-stage layer split the checkpoint to load was trained with, when its pp and vp match.

    ``--pipeline-balance measured`` resumes with it instead of measuring again: timing noise could
    choose another split, which a torch-format checkpoint refuses and which changes the RNG layout.
    """
    try:  # a damaged checkpoint is reported by the load that follows, in one line
        it = step if step is not None else read_latest(root)
        path = os.path.join(iteration_dir(root, it), "meta.json") if it is not None else None
        if path is None or not os.path.exists(path):
            return None
        meta = read_json(path)
    except CheckpointError:
        return None
    layout = meta.get("layout") if isinstance(meta, dict) else None
    if not isinstance(layout, dict) or layout.get("pp") != pp or layout.get("vp") != vp:
        return None
    split = layout.get("stage_layers")
    if isinstance(split, list) and split and all(type(n) is int and n >= 0 for n in split):
        return tuple(split)
    return None  # none recorded, or damaged: the load that follows names what is wrong
