"""Megatron-Core's distributed checkpoints (Megatron-LM's default ``--ckpt-format torch_dist``): reading.

``megatron.core.dist_checkpointing`` writes one directory per iteration::

    iter_0000100/
      metadata.json          {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": ...}
      common.pt              everything that is not sharded: args (Namespace), iteration, checkpoint_version,
                             opt_param_scheduler, ...; read with the Megatron allow-list (safe_load.py)
      .metadata, __R_N.distcp  a torch.distributed.checkpoint of every ShardedTensor under its global key

The global tensors are layout-free (tp shards joined, pipeline stages and virtual
chunks numbered globally), under Megatron-Core's GPTModel names::

    embedding.word_embeddings.weight             [padded vocab, h] (padding rows after the vocabulary)
    decoder.layers.<module>.<param>              every layer stacked on a leading axis: [num_layers, ...]
        self_attention.linear_qkv.weight/bias    rows grouped per query group (megatron.py's qkv_from_megatron)
        self_attention.linear_qkv.layer_norm_*   input norm (also for the local spec: its sharded names
        mlp.linear_fc1.layer_norm_*              follow transformer_engine's); input_layernorm.* is accepted too
        mlp.linear_fc1.weight                    [gate; up] for SwiGLU, as megalite
        <linear>._extra_state/shard_<i>_<L>      bytes (torch.save([None]) for the local spec); not weights
    decoder.final_layernorm.*, output_layer.weight (untied only)

A layer is read as the slice [i] of each stacked tensor, so a converter holds one
layer at a time, and :func:`load_torch_dist_weights` gives each rank of a run
(``pretrain_gpt.py --load``) only its own blocks. The distributed optimizer's state
(``optimizer.distributed.dp_group_idx_<m>.*``, laid out by Megatron's gradient
buckets per model-parallel rank m in the default ``dp_reshardable`` mode, or
``optimizer.state.<key>.<weight key>`` with ``--dist-ckpt-optim-fully-reshardable``)
is read by torch_dist_optim.py where it maps exactly onto the saved weights;
otherwise weights load, Adam starts fresh (as ``--no-load-optim``), and the loader
says why.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megalite.checkpointing.layout import chunk_blocks
from megalite.checkpointing.run_state import SHAPE_FIELDS, check_model_shape
from megalite.checkpointing.safe_load import CheckpointError, SafeFileSystemReader, load_megatron_file
from megalite.checkpointing.sharded import quiet_single_process
from megalite.config import ModelConfig
from megalite.data_parallel.fsdp import DTensor
from megalite.interop.interchange import (
    OUTPUT,
    WORD,
    ModelSource,
    SourceInfo,
    check_tensors,
    full_shape,
    layer_names,
    post_names,
    pre_names,
)
from megalite.interop.megatron import LATEST, TOKENIZER_FIELDS, config_from_args, megatron_name, qkv_from_megatron
from megalite.interop.tokenizer_vocab import check_vocab_fits, megatron_vocab, with_tokenizer_files

CONFIG = "metadata.json"
COMMON = "common.pt"
STACKED = "decoder.layers."


def is_torch_dist(d: str) -> bool:
    """True when ``d`` is one iteration of a torch_dist checkpoint (its metadata.json says so)."""
    path = os.path.join(d, CONFIG)
    if not os.path.isfile(path):
        return False
    try:
        with open(path) as f:
            return json.load(f).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError):
        return os.path.exists(os.path.join(d, COMMON))  # a damaged config next to common.pt: still this format


def torch_dist_dir(root: str, step: Optional[int] = None) -> Optional[str]:
    """The torch_dist iteration directory ``root`` means (itself, ``--ckpt-step``, or what its
    latest_checkpointed_iteration.txt names, ``release`` included), or None when it is not one."""
    if is_torch_dist(root):
        return root
    if step is not None:
        d = os.path.join(root, f"iter_{step:07d}")
        return d if is_torch_dist(d) else None
    try:
        with open(os.path.join(root, LATEST)) as f:
            text = f.read().strip()
    except OSError:
        return None
    d = os.path.join(root, "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else "?")
    return d if is_torch_dist(d) else None


class _RegionPlanner(DefaultLoadPlanner):
    """Reads a region of each global tensor: ``state_dict[key]`` receives the block at ``offsets[key]``."""

    def __init__(self, offsets: Dict[str, Sequence[int]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.offsets = offsets

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, t in self.state_dict.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets[key]), sizes=t.shape)
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
        return LoadPlan(items)

    def resolve_tensor(self, read_item):
        t = self.state_dict[read_item.dest_index.fqn]
        for dim, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, o, n)
        return t


def _refuse_moe(ns: argparse.Namespace, root: str, d: str) -> None:
    """Refuse an MoE model in this format with its way round (CheckpointError): megalite reads Megatron's MoE
    from the legacy torch format, which Megatron-LM itself re-saves a torch_dist checkpoint into."""
    experts = getattr(ns, "num_experts", None)
    if not experts:
        return
    raise CheckpointError(
        f"{d} is a Megatron-Core torch_dist checkpoint of an MoE model (num_experts {experts}), which megalite "
        f"does not read in this format yet; have Megatron-LM re-save it in its legacy torch format (its "
        f"pretrain_gpt.py with the model's flags and --load {root} --ckpt-convert-format torch "
        f"--ckpt-convert-save DIR), then convert that checkpoint with tools/checkpoint/convert.py --model-type GPT "
        f"--loader megatron --saver megalite --load-dir <it> --save-dir OUT"
    )


class TorchDistSource(ModelSource):
    """A torch_dist checkpoint read layer by layer (any layout it was saved from)."""

    def __init__(
        self,
        root: str,
        true_vocab: Optional[int] = None,
        step: Optional[int] = None,
        tokenizer_files: Optional[dict] = None,
    ):
        d = torch_dist_dir(root, step)
        if d is None:
            raise CheckpointError(
                f"{root} is not a Megatron-Core torch_dist checkpoint (no metadata.json with "
                f"sharded_backend torch_dist in it or in the iteration it names)"
            )
        self.dir = d
        common = load_megatron_file(os.path.join(d, COMMON))
        ns = common.get("args") if isinstance(common, dict) else None
        if not isinstance(ns, argparse.Namespace):
            raise CheckpointError(
                f"{d}/{COMMON} stores no argparse Namespace 'args': the model's shape is not "
                f"recorded (it was not saved by Megatron-LM's training loop)"
            )
        _refuse_moe(ns, root, d)
        ns = with_tokenizer_files(ns, tokenizer_files)
        self.args, self.common = ns, common
        self.md = SafeFileSystemReader(d).read_metadata()  # the allow-listed index, before DCP reads anything
        table = self.md.state_dict_metadata.get(WORD)
        rows = table.size[0] if isinstance(table, TensorStorageMetadata) else None
        vocab, self.vocab_note = megatron_vocab(ns, rows, true_vocab)
        check_vocab_fits(vocab, rows, self.vocab_note, d)
        self.vocab_guessed = not vocab
        self.cfg, self.layout = config_from_args(ns, vocab or rows, d)
        it = common.get("iteration", 0)
        self.info = SourceInfo(
            iteration=int(it) if isinstance(it, int) else 0,
            kind="megatron torch_dist",
            tokenizer={k: getattr(ns, k, None) for k in TOKENIZER_FIELDS},
        )
        self.keys = {n: self._key(n) for n in layer_names(self.cfg)}
        for n in pre_names(self.cfg) + post_names(self.cfg):  # every tensor there, with its shape, up front
            self._check(n, n, full_shape(self.cfg, n))
        for n, key in self.keys.items():
            self._check(key, f"layer {n}", (self.cfg.num_layers,) + full_shape(self.cfg, n))

    def _key(self, rel: str) -> str:
        """The stacked key of a layer tensor: transformer_engine's fused-norm name, else the local one."""
        for cand in (STACKED + megatron_name(rel, True), STACKED + rel):
            if cand in self.md.state_dict_metadata:
                return cand
        raise CheckpointError(
            f"{self.dir} has no tensor {STACKED + megatron_name(rel, True)!r}: it does not hold "
            f"the model its args describe"
        )

    def _check(self, key: str, what: str, want: Tuple[int, ...]) -> None:
        md = self.md.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{self.dir} has no tensor {key!r}: it does not hold the model its args describe")
        got = tuple(md.size)
        vocab_ok = key in (WORD, OUTPUT) and got[1:] == want[1:] and got[0] >= want[0]  # padded rows follow
        if got != want and not vocab_ok:
            raise CheckpointError(f"{self.dir}: {key} has shape {got}, its args imply {want} ({what})")

    def read_regions(self, regions: Dict[str, Tuple[Tuple[int, ...], Tuple[int, ...]]]) -> Dict[str, torch.Tensor]:
        """key -> the block (offsets, sizes) of its global tensor, read without a process group."""
        state = {
            k: torch.empty(sizes, dtype=self.md.state_dict_metadata[k].properties.dtype)
            for k, (_, sizes) in regions.items()
        }
        try:
            with quiet_single_process():
                dcp.load(
                    state,
                    storage_reader=SafeFileSystemReader(self.dir),
                    planner=_RegionPlanner({k: off for k, (off, _) in regions.items()}),
                    no_dist=True,
                )
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - DCP wraps a damaged file in its own exception types
            first = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            raise CheckpointError(
                f"reading the tensors of {self.dir} failed ({first[:200]}); the checkpoint is "
                f"damaged: use another iteration of it"
            ) from None
        return state

    def _whole(self, names: List[str]) -> Dict[str, torch.Tensor]:
        regions = {}
        for n in names:
            shape = tuple(self.md.state_dict_metadata[n].size)
            if n in (WORD, OUTPUT):
                shape = (self.cfg.vocab_size,) + shape[1:]  # the vocabulary rows, not the padding
            regions[n] = ((0,) * len(shape), shape)
        return self.read_regions(regions)

    def pre(self) -> Dict[str, torch.Tensor]:
        out = self._whole(pre_names(self.cfg))
        check_tensors(self.cfg, out, pre_names(self.cfg), self.dir)
        return out

    def layer(self, i: int) -> Dict[str, torch.Tensor]:
        regions = {}
        for key in self.keys.values():
            rest = tuple(self.md.state_dict_metadata[key].size)[1:]
            regions[key] = ((i,) + (0,) * len(rest), (1,) + rest)
        got = self.read_regions(regions)
        out = {}
        for n, key in self.keys.items():
            t = got[key][0]
            out[n] = qkv_from_megatron(self.cfg, t) if ".linear_qkv." in "." + n else t
        check_tensors(self.cfg, out, list(self.keys), f"{self.dir} layer {i}")
        return out

    def post(self) -> Dict[str, torch.Tensor]:
        out = self._whole(post_names(self.cfg))
        check_tensors(self.cfg, out, post_names(self.cfg), self.dir)
        return out


# -- pretrain_gpt.py --load: a rank's weights straight from the directory ---------------------------------
def open_for_run(d: str, model: ModelConfig) -> "TorchDistSource":
    """torch_dist directory ``d`` read for a run of ``model``: when the args do not say which rows are
    vocabulary, this run's tokenizer does."""
    src = TorchDistSource(d)
    return TorchDistSource(d, true_vocab=model.vocab_size) if src.vocab_guessed else src


def load_torch_dist_weights(
    src: "TorchDistSource", model: ModelConfig, chunks: Sequence[nn.Module], optimizer
) -> Dict[str, int]:
    """Copy the weights this rank holds (any tp/pp/vp) from ``src`` (:func:`open_for_run`) into ``chunks``.

    The fp32 main weights follow the loaded ones (torch_dist_optim.py then restores the
    distributed optimizer's state where it can). Returns the counters common.pt records
    (iteration, consumed samples). Reads only this rank's layers; no collective.
    """
    d = src.dir
    check_model_shape({f: getattr(src.cfg, f) for f in SHAPE_FIELDS}, model, d)
    needs = chunk_blocks(chunks, for_write=False)
    wanted = {b.name for blocks in needs.values() for b in blocks}
    full: Dict[str, torch.Tensor] = {}
    if wanted & set(pre_names(src.cfg)):
        full.update(src.pre())
    for i in sorted({int(n.split(".")[2]) for n in wanted if n.startswith("decoder.layers.")}):
        full.update({f"decoder.layers.{i}.{n}": t for n, t in src.layer(i).items()})
    if wanted & set(post_names(src.cfg)):
        full.update(src.post())
    params = {(i, n): p for i, c in enumerate(chunks) for n, p in c.named_parameters()}
    main: Dict[str, Dict[str, torch.Tensor]] = {}
    sharded = False  # FSDP (data_parallel/fsdp.py): a parameter is this rank's shard, placed by the optimizer
    with torch.no_grad():
        for key, blocks in needs.items():
            local = torch.zeros(params[key].shape, dtype=torch.float32)  # vocabulary padding stays zero
            for b in blocks:
                b.local(local).copy_(full[b.name][tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))])
            if isinstance(params[key], DTensor):
                sharded = True
            else:
                params[key].data.copy_(local.to(params[key].device))
            main[key[1]] = {"param": local}
    if optimizer.half or sharded:  # separate fp32 main weights (or FSDP's shards): from the loaded weights
        optimizer.load_full_state_dict(main)
    args = src.args
    return {"iteration": src.info.iteration, "consumed_samples": int(getattr(args, "consumed_train_samples", 0) or 0)}
