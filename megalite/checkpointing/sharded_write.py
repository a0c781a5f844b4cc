"""The sharded format's writer (the format is described in ``sharded.py``)."""
from __future__ import annotations

import os
from typing import Dict, List, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from megalite.checkpointing.layout import chunk_blocks
from megalite.checkpointing.protocol import save_synced, write_json
from megalite.checkpointing.run_state import RandomStates
from megalite.checkpointing.sharded import OPTIM_KEYS, quiet_single_process
from megalite.parallel_state import ParallelState

__all__ = ["write_sharded"]


def write_sharded(tmp: str, ps: ParallelState, chunks: Sequence[nn.Module], full_opt: dict,
                  rng: RandomStates) -> None:
    """Write this rank's blocks, index and random states into ``tmp`` (collective over the world).

    ``full_opt`` is the optimizer's ``full_state_dict`` (every parameter's whole fp32 state).
    """
    state: Dict[str, torch.Tensor] = {}
    index: List[dict] = []
    if ps.dp_rank == 0:  # DP replicas hold the same tensors: one writes them
        params = {(i, n): p for i, c in enumerate(chunks) for n, p in c.named_parameters()}
        for (i, name), blocks in chunk_blocks(chunks, for_write=True).items():
            sources = {"model": params[(i, name)].detach()}
            sources.update({f"optim.{k}": full_opt[name][k] for k in OPTIM_KEYS if k in full_opt.get(name, {})})
            for prefix, tensor in sources.items():
                for b in blocks:
                    key = f"{prefix}/{b.key}"
                    state[key] = b.local(tensor).contiguous()  # written before anything changes
                    index.append({"key": key, "prefix": prefix, "name": b.name, "shape": list(b.global_shape),
                                  "offsets": list(b.offsets), "sizes": list(b.sizes),
                                  "dtype": str(tensor.dtype).replace("torch.", "")})
    with quiet_single_process():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))
    write_json(os.path.join(tmp, f"index_{ps.rank:05d}.json"), index)
    save_synced(rng.state_dict(), os.path.join(tmp, f"rng_{ps.rank:05d}.pt"))


