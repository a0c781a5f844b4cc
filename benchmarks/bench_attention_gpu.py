#!/usr/bin/env python
"""One-GPU check of packed-document and context-parallel attention (issue 29); one command, under
5 minutes on one H200:

    python benchmarks/bench_attention_gpu.py              # CUDA, bf16
    python benchmarks/bench_attention_gpu.py --cpu-smoke  # tiny shapes on CPU: checks the script runs

Prints four tables:
  1. step       the 12 x 768 GPT (12 heads, 4 query groups, RoPE, dropout 0) forward + backward with
                --reset-position-ids --reset-attention-mask --eod-mask-loss (documents of ~1k tokens,
                a fresh segment_ids tensor every step, so the per-micro-batch segment work is counted)
                over the same step without documents, at seq 8192 and 32768 (target <= 1.10 at 8192)
  2. attention  one attention fwd+bwd (b 2, 12 heads, 4 groups, d 64, s 8192, ~1k-token documents):
                SDPA flash causal, megalite's packed path (FlashAttention-2 varlen; and the fp32 tiles,
                --attention-backend unfused), flex_attention with a document block mask (compiled)
  3. cp blocks  the kernel calls a cp 2 / 4 / 8 ring makes at seq 65536 (chunks of s / 2cp): the causal
                diagonal chunk and a past chunk, causal and with documents, against SDPA flash at the
                same shape (target: within 1.2x of flash)
  4. longest    the longest packed sequence (mbs 1) whose step fits in this GPU's memory: doubling,
                then bisection in steps of 8192; each try after freeing the last one's memory
Times are CUDA-event medians after warm-up. --cpu-smoke runs the same code on CPU with tiny shapes,
the reference kernel in place of FlashAttention-2 and no flex_attention.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Callable, Dict, List, Optional

import common  # noqa: F401  (first: puts the repository on sys.path)
import torch
import torch.nn.functional as F

from megalite.config import ModelConfig
from megalite.context_parallel import context_parallel_attention, varlen
from megalite.context_parallel.kernels import describe, kernel_for
from megalite.context_parallel.sequence import add_document_fields
from megalite.model.gpt import GPTModel
from megalite.parallel.state import AxisGroup, ParallelState
from megalite.tensor_parallel.random import RNGTracker

ONE = AxisGroup([0], 0)
FULL = dict(
    layers=12,
    hidden=768,
    heads=12,
    groups=4,
    vocab=50257,
    doc=1024,
    steps=(8192, 32768),
    mbs=2,
    attn_s=8192,
    cp_s=65536,
    search=(8192, 1 << 22),
    iters=10,
)
SMOKE = dict(
    layers=2,
    hidden=64,
    heads=4,
    groups=2,
    vocab=512,
    doc=16,
    steps=(64, 128),
    mbs=2,
    attn_s=64,
    cp_s=128,
    search=(64, 256),
    iters=1,
)


def timed_ms(fn: Callable[[], None], device: torch.device, iters: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` (CUDA events around each call on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def doc_tokens(b: int, s: int, vocab: int, doc: int, device, seed: int = 0) -> torch.Tensor:
    """Random tokens [b, s] with an eod (vocab - 1) ending documents of doc/2 .. 3doc/2 tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab - 1, (b, s), generator=g)
    for row in range(b):
        at = 0
        while True:
            at += int(torch.randint(doc // 2, doc + doc // 2 + 1, (1,), generator=g))
            if at > s:
                break
            tokens[row, at - 1] = vocab - 1
    return tokens.to(device)


def build_model(c: Dict, device: torch.device, dtype: str) -> GPTModel:
    cfg = ModelConfig(
        num_layers=c["layers"],
        hidden_size=c["hidden"],
        num_attention_heads=c["heads"],
        num_query_groups=c["groups"],
        seq_length=max(c["steps"]),
        vocab_size=c["vocab"],
        position_embedding_type="rope",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
    )
    ps = ParallelState.single(device)
    return GPTModel(cfg, ps, RNGTracker(1, 0, 0, device), 1).to(device)


def step_fn(model: GPTModel, tokens: torch.Tensor, packed: bool, vocab: int) -> Callable[[], None]:
    """Forward + backward of one micro-batch; packed: the document fields rebuilt (fresh tensors) each call."""
    labels = torch.roll(tokens, -1, dims=1)
    ones = torch.ones(tokens.shape, device=tokens.device)

    def run() -> None:
        batch = {"tokens": tokens, "labels": labels, "loss_mask": ones}
        kw = {}
        if packed:
            batch = add_document_fields(batch, vocab - 1, True, True, True)
            kw = {"position_ids": batch["position_ids"], "segment_ids": batch["segment_ids"]}
        logits = model(tokens, **kw)
        model.loss(logits, labels, batch["loss_mask"]).backward()
        model.zero_grad(set_to_none=True)

    return run


def table_steps(c: Dict, model: GPTModel, device) -> None:
    print("\n1. training step (forward + backward), packed documents over causal")
    print(f"{'seq':>7} {'mbs':>4} {'causal ms':>10} {'packed ms':>10} {'packed/causal':>14} {'peak GiB':>9}")
    for s in c["steps"]:
        tokens = doc_tokens(c["mbs"], s, c["vocab"], c["doc"], device)
        causal = timed_ms(step_fn(model, tokens, False, c["vocab"]), device, c["iters"])
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        packed = timed_ms(step_fn(model, tokens, True, c["vocab"]), device, c["iters"])
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        print(f"{s:>7} {c['mbs']:>4} {causal:>10.1f} {packed:>10.1f} {packed / causal:>14.2f} {peak:>9.1f}")
        del tokens
        _free(device)


def _qkv(b: int, nq: int, nkv: int, s: int, dtype, device, seed: int = 0) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, s, 64, generator=g).to(device, dtype).requires_grad_() for n in (nq, nkv, nkv)]


def fwd_bwd(attend: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        out = attend(*inputs)
        torch.autograd.grad(out, inputs, torch.ones_like(out))

    return run


def _sdpa_flash(causal: bool):
    """SDPA restricted to the flash backend where this torch can restrict it."""

    def attend(q, k, v):
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            ctx = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if q.is_cuda else _null()
        except ImportError:
            ctx = _null()
        with ctx:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return attend


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _flex(seg: torch.Tensor, s: int, device):
    """flex_attention with a causal document block mask (compiled), or the reason it cannot run."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        return None, f"n/a ({e})"
    if device.type != "cuda":
        return None, "n/a (compiled flex_attention needs CUDA here)"
    compiled = torch.compile(flex_attention)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (seg[b, q_idx] == seg[b, kv_idx])

    mask = create_block_mask(mask_mod, seg.shape[0], None, s, s, device=device)
    return (lambda q, k, v: compiled(q, k, v, block_mask=mask, enable_gqa=True)), ""


def _flex_ms(seg, s: int, device, iters: int, inputs):
    """flex_attention's fwd+bwd ms, or why it did not run (a failure here does not stop the script)."""
    try:
        flex, why = _flex(seg, s, device)
        return timed_ms(fwd_bwd(flex, *inputs), device, iters) if flex else why
    except Exception as e:  # noqa: BLE001 - compile and kernel errors vary by torch version
        return f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:80]})"


def table_attention(c: Dict, device, dtype, backend: str) -> None:
    b, nq, nkv, s = 2, c["heads"], c["groups"], c["attn_s"]
    print(f"\n2. attention fwd+bwd: b {b}, {nq} heads, {nkv} query groups, d 64, s {s}, ~{c['doc']}-token documents")
    q, k, v = _qkv(b, nq, nkv, s, dtype, device)
    rep = nq // nkv
    kx, vx = (t.detach().repeat_interleave(rep, 1).requires_grad_() for t in (k, v))  # SDPA: MHA, same FLOPs
    seg = add_document_fields(
        {"tokens": doc_tokens(b, s, 1000, c["doc"], device), "labels": None, "loss_mask": None}, 999, False, True, False
    )["segment_ids"]
    idx = torch.arange(s, device=device)
    flash = timed_ms(fwd_bwd(_sdpa_flash(True), q, kx, vx), device, c["iters"])
    rows = [("SDPA flash, causal (no documents)", flash)]
    for name, be in (
        (f"megalite packed, {kernel_name(backend, q)}", backend),
        ("megalite packed, fp32 tiles", "unfused"),
    ):
        run = fwd_bwd(
            lambda q_, k_, v_, be=be: context_parallel_attention(q_, k_, v_, ONE, "p2p", idx, seg, backend=be), q, k, v
        )
        rows.append((name, timed_ms(run, device, max(2, c["iters"] // 3))))
    rows.append(("flex_attention, document block mask", _flex_ms(seg, s, device, c["iters"], (q, k, v))))
    print(f"{'kernel':<52} {'ms':>9} {'/ flash':>8}")
    for name, ms in rows:
        print(f"{name:<52} {ms:>9.2f} {ms / flash:>8.2f}" if isinstance(ms, float) else f"{name:<52} {ms}")
    _free(device)


def kernel_name(backend: str, q: torch.Tensor) -> str:
    kernel = kernel_for(backend, q)
    return "fp32 tiles (no kernel)" if kernel is None else kernel.name.split(" (")[0]


def _block(kernel, c_len: int, past: bool, seg: Optional[torch.Tensor], inputs) -> Callable[[], None]:
    """fwd+bwd of one ring kernel call: the causal diagonal chunk [c, 2c) or queries [c, 2c) over keys [0, c)."""
    q_runs = [(0, c_len, c_len)]
    k_runs = [(0, 0, c_len)] if past else q_runs
    segs = varlen.plans(q_runs, k_runs, seg, 2 * c_len, inputs[0].shape[0], inputs[0].device)
    return fwd_bwd(lambda q, k, v: varlen.VarlenAttention.apply(q, k, v, kernel, segs), *inputs)


def table_cp(c: Dict, device, dtype, backend: str) -> None:
    s = c["cp_s"]
    print(f"\n3. CP ring kernel calls at seq {s}, b 1, {c['heads']} heads, {c['groups']} groups, d 64 (fwd+bwd)")
    print(f"{'cp':>3} {'chunk':>6} {'call':<10} {'documents':<10} {'megalite ms':>12} {'flash ms':>9} {'ratio':>6}")
    seg_full = add_document_fields(
        {"tokens": doc_tokens(1, s, 1000, c["doc"], device), "labels": None, "loss_mask": None}, 999, False, True, False
    )["segment_ids"]
    for cp in (2, 4, 8):
        n = s // (2 * cp)
        q, k, v = _qkv(1, c["heads"], c["groups"], n, dtype, device)
        kernel = kernel_for(backend, q)
        if kernel is None:
            print(f"{cp:>3} {n:>6} no varlen kernel on this device/dtype: the ring runs fp32 tiles")
            continue
        rep = c["heads"] // c["groups"]
        kx, vx = (t.detach().repeat_interleave(rep, 1).requires_grad_() for t in (k, v))
        for past in (False, True):
            flash = timed_ms(fwd_bwd(_sdpa_flash(not past), q, kx, vx), device, c["iters"])
            for docs in (None, seg_full[:, : 2 * n]):
                ms = timed_ms(_block(kernel, n, past, docs, (q, k, v)), device, c["iters"])
                call = "past" if past else "diagonal"
                label = "none" if docs is None else f"~{c['doc']}"
                print(f"{cp:>3} {n:>6} {call:<10} {label:<10} {ms:>12.2f} {flash:>9.2f} {ms / flash:>6.2f}")
        del q, k, v, kx, vx
        _free(device)


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _fits(model: GPTModel, c: Dict, s: int, device) -> bool:
    """Whether one packed step of mbs 1 at seq ``s`` runs without running out of memory; the try's
    memory is freed (its frame gone) before the next one starts."""
    ok = _try_step(model, c, s, device)
    model.zero_grad(set_to_none=True)
    _free(device)
    return ok


def _try_step(model: GPTModel, c: Dict, s: int, device) -> bool:
    try:
        step_fn(model, doc_tokens(1, s, c["vocab"], c["doc"], device), True, c["vocab"])()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return True
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError is a RuntimeError; so are some allocators' reports
        if "out of memory" not in str(e).lower():
            raise
    return False


def table_longest(c: Dict, model: GPTModel, device, budget_s: float) -> None:
    unit, cap = c["search"]
    print(f"\n4. longest packed sequence (mbs 1, forward + backward) on this device, in steps of {unit}")
    t0 = time.perf_counter()
    good, bad = 0, None
    s = unit
    while s <= cap and time.perf_counter() - t0 < budget_s:  # doubling until a try fails
        if not _fits(model, c, s, device):
            bad = s
            break
        good, s = s, 2 * s
    while bad is not None and bad - good > unit and time.perf_counter() - t0 < budget_s:  # then bisection
        mid = (good + bad) // 2 // unit * unit
        good, bad = (mid, bad) if _fits(model, c, mid, device) else (good, mid)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        where = f"{torch.cuda.get_device_name(device)}, {total:.0f} GiB"
    else:
        where = "CPU (no memory limit: capped)"
    limit = "no try failed up to the cap" if bad is None else f"seq {bad} ran out of memory"
    late = " (time budget spent)" if time.perf_counter() - t0 >= budget_s else ""
    print(f"longest: {good} tokens on {where}; {limit}{late}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU (checks the script runs)")
    ap.add_argument("--backend", default="auto", help="--attention-backend for the megalite rows (default auto)")
    ap.add_argument("--search-seconds", type=float, default=100.0, help="time budget of the longest-sequence search")
    ap.add_argument("--skip", default="", help="comma-separated tables to skip: step,attention,cp,longest")
    a = ap.parse_args()
    c = SMOKE if a.cpu_smoke else FULL
    if not a.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --cpu-smoke")
    device = torch.device("cpu" if a.cpu_smoke else "cuda")
    dtype = torch.float32 if a.cpu_smoke else torch.bfloat16
    backend = "reference" if a.cpu_smoke else a.backend
    skip = set(filter(None, a.skip.split(",")))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}")
    print(describe(a.backend, device, dtype, 64))
    t0 = time.perf_counter()
    model = build_model(c, device, "float32" if a.cpu_smoke else "bfloat16")
    if "step" not in skip:
        table_steps(c, model, device)
    if "attention" not in skip:
        table_attention(c, device, dtype, backend)
    if "cp" not in skip:
        table_cp(c, device, dtype, backend)
    if "longest" not in skip:
        table_longest(c, model, device, a.search_seconds)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
