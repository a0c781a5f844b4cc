#!/usr/bin/env python
"""Choose a parallel layout before spending GPU hours: the layouts that fit, fastest first.

    python tools/plan.py --num-gpus 16 --gpu-memory 80 --model-size llama2-7b --global-batch-size 512 --seq-length 4096
    python tools/plan.py --num-gpus 8 --gpu-memory 141 --num-layers 24 --hidden-size 2048 \\
        --num-attention-heads 16 --global-batch-size 256 --seq-length 2048
    python tools/plan.py --num-gpus 64 --gpu-memory 80 --model-size mixtral-8x7b --global-batch-size 256 \\
        --seq-length 4096 --expert-model-parallel-size 4 8

For every (tp, pp, vp, dp, micro-batch, recompute, sequence parallel, --data-parallel-sharding-strategy)
layout that pretrain_gpt.py accepts, megalite/analysis/planner.py estimates the memory of the most
loaded rank (weights, fp32 grads, optimizer state, FSDP's gathered weights, activations in flight for the schedule)
and the step time (FLOPs at --efficiency of the peak, tensor-parallel and data-parallel
traffic, the pipeline simulator's bubble). A mixture of experts (--num-experts, or the mixtral-8x7b
preset) is searched over the expert-parallel size too (experts and their optimizer state split over EP,
each expert over ETP; the token dispatch's buffers and traffic counted). Layouts over
(1 - --headroom) x --gpu-memory are dropped; the best one's pretrain_gpt.py flags are printed last. Bad input: one line, exit 2.

Calibrated mode: give one or more measured runs' timelines (pretrain_gpt.py --timeline-out, which
also records the run's layout and step timers) or a stage-cost file (--save-calibration), and the
step time of every layout and schedule comes from those measured costs instead of the hardware
model (megalite/analysis/calibrate.py: per-token costs of a layer, the output layer, the embedding
and tensor-parallel communication, scaled by tp, cp and micro-batch, timed by the pipeline simulator):

    python tools/plan.py --num-gpus 8 --gpu-memory 80 --num-layers 8 --hidden-size 512 \
        --num-attention-heads 8 --global-batch-size 64 --seq-length 1024 --calibrate run_pp4.json run_tp2.json \
        --schedules zb_h1 interleaved_1f1b
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megalite.analysis.calibrate import CalibrationError, load_calibration  # noqa: E402
from megalite.analysis.planner import GiB, Hardware  # noqa: E402
from megalite.analysis.search import default_cp_sizes, plan, why_no_plan  # noqa: E402
from megalite.config import ModelConfig  # noqa: E402
from megalite.config.cli import OneLineArgumentParser, number  # noqa: E402
from megalite.config.moe import layer_freq  # noqa: E402
from megalite.config.sections import SHARDING_STRATEGIES  # noqa: E402
from megalite.config.validate import check_model  # noqa: E402
from megalite.config.validate_moe import check_moe_model  # noqa: E402
from megalite.config.validate_sharding import check_sharding_companions  # noqa: E402
from megalite.observability.throughput import peak_tflops_for  # noqa: E402
from megalite.pipeline.registry import SCHEDULES  # noqa: E402

_LLAMA = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    untie_embeddings_and_output_weights=True,
    add_bias_linear=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    vocab_size=32000,
)
_GPT3 = dict(vocab_size=50257, hidden_dropout=0.1, attention_dropout=0.1)
PRESETS = {  # GPT-3 paper table 2.1 shapes; Llama 2 paper shapes
    "gpt3-125m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, **_GPT3),
    "gpt3-350m": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, **_GPT3),
    "gpt3-1.3b": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, **_GPT3),
    "gpt3-2.7b": dict(num_layers=32, hidden_size=2560, num_attention_heads=32, **_GPT3),
    "gpt3-6.7b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, **_GPT3),
    "gpt3-13b": dict(num_layers=40, hidden_size=5120, num_attention_heads=40, **_GPT3),
    "gpt3-175b": dict(num_layers=96, hidden_size=12288, num_attention_heads=96, **_GPT3),
    "llama2-7b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008, **_LLAMA),
    "llama2-13b": dict(num_layers=40, hidden_size=5120, num_attention_heads=40, ffn_hidden_size=13824, **_LLAMA),
    "llama2-70b": dict(
        num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8, ffn_hidden_size=28672, **_LLAMA
    ),
    # Mixtral 8x7B (its config.json): 8 experts of the Mistral-7B MLP, top-2, in every layer
    "mixtral-8x7b": dict(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        num_experts=8,
        moe_router_topk=2,
        **_LLAMA,
    ),
}
_MOE_FLAGS = (
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_shared_expert_intermediate_size",
    "moe_layer_freq",
)


def build_parser() -> argparse.ArgumentParser:
    """The planner's flags; every number is read by config.cli.number (finite, in its range: one line if not).
    The model flags' own ranges and rules are pretrain_gpt.py's (model_config applies them)."""
    p = OneLineArgumentParser(prog="tools/plan.py", description=__doc__.split("\n\n")[0])
    positive, count = number(gt=0), number(int, ge=1)
    p.add_argument("--num-gpus", type=count, required=True, help="devices in the job")
    p.add_argument("--gpu-memory", type=positive, required=True, help="memory per device, GiB (H100: 80, H200: 141)")
    p.add_argument("--global-batch-size", type=count, required=True)
    p.add_argument("--seq-length", type=count, required=True)
    p.add_argument("--model-size", choices=sorted(PRESETS), help="a preset shape (or give the model flags)")
    _add_model_flags(p.add_argument_group("model flags (pretrain_gpt.py's names; override the preset)"), count)
    _add_hardware_flags(p.add_argument_group("hardware and search"), positive, count)
    _add_sharding_flags(p.add_argument_group("data-parallel sharding (pretrain_gpt.py's names; what is searched)"))
    c = p.add_argument_group("calibrated mode")
    c.add_argument(
        "--calibrate",
        nargs="+",
        metavar="JSON",
        help="measured runs' --timeline-out files (fitted "
        "together: e.g. one pipelined run and one tensor-parallel run), or one --save-calibration file",
    )
    c.add_argument("--save-calibration", metavar="JSON", help="write the fitted stage costs here")
    return p


def _add_model_flags(g, count) -> None:
    """The model's shape, pretrain_gpt.py's flag names (they override --model-size's preset)."""
    for flag in (
        "num-layers",
        "hidden-size",
        "num-attention-heads",
        "num-query-groups",
        "ffn-hidden-size",
    ):
        g.add_argument(f"--{flag}", type=int)  # ranges and rules: pretrain_gpt.py's (model_config)
    # pretrain_gpt.py takes 0 as "the tokenizer's"; the plan has no tokenizer, and counts the embedding with it
    g.add_argument("--vocab-size", type=count, help="the tokenizer's vocabulary (default 50257, or the preset's)")
    g.add_argument("--swiglu", action="store_true", default=None)
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"))
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"))
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    g.add_argument("--disable-bias-linear", action="store_true", default=None)
    g.add_argument("--num-experts", type=int, help="experts per MoE layer (a mixture of experts)")
    g.add_argument("--moe-ffn-hidden-size", type=int, help="each expert's MLP size (default --ffn-hidden-size)")
    g.add_argument("--moe-router-topk", type=int, help="experts each token is routed to (default 2)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, help="the shared expert's MLP size")
    g.add_argument("--moe-layer-freq", type=layer_freq, help="which layers are MoE (pretrain_gpt.py's syntax)")


def _add_hardware_flags(h, positive, count) -> None:
    """The devices, their links and what the search tries."""
    h.add_argument("--gpu", default="H100", help="device name for the bf16 peak table (A100, H100, H200, B200)")
    h.add_argument("--peak-tflops", type=positive, help="peak TFLOP/s per device (overrides --gpu)")
    h.add_argument(
        "--efficiency",
        type=number(gt=0, le=1, hint="a fraction of the peak: 0.5 for 50%"),
        default=0.5,
        help="fraction of the peak the matmuls reach",
    )
    h.add_argument("--gpus-per-node", type=count, default=8, help="tensor parallelism stays inside a node")
    h.add_argument("--intra-node-gbps", type=positive, default=300.0, help="per-device NVLink bandwidth, GB/s")
    h.add_argument("--inter-node-gbps", type=positive, default=25.0, help="per-device network bandwidth, GB/s")
    h.add_argument(
        "--headroom",
        type=number(ge=0, lt=1, hint="a fraction of --gpu-memory: 0.15 keeps 15% free"),
        default=0.15,
        help="memory kept free for temporaries, allocator slack and the CUDA context (fraction)",
    )
    h.add_argument("--top", type=count, default=10, help="rows to print")
    h.add_argument(
        "--context-parallel-sizes",
        type=count,
        nargs="+",
        metavar="CP",
        help="context-parallel sizes to search (default: 1, and 2, 4, 8 from --seq-length 8192)",
    )
    h.add_argument(
        "--expert-model-parallel-size",
        type=count,
        nargs="+",
        metavar="EP",
        dest="ep_sizes",
        help="expert-parallel sizes to search (default: every one dividing --num-experts)",
    )
    h.add_argument(
        "--expert-tensor-parallel-size",
        type=count,
        nargs="+",
        metavar="ETP",
        dest="etp_sizes",
        help="expert tensor-parallel sizes to search (default: the layout's tp, and 1)",
    )
    h.add_argument(
        "--schedules",
        nargs="+",
        default=[],
        choices=sorted(SCHEDULES),
        metavar="NAME",
        help=f"pipeline schedules to try besides Megatron's default for each layout ({', '.join(SCHEDULES)})",
    )
    h.add_argument(
        "--params-dtype",
        choices=("bfloat16", "float16", "float32"),
        help="weights' precision (default bfloat16, or the calibration timeline's)",
    )
    h.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        help="what the memory estimate counts (CPU kernels save "
        "more for RMSNorm, less for SDPA); default cuda, or the calibration timeline's",
    )


def _add_sharding_flags(g) -> None:
    """The strategies to search and their companions; their rules are pretrain_gpt.py's (validate_sharding)."""
    g.add_argument(
        "--data-parallel-sharding-strategy",
        nargs="+",
        choices=SHARDING_STRATEGIES,
        metavar="STRATEGY",
        dest="strategies",
        help=f"strategies to search (default: all of {', '.join(SHARDING_STRATEGIES)})",
    )
    g.add_argument(
        "--no-reshard-after-forward",
        action="store_false",
        dest="reshard_after_forward",
        help="optim_grads_params keeps each layer's gathered weights from forward to backward",
    )
    g.add_argument(
        "--num-distributed-optimizer-instances",
        type=number(int, ge=1),
        metavar="N",
        dest="instances",
        help="HSDP: shard over dp x cp / N ranks, replicate N times (default: search 1 and, when the "
        "replicas leave a node, a shard group per node)",
    )


def check_sharding(a: argparse.Namespace) -> None:
    """The sharding flags by pretrain_gpt.py's rules (a ConfigError is a ValueError: one line, exit 2); an
    HSDP size must also divide the devices, or no layout could take it."""
    check_sharding_companions(
        tuple(a.strategies or SHARDING_STRATEGIES), a.reshard_after_forward, a.instances or 1, "searched"
    )
    if a.instances and a.num_gpus % a.instances:
        raise ValueError(f"--num-distributed-optimizer-instances {a.instances} does not divide --num-gpus {a.num_gpus}")


def read_documents(paths: Sequence[str]) -> List[tuple]:
    docs = []
    for path in paths:
        try:
            with open(path) as f:
                docs.append((path, json.load(f)))
        except (OSError, ValueError) as e:
            raise ValueError(f"--calibrate {path}: cannot read it as JSON ({e})") from None
    return docs


def model_config(a: argparse.Namespace, meta: Optional[dict] = None) -> ModelConfig:
    """The preset (if any) with every model flag given on the command line applied on top."""
    if a.model_size is None and (a.num_layers is None or a.hidden_size is None or a.num_attention_heads is None):
        raise ValueError("give --model-size or --num-layers, --hidden-size and --num-attention-heads")
    kw = dict(PRESETS.get(a.model_size, {}))
    kw.setdefault("vocab_size", 50257)
    for name in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "ffn_hidden_size",
        "vocab_size",
        "swiglu",
        "normalization",
        "position_embedding_type",
        *_MOE_FLAGS,
    ):
        if getattr(a, name) is not None:
            kw[name] = getattr(a, name)
    if a.untie_embeddings_and_output_weights:
        kw["untie_embeddings_and_output_weights"] = True
    if a.disable_bias_linear:
        kw["add_bias_linear"] = False
    if kw.get("num_experts") is None and any(kw.get(n) is not None for n in _MOE_FLAGS):
        raise ValueError("--moe-* flags describe a mixture of experts: give --num-experts too")
    dtype = a.params_dtype or (meta or {}).get("params_dtype", "bfloat16")
    cfg = ModelConfig(seq_length=a.seq_length, params_dtype=dtype, attention_backend="auto", **kw)
    check_model(cfg)  # pretrain_gpt.py's rules for the model: no launch command for a model it refuses
    if cfg.is_moe:
        check_moe_model(cfg)  # pretrain_gpt.py's rules for the model (one line each)
        for flag, sizes in (
            ("--expert-model-parallel-size", a.ep_sizes),
            ("--expert-tensor-parallel-size", a.etp_sizes),
        ):
            bad = [v for v in sizes or () if v < 1 or (flag[9] == "m" and cfg.num_experts % v)]
            if bad:
                raise ValueError(
                    f"{flag} {bad[0]} must be >= 1"
                    + (f" and divide --num-experts {cfg.num_experts}" if flag[9] == "m" else "")
                )
    elif a.ep_sizes or a.etp_sizes:
        raise ValueError("--expert-model/tensor-parallel-size describe a mixture of experts: give --num-experts too")
    return cfg


def check_cp_sizes(cp_sizes: Sequence[int], num_gpus: int, seq_length: int) -> None:
    """Each --context-parallel-sizes value must divide --num-gpus and split --seq-length into 2 x CP chunks
    (pretrain_gpt.py's rule); otherwise the search has no split at all, and the batch would be blamed."""
    for cp in cp_sizes:
        if num_gpus % cp:
            raise ValueError(f"--context-parallel-sizes {cp} does not divide --num-gpus {num_gpus}")
        if seq_length % (2 * cp):
            raise ValueError(
                f"--context-parallel-sizes {cp}: --seq-length {seq_length} is not divisible by 2 x {cp} "
                "(each CP rank holds two chunks of the sequence)"
            )


def model_flags(cfg: ModelConfig, global_batch_size: int) -> List[str]:
    """pretrain_gpt.py flags for the model shape, precision and batch (the layout adds its own)."""
    out = [
        "--num-layers",
        str(cfg.num_layers),
        "--hidden-size",
        str(cfg.hidden_size),
        "--num-attention-heads",
        str(cfg.num_attention_heads),
    ]
    if cfg.num_query_groups is not None:
        out += ["--group-query-attention", "--num-query-groups", str(cfg.num_query_groups)]
    if cfg.ffn_hidden_size is not None:
        out += ["--ffn-hidden-size", str(cfg.ffn_hidden_size)]
    if cfg.swiglu:
        out.append("--swiglu")
    if cfg.normalization != "LayerNorm":
        out += ["--normalization", cfg.normalization]
    if cfg.position_embedding_type != "learned_absolute":
        out += ["--position-embedding-type", cfg.position_embedding_type]
    if cfg.untie_embeddings_and_output_weights:
        out.append("--untie-embeddings-and-output-weights")
    if not cfg.add_bias_linear:
        out.append("--disable-bias-linear")
    if cfg.is_moe:
        out += ["--num-experts", str(cfg.num_experts), "--moe-router-topk", str(cfg.moe_router_topk)]
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            if getattr(cfg, name) is not None:
                out += ["--" + name.replace("_", "-"), str(getattr(cfg, name))]
        f = cfg.moe_layer_freq
        if f != 1:
            out += ["--moe-layer-freq", str(list(f)).replace(" ", "") if isinstance(f, tuple) else str(f)]
    out += [
        "--hidden-dropout",
        f"{cfg.hidden_dropout:g}",
        "--attention-dropout",
        f"{cfg.attention_dropout:g}",
        "--seq-length",
        str(cfg.seq_length),
        "--max-position-embeddings",
        str(cfg.seq_length),
        "--global-batch-size",
        str(global_batch_size),
    ]
    out += {"bfloat16": ["--bf16"], "float16": ["--fp16"]}.get(cfg.params_dtype, [])
    return out


def calibrated(calibration, layout, global_batch_size: int) -> tuple:
    """(seconds, bubble) of ``layout`` from the measured costs."""
    p = calibration.predict(layout, global_batch_size)
    return p.step_s, p.bubble


def print_table(plans, fit: int, tokens_per_gpu: float) -> None:
    """The best layouts, GiB per device; ``gather``: FSDP's transient gathered weights and gradients."""
    print(f"{fit} layouts fit; the best {len(plans)} (GiB per device, most loaded rank):")
    wide = max([42] + [len(p.layout.describe()) for p in plans])
    print(
        f"{'#':>3} {'layout':<{wide}} {'weights':>8} {'grads':>7} {'optim':>7} {'gather':>7} {'activ':>7} "
        f"{'total':>7} {'step s':>8} {'bubble':>7} {'tok/s/GPU':>10}"
    )
    for i, p in enumerate(plans, 1):
        m = p.memory
        print(
            f"{i:>3} {p.layout.describe():<{wide}} {m.weights / GiB:>8.2f} {m.grads / GiB:>7.2f} "
            f"{m.optimizer / GiB:>7.2f} {m.gathered / GiB:>7.2f} {m.activations / GiB:>7.2f} {m.total / GiB:>7.2f} "
            f"{p.step_s:>8.3f} {100 * p.bubble:>6.1f}% {tokens_per_gpu / p.step_s:>10.0f}"
        )


def sharding_line(layout) -> str:
    """What the chosen --data-parallel-sharding-strategy shards, over how many ranks, in words."""
    s, ways = layout.strategy, layout.shard_ways
    what = {
        "no_shard": "nothing (gradients all-reduced)",
        "optim": "the optimizer state (ZeRO-1, the distributed optimizer)",
        "optim_grads": "the optimizer state and gradients (ZeRO-2, FSDP2)",
        "optim_grads_params": "the optimizer state, gradients and weights (ZeRO-3, FSDP2)",
    }[s]
    over = f" over {ways} ranks" if ways > 1 else ""
    hsdp = f", replicated {layout.instances} times (HSDP)" if layout.instances > 1 else ""
    return f"{s}: {what}{over}{hsdp}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Plan, print the table and the best layout's command; 0, 1 (nothing fits) or 2 (bad input, one line)."""
    a = build_parser().parse_args(argv)
    try:
        docs = read_documents(a.calibrate or [])
        meta = next((d for _, d in docs if "events" in d), {})
        cfg = model_config(a, meta)
        calibration = load_calibration(cfg, docs) if docs else None
        peak = a.peak_tflops or peak_tflops_for(a.gpu)
        if peak is None:
            raise ValueError(f"--gpu {a.gpu!r} is not in the peak table (A100, H100, H200, B200); give --peak-tflops")
        check_cp_sizes(a.context_parallel_sizes or (), a.num_gpus, a.seq_length)
        check_sharding(a)
    except (ValueError, CalibrationError) as e:
        print(f"tools/plan.py: error: {e}", file=sys.stderr)
        return 2
    if calibration is not None and a.save_calibration:
        with open(a.save_calibration, "w") as f:
            json.dump(calibration.to_json(), f, indent=1)
    hw = Hardware(peak, a.efficiency, a.intra_node_gbps, a.inter_node_gbps, a.gpus_per_node)
    device = a.device or meta.get("device", "cuda")
    step_time = None if calibration is None else lambda layout: calibrated(calibration, layout, a.global_batch_size)
    search = dict(
        cp_sizes=tuple(a.context_parallel_sizes or default_cp_sizes(a.seq_length)),
        schedules=tuple(a.schedules),
        ep_sizes=a.ep_sizes,
        etp_sizes=a.etp_sizes,
        strategies=tuple(a.strategies or SHARDING_STRATEGIES),
        reshard=a.reshard_after_forward,
        instances=a.instances,
    )
    plans = plan(
        cfg, a.num_gpus, a.gpu_memory, a.global_batch_size, hw, a.headroom, device=device, step_time=step_time, **search
    )
    tokens = a.global_batch_size * a.seq_length
    experts = (
        f"; {cfg.num_experts} experts of ffn {cfg.moe_ffn_size} (top-{cfg.moe_router_topk}) in "
        f"{cfg.num_moe_layers} layers"
        if cfg.is_moe
        else ""
    )
    print(
        f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}"
        f"{f' (groups {cfg.num_query_groups})' if cfg.num_query_groups else ''}, ffn {cfg.ffn_size}"
        f"{experts}, seq "
        f"{cfg.seq_length}, vocab {cfg.vocab_size}; {a.num_gpus} x {a.gpu_memory:g} GiB at {peak:g} TFLOP/s "
        f"(x {a.efficiency:g}), global batch {a.global_batch_size}"
        + (f"; step times calibrated on {', '.join(n for n, _ in docs)}" if calibration is not None else "")
    )
    if not plans:  # the batch (a flag to fix: exit 2) or memory (no answer: exit 1), whichever rules them out
        why, bad_batch = why_no_plan(cfg, a.num_gpus, a.gpu_memory, a.global_batch_size, hw, a.headroom, **search)
        print(f"tools/plan.py: error: {why}" if bad_batch else why, file=sys.stderr)
        return 2 if bad_batch else 1
    print_table(plans[: a.top], len(plans), tokens / a.num_gpus)
    best = plans[0].layout
    flags = model_flags(cfg, a.global_batch_size) + best.flags(cfg.num_layers)
    print(f"\nbest layout: {best.describe()}; data-parallel sharding: {sharding_line(best)}")
    print("its flags (add your data and schedule flags):")
    per_node = min(a.num_gpus, a.gpus_per_node)
    nodes = (
        f'--nnodes {a.num_gpus // per_node} --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" '
        if a.num_gpus > per_node
        else ""
    )
    print(f"torchrun {nodes}--nproc-per-node {per_node} pretrain_gpt.py " + shlex.join(flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
