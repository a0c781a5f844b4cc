"""Layout planner: memory per rank and step time of a (tp, pp, vp, dp, micro-batch, recompute, SP, data-parallel
sharding) layout.

Memory per rank, in bytes, for the rank that needs the most::

    weights      parameters on the rank x 2 (bf16/fp16) or 4 (fp32)
    grads        the fp32 main_grad buffer: 4 per parameter (2 for fp16 without fp32 accumulation)
    optimizer    Adam moments (8) + fp32 main weights (4, half precision only), / (dp x cp) with ZeRO-1
                 (--data-parallel-sharding-strategy optim)
    activations  what autograd saves per micro-batch, summed over the micro-batches the schedule
                 keeps in flight on that rank (its action list replayed: + at F, - at B, or at W
                 for a split backward)
    gathered     FSDP only (optim_grads, optim_grads_params: state_bytes, fsdp_transient_bytes): weights,
                 gradients and moments are fp32 shards, 4 + 4 + 8 bytes / (dp x cp, or dp x cp / N under
                 HSDP), and the gathered weights and unsharded gradients come on top while a step runs

Activations per layer are Korthikanti et al. 2022 written term by term (so that GQA, SwiGLU, RoPE,
dropout 0, flash attention and recomputation change the right terms): tp splits what lies between
the column- and row-parallel matmuls; sequence parallelism also splits the rest; context parallelism
(cp) gives each rank s/cp of every sequence's tokens (the attention scores are local queries against
all keys; the all_gather variant also keeps the gathered keys and values). These are the bytes
bench_plan.py measures on CPU runs; a GPU adds temporaries (the logits' gradient, all-gather buffers)
and allocator slack, which the planner's --headroom covers.

Mixture of experts (moe_plan.py): an MoE layer's router and shared expert count as dense weights;
its E/EP experts (ETP shards) are reduced, and with ZeRO-1 their optimizer state sharded, over
expert-DP = tp x cp x dp / (ep x etp); its activations are the tokens' topk routed rows through the
local experts, plus one layer's dispatch buffers (alltoall or allgather) at the peak; the step time
adds the dispatch traffic and the expert gradients' reduction over expert-DP.

Step time: each virtual stage costs its hardware FLOPs at an assumed fraction of the device's peak,
plus tensor-parallel collectives (4 per layer and micro-batch forward+backward) at the intra-node link
speed; the pipeline simulator turns stage costs into the schedule's makespan and bubble; the
data-parallel traffic of the sharding strategy (data_parallel_seconds: no_shard's and ZeRO-1's not overlapped,
FSDP's per micro-batch behind the compute) is added at the inter-node link speed when the data-parallel group
leaves the node. With cp > 1 a rank computes 1/cp of every layer (the causal
attention load-balanced) and passes keys and values around the CP ring: 2 (cp - 1) K/V blocks per
layer forward, twice that backward, hidden behind the core attention where it is shorter. Rough by
design: its job is to rank layouts; analysis/calibrate.py predicts from a measured run's costs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import List, Optional, Tuple

from megalite.analysis.moe_plan import (
    dispatch_buffer_bytes,
    dispatch_bytes_per_layer,
    expert_tp,
    moe_block_activation_bytes,
    moe_block_params,
)
from megalite.analysis.simulate import simulate_schedule
from megalite.config import ModelConfig
from megalite.model.spec import OUTPUT_LAYER, ModelSpec, split_counts
from megalite.observability.throughput import flops_per_iteration, recompute_flops_per_iteration
from megalite.pipeline.registry import build_compute, default_schedule_name, layout_for
from megalite.pipeline.stage_layout import StageLayout

RECOMPUTE = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}
GiB = 2**30
FSDP_STRATEGIES = ("optim_grads", "optim_grads_params")
# describe()'s names for the strategies (ZeRO's stages; no_shard says nothing, as before)
SHORT_NAMES = {"no_shard": "", "optim": " zero1", "optim_grads": " zero2", "optim_grads_params": " zero3"}


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
    cp: int = 1  # context parallel: ranks sharing each sequence
    schedule_name: Optional[str] = None  # None: Megatron's default for (pp, vp)
    stage_layers: Optional[Tuple[int, ...]] = None  # layers of every virtual stage (None: even)
    cp_comm: str = "p2p"
    ep: int = 1  # expert parallel: ranks a layer's experts are split over (MoE)
    etp: Optional[int] = None  # expert tensor parallel (None: tp)
    moe_dispatcher: str = "allgather"
    # --data-parallel-sharding-strategy optim_grads / optim_grads_params (FSDP2); None: dist_opt says optim or
    # no_shard, so the ZeRO-1 layouts keep their old spelling (timelines, calibration files)
    sharding: Optional[str] = None
    reshard: bool = True  # optim_grads_params: gather again for backward (--no-reshard-after-forward: False)
    instances: int = 1  # --num-distributed-optimizer-instances: HSDP's replicas of each shard group

    @property
    def strategy(self) -> str:
        """The effective sharding strategy: one replica has nothing to shard (the Trainer then runs no FSDP)."""
        if self.dp * self.cp == 1:
            return "no_shard"
        return self.sharding or ("optim" if self.dist_opt else "no_shard")

    @property
    def fsdp(self) -> bool:
        return self.strategy in FSDP_STRATEGIES

    @property
    def shard_ways(self) -> int:
        """Ranks the dense state is sharded over: dp x cp, or dp x cp / N under HSDP (1: not sharded)."""
        s = self.strategy
        return 1 if s == "no_shard" else self.dp * self.cp // (self.instances if s in FSDP_STRATEGIES else 1)

    @property
    def expert_shard_ways(self) -> int:
        """Ranks the experts' state is sharded over: expert-DP (over N too under HSDP, where it divides)."""
        if self.strategy == "no_shard" or self.edp == 1:
            return 1
        n = self.instances if self.fsdp and self.edp % self.instances == 0 else 1
        return self.edp // n

    @property
    def expert_tp(self) -> int:
        return expert_tp(self.tp, self.etp)

    @property
    def edp(self) -> int:
        """Expert data-parallel size: the replicas of each expert shard."""
        return self.tp * self.cp * self.dp // (self.ep * self.expert_tp)

    def layers(self, num_layers: int) -> List[int]:
        """Layers of every global stage, in stage order."""
        return list(self.stage_layers or [num_layers // (self.pp * self.vp)] * (self.pp * self.vp))

    def placement(self) -> StageLayout:
        return layout_for(self.schedule(), self.pp, self.vp)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def num_microbatches(self, global_batch_size: int) -> int:
        return global_batch_size // (self.mbs * self.dp)

    def schedule(self) -> str:
        return self.schedule_name or default_schedule_name(self.pp, self.vp)

    def flags(self, num_layers: int) -> List[str]:
        """pretrain_gpt.py flags that select this layout."""
        out = [
            "--tensor-model-parallel-size",
            str(self.tp),
            "--pipeline-model-parallel-size",
            str(self.pp),
            "--micro-batch-size",
            str(self.mbs),
            "--data-parallel-sharding-strategy",
            self.strategy,
        ]
        if self.strategy == "optim":
            out += ["--overlap-grad-reduce", "--overlap-param-gather"]
        if self.fsdp and not self.reshard:
            out.append("--no-reshard-after-forward")
        if self.fsdp and self.instances > 1:
            out += ["--num-distributed-optimizer-instances", str(self.instances)]
        if self.vp > 1:
            out += ["--num-layers-per-virtual-pipeline-stage", str(num_layers // (self.pp * self.vp))]
        if self.schedule_name:
            out += ["--pipeline-schedule", self.schedule_name]
        if self.cp > 1:
            out += ["--context-parallel-size", str(self.cp)]
        if self.stage_layers:
            out += ["--pipeline-stage-layers", ",".join(map(str, self.stage_layers))]
        if self.ep > 1:
            out += ["--expert-model-parallel-size", str(self.ep)]
        if self.etp is not None and self.etp != self.tp:
            out += ["--expert-tensor-parallel-size", str(self.etp)]
        if self.moe_dispatcher != "allgather":
            out += ["--moe-token-dispatcher-type", self.moe_dispatcher]
        if self.sp:
            out.append("--sequence-parallel")
        if self.recompute == "selective":
            out.append("--recompute-activations")
        elif self.recompute == "full":
            out += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
        return out

    def describe(self) -> str:
        moe = (
            f"{f' ep{self.ep}' if self.ep > 1 else ''}{f' etp{self.etp}' if self.etp not in (None, self.tp) else ''}"
            f"{' a2a' if self.moe_dispatcher == 'alltoall' else ''}"
        )
        return (
            f"tp{self.tp} pp{self.pp} vp{self.vp} dp{self.dp}{f' cp{self.cp}' if self.cp > 1 else ''}{moe} "
            f"mbs{self.mbs} {self.recompute}{' sp' if self.sp else ''}{SHORT_NAMES[self.strategy]}"
            f"{' keep' if self.fsdp and not self.reshard else ''}{f' hsdp{self.instances}' if self.instances > 1 else ''}"
            f"{f' {self.schedule_name}' if self.schedule_name else ''}"
        )


@dataclass(frozen=True)
class Memory:
    """Bytes on one rank."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    gathered: float = 0.0  # FSDP's transient full weights and unsharded gradients (fsdp_transient_bytes)

    @property
    def state(self) -> float:
        """Resident weights + gradients + optimizer state (what stays between steps)."""
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.activations + self.gathered


def _with_recompute(cfg: ModelConfig, recompute: str) -> ModelConfig:
    return replace(cfg, **{"recompute_granularity": None, "recompute_method": None, **RECOMPUTE[recompute]})


# -- parameters ---------------------------------------------------------------------------------------
def layer_params(cfg: ModelConfig, tp: int, mlp: bool = True) -> int:
    """Parameters of one transformer layer on one tensor-parallel rank (norms and row biases replicated);
    ``mlp`` False: without the MLP (an MoE layer's block is counted by moe_plan.moe_block_params)."""
    params = [p for p in ModelSpec.of(cfg).layer().params() if mlp or not p.name.startswith("mlp.")]
    split, whole = split_counts(params)
    return split // tp + whole


def stage_layer_ids(cfg: ModelConfig, layout: Layout) -> List[range]:
    """The global layers of every stage, in stage order."""
    out, start = [], 0
    for n in layout.layers(cfg.num_layers):
        out.append(range(start, start + n))
        start += n
    return out


def param_counts_per_rank(cfg: ModelConfig, layout: Layout) -> List[Tuple[int, int, int]]:
    """(dense, expert, fp32 without gradient) parameters of each pipeline rank, for one rank of its stage:
    dense ones are reduced over dp x cp, experts over expert-DP (moe_plan.py; (n, 0, 0) for a dense model)."""
    t, pp, place = layout.tp, layout.pp, layout.placement()
    vocab = cfg.padded_vocab_size(t) * cfg.hidden_size // t
    out, experts, fixed = [0] * pp, [0] * pp, [0] * pp
    moe = moe_block_params(cfg, t, layout.ep, layout.expert_tp) if cfg.is_moe else (0, 0, 0)
    dense, attention = layer_params(cfg, t), layer_params(cfg, t, mlp=False)  # a dense layer; one without its MLP
    for stage, ids in enumerate(stage_layer_ids(cfg, layout)):
        r, n_moe = place.rank_of(stage), sum(cfg.is_moe_layer(i) for i in ids)
        out[r] += (len(ids) - n_moe) * dense + n_moe * (attention + moe[0])
        experts[r] += n_moe * moe[1]
        fixed[r] += n_moe * moe[2]
    first, last = place.rank_of(0), place.rank_of(place.num_stages - 1)
    spec = ModelSpec.of(cfg)
    split, whole = split_counts(spec.pre_params(cfg.padded_vocab_size(t)))  # word (vocab rows / tp), positions
    out[first] += split // t + whole
    out[last] += sum(p.numel for p in spec.post_params() if p.name != OUTPUT_LAYER)  # final norm
    if not cfg.tied_embeddings or first != last:  # an output layer, or the last stage's copy of the tied table
        out[last] += vocab
    return list(zip(out, experts, fixed))


def params_per_rank(cfg: ModelConfig, layout: Layout) -> List[int]:
    """Parameters held by each pipeline rank (all its virtual chunks), for one tp rank, whose gradients
    are reduced over dp x cp (all of a dense model's; an MoE's experts: param_counts_per_rank)."""
    return [dense for dense, _, _ in param_counts_per_rank(cfg, layout)]


def state_bytes(
    cfg: ModelConfig, n_params: int, layout: Layout, ways: Optional[int] = None
) -> Tuple[float, float, float]:
    """(weights, grads, optimizer) bytes for ``n_params`` parameters on one rank, their state sharded ``ways`` ways
    (default: the layout's dense sharding) as its strategy shards it:

    no_shard             weights 2 (4 fp32), fp32 grads 4, Adam moments 8 + fp32 main weights 4 (half only)
    optim                the same, the optimizer's 12 (8) / ways
    optim_grads(_params) an fp32 shard that is its own main weight 4, its fp32 gradient 4 and moments 8, all / ways
                         (the gathered copies are transient: fsdp_transient_bytes)
    """
    half = cfg.params_dtype != "float32"
    ways = layout.shard_ways if ways is None else ways
    if layout.fsdp and ways > 1:
        return 4 * n_params / ways, 4 * n_params / ways, 8 * n_params / ways
    weights = n_params * (2 if half else 4)
    grads = n_params * 4  # bf16 always accumulates in fp32; fp16 runs are planned with fp32 accumulation too
    opt = n_params * (8 + (4 if half else 0))
    return weights, grads, opt / ways if layout.strategy == "optim" else opt


def rank_state_bytes(cfg: ModelConfig, counts: Tuple[int, int, int], layout: Layout) -> Tuple[float, float, float]:
    """(weights, grads, optimizer) bytes of one rank from its (dense, expert, fp32 no-grad) counts: the
    experts' state is sharded over expert-DP (layout.expert_shard_ways; with one rank per expert-DP group the
    experts keep a plain buffer and a whole optimizer state, whatever the strategy); the expert bias is fp32 and
    has neither gradient nor optimizer state."""
    dense, expert, fixed = counts
    w, g, o = state_bytes(cfg, dense, layout)
    ew, eg, eo = state_bytes(cfg, expert, layout, layout.expert_shard_ways)
    return w + ew + 4 * fixed, g + eg, o + eo


def fsdp_transient_bytes(cfg: ModelConfig, layout: Layout) -> List[float]:
    """FSDP's bytes beyond the shards on each pipeline rank, at the step's worst point (0 without FSDP).

    Weights gathered in the compute dtype: optim_grads (and optim_grads_params with --no-reshard-after-forward,
    whose layers stay gathered from forward to backward while micro-batches are in flight) all of the rank's;
    optim_grads_params the chunk roots (embedding, final norm, output layer: FSDP2 keeps a root gathered
    through its backward) and two layers (the one computing, the next one prefetched). Plus one unit's
    unsharded gradient, in the compute dtype, and its fp32 copy reduce-scattered.
    """
    if not layout.fsdp:
        return [0.0] * layout.pp
    e = 2 if cfg.params_dtype != "float32" else 4
    t, place = layout.tp, layout.placement()
    dense_layer = layer_params(cfg, t)
    if cfg.is_moe:
        router, experts, _ = moe_block_params(cfg, t, layout.ep, layout.expert_tp)
        moe_layer = layer_params(cfg, t, mlp=False) + router + experts
    layers_of, biggest = [0] * layout.pp, [0] * layout.pp
    for stage, ids in enumerate(stage_layer_ids(cfg, layout)):
        r = place.rank_of(stage)
        for i in ids:
            size = moe_layer if cfg.is_moe_layer(i) else dense_layer
            layers_of[r] += size
            biggest[r] = max(biggest[r], size)
    out = []
    for r, (dense, expert, _) in enumerate(param_counts_per_rank(cfg, layout)):
        root = dense + expert - layers_of[r]
        keep_all = layout.strategy == "optim_grads" or not layout.reshard
        held = dense + expert if keep_all else root + min(2 * biggest[r], layers_of[r])
        out.append(e * held + (e + 4) * max(biggest[r], root))
    return out


# -- activations ---------------------------------------------------------------------------------------
def norm_bytes(cfg: ModelConfig, tokens: float, device: str) -> float:
    """What one norm saves: its input and fp32 statistics; torch's RMSNorm on CPU (a composite of
    fp32 ops, where CUDA has a fused kernel) keeps an fp32 copy of the input and of the normalized one."""
    e = 2 if cfg.params_dtype != "float32" else 4
    h = cfg.hidden_size
    if cfg.normalization == "RMSNorm":
        return tokens * (8 * h + 4 if device == "cpu" else e * h + 4)
    return tokens * (e * h + 8)  # LayerNorm: input, mean and rstd


def layer_activation_bytes(
    cfg: ModelConfig,
    tp: int,
    sp: bool,
    mbs: int,
    device: str = "cuda",
    cp: int = 1,
    cp_comm: str = "p2p",
    moe: bool = False,
    etp: int = 1,
) -> float:
    """Bytes one transformer layer saves for backward, per micro-batch, on one rank (no recompute);
    ``moe``: an MoE layer, its MLP replaced by the MoE block (experts split over ``etp``)."""
    e = 2 if cfg.params_dtype != "float32" else 4
    s, b, h, t = cfg.seq_length // cp, mbs, cfg.hidden_size, tp
    sb = s * b
    r = 1.0 / t if sp else 1.0  # the part outside the tensor-parallel region
    spec = ModelSpec.of(cfg)
    (q, kv, _), mlp = spec.attention.qkv_pieces, spec.mlp
    drop = cfg.hidden_dropout > 0
    outside = 2 * norm_bytes(cfg, sb, device)  # the two norms' inputs and statistics
    outside += 2 * e * sb * h  # the norms' outputs: inputs of linear_qkv and linear_fc1
    outside += 2 * sb * h if drop else 0  # two hidden-dropout masks (1 byte)
    inside = e * sb * (q + 2 * kv)  # linear_qkv output: v (and, without RoPE, q and k) are views of it
    if spec.attention.rope:
        inside += e * sb * (q + kv)  # rotated q and k are new tensors
    inside += e * sb * q  # linear_proj input
    if not moe:
        inside += e * sb * mlp.ffn * (4 if mlp.gated else 2)  # fc1 output [+ silu(gate), product] / GeLU output
    if cfg.recompute_granularity != "selective":
        inside += core_attention_bytes(cfg, mbs, e, device, cp)
    if cp > 1 and cp_comm == "all_gather":
        inside += e * cfg.seq_length * b * 2 * kv  # the gathered keys and values of the whole sequence
    block = moe_block_activation_bytes(cfg, sb * r, t, etp, e) if moe else 0.0
    return outside * r + inside / t + block


def core_attention_bytes(cfg: ModelConfig, mbs: int, e: int, device: str = "cuda", cp: int = 1) -> float:
    """What the core attention saves beyond its q, k, v inputs, for all heads (divide by tp);
    with cp the rank's s/cp queries against the whole sequence's keys."""
    s, b, nq = cfg.seq_length // cp, mbs, cfg.num_attention_heads
    square = nq * s * cfg.seq_length * b
    if device == "cpu" and cfg.attention_dropout > 0 and cfg.attention_backend not in ("unfused", "local"):
        # torch's CPU SDPA runs dropout in its math path, in fp32: softmax output, a mask, the dropped-out
        # scores (half precision adds three q-sized copies)
        return square * 3 * 4 + (3 * e * s * b * cfg.head_dim * nq if e < 4 else 0)
    if cfg.attention_backend in ("unfused", "local"):
        # softmax output; with attention dropout also its mask (1 byte) and output
        return square * (2 * e + 1) if cfg.attention_dropout > 0 else square * e
    # SDPA / flash: an fp32 log-sum-exp per row, no s x s matrix, and the output: CUDA's flash kernel
    # lays it out [b, s, n, d], so linear_proj's [s, b, n*d] input is a copy; on CPU it is the same storage
    return (e * s * b * cfg.head_dim * nq if device == "cuda" else 0) + 4 * nq * s * b


def chunk_activation_bytes(
    cfg: ModelConfig,
    layout: Layout,
    layers: int,
    first: bool,
    last: bool,
    device: str = "cuda",
    cp_comm: str = "p2p",
    moe_layers: int = 0,
) -> float:
    """One micro-batch's saved bytes for a chunk of ``layers`` layers, ``moe_layers`` of them MoE layers
    (embedding / loss when first / last)."""
    e = 2 if cfg.params_dtype != "float32" else 4
    t, sp, b = layout.tp, layout.sp and layout.tp > 1, layout.mbs
    sb, h = cfg.seq_length // layout.cp * b, cfg.hidden_size
    r = 1.0 / t if sp else 1.0
    if cfg.recompute_granularity == "full":
        total = layers * e * sb * h * r  # each layer's input only
    else:
        total = (layers - moe_layers) * layer_activation_bytes(cfg, t, sp, b, device, layout.cp, cp_comm)
        if moe_layers:
            total += moe_layers * layer_activation_bytes(
                cfg, t, sp, b, device, layout.cp, cp_comm, moe=True, etp=layout.expert_tp
            )
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
    """For each point of the rank's schedule, how many forwards of each chunk are held
    (freed at B, or at W in a split-backward schedule: the weight GEMMs read the saved inputs)."""
    held, out = [0] * vp, []
    actions = build_compute(name, pp, vp, _short_m(pp, m))[rank]
    freed = "W" if any(a.kind == "W" for a in actions) else "B"
    for a in actions:
        held[a.chunk] += 1 if a.kind == "F" else -1 if a.kind == freed else 0
        out.append(tuple(held))
    return tuple(out)


def activation_bytes_per_rank(
    cfg: ModelConfig, layout: Layout, global_batch_size: int, device: str = "cuda"
) -> List[float]:
    """Peak saved bytes on each pipeline rank over one step of its schedule."""
    pp, vp, place = layout.pp, layout.vp, layout.placement()
    m, ids = layout.num_microbatches(global_batch_size), stage_layer_ids(cfg, layout)
    moe = [sum(cfg.is_moe_layer(i) for i in r) for r in ids]
    e = 2 if cfg.params_dtype != "float32" else 4
    tokens = cfg.seq_length // layout.cp * layout.mbs / (layout.tp if layout.sp and layout.tp > 1 else 1)
    out = []
    for rank in range(pp):
        stages = [place.stage(rank, c) for c in range(vp)]
        sizes = [
            chunk_activation_bytes(
                cfg,
                layout,
                len(ids[s]),
                first=s == 0,
                last=s == place.num_stages - 1,
                device=device,
                cp_comm=layout.cp_comm,
                moe_layers=moe[s],
            )
            for s in stages
        ]
        pattern = _in_flight_pattern(layout.schedule(), pp, vp, m, rank)
        peak = max(sum(n * size for n, size in zip(held, sizes)) for held in pattern)
        if any(moe[s] for s in stages):  # one layer's token exchange at a time, at the peak
            peak += dispatch_buffer_bytes(cfg, tokens, layout.ep, layout.expert_tp, layout.moe_dispatcher, e)
        out.append(peak)
    return out


def memory_per_rank(cfg: ModelConfig, layout: Layout, global_batch_size: int, device: str = "cuda") -> List[Memory]:
    """Memory of each pipeline rank (cfg's recompute is replaced by the layout's).

    ``device`` "cpu" counts what torch's CPU kernels save where they differ from CUDA's (RMSNorm, SDPA).
    """
    cfg = _with_recompute(cfg, layout.recompute)
    acts = activation_bytes_per_rank(cfg, layout, global_batch_size, device)
    counts, gathered = param_counts_per_rank(cfg, layout), fsdp_transient_bytes(cfg, layout)
    return [Memory(*rank_state_bytes(cfg, n, layout), a, g) for n, a, g in zip(counts, acts, gathered)]


def estimate_memory(cfg: ModelConfig, layout: Layout, global_batch_size: int, device: str = "cuda") -> Memory:
    """Memory of the rank that needs the most (see memory_per_rank)."""
    return max(memory_per_rank(cfg, layout, global_batch_size, device), key=lambda x: x.total)


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


def data_parallel_seconds(
    cfg: ModelConfig, layout: Layout, hw: Hardware, m: int, forward: float, backward: float
) -> float:
    """Seconds the dense gradients' data-parallel traffic adds to a step of ``m`` micro-batches, each taking
    ``forward`` and ``backward`` seconds on the busiest pipeline rank. Bytes per rank on the wire (ring
    collectives over R = dp x cp ranks, R / N under HSDP; n the rank's parameters, e bytes each)::

        no_shard            an all-reduce of the fp32 gradients, 2 (R-1)/R x 4n, after the last backward
        optim               a reduce-scatter of them and an all-gather of the updated weights, (R-1)/R x (4+e)n
        optim_grads         per micro-batch a reduce-scatter, (R-1)/R x 4n; per step an all-gather, (R-1)/R x en
        optim_grads_params  per micro-batch that reduce-scatter and an all-gather for forward, another for
                            backward unless --no-reshard-after-forward keeps the weights
        HSDP (N > 1)        + an all-reduce of the gradient shards over the N replicas, 2 (N-1)/N x 4n/R

    The first two wait for the step's backward to end (--overlap-grad-reduce hides part of it; the planner
    counts none). FSDP prefetches each layer's gather during the previous layer's compute and reduces a layer
    behind the next one's backward, so only what is longer than the pass it runs beside is added.
    """
    replicas = layout.dp * layout.cp
    if replicas == 1:
        return 0.0
    e = 2 if cfg.params_dtype != "float32" else 4
    n, shard = max(params_per_rank(cfg, layout)), layout.shard_ways
    in_node = layout.world <= hw.gpus_per_node
    bw = (hw.intra_node_gbps if in_node else hw.inter_node_gbps) * 1e9
    if not layout.fsdp:
        moved = 2 * 4 * n if layout.strategy == "no_shard" else (4 + e) * n
        return (replicas - 1) / replicas * moved / bw
    group_bw = (hw.intra_node_gbps if layout.tp * shard <= hw.gpus_per_node else hw.inter_node_gbps) * 1e9
    ring = (shard - 1) / shard / group_bw  # seconds per byte of a full tensor reduce-scattered or gathered
    gathers = (2 if layout.reshard else 1) if layout.strategy == "optim_grads_params" else 0
    fwd = (gathers > 0) * ring * e * n
    bwd = ring * (4 * n + (gathers > 1) * e * n)
    out = m * (max(0.0, fwd - forward) + max(0.0, bwd - backward))
    if layout.strategy == "optim_grads":  # the step's one gather, behind the first forward
        out += max(0.0, ring * e * n - forward)
    if layout.instances > 1:
        k = layout.instances
        out += 2 * (k - 1) / k * 4 * n / shard / bw
    return out


def estimate_step_time(cfg: ModelConfig, layout: Layout, global_batch_size: int, hw: Hardware) -> Tuple[float, float]:
    """(seconds per step, pipeline bubble fraction) under ``hw``'s rough speeds."""
    cfg = _with_recompute(cfg, layout.recompute)
    m, mbs, t, cp = layout.num_microbatches(global_batch_size), layout.mbs, layout.tp, layout.cp
    e = 2 if cfg.params_dtype != "float32" else 4
    model = flops_per_iteration(cfg, mbs, cfg.padded_vocab_size(t))
    extra = recompute_flops_per_iteration(cfg, mbs, num_chunks=layout.pp * layout.vp)
    rate = hw.peak_tflops * 1e12 * hw.efficiency * t * cp  # one micro-batch is shared by tp x cp devices
    forward = model / 3 / rate / layout.pp  # one micro-batch's forward through one pipeline rank
    msg = e * cfg.seq_length // cp * mbs * cfg.hidden_size  # one rank's hidden states of a micro-batch
    layers = cfg.num_layers / layout.pp
    if t > 1:  # 2 all-reduces (or all-gather + reduce-scatter) per layer forward, 2 backward
        comm = 4 * layers * 2 * (t - 1) / t * msg / (hw.intra_node_gbps * 1e9)
        forward += comm / 3  # spread like compute: a third forward, two thirds backward
    if cfg.is_moe and layout.ep * layout.expert_tp > 1:  # token dispatch and combine, mirrored in backward
        tokens = cfg.seq_length / cp * mbs / (t if layout.sp and t > 1 else 1)
        moved = dispatch_bytes_per_layer(cfg, tokens, layout.ep, layout.expert_tp, layout.moe_dispatcher, e)
        in_node = layout.ep * layout.expert_tp <= hw.gpus_per_node  # the expert-MP group: consecutive ranks
        bw = (hw.intra_node_gbps if in_node else hw.inter_node_gbps) * 1e9
        forward += 2 * cfg.num_moe_layers / layout.pp * moved / bw / 3
    if cp > 1:  # K/V blocks around the CP ring: cp - 1 steps forward, twice that backward (dK, dV too)
        kv = 2 * e * cfg.seq_length // cp * mbs * cfg.head_dim * cfg.query_groups / t
        bw = (hw.intra_node_gbps if t * cp <= hw.gpus_per_node else hw.inter_node_gbps) * 1e9
        ring = 3 * (cp - 1) * kv / bw
        attention = (
            6.0
            * mbs
            * cfg.seq_length
            / cp
            * cfg.seq_length
            * cfg.head_dim
            * cfg.num_attention_heads
            / (hw.peak_tflops * 1e12 * hw.efficiency * t)
        )
        exposed = max(0.0, ring - attention) if layout.cp_comm == "p2p" else ring
        forward += layers * exposed / 3
    if layout.pp > 1:  # each virtual stage sends its output forward and receives its gradient back
        crosses = t * cp * layout.dp >= hw.gpus_per_node  # pipeline neighbours sit on other nodes
        bw = (hw.inter_node_gbps if crosses else hw.intra_node_gbps) * 1e9
        forward += 2 * layout.vp * msg / bw / 3
    recompute_ratio = (extra / 3 / rate / layout.pp) / forward if forward > 0 else 0.0
    makespan, bubble = _simulate(layout.schedule(), layout.pp, layout.vp, m, round(recompute_ratio, 3))
    step = makespan * forward
    step += data_parallel_seconds(cfg, layout, hw, m, forward, (2.0 + recompute_ratio) * forward)
    if cfg.is_moe and layout.edp > 1:  # the experts' gradients over their own replicas (expert-DP)
        n = max(c[1] for c in param_counts_per_rank(cfg, layout))
        bw = (hw.intra_node_gbps if layout.world <= hw.gpus_per_node else hw.inter_node_gbps) * 1e9
        step += 2 * (layout.edp - 1) / layout.edp * 4 * n / bw
    return step, bubble
