"""Calibrated step time: costs fitted from measured runs, scaled to other layouts, timed by the simulator.

A measured run (its ``--timeline-out`` JSON: each pipeline rank's F/B/W events of the last iteration,
plus the layout, the model shape and the step's timers, see ``timeline_meta``) gives, for every
global stage and action kind, the median seconds per micro-batch. Those are fitted, by least squares
over every stage of every run given, to per-token costs of the model's pieces::

    stage cost (kind k) = tokens x [ n_layers x L_k / tp  +  last x H_k / tp  +  first x E_k
                                     + (n_layers + first + last) x C_k x 2 (tp - 1) / tp ]

tokens = micro-batch x seq / cp on the rank; L a transformer layer, H the output layer and loss, E the
embedding, C tensor-parallel communication (k = F, the whole backward B, and W, the weight-gradient
part of a split backward). Pieces a run cannot tell apart (one stage: layers and head together; no
tensor parallelism: C) are held near a prior by a weak ridge: the head's FLOPs against a layer's, C
zero. The step's other parts are fitted too: the optimizer per parameter on the rank (divided over
dp x cp with ZeRO-1), the gradient reduction as a constant plus a cost per byte of the ring all-reduce
over dp x cp, and the pipeline's transfers as a cost per Comm action of the busiest rank (what the
measured schedule took beyond the simulated one). ``Calibration.predict`` then builds any layout's
stage costs from those pieces and runs the pipeline simulator (executor semantics) over its schedule.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megalite.analysis.planner import Layout, _with_recompute, params_per_rank
from megalite.analysis.simulate import simulate_schedule
from megalite.config import ModelConfig
from megalite.model.spec import ModelSpec
from megalite.pipeline.actions import Comm
from megalite.pipeline.registry import build_schedule, get_schedule

KINDS = ("F", "B", "W")
PIECES = ("layer", "head", "embedding", "tp_comm")


class CalibrationError(ValueError):
    """A timeline or stage-cost file that cannot calibrate the planner (one line)."""


def layout_from_meta(meta: dict) -> Layout:
    """The Layout a timeline's metadata describes (``timeline_meta`` writes it)."""
    missing = [k for k in ("tp", "dp", "mbs") if k not in meta]
    if missing:
        raise CalibrationError(
            f"the timeline has no {', '.join(missing)}: write it with this megalite's "
            f"--timeline-out (older timelines lack the layout)"
        )
    layers = meta.get("stage_layers")
    return Layout(
        int(meta["tp"]),
        int(meta["pp"]),
        int(meta["dp"]),
        int(meta.get("vp", 1)),
        int(meta["mbs"]),
        meta.get("recompute", "none"),
        bool(meta.get("sp", False)),
        bool(meta.get("dist_opt", False)),
        int(meta.get("cp", 1)),
        meta.get("schedule"),
        tuple(layers) if layers else None,
        meta.get("cp_comm", "p2p"),
        int(meta.get("ep", 1)),
        meta.get("etp"),
        meta.get("moe_dispatcher", "allgather"),
        sharding=meta.get("sharding"),
        reshard=bool(meta.get("reshard", True)),
        instances=int(meta.get("instances", 1)),
    )


def comm_count(layout: Layout, m: int) -> int:
    """Comm actions on the busiest pipeline rank of ``layout``'s schedule."""
    if layout.pp == 1:
        return 0
    lists = build_schedule(layout.schedule(), layout.pp, layout.vp, m)
    return max(sum(isinstance(a, Comm) for a in rank) for rank in lists)


@dataclass(frozen=True)
class MeasuredRun:
    """What one measured run says: its layout, seconds per micro-batch by (global stage, kind), and the step."""

    layout: Layout
    m: int
    stage_seconds: Dict[Tuple[int, str], float]
    schedule_s: float  # the measured pipeline schedule (first start to last end over the ranks)
    grads_sync_s: float = 0.0
    optimizer_s: float = 0.0
    step_s: Optional[float] = None  # the measured step; None: schedule + grads_sync + optimizer
    busy_s: float = 0.0  # compute seconds summed over the timeline's pipeline ranks
    cores: Optional[float] = None  # CPU cores the ranks of a CPU run shared (None: a device each)

    @property
    def measured_step(self) -> float:
        return self.step_s if self.step_s is not None else self.schedule_s + self.grads_sync_s + self.optimizer_s

    @classmethod
    def from_timeline(cls, timeline: dict) -> "MeasuredRun":
        layout = layout_from_meta(timeline)
        place, events = layout.placement(), timeline.get("events") or []
        if not events:
            raise CalibrationError("the timeline has no events")
        per: Dict[Tuple[int, str], List[float]] = defaultdict(list)
        for e in events:
            per[(place.stage(int(e["rank"]), int(e["chunk"])), e["kind"])].append(e["end"] - e["start"])
        seconds = {k: statistics.median(v) for k, v in per.items()}
        if not get_schedule(layout.schedule()).split_backward:
            seconds.update({(s, "W"): 0.0 for s, k in list(seconds) if k == "B"})
        wall = max(e["end"] for e in events) - min(e["start"] for e in events)
        timers = timeline.get("timers") or {}
        busy = sum(e["end"] - e["start"] for e in events)
        cores = timeline.get("host_cores") if timeline.get("device") == "cpu" else None
        return cls(
            layout,
            int(timeline["m"]),
            seconds,
            wall,
            float(timers.get("grads_sync", 0.0)),
            float(timers.get("optimizer", 0.0)),
            timers.get("step"),
            busy,
            cores,
        )

    def contention(self) -> float:
        """How much slower than alone each rank computed: ranks busy on average / cores (at least 1)."""
        if not self.cores:
            return 1.0
        return max(1.0, self.busy_s / self.schedule_s * self.layout.world / self.layout.pp / self.cores)


def _features(cfg: ModelConfig, layout: Layout, stage: int) -> List[float]:
    """Per-piece multipliers of one stage's cost (see the module docstring), in PIECES order."""
    layers, last = layout.layers(cfg.num_layers), layout.pp * layout.vp - 1
    t, n = layout.tp, layers[stage]
    tokens = layout.mbs * cfg.seq_length / layout.cp
    first_, last_ = float(stage == 0), float(stage == last)
    comm = 2 * (t - 1) / t * (n + first_ + last_)
    return [tokens * n / t, tokens * last_ / t, tokens * first_, tokens * comm]


def _head_ratio(cfg: ModelConfig, tp: int) -> float:
    """The output layer's matmul FLOPs against one layer's (the prior for runs that cannot tell them apart)."""
    return cfg.hidden_size * cfg.padded_vocab_size(tp) / ModelSpec.of(cfg).layer_macs_per_token()


@dataclass
class Calibration:
    """Fitted per-token costs of each model piece by kind, and the step's other parts."""

    cfg: ModelConfig
    pieces: Dict[str, Dict[str, float]]  # kind -> piece -> seconds per token (per layer for layer/tp_comm)
    optimizer_per_param: float
    grads_sync_const: float
    grads_sync_per_byte: float
    comm_s: float  # per Comm action of the busiest rank
    cores: Optional[float] = None  # CPU runs: cores the ranks share (processor sharing); None: a device each
    overhead_s: float = 0.0  # per step, what the timed parts leave out (zeroing grads, Python)
    runs: List[MeasuredRun] = field(default_factory=list)

    @classmethod
    def fit(
        cls, cfg: ModelConfig, runs: Sequence[MeasuredRun], prior_bytes_per_s: float = 1e9, ridge: float = 1e-3
    ) -> "Calibration":
        """Least squares over every stage of ``runs`` (relative errors), weak ridge towards the priors."""
        if not runs:
            raise CalibrationError("calibration needs at least one measured run")
        cores = min((r.cores for r in runs if r.cores), default=None)
        pieces: Dict[str, Dict[str, float]] = {}
        for kind in KINDS:
            rows, obs = [], []
            for run in runs:
                for s in range(run.layout.pp * run.layout.vp):
                    y = run.stage_seconds.get((s, kind))
                    if kind == "B" and y is not None:
                        y += run.stage_seconds.get((s, "W"), 0.0)  # B: the whole backward
                    if y is None or (kind == "W" and not get_schedule(run.layout.schedule()).split_backward):
                        continue
                    y /= run.contention()  # what the stage costs alone
                    x = _features(_with_recompute(cfg, run.layout.recompute), run.layout, s)
                    w = 1.0 / max(y, 1e-9)
                    rows.append([v * w for v in x])
                    obs.append(1.0)
            pieces[kind] = cls._solve(cfg, rows, obs, ridge, runs[0].layout.tp)
        if not any(get_schedule(r.layout.schedule()).split_backward for r in runs):
            pieces["W"] = {k: v / 2 for k, v in pieces["B"].items()}  # the simulator's default: half the backward
        opt = [(r.optimizer_s / _all_busy(r.layout, cores), _effective_params(cfg, r.layout)) for r in runs]
        per_param = sum(t * n for t, n in opt) / max(1e-30, sum(n * n for _, n in opt))
        gs = [(r.grads_sync_s / _all_busy(r.layout, cores), _reduce_bytes(cfg, r.layout)) for r in runs]
        a = torch.tensor([[1.0, b] for _, b in gs] + [[0.0, ridge * prior_bytes_per_s * 1e-6]], dtype=torch.float64)
        y = torch.tensor([t for t, _ in gs] + [ridge * 1e-6], dtype=torch.float64)
        const, per_byte = torch.linalg.lstsq(a, y.unsqueeze(1)).solution.squeeze(1).tolist()
        cal = cls(cfg, pieces, per_param, max(0.0, const), max(0.0, per_byte), 0.0, cores, 0.0, list(runs))
        extra = [(r.schedule_s - cal.simulate(r.layout, r.m)[0], comm_count(r.layout, r.m)) for r in runs]
        extra = [(x, n) for x, n in extra if n > 0]
        cal.comm_s = max(0.0, sum(x for x, _ in extra) / sum(n for _, n in extra)) if extra else 0.0
        gbs = [r.layout.mbs * r.layout.dp * r.m for r in runs]
        cal.overhead_s = statistics.mean(r.measured_step - cal.predict(r.layout, g).step_s for r, g in zip(runs, gbs))
        return cal

    @staticmethod
    def _solve(cfg: ModelConfig, rows: List[List[float]], obs: List[float], ridge: float, tp: int) -> Dict[str, float]:
        if not rows:
            return {p: 0.0 for p in PIECES}
        a = torch.tensor(rows, dtype=torch.float64)
        y = torch.tensor(obs, dtype=torch.float64)
        scale = a.abs().max(dim=0).values
        active = scale > 0  # pieces no measured stage has (tensor parallelism in a tp 1 run) stay 0
        a, scale = a[:, active], scale[active]  # columns in comparable units
        r = _head_ratio(cfg, tp)
        prior = (
            torch.tensor([[-r, 1.0, 0.0, 0.0], [-0.05, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)[
                :, active
            ]
            * ridge
            * scale.max()
        )
        a_all = torch.cat([a / scale, prior / scale])
        y_all = torch.cat([y, torch.zeros(3, dtype=torch.float64)])
        x = torch.zeros(len(PIECES), dtype=torch.float64)
        x[active] = torch.linalg.lstsq(a_all, y_all.unsqueeze(1)).solution.squeeze(1) / scale
        return dict(zip(PIECES, x.clamp_min(0.0).tolist()))

    def stage_costs(self, layout: Layout) -> List[Tuple[float, float, float]]:
        """(forward, whole backward, weight part) seconds per micro-batch of every global stage of ``layout``."""
        cfg = _with_recompute(self.cfg, layout.recompute)
        out = []
        for s in range(layout.pp * layout.vp):
            x = _features(cfg, layout, s)
            f, b, w = (sum(c * self.pieces[k][p] for c, p in zip(x, PIECES)) for k in KINDS)
            if layout.recompute != "none":  # the layers' forward again (selective: its core attention share)
                proj, core, mlp = ModelSpec.of(cfg).layer_flops_per_token(causal=True)
                share = 1.0 if layout.recompute == "full" else core / (proj + core + mlp)
                b += share * x[0] * self.pieces["F"]["layer"]
            out.append((f, b, min(w, b)))
        return out

    def simulate(self, layout: Layout, m: int) -> Tuple[float, float]:
        """(schedule seconds, bubble) of ``layout``'s schedule over ``m`` micro-batches from the fitted costs.

        With ``cores`` (ranks sharing a CPU) every cost is stretched by the contention the schedule itself
        creates: ranks busy on average / cores, found by fixed-point iteration.
        """
        base, slow = self.stage_costs(layout), 1.0
        for _ in range(30 if self.cores else 1):
            res = simulate_schedule(
                layout.schedule(),
                layout.pp,
                layout.vp,
                m,
                mode="executor",
                stage_costs=[tuple(c * slow for c in cost) for cost in base],
            )
            if not self.cores:
                break
            busy = sum(res.busy) / res.makespan * layout.world / layout.pp
            slow = 0.5 * slow + 0.5 * max(1.0, busy / self.cores)
        return res.makespan, statistics.mean(res.bubble_fraction)

    def to_json(self) -> dict:
        """The fitted costs (``tools/plan.py --save-calibration``; read back with ``from_json``)."""
        return {
            "calibration": 1,
            "num_layers": self.cfg.num_layers,
            "seq_length": self.cfg.seq_length,
            "pieces": self.pieces,
            "optimizer_per_param": self.optimizer_per_param,
            "grads_sync_const": self.grads_sync_const,
            "grads_sync_per_byte": self.grads_sync_per_byte,
            "comm_s": self.comm_s,
            "cores": self.cores,
            "overhead_s": self.overhead_s,
        }

    @classmethod
    def from_json(cls, cfg: ModelConfig, d: dict) -> "Calibration":
        try:
            pieces = {k: {p: float(d["pieces"][k][p]) for p in PIECES} for k in KINDS}
            return cls(
                cfg,
                pieces,
                float(d["optimizer_per_param"]),
                float(d["grads_sync_const"]),
                float(d["grads_sync_per_byte"]),
                float(d["comm_s"]),
                d.get("cores"),
                float(d.get("overhead_s", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CalibrationError(
                f"a stage-cost file needs pieces ({', '.join(PIECES)}) by kind "
                f"({', '.join(KINDS)}) and the step's costs; missing or bad: {e}"
            ) from None

    def predict(self, layout: Layout, global_batch_size: int) -> "Predicted":
        m = layout.num_microbatches(global_batch_size)
        schedule, bubble = self.simulate(layout, m)
        schedule += self.comm_s * comm_count(layout, m)
        busy = _all_busy(layout, self.cores)
        grads = (self.grads_sync_const + self.grads_sync_per_byte * _reduce_bytes(self.cfg, layout)) * busy
        opt = self.optimizer_per_param * _effective_params(self.cfg, layout) * busy
        return Predicted(schedule + grads + opt + self.overhead_s, schedule, grads, opt, bubble)


@dataclass(frozen=True)
class Predicted:
    step_s: float
    schedule_s: float
    grads_sync_s: float
    optimizer_s: float
    bubble: float


def _all_busy(layout: Layout, cores: Optional[float]) -> float:
    """Contention while every rank works at once (the optimizer step, the gradient reduction)."""
    return max(1.0, layout.world / cores) if cores else 1.0


def _effective_params(cfg: ModelConfig, layout: Layout) -> float:
    """Parameters whose optimizer step the busiest rank runs."""
    n = max(params_per_rank(cfg, layout))
    return n / layout.shard_ways


def _reduce_bytes(cfg: ModelConfig, layout: Layout) -> float:
    """Bytes one rank moves in the ring all-reduce (or reduce-scatter + all-gather) of its fp32 gradients."""
    r = layout.dp * layout.cp
    return 2 * (r - 1) / r * 4 * max(params_per_rank(cfg, layout))


def load_calibration(cfg: ModelConfig, documents: Sequence[Tuple[str, dict]]) -> Calibration:
    """A Calibration from named JSON documents: measured timelines (fitted together) or one stage-cost file."""
    costs = [(n, d) for n, d in documents if "pieces" in d]
    if costs:
        if len(documents) > 1:
            raise CalibrationError(f"{costs[0][0]} holds fitted stage costs: give it alone, not with timelines")
        return Calibration.from_json(cfg, costs[0][1])
    runs = []
    for name, d in documents:
        if "events" not in d:
            raise CalibrationError(f"{name} is neither a --timeline-out timeline nor a stage-cost file")
        for key, want in (
            ("num_layers", cfg.num_layers),
            ("seq_length", cfg.seq_length),
            ("hidden_size", cfg.hidden_size),
        ):
            if key in d and int(d[key]) != want:
                raise CalibrationError(
                    f"{name} was measured with {key} {d[key]}, the model here has {want}: "
                    f"give the measured model's flags"
                )
        try:
            runs.append(MeasuredRun.from_timeline(d))
        except CalibrationError as e:
            raise CalibrationError(f"{name}: {e}") from None
    return Calibration.fit(cfg, runs)
