"""The rank grids and their process groups, built once from the config and passed explicitly.

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

Both grids are data (``grid.RankGrid``: axes and their order); the groups are declared as the
grid axes they span (``DENSE_GROUPS``, ``EXPERT_GROUPS``) and every one is created in
``__init__`` through one helper (``_new_groups``): the expert groups too when the run has experts.
Created later, on request, are only the groups of optional features: a second communicator per
forward group for DualPipeV's overlapped pairs (``init_shadow_groups``, called by the Trainer as it
is built) and the gloo groups of asynchronous checkpoint writes (``background_*``, first save).

This is the only module that creates process groups or asks torch.distributed
for the world's rank and size (a test enforces it). Everything else receives a
``ParallelState`` (or one of its ``AxisGroup`` members) as an argument. The state
also holds this rank's flight recorder, so whoever talks on its groups records there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megalite.config.checks import check_dense_sizes, check_expert_sizes
from megalite.observability.flight_recorder import FlightRecorder
from megalite.parallel.grid import RankGrid

if TYPE_CHECKING:
    from megalite.config import Config

logger = logging.getLogger(__name__)

# The grids' axes, fastest varying first (Megatron-Core's tp-cp-dp-pp; its expert order tp-ep-dp-pp).
AXES: Tuple[str, ...] = ("tp", "cp", "dp", "pp")
EXPERT_AXES: Tuple[str, ...] = ("etp", "ep", "edp", "pp")
# Each group by the grid axes it spans, in creation order (every rank creates them in this order); after
# the dense ones come ``embedding`` and ``position_embedding`` (the ends of each pp group), after the
# expert ones ``tp_cp`` (the dense grid's tp x cp).
DENSE_GROUPS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("tp", ("tp",)),
    ("cp", ("cp",)),
    ("dp", ("dp",)),
    ("pp", ("pp",)),
    ("dp_cp", ("cp", "dp")),
    ("mp", ("tp", "pp")),
)
EXPERT_GROUPS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("etp", ("etp",)),
    ("ep", ("ep",)),
    ("edp", ("edp",)),
    ("expert_mp", ("etp", "ep")),
    ("stage", ("etp", "ep", "edp")),
)


@dataclass
class AxisGroup:
    """One rank's view of one parallel group: its members, its rank in it, the handle."""

    ranks: List[int]
    rank: int  # this process's index inside ``ranks``
    handle: Optional["dist.ProcessGroup"] = None  # None when size == 1 or not distributed
    shadow: Optional["dist.ProcessGroup"] = None  # the same members' second communicator (shadow_groups)
    # the owning ParallelState's per-thread flags (.shadow: inside its shadow_groups on this thread)
    threads: Optional[threading.local] = field(default=None, repr=False, compare=False)
    name: str = ""  # the axis name (tp, cp, ep ...): the flight recorder's group of these collectives
    recorder: Optional[FlightRecorder] = field(default=None, repr=False, compare=False)  # ps.recorder

    @property
    def group(self) -> Optional["dist.ProcessGroup"]:
        """The communicator this thread uses (``handle``, or ``shadow`` inside shadow_groups)."""
        if self.shadow is not None and getattr(self.threads, "shadow", False):
            return self.shadow
        return self.handle

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def label(self) -> str:
        """The recorder's name of the communicator this thread uses: the shadow one counts its own
        sequence (a forward beside a backward on another thread orders its collectives independently)."""
        return self.name + "/shadow" if self.group is not self.handle else self.name

    def collective(self, fn, *args, **kwargs):
        """``fn(*args, group=<this thread's communicator>, **kwargs)``, recorded in the flight recorder as
        a collective of this group (per-group sequence number; its wait, or the handle's, recorded), so a
        hang inside the model names the collective and the members it waits for."""
        if self.recorder is None:
            return fn(*args, group=self.group, **kwargs)
        return self.recorder.call(self.label, fn, *args, group=self.group, **kwargs)

    def started(self, op: str, works: list):
        """Record point-to-point ``works`` already posted on this group (e.g. the CP ring's exchange) as
        collective ``op``; the returned handle's ``wait()`` waits for all of them, recorded."""
        if self.recorder is None:
            return _Works(works)
        return self.recorder.started(op, self.label, works)


class _Works:
    """Posted transfers waited for together (no recorder)."""

    __slots__ = ("works",)

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def dense_grid(world_size: int, tp: int, pp: int, cp: int = 1) -> RankGrid:
    """The dense grid (tp, cp, dp, pp); ConfigError (one line) when the sizes do not divide the world."""
    check_dense_sizes(world_size, tp, pp, cp)
    return RankGrid(zip(AXES, (tp, cp, world_size // (tp * pp * cp), pp)))


def expert_grid(world_size: int, tp: int, pp: int, cp: int = 1, ep: int = 1, etp: Optional[int] = None) -> RankGrid:
    """The experts' grid (etp, ep, edp inside each pipeline stage, then pp); ``etp`` None: tp. ConfigError
    when ep x etp does not divide a stage's ranks (checked first), or when the dense grid is wrong."""
    etp = tp if etp is None else etp
    stage = world_size // pp
    check_expert_sizes(stage, ep, etp)
    dense_grid(world_size, tp, pp, cp)
    return RankGrid(zip(EXPERT_AXES, (etp, ep, stage // (ep * etp), pp)))


def _dense_memberships(grid: RankGrid) -> Dict[str, List[List[int]]]:
    groups = {name: grid.groups(along) for name, along in DENSE_GROUPS}
    groups["embedding"] = [sorted({g[0], g[-1]}) for g in groups["pp"]]
    groups["position_embedding"] = [[g[0]] for g in groups["pp"]]
    return groups


def _expert_memberships(experts: RankGrid, dense: RankGrid) -> Dict[str, List[List[int]]]:
    return {**{name: experts.groups(along) for name, along in EXPERT_GROUPS}, "tp_cp": dense.groups(("tp", "cp"))}


def hybrid_shard_memberships(dp_cp: Sequence[List[int]], instances: int) -> Tuple[List[List[int]], List[List[int]]]:
    """(shard groups, replicate groups) of hybrid sharding: each dp x cp group cut into ``instances`` runs of
    consecutive members (one whole copy of the sharded state each), and the members at one position of every
    run (the copies of one shard)."""
    shard, replicate = [], []
    for group in dp_cp:
        size = len(group) // instances
        shard += [group[i * size : (i + 1) * size] for i in range(instances)]
        replicate += [group[j::size] for j in range(size)]
    return shard, replicate


def grid_groups(world_size: int, tp: int, pp: int, cp: int = 1) -> Dict[str, List[List[int]]]:
    """All group memberships for a world, without creating any process group.

    Returns a dict with keys ``tp``, ``cp``, ``dp``, ``pp``, ``dp_cp`` (data x context: the ranks
    holding the same model shard), ``mp`` (model parallel: tp x pp), ``embedding`` (first and last
    stage of each pipeline group) and ``position_embedding`` (first stage of each pipeline group).
    """
    return _dense_memberships(dense_grid(world_size, tp, pp, cp))


def expert_grid_groups(
    world_size: int, tp: int, pp: int, cp: int = 1, ep: int = 1, etp: Optional[int] = None
) -> Dict[str, List[List[int]]]:
    """The expert grid's groups (``etp``, ``ep``, ``edp``, ``expert_mp`` = etp x ep) and the MoE helpers
    ``tp_cp`` (tp x cp) and ``stage`` (tp x cp x dp), without creating any process group."""
    experts = expert_grid(world_size, tp, pp, cp, ep, etp)
    return _expert_memberships(experts, dense_grid(world_size, tp, pp, cp))


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
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(
        f"megalite/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/round_"
        f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
        client,
    )


def job_store(timeout_s: float = 5.0) -> Optional["dist.Store"]:
    """This restart round's view of torchrun's store, reachable before any process group exists, or None
    (not under torchrun's agent store, or the store cannot be reached within ``timeout_s``).

    A side channel every rank of a torchrun job shares from its first line on: the line that says why
    the job stopped is claimed there, so it is written once whichever rank gets there first.
    """
    try:
        return elastic_round_store(int(os.environ.get("WORLD_SIZE", "1")), timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError, KeyError, OSError):  # no store to share: each rank decides alone
        return None


class ParallelState:
    """This rank's place in the (tp, cp, dp, pp) grid (and the experts' grid), its process groups
    and its flight recorder.

    Build it with :meth:`from_config` (torchrun / a test harness already set the environment),
    :meth:`from_env` (the same from explicit sizes) or :meth:`single` (one process, no
    torch.distributed at all). ``experts``: the run has MoE layers, so the expert groups are
    created too (a single process or ``create_groups=False`` views have them regardless).
    """

    SHADOWED = ("tp", "cp", "tp_cp", "ep", "etp", "expert_mp")  # the groups a forward's compute talks on

    def __init__(
        self,
        world_size: int,
        rank: int,
        tp: int = 1,
        pp: int = 1,
        create_groups: bool = True,
        backend: Optional[str] = None,
        device: Optional[torch.device] = None,
        timeout: Optional[timedelta] = None,
        cp: int = 1,
        ep: int = 1,
        etp: Optional[int] = None,
        experts: bool = False,
    ):
        self.world_size, self.rank = world_size, rank
        self.expert_grid = expert_grid(world_size, tp, pp, cp, ep, etp)  # validated now
        self.grid = dense_grid(world_size, tp, pp, cp)
        self.memberships = _dense_memberships(self.grid)
        self.expert_memberships = _expert_memberships(self.expert_grid, self.grid)
        self.backend = backend
        # How long a blocking wait may last before the job is declared hung: every group gets it
        # (new_group would otherwise use torch's default, 30 min for gloo) and gloo point-to-point
        # receives need it passed explicitly or they wait forever.
        self.timeout = timeout
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.device = device
        self.recorder = FlightRecorder()  # what this rank did (hang diagnosis); start_hang_watch sizes it
        self._distributed = create_groups and world_size > 1
        self._threads = threading.local()  # .shadow: this thread's collectives use the second communicators
        self._shadowed = False
        self._background = self._background_dp = self._background_edp = None
        # Groups of one need no communicator: without torch.distributed every axis exists.
        self.has_experts = experts or not self._distributed
        self.axes: Dict[str, AxisGroup] = {}
        self._create_axes([(name, ("dp", "cp") if name == "dp_cp" else ()) for name in self.memberships])
        if self.has_experts:
            # an expert group with the same members as any earlier group takes its communicator
            earlier = tuple(self.memberships)
            self._create_axes(
                [(name, earlier + tuple(self.expert_memberships)[:i]) for i, name in enumerate(self.expert_memberships)]
            )

    # -- group creation: the one place (every rank, every group, in the same order) --------------
    def _partition(self, name: str) -> List[List[int]]:
        return self.memberships[name] if name in self.memberships else self.expert_memberships[name]

    def _new_groups(
        self, partition: Sequence[List[int]], backend: Optional[str] = None
    ) -> Optional["dist.ProcessGroup"]:
        """One communicator per group of ``partition``, this rank's returned (None: its group has one
        rank, or nothing is distributed). new_group is collective over the whole world: every rank
        creates every group, members or not, in the same order."""
        mine = None
        for ranks in partition:
            handle = None
            if self._distributed and len(ranks) > 1:
                handle = dist.new_group(ranks, timeout=self.timeout, backend=backend)
            if self.rank in ranks:
                mine = handle
        return mine

    def _create_axes(self, declared: Sequence[Tuple[str, Sequence[str]]]) -> None:
        """Create each declared axis' groups in order; an axis whose partition of the world equals that
        of one of the axes in its ``shares`` (already built) takes that axis' communicator instead."""
        for name, shares in declared:
            partition = self._partition(name)
            same = [a for a in shares if self._partition(a) == partition]
            # decided from the whole partition, never this rank's own group: every rank agrees. A shared
            # communicator still gets an AxisGroup of its own, named for the recorder (ep, not tp)
            handle = self.axes[same[0]].handle if same else self._new_groups(partition)
            ranks = next((g for g in partition if self.rank in g), [self.rank])  # embedding: not every rank
            self.axes[name] = AxisGroup(
                ranks, ranks.index(self.rank), handle, threads=self._threads, name=name, recorder=self.recorder
            )

    def init_shadow_groups(self) -> None:
        """A second communicator for each group a forward computes with (idempotent; every rank calls it
        at the same point: the Trainer, as it is built); axes with the same partition of the world share it."""
        if self._shadowed:
            return
        self._shadowed = True
        made: Dict[tuple, Optional["dist.ProcessGroup"]] = {}
        for name in self.SHADOWED:
            if name not in self.axes:  # a run without experts has no expert groups to shadow
                continue
            key = tuple(map(tuple, self._partition(name)))
            if key not in made:
                made[key] = self._new_groups(self._partition(name))
            self.axes[name].shadow = made[key]

    def init_hybrid_shard_groups(self, instances: int) -> None:
        """Split each dp x cp group for hybrid sharding (HSDP, --num-distributed-optimizer-instances):
        ``dp_cp_shard``, ``instances`` runs of consecutive members each holding one whole sharded copy, and
        ``dp_cp_replicate``, the members at one position in every run (the copies of one shard). Idempotent;
        every rank calls it at the same point (the Trainer, as it is built)."""
        if "dp_cp_shard" in self.axes:
            return
        shard, replicate = hybrid_shard_memberships(self.memberships["dp_cp"], instances)
        self.memberships.update(dp_cp_shard=shard, dp_cp_replicate=replicate)
        self._create_axes([("dp_cp_shard", ("dp_cp",)), ("dp_cp_replicate", ("dp_cp",))])

    @contextlib.contextmanager
    def shadow_groups(self) -> Iterator[None]:
        """Within the block, on this thread, every AxisGroup that has a second communicator (``shadow``) hands
        that one out as ``group``: a forward running beside a backward on another thread (paired DualPipeV
        micro-batches) then issues its collectives on communicators of its own, in an order every rank
        shares, while the backward's keep theirs."""
        previous = getattr(self._threads, "shadow", False)
        self._threads.shadow = True
        try:
            yield
        finally:
            self._threads.shadow = previous

    def background_group(self) -> Optional["dist.ProcessGroup"]:
        """A gloo group over the whole world for work done off the training thread (asynchronous
        checkpoint writes), so its collectives never interleave with training's. Created at the first
        call, which every rank must make at the same point; None in a single process."""
        if self._background is None and self.world_size > 1 and dist.is_initialized():
            self._background = self._new_groups([list(range(self.world_size))], backend="gloo")
        return self._background

    def background_dp_group(self) -> Optional["dist.ProcessGroup"]:
        """This rank's data x context group (``dp_cp``: the distributed optimizer's shards) again, on
        gloo, for off-thread work (the torch format's gather of distributed-optimizer shards during an
        asynchronous save); the same rules as :meth:`background_group`. None when dp_cp has one rank."""
        if self._background_dp is None and self.dp_cp_size > 1 and dist.is_initialized():
            self._background_dp = self._new_groups(self.memberships["dp_cp"], backend="gloo")
        return self._background_dp

    def background_edp_group(self) -> Optional["dist.ProcessGroup"]:
        """The expert data-parallel group on gloo, as :meth:`background_dp_group` (None: one rank)."""
        if self._background_edp is None and self.edp_size > 1 and dist.is_initialized():
            self._background_edp = self._new_groups(self.expert_memberships["edp"], backend="gloo")
        return self._background_edp

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def single(cls, device: Optional[torch.device] = None) -> "ParallelState":
        """A one-process state: every axis has size 1 and nothing is distributed."""
        return cls(1, 0, 1, 1, create_groups=False, device=device)

    @classmethod
    def from_config(cls, cfg: "Config") -> "ParallelState":
        """This rank's state for the run ``cfg`` describes: its parallel section's sizes, backend and
        timeout, and the expert groups when the model has experts (see :meth:`from_env`)."""
        par = cfg.parallel
        return cls.from_env(
            par.tp,
            par.pp,
            par.distributed_backend,
            timeout_s=60.0 * par.distributed_timeout_minutes,
            cp=par.cp,
            ep=par.ep,
            etp=par.etp,
            experts=cfg.model.is_moe,
        )

    @classmethod
    def from_env(
        cls,
        tp: int = 1,
        pp: int = 1,
        backend: Optional[str] = None,
        timeout_s: float = 600.0,
        cp: int = 1,
        ep: int = 1,
        etp: Optional[int] = None,
        experts: bool = False,
    ) -> "ParallelState":
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
            dist.init_process_group(
                backend, rank=rank, world_size=world, timeout=timeout, store=elastic_round_store(world, timeout)
            )
        return cls(
            dist.get_world_size(),
            dist.get_rank(),
            tp,
            pp,
            backend=backend,
            timeout=timedelta(seconds=timeout_s),
            cp=cp,
            ep=ep,
            etp=etp,
            experts=experts,
        )

    @classmethod
    def init_for_test(
        cls,
        rank: int,
        world_size: int,
        init_method: str,
        tp: int = 1,
        pp: int = 1,
        timeout_s: float = 120.0,
        cp: int = 1,
        ep: int = 1,
        etp: Optional[int] = None,
        experts: bool = False,
    ) -> "ParallelState":
        """Start a gloo process group on an explicit rendezvous (used by megalite.testing.run_distributed)."""
        if world_size > 1 and not dist.is_initialized():
            dist.init_process_group(
                "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
            )
        return cls(
            world_size,
            rank,
            tp,
            pp,
            backend="gloo",
            timeout=timedelta(seconds=timeout_s),
            cp=cp,
            ep=ep,
            etp=etp,
            experts=experts,
        )

    def destroy(self) -> None:
        """Tear the process group down (end of a run or test)."""
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- axis accessors (tp_*, pp_*, dp_* names; README, Architecture) -------------------------
    tp = property(lambda self: self.axes["tp"])
    cp = property(lambda self: self.axes["cp"])
    dp = property(lambda self: self.axes["dp"])
    dp_cp = property(
        lambda self: self.axes["dp_cp"],
        doc="every rank holding this rank's model shard: the group gradients are averaged over",
    )
    pp = property(lambda self: self.axes["pp"])
    mp = property(lambda self: self.axes["mp"])
    embedding = property(lambda self: self.axes["embedding"])
    position_embedding = property(lambda self: self.axes["position_embedding"])

    def _expert_axis(self, name: str) -> AxisGroup:
        if name not in self.axes:
            raise RuntimeError(
                f"this ParallelState has no expert groups ({name}): build it for a model with "
                "experts (ParallelState.from_config, or experts=True)"
            )
        return self.axes[name]

    ep = property(lambda self: self._expert_axis("ep"), doc="the ranks one layer's experts are split over")
    etp = property(lambda self: self._expert_axis("etp"), doc="the ranks one expert is split over (its TP)")
    edp = property(lambda self: self._expert_axis("edp"), doc="the replicas of this rank's experts")
    expert_mp = property(lambda self: self._expert_axis("expert_mp"), doc="etp x ep: where tokens are exchanged")
    tp_cp = property(lambda self: self._expert_axis("tp_cp"), doc="the ranks sharing one micro-batch's tokens")
    stage = property(lambda self: self._expert_axis("stage"), doc="every rank of this pipeline stage")
    ep_size = property(lambda self: self.expert_grid.sizes["ep"])
    ep_rank = property(lambda self: self.ep.rank)
    etp_size = property(lambda self: self.expert_grid.sizes["etp"])
    etp_rank = property(lambda self: self.etp.rank)
    edp_size = property(lambda self: self.expert_grid.sizes["edp"])
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

    def barrier(self) -> None:
        """Wait for every rank (no-op in one process)."""
        if dist.is_initialized():
            dist.barrier()

    def __repr__(self) -> str:
        return (
            f"ParallelState(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{self.tp_size}, "
            f"cp={self.cp_rank}/{self.cp_size}, dp={self.dp_rank}/{self.dp_size}, pp={self.pp_rank}/{self.pp_size})"
        )
