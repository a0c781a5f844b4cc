"""The sharded format's reader (the format is described in ``sharded.py``)."""
from __future__ import annotations

import os
from typing import Dict, Optional, Sequence

import torch
from torch import nn

from megalite.agreement import flag_on_any_rank
from megalite.checkpointing.layout import chunk_blocks, intersect
from megalite.checkpointing.safe_load import CheckpointError, SafeFileSystemReader, safe_torch_load
from megalite.checkpointing.sharded import OPTIM_KEYS, dcp_read, read_index
from megalite.parallel_state import ParallelState

__all__ = ["read_sharded"]


def _plan_reads(d, index, needs, saved_optim, model_out, optim_out, wanted, copies) -> None:
    """Which saved blocks this rank reads, and where each part of them goes."""
    for (i, name), blocks in needs.items():
        for prefix in ["model"] + [f"optim.{k}" for k in saved_optim]:
            target = model_out[(i, name)] if prefix == "model" else optim_out[name][prefix.split(".", 1)[1]]
            for b in blocks:
                entries = index.get((prefix, b.name))
                if not entries:
                    raise CheckpointError(f"{d} has no {prefix} tensor {b.name!r}: it was saved from another "
                                          f"model; check the model flags")
                if entries[0]["shape"] != list(b.global_shape):
                    raise CheckpointError(f"{d}: {b.name} has shape {entries[0]['shape']} in the checkpoint, "
                                          f"{list(b.global_shape)} in this run; check the model flags")
                for e in entries:
                    sl = intersect(b, e["offsets"], e["sizes"])
                    if sl is None:
                        continue
                    dst = b.local(target)[sl[0]]
                    exact = (e["offsets"] == list(b.offsets) and e["sizes"] == list(b.sizes)
                             and e["dtype"] == "float32" and e["key"] not in wanted)
                    if exact:  # read straight into place
                        wanted[e["key"]] = dst
                        continue
                    if e["key"] not in wanted:
                        wanted[e["key"]] = torch.empty(e["sizes"], dtype=getattr(torch, e["dtype"]))
                    copies.append((dst, e["key"], sl[1]))


def _agree_on_error(ps: ParallelState, error: Optional[CheckpointError]) -> None:
    """Raise everywhere if any rank failed (that rank's message locally, a pointer to it elsewhere)."""
    failed = flag_on_any_rank(error is not None, ps)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError("another rank could not read this checkpoint (its error is printed above); "
                              "check --load and the model flags")


def _optimizer_state(tensors: Dict[str, Dict[str, torch.Tensor]], adam_step: float) -> dict:
    step = torch.tensor(adam_step, dtype=torch.float32)
    # Adam's moments exist once a step has been taken (fp16 may skip the first ones)
    return {n: {**t, "step": step.clone()} if "exp_avg" in t else dict(t) for n, t in tensors.items()}


def read_sharded(d: str, meta: dict, ps: ParallelState, chunks: Sequence[nn.Module], optimizer,
                 load_optim: bool, same_layout: bool) -> Optional[dict]:
    """Load ``d``'s blocks into ``chunks`` and (with ``load_optim``) ``optimizer`` (collective).

    Returns this rank's saved random states when ``same_layout`` (the layout it was saved
    in), else None. The optimizer's step counts and scaler are the caller's (``meta.json``).
    """
    SafeFileSystemReader(d).read_metadata()  # refuse a tampered index before torch.distributed.checkpoint reads it
    index = read_index(d)
    params = {(i, n): p for i, c in enumerate(chunks) for n, p in c.named_parameters()}
    needs = chunk_blocks(chunks, for_write=False)
    saved_optim = [k for k in OPTIM_KEYS if any(pre == f"optim.{k}" for pre, _ in index)] if load_optim else []
    # destinations: fp32 full local tensors (vocabulary padding stays zero)
    model_out = {k: torch.zeros(p.shape, dtype=torch.float32) for k, p in params.items()}
    optim_out: Dict[str, Dict[str, torch.Tensor]] = {
        name: {k: torch.zeros(p.shape, dtype=torch.float32) for k in saved_optim}
        for (i, name), p in params.items()} if saved_optim else {}
    wanted: Dict[str, torch.Tensor] = {}
    copies: list = []  # (destination view, key, source slices) where a saved block is not exactly a needed one
    error = None
    try:
        _plan_reads(d, index, needs, saved_optim, model_out, optim_out, wanted, copies)
    except CheckpointError as e:
        error = e
    _agree_on_error(ps, error)  # a rank that cannot plan must not leave the others in the collective read
    dcp_read(wanted, d, "load another iteration with --ckpt-step")  # collective
    for dst, key, src in copies:
        dst.copy_(wanted[key][src])
    with torch.no_grad():
        for k, p in params.items():
            p.data.copy_(model_out[k].to(p.device))
    if "param" not in saved_optim and (optim_out or optimizer.half):
        # no fp32 main weights saved (fp32 run, or optimizer not loaded): the loaded weights are them
        for (i, name), t in model_out.items():
            optim_out.setdefault(name, {})["param"] = t
    if optim_out:
        optimizer.load_full_state_dict(_optimizer_state(optim_out, meta["adam_step"]))
    if not same_layout:
        return None
    path = os.path.join(d, f"rng_{ps.rank:05d}.pt")
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete; pass --no-load-rng to "
                              f"load it without random states")
    return safe_torch_load(path)
