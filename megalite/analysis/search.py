"""The planner's search: every layout pretrain_gpt.py accepts for a model on N devices, the ones
that fit, fastest first (tools/plan.py), why none fits, and the fitting layouts nearest a given one
(``--plan-check``'s suggestions). Memory and time come from planner.py.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

from megalite.analysis.planner import (
    FSDP_STRATEGIES,
    RECOMPUTE,
    GiB,
    Hardware,
    Layout,
    Memory,
    estimate_memory,
    estimate_step_time,
)
from megalite.config import ModelConfig
from megalite.config.sections import SHARDING_STRATEGIES
from megalite.pipeline.registry import SCHEDULES, validate_schedule

LONG_SEQUENCE = 8192  # from here on the search also splits sequences (context parallelism)


def _divisors(n: int) -> List[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def default_cp_sizes(seq_length: int) -> Tuple[int, ...]:
    """Context-parallel sizes worth searching: only long sequences are split."""
    return (1, 2, 4, 8) if seq_length >= LONG_SEQUENCE else (1,)


def model_splits(
    cfg: ModelConfig, num_gpus: int, gpus_per_node: int = 8, cp_sizes: Sequence[int] = (1,)
) -> Iterator[Tuple[int, int, int, int]]:
    """(tp, pp, dp, cp) for every split of ``num_gpus`` this model allows (tp x cp within a node for cp > 1
    is not required; tp within a node is), batch aside."""
    for tp, pp, cp in itertools.product(_divisors(num_gpus), _divisors(num_gpus), cp_sizes):
        if num_gpus % (tp * pp * cp) or tp > gpus_per_node or cfg.num_layers % pp:
            continue
        if cfg.num_attention_heads % tp or cfg.query_groups % tp or cfg.ffn_size % tp:
            continue
        if cp > 1 and cfg.seq_length % (2 * cp * tp):  # 2 x cp chunks, each split by tp under SP
            continue
        yield tp, pp, num_gpus // (tp * pp * cp), cp


def expert_splits(
    cfg: ModelConfig,
    tp: int,
    stage_ranks: int,
    ep_sizes: Optional[Sequence[int]] = None,
    etp_sizes: Optional[Sequence[int]] = None,
) -> List[Tuple[int, Optional[int], str]]:
    """(ep, etp, dispatcher) for an MoE on a stage of ``stage_ranks`` ranks (tp x cp x dp): every ep dividing
    the experts (or ``ep_sizes``), etp = tp or 1 (or ``etp_sizes``); alltoall once experts are split, as
    Megatron advises. A dense model: only (1, None, allgather)."""
    if not cfg.is_moe:
        return [(1, None, "allgather")]
    out = []
    for ep in ep_sizes or _divisors(cfg.num_experts):
        for etp in etp_sizes or sorted({tp, 1}):
            if (
                cfg.num_experts % ep
                or stage_ranks % (ep * etp)
                or cfg.moe_ffn_size % etp
                or (cfg.add_bias_linear and etp > 1)
            ):
                continue
            out.append((ep, None if etp == tp else etp, "alltoall" if ep > 1 else "allgather"))
    return out


def sharding_options(
    strategies: Sequence[str], tp: int, replicas: int, gpus_per_node: int, instances: Optional[int] = None
) -> List[Tuple[str, int]]:
    """(strategy, HSDP instances) worth trying over ``replicas`` = dp x cp ranks: none but no_shard with one
    replica; the FSDP ones flat and, when the replicas leave a node, sharded within a node and replicated
    across (``instances`` given: only that N, where it leaves more than one rank per shard group)."""
    if replicas == 1:
        return [("no_shard", 1)] if "no_shard" in strategies or not strategies else []
    per_node = max(1, gpus_per_node // tp)  # dp x cp ranks in a node: tp is the fastest axis
    if instances is not None:
        hsdp = [instances] if replicas % instances == 0 and replicas > instances else []
    else:
        hsdp = [1] + ([replicas // per_node] if replicas > per_node and replicas % per_node == 0 else [])
    out = []
    for s in strategies:
        out += [(s, n) for n in hsdp] if s in FSDP_STRATEGIES else [(s, 1)] if instances in (None, 1) else []
    return out


def candidate_layouts(
    cfg: ModelConfig,
    num_gpus: int,
    global_batch_size: int,
    gpus_per_node: int = 8,
    micro_batches: Sequence[int] = (1, 2, 4, 8),
    max_vp: int = 4,
    cp_sizes: Sequence[int] = (1,),
    schedules: Sequence[str] = (),
    ep_sizes: Optional[Sequence[int]] = None,
    etp_sizes: Optional[Sequence[int]] = None,
    strategies: Sequence[str] = SHARDING_STRATEGIES,
    reshard: bool = True,
    instances: Optional[int] = None,
) -> Iterator[Layout]:
    """Every layout pretrain_gpt.py accepts for this model on ``num_gpus`` devices (tp within a node), with
    Megatron's default schedule and each of ``schedules`` that runs on it (an MoE: each expert split,
    expert_splits), under each data-parallel sharding strategy (sharding_options; ``reshard`` False:
    optim_grads_params with --no-reshard-after-forward). FSDP runs no split-backward schedule
    (config/validate_sharding.py)."""
    for tp, pp, dp, cp in model_splits(cfg, num_gpus, gpus_per_node, cp_sizes):
        vps = [v for v in (1, 2, 3, 4, 6, 8) if v <= max_vp and (cfg.num_layers // pp) % v == 0] if pp > 1 else [1]
        sp = tp > 1 and cfg.seq_length % tp == 0
        if cfg.is_moe and tp > 1 and not sp:  # an MoE with tp needs sequence parallelism
            continue
        experts = expert_splits(cfg, tp, tp * cp * dp, ep_sizes, etp_sizes)
        shardings = sharding_options(strategies, tp, dp * cp, gpus_per_node, instances)
        for vp, mbs, rec, (strategy, n), (ep, etp, disp) in itertools.product(
            vps, micro_batches, RECOMPUTE, shardings, experts
        ):
            fsdp = strategy in FSDP_STRATEGIES
            layout = Layout(
                tp,
                pp,
                dp,
                vp,
                mbs,
                rec,
                sp=sp,
                dist_opt=strategy == "optim",
                cp=cp,
                ep=ep,
                etp=etp,
                moe_dispatcher=disp,
                sharding=strategy if fsdp else None,
                instances=n,
                reshard=reshard or strategy != "optim_grads_params",
            )
            if global_batch_size % (mbs * dp):
                continue
            for name in (None, *(s for s in schedules if s != layout.schedule())):
                if fsdp and SCHEDULES[name or layout.schedule()].split_backward:
                    continue
                try:
                    validate_schedule(name or layout.schedule(), pp, vp, layout.num_microbatches(global_batch_size))
                except ValueError:
                    continue
                yield replace(layout, schedule_name=name)


@dataclass(frozen=True)
class Plan:
    layout: Layout
    memory: Memory
    step_s: float
    bubble: float


def plan(
    cfg: ModelConfig,
    num_gpus: int,
    gpu_memory_gib: float,
    global_batch_size: int,
    hw: Optional[Hardware] = None,
    headroom: float = 0.15,
    device: str = "cuda",
    step_time: Optional[Callable[[Layout], Tuple[float, float]]] = None,
    **search,
) -> List[Plan]:
    """Layouts whose estimated memory fits in (1 - headroom) x the device memory, fastest first.

    ``step_time(layout) -> (seconds, bubble)`` replaces the hardware model (a calibrated prediction).

    Times within 2% of each other are too close for this model to tell apart: among them the
    simpler layout comes first (fewer pipeline stages and chunks, less tensor and context
    parallelism, less recomputation, fewer experts split, no FSDP), then the one with less memory.
    """
    hw = hw or Hardware()
    budget = gpu_memory_gib * GiB * (1.0 - headroom)
    out = []
    for layout in candidate_layouts(cfg, num_gpus, global_batch_size, hw.gpus_per_node, **search):
        mem = estimate_memory(cfg, layout, global_batch_size, device)
        if mem.total <= budget:
            out.append(
                Plan(
                    layout,
                    mem,
                    *(step_time(layout) if step_time else estimate_step_time(cfg, layout, global_batch_size, hw)),
                )
            )
    rec = {name: i for i, name in enumerate(RECOMPUTE)}
    fastest = min((p.step_s for p in out), default=1.0)
    return sorted(
        out,
        key=lambda p: (
            int(math.log(p.step_s / fastest) / math.log(1.02)),
            p.layout.pp * p.layout.vp,
            p.layout.tp * p.layout.cp,
            rec[p.layout.recompute],
            p.layout.ep,
            p.layout.fsdp,  # ZeRO-1 or none over FSDP when they are as fast: fewer collectives to go wrong
            p.memory.total,
        ),
    )


def layout_distance(a: Layout, b: Layout) -> float:
    """How far apart two layouts are, in flags to change (each doubling or halving of a size counts one)."""
    sizes = sum(
        abs(math.log2(x) - math.log2(y))
        for x, y in (
            (a.tp, b.tp),
            (a.pp, b.pp),
            (a.vp, b.vp),
            (a.cp, b.cp),
            (a.mbs, b.mbs),
            (a.ep, b.ep),
            (a.expert_tp, b.expert_tp),
        )
    )
    rec = {name: i for i, name in enumerate(RECOMPUTE)}
    return sizes + abs(rec[a.recompute] - rec[b.recompute]) + (a.sp != b.sp) * 0.5 + (a.strategy != b.strategy) * 0.5


def nearest_fitting(
    cfg: ModelConfig,
    layout: Layout,
    global_batch_size: int,
    budget_bytes: float,
    device: str = "cuda",
    count: int = 3,
    gpus_per_node: int = 8,
) -> List[Tuple[Layout, Memory]]:
    """The ``count`` layouts on the same number of devices nearest ``layout`` whose estimate fits ``budget_bytes``
    (same model and global batch; context parallelism searched when the run uses it or the sequence is long)."""
    cps = sorted(set(default_cp_sizes(cfg.seq_length)) | {1, layout.cp})
    found = []
    for cand in candidate_layouts(cfg, layout.world, global_batch_size, max(gpus_per_node, layout.tp), cp_sizes=cps):
        mem = estimate_memory(cfg, cand, global_batch_size, device)
        if mem.total <= budget_bytes:
            found.append((layout_distance(cand, layout), mem.total, cand, mem))
    found.sort(key=lambda x: (x[0], x[1]))
    return [(c, m) for _, _, c, m in found[:count]]


def _no_split(cfg: ModelConfig, num_gpus: int, cp_sizes: Sequence[int]) -> str:
    """Why ``model_splits`` gives nothing. With CP size 1 a split always exists (tp 1, pp 1: every model allows
    it), so it is the context-parallel sizes: one that does not divide the GPUs, or a sequence that does not
    split into its 2 x CP chunks."""
    for cp in cp_sizes:
        if num_gpus % cp:
            return f"context-parallel size {cp} does not divide {num_gpus} GPUs"
        if cfg.seq_length % (2 * cp):
            return f"--seq-length {cfg.seq_length} does not split into 2 x {cp} chunks for context-parallel size {cp}"
    return f"no split of {num_gpus} GPUs into tp x cp x dp x pp suits this model"  # unreachable with cp 1


def why_no_plan(
    cfg: ModelConfig,
    num_gpus: int,
    gpu_memory_gib: float,
    global_batch_size: int,
    hw: Optional[Hardware] = None,
    headroom: float = 0.15,
    **search,
) -> Tuple[str, bool]:
    """Why ``plan`` found nothing, as one line naming what to change; True when no layout at all takes the batch.

    The global batch must be a multiple of micro-batch x dp and give each pipeline enough micro-batches;
    when it rules out every split (or every split that would fit in memory), it is named, with the
    nearest batch that works, rather than memory.
    """
    hw = hw or Hardware()
    budget = gpu_memory_gib * GiB * (1.0 - headroom)
    cp_sizes = search.get("cp_sizes", (1,))
    dps = sorted({dp for _, _, dp, _ in model_splits(cfg, num_gpus, hw.gpus_per_node, cp_sizes)})
    if not dps:  # not the batch's fault: no split of the devices at all (the batch would be blamed with no sizes)
        return f"{_no_split(cfg, num_gpus, cp_sizes)}: no layout exists; change the context-parallel sizes", True

    def works(gbs: int, memory: bool) -> bool:
        return any(
            not memory or estimate_memory(cfg, layout, gbs).total <= budget
            for layout in candidate_layouts(cfg, num_gpus, gbs, hw.gpus_per_node, **search)
        )

    def nearest(memory: bool) -> Optional[int]:  # the smallest larger batch some data-parallel size divides
        tries = sorted({-(-global_batch_size // dp) * dp for dp in dps} | {global_batch_size * 2})
        return next((g for g in tries if g > global_batch_size and works(g, memory)), None)

    fits = f"no layout fits in {gpu_memory_gib * (1 - headroom):.1f} GiB per device"
    sizes = f"the data-parallel sizes this model allows on {num_gpus} GPUs are {', '.join(map(str, dps))}"
    if not works(global_batch_size, memory=False):
        better = nearest(memory=False)
        why = (
            "is not divisible by any data-parallel size"
            if all(global_batch_size % dp for dp in dps)
            else "gives too few micro-batches for every pipeline split"
        )
        return (
            f"--global-batch-size {global_batch_size} {why} ({sizes}); "
            + (f"use e.g. {better}" if better else "change it or --num-gpus")
        ), True
    better = nearest(memory=True)
    if better:
        return (
            f"{fits} with --global-batch-size {global_batch_size}, one does with {better} ({sizes}); or "
            f"add devices, lower --seq-length, or raise --gpu-memory"
        ), False
    return f"{fits}: add devices, lower --seq-length, or raise --gpu-memory", False
