"""megalite's own checkpoints as a conversion source and target, one layer at a time.

Reading: the ``sharded`` format is read block by block with
torch.distributed.checkpoint (only the blocks of the layer asked for); the
``torch`` format maps one pipeline rank's files at a time (``mmap``) and joins
their tp shards. Writing: ``sharded`` saves each layer as its own DCP file and
merges the indexes at the end, so memory holds one layer; ``torch`` writes a
pipeline rank's files when the last of its chunks is complete (one stage, or
the whole model when virtual stages interleave). Optimizer state is not
converted: the result loads with ``--finetune`` or ``--no-load-optim``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
from dataclasses import asdict
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp

from megalite.checkpointing.format_info import SHARDED_INFO, TORCH_INFO, format_info
from megalite.checkpointing.protocol import iteration_dir, read_json, read_latest
from megalite.checkpointing.run_state import FORMAT_VERSION, MOE_SHAPE_FIELDS, SHAPE_FIELDS
from megalite.checkpointing.safe_load import CheckpointError, SafeFileSystemReader, safe_torch_load
from megalite.checkpointing.sharded import quiet_single_process, read_index
from megalite.checkpointing.sharded_read import read_whole
from megalite.checkpointing.torch_format import legacy_dir
from megalite.config import Config, DataConfig, ModelConfig, ParallelConfig
from megalite.interop.interchange import (
    TIED_COPY,
    WORD,
    Layout,
    ModelSource,
    SourceInfo,
    check_tensors,
    expert_of,
    layer_names,
    layer_prefix,
    merge_tp,
    model_config_from_dict,
    post_names,
    pre_names,
    split_tp,
    stream_to_ranks,
)
from megalite.interop.torch_dist import is_torch_dist

TOKENIZER_FIELDS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")


def find_iteration(root: str, what: str, step: Optional[int] = None, flag: str = "--load-dir") -> str:
    """The iteration directory ``step`` or ``latest_checkpointed_iteration.txt`` names (one-line error otherwise)."""
    if not os.path.isdir(root):
        raise CheckpointError(f"{flag} {root}: no such directory")
    it = step if step is not None else read_latest(root)
    if it is None:
        raise CheckpointError(
            f"{flag} {root}: no checkpoint there (no latest_checkpointed_iteration.txt); it is not a {what} checkpoint"
        )
    d = iteration_dir(root, it)
    if not os.path.isdir(d):
        asked = "--ckpt-step asks for" if step is not None else "latest_checkpointed_iteration.txt names"
        raise CheckpointError(
            f"{root}: {asked} iteration {it} but {d} is missing; it is not a complete {what} checkpoint"
        )
    return d


class MegaliteSource(ModelSource):
    """A megalite checkpoint (either format), read lazily."""

    def __init__(self, root: str, step: Optional[int] = None, flag: str = "--load-dir"):
        self.dir = find_iteration(root, "megalite", step, flag)
        meta_path = os.path.join(self.dir, "meta.json")
        if not os.path.exists(meta_path):
            if is_torch_dist(self.dir):
                raise CheckpointError(
                    f"{self.dir} is a Megatron-Core torch_dist checkpoint, not a megalite one: "
                    f"convert it with --loader megatron (pretrain_gpt.py --load reads it directly)"
                )
            raise CheckpointError(
                f"{self.dir} has no meta.json: it is not a complete megalite checkpoint (a "
                f"Megatron-LM one converts with --loader megatron)"
            )
        self.meta = read_json(meta_path)
        try:
            config = self.meta.get("config", {})
            self.cfg = model_config_from_dict(config.get("model", {}))
            data = config.get("data", {})
            self.info = SourceInfo(
                iteration=int(self.meta.get("iteration", 0)),
                kind="megalite",
                tokenizer={k: data.get(k) for k in TOKENIZER_FIELDS},
            )
            self.format = format_info(self.meta.get("format", SHARDED_INFO.name))  # one of the run formats
            lay = self.meta["layout"]  # the layout it was trained in: the converter's default target
            self.layout = Layout(
                lay["tp"],
                lay["pp"],
                lay["vp"],
                lay.get("first") or None,
                lay.get("last") or None,
                tuple(lay.get("stage_layers") or ()) or None,
                int(lay.get("ep", 1)),
                lay.get("etp"),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"{meta_path} is damaged ({type(e).__name__}: {e}); restore it from the run that saved the checkpoint"
            ) from None
        if self.format.layout_free:  # one set of blocks for the whole model
            SafeFileSystemReader(self.dir).read_metadata()  # the allow-listed index, before DCP reads anything
            self.index = read_index(self.dir)
        else:
            self.where = self.layout.stage_of_layer(self.cfg.num_layers)
            self._need = self._needed()
            for r in range(self.layout.pp):  # every file needed present before anything is converted
                for t, e in set(self._need.values()):
                    if not os.path.exists(self._path(t, r, e)):
                        raise CheckpointError(f"{self._path(t, r, e)} is missing: the checkpoint is incomplete")
            self._open_rank: Optional[int] = None
            self._files: Dict[Tuple[int, int], dict] = {}

    # -- sharded: blocks through torch.distributed.checkpoint --------------------------------------
    def _read_sharded(self, names: List[str]) -> Dict[str, torch.Tensor]:
        # whole tensors from any writer's entries (whole blocks, or the owner-written flat pieces), checked
        return read_whole(self.dir, self.index, names)

    # -- torch: one pipeline rank's files, mapped ------------------------------------------------
    def _path(self, t: int, pp_rank: int, e: int = 0) -> str:
        lay = self.layout
        return os.path.join(self.dir, legacy_dir(t, pp_rank, lay.pp, e, lay.ep), "model_optim_rng.pt")

    def _needed(self) -> Dict[tuple, Tuple[int, int]]:
        """Which file (tp rank, ep rank) each part comes from: ("dense", t) for tp rank t's dense shards, and
        ("expert", e, k) for ep rank e's experts at expert-TP shard k (file tp rank t holds shard t mod etp).
        A run writes file (t, e) only where one of its ranks has both: the first present one is taken."""
        lay, pp0 = self.layout, 0

        def first(options):
            return next((o for o in options if os.path.exists(self._path(o[0], pp0, o[1]))), options[0])

        need: Dict[tuple, Tuple[int, int]] = {
            ("dense", t): first([(t, e) for e in range(lay.ep)]) for t in range(lay.tp)
        }
        for e in range(lay.ep) if self.cfg.is_moe else ():
            for k in range(lay.expert_tp):
                need[("expert", e, k)] = first([(t, e) for t in range(k, lay.tp, lay.expert_tp)] or [(k, e)])
        return need

    def _chunk(self, pp_rank: int, chunk: int) -> Dict[tuple, dict]:
        if self._open_rank != pp_rank:
            self._files = {}  # release the previous rank's maps before opening the next
            for t, e in set(self._need.values()):
                path = self._path(t, pp_rank, e)
                if not os.path.exists(path):
                    raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
                self._files[(t, e)] = safe_torch_load(path, mmap=True)
            self._open_rank = pp_rank
        key = "model" if self.layout.vp == 1 else f"model{chunk}"
        return {role: self._files[te][key] for role, te in self._need.items()}

    def _read_torch(self, pp_rank: int, chunk: int, names: List[str]) -> Dict[str, torch.Tensor]:
        files, lay = self._chunk(pp_rank, chunk), self.layout
        out = {}
        for n in names:
            g = expert_of(n)
            if g is None:
                shards = [files[("dense", t)].get(n) for t in range(lay.tp)]
            else:  # expert g sits in its ep rank's files, split over expert TP
                e = g // (self.cfg.num_experts // lay.ep)
                shards = [files[("expert", e, k)].get(n) for k in range(lay.expert_tp)]
            if any(s is None for s in shards):
                raise CheckpointError(f"{self.dir}: no tensor {n!r} in pipeline rank {pp_rank}'s files")
            out[n] = merge_tp(self.cfg, n, shards).clone()
        return out

    def _read(self, names: List[str], pp_rank: int, chunk: int) -> Dict[str, torch.Tensor]:
        if self.format.layout_free:
            return self._read_sharded(names)
        return self._read_torch(pp_rank, chunk, names)

    def pre(self) -> Dict[str, torch.Tensor]:
        out = self._read(pre_names(self.cfg), 0, 0)
        check_tensors(self.cfg, out, pre_names(self.cfg), self.dir)
        return out

    def layer(self, i: int) -> Dict[str, torch.Tensor]:
        rel = layer_names(self.cfg, i)
        r, c = self.where[i][:2] if not self.format.layout_free else (0, 0)
        got = self._read([layer_prefix(i) + n for n in rel], r, c)
        out = {n: got[layer_prefix(i) + n] for n in rel}
        check_tensors(self.cfg, out, rel, f"{self.dir} layer {i}")
        return out

    def post(self) -> Dict[str, torch.Tensor]:
        last = (self.layout.pp - 1, self.layout.vp - 1) if not self.format.layout_free else (0, 0)
        out = self._read(post_names(self.cfg), *last)
        check_tensors(self.cfg, out, post_names(self.cfg), self.dir)
        return out

    def full_model(self) -> Dict[str, torch.Tensor]:
        """Every model tensor, full (unsharded, unpadded), under megalite's single-model names."""
        full = self.pre()
        for i in range(self.cfg.num_layers):
            full.update({layer_prefix(i) + n: t for n, t in self.layer(i).items()})
        full.update(self.post())
        self.close()
        return full

    def close(self) -> None:
        self._files, self._open_rank = {}, None


# -- writing --------------------------------------------------------------------------------------
def _meta(cfg: ModelConfig, info: SourceInfo, layout: Layout, fmt: str, tokenizer: Dict[str, Optional[str]]) -> dict:
    """meta.json of a converted checkpoint: weights only (no optimizer, no RNG; the layout marks it converted)."""
    full = Config(
        model=cfg,
        parallel=ParallelConfig(
            tp=layout.tp,
            pp=layout.pp,
            vp=layout.vp,
            decoder_first_pipeline_num_layers=layout.first,
            decoder_last_pipeline_num_layers=layout.last,
            ep=layout.ep,
            etp=layout.etp,
        ),
        data=DataConfig(**{k: v for k, v in tokenizer.items() if k in TOKENIZER_FIELDS}),
    )
    lay = {
        "world": layout.tp * layout.pp * layout.ep,
        "tp": layout.tp,
        "pp": layout.pp,
        "vp": layout.vp,
        "dp": 1,
        "first": layout.first or 0,
        "last": layout.last or 0,
        "converted_from": info.kind,
    }
    if cfg.is_moe:  # as a run records an MoE layout (run_state.layout_of)
        lay.update(ep=layout.ep, etp=layout.expert_tp)
    shape = SHAPE_FIELDS + (MOE_SHAPE_FIELDS if cfg.is_moe else ())
    return {
        "format_version": FORMAT_VERSION,
        "format": fmt,
        "iteration": info.iteration,
        "consumed_samples": 0,
        "skipped_iters": 0,
        "nan_iters": 0,
        "scheduler": {"num_steps": info.iteration},
        "scaler": None,
        "adam_step": 0.0,
        "group_steps": [],
        "layout": lay,  # never equal to a run's layout (converted_from), so no RNG file is looked for
        "config": json.loads(json.dumps(asdict(full), default=str)),
        "model_shape": {f: list(v) if isinstance(v, tuple) else v for f in shape for v in [getattr(cfg, f)]},
    }


def _whole_key(name: str, t: torch.Tensor) -> str:
    """The DCP key of a block that is the whole tensor (the key format of checkpointing.layout.Block)."""
    return f"model/{name}@{','.join('0' for _ in t.shape)}"


def _write_finish(out: str, meta: dict, iteration: int) -> None:
    with open(os.path.join(iteration_dir(out, iteration), "meta.json"), "w") as f:
        json.dump(meta, f)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def save_sharded(
    source: ModelSource, out: str, layout: Layout, tokenizer: Dict[str, Optional[str]], progress: Callable[[str], None]
) -> None:
    """Write ``source`` as a megalite sharded checkpoint under ``out`` (a fresh directory)."""
    cfg, it = source.cfg, source.info.iteration
    d = iteration_dir(out, it)
    os.makedirs(d)
    index: List[dict] = []
    merged_md, merged_storage = {}, {}
    groups = (
        [("embeddings", source.pre)]
        + [
            (f"layer {i}", lambda i=i: {layer_prefix(i) + k: v for k, v in source.layer(i).items()})
            for i in range(cfg.num_layers)
        ]
        + [("final norm and head", source.post)]
    )
    for k, (what, read) in enumerate(groups):
        tensors = {n: t.contiguous() for n, t in read().items()}
        state = {_whole_key(n, t): t for n, t in tensors.items()}
        part = os.path.join(d, f".part{k}")
        with quiet_single_process():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(part))
        md = SafeFileSystemReader(part).read_metadata()
        fname = f"__{k}_0.distcp"
        files = {info.relative_path for info in md.storage_data.values()}
        if len(files) != 1:
            raise CheckpointError(f"unexpected torch.distributed.checkpoint output in {part}: {sorted(files)}")
        os.replace(os.path.join(part, files.pop()), os.path.join(d, fname))
        shutil.rmtree(part)
        merged_md.update(md.state_dict_metadata)
        merged_storage.update(
            {idx: dataclasses.replace(info, relative_path=fname) for idx, info in md.storage_data.items()}
        )
        for n, t in tensors.items():
            index.append(
                {
                    "key": _whole_key(n, t),
                    "prefix": "model",
                    "name": n,
                    "shape": list(t.shape),
                    "offsets": [0] * t.dim(),
                    "sizes": list(t.shape),
                    "dtype": str(t.dtype).replace("torch.", ""),
                }
            )
        progress(what)
    md.state_dict_metadata, md.storage_data = merged_md, merged_storage
    with open(os.path.join(d, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with open(os.path.join(d, "index_00000.json"), "w") as f:
        json.dump(index, f)
    _write_finish(out, _meta(cfg, source.info, layout, SHARDED_INFO.name, tokenizer), it)


def shard_files(
    cfg: ModelConfig, layout: Layout, tensors: Dict[str, torch.Tensor], rename: Callable[[str], str]
) -> List[Dict[str, torch.Tensor]]:
    """Each per-rank file's entries (``layout.files``: file tp rank + tp x ep rank) of full ``tensors``:
    dense ones split over tp in every file; expert e's only in its ep rank's files, the expert-TP shard
    ``tp rank mod etp`` (the shard the run's rank of that tp rank holds, etp dividing tp), stored under
    ``rename(name)``. Clones: a shard must not keep the full tensor alive."""
    tp, ep, etp = layout.tp, layout.ep, layout.expert_tp
    out: List[Dict[str, torch.Tensor]] = [{} for _ in range(layout.files)]
    for n, t in tensors.items():
        g = expert_of(n)
        if g is None:
            for f, s in enumerate(split_tp(cfg, WORD if n == TIED_COPY else n, t, tp) * ep):
                out[f][rename(n)] = s.clone()
            continue
        e = g // (cfg.num_experts // ep)
        shards = split_tp(cfg, n, t, etp)
        for r in range(tp):
            out[r + tp * e][rename(n)] = shards[r % etp].clone()
    return out


def save_torch(
    source: ModelSource, out: str, layout: Layout, tokenizer: Dict[str, Optional[str]], progress: Callable[[str], None]
) -> None:
    """Write ``source`` in megalite's torch (legacy, per tp/pp rank) format for ``layout``."""
    cfg, it, tp = source.cfg, source.info.iteration, layout.tp
    d = iteration_dir(out, it)
    meta = _meta(cfg, source.info, layout, TORCH_INFO.name, tokenizer)

    def shard(tensors: Dict[str, torch.Tensor], _: Optional[int]) -> List[Dict[str, torch.Tensor]]:
        return shard_files(cfg, layout, tensors, lambda n: n)

    def write(pp_rank: int, files: List[Dict[int, Dict[str, torch.Tensor]]]) -> None:
        for f, chunks in enumerate(files):
            models = {("model" if layout.vp == 1 else f"model{c}"): sd for c, sd in chunks.items()}
            path = os.path.join(d, legacy_dir(f % tp, pp_rank, layout.pp, f // tp, layout.ep), "model_optim_rng.pt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(
                {
                    "args": meta["config"],
                    "checkpoint_version": 3.0,
                    "iteration": it,
                    "consumed_samples": 0,
                    **models,
                    "optimizer": {"state": {}, "scaler": None, "group_steps": []},
                    "opt_param_scheduler": meta["scheduler"],
                    "rng_state": [],
                    "layout": meta["layout"],
                    "model_shape": meta["model_shape"],
                },
                path,
            )

    stream_to_ranks(source, layout, shard, write, progress)
    _write_finish(out, meta, it)


def megalite_writer(fmt: str) -> Callable:
    """The conversion writer of run format ``fmt`` (save_sharded or save_torch); one line if unknown."""
    writers = {SHARDED_INFO.name: save_sharded, TORCH_INFO.name: save_torch}
    return writers[format_info(fmt).name]
