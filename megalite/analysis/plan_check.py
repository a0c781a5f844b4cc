"""The planner checks itself and the launch it guards (``--plan-check``, on by default on GPUs).

Before the model is built (``preflight``, from pretrain_gpt.py): each rank compares the planner's
memory estimate for its pipeline rank with its device's free memory (torch.cuda.mem_get_info; on
CPU the host's available memory shared by the node's ranks) and a layout that cannot fit stops every
rank with one line naming the layouts nearest it that do (the planner's search, as tools/plan.py).
``MEGALITE_PLAN_CHECK_FREE_GIB`` replaces the free figure (tests, or a budget smaller than the device).

After the first iterations (``PlanCheck``, from the Trainer: the first log iteration from the third
on, or the last one of a shorter run), the logging rank prints the planner's memory per pipeline
rank, step time and bubble beside the measured ones: peak allocated memory on GPU; on CPU, where
torch keeps no allocator counters, the bytes autograd saves for each micro-batch of that iteration
(saved_tensors_hooks, replayed in the schedule's order for the peak) plus parameter, gradient-buffer
and optimizer-state bytes. The step time is the planner's hardware model at the device's peak
(on CPU: the rate of a probe matmul of the run's shape). ``timeline_meta`` adds the layout and the
step's timers to ``--timeline-out``, so that ``tools/plan.py --calibrate`` can predict other layouts.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megalite.analysis.calibrate import Calibration, MeasuredRun
from megalite.analysis.planner import GiB, Hardware, Layout, estimate_step_time, memory_per_rank
from megalite.analysis.search import nearest_fitting
from megalite.config import Config, ConfigError
from megalite.config.settings import RunSettings, resolve_settings
from megalite.observability.throughput import device_peak_tflops
from megalite.parallel.agreement import lowest_rank_with
from megalite.parallel.state import ParallelState
from megalite.pipeline.actions import Compute
from megalite.pipeline.registry import default_schedule_name

logger = logging.getLogger("megalite")
FREE_ENV = "MEGALITE_PLAN_CHECK_FREE_GIB"
HEADROOM = 0.15  # suggestions leave this share of the free memory for temporaries (tools/plan.py's default)
CHECK_AFTER = 3  # iterations before predicted and measured are compared


def enabled(cfg: Config, device: torch.device) -> bool:
    flag = getattr(cfg.train, "plan_check", None)
    return device.type == "cuda" if flag is None else bool(flag)


def layout_of(cfg: Config, settings: RunSettings) -> Layout:
    """The planner's Layout of a run."""
    m, par = cfg.model, cfg.parallel
    recompute = {"selective": "selective", "full": "full"}.get(m.recompute_granularity, "none")
    schedule = settings.schedule if settings.schedule != default_schedule_name(par.pp, par.vp) else None
    even = settings.stage_layers is None or len(set(settings.stage_layers)) == 1
    return Layout(
        par.tp,
        par.pp,
        settings.dp,
        par.vp,
        cfg.train.micro_batch_size,
        recompute,
        par.sequence_parallel and par.tp > 1,
        cfg.optim.use_distributed_optimizer,
        getattr(par, "cp", 1),
        schedule,
        None if even else tuple(settings.stage_layers),
        getattr(par, "cp_comm_type", "p2p"),
        *_expert_fields(cfg),
        sharding=cfg.optim.sharding if cfg.optim.fsdp else None,
        reshard=cfg.optim.reshard_after_forward,
        instances=cfg.optim.num_distributed_optimizer_instances,
    )


def _expert_fields(cfg: Config) -> Tuple[int, Optional[int], str]:
    """(ep, etp, dispatcher) of the Layout: an MoE's expert grid, (1, None, allgather) for a dense model."""
    par = cfg.parallel
    if not cfg.model.is_moe:
        return 1, None, "allgather"
    return par.ep, par.etp, par.moe_token_dispatcher_type


def free_memory(device: torch.device) -> Tuple[float, str]:
    """(bytes free for this rank, what they are)."""
    fake = os.environ.get(FREE_ENV)
    if fake:
        return float(fake) * GiB, f"{FREE_ENV}={fake}"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free), f"GPU {device.index if device.index is not None else 0} has"
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    available = float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    try:
        with open("/proc/meminfo") as f:
            available = next(float(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        pass
    return available / ranks, f"this host's available memory / {ranks} local rank{'s' if ranks > 1 else ''} is"


def refusal(cfg: Config, layout: Layout, pp_rank: int, free: float, where: str, device: str) -> Optional[str]:
    """The one-line refusal when the planner's estimate for ``pp_rank`` exceeds ``free`` bytes, else None."""
    mem = memory_per_rank(cfg.model, layout, cfg.train.global_batch_size, device)[pp_rank]
    if mem.total <= free:
        return None
    gib = lambda x: f"{x / GiB:.1f}"  # noqa: E731
    fits = nearest_fitting(cfg.model, layout, cfg.train.global_batch_size, free * (1 - HEADROOM), device)
    near = "; ".join(
        f"{c.describe()} ({gib(m.total)} GiB): {' '.join(_changed_flags(layout, c, cfg))}" for c, m in fits
    )
    return (
        f"--plan-check: {layout.describe()} needs an estimated {gib(mem.total)} GiB on pipeline rank {pp_rank} "
        f"(weights {gib(mem.weights)}, grads {gib(mem.grads)}, optimizer {gib(mem.optimizer)}, activations "
        f"{gib(mem.activations)}) but {where} {gib(free)} GiB free; "
        + (
            f"nearest layouts that fit in {gib(free * (1 - HEADROOM))} GiB: {near}"
            if fits
            else "no layout of this model and batch fits on this many devices: add devices or shorten --seq-length"
        )
        + "; --no-plan-check to try anyway"
    )


def _changed_flags(old: Layout, new: Layout, cfg: Config) -> List[str]:
    """The pretrain_gpt.py flags of ``new`` that differ from ``old``'s."""
    n = cfg.model.num_layers
    before = " ".join(old.flags(n))
    out, flags = [], new.flags(n)
    i = 0
    while i < len(flags):
        item = flags[i : i + 2] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else flags[i : i + 1]
        if " ".join(item) not in before:
            out += item
        i += len(item)
    if old.dist_opt and not new.dist_opt:
        out.append("(without --use-distributed-optimizer)")
    if old.recompute != "none" and new.recompute == "none":
        out.append("(without recomputation)")
    return out or ["(same flags)"]


def preflight(cfg: Config, ps: ParallelState) -> Optional[ConfigError]:
    """--plan-check before the model is built (collective when enabled): None, or the error every rank
    stops with (``report`` True on the one rank that says it)."""
    if not enabled(cfg, ps.device):
        return None
    settings = resolve_settings(cfg, ps.world_size)
    layout = layout_of(cfg, settings)
    free, where = free_memory(ps.device)
    device = "cuda" if ps.device.type == "cuda" else "cpu"
    line = refusal(cfg, layout, ps.pp_rank, free, where, device)
    lowest = lowest_rank_with(line is not None, ps)
    if lowest is None:
        return None
    err = ConfigError(line if lowest == ps.rank else "--plan-check refused the layout on another rank")
    err.report = lowest == ps.rank
    return err


class SavedBytes:
    """Context: bytes of every distinct storage autograd saves inside it, parameters excluded."""

    def __init__(self, params=()):
        self.storages: Dict[int, int] = {}
        self.skip = {p.untyped_storage().data_ptr() for p in params}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in self.skip:
            self.storages[st.data_ptr()] = st.nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


class ActivationMeter:
    """Counts what each chunk's forward (and loss) saves, per micro-batch, while installed."""

    def __init__(self, trainer):
        self.trainer, self.sizes = trainer, [[] for _ in trainer.chunks]
        for c, chunk in enumerate(trainer.chunks):
            chunk.forward = self._wrap(chunk.forward, c, new=True)
            chunk.loss = self._wrap(chunk.loss, c, new=False)

    def _wrap(self, fn, c: int, new: bool):
        def counted(*args, **kwargs):
            with SavedBytes(self.trainer.params) as counter:
                out = fn(*args, **kwargs)
            if new or not self.sizes[c]:
                self.sizes[c].append(counter.total)
            else:
                self.sizes[c][-1] += counter.total
            return out

        return counted

    def remove(self) -> None:
        for chunk in self.trainer.chunks:
            for name in ("forward", "loss"):
                chunk.__dict__.pop(name, None)

    def peak(self, actions) -> int:
        """Saved bytes held at the worst point of the rank's schedule (+ at F, - at B, or at W when split)."""
        computes = [a for a in actions if isinstance(a, Compute)]
        freed = "W" if any(a.kind == "W" for a in computes) else "B"
        order = [0] * len(self.sizes)
        sizes: Dict[Tuple[int, int], int] = {}
        live = peak = 0
        for a in computes:
            if a.kind == "F":
                sizes[(a.mb, a.chunk)] = (
                    self.sizes[a.chunk][order[a.chunk]] if order[a.chunk] < len(self.sizes[a.chunk]) else 0
                )
                order[a.chunk] += 1
                live += sizes[(a.mb, a.chunk)]
            elif a.kind == freed:
                live -= sizes.pop((a.mb, a.chunk), 0)
            peak = max(peak, live)
        return peak


def resident_state_bytes(trainer) -> Tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes a rank keeps between steps: FSDP's parameters and gradients
    by their local shards (a DTensor's numel is the whole tensor's), the gradient buffers (MoE: the experts'
    too), Adam's moments and the fp32 main weights the optimizer holds beside the model's."""
    weights = sum(local_tensor(p).numel() * p.element_size() for p in trainer.params)
    grads = trainer.optimizer.grads
    buffers = getattr(grads, "parts", None) or [grads]
    return (
        weights,
        sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
        trainer.optimizer.state_bytes(),
    )


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What this rank stores of ``t``: an FSDP shard's local rows, else ``t`` itself."""
    return getattr(t, "_local_tensor", t)


def probe_tflops(cfg: Config, device: torch.device, tp: int) -> float:
    """TFLOP/s of a matmul the size of the run's MLP input projection (the CPU's stand-in for a peak)."""
    m = cfg.model
    rows = cfg.train.micro_batch_size * m.seq_length
    a = torch.full((rows, m.hidden_size), 0.5, device=device, dtype=m.torch_dtype)  # no random draw
    b = torch.full((m.hidden_size, max(1, m.ffn_size // tp)), 0.25, device=device, dtype=m.torch_dtype)
    torch.matmul(a, b)
    t0, reps = time.perf_counter(), 5
    for _ in range(reps):
        torch.matmul(a, b)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2.0 * rows * m.hidden_size * b.shape[1] * reps / max(1e-9, time.perf_counter() - t0) / 1e12


def _fmt_error(pred: float, got: float) -> str:
    return f"{100 * (pred - got) / got:+.1f}%" if got > 0 else "n/a"


class PlanCheck:
    """The Trainer's hook: ``before_step``/``after_step`` around every train_step. Keeps the last step's
    timers (for ``timeline_meta``) and, when enabled, prints the predicted-beside-measured block once."""

    def __init__(self, cfg: Config, ps: ParallelState, settings: RunSettings):
        self.cfg, self.ps, self.settings = cfg, ps, settings
        self.enabled = enabled(cfg, ps.device)
        self.at: Optional[int] = None  # the iteration whose end prints the block
        self.meter: Optional[ActivationMeter] = None
        self.t0 = 0.0
        self.walls: List[float] = []
        self.bubbles: List[float] = []
        self.last_times: Dict[str, float] = {}

    def _due(self, first: int) -> int:
        every, last = self.cfg.logging.log_interval, self.cfg.train.train_iters
        it = first + CHECK_AFTER
        it += (-it) % every
        return min(it, last)

    def before_step(self, trainer, iteration: int) -> None:
        if self.enabled and self.at is None:
            self.at = self._due(iteration - 1)
        if self.enabled and iteration == self.at and self.ps.device.type == "cpu":
            self.meter = ActivationMeter(trainer)
        self.t0 = time.perf_counter()

    def after_step(self, trainer, iteration: int, out: Dict[str, float]) -> None:
        wall = time.perf_counter() - self.t0
        self.last_times = {
            "grads_sync": out.get("grads_sync", 0.0),
            "optimizer": out.get("optimizer", 0.0),
            "step": wall,
        }
        if not self.enabled or self.at is None or iteration > self.at:
            return
        self.walls.append(wall)
        self.bubbles.append(out.get("bubble", 0.0))
        if iteration == self.at:
            self._report(trainer, iteration)

    def _measured_memory(self, trainer) -> Tuple[float, float]:
        """(total, activations) bytes on this rank: the allocator's peak on GPU, counted on CPU."""
        if self.ps.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.ps.device)), 0.0
        acts = 0
        if self.meter is not None:
            acts = self.meter.peak(trainer.actions)
            self.meter.remove()
            self.meter = None
        return float(sum(resident_state_bytes(trainer)) + acts), float(acts)

    def _report(self, trainer, iteration: int) -> None:
        """Gather (pp rank, memory, activations, step wall, bubble) from every rank; the logging rank prints."""
        total, acts = self._measured_memory(trainer)
        skip = 1 if len(self.walls) > 1 else 0  # the run's first step warms up
        mine = torch.tensor(
            [
                float(self.ps.pp_rank),
                total,
                acts,
                statistics.mean(self.walls[skip:]),
                statistics.mean(self.bubbles[skip:]),
            ],
            dtype=torch.float64,
            device=self.ps.device,
        )
        rows, events = [mine], trainer.last_stats.events
        if self.ps.world_size > 1 and dist.is_initialized():
            rows = [torch.zeros_like(mine) for _ in range(self.ps.world_size)]
            dist.all_gather(rows, mine)
        if self.ps.pp_size > 1:
            parts: List[object] = [None] * self.ps.pp_size
            dist.all_gather_object(parts, events, group=self.ps.pp_group)
            events = [e for part in parts for e in part]
        if not self.ps.is_logging_rank:
            return
        self.events = events
        cpu_without_peak = (
            self.ps.device.type != "cuda" and device_peak_tflops(self.ps.device, self.cfg.logging.peak_tflops) is None
        )
        probed = probe_tflops(self.cfg, self.ps.device, self.ps.tp_size) if cpu_without_peak else None
        logger.info("\n".join(self.block([r.tolist() for r in rows], iteration, probed)))

    def block(self, got: List[List[float]], iteration: int, probed: Optional[float]) -> List[str]:
        """The lines of the predicted-beside-measured block from every rank's [pp rank, bytes, activation
        bytes, step seconds, bubble]."""
        cfg, settings = self.cfg, self.settings
        layout = layout_of(cfg, settings)
        cpu = self.ps.device.type != "cuda"
        pred = memory_per_rank(cfg.model, layout, cfg.train.global_batch_size, "cpu" if cpu else "cuda")
        if probed is not None:
            hw, rate = Hardware(peak_tflops=probed, efficiency=1.0), f"a probe matmul's {probed:.3g} TFLOP/s"
        else:
            peak = device_peak_tflops(self.ps.device, cfg.logging.peak_tflops) or 989.0
            hw, rate = Hardware(peak_tflops=peak), f"{peak:g} TFLOP/s x 0.5"
        step, bubble = estimate_step_time(cfg.model, layout, cfg.train.global_batch_size, hw)
        how = (
            "saved tensors of one step's micro-batches in schedule order + weights, grads, optimizer state"
            if cpu
            else "the allocator's peak (torch.cuda.max_memory_allocated)"
        )
        lines = [
            f"plan check after iteration {iteration}: {layout.describe()}, schedule {settings.schedule}, "
            f"{settings.num_microbatches} micro-batches (measured memory: {how})",
            f"    {'':<26}{'predicted':>12}{'measured':>12}{'error':>9}",
        ]
        mib = 2**20
        for r, mem in enumerate(pred):
            mine = [g for g in got if int(g[0]) == r]
            m_total = max(g[1] for g in mine) if mine else 0.0
            lines.append(
                f"    {f'memory MiB, pp rank {r}':<26}{mem.total / mib:>12.2f}{m_total / mib:>12.2f}"
                f"{_fmt_error(mem.total, m_total):>9}"
            )
            if cpu and mine:
                m_act = max(g[2] for g in mine)
                lines.append(
                    f"    {'  of which activations':<26}{mem.activations / mib:>12.2f}{m_act / mib:>12.2f}"
                    f"{_fmt_error(mem.activations, m_act):>9}"
                )
        m_step = max(g[3] for g in got)
        m_bubble = statistics.mean(g[4] for g in got)
        lines.append(
            f"    {'step time ms':<26}{1e3 * step:>12.1f}{1e3 * m_step:>12.1f}{_fmt_error(step, m_step):>9}"
            f"  (hardware model at {rate})"
        )
        lines.append(
            f"    {'pipeline bubble':<26}{100 * bubble:>11.1f}%{100 * m_bubble:>11.1f}%{'':>9}  (equal stages, B = 2 F)"
        )
        if getattr(self, "events", None):
            timeline = {
                "schedule": settings.schedule,
                "pp": layout.pp,
                "vp": layout.vp,
                "m": settings.num_microbatches,
                "events": self.events,
                **_layout_meta(layout),
            }
            sim = Calibration.fit(cfg.model, [MeasuredRun.from_timeline(timeline)]).simulate(
                layout, settings.num_microbatches
            )
            lines.append(
                f"    {'  from measured F/B/W':<26}{100 * sim[1]:>11.1f}%{100 * m_bubble:>11.1f}%{'':>9}"
                f"  (this step's compute per stage, transfers free: the schedule {1e3 * sim[0]:.1f} ms)"
            )
        lines.append(
            "    calibrate the planner with this run: --timeline-out FILE, then tools/plan.py --calibrate FILE"
        )
        return lines


def timeline_meta(trainer) -> Dict[str, object]:
    """What ``tools/plan.py --calibrate`` needs beside a timeline's events: the layout and the step's timers."""
    cfg, settings = trainer.cfg, trainer.settings
    layout = layout_of(cfg, settings)
    return {
        **_layout_meta(layout),
        "stage_layers": list(settings.stage_layers) if settings.stage_layers else None,
        "num_layers": cfg.model.num_layers,
        "seq_length": cfg.model.seq_length,
        "hidden_size": cfg.model.hidden_size,
        "params_dtype": cfg.model.params_dtype,
        "device": trainer.ps.device.type,
        "host_cores": host_cores(),
        "global_batch_size": cfg.train.global_batch_size,
        "timers": dict(getattr(getattr(trainer, "plan_check", None), "last_times", {}) or {}),
    }


def host_cores() -> int:
    """CPU cores this process may run on (what the ranks of a CPU run share)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _layout_meta(layout: Layout) -> Dict[str, object]:
    meta = {
        "tp": layout.tp,
        "dp": layout.dp,
        "cp": layout.cp,
        "mbs": layout.mbs,
        "recompute": layout.recompute,
        "sp": layout.sp,
        "dist_opt": layout.dist_opt,
        "cp_comm": layout.cp_comm,
        "stage_layers": list(layout.stage_layers) if layout.stage_layers else None,
    }
    if layout.fsdp:  # FSDP only: older runs' timelines keep their keys
        meta.update(sharding=layout.sharding, reshard=layout.reshard, instances=layout.instances)
    if layout.ep > 1 or layout.etp is not None:  # MoE only: a dense run's timeline keeps its keys
        meta.update(ep=layout.ep, etp=layout.etp, moe_dispatcher=layout.moe_dispatcher)
    return meta
