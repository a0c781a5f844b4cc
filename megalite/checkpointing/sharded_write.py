"""The sharded format's writer (the format is described in ``sharded.py``): shards written by their owners.

Each rank writes only what it owns, without gathering anything:

"DP rank" below is the rank in ``ps.dp_cp``, the ranks holding the same model shard (data x
context parallel; the distributed optimizer shards over that group too).

* with the distributed optimizer, every DP rank owns flat ranges of its TP-local parameters
  (``MegatronOptimizer.pieces``); it writes, for each of its pieces and each global block the
  parameter holds (``layout.py``), the part of the block the piece covers as one ``"flat"``
  entry: the block's elements ``[lo, hi)`` in row-major order, 1-D. That holds for the model
  weights (``model/``) and for the optimizer state (``optim.param`` -- the fp32 main weights,
  only for half-precision runs --, ``optim.exp_avg``, ``optim.exp_avg_sq``). Keys are
  ``<prefix>/<block key>#<lo>``; the DP ranks' entries together cover each block once.
* without it (or at dp 1), whole blocks (``<prefix>/<block key>``, no ``"flat"``), spread over
  the DP ranks round-robin (block ``j`` of a rank's list is written by DP rank ``j % dp``).
* under FSDP (data_parallel/fsdp.py) a rank's shard of a parameter is one flat piece too, written
  the same way (its model entry in the compute dtype, its fp32 main weight as ``optim.param`` in a
  16-bit run): a sharded run's checkpoint is the distributed optimizer's, and each loads into the other.
* MoE expert weights (``p.expert_parallel``) are replicated over the expert data-parallel group
  (``ps.edp``), not dp x cp: their whole blocks are dealt round-robin over edp (a turn count of
  their own, so dense blocks are dealt as without experts), and the distributed optimizer's
  pieces of them cover each block once over edp.

Every index entry carries ``"crc32"``: ``zlib.crc32`` of the stored tensor's bytes (contiguous,
little-endian), computed from the bytes written. Save time and bytes written per rank fall as
1/dp. Extra memory: for a synchronous save the entries are views of the live tensors, and
torch.distributed.checkpoint copies one view at a time while it writes; an asynchronous save
(``async_save.py``) copies this rank's share into host buffers it keeps for the next save.
The collective is torch.distributed.checkpoint's (plans gathered, ``.metadata`` written by the
first rank of the group), run before anything else so a failure there reaches every rank.
"""

from __future__ import annotations

import os
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from megalite.checkpointing.layout import Block, chunk_blocks, saved_order
from megalite.checkpointing.protocol import save_synced, write_json
from megalite.checkpointing.sharded import OPTIM_KEYS, crc_of, quiet_single_process
from megalite.parallel.state import ParallelState

__all__ = ["Shard", "plan_shards", "write_sharded", "crc32_of"]

Shard = Tuple[dict, torch.Tensor]  # (index entry without its crc32, the tensor to store)


def crc32_of(t: torch.Tensor) -> int:
    """``zlib.crc32`` of a tensor's bytes (contiguous, native little-endian), as the index records it."""
    return crc_of(t.detach().contiguous().cpu())


def _entry(prefix: str, b: Block, t: torch.Tensor, flat=None) -> dict:
    key = f"{prefix}/{b.key}" + (f"#{flat[0]}" if flat is not None else "")
    e = {
        "key": key,
        "prefix": prefix,
        "name": b.name,
        "shape": list(b.global_shape),
        "offsets": list(b.offsets),
        "sizes": list(b.sizes),
        "dtype": str(t.dtype).replace("torch.", ""),
    }
    if flat is not None:
        e["flat"] = [int(flat[0]), int(flat[1])]
    return e


def _optim_views(optimizer, pc) -> Dict[str, torch.Tensor]:
    """The optimizer state a piece stores: fp32 main weights (half-precision runs) and the Adam moments."""
    out = {"param": pc.main.detach()} if optimizer.half else {}
    st = optimizer.optimizer.state.get(pc.main, {})
    out.update({k: st[k].detach() for k in OPTIM_KEYS if k != "param" and torch.is_tensor(st.get(k))})
    return out


def plan_shards(ps: ParallelState, chunks: Sequence[nn.Module], optimizer) -> List[Shard]:
    """This rank's entries and the tensors they store (views of the live state, no copies, no collective)."""
    params = {(i, n): p for i, c in enumerate(chunks) for n, p in c.named_parameters()}
    pieces: Dict[int, list] = {}
    for pc in optimizer.pieces:
        pieces.setdefault(id(pc.param), []).append(pc)
    optimized = {id(p) for _, p in optimizer.named}
    sharded = {id(p) for part in optimizer.grads.parts if part.shard_grads for p in part.params}  # ZeRO-1, FSDP
    copies = {id(p) for part in optimizer.grads.parts if not getattr(part, "writes", True) for p in part.params}
    out: List[Shard] = []
    turns = {False: 0, True: 0}  # whole blocks go round-robin over the DP (dense) or EDP (expert) ranks
    for (i, name), blocks in saved_order(chunk_blocks(chunks, for_write=True)):
        param = params[(i, name)]
        p = param.detach()
        if id(param) in copies:
            continue  # hybrid sharding: the first copy of this shard writes it
        if id(param) in sharded:
            for b in blocks:
                a, z = b.local_rows[0] * b.row, b.local_rows[1] * b.row
                for pc in pieces.get(id(param), []):
                    lo, hi = max(pc.start, a), min(pc.end, z)
                    if lo >= hi:
                        continue
                    flat = (lo - a, hi - a)
                    weight = pc.model_slice[lo - pc.start : hi - pc.start]  # an FSDP shard's: in the compute dtype
                    out.append((_entry("model", b, weight, flat), weight))
                    for k, t in _optim_views(optimizer, pc).items():
                        piece = t.view(-1)[lo - pc.start : hi - pc.start]
                        out.append((_entry(f"optim.{k}", b, piece, flat), piece))
            continue
        state = {}
        if id(param) in optimized:
            pc = pieces[id(param)][0]  # the plain optimizer: one piece per parameter
            state = {k: t.view(p.shape) for k, t in _optim_views(optimizer, pc).items()}
        expert = bool(getattr(param, "expert_parallel", False))
        size, rank = (ps.edp_size, ps.edp_rank) if expert else (ps.dp_cp_size, ps.dp_cp_rank)
        for b in blocks:
            turns[expert] += 1
            if (turns[expert] - 1) % size != rank:  # the replicas: dp x cp (edp for experts)
                continue
            for prefix, t in [("model", p)] + [(f"optim.{k}", v) for k, v in state.items()]:
                view = b.local(t)
                out.append((_entry(prefix, b, view), view))
    return out


def write_sharded(tmp: str, ps: ParallelState, shards: Sequence[Shard], rng_state: dict, process_group=None) -> None:
    """Write this rank's shards, its index (with checksums) and random states into ``tmp``.

    Collective over ``process_group`` (the default group when None): torch.distributed.checkpoint
    plans the save on every rank and writes ``.metadata`` on the first.
    """
    state: Dict[str, torch.Tensor] = {e["key"]: t if t.is_contiguous() else t.contiguous() for e, t in shards}
    with quiet_single_process():  # first: a failure here reaches every rank through the collective
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), process_group=process_group)
    index = [{**e, "crc32": crc32_of(state[e["key"]])} for e, _ in shards]
    write_json(os.path.join(tmp, f"index_{ps.rank:05d}.json"), index)
    save_synced(rng_state, os.path.join(tmp, f"rng_{ps.rank:05d}.pt"))
