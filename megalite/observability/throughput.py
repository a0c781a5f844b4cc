"""Throughput figures: model and hardware FLOPs, MFU against the device's peak, GPU memory per rank.

Model FLOPs are Megatron-LM's ``num_floating_point_operations`` (megatron-core 0.16 and later), counted
by the model's spec (model/spec.py: per token and layer 6 x the weights a token multiplies plus the
causal core attention, the output layer once; an MoE layer's active experts only), so that
TFLOP/s/GPU compares with Megatron's log. ``causal=False`` counts the core attention over the full
square, as Megatron up to core 0.15 did and as a FLOP counter sees from an unfused attention.
Recomputation re-runs forwards that the model count leaves out; they are added only to the *hardware*
FLOPs, never to MFU (MFU is model FLOPs / peak, as Megatron and PaLM define it).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from megalite.config import ModelConfig
from megalite.model.spec import ModelSpec

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, from NVIDIA's data sheets. Matched in
# order against torch.cuda.get_device_name(): the more specific names come first.
PEAK_BF16_TFLOPS: Tuple[Tuple[str, float], ...] = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM5
    ("A100", 312.0),
)


def peak_tflops_for(device_name: str) -> Optional[float]:
    """The table's bf16 dense peak for a CUDA device name (None: not in the table)."""
    for key, peak in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


def device_peak_tflops(device: torch.device, override: Optional[float] = None) -> Optional[float]:
    """--peak-tflops when given; else the table's peak for this CUDA device; on CPU None (no MFU)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    return peak_tflops_for(torch.cuda.get_device_name(device))


def mlp_flops_per_token(cfg: ModelConfig) -> float:
    """Forward+backward MLP FLOPs per token summed over all layers: dense layers' MLP, and for an MoE
    layer the ``topk`` routed experts plus the shared expert (megatron's num_floating_point_operations)."""
    return ModelSpec.of(cfg).mlp_flops_per_token()


def flops_per_iteration(cfg: ModelConfig, global_batch_size: int, padded_vocab: int, causal: bool = True) -> float:
    """Model FLOPs of one iteration (forward + backward of every sample), Megatron's count.

    ``causal=False``: the core attention over the whole s x s square (Megatron <= core 0.15).
    """
    return ModelSpec.of(cfg).flops(global_batch_size * cfg.seq_length, padded_vocab, causal)


def recomputed_layers(cfg: ModelConfig, num_chunks: int = 1, layers_per_chunk: Optional[int] = None) -> int:
    """Transformer layers whose forward runs twice under --recompute-granularity full.

    uniform: every layer (each group of n is re-run from its input); block: the first n
    layers of each of the model's ``num_chunks`` pipeline chunks (pp x vp of them).
    """
    if cfg.recompute_granularity != "full":
        return 0
    if cfg.recompute_method == "block":
        per_chunk = layers_per_chunk if layers_per_chunk is not None else cfg.num_layers // max(1, num_chunks)
        return min(cfg.recompute_num_layers, per_chunk) * num_chunks
    return cfg.num_layers


def recompute_flops_per_iteration(
    cfg: ModelConfig, global_batch_size: int, num_chunks: int = 1, causal: bool = True
) -> float:
    """Extra FLOPs recomputation costs: one more forward (a third of forward+backward) of what it re-runs.

    selective: the core attention of every layer; full: whole layers (recomputed_layers).
    """
    tokens = global_batch_size * cfg.seq_length
    proj, core, mlp = ModelSpec.of(cfg).layer_flops_per_token(causal)
    if cfg.recompute_granularity == "selective":
        return tokens * cfg.num_layers * core / 3.0
    return tokens * recomputed_layers(cfg, num_chunks) * (proj + core + mlp) / 3.0


class Throughput:
    """Per-iteration figures from the iteration time: tokens/s, model and hardware TFLOP/s/GPU, MFU."""

    def __init__(
        self,
        cfg: ModelConfig,
        global_batch_size: int,
        padded_vocab: int,
        world_size: int,
        num_chunks: int = 1,
        peak_tflops: Optional[float] = None,
    ):
        self.tokens = global_batch_size * cfg.seq_length
        self.model_flops = flops_per_iteration(cfg, global_batch_size, padded_vocab)
        self.hardware_flops = self.model_flops + recompute_flops_per_iteration(cfg, global_batch_size, num_chunks)
        self.world_size, self.peak = world_size, peak_tflops

    def figures(self, sec_per_iter: float) -> Dict[str, Optional[float]]:
        """tokens/s (whole job), TFLOP/s per device (model, hardware) and MFU (fraction; None: no peak)."""
        model = self.model_flops / sec_per_iter / 1e12 / self.world_size
        hardware = self.hardware_flops / sec_per_iter / 1e12 / self.world_size
        return {
            "tokens_per_s": self.tokens / sec_per_iter,
            "tflops": model,
            "hw_tflops": hardware,
            "mfu": model / self.peak if self.peak else None,
        }

    def log_fields(self, figures: Dict[str, Optional[float]]) -> str:
        """The fields that follow Megatron's in the log line (hardware FLOPs only when they differ)."""
        parts = [f" tokens per second per GPU: {figures['tokens_per_s'] / self.world_size:.1f}"]
        if self.hardware_flops != self.model_flops:
            parts.append(f" hardware TFLOP/s/GPU (with recompute): {figures['hw_tflops']:.3f}")
        if figures["mfu"] is not None:
            parts.append(f" MFU: {100 * figures['mfu']:.1f}% of {self.peak:g} TFLOP/s")
        return "".join(p + " |" for p in parts)

    def tensorboard(self, figures: Dict[str, Optional[float]]) -> Dict[str, Optional[float]]:
        """TensorBoard scalars (Megatron's 'throughput' is the model TFLOP/s/GPU)."""
        return {
            "throughput": figures["tflops"],
            "hardware-throughput": figures["hw_tflops"],
            "tokens-per-second": figures["tokens_per_s"],
            "mfu": figures["mfu"] if figures["mfu"] is not None else None,
        }


# -- GPU memory per rank ------------------------------------------------------------------------------
def memory_stats(device: torch.device) -> Optional[Dict[str, float]]:
    """This rank's CUDA allocator figures in bytes (None on CPU, where torch keeps no such counters)."""
    if device.type != "cuda":
        return None
    return {
        "allocated": float(torch.cuda.memory_allocated(device)),
        "max_allocated": float(torch.cuda.max_memory_allocated(device)),
        "reserved": float(torch.cuda.memory_reserved(device)),
        "max_reserved": float(torch.cuda.max_memory_reserved(device)),
    }


def format_memory_report(rank: int, iteration: int, stats: Dict[str, float]) -> str:
    """Megatron's memory report line (MB), printed once after the first logged iterations."""
    mb = {k: v / 2**20 for k, v in stats.items()}
    return (
        f"[Rank {rank}] (after {iteration} iterations) memory (MB) | allocated: {mb['allocated']:.1f} | "
        f"max allocated: {mb['max_allocated']:.1f} | reserved: {mb['reserved']:.1f} | "
        f"max reserved: {mb['max_reserved']:.1f}"
    )


def gather_memory_report(ps, iteration: int) -> List[str]:
    """Every rank's report line, gathered on all ranks (collective; [] on CPU runs, which skip it).

    Megatron prints from each rank whose data-parallel rank is 0 (data-parallel replicas hold
    the same); one gather lets the logging rank print them in rank order instead.
    """
    stats = memory_stats(ps.device)
    if stats is None:
        return []
    import torch.distributed as dist

    gathered: List[Optional[tuple]] = [(ps.rank, ps.dp_rank, stats)]
    if ps.world_size > 1 and dist.is_initialized():
        gathered = [None] * ps.world_size
        ps.recorder.call("world", dist.all_gather_object, gathered, (ps.rank, ps.dp_rank, stats))
    return [format_memory_report(r, iteration, s) for r, dp_rank, s in gathered if dp_rank == 0]


def memory_scalars(stats: Optional[Dict[str, float]]) -> Dict[str, float]:
    """TensorBoard tags of Megatron's --log-memory-to-tensorboard for this rank's figures."""
    if stats is None:
        return {}
    return {
        "mem-allocated-bytes": stats["allocated"],
        "mem-max-allocated-bytes": stats["max_allocated"],
        "mem-reserved-bytes": stats["reserved"],
        "mem-max-reserved-bytes": stats["max_reserved"],
    }
