"""Checkpoint conversion: time and peak memory of tools/checkpoint/convert.py, each direction.

    python benchmarks/bench_convert.py [--hidden 768 --layers 12 --vocab 32000] [--workdir DIR]

A Llama-style model (GQA, SwiGLU, untied; about 124M parameters at the defaults, fp32) is
written once as a megalite sharded checkpoint from random tensors; every conversion then
runs as its own process, and its peak resident memory (ru_maxrss of that process alone)
is printed next to the model's size and the memory of a process that only imports the
converter (python + torch), so the part the conversion itself holds can be read off.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
from common import REPO  # first: puts the repository on sys.path

from megalite.config import ModelConfig
from megalite.interop.interchange import Layout, ModelSource, SourceInfo, full_shape, layer_names, post_names, pre_names
from megalite.interop.native_io import save_sharded

# runs one command and reports that child's peak RSS (KiB on Linux)
_MEASURE = (
    "import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode;"
    " print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, rc)"
)


class RandomSource(ModelSource):
    """Random weights of the right shapes, one layer at a time."""

    def __init__(self, cfg: ModelConfig):
        self.cfg, self.info = cfg, SourceInfo(kind="random")

    def _make(self, names):
        return {n: torch.randn(full_shape(self.cfg, n)) * 0.02 for n in names}

    def pre(self):
        return self._make(pre_names(self.cfg))

    def layer(self, i):
        return self._make(layer_names(self.cfg))

    def post(self):
        return self._make(post_names(self.cfg))


def measure(args) -> tuple:
    """(seconds, peak MiB, exit status) of one command in its own process."""
    start = time.time()
    out = subprocess.run([sys.executable, "-c", _MEASURE, *args], capture_output=True, text=True, cwd=REPO)
    seconds = time.time() - start
    kib, rc = out.stdout.split()
    return seconds, int(kib) / 1024, int(rc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--workdir", default=None)
    a = p.parse_args()
    cfg = ModelConfig(
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=a.hidden // 64,
        num_query_groups=a.hidden // 64 // 3,
        ffn_hidden_size=int(a.hidden * 8 / 3) // 64 * 64,
        vocab_size=a.vocab,
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
        add_bias_linear=False,
        seq_length=2048,
    )
    work = a.workdir or tempfile.mkdtemp(prefix="bench_convert_")
    params = sum(
        torch.Size(full_shape(cfg, n)).numel() for n in pre_names(cfg) + post_names(cfg)
    ) + cfg.num_layers * sum(torch.Size(full_shape(cfg, n)).numel() for n in layer_names(cfg))
    torch.manual_seed(0)
    save_sharded(RandomSource(cfg), os.path.join(work, "megalite"), Layout(), {}, lambda _: None)
    layer_mib = sum(torch.Size(full_shape(cfg, n)).numel() for n in layer_names(cfg)) * 4 / 2**20
    emb_mib = cfg.vocab_size * cfg.hidden_size * 4 / 2**20
    tool = [sys.executable, "tools/checkpoint/convert.py", "--model-type", "GPT"]
    runs = [
        ("megalite -> hf", "megalite", "hf", "megalite", "hf", []),
        ("hf -> megalite", "hf", "megalite", "hf", "megalite_from_hf", []),
        ("megalite -> megatron", "megalite", "megatron", "megalite", "megatron", []),
        ("megatron -> megalite", "megatron", "megalite", "megatron", "megalite_from_megatron", []),
        (
            "reshard megalite -> megatron tp2 pp2",
            "megalite",
            "megatron",
            "megalite",
            "megatron_tp2pp2",
            ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"],
        ),
        (
            "reshard megatron tp2 pp2 -> megalite torch tp4 pp1",
            "megatron",
            "megalite",
            "megatron_tp2pp2",
            "megalite_tp4",
            ["--ckpt-format", "torch", "--target-tensor-parallel-size", "4", "--target-pipeline-parallel-size", "1"],
        ),
    ]
    _, base_mib, _ = measure(tool[:2] + ["--help"])  # imports everything, converts nothing
    print(
        f"model: {params / 1e6:.1f}M parameters fp32 = {params * 4 / 2**20:.0f} MiB "
        f"(one layer {layer_mib:.0f} MiB, one vocabulary table {emb_mib:.0f} MiB); "
        f"python + torch + converter imported: {base_mib:.0f} MiB peak"
    )
    print(f"{'direction':<52} {'time s':>7} {'peak MiB':>9} {'above import':>13}")
    for name, loader, saver, src, dst, extra in runs:
        cmd = tool + [
            "--loader",
            loader,
            "--saver",
            saver,
            "--load-dir",
            os.path.join(work, src),
            "--save-dir",
            os.path.join(work, dst),
            *extra,
        ]
        seconds, mib, rc = measure(cmd)
        status = "" if rc == 0 else f"  (exit {rc})"
        print(f"{name:<52} {seconds:>7.1f} {mib:>9.0f} {mib - base_mib:>13.0f}{status}")
    if a.workdir is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
