"""A model written as Megatron-Core's torch_dist checkpoint (convert.py --saver megatron --target-format torch_dist).

The files are those ``megatron.core.dist_checkpointing.save`` writes for a GPTModel
of the local transformer spec (torch_dist.py describes them): the stacked layer
tensors are written one layer at a time, each as its own torch.distributed.checkpoint
file whose block sits at [i] of the stacked tensor, and the indexes are merged at
the end, so memory holds one layer. ``common.pt`` holds the ``args`` a Megatron-LM
run of this model and target layout would store (vocabulary padded for its tp).
No optimizer or RNG state: Megatron-LM loads it with ``--finetune`` (or
``--no-load-optim --no-load-rng``), megatron-core with ``dist_checkpointing.load``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import shutil
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

from megalite.checkpointing.safe_load import CheckpointError, SafeFileSystemReader
from megalite.checkpointing.sharded import quiet_single_process
from megalite.interop.interchange import OUTPUT, WORD, Layout, ModelSource, layer_names
from megalite.interop.megatron import LATEST, LINEARS, args_for, megatron_name, qkv_to_megatron
from megalite.interop.torch_dist import COMMON, CONFIG, STACKED

# (tensor, global shape, offsets of the block) or the plain object a ShardedObject holds
Entry = Tuple[torch.Tensor, Tuple[int, ...], Tuple[int, ...]]


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros(rows, *t.shape[1:], dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


class _Merger:
    """Collects the DCP files of each written group into one checkpoint directory and index."""

    def __init__(self, d: str):
        self.d, self.count = d, 0
        self.md = None
        self.tensors: Dict[str, TensorStorageMetadata] = {}
        self.storage: Dict[MetadataIndex, object] = {}
        self.others: Dict[str, object] = {}

    def add(self, tensors: Dict[str, Entry], objects: Dict[str, object]) -> None:
        part = os.path.join(self.d, f".part{self.count}")
        state = {k: t.contiguous() for k, (t, _, _) in tensors.items()}
        state.update(objects)  # written as torch.save(obj) bytes, as megatron-core stores a ShardedObject
        with quiet_single_process():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(part), no_dist=True)
        md = SafeFileSystemReader(part).read_metadata()
        files = {info.relative_path for info in md.storage_data.values()}
        if len(files) != 1:
            raise CheckpointError(f"unexpected torch.distributed.checkpoint output in {part}: {sorted(files)}")
        fname = f"__0_{self.count}.distcp"
        os.replace(os.path.join(part, files.pop()), os.path.join(self.d, fname))
        shutil.rmtree(part)
        for key, meta in md.state_dict_metadata.items():
            if key not in tensors:
                self.others[key] = meta
                continue
            t, shape, offsets = tensors[key]
            entry = self.tensors.setdefault(key, TensorStorageMetadata(meta.properties, torch.Size(shape), []))
            entry.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(t.shape)))
        for idx, info in md.storage_data.items():
            info = dataclasses.replace(info, relative_path=fname)
            if idx.fqn in tensors:  # the block's place in the global tensor, not 0
                offsets = tensors[idx.fqn][2]
                idx = MetadataIndex(idx.fqn, torch.Size(offsets), len(self.tensors[idx.fqn].chunks) - 1)
            self.storage[idx] = info
        self.md = md
        self.count += 1

    def finish(self) -> None:
        md = self.md
        md.state_dict_metadata = {**self.tensors, **self.others}
        md.storage_data, md.planner_data = self.storage, None
        if hasattr(md, "storage_meta"):
            md.storage_meta = None
        with open(os.path.join(self.d, ".metadata"), "wb") as f:
            pickle.dump(md, f)


def _layer_entries(source: ModelSource, i: int, te_names: bool) -> Tuple[Dict[str, Entry], Dict[str, object]]:
    cfg, n = source.cfg, source.cfg.num_layers
    full = source.layer(i)
    tensors = {}
    for rel in layer_names(cfg):
        t = full[rel]
        if ".linear_qkv." in "." + rel:
            t = qkv_to_megatron(cfg, t)
        key = STACKED + megatron_name(rel, te_names)
        tensors[key] = (t.unsqueeze(0), (n,) + tuple(t.shape), (i,) + (0,) * t.dim())
    objects = {f"{STACKED}{m}._extra_state/shard_{i}_{n}": [None] for m in LINEARS}
    return tensors, objects


def save_torch_dist(
    source: ModelSource,
    out: str,
    layout: Layout,
    tokenizer: Dict[str, Optional[str]],
    progress: Callable[[str], None],
    base_args: Optional[argparse.Namespace] = None,
) -> None:
    """Write ``source`` under ``out`` as Megatron-LM's ``--ckpt-format torch_dist`` saves it (weights only)."""
    cfg, it = source.cfg, source.info.iteration
    ns = args_for(cfg, layout, tokenizer, base_args)
    ns.ckpt_format = "torch_dist"
    rows = cfg.padded_vocab_size(layout.tp)
    d = os.path.join(out, f"iter_{it:07d}")
    os.makedirs(d)
    merger = _Merger(d)
    pre = source.pre()
    merger.add(
        {
            k: (
                (_padded(t, rows) if k == WORD else t),
                (rows,) + tuple(t.shape[1:]) if k == WORD else tuple(t.shape),
                (0,) * t.dim(),
            )
            for k, t in pre.items()
        },
        {},
    )
    progress("embeddings")
    for i in range(cfg.num_layers):
        # the names megatron-core's sharded state dict gives the local spec's norms (transformer_engine's)
        merger.add(*_layer_entries(source, i, te_names=True))
        progress(f"layer {i}")
    post = source.post()
    merger.add(
        {
            k: (
                (_padded(t, rows) if k == OUTPUT else t),
                (rows,) + tuple(t.shape[1:]) if k == OUTPUT else tuple(t.shape),
                (0,) * t.dim(),
            )
            for k, t in post.items()
        },
        {},
    )
    progress("final norm and head")
    merger.finish()
    torch.save(
        {"args": ns, "checkpoint_version": 3.0, "iteration": it, "num_floating_point_operations_so_far": 0},
        os.path.join(d, COMMON),
    )
    with open(os.path.join(d, CONFIG), "w") as f:  # last: its presence marks the checkpoint complete
        json.dump(
            {
                "sharded_backend": "torch_dist",
                "sharded_backend_version": 1,
                "common_backend": "torch",
                "common_backend_version": 1,
            },
            f,
        )
    with open(os.path.join(out, LATEST), "w") as f:
        f.write(str(it))
