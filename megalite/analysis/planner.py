"""Layout planner: memory per rank and step time of a (tp, pp, vp, dp, micro-batch, recompute, SP, ZeRO-1) layout.

Memory per rank, in bytes, for the rank that needs the most::

    weights      parameters on the rank x 2 (bf16/fp16) or 4 (fp32)
    grads        the fp32 main_grad buffer: 4 per parameter (2 for fp16 without fp32 accumulation)
    optimizer    Adam moments (8) + fp32 main weights (4, half precision only), / dp with ZeRO-1
    activations  what autograd saves per micro-batch, summed over the micro-batches the schedule
                 keeps in flight on that rank (its action list replayed: + at F, - at B)

Activations per layer are Korthikanti et al. 2022 written term by term (so that GQA, SwiGLU, RoPE,
dropout 0, flash attention and recomputation change the right terms): tp splits what lies between
the column- and row-parallel matmuls; sequence parallelism also splits the rest. These are the bytes
bench_plan.py measures on CPU runs; a GPU adds temporaries (the logits' gradient, all-gather buffers)
and allocator slack, which the planner's --headroom covers.

Step time: each virtual stage costs its hardware FLOPs at an assumed fraction of the device's peak,
plus tensor-parallel collectives (4 per layer and micro-batch forward+backward) at the intra-node link
speed; the pipeline simulator turns stage costs into the schedule's makespan and bubble; the
data-parallel gradient reduction (not overlapped) is added at the inter-node link speed when the
data-parallel group leaves the node. Rough by design: its job is to rank layouts, not to predict.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Iterator, List, Optional, Sequence, Tuple

from megalite.analysis.simulate import simulate_schedule
from megalite.config import ModelConfig
from megalite.pipeline.registry import build_compute, default_schedule_name, validate_schedule
from megalite.throughput import flops_per_iteration, recompute_flops_per_iteration

RECOMPUTE = {"none": {}, "selective": dict(recompute_granularity="selective"),
             "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)}
GiB = 2 ** 30


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    vp: int = 1
    mbs: int = 1
    recompute: str = "none"  # none | selective | full (uniform, one layer per group)
    sp: bool = False
    dist_opt: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def num_microbatches(self, global_batch_size: int) -> int:
        return global_batch_size // (self.mbs * self.dp)

    def schedule(self) -> str:
        return default_schedule_name(self.pp, self.vp)

    def flags(self, num_layers: int) -> List[str]:
        """pretrain_gpt.py flags that select this layout."""
        out = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp),
               "--micro-batch-size", str(self.mbs)]
        if self.vp > 1:
            out += ["--num-layers-per-virtual-pipeline-stage", str(num_layers // (self.pp * self.vp))]
        if self.sp:
            out.append("--sequence-parallel")
        if self.dist_opt:
            out += ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
        if self.recompute == "selective":
            out.append("--recompute-activations")
        elif self.recompute == "full":
            out += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
        return out

    def describe(self) -> str:
        return (f"tp{self.tp} pp{self.pp} vp{self.vp} dp{self.dp} mbs{self.mbs} {self.recompute}"
                f"{' sp' if self.sp else ''}{' zero1' if self.dist_opt else ''}")


@dataclass(frozen=True)
class Memory:
    """Bytes on one rank."""
    weights: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations


def _with_recompute(cfg: ModelConfig, recompute: str) -> ModelConfig:
    return replace(cfg, **{"recompute_granularity": None, "recompute_method": None, **RECOMPUTE[recompute]})


# -- parameters ---------------------------------------------------------------------------------------
def layer_params(cfg: ModelConfig, tp: int) -> int:
    """Parameters of one transformer layer on one tensor-parallel rank (norms and row biases replicated)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, ffn = d * cfg.num_attention_heads, d * cfg.query_groups, cfg.ffn_size
    fc1 = 2 * ffn if cfg.swiglu else ffn
    split = h * (q + 2 * kv) + q * h + h * fc1 + ffn * h
    norm = (2 if cfg.normalization == "LayerNorm" else 1) * h
    split_bias = (q + 2 * kv + fc1) if cfg.add_bias_linear else 0
    replicated = 2 * norm + (2 * h if cfg.add_bias_linear else 0)
    return (split + split_bias) // tp + replicated


def params_per_rank(cfg: ModelConfig, layout: Layout) -> List[int]:
    """Parameters held by each pipeline rank (all its virtual chunks), for one tp rank."""
    t, pp, vp = layout.tp, layout.pp, layout.vp
    vocab = cfg.padded_vocab_size(t) * cfg.hidden_size // t
    per_chunk = cfg.num_layers // (pp * vp)
    out = [vp * per_chunk * layer_params(cfg, t) for _ in range(pp)]
    out[0] += vocab + (cfg.max_positions * cfg.hidden_size if cfg.position_embedding_type == "learned_absolute" else 0)
    out[-1] += (2 if cfg.normalization == "LayerNorm" else 1) * cfg.hidden_size  # final norm
    if not cfg.tied_embeddings or pp > 1:  # an output layer, or the last stage's copy of the tied table
        out[-1] += vocab
    return out


def state_bytes(cfg: ModelConfig, n_params: int, layout: Layout) -> Tuple[float, float, float]:
    """(weights, grads, optimizer) bytes for ``n_params`` parameters on one rank."""
    half = cfg.params_dtype != "float32"
    weights = n_params * (2 if half else 4)
    grads = n_params * 4  # bf16 always accumulates in fp32; fp16 runs are planned with fp32 accumulation too
    opt = n_params * (8 + (4 if half else 0))
    return weights, grads, opt / layout.dp if layout.dist_opt else opt


# -- activations ---------------------------------------------------------------------------------------
def norm_bytes(cfg: ModelConfig, tokens: float, device: str) -> float:
    """What one norm saves: its input and fp32 statistics; torch's RMSNorm on CPU (a composite of
    fp32 ops, where CUDA has a fused kernel) keeps an fp32 copy of the input and of the normalized one."""
    e = 2 if cfg.params_dtype != "float32" else 4
    h = cfg.hidden_size
    if cfg.normalization == "RMSNorm":
        return tokens * (8 * h + 4 if device == "cpu" else e * h + 4)
    return tokens * (e * h + 8)  # LayerNorm: input, mean and rstd


def layer_activation_bytes(cfg: ModelConfig, tp: int, sp: bool, mbs: int, device: str = "cuda") -> float:
    """Bytes one transformer layer saves for backward, per micro-batch, on one rank (no recompute)."""
    e = 2 if cfg.params_dtype != "float32" else 4
    s, b, h, t = cfg.seq_length, mbs, cfg.hidden_size, tp
    sb = s * b
    r = 1.0 / t if sp else 1.0  # the part outside the tensor-parallel region
    d, nq = cfg.head_dim, cfg.num_attention_heads
    q, kv, ffn = d * nq, d * cfg.query_groups, cfg.ffn_size
    drop = cfg.hidden_dropout > 0
    outside = 2 * norm_bytes(cfg, sb, device)  # the two norms' inputs and statistics
    outside += 2 * e * sb * h  # the norms' outputs: inputs of linear_qkv and linear_fc1
    outside += 2 * sb * h if drop else 0  # two hidden-dropout masks (1 byte)
    inside = e * sb * (q + 2 * kv)  # linear_qkv output: v (and, without RoPE, q and k) are views of it
    if cfg.position_embedding_type == "rope":
        inside += e * sb * (q + kv)  # rotated q and k are new tensors
    inside += e * sb * q  # linear_proj input
    inside += e * sb * ffn * (4 if cfg.swiglu else 2)  # fc1 output [+ silu(gate), product] / GeLU output
    if cfg.recompute_granularity != "selective":
        inside += core_attention_bytes(cfg, mbs, e, device)
    return outside * r + inside / t


def core_attention_bytes(cfg: ModelConfig, mbs: int, e: int, device: str = "cuda") -> float:
    """What the core attention saves beyond its q, k, v inputs, for all heads (divide by tp)."""
    s, b, nq = cfg.seq_length, mbs, cfg.num_attention_heads
    if cfg.attention_backend in ("unfused", "local"):
        square = nq * s * s * b
        # softmax output; with attention dropout also its mask (1 byte) and output
        return square * (2 * e + 1) if cfg.attention_dropout > 0 else square * e
    # SDPA / flash: an fp32 log-sum-exp per row, no s x s matrix, and the output: CUDA's flash kernel
    # lays it out [b, s, n, d], so linear_proj's [s, b, n*d] input is a copy; on CPU it is the same storage
    return (e * s * b * cfg.head_dim * nq if device == "cuda" else 0) + 4 * nq * s * b


def chunk_activation_bytes(cfg: ModelConfig, layout: Layout, layers: int, first: bool, last: bool,
                           device: str = "cuda") -> float:
    """One micro-batch's saved bytes for a chunk of ``layers`` layers (embedding / loss when first / last)."""
    e = 2 if cfg.params_dtype != "float32" else 4
    t, sp, b = layout.tp, layout.sp and layout.tp > 1, layout.mbs
    sb, h = cfg.seq_length * b, cfg.hidden_size
    r = 1.0 / t if sp else 1.0
    if cfg.recompute_granularity == "full":
        total = layers * e * sb * h * r  # each layer's input only
    else:
        total = layers * layer_activation_bytes(cfg, t, sp, b, device)
    if cfg.position_embedding_type == "rope" and layers:
        total += 2 * 4 * cfg.seq_length * cfg.head_dim  # fp32 cos and sin tables, shared by the chunk's layers
    if first:
        total += 8 * sb  # int64 token ids (the embedding's backward)
        total += sb * h * r if cfg.hidden_dropout > 0 else 0  # embedding dropout mask
    if last:
        total += norm_bytes(cfg, sb * r, device)  # final norm
        total += e * sb * h  # output layer input (gathered under SP)
        total += 4 * sb * cfg.padded_vocab_size(t) / t  # fp32 softmax of the vocab-parallel cross entropy
    return total


def _short_m(pp: int, m: int, cap: int = 64) -> int:
    """A micro-batch count that behaves like ``m`` (same warmup, same peak in flight) but is cheap to
    walk: past the warmup every further micro-batch adds one steady F+B per rank and nothing held."""
    if m <= cap:
        return m
    return max(pp, cap // pp * pp) if m % pp == 0 else cap


@lru_cache(maxsize=4096)
def _in_flight_pattern(name: str, pp: int, vp: int, m: int, rank: int) -> Tuple[Tuple[int, ...], ...]:
    """For each point of the rank's schedule, how many forwards of each chunk are held."""
    held, out = [0] * vp, []
    for a in build_compute(name, pp, vp, _short_m(pp, m))[rank]:
        held[a.chunk] += 1 if a.kind == "F" else -1
        out.append(tuple(held))
    return tuple(out)


def activation_bytes_per_rank(cfg: ModelConfig, layout: Layout, global_batch_size: int,
                              device: str = "cuda") -> List[float]:
    """Peak saved bytes on each pipeline rank over one step of its schedule."""
    pp, vp = layout.pp, layout.vp
    m = layout.num_microbatches(global_batch_size)
    per_chunk = cfg.num_layers // (pp * vp)
    out = []
    for rank in range(pp):
        sizes = [chunk_activation_bytes(cfg, layout, per_chunk, first=rank == 0 and c == 0,
                                        last=rank == pp - 1 and c == vp - 1, device=device) for c in range(vp)]
        pattern = _in_flight_pattern(layout.schedule(), pp, vp, m, rank)
        out.append(max(sum(n * size for n, size in zip(held, sizes)) for held in pattern))
    return out


def estimate_memory(cfg: ModelConfig, layout: Layout, global_batch_size: int, device: str = "cuda") -> Memory:
    """Memory of the rank that needs the most (cfg's recompute is replaced by the layout's).

    ``device`` "cpu" counts what torch's CPU kernels save where they differ from CUDA's (RMSNorm, SDPA).
    """
    cfg = _with_recompute(cfg, layout.recompute)
    acts = activation_bytes_per_rank(cfg, layout, global_batch_size, device)
    ranks = [Memory(*state_bytes(cfg, n, layout), a) for n, a in zip(params_per_rank(cfg, layout), acts)]
    return max(ranks, key=lambda x: x.total)


# -- time -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    peak_tflops: float = 989.0  # bf16 dense, per device
    efficiency: float = 0.5  # fraction of peak the matmuls reach
    intra_node_gbps: float = 300.0  # per-device bus bandwidth inside a node (NVLink), GB/s
    inter_node_gbps: float = 25.0  # per-device bandwidth between nodes (one 200 Gb/s NIC), GB/s
    gpus_per_node: int = 8


@lru_cache(maxsize=1024)
def _simulate(name: str, pp: int, vp: int, m: int, recompute_ratio: float) -> Tuple[float, float]:
    """(makespan, bubble) of the schedule with F=1, B=2+recompute_ratio per whole rank.

    Long schedules are simulated with fewer micro-batches (_short_m); the rest run in steady state.
    """
    short = _short_m(pp, m)
    res = simulate_schedule(name, pp, vp, short, f_cost=1.0, b_cost=2.0 + recompute_ratio)
    makespan = res.makespan + (m - short) * (3.0 + recompute_ratio)
    busy = m * (3.0 + recompute_ratio)
    return makespan, (makespan - busy) / busy


def estimate_step_time(cfg: ModelConfig, layout: Layout, global_batch_size: int, hw: Hardware) -> Tuple[float, float]:
    """(seconds per step, pipeline bubble fraction) under ``hw``'s rough speeds."""
    cfg = _with_recompute(cfg, layout.recompute)
    m, mbs = layout.num_microbatches(global_batch_size), layout.mbs
    model = flops_per_iteration(cfg, mbs, cfg.padded_vocab_size(layout.tp))
    extra = recompute_flops_per_iteration(cfg, mbs, num_chunks=layout.pp * layout.vp)
    rate = hw.peak_tflops * 1e12 * hw.efficiency * layout.tp  # one micro-batch is shared by tp devices
    forward = model / 3 / rate / layout.pp  # one micro-batch's forward through one pipeline rank
    if layout.tp > 1:  # 2 all-reduces (or all-gather + reduce-scatter) per layer forward, 2 backward
        e = 2 if cfg.params_dtype != "float32" else 4
        msg = e * cfg.seq_length * mbs * cfg.hidden_size
        comm = 4 * (cfg.num_layers / layout.pp) * 2 * (layout.tp - 1) / layout.tp * msg / (hw.intra_node_gbps * 1e9)
        forward += comm / 3  # spread like compute: a third forward, two thirds backward
    if layout.pp > 1:  # each virtual stage sends its output forward and receives its gradient back
        e = 2 if cfg.params_dtype != "float32" else 4
        crosses = layout.tp * layout.dp >= hw.gpus_per_node  # pipeline neighbours sit on other nodes
        bw = (hw.inter_node_gbps if crosses else hw.intra_node_gbps) * 1e9
        forward += 2 * layout.vp * e * cfg.seq_length * mbs * cfg.hidden_size / bw / 3
    recompute_ratio = (extra / 3 / rate / layout.pp) / forward if forward > 0 else 0.0
    makespan, bubble = _simulate(layout.schedule(), layout.pp, layout.vp, m, round(recompute_ratio, 3))
    step = makespan * forward
    if layout.dp > 1:
        n = max(params_per_rank(cfg, layout))
        in_node = layout.tp * layout.pp * layout.dp <= hw.gpus_per_node
        bw = (hw.intra_node_gbps if in_node else hw.inter_node_gbps) * 1e9
        step += 2 * (layout.dp - 1) / layout.dp * 4 * n / bw  # fp32 gradients, ring all-reduce
    return step, bubble


# -- search -----------------------------------------------------------------------------------------------
def _divisors(n: int) -> List[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def model_splits(cfg: ModelConfig, num_gpus: int, gpus_per_node: int = 8) -> Iterator[Tuple[int, int, int]]:
    """(tp, pp, dp) for every split of ``num_gpus`` this model allows (tp within a node), batch aside."""
    for tp, pp in itertools.product(_divisors(num_gpus), repeat=2):
        if num_gpus % (tp * pp) or tp > gpus_per_node or cfg.num_layers % pp:
            continue
        if cfg.num_attention_heads % tp or cfg.query_groups % tp or cfg.ffn_size % tp:
            continue
        yield tp, pp, num_gpus // (tp * pp)


def candidate_layouts(cfg: ModelConfig, num_gpus: int, global_batch_size: int, gpus_per_node: int = 8,
                      micro_batches: Sequence[int] = (1, 2, 4, 8), max_vp: int = 4) -> Iterator[Layout]:
    """Every layout pretrain_gpt.py accepts for this model on ``num_gpus`` devices (tp within a node)."""
    for tp, pp, dp in model_splits(cfg, num_gpus, gpus_per_node):
        vps = [v for v in (1, 2, 3, 4, 6, 8) if v <= max_vp and (cfg.num_layers // pp) % v == 0] if pp > 1 else [1]
        for vp, mbs, rec, dist_opt in itertools.product(vps, micro_batches, RECOMPUTE, (False, True)):
            layout = Layout(tp, pp, dp, vp, mbs, rec, sp=tp > 1 and cfg.seq_length % tp == 0,
                            dist_opt=dist_opt)
            if (dist_opt and dp == 1) or global_batch_size % (mbs * dp):
                continue
            try:
                validate_schedule(layout.schedule(), pp, vp, layout.num_microbatches(global_batch_size))
            except ValueError:
                continue
            yield layout


@dataclass(frozen=True)
class Plan:
    layout: Layout
    memory: Memory
    step_s: float
    bubble: float


def plan(cfg: ModelConfig, num_gpus: int, gpu_memory_gib: float, global_batch_size: int,
         hw: Optional[Hardware] = None, headroom: float = 0.15, **search) -> List[Plan]:
    """Layouts whose estimated memory fits in (1 - headroom) x the device memory, fastest first.

    Times within 2% of each other are too close for this model to tell apart: among them the
    simpler layout comes first (fewer pipeline stages and chunks, less tensor parallelism, less
    recomputation), then the one with less memory.
    """
    hw = hw or Hardware()
    budget = gpu_memory_gib * GiB * (1.0 - headroom)
    out = []
    for layout in candidate_layouts(cfg, num_gpus, global_batch_size, hw.gpus_per_node, **search):
        mem = estimate_memory(cfg, layout, global_batch_size)
        if mem.total <= budget:
            out.append(Plan(layout, mem, *estimate_step_time(cfg, layout, global_batch_size, hw)))
    rec = {name: i for i, name in enumerate(RECOMPUTE)}
    fastest = min((p.step_s for p in out), default=1.0)
    return sorted(out, key=lambda p: (int(math.log(p.step_s / fastest) / math.log(1.02)), p.layout.pp * p.layout.vp,
                                      p.layout.tp, rec[p.layout.recompute], p.memory.total))


def why_no_plan(cfg: ModelConfig, num_gpus: int, gpu_memory_gib: float, global_batch_size: int,
                hw: Optional[Hardware] = None, headroom: float = 0.15, **search) -> Tuple[str, bool]:
    """Why ``plan`` found nothing, as one line naming what to change; True when no layout at all takes the batch.

    The global batch must be a multiple of micro-batch x dp and give each pipeline enough micro-batches;
    when it rules out every split (or every split that would fit in memory), it is named, with the
    nearest batch that works, rather than memory.
    """
    hw = hw or Hardware()
    budget = gpu_memory_gib * GiB * (1.0 - headroom)
    dps = sorted({dp for _, _, dp in model_splits(cfg, num_gpus, hw.gpus_per_node)})

    def works(gbs: int, memory: bool) -> bool:
        return any(not memory or estimate_memory(cfg, layout, gbs).total <= budget
                   for layout in candidate_layouts(cfg, num_gpus, gbs, hw.gpus_per_node, **search))

    def nearest(memory: bool) -> Optional[int]:  # the smallest larger batch some data-parallel size divides
        tries = sorted({-(-global_batch_size // dp) * dp for dp in dps} | {global_batch_size * 2})
        return next((g for g in tries if g > global_batch_size and works(g, memory)), None)

    fits = f"no layout fits in {gpu_memory_gib * (1 - headroom):.1f} GiB per device"
    sizes = f"the data-parallel sizes this model allows on {num_gpus} GPUs are {', '.join(map(str, dps))}"
    if not works(global_batch_size, memory=False):
        better = nearest(memory=False)
        why = ("is not divisible by any data-parallel size" if all(global_batch_size % dp for dp in dps)
               else "gives too few micro-batches for every pipeline split")
        return (f"--global-batch-size {global_batch_size} {why} ({sizes}); "
                + (f"use e.g. {better}" if better else "change it or --num-gpus")), True
    better = nearest(memory=True)
    if better:
        return (f"{fits} with --global-batch-size {global_batch_size}, one does with {better} ({sizes}); or "
                f"add devices, lower --seq-length, or raise --gpu-memory"), False
    return f"{fits}: add devices, lower --seq-length, or raise --gpu-memory", False
