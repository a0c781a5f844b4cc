"""The rank grid and its process groups, built once and passed explicitly.

Ranks are laid out tensor-fastest, then context, then data, then pipeline
(Megatron-Core's ``tp-cp-dp-pp`` order)::

    global_rank = tp_rank + cp_rank * TP + dp_rank * TP * CP + pp_rank * TP * CP * DP

    world 16, TP=2, PP=4 (so DP=2, CP=1):
      tp groups  [0,1] [2,3] [4,5] ... [14,15]      (neighbours: fast links)
      dp groups  [0,2] [1,3] [4,6] [5,7] ...
      pp groups  [0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]

    world 16, TP=2, CP=2, PP=2 (so DP=2):
      tp groups     [0,1] [2,3] [4,5] ... [14,15]
      cp groups     [0,2] [1,3] [4,6] [5,7] ...       (one sequence split over these)
      dp groups     [0,4] [1,5] [2,6] [3,7] ...
      dp_cp groups  [0,2,4,6] [1,3,5,7] [8,10,12,14] [9,11,13,15]
      pp groups     [0,8] [1,9] ... [7,15]

The ``dp_cp`` group holds every rank with the same model shard (the CP ranks of
a replica keep the same weights and see different parts of the same samples):
gradients are averaged over it, the distributed optimizer and the checkpoint
writers share their work over it. ``dp`` stays the pure data axis: the sampler
reads by dp rank, so the CP ranks of one dp rank read the same samples. With
CP=1, ``dp_cp`` has exactly ``dp``'s members.

This is the only module that creates process groups or asks torch.distributed
for the world's rank and size (a test enforces it). Everything else receives a
``ParallelState`` (or one of its ``AxisGroup`` members) as an argument.
"""
from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megalite.config import ConfigError  # noqa: F401  (re-exported: grid_groups raises it)

logger = logging.getLogger(__name__)

# Axis order, fastest varying first (Megatron-Core's tp-cp-dp-pp). An expert axis slots in later.
AXES: Tuple[str, ...] = ("tp", "cp", "dp", "pp")


@dataclass
class AxisGroup:
    """One rank's view of one parallel group: its members, its rank in it, the handle."""

    ranks: List[int]
    rank: int  # this process's index inside ``ranks``
    group: Optional["dist.ProcessGroup"] = None  # None when size == 1 or not distributed

    @property
    def size(self) -> int:
        return len(self.ranks)


def grid_groups(world_size: int, tp: int, pp: int, cp: int = 1) -> Dict[str, List[List[int]]]:
    """All group memberships for a world, without creating any process group.

    Returns a dict with keys ``tp``, ``cp``, ``dp``, ``pp``, ``dp_cp`` (data x context: the ranks
    holding the same model shard), ``mp`` (model parallel: tp x pp), ``embedding`` (first and last
    stage of each pipeline group) and ``position_embedding`` (first stage of each pipeline group).
    """
    if tp < 1 or pp < 1 or cp < 1 or world_size % (tp * pp * cp) != 0:
        with_cp = f" x context-parallel-size ({cp})" if cp != 1 else ""
        raise ConfigError(
            f"world size {world_size} is not divisible by tensor-model-parallel-size ({tp}) x "
            f"pipeline-model-parallel-size ({pp}){with_cp}; change the parallel sizes or the number of "
            f"processes"
        )
    sizes = {"tp": tp, "cp": cp, "dp": world_size // (tp * pp * cp), "pp": pp}
    strides, s = {}, 1
    for axis in AXES:
        strides[axis] = s
        s *= sizes[axis]

    def groups_varying(varying: Sequence[str]) -> List[List[int]]:
        fixed = [a for a in AXES if a not in varying]
        out = []
        for fixed_coords in itertools.product(*(range(sizes[a]) for a in reversed(fixed))):
            base = sum(c * strides[a] for a, c in zip(reversed(fixed), fixed_coords))
            members = [
                base + sum(c * strides[a] for a, c in zip(reversed(varying), coords))
                for coords in itertools.product(*(range(sizes[a]) for a in reversed(varying)))
            ]
            out.append(sorted(members))
        return sorted(out)

    groups = {axis: groups_varying([axis]) for axis in AXES}
    groups["dp_cp"] = groups_varying(["cp", "dp"])
    groups["mp"] = groups_varying(["tp", "pp"])
    groups["embedding"] = [sorted({g[0], g[-1]}) for g in groups["pp"]]
    groups["position_embedding"] = [[g[0]] for g in groups["pp"]]
    return groups


def elastic_round_store(world_size: int, timeout: timedelta) -> Optional["dist.Store"]:
    """This restart round's own view of torchrun's store, or None (then env:// as usual).

    torchrun (c10d rendezvous, the default and --standalone's) hosts one TCPStore in the agent for
    the whole job and points every round's workers at it (TORCHELASTIC_USE_AGENT_STORE=True). Recent
    torch reads env:// with no per-round prefix there, so after a restart the new round's gloo
    rendezvous finds the dead round's keys (its ranks' listening addresses) under the same names and
    connects to them: "connectFullMesh failed ... Connection refused", or a hang. Keys under
    ``megalite/<run id>/round_<TORCHELASTIC_RESTART_COUNT>`` keep the rounds apart (what torch up to
    2.5 did itself with ``/worker/attempt_<n>``).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                           is_master=False, timeout=timeout)
    return dist.PrefixStore(f"megalite/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/round_"
                            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


class ParallelState:
    """This rank's place in the (tp, cp, dp, pp) grid plus its process groups.

    Build it with :meth:`from_env` (torchrun / a test harness already set the
    environment) or :meth:`single` (one process, no torch.distributed at all).
    """

    def __init__(self, world_size: int, rank: int, tp: int = 1, pp: int = 1,
                 create_groups: bool = True, backend: Optional[str] = None,
                 device: Optional[torch.device] = None, timeout: Optional[timedelta] = None,
                 cp: int = 1):
        self.world_size, self.rank = world_size, rank
        self.backend = backend
        # How long a blocking wait may last before the job is declared hung: every group gets it
        # (new_group would otherwise use torch's default, 30 min for gloo) and gloo point-to-point
        # receives need it passed explicitly or they wait forever.
        self.timeout = timeout
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                      else torch.device("cpu"))
        self.device = device
        self.memberships = grid_groups(world_size, tp, pp, cp)
        self.axes: Dict[str, AxisGroup] = {}
        use_dist = create_groups and world_size > 1
        for name, all_groups in self.memberships.items():
            same = [a for a in ("dp", "cp") if name == "dp_cp" and self.memberships[a] == all_groups]
            if same:  # cp 1 (or dp 1): the same ranks, so the same communicator, nothing new created
                self.axes[name] = self.axes[same[0]]
                continue
            mine = None
            for ranks in all_groups:
                # Every rank must call new_group for every group, in the same order.
                handle = dist.new_group(ranks, timeout=timeout) if use_dist and len(ranks) > 1 else None
                if rank in ranks:
                    mine = AxisGroup(ranks, ranks.index(rank), handle)
            self.axes[name] = mine if mine is not None else AxisGroup([rank], 0, None)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def single(cls, device: Optional[torch.device] = None) -> "ParallelState":
        """A one-process state: every axis has size 1 and nothing is distributed."""
        return cls(1, 0, 1, 1, create_groups=False, device=device)

    @classmethod
    def from_env(cls, tp: int = 1, pp: int = 1, backend: Optional[str] = None,
                 timeout_s: float = 600.0, cp: int = 1) -> "ParallelState":
        """Initialise torch.distributed from torchrun's variables (if several ranks) and build groups.

        With WORLD_SIZE unset or 1 no process group is created at all, so a
        single-process run needs no rendezvous.
        """
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        grid_groups(world, tp, pp, cp)  # validate before any communication
        if world == 1 and not dist.is_initialized():
            use_cuda = torch.cuda.is_available() and backend != "gloo"
            return cls.single(torch.device("cuda", 0) if use_cuda else torch.device("cpu"))
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            timeout = timedelta(seconds=timeout_s)
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                                    store=elastic_round_store(world, timeout))
        return cls(dist.get_world_size(), dist.get_rank(), tp, pp, backend=backend,
                   timeout=timedelta(seconds=timeout_s), cp=cp)

    @classmethod
    def init_for_test(cls, rank: int, world_size: int, init_method: str, tp: int = 1, pp: int = 1,
                      timeout_s: float = 120.0, cp: int = 1) -> "ParallelState":
        """Start a gloo process group on an explicit rendezvous (used by megalite.testing.run_distributed)."""
        if world_size > 1 and not dist.is_initialized():
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s))
        return cls(world_size, rank, tp, pp, backend="gloo", timeout=timedelta(seconds=timeout_s), cp=cp)

    def destroy(self) -> None:
        """Tear the process group down (end of a run or test)."""
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- axis accessors (tp_*, pp_*, dp_* names; README, Architecture) -------------------------
    @property
    def tp(self) -> AxisGroup:
        return self.axes["tp"]

    @property
    def cp(self) -> AxisGroup:
        return self.axes["cp"]

    @property
    def dp(self) -> AxisGroup:
        return self.axes["dp"]

    @property
    def dp_cp(self) -> AxisGroup:
        """Every rank holding this rank's model shard: the group gradients are averaged over."""
        return self.axes["dp_cp"]

    @property
    def pp(self) -> AxisGroup:
        return self.axes["pp"]

    @property
    def mp(self) -> AxisGroup:
        return self.axes["mp"]

    @property
    def embedding(self) -> AxisGroup:
        return self.axes["embedding"]

    @property
    def position_embedding(self) -> AxisGroup:
        return self.axes["position_embedding"]

    tp_size = property(lambda self: self.tp.size)
    tp_rank = property(lambda self: self.tp.rank)
    tp_group = property(lambda self: self.tp.group)
    cp_size = property(lambda self: self.cp.size)
    cp_rank = property(lambda self: self.cp.rank)
    cp_group = property(lambda self: self.cp.group)
    dp_size = property(lambda self: self.dp.size)
    dp_rank = property(lambda self: self.dp.rank)
    dp_group = property(lambda self: self.dp.group)
    dp_cp_size = property(lambda self: self.dp_cp.size)
    dp_cp_rank = property(lambda self: self.dp_cp.rank)
    dp_cp_group = property(lambda self: self.dp_cp.group)
    pp_size = property(lambda self: self.pp.size)
    pp_rank = property(lambda self: self.pp.rank)
    pp_group = property(lambda self: self.pp.group)

    # -- pipeline position ---------------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_pp_rank(self) -> int:
        """Global rank of the next pipeline stage (wrapping, as interleaving needs)."""
        return self.pp.ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def prev_pp_rank(self) -> int:
        return self.pp.ranks[(self.pp_rank - 1) % self.pp_size]

    @property
    def is_logging_rank(self) -> bool:
        """The last global rank: it sits on the last pipeline stage, where the loss lives."""
        return self.rank == self.world_size - 1

    def background_group(self):
        """A gloo group over the whole world for work done off the training thread (asynchronous
        checkpoint writes), so its collectives never interleave with training's. Created at the first
        call, which every rank must make at the same point; None in a single process."""
        if getattr(self, "_background", None) is None and self.world_size > 1 and dist.is_initialized():
            self._background = dist.new_group(backend="gloo", timeout=self.timeout)
        return getattr(self, "_background", None)

    def background_dp_group(self):
        """This rank's data x context group (``dp_cp``: the distributed optimizer's shards) again, on
        gloo, for off-thread work (the torch format's gather of distributed-optimizer shards during an
        asynchronous save); the same rules as :meth:`background_group`. None when dp_cp has one rank."""
        if getattr(self, "_background_dp", None) is None and self.dp_cp_size > 1 and dist.is_initialized():
            for ranks in self.memberships["dp_cp"]:
                group = dist.new_group(ranks, backend="gloo", timeout=self.timeout)  # every rank, every group
                if self.rank in ranks:
                    self._background_dp = group
        return getattr(self, "_background_dp", None)

    def barrier(self) -> None:
        """Wait for every rank (no-op in one process)."""
        if dist.is_initialized():
            dist.barrier()

    def __repr__(self) -> str:
        return (f"ParallelState(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{self.tp_size}, "
                f"cp={self.cp_rank}/{self.cp_size}, dp={self.dp_rank}/{self.dp_size}, pp={self.pp_rank}/{self.pp_size})")
