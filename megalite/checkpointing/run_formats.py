"""The run's own checkpoint formats behind the Format protocol (formats.py), and their registry.

``ShardedFormat``: layout-free blocks on torch.distributed.checkpoint, each written by its owner
(sharded_write.py / sharded_read.py). ``TorchFormat``: Megatron-LM's legacy per-(tp, pp) rank
``model_optim_rng.pt`` files (torch_format.py). ``RUN_FORMATS`` holds both; the composition root
adds other projects' load sources with ``RUN_FORMATS.with_sources(...)``.
"""

from __future__ import annotations

from typing import Callable, Optional

from megalite.checkpointing.format_info import SHARDED_INFO, TORCH_INFO, FormatInfo
from megalite.checkpointing.formats import FormatRegistry
from megalite.checkpointing.run import RunParts
from megalite.checkpointing.run_state import layout_of
from megalite.checkpointing.sharded_read import read_sharded
from megalite.checkpointing.sharded_write import plan_shards, write_sharded
from megalite.checkpointing.torch_format import read_torch, torch_state, write_torch_state

__all__ = ["ShardedFormat", "TorchFormat", "RUN_FORMATS"]


class ShardedFormat:
    """Every block once, written by the rank that owns it; loads into any layout."""

    info: FormatInfo = SHARDED_INFO

    def background_group(self, run: RunParts):
        """torch.distributed.checkpoint's collective runs on a gloo group of its own with --async-save."""
        return run.ps.background_group()

    def snapshot(
        self, run: RunParts, tmp: str, meta: dict, rng: dict, keep: Callable, copy: bool, group=None
    ) -> Callable[[], None]:
        """This rank's blocks (views, or host copies through ``keep``); the writer of ``tmp``."""
        shards = [(e, keep(t, e["key"])) for e, t in plan_shards(run.ps, run.model_parts, run.optimizer)]

        def write() -> None:
            write_sharded(tmp, run.ps, shards, rng, process_group=group)

        return write

    def read(self, run: RunParts, d: str, meta: dict, load_optim: bool) -> Optional[dict]:
        """Blocks into this rank's slices; random states only when saved in this very layout."""
        same_layout = meta["layout"] == layout_of(run.cfg, run.ps)
        return read_sharded(d, meta, run.ps, run.model_parts, run.optimizer, load_optim, same_layout)


class TorchFormat:
    """Megatron-LM's legacy files, one per (tp, pp[, ep]) rank; loads into the saved layout only."""

    info: FormatInfo = TORCH_INFO

    def background_group(self, run: RunParts):
        """No collective of its own: the optimizer's DP gather picks its background group in snapshot."""
        return None

    def snapshot(
        self, run: RunParts, tmp: str, meta: dict, rng: dict, keep: Callable, copy: bool, group=None
    ) -> Callable[[], None]:
        """This rank's file content (the DP gather of the optimizer state: collective, or with --async-save
        and the distributed optimizer, in the background on gloo copies of the DP groups)."""
        ps, chunks, optimizer = run.ps, run.model_parts, run.optimizer
        if copy and any(part.shard_grads for part in optimizer.grads.parts):
            state = keep(torch_state(ps, chunks, optimizer, meta, rng, gather_optimizer=False), "state")
            own = optimizer.state_snapshot(optimizer.half, lambda t, where: keep(t, ("optim",) + where))
            dp_group = ps.background_dp_group()
            edp_group = ps.background_edp_group() if optimizer.has_experts else None

            def write() -> None:
                full = optimizer.full_state_dict(
                    to_cpu=True, snapshot=own, group=dp_group, expert_group=edp_group
                )  # collective, gloo
                if state is not None:
                    state["optimizer"]["state"] = full
                write_torch_state(tmp, ps, state)

            return write
        state = keep(torch_state(ps, chunks, optimizer, meta, rng), "state")  # the DP gather: collective

        def write_now() -> None:
            write_torch_state(tmp, ps, state)

        return write_now

    def read(self, run: RunParts, d: str, meta: dict, load_optim: bool) -> Optional[dict]:
        """This rank's file into its chunks (the saved layout must be this run's)."""
        here = layout_of(run.cfg, run.ps)
        return read_torch(
            d, meta["layout"], here, run.ps, run.model_parts, run.optimizer, load_optim, run.cfg.model.num_layers
        )


RUN_FORMATS = FormatRegistry((ShardedFormat(), TorchFormat()))
