#!/usr/bin/env python
"""Framework overhead: megalite's real training step vs a plain single-file PyTorch GPT.

Both sides do the same work per iteration on the same micro-batches: forward and
backward of every micro-batch (gradient accumulation, loss / m), global-norm
clipping, AdamW (foreach, decay on matrices only) and an LR schedule. megalite
runs ``Trainer.train_step`` (grad buffer, executor, its own cross entropy,
clipping and schedule); the plain side is a ~90-line nanoGPT-style model
defined below. The two are timed step by step in alternation (A B, B A, ...)
so that load from other processes on the machine hits both alike. The table
gives median and min wall time per step, the median process CPU time (steadier
on a shared machine when --threads 1), tokens/s, and megalite / plain both as
a ratio of medians and as the median of the per-pair ratios. A third row runs
megalite's step with the flight recorder off (``no-rec``: the hang diagnosis'
ring buffer), and a last line prices the recorder per event and per step of a
deeper pipeline (its events counted from the schedule's action lists).
``--recorder-pp N`` also times the recorder on and off, step by step, on an N-rank
gloo pipeline of a small model (1F1B, 4N micro-batches: many transfers and
waits per unit of compute, the recorder's worst case).

  python benchmarks/bench_overhead.py                  # pretrain_gpt.py's default model
  python benchmarks/bench_overhead.py --llama          # RMSNorm, SwiGLU, RoPE, untied, no bias
  python benchmarks/bench_overhead.py --quick          # smoke run (< 60 s)
  python benchmarks/bench_overhead.py --profile        # also print where each side spends CPU time
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Callable, Dict, List, Sequence, Tuple

import common  # noqa: F401  (first: puts the repository on sys.path)
import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import Config, ModelConfig
from megalite.config.arguments import parse_args
from megalite.observability.flight_recorder import FlightRecorder
from megalite.parallel.state import ParallelState
from megalite.pipeline.actions import Comm, Compute
from megalite.pipeline.registry import build_schedule
from megalite.training import Trainer
from megalite.training.mock import MockFeed

Batch = Dict[str, torch.Tensor]


# -- the plain model (nanoGPT-like, batch-first [b, s, h]) ------------------------------------------
class PlainBlock(nn.Module):
    """Pre-norm block: GPT-2 (LayerNorm, GELU, biases) or Llama (RMSNorm, SwiGLU, RoPE, no bias)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, bias, self.cfg = cfg.hidden_size, cfg.add_bias_linear, cfg
        norm = (
            (lambda: nn.RMSNorm(h, eps=cfg.layernorm_epsilon))
            if cfg.normalization == "RMSNorm"
            else (lambda: nn.LayerNorm(h, eps=cfg.layernorm_epsilon))
        )
        self.ln1, self.ln2 = norm(), norm()
        self.qkv = nn.Linear(h, 3 * h, bias=bias)
        self.proj = nn.Linear(h, h, bias=bias)
        self.fc1 = nn.Linear(h, (2 if cfg.swiglu else 1) * cfg.ffn_size, bias=bias)
        self.fc2 = nn.Linear(cfg.ffn_size, h, bias=bias)
        self.drop = nn.Dropout(cfg.hidden_dropout)

    def attention(self, x: torch.Tensor, rope) -> torch.Tensor:
        b, s, h = x.shape
        n = self.cfg.num_attention_heads
        q, k, v = self.qkv(x).view(b, s, 3, n, h // n).permute(2, 0, 3, 1, 4)  # each [b, n, s, d]
        if rope is not None:
            q, k = rotate(q, *rope), rotate(k, *rope)
        p = self.cfg.attention_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)
        if self.cfg.swiglu:
            gate, up = y.chunk(2, dim=-1)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(y))

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        x = x + self.drop(self.attention(self.ln1(x), rope))
        return x + self.drop(self.mlp(self.ln2(x)))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [b, n, s, d] (the same convention as megalite and Megatron)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class PlainGPT(nn.Module):
    """The whole model in one module; the loss is plain F.cross_entropy."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg, h = cfg, cfg.hidden_size
        vocab = cfg.padded_vocab_size(1)  # same table size as megalite
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(cfg.seq_length, h) if cfg.position_embedding_type != "rope" else None
        self.drop = nn.Dropout(cfg.hidden_dropout)
        self.blocks = nn.ModuleList(PlainBlock(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.RMSNorm(h) if cfg.normalization == "RMSNorm" else nn.LayerNorm(h)
        self.head = None if cfg.tied_embeddings else nn.Linear(h, vocab, bias=False)
        for _name, p in self.named_parameters():
            if p.ndim > 1:
                nn.init.normal_(p, std=cfg.init_method_std)
        if cfg.position_embedding_type == "rope":
            d = cfg.head_dim
            inv = 1.0 / (cfg.rotary_base ** (torch.arange(0, d, 2).float() / d))
            freqs = torch.outer(torch.arange(cfg.seq_length).float(), inv)
            emb = torch.cat([freqs, freqs], dim=-1)
            self.register_buffer("cos", emb.cos(), persistent=False)
            self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.wte(tokens)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(s, device=tokens.device))
        x = self.drop(x)
        rope = (self.cos[:s], self.sin[:s]) if self.wpe is None else None
        for block in self.blocks:
            x = block(x, rope)
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight) if self.head is None else self.head(x)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


class PlainTrainer:
    """The same training work as Trainer.train_step, written the usual single-GPU way."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        torch.manual_seed(cfg.train.seed)
        self.model = PlainGPT(cfg.model)
        params = list(self.model.parameters())
        groups = [
            {"params": [p for p in params if p.ndim > 1], "weight_decay": cfg.optim.weight_decay},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
        ]
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, foreach=True
        )
        self.iteration = 0

    def lr(self) -> float:
        """Linear warmup then cosine decay to min_lr (megalite's default schedule)."""
        o, it = self.cfg.optim, self.iteration
        total = o.lr_decay_iters or self.cfg.train.train_iters
        if o.lr_warmup_iters and it <= o.lr_warmup_iters:
            return o.lr * it / o.lr_warmup_iters
        ratio = min(1.0, (it - o.lr_warmup_iters) / max(1, total - o.lr_warmup_iters))
        return o.min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (o.lr - o.min_lr)

    def train_step(self, batches: Sequence[Batch]) -> Dict[str, float]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        for b in batches:
            loss = self.model(b["tokens"], b["labels"])
            (loss / len(batches)).backward()
            losses.append(loss.detach())
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.clip_grad, foreach=True))
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr()
        if math.isfinite(norm):
            self.optimizer.step()
        self.iteration += 1
        return {"loss": float(torch.stack(losses).mean()), "grad_norm": norm}


# -- the benchmark ---------------------------------------------------------------------------------
def build_config(a: argparse.Namespace, total_iters: int) -> Config:
    """pretrain_gpt.py's defaults (through its own parser), with the shape flags given here."""
    argv = [
        "--mock-data",
        "--num-layers",
        str(a.num_layers),
        "--hidden-size",
        str(a.hidden_size),
        "--seq-length",
        str(a.seq_length),
        "--micro-batch-size",
        str(a.micro_batch_size),
        "--global-batch-size",
        str(a.global_batch_size),
        "--train-iters",
        str(total_iters),
        "--eval-iters",
        "0",
    ]
    if a.llama:
        argv += [
            "--normalization",
            "RMSNorm",
            "--swiglu",
            "--position-embedding-type",
            "rope",
            "--untie-embeddings-and-output-weights",
            "--disable-bias-linear",
        ]
    return parse_args(argv)


def make_batches(cfg: Config, trainer: Trainer, n: int) -> List[List[Batch]]:
    """n global batches of mock data, read once through megalite's MicroBatches (data is not timed)."""
    feed = MockFeed(trainer, n)
    return [feed.next() for _ in range(n)]


def timed(step: Callable[[List[Batch]], dict], batch: List[Batch]) -> Tuple[float, float]:
    """One iteration; return (wall seconds, this process's CPU seconds).

    With one thread the CPU time hardly moves when other processes compete for
    the cores (time spent descheduled is not counted), so it is the steadier
    figure on a shared machine; with several threads it also counts spinning.
    """
    w0, c0 = time.perf_counter(), time.process_time()
    step(batch)
    return time.perf_counter() - w0, time.process_time() - c0


def profile(name: str, step: Callable, batches: List[List[Batch]], n: int, rows: int) -> None:
    """Print torch.profiler's top ops by self CPU time over ``n`` steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    step(batches[0])
    with tprofile(activities=[ProfilerActivity.CPU], with_stack=False) as prof:
        for i in range(n):
            step(batches[i % len(batches)])
    print(f"\n== torch.profiler, {name}, {n} steps, by self CPU time ==")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main(argv: Sequence[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps per implementation")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per implementation first")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--llama", action="store_true", help="RMSNorm, SwiGLU, RoPE, untied, no biases")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 warmup + 6 timed steps each")
    p.add_argument("--profile", action="store_true", help="also print torch.profiler tables")
    p.add_argument(
        "--recorder-pp",
        type=int,
        default=0,
        help="also time the flight recorder on/off on a pipeline of this many gloo ranks (0: not)",
    )
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.warmup = 6, 1
    torch.set_num_threads(a.threads)

    total = a.warmup + a.steps + 10  # so the LR schedule never runs out
    cfg = build_config(a, total)
    trainer = Trainer(cfg, ParallelState.single())
    plain = PlainTrainer(cfg)
    batches = make_batches(cfg, trainer, 4)
    impls = {
        "megalite": trainer.train_step,
        "no-rec": without_recorder(trainer.train_step, trainer.ps.recorder),
        "plain": plain.train_step,
    }
    n_params = {
        "megalite": sum(q.numel() for q in trainer.params),
        "plain": sum(q.numel() for q in plain.model.parameters()),
    }
    n_params["no-rec"] = n_params["megalite"]
    wall: Dict[str, List[float]] = {k: [] for k in impls}
    cpu: Dict[str, List[float]] = {k: [] for k in impls}
    for step in impls.values():
        for i in range(a.warmup):
            step(batches[i % len(batches)])
    for i in range(a.steps):
        # Alternate step by step, flipping the order every step (A B, B A, ...), so that
        # load from other processes and slow drift hit both implementations alike.
        order = list(impls) if i % 2 == 0 else list(reversed(impls))
        for name in order:
            w, c = timed(impls[name], batches[i % len(batches)])
            wall[name].append(w)
            cpu[name].append(c)
    print_table(a, cfg, wall, cpu, n_params)
    print_recorder_cost(wall, cpu)
    if a.recorder_pp:
        pipeline_recorder_rows(a.recorder_pp, a.steps, a.warmup)
    if a.profile:
        for name, step in impls.items():
            profile(name, step, batches, max(2, a.steps), 25)
    return 0


def without_recorder(step: Callable[[List[Batch]], dict], recorder: FlightRecorder) -> Callable[[List[Batch]], dict]:
    """``step`` with the run's flight recorder off (what --flight-recorder-size 0 runs)."""

    def run(batch: List[Batch]) -> dict:
        recorder.enabled = False
        try:
            return step(batch)
        finally:
            recorder.enabled = True

    return run


def print_recorder_cost(wall: Dict[str, List[float]], cpu: Dict[str, List[float]]) -> None:
    """The recorder's price: measured on this step (per-pair medians), per event (CPU time), and per step of a
    pp 4 interleaved pipeline."""
    rec, n = FlightRecorder(), 200_000
    t0 = time.process_time()
    for i in range(n // 2):
        rec.done(rec.record("F", mb=i, chunk=0, run=1))
    for i in range(n // 4):
        rec.wait_on(rec.transfer("recv", 1, "F", i, 1))
    per_event = (time.process_time() - t0) / n
    actions = build_schedule("interleaved_1f1b", 4, 2, 16)[1]
    events = sum(1 if isinstance(x, Compute) else 2 * len(x.ops) for x in actions if isinstance(x, (Compute, Comm)))
    pair, pair_cpu = (statistics.median(x / y for x, y in zip(d["megalite"], d["no-rec"])) for d in (wall, cpu))
    print(
        f"flight recorder on / off - 1: median wall {100 * (pair - 1):+.2f}%, median cpu "
        f"{100 * (pair_cpu - 1):+.2f}% (per-pair); {1e6 * per_event:.2f} us cpu per event; a pp 4 x vp 2 rank "
        f"with 16 micro-batches records {events} events per step: {1e3 * events * per_event:.2f} ms"
    )


def _recorder_on_off(ps, cfg: Config, steps: int, warmup: int) -> Dict[str, List[float]]:
    """One pipeline rank: train steps alternating recorder on / off (every rank alike); wall and CPU times."""
    trainer = Trainer(cfg, ps)
    feed = MockFeed(trainer, 4)
    batches = [feed.next() for _ in range(4)]
    times: Dict[str, List[float]] = {"on": [], "off": [], "on cpu": [], "off cpu": []}
    for i in range(warmup + steps):
        for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
            ps.recorder.enabled = mode == "on"
            t0, c0 = time.perf_counter(), time.process_time()
            trainer.train_step(batches[i % len(batches)])
            if i >= warmup:
                times[mode].append(time.perf_counter() - t0)
                times[mode + " cpu"].append(time.process_time() - c0)
    ps.recorder.enabled = True
    return times


def pipeline_recorder_rows(pp: int, steps: int, warmup: int) -> None:
    """The recorder on and off on a ``pp``-rank pipeline (hidden 64, 4 layers per stage, seq 64, 4 pp micro-batches)."""
    model = ModelConfig(num_layers=4 * pp, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=1024)
    cfg = common.mock_config(model, 2, 2 * 4 * pp, seed=1234, train_iters=10_000, pp=pp)
    times = common.run_distributed(_recorder_on_off, pp, cfg, steps, warmup, pp=pp)

    def med(key: str, agg) -> float:  # per step: the slowest rank's wall time, the ranks' summed CPU time
        return statistics.median(agg(t[key][i] for t in times) for i in range(steps))

    def pair(key: str, agg) -> float:
        return statistics.median(
            agg(t["on" + key][i] for t in times) / agg(t["off" + key][i] for t in times) for i in range(steps)
        )

    print(
        f"\nflight recorder on a pp {pp} pipeline (gloo, 1F1B, {4 * pp} micro-batches of 2 x 64 tokens, hidden 64, "
        f"{steps} steps each, alternating)"
    )
    print(f"{'recorder':<10} {'median ms':>10} {'cpu ms':>9}")
    for k in ("on", "off"):
        print(f"{k:<10} {1e3 * med(k, max):>10.2f} {1e3 * med(k + ' cpu', sum):>9.2f}")
    print(
        f"on / off - 1: wall {100 * (pair('', max) - 1):+.2f}%, cpu {100 * (pair(' cpu', sum) - 1):+.2f}% "
        f"(median of per-step ratios; wall: slowest rank, cpu: all ranks)"
    )


def print_table(
    a: argparse.Namespace,
    cfg: Config,
    wall: Dict[str, List[float]],
    cpu: Dict[str, List[float]],
    n_params: Dict[str, int],
) -> None:
    """The result table: wall and CPU time per step, tokens/s, and the overhead over plain."""
    m, t = cfg.model, cfg.train
    tokens = t.global_batch_size * m.seq_length
    style = "llama" if a.llama else "gpt2"
    print(
        f"model {style}: {m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_attention_heads}, "
        f"seq {m.seq_length}, vocab {m.vocab_size}, micro-batch {t.micro_batch_size}, global batch "
        f"{t.global_batch_size} ({t.global_batch_size // t.micro_batch_size} micro-batches), "
        f"dropout {m.hidden_dropout}, threads {a.threads}"
    )
    print(f"{a.steps} timed steps per implementation after {a.warmup} warmup, alternating step by step")
    print(f"{'impl':<10} {'params':>10} {'median ms':>10} {'min ms':>9} {'cpu ms':>9} {'tokens/s':>10} {'vs plain':>9}")
    base = statistics.median(wall["plain"])
    for name in wall:
        med = statistics.median(wall[name])
        print(
            f"{name:<10} {n_params[name]:>10,} {1e3 * med:>10.1f} {1e3 * min(wall[name]):>9.1f} "
            f"{1e3 * statistics.median(cpu[name]):>9.1f} {tokens / med:>10.0f} "
            f"{100 * (med / base - 1):>+8.1f}%"
        )
    pair = statistics.median(x / y for x, y in zip(wall["megalite"], wall["plain"]))
    pair_cpu = statistics.median(x / y for x, y in zip(cpu["megalite"], cpu["plain"]))
    print(
        f"framework overhead, megalite / plain - 1: median wall {100 * (pair - 1):+.1f}% (per-pair), "
        f"min wall {100 * (min(wall['megalite']) / min(wall['plain']) - 1):+.1f}%, "
        f"median cpu {100 * (pair_cpu - 1):+.1f}% (per-pair)"
    )


if __name__ == "__main__":
    sys.exit(main())
