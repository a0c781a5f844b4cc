"""``--pipeline-balance measured``: time each layer kind on the run's device, then choose the split.

Every rank builds three throwaway probe chunks of the real model shape (its
own tp shard, sequence parallelism, dtype, recomputation, compile)::

    embedding probe   tokens [b, s] -> word + position embedding -> [s, b, h]
    layer probe       [s, b, h] -> one transformer layer -> [s, b, h]
    head probe        [s, b, h] -> final norm -> output layer -> loss

and times forward and backward of each for a few micro-batches (median after
a warmup). For a schedule with a split backward (ZB-H1, ZB-V, DualPipeV) the
backward runs as the executor runs it, B with the weight GEMMs deferred to a
WeightGradStore, then W, and the W part of each kind is kept too (otherwise
the simulator takes half of a backward). The six (or nine) numbers are reduced with a max over every rank (the
slowest device sets the pace), so every rank holds the same costs and
``balance.choose_split`` picks the same split everywhere. Random states are
saved and restored around the probes: a measured run trains exactly like the
same run given the chosen ``--pipeline-stage-layers``.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from dataclasses import replace
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from megalite.analysis.balance import BalancePlan, LayerCosts, choose_split
from megalite.config import Config
from megalite.config.settings import RunSettings
from megalite.model.gpt import GPTModel
from megalite.parallel.state import ParallelState
from megalite.tensor_parallel.layers import WeightGradSplit, WeightGradStore, enable_weight_grad_split
from megalite.tensor_parallel.random import RNGTracker

logger = logging.getLogger("megalite")


def _timer(device: torch.device) -> Callable[[], float]:
    """perf_counter, after the device has finished its queued work."""
    if device.type == "cuda":
        return lambda: (torch.cuda.synchronize(device), time.perf_counter())[1]
    return time.perf_counter


def _time_fb(
    run: Callable[[], Tuple[torch.Tensor, torch.Tensor]],
    now: Callable[[], float],
    warmup: int,
    reps: int,
    split: Optional[WeightGradSplit],
) -> Tuple[float, float, float]:
    """Median (forward, backward, W part of the backward) seconds of ``run`` (returns output and its
    gradient) after ``warmup`` calls. ``split`` (the probes' WeightGradSplit): the backward runs as the
    executor splits it, B with the weight GEMMs deferred to a WeightGradStore, then W; None: whole (W
    part 0)."""
    fwd: List[float] = []
    bwd: List[float] = []
    wgt: List[float] = []
    for i in range(warmup + reps):
        store = WeightGradStore()
        t0 = now()
        out, grad = run()
        t1 = now()
        with split.collecting(store) if split is not None else contextlib.nullcontext():
            torch.autograd.backward(out, grad)
        t2 = now()
        store.run()
        t3 = now()
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t3 - t1)
            wgt.append(t3 - t2)
    return statistics.median(fwd), statistics.median(bwd), statistics.median(wgt)


def _probe_times(cfg: Config, ps: ParallelState, warmup: int, reps: int, split: bool) -> List[float]:
    """This rank's [emb f, emb b, layer f, layer b, head f, head b] in seconds, then with ``split``
    the W parts of the three backwards."""
    m, par, t = cfg.model, cfg.parallel, cfg.train
    tracker = RNGTracker(t.seed, ps.tp_rank, ps.pp_rank, ps.device)
    wgrad = WeightGradSplit() if split else None

    def probe(pre: bool, post: bool, layers: List[int]) -> GPTModel:
        chunk = GPTModel(
            m, ps, tracker, t.seed, layers, pre_process=pre, post_process=post, sequence_parallel=par.sequence_parallel
        ).to(ps.device)
        if wgrad is not None:
            enable_weight_grad_split(chunk, wgrad)
        return chunk.train()

    chunks = {"emb": probe(True, False, []), "layer": probe(False, False, [0]), "head": probe(False, True, [])}
    emb = chunks["emb"]
    gen = torch.Generator().manual_seed(0)  # inputs from a private generator: no global RNG drawn
    b, seq = t.micro_batch_size, m.seq_length
    s = seq // ps.tp_size if emb.sequence_parallel else seq
    tokens = torch.randint(0, m.vocab_size, (b, seq), generator=gen).to(ps.device)
    mask = torch.ones(b, seq, device=ps.device)
    hidden = torch.randn(s, b, m.hidden_size, generator=gen).to(ps.device, m.torch_dtype)
    grad = torch.ones_like(hidden)

    def run_emb():
        return chunks["emb"](tokens), grad

    def run_layer():
        return chunks["layer"](hidden.detach().requires_grad_()), grad

    def run_head():
        head = chunks["head"]
        return head.loss(head(hidden.detach().requires_grad_()), tokens, mask), None

    now = _timer(ps.device)
    out: List[float] = []
    weights: List[float] = []
    for run in (run_emb, run_layer, run_head):
        f, b, w = _time_fb(run, now, warmup, reps, wgrad)
        out += [f, b]
        weights.append(w)
    if split:
        out += weights
    del emb
    chunks.clear()  # the probe chunks are freed before the caller builds the real ones
    if ps.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def measure_layer_costs(
    cfg: Config, ps: ParallelState, settings: RunSettings, warmup: int = 2, reps: int = 5
) -> LayerCosts:
    """Forward/backward seconds per micro-batch of each layer kind, max over every rank (collective);
    for a schedule with a split backward (ZB-H1, ZB-V, DualPipeV) also the W part of each."""
    split = settings.spec.split_backward
    cpu_state = torch.get_rng_state()
    dev_state = torch.cuda.get_rng_state(ps.device) if ps.device.type == "cuda" else None
    try:
        local = _probe_times(cfg, ps, warmup, reps, split)
    finally:
        torch.set_rng_state(cpu_state)
        if dev_state is not None:
            torch.cuda.set_rng_state(dev_state, ps.device)
    costs = torch.tensor(local, dtype=torch.float64, device=ps.device)
    if ps.world_size > 1 and dist.is_initialized():
        dist.all_reduce(costs, op=dist.ReduceOp.MAX)
    return LayerCosts.from_list(costs.tolist())


def plan_for(cfg: Config, settings: RunSettings, costs: LayerCosts) -> BalancePlan:
    """The balanced split of this run's layers for its schedule and micro-batch count."""
    par = cfg.parallel
    return choose_split(
        cfg.model.num_layers,
        par.pp,
        par.vp,
        settings.num_microbatches,
        settings.schedule,
        costs,
        overlap_p2p=par.overlap_p2p_comm,
    )


def balance_stages(cfg: Config, ps: ParallelState, settings: RunSettings) -> Config:
    """``cfg`` with ``pipeline_stage_layers`` set to the measured balanced split (collective).

    Logged once: the measured costs, the even and the balanced split with their
    predicted step time and bubble.
    """
    costs = measure_layer_costs(cfg, ps, settings)
    plan = plan_for(cfg, settings, costs)
    if ps.is_logging_rank:
        logger.info(plan.describe())
    return cfg.with_(parallel=replace(cfg.parallel, pipeline_stage_layers=plan.chosen.counts))
