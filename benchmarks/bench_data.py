#!/usr/bin/env python
"""Data pipeline benchmark: preprocessing throughput / peak memory, index build times.

Builds its corpus offline from text every Python install has: pydoc's topic
documentation and the .py sources under sys.prefix (stdlib first, then
site-packages, cycled if needed), one document per file. The tokenizer is the
default corpus's 4k byte-level BPE. Each preprocessing run happens in a fresh
subprocess so its peak RSS (parent and worker processes) can be read.

  python benchmarks/bench_data.py                 # full run (50 MB, 10 vs 100 MB, 1M/10M docs)
  python benchmarks/bench_data.py --only indices  # index build (1M, 10M, 10M x 3 epochs documents)
                                                  # vs megatron-core's builder, when installed
  python benchmarks/bench_data.py --quick         # 1/25 of the sizes, for a smoke test
  python benchmarks/bench_data.py --only megatron --megatron-lm ~/Megatron-LM --megatron-mb 5
                                                  # vs Megatron-LM's own tool, same corpus

The index build section times megalite's document, sample and shuffle index build
against megatron-core's (``pip install megatron-core``: the PyPI wheel ships the compiled
``megatron.core.datasets.helpers_cpp``, nothing to compile) on the same synthetic documents,
and checks that the arrays are byte-identical.

The Megatron comparison runs Megatron-LM's tools/preprocess_data.py from a checkout
(core_v0.16.x) with its own GPT-2 BPE (--legacy-tokenizer: the default GPT2BPETokenizer
of that release loads the "gpt2" config from the Hugging Face Hub) on the same corpus,
vocabulary and --workers, times both tools as whole processes, and checks that the two
.bin/.idx pairs are byte-identical. Megatron-LM imports triton at import time through
megatron.training; on a machine without it, that one module is stubbed by the runner
below (nothing in preprocessing uses it).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from common import REPO  # first: puts the repository on sys.path

from megalite.data.blended_dataset import build_blending_indices
from megalite.data.default_corpus import prepare_default_corpus


def source_files():
    """Offline real text: pydoc topics, then .py files under sys.prefix."""
    from pydoc_data.topics import topics

    for k in sorted(topics):
        yield topics[k]
    for root in sorted(Path(sys.prefix).rglob("*.py")):
        try:
            yield root.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue


def build_corpus(path: Path, megabytes: float, pool_megabytes: float | None = None) -> int:
    """Write a jsonl of at least ``megabytes`` MB; return its size in bytes.

    With ``pool_megabytes``, only the first that many MB of sources are used,
    cycled: corpora of different sizes then share one document-size
    distribution, so a memory comparison measures growth with input size
    rather than the largest file met.
    """
    target, written = int(megabytes * 1e6), 0
    pool_limit = pool_megabytes * 1e6 if pool_megabytes else float("inf")
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            pooled = 0
            for text in source_files():
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                written += len(line.encode("utf-8"))
                pooled += len(line)
                if written >= target or pooled >= pool_limit:
                    break
    return written


_CHILD = """
import json, resource, sys
sys.path.insert(0, {repo!r})
from megalite.config import DataConfig
from megalite.data.preprocess import PreprocessOptions, preprocess
tok = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file={vocab!r}, merge_file={merge!r})
s = preprocess(PreprocessOptions(input={inp!r}, output_prefix={out!r}, tokenizer=tok,
                                 append_eod=True, workers={workers}, log_interval=0))
me = resource.getrusage(resource.RUSAGE_SELF)
kids = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps(dict(seconds=s.seconds, bytes=s.bytes_read, tokens=sum(s.tokens.values()),
                      docs=s.lines, rss_main_mb=me.ru_maxrss / 1024,
                      rss_worker_mb=kids.ru_maxrss / 1024, cpu_main=me.ru_utime + me.ru_stime,
                      cpu_workers=kids.ru_utime + kids.ru_stime)))
"""


def run_preprocess(inp: Path, out: Path, tok: dict, workers: int) -> dict:
    code = _CHILD.format(
        repo=str(REPO), vocab=tok["vocab_file"], merge=tok["merge_file"], inp=str(inp), out=str(out), workers=workers
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def bench_preprocess(tmp: Path, tok: dict, throughput_mb: float, memory_mb: tuple) -> None:
    print(
        f"\n## Preprocessing (GPT2BPETokenizer 4k vocab, --append-eod), {os.cpu_count()} CPUs,"
        f" load average {os.getloadavg()[0]:.1f} at start"
    )
    print("| input | workers | docs | seconds | MB/s | tokens/s | CPU s main / workers | peak RSS main / worker (MB) |")
    print("|---|---|---|---|---|---|---|---|")
    corpora = {("all", throughput_mb): tmp / "corpus_throughput.jsonl"}
    build_corpus(corpora["all", throughput_mb], throughput_mb)
    for mb in memory_mb:  # same documents, cycled: only the input size differs
        corpora["pool", mb] = tmp / f"corpus_pool_{mb:g}MB.jsonl"
        build_corpus(corpora["pool", mb], mb, pool_megabytes=min(memory_mb))
    runs = [("all", throughput_mb, 1), ("all", throughput_mb, 2)]
    runs += [("pool", mb, w) for mb in memory_mb for w in (1, 2)]
    for kind, mb, workers in runs:
        r = run_preprocess(corpora[kind, mb], tmp / "out", tok, workers)
        label = "sources" if kind == "all" else f"first {min(memory_mb):g} MB, cycled"
        print(
            f"| {r['bytes'] / 1e6:.0f} MB ({label}) | {workers} | {r['docs']} | "
            f"{r['seconds']:.1f} | "
            f"{r['bytes'] / 1e6 / r['seconds']:.2f} | {r['tokens'] / r['seconds']:,.0f} | "
            f"{r['cpu_main']:.1f} / {r['cpu_workers']:.1f} | "
            f"{r['rss_main_mb']:.0f} / {r['rss_worker_mb']:.0f} |",
            flush=True,
        )


_MEGATRON_RUNNER = """
import runpy, sys, types
name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
try:
    import triton  # noqa: F401
except ImportError:  # imported by megatron.training at import time, unused by preprocessing
    stub = types.ModuleType(name)
    def _attr(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return lambda *a, **k: None
    stub.__getattr__ = _attr
    sys.modules[name] = stub
tool = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(tool, run_name="__main__")
"""


def _timed(cmd: list, env: dict | None = None, cwd: Path | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def _tool_commands(megatron_lm: Path, runner: Path, tok: dict, inp: Path, out: Path, workers: int) -> tuple[list, list]:
    common = [
        "--input",
        str(inp),
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        tok["vocab_file"],
        "--merge-file",
        tok["merge_file"],
        "--append-eod",
        "--workers",
        str(workers),
    ]
    ours = [
        sys.executable,
        str(REPO / "tools" / "preprocess_data.py"),
        *common,
        "--output-prefix",
        str(out / "megalite"),
        "--log-interval",
        "0",
    ]
    theirs = [
        sys.executable,
        str(runner),
        str(megatron_lm / "tools" / "preprocess_data.py"),
        *common,
        "--output-prefix",
        str(out / "megatron"),
        "--legacy-tokenizer",
        "--log-interval",
        "100000000",
    ]
    return ours, theirs


def bench_vs_megatron(tmp: Path, tok: dict, megatron_lm: Path, megabytes: float, workers_list: list[int]) -> None:
    print(
        f"\n## Preprocessing vs Megatron-LM's tools/preprocess_data.py ({megatron_lm}), "
        f"GPT2BPETokenizer 4k vocab, --append-eod, {megabytes:g} MB, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f} at start"
    )
    print(
        "| workers | megalite s | Megatron s | speedup | startup s megalite / Megatron "
        "| speedup after startup | identical .bin/.idx |"
    )
    print("|---|---|---|---|---|---|---|")
    runner = tmp / "run_megatron_tool.py"
    runner.write_text(_MEGATRON_RUNNER)
    env = {**os.environ, "PYTHONPATH": str(megatron_lm)}
    corpus, tiny = tmp / "corpus_vs_megatron.jsonl", tmp / "one_line.jsonl"
    build_corpus(corpus, megabytes)
    tiny.write_text(json.dumps({"text": "startup only"}) + "\n")
    for workers in workers_list:
        out = tmp / f"vs_megatron_w{workers}"
        out.mkdir()
        startup = []
        for inp in (tiny, corpus):  # the one-line run measures each tool's start-up cost
            ours, theirs = _tool_commands(megatron_lm, runner, tok, inp, out, workers)
            startup.append((_timed(ours), _timed(theirs, env=env, cwd=out)))
        (s_ours, s_theirs), (t_ours, t_theirs) = startup
        same = all(
            (out / f"megalite_text_document{e}").read_bytes() == (out / f"megatron_text_document{e}").read_bytes()
            for e in (".bin", ".idx")
        )
        net = (t_theirs - s_theirs) / max(t_ours - s_ours, 1e-9)
        print(
            f"| {workers} | {t_ours:.1f} | {t_theirs:.1f} | {t_theirs / t_ours:.1f}x | "
            f"{s_ours:.1f} / {s_theirs:.1f} | {net:.1f}x | {'yes' if same else 'NO'} |",
            flush=True,
        )


_INDEX_CHILD = """
import gc, hashlib, json, sys, time
sys.path.insert(0, {repo!r})
import numpy as np
from megalite.data.gpt_dataset import (build_shuffle_index, num_epochs_needed,
                                       num_samples_built, sample_index_dtype,
                                       sample_index_from_sizes, separate_final_epoch,
                                       shuffled_documents)
n, seq, epochs, builder, repeats = {n}, {seq}, {epochs}, {builder!r}, {repeats}
sizes = np.random.default_rng(0).lognormal(6.0, 1.0, n).astype(np.int32) + 1
documents = np.arange(n, dtype=np.int32)
tokens = int(sizes.sum(dtype=np.int64))
per_epoch = num_samples_built(tokens, seq, 1)
# several epochs: the last one only 10% used, so shuffled on its own (Megatron's rule)
num_samples = per_epoch if epochs == 1 else num_samples_built(tokens, seq, epochs - 1) + per_epoch // 10
num_epochs = num_epochs_needed(tokens, seq, num_samples)
separate = separate_final_epoch(tokens, seq, num_samples, num_epochs)
total = num_samples_built(tokens, seq, num_epochs)
first = num_samples_built(tokens, seq, num_epochs - 1) if separate else total
if builder == "megatron-core":  # as its GPTDataset builds them
    from megatron.core.datasets import helpers
    from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index

    def build(rng, lap):
        doc_index = _build_document_index(documents, num_epochs, rng, separate)
        lap()
        sample_index = helpers.build_sample_idx(sizes, doc_index, seq, num_epochs, tokens,
                                                True, True)
        lap()
        shuffle_index = _build_shuffle_index(first, total, rng)
        lap()
        return doc_index, sample_index, shuffle_index
else:  # as GPTDataset builds them
    def build(rng, lap):
        pairs = shuffled_documents(documents, sizes, num_epochs, rng, separate)
        lap()
        dtype = sample_index_dtype(int(sizes.max()), len(pairs))
        sample_index = sample_index_from_sizes(pairs[:, 1], seq, dtype)
        doc_index = pairs[:, 0].copy()  # (counted with the sample index)
        del pairs
        lap()
        shuffle_index = build_shuffle_index(first, total, rng)
        lap()
        return doc_index, sample_index, shuffle_index


def rss_kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


gc.collect()
try:  # reset the peak RSS (Linux >= 4.0), so the data generation above does not count
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
base = rss_kb("VmRSS:")
best, digest = None, None
for _ in range(repeats):
    times, clock, wall = [], [time.process_time()], time.perf_counter()

    def lap():
        times.append(time.process_time() - clock[0])
        clock[0] = time.process_time()
    arrays = build(np.random.RandomState(1234), lap)
    times.append(time.perf_counter() - wall)
    best = times if best is None else [min(x, y) for x, y in zip(best, times)]
    digest = [hashlib.md5(str((a.dtype.str, a.shape)).encode() + a.tobytes()).hexdigest()
              for a in arrays]
    del arrays
    gc.collect()
print(json.dumps(dict(seconds=best, peak_mb=(rss_kb("VmHWM:") - base) / 1024, md5=digest,
                      samples=total, epochs=num_epochs, separate=separate)))
"""


def _index_child(builder: str, n: int, seq: int, epochs: int, repeats: int) -> dict:
    code = _INDEX_CHILD.format(repo=str(REPO), n=n, seq=seq, epochs=epochs, builder=builder, repeats=repeats)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{builder} index build failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _have_megatron_core() -> bool:
    try:
        with warnings.catch_warnings():  # megatron.core's import warns about optional kernels
            warnings.simplefilter("ignore")
            importlib.import_module("megatron.core.datasets.helpers")  # its compiled helpers_cpp
    except Exception:  # noqa: BLE001 - absent, or present without its compiled helpers
        return False
    return True


def bench_indices(cases: list[tuple[int, int]], seq_length: int = 2048, repeats: int = 3) -> None:
    """Document, sample and shuffle index build, megalite vs megatron-core, on the same data.

    megatron-core's side is what its GPTDataset runs: _build_document_index (numpy),
    helpers.build_sample_idx (its compiled C++, shipped in the PyPI wheel) and
    _build_shuffle_index (numpy). Each builder runs in its own process (best of
    ``repeats``; peak RSS over the process's own baseline); the arrays' md5 must agree.
    """
    mcore = _have_megatron_core()
    print(
        f"\n## Index build vs megatron-core (seq_length {seq_length}, doc sizes ~ lognormal, "
        f"mean ~660 tokens; CPU seconds of the builder's process (one thread), best of "
        f"{repeats}, and the total's wall clock; load average {os.getloadavg()[0]:.1f} at start)"
    )
    if not mcore:
        print("(megatron-core with its compiled helpers is not installed: megalite only)")
    print("| documents | epochs | samples | index | megalite s | megatron-core s | speedup |")
    print("|---|---|---|---|---|---|---|")
    names = ("document_index", "sample_index", "shuffle_index")
    for n, epochs in cases:
        ours = _index_child("megalite", n, seq_length, epochs, repeats)
        theirs = _index_child("megatron-core", n, seq_length, epochs, repeats) if mcore else None
        label = f"{ours['epochs']}" + (" (last separate)" if ours["separate"] else "")
        rows = list(zip(names, ours["seconds"], theirs["seconds"] if theirs else [None] * 4))
        rows.append(("total", sum(ours["seconds"][:3]), sum(theirs["seconds"][:3]) if theirs else None))
        rows.append(("total, wall clock", ours["seconds"][3], theirs["seconds"][3] if theirs else None))
        rows.append(("peak RSS MB", ours["peak_mb"], theirs["peak_mb"] if theirs else None))
        for name, a, b in rows:
            fmt = "{:.0f}" if name.startswith("peak") else "{:.2f}"
            other = fmt.format(b) if b is not None else "-"
            ratio = f"{b / a:.2f}x" if b is not None and a > 0 else "-"
            if name.startswith("peak"):
                ratio = f"{a / b:.2f} of it" if b else "-"
            print(
                f"| {n:,} | {label} | {ours['samples']:,} | {name} | {fmt.format(a)} | {other} | {ratio} |", flush=True
            )
        if theirs is not None:
            same = ours["md5"] == theirs["md5"]
            print(f"| {n:,} | {label} | | arrays byte-identical | {'yes' if same else 'NO'} | | |", flush=True)


def bench_blending(sizes: list[int]) -> None:
    print("\n## Blending index (3 datasets, weights 0.5/0.3/0.2, pure Python greedy loop)")
    print("| samples | seconds |")
    print("|---|---|")
    for n in sizes:
        t0 = time.perf_counter()
        build_blending_indices([0.5, 0.3, 0.2], n)
        print(f"| {n:,} | {time.perf_counter() - t0:.2f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--only", choices=("preprocess", "indices", "megatron"), default=None)
    p.add_argument(
        "--megatron-lm",
        type=Path,
        default=None,
        help="a Megatron-LM checkout (core_v0.16.x): adds the comparison with its tools/preprocess_data.py",
    )
    p.add_argument("--megatron-mb", type=float, default=20.0, help="corpus size for the Megatron comparison (MB)")
    p.add_argument("--megatron-workers", type=int, nargs="+", default=[1, 2])
    args = p.parse_args()
    if args.only == "megatron" and args.megatron_lm is None:
        p.error("--only megatron needs --megatron-lm PATH (a Megatron-LM checkout)")
    if args.megatron_lm is not None and not (args.megatron_lm / "tools" / "preprocess_data.py").is_file():
        p.error(f"--megatron-lm {args.megatron_lm}: no tools/preprocess_data.py there")
    scale = 0.04 if args.quick else 1.0
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        tmp = Path(tmp)
        compare = args.megatron_lm is not None and args.only in (None, "megatron")
        tok = None
        if args.only in (None, "preprocess") or compare:
            tok = prepare_default_corpus(str(tmp / "tokenizer"))
        if args.only in (None, "preprocess"):
            bench_preprocess(tmp, tok, 50 * scale, (10 * scale, 100 * scale))
        if compare:
            bench_vs_megatron(tmp, tok, args.megatron_lm.resolve(), args.megatron_mb, args.megatron_workers)
        if args.only in (None, "indices"):
            bench_indices([(int(1_000_000 * scale), 1), (int(10_000_000 * scale), 1), (int(10_000_000 * scale), 3)])
            bench_blending([int(1_000_000 * scale)])


if __name__ == "__main__":
    main()
