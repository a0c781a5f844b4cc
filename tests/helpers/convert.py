"""Checkpoint conversion in the tests: tools/checkpoint/convert.py in this process (``convert``) and in a
fresh interpreter (``run_convert``), trainers of the two styles to convert, their state and logits, and
Megatron-LM's own fixture files (tests/fixtures/megatron_lm)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

from megalite.checkpointing import load_checkpoint
from megalite.checkpointing.run import RunParts
from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from tests.helpers import REPO
from tests.helpers.parity import GPT2_STYLE, LLAMA_STYLE, tiny_config

_spec = importlib.util.spec_from_file_location("convert_cli", REPO / "tools" / "checkpoint" / "convert.py")
convert_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert_cli)
VOCAB = 250
# larger weights than training's init so logits and greedy choices are far from ties
STYLES = {
    "gpt2": dict(GPT2_STYLE, init_method_std=0.3),
    "llama": dict(LLAMA_STYLE, init_method_std=0.3),
}  # llama: GQA (2 groups for 4 heads), untied
FIXTURES = REPO / "tests" / "fixtures" / "megatron_lm"


def convert_argv(loader, saver, src, dst, *extra) -> list:
    """tools/checkpoint/convert.py's arguments for one conversion of ``src`` into ``dst``."""
    return ["--model-type", "GPT", "--loader", loader, "--saver", saver, "--load-dir", str(src),
            "--save-dir", str(dst), *map(str, extra)]  # fmt: skip


def convert(loader, saver, src, dst, *extra) -> int:
    return convert_cli.main(convert_argv(loader, saver, src, dst, *extra))


def make_trainer(style: str, **model) -> Trainer:
    cfg = tiny_config(STYLES[style])
    return Trainer(cfg.with_(model=replace(cfg.model, **model)), ParallelState.single())


def parts(t: Trainer) -> RunParts:
    """The run objects save_checkpoint and load_checkpoint take (one bundle)."""
    return t.run_parts


def state(trainer: Trainer) -> dict:
    return {k: v.clone() for k, v in trainer.chunks[0].state_dict().items()}


def loaded(style: str, root, **model) -> Trainer:
    t = make_trainer(style, **{"init_method_std": 0.01, **model})  # other weights: the load must replace them all
    load_checkpoint(parts(t), str(root), finetune=True)
    return t


def megalite_logits(trainer: Trainer, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return trainer.chunks[0].eval()(ids).transpose(0, 1)[..., :VOCAB]  # [b, s, V] without the padding


def run_convert(loader: str, saver: str, src, dst, *extra) -> subprocess.CompletedProcess:
    """tools/checkpoint/convert.py in a fresh interpreter (nothing this process imported can help it)."""
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "checkpoint" / "convert.py"),
            "--model-type",
            "GPT",
            "--loader",
            loader,
            "--saver",
            saver,
            "--load-dir",
            str(src),
            "--save-dir",
            str(dst),
            *map(str, extra),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _convert(*args) -> subprocess.CompletedProcess:
    """``tools/checkpoint/convert.py --model-type GPT *args`` in a fresh interpreter (the flags as given)."""
    return subprocess.run(
        [sys.executable, "tools/checkpoint/convert.py", "--model-type", "GPT", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _differences(ours: dict, theirs: dict) -> list:
    """Keys whose tensors differ; vocabulary tables compare their real rows, and our padding must be zero."""
    bad = sorted(set(ours) ^ set(theirs))
    for k, v in theirs.items():
        b = ours.get(k)
        if v is None or b is None:
            bad += [] if v is None and b is None else [k]
        elif k.endswith(("word_embeddings.weight", "output_layer.weight")):
            bad += [] if b.shape == v.shape and torch.equal(b[:VOCAB], v[:VOCAB]) and not b[VOCAB:].any() else [k]
        elif not torch.equal(b, v):
            bad.append(k)
    return bad


def unpack_tp2pp2(root: Path) -> Path:
    """tp2pp2_torch_dist.tar.xz unpacked: {untied,tied}/ckpt (dp_reshardable) and /ckpt_full (fully_reshardable)."""
    import tarfile

    with tarfile.open(FIXTURES / "tp2pp2_torch_dist.tar.xz") as tar:
        tar.extractall(root, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return root


def _megatron_model_space_state(d: Path, cfg) -> dict:
    """What Megatron-LM's own fully_reshardable save holds per parameter, read with plain DCP (none of megalite's
    readers), in megalite's names and layout."""
    import torch.distributed.checkpoint as dcp

    from megalite.interop.interchange import layer_names, post_names, pre_names
    from megalite.interop.megatron import megatron_name, qkv_from_megatron

    reader = dcp.FileSystemReader(str(d))
    md = reader.read_metadata().state_dict_metadata
    want = {
        k: torch.empty(tuple(md[k].size), dtype=md[k].properties.dtype) for k in md if k.startswith("optimizer.state.")
    }
    dcp.load(want, storage_reader=reader, no_dist=True)
    out = {}
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        for n in pre_names(cfg) + post_names(cfg):
            rows = cfg.vocab_size if n.endswith(("word_embeddings.weight", "output_layer.weight")) else None
            out.setdefault(n, {})[kind] = want[f"optimizer.state.{kind}.{n}"][:rows]
        for rel in layer_names(cfg):
            stacked = want[f"optimizer.state.{kind}.decoder.layers.{megatron_name(rel, True)}"]
            for i in range(cfg.num_layers):
                t = qkv_from_megatron(cfg, stacked[i]) if ".linear_qkv." in rel else stacked[i]
                out.setdefault(f"decoder.layers.{i}.{rel}", {})[kind] = t
    return out
