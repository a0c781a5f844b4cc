"""FP8 training against bf16: tokens/s of megalite's training step, and the loss after N iterations.

Throughput (default): one process, mock data, the same model and micro-batches with --bf16 alone and
with --fp8-format and each --fp8-recipe; prints ms/iter, tokens/s and the speed-up over bf16 (median
of the timed iterations after warm-up; the variants alternate so drift hits all of them alike).
``--loss-iters N``: runs pretrain_gpt.py on the embedded corpus (the default data) for N iterations,
bf16 and FP8, and prints the mean loss of the last 10% of iterations of each and their relative gap.

    python benchmarks/bench_fp8.py                         # CUDA (FP8 needs compute capability 8.9+)
    python benchmarks/bench_fp8.py --loss-iters 200        # + the 200-iteration loss comparison
    python benchmarks/bench_fp8.py --cpu-smoke             # tiny shape on CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Dict, List

import common  # noqa: F401  (first: puts the repository on sys.path)
import torch

from megalite.config.arguments import parse_args
from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from megalite.training.mock import MockFeed

FULL = dict(layers=8, hidden=2048, heads=16, seq=2048, mbs=4, gbs=8, vocab=32000, warmup=5, iters=20)
SMOKE = dict(layers=2, hidden=64, heads=4, seq=32, mbs=2, gbs=4, vocab=256, warmup=1, iters=2)
VARIANTS = {
    "bf16": [],
    "tensorwise": ["--fp8-recipe", "tensorwise"],
    "delayed": ["--fp8-recipe", "delayed", "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max"],
    "rowwise": ["--fp8-recipe", "rowwise"],
}


def model_flags(s: Dict[str, int]) -> List[str]:
    """The model and batch flags of shape ``s`` (no data flags)."""
    return [
        *("--num-layers", str(s["layers"]), "--hidden-size", str(s["hidden"])),
        *("--num-attention-heads", str(s["heads"]), "--seq-length", str(s["seq"])),
        *("--max-position-embeddings", str(s["seq"]), "--micro-batch-size", str(s["mbs"])),
        *("--global-batch-size", str(s["gbs"]), "--eval-iters", "0", "--bf16"),
        *("--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope"),
        *("--untie-embeddings-and-output-weights", "--disable-bias-linear"),
    ]


def label(name: str) -> str:
    return name if name == "bf16" else f"fp8 {name}"


def variant_flags(name: str, fmt: str) -> List[str]:
    return [] if name == "bf16" else ["--fp8-format", fmt, *VARIANTS[name]]


def throughput(s: Dict[str, int], names: List[str], fmt: str, ps: ParallelState) -> Dict[str, float]:
    """Median seconds per training step of each variant, the variants interleaved step by step."""
    cuda = ps.device.type == "cuda"
    runs = {}
    for name in names:
        argv = ["--mock-data", "--vocab-size", str(s["vocab"]), "--train-iters", "1000", *model_flags(s)]
        trainer = Trainer(parse_args(argv + variant_flags(name, fmt), world_size=1), ps)
        feed = MockFeed(trainer, 2, seed=1)
        runs[name] = (trainer, [feed.next() for _ in range(2)], [])
    for i in range(s["warmup"] + s["iters"]):
        for trainer, batches, times in runs.values():
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            trainer.train_step(batches[i % 2])
            if cuda:
                torch.cuda.synchronize()
            if i >= s["warmup"]:
                times.append(time.perf_counter() - t0)
    return {name: statistics.median(times) for name, (_, _, times) in runs.items()}


def losses_of(argv: List[str]) -> List[float]:
    """The per-iteration losses of a pretrain_gpt.py run (its log lines)."""
    script = os.path.join(common.REPO, "pretrain_gpt.py")
    res = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True)
    if res.returncode != 0:  # say why before stopping: the run's own last lines
        sys.exit(f"bench_fp8: pretrain_gpt.py {' '.join(argv)} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", res.stdout)]


def loss_comparison(s: Dict[str, int], names: List[str], fmt: str, iters: int) -> None:
    """Mean loss over the last 10% of ``iters`` iterations on the embedded corpus, bf16 against FP8."""
    base = model_flags(s) + ["--train-iters", str(iters), "--log-interval", "1", "--lr", "3e-4"]
    base += ["--lr-warmup-iters", str(max(1, iters // 10)), "--hidden-dropout", "0", "--attention-dropout", "0"]
    tail = max(1, iters // 10)
    results = {name: losses_of(base + variant_flags(name, fmt)) for name in names}
    ref = statistics.mean(results["bf16"][-tail:])
    print(f"\nloss after {iters} iterations (mean of the last {tail}), embedded corpus")
    print(f"{'run':<16} {'first':>8} {'last':>8} {'vs bf16':>9}")
    for name, values in results.items():
        last = statistics.mean(values[-tail:])
        print(f"{label(name):<16} {values[0]:>8.4f} {last:>8.4f} {100 * (last - ref) / ref:>8.2f}%")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shape on CPU: checks the script runs")
    p.add_argument("--fp8-format", default="hybrid", choices=("e4m3", "hybrid"))
    p.add_argument("--recipes", nargs="+", default=list(VARIANTS)[1:], choices=list(VARIANTS)[1:], help="FP8 recipes")
    p.add_argument("--iters", type=int, help="timed iterations (default 20; smoke 2)")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--loss-iters", type=int, default=0, help="also compare the loss after N iterations")
    a = p.parse_args()
    cuda = not a.cpu_smoke
    if cuda and not torch.cuda.is_available():
        print("bench_fp8: no CUDA device; use --cpu-smoke to check the script on CPU", file=sys.stderr)
        return 2
    s = dict(SMOKE if a.cpu_smoke else FULL)
    s.update({k: v for k, v in (("iters", a.iters), ("layers", a.layers), ("hidden", a.hidden)) if v})
    names = ["bf16", *a.recipes]
    ps = ParallelState.single() if a.cpu_smoke else ParallelState.single(torch.device("cuda", 0))
    device = torch.cuda.get_device_name(0) if cuda else "CPU (FP8 emulated: float8 values multiplied in fp32)"
    print(
        f"device {device}, torch {torch.__version__}; llama-style GPT {s['layers']} x {s['hidden']}, heads "
        f"{s['heads']}, seq {s['seq']}, micro-batch {s['mbs']}, global batch {s['gbs']}, --fp8-format {a.fp8_format}"
    )
    secs = throughput(s, names, a.fp8_format, ps)
    tokens = s["gbs"] * s["seq"]
    print(f"{'run':<16} {'ms/iter':>9} {'tokens/s':>10} {'vs bf16':>8}")
    for name, t in secs.items():
        print(f"{label(name):<16} {1e3 * t:>9.1f} {tokens / t:>10.0f} {secs['bf16'] / t:>8.2f}")
    if a.loss_iters:
        loss_comparison(s, names, a.fp8_format, a.loss_iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
