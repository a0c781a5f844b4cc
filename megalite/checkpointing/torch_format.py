"""The torch format: Megatron-LM's legacy ``mp_rank_XX`` layout (loads only into the same tp, pp, vp).

::

    iter_0000100/mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>]/model_optim_rng.pt    one file per (tp, pp[, ep]) rank
      args  checkpoint_version (3.0)  iteration  consumed_samples
      model | model0, model1, ...     each chunk's state_dict (one per virtual stage)
      optimizer: {state: full per-parameter fp32 state, scaler, group_steps}
      opt_param_scheduler  rng_state (one RandomStates per dp x cp rank)  counters  layout  model_shape
    iter_0000100/mp_rank_<tp:02d>[_<pp:03d>]/model_optim_rng.pt.crc32.json   {"crc32", "bytes"} of that file

The directory naming is Megatron's (:func:`legacy_dir`), which the Megatron-LM
reader and writer (``megatron.py``) and the converter (``native_io.py``) share.
The ranks of a (tp, pp) rank's dp x cp group (``ps.dp_cp``) hold the same parameters,
so the file does not depend on dp or cp: a checkpoint loads at another dp or cp size
(only the random states, one per dp x cp rank, are then not restored).

With expert parallelism (ep > 1) the ranks of one dp x cp group hold different experts: the
directory gains the EP rank, as Megatron-LM names it, and the first rank of the group holding
each EP rank's experts writes that file. Such a checkpoint loads only at the same ep and etp.
"""

from __future__ import annotations

import os
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megalite.checkpointing.protocol import agree_on_error, read_json, write_json
from megalite.checkpointing.run_state import stage_counts
from megalite.checkpointing.safe_load import CheckpointError, safe_torch_load
from megalite.data_parallel.fsdp import gathered_state_dict
from megalite.parallel.state import ParallelState
from megalite.tensor_parallel.layers import per_expert_names

CRC_SUFFIX = ".crc32.json"  # the checksum sidecar next to each model_optim_rng.pt

__all__ = ["legacy_dir", "CRC_SUFFIX", "torch_state", "write_torch_state", "read_torch", "check_same_layout"]


def legacy_dir(tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1) -> str:
    """Megatron's per-rank directory name: ``mp_rank_TT`` (no pipeline) or ``mp_rank_TT_PPP``, with
    ``_EEE`` (the expert-parallel rank) appended when ep > 1."""
    return (
        f"mp_rank_{tp_rank:02d}"
        + (f"_{pp_rank:03d}" if pp_size > 1 else "")
        + (f"_{ep_rank:03d}" if ep_size > 1 else "")
    )


def _ep(ps: ParallelState):
    """(ep rank, ep size): (0, 1) for a grid without experts."""
    return (ps.ep_rank, ps.ep_size) if ps.has_experts else (0, 1)


def _writes_file(ps: ParallelState) -> bool:
    """Whether this rank writes its (tp, pp[, ep]) file: dp x cp rank 0, or with ep > 1 the lowest dp x cp
    rank holding its EP rank's experts (collective over dp x cp when ep > 1)."""
    ep_rank, ep_size = _ep(ps)
    if ep_size == 1 or ps.dp_cp_size == 1:
        return ps.dp_cp_rank == 0
    eps: List[int] = [0] * ps.dp_cp_size
    dist.all_gather_object(eps, ep_rank, group=ps.dp_cp_group)
    return eps.index(ep_rank) == ps.dp_cp_rank


def _model_key(i: int, n_chunks: int) -> str:
    return "model" if n_chunks == 1 else f"model{i}"


def torch_state(
    ps: ParallelState, chunks: Sequence[nn.Module], optimizer, meta: dict, rng: dict, gather_optimizer: bool = True
) -> Optional[dict]:
    """This (tp, pp[, ep]) rank's ``model_optim_rng.pt`` content on its writer (:func:`_writes_file`), None
    elsewhere (collective over dp x cp).

    The optimizer state is gathered over dp x cp (``full_state_dict``: the legacy file holds every
    parameter's whole fp32 state; without ``gather_optimizer`` it is left empty for the caller
    to fill, as an asynchronous save does in the background); ``rng`` is this rank's
    RandomStates, gathered over dp x cp. The tensors may be views of the live state: copy them
    before training goes on.
    """
    full_opt = optimizer.full_state_dict(include_main=optimizer.half, to_cpu=True) if gather_optimizer else {}
    rngs: List[Optional[dict]] = [None] * ps.dp_cp_size
    if ps.dp_cp_size > 1:
        dist.all_gather_object(rngs, rng, group=ps.dp_cp_group)
    else:
        rngs = [rng]
    fsdp = getattr(optimizer, "fsdp", None) is not None
    # FSDP's weights are shards: gathered on every rank of their group (the file holds whole TP-local tensors)
    states = [gathered_state_dict(c, optimizer.dtype) if fsdp else None for c in chunks]
    if not _writes_file(ps):
        return None
    models = {_model_key(i, len(chunks)): sd or c.state_dict() for i, (c, sd) in enumerate(zip(chunks, states))}
    return {
        "args": meta["config"],
        "checkpoint_version": 3.0,
        "iteration": meta["iteration"],
        "consumed_samples": meta["consumed_samples"],
        **models,
        "optimizer": {"state": full_opt, "scaler": meta["scaler"], "group_steps": meta["group_steps"]},
        "opt_param_scheduler": meta["scheduler"],
        "rng_state": rngs,
        "counters": {"skipped_iters": meta["skipped_iters"], "nan_iters": meta["nan_iters"]},
        "layout": meta["layout"],
        "model_shape": meta["model_shape"],
    }


class _Checksummed:
    """A binary file torch.save writes through, summing what passes (zlib.crc32 and the byte count)."""

    def __init__(self, f):
        self.f, self.crc32, self.bytes = f, 0, 0

    def write(self, b) -> int:
        self.crc32 = zlib.crc32(b, self.crc32)
        self.bytes += len(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def write_torch_state(tmp: str, ps: ParallelState, state: Optional[dict]) -> None:
    """Write :func:`torch_state`'s content (its writer; nothing elsewhere) and its checksum sidecar:
    ``model_optim_rng.pt.crc32.json`` = {"crc32": zlib.crc32 of the whole file, "bytes": its size}."""
    if state is None:
        return
    d = os.path.join(tmp, legacy_dir(ps.tp_rank, ps.pp_rank, ps.pp_size, *_ep(ps)))
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "model_optim_rng.pt")
    with open(path, "wb") as f:
        out = _Checksummed(f)
        torch.save(state, out)
        f.flush()
        os.fsync(f.fileno())
    write_json(path + CRC_SUFFIX, {"crc32": out.crc32, "bytes": out.bytes})


def check_same_layout(d: str, saved: dict, here: dict, num_layers: int) -> None:
    """A torch-format checkpoint loads only into its own tp, pp, vp, ep, etp and layers per stage: one line
    otherwise."""
    split = lambda layout: stage_counts(layout, num_layers)  # noqa: E731
    experts = lambda layout: (layout.get("ep", 1), layout.get("etp", layout["tp"]))  # noqa: E731
    if experts(saved) != experts(here):
        (ep, etp), (ep_here, etp_here) = experts(saved), experts(here)
        raise CheckpointError(
            f"{d} is a torch-format checkpoint saved with expert parallelism ep={ep} etp={etp}; this run has "
            f"ep={ep_here} etp={etp_here}: run with --expert-model-parallel-size {ep} "
            f"--expert-tensor-parallel-size {etp}, or save with --ckpt-format sharded, which loads into any layout"
        )
    if any(saved[k] != here[k] for k in ("tp", "pp", "vp")) or split(saved) != split(here):
        raise CheckpointError(
            f"{d} is a torch-format checkpoint saved with tp={saved['tp']} pp={saved['pp']} vp={saved['vp']} "
            f"(layers per stage: {split(saved)}); this run has tp={here['tp']} pp={here['pp']} vp={here['vp']} "
            f"({split(here)}): run with the saved layout (--pipeline-stage-layers) or save with --ckpt-format "
            f"sharded, which loads into any layout"
        )


def _saved_parameters(chunk: nn.Module) -> List[Tuple[str, tuple, nn.Parameter]]:
    """(saved name, saved shape, parameter) of every parameter as its state dict stores it: a grouped expert
    parameter once per expert."""
    out = []
    for name, p in chunk.named_parameters():
        names = per_expert_names(name, p)
        out += [(n, tuple(p.shape[1:]), p) for n in names] if names else [(name, tuple(p.shape), p)]
    return out


def _load_models(path: str, state: dict, chunks: Sequence[nn.Module], weights: bool = True) -> List[Dict[str, object]]:
    """Each chunk's saved state dict, checked against the chunk and loaded into it (without ``weights``: only
    what is not a trained parameter, whose values the optimizer then places)."""
    models = [state[_model_key(i, len(chunks))] for i in range(len(chunks))]
    for chunk, sd in zip(chunks, models):
        for name, shape, _ in _saved_parameters(chunk):
            if name not in sd or tuple(sd[name].shape) != shape:
                got = tuple(sd[name].shape) if name in sd else "missing"
                raise CheckpointError(
                    f"{path}: {name} is {got} in the checkpoint, {shape} in this run "
                    f"(check --make-vocab-size-divisible-by and the model flags)"
                )
        if weights:
            chunk.load_state_dict(sd)
        else:
            trained = {n for n, _, p in _saved_parameters(chunk) if p.requires_grad}
            chunk.load_state_dict({k: v for k, v in sd.items() if k not in trained}, strict=False)
    return models


def _verify_checksum(path: str) -> None:
    """The file against its sidecar ``<file>.crc32.json`` when there is one (older checkpoints have none)."""
    side = path + CRC_SUFFIX
    if not os.path.exists(side):
        return
    want = read_json(side)
    if not (isinstance(want, dict) and type(want.get("crc32")) is int and type(want.get("bytes")) is int):
        raise CheckpointError(
            f"{side} is damaged (no integer crc32 and bytes); load another iteration with --ckpt-step"
        )
    crc, size, buf = 0, 0, bytearray(16 << 20)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            crc, size = zlib.crc32(memoryview(buf)[:n], crc), size + n
    if (crc, size) != (want["crc32"], want["bytes"]):
        try:  # a file replaced by pickled code: say that (weights-only: nothing in it runs)
            safe_torch_load(path)
        except CheckpointError as e:
            if str(e).startswith("refusing to load"):
                raise
        raise CheckpointError(
            f"{path} fails its checksum ({size} bytes, crc32 {crc:08x}; {side} says "
            f"{want['bytes']} bytes, {want['crc32'] & 0xFFFFFFFF:08x}): the file is damaged; "
            f"load another iteration with --ckpt-step"
        )


def read_torch(
    d: str,
    saved: dict,
    here: dict,
    ps: ParallelState,
    chunks: Sequence[nn.Module],
    optimizer,
    load_optim: bool,
    num_layers: int,
) -> Optional[dict]:
    """Load this rank's ``model_optim_rng.pt`` of ``d`` into ``chunks`` and (with ``load_optim``) ``optimizer``.

    ``saved``/``here`` are the checkpoint's and this run's layouts. Returns this rank's saved
    random states when the dp and cp sizes match, else None. The optimizer's step counts and
    scaler are the caller's (``meta.json``).
    """
    check_same_layout(d, saved, here, num_layers)
    path = os.path.join(d, legacy_dir(ps.tp_rank, ps.pp_rank, ps.pp_size, *_ep(ps)), "model_optim_rng.pt")
    error = None
    try:  # each rank reads its own file: a damaged one must stop every rank before the next collective
        if not os.path.exists(path):
            raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
        _verify_checksum(path)
        state = safe_torch_load(path)
        fsdp = getattr(optimizer, "fsdp", None) is not None
        models = _load_models(path, state, chunks, weights=not fsdp)
    except CheckpointError as e:
        error = e
    agree_on_error(ps, error)
    opt_state = state["optimizer"]["state"] if load_optim else {}
    optimized = {n for n, _ in optimizer.named}
    for sd in models:  # no fp32 main weights saved (fp32 run, or optimizer not loaded): the weights are them
        for name, t in sd.items():  # (FSDP's weights are its main weights' shards: they always come this way)
            if "param" not in opt_state.get(name, {}) and (load_optim or optimizer.half or fsdp) and name in optimized:
                opt_state.setdefault(name, {})["param"] = t.float()
    if opt_state:
        optimizer.load_full_state_dict(opt_state)
    rngs = state["rng_state"]
    same = (saved["dp"], saved.get("cp", 1)) == (here["dp"], here.get("cp", 1))
    return rngs[ps.dp_cp_rank] if same and len(rngs) == ps.dp_cp_size else None
