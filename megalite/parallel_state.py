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

Mixtures of experts see each pipeline stage's N = TP x CP x DP ranks through a second grid,
ETP x EP x EDP = N (megatron-core's expert rank generator, order ``tp-ep-dp-pp``)::

    global_rank = etp_rank + ep_rank * ETP + edp_rank * ETP * EP + pp_rank * N

    world 8, TP=2, PP=2 (DP=2), EP=2, ETP=1 (EDP=2):
      ep groups   [0,1] [2,3] [4,5] [6,7]     (tokens are exchanged here; experts split over it)
      edp groups  [0,2] [1,3] [4,6] [5,7]     (the replicas of an expert: its gradients reduce here)
      tp_cp       [0,1] [2,3] ...             (the ranks splitting one micro-batch's tokens)
      stage       [0,1,2,3] [4,5,6,7]         (every rank of a stage: expert loads are counted here)

Expert groups are created on first use (``init_expert_groups``, called by every rank as it builds
its first MoE chunk); a group with the same members as another reuses its communicator.

This is the only module that creates process groups or asks torch.distributed
for the world's rank and size (a test enforces it). Everything else receives a
``ParallelState`` (or one of its ``AxisGroup`` members) as an argument.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megalite.config import ConfigError  # noqa: F401  (re-exported: grid_groups raises it)

logger = logging.getLogger(__name__)

# Axis order, fastest varying first (Megatron-Core's tp-cp-dp-pp). An expert axis slots in later.
AXES: Tuple[str, ...] = ("tp", "cp", "dp", "pp")


_THREAD = threading.local()  # .shadow: this thread's collectives use the groups' second communicators


@contextlib.contextmanager
def shadow_groups() -> Iterator[None]:
    """Within the block, on this thread, every AxisGroup that has a second communicator (``shadow``) hands
    that one out as ``group``: a forward running beside a backward on another thread (paired DualPipeV
    micro-batches) then issues its collectives on communicators of its own, in an order every rank
    shares, while the backward's keep theirs."""
    previous = getattr(_THREAD, "shadow", False)
    _THREAD.shadow = True
    try:
        yield
    finally:
        _THREAD.shadow = previous


@dataclass
class AxisGroup:
    """One rank's view of one parallel group: its members, its rank in it, the handle."""

    ranks: List[int]
    rank: int  # this process's index inside ``ranks``
    handle: Optional["dist.ProcessGroup"] = None  # None when size == 1 or not distributed
    shadow: Optional["dist.ProcessGroup"] = None  # the same members' second communicator (shadow_groups)

    @property
    def group(self) -> Optional["dist.ProcessGroup"]:
        """The communicator this thread uses (``handle``, or ``shadow`` inside shadow_groups)."""
        if self.shadow is not None and getattr(_THREAD, "shadow", False):
            return self.shadow
        return self.handle

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


def expert_grid_groups(world_size: int, tp: int, pp: int, cp: int = 1, ep: int = 1,
                       etp: Optional[int] = None) -> Dict[str, List[List[int]]]:
    """The expert grid's groups (``etp``, ``ep``, ``edp``, ``expert_mp`` = etp x ep) and the MoE helpers
    ``tp_cp`` (tp x cp) and ``stage`` (tp x cp x dp), without creating any process group."""
    etp = tp if etp is None else etp
    stage = world_size // pp
    if ep < 1 or etp < 1 or stage % (ep * etp):
        raise ConfigError(f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} does not "
                          f"divide the {stage} ranks of a pipeline stage (tp x cp x dp); change ep or etp")
    edp = stage // (ep * etp)
    out: Dict[str, List[List[int]]] = {k: [] for k in ("etp", "ep", "edp", "expert_mp", "stage")}
    for p in range(pp):
        base = p * stage
        out["stage"].append(list(range(base, base + stage)))
        for d in range(edp):
            for e in range(ep):
                out["etp"].append([base + t + e * etp + d * etp * ep for t in range(etp)])
            for t in range(etp):
                out["ep"].append([base + t + e * etp + d * etp * ep for e in range(ep)])
            out["expert_mp"].append([base + t + e * etp + d * etp * ep for e in range(ep) for t in range(etp)])
        for e in range(ep):
            for t in range(etp):
                out["edp"].append([base + t + e * etp + d * etp * ep for d in range(edp)])
    dense = grid_groups(world_size, tp, pp, cp)
    tp_cp = {}
    for g in dense["tp"]:
        key = tuple(next(c for c in dense["cp"] if g[0] in c))
        tp_cp.setdefault(key, set()).update(r for c in key for r in next(t for t in dense["tp"] if c in t))
    out["tp_cp"] = sorted(sorted(v) for v in tp_cp.values())
    return {k: sorted(sorted(g) for g in v) for k, v in out.items()}


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
                 cp: int = 1, ep: int = 1, etp: Optional[int] = None):
        self.world_size, self.rank = world_size, rank
        self.expert_memberships = expert_grid_groups(world_size, tp, pp, cp, ep, etp)  # validated now
        self._create_groups = create_groups
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

    def init_expert_groups(self) -> None:
        """Create the expert grid's groups (idempotent). Every rank must make the first call at the same
        point (GPTModel does, building an MoE model); a group whose members equal an existing group's
        reuses its communicator."""
        if "ep" in self.axes:
            return
        use_dist = self._create_groups and self.world_size > 1
        for name, all_groups in self.expert_memberships.items():
            # the same partition of the world as an existing axis: its communicators (decided from the
            # whole partition, never from this rank's own group, so every rank makes the same calls)
            same = [a for a, groups in self.memberships.items() if groups == all_groups and a in self.axes]
            same += [a for a in self.expert_memberships if a in self.axes and self.expert_memberships[a] == all_groups]
            if same:
                self.axes[name] = self.axes[same[0]]
                continue
            mine = None
            for ranks in all_groups:  # every rank calls new_group for every group, in the same order
                handle = dist.new_group(ranks, timeout=self.timeout) if use_dist and len(ranks) > 1 else None
                if self.rank in ranks:
                    mine = AxisGroup(ranks, ranks.index(self.rank), handle)
            self.axes[name] = mine

    SHADOWED = ("tp", "cp", "tp_cp", "ep", "etp", "expert_mp")  # the groups a forward's compute talks on

    def init_shadow_groups(self) -> None:
        """A second communicator for each group a forward computes with (idempotent; every rank calls it
        at the same point); axes with the same partition of the world share it."""
        if getattr(self, "_shadowed", False):
            return
        self.init_expert_groups()
        self._shadowed = True
        made: Dict[tuple, Optional["dist.ProcessGroup"]] = {}
        use_dist = self._create_groups and self.world_size > 1
        for name in self.SHADOWED:
            groups = {**self.memberships, **self.expert_memberships}[name]
            key = tuple(map(tuple, groups))
            if key not in made:
                made[key] = None
                for ranks in groups:  # every rank, every group, in the same order
                    handle = dist.new_group(ranks, timeout=self.timeout) if use_dist and len(ranks) > 1 else None
                    if self.rank in ranks:
                        made[key] = handle
            self.axes[name].shadow = made[key]

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def single(cls, device: Optional[torch.device] = None) -> "ParallelState":
        """A one-process state: every axis has size 1 and nothing is distributed."""
        return cls(1, 0, 1, 1, create_groups=False, device=device)

    @classmethod
    def from_env(cls, tp: int = 1, pp: int = 1, backend: Optional[str] = None,
                 timeout_s: float = 600.0, cp: int = 1, ep: int = 1, etp: Optional[int] = None) -> "ParallelState":
        """Initialise torch.distributed from torchrun's variables (if several ranks) and build groups.

        With WORLD_SIZE unset or 1 no process group is created at all, so a
        single-process run needs no rendezvous.
        """
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        grid_groups(world, tp, pp, cp)  # validate before any communication
        expert_grid_groups(world, tp, pp, cp, ep, etp)
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
                   timeout=timedelta(seconds=timeout_s), cp=cp, ep=ep, etp=etp)

    @classmethod
    def init_for_test(cls, rank: int, world_size: int, init_method: str, tp: int = 1, pp: int = 1,
                      timeout_s: float = 120.0, cp: int = 1, ep: int = 1,
                      etp: Optional[int] = None) -> "ParallelState":
        """Start a gloo process group on an explicit rendezvous (used by megalite.testing.run_distributed)."""
        if world_size > 1 and not dist.is_initialized():
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s))
        return cls(world_size, rank, tp, pp, backend="gloo", timeout=timedelta(seconds=timeout_s), cp=cp, ep=ep,
                   etp=etp)

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

    def _expert_axis(self, name: str) -> AxisGroup:
        return self.init_expert_groups() or self.axes[name]

    ep = property(lambda self: self._expert_axis("ep"), doc="the ranks one layer's experts are split over")
    etp = property(lambda self: self._expert_axis("etp"), doc="the ranks one expert is split over (its TP)")
    edp = property(lambda self: self._expert_axis("edp"), doc="the replicas of this rank's experts")
    expert_mp = property(lambda self: self._expert_axis("expert_mp"), doc="etp x ep: where tokens are exchanged")
    tp_cp = property(lambda self: self._expert_axis("tp_cp"), doc="the ranks sharing one micro-batch's tokens")
    stage = property(lambda self: self._expert_axis("stage"), doc="every rank of this pipeline stage")
    ep_size = property(lambda self: len(self.expert_memberships["ep"][0]))
    ep_rank = property(lambda self: self.ep.rank)
    etp_size = property(lambda self: len(self.expert_memberships["etp"][0]))
    etp_rank = property(lambda self: self.etp.rank)
    edp_size = property(lambda self: len(self.expert_memberships["edp"][0]))
    edp_rank = property(lambda self: self.edp.rank)

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

    def background_edp_group(self):
        """The expert data-parallel group on gloo, as :meth:`background_dp_group` (None: one rank)."""
        if getattr(self, "_background_edp", None) is None and self.edp_size > 1 and dist.is_initialized():
            for ranks in self.expert_memberships["edp"]:
                group = dist.new_group(ranks, backend="gloo", timeout=self.timeout)
                if self.rank in ranks:
                    self._background_edp = group
        return getattr(self, "_background_edp", None)

    def barrier(self) -> None:
        """Wait for every rank (no-op in one process)."""
        if dist.is_initialized():
            dist.barrier()

    def __repr__(self) -> str:
        return (f"ParallelState(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{self.tp_size}, "
                f"cp={self.cp_rank}/{self.cp_size}, dp={self.dp_rank}/{self.dp_size}, pp={self.pp_rank}/{self.pp_size})")
