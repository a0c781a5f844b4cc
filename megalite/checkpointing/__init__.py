"""Save and load a whole run: model, optimizer, LR schedule, loss scaler, counters, RNG, config.

::

    SAVE/iter_0000100/                      (written as iter_0000100.tmp, renamed when complete)
      sharded format (default, layout-free, on torch.distributed.checkpoint):
        __<rank>_0.distcp  .metadata        every tensor block once, written by the rank owning it
        index_<rank>.json                   block -> global tensor name, global shape, offsets
        meta.json  rng_<rank>.pt            counters, scheduler, scaler, config; RNG per rank
      torch format (Megatron-LM's legacy layout, same tp/pp/vp to load):
        mp_rank_<tp:02d>[_<pp:03d>]/model_optim_rng.pt
    SAVE/latest_checkpointed_iteration.txt  written last (temporary file + rename)

Model blocks are slices of each parameter's full tensor (``layout.py``);
optimizer state (fp32 main weights, Adam moments) is gathered over DP into the
same per-parameter shapes and saved as the same blocks, so a sharded checkpoint
loads into any tp, pp, vp, dp and distributed-optimizer setting. Every read is
restricted to plain data (``safe_load.py``).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import warnings
from dataclasses import asdict
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megalite.checkpointing.layout import chunk_blocks, intersect
from megalite.checkpointing.safe_load import CheckpointError, SafeFileSystemReader, safe_torch_load

logger = logging.getLogger("megalite")
LATEST = "latest_checkpointed_iteration.txt"
OPTIM_KEYS = ("param", "exp_avg", "exp_avg_sq")
FORMAT_VERSION = 1
_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "query_groups", "ffn_size", "vocab_size",
                 "normalization", "swiglu", "position_embedding_type", "tied_embeddings", "add_bias_linear",
                 "max_positions")

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "iteration_dir", "read_latest"]


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_latest(root: str) -> Optional[int]:
    """The iteration ``latest_checkpointed_iteration.txt`` names, or None when there is none."""
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} should hold an iteration number, found {text[:40]!r}")
    return int(text)


@contextlib.contextmanager
def _quiet_single_process():
    """torch.distributed.checkpoint warns when it runs without a process group; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        warnings.filterwarnings("ignore", message="Global metadata is not found")
        yield


def dcp_read(state: Dict[str, torch.Tensor], d: str, advice: str) -> None:
    """torch.distributed.checkpoint's load into ``state``; any failure (DCP wraps each rank's in its own
    exception types) becomes one CheckpointError line naming ``d``, then ``advice``."""
    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=SafeFileSystemReader(d))
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        first = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        raise CheckpointError(f"reading the tensors of {d} failed ({first[:200]}); the checkpoint is damaged: "
                              f"{advice}") from None


# -- what a run consists of -----------------------------------------------------------------------
def _rng_state(trainer) -> dict:
    np_state = np.random.get_state()
    return {"python": random.getstate(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
            "torch": torch.get_rng_state(),
            "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_available() else [],  # this rank's device
            "tracker": trainer.tracker.get_states()}


def _set_rng_state(trainer, st: dict) -> None:
    random.setstate((st["python"][0], tuple(st["python"][1]), st["python"][2]))
    n = st["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), int(n[2]), int(n[3]), float(n[4])))
    torch.set_rng_state(st["torch"])
    if st["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"][0])
    trainer.tracker.set_states(st["tracker"])


def _layout(trainer) -> Dict[str, int]:
    ps = trainer.ps
    return {"world": ps.world_size, "tp": ps.tp_size, "pp": ps.pp_size, "vp": trainer.cfg.parallel.vp,
            "dp": ps.dp_size, "first": trainer.cfg.parallel.decoder_first_pipeline_num_layers or 0,
            "last": trainer.cfg.parallel.decoder_last_pipeline_num_layers or 0,
            "stage_layers": list(trainer.cfg.parallel.pipeline_stage_layers or ())}


def _meta(trainer) -> dict:
    opt = trainer.optimizer
    steps = [s["step"] for s in opt.optimizer.state.values() if "step" in s]
    return {"format_version": FORMAT_VERSION, "iteration": trainer.iteration,
            "consumed_samples": trainer.consumed_samples, "skipped_iters": trainer.skipped_iters,
            "nan_iters": trainer.nan_iters, "scheduler": trainer.scheduler.state_dict(),
            "scaler": opt.scaler.state_dict() if opt.scaler else None,
            "adam_step": float(steps[0]) if steps else 0.0,
            "group_steps": [g.get("step") if not torch.is_tensor(g.get("step")) else float(g["step"])
                            for g in opt.optimizer.param_groups],
            "layout": _layout(trainer), "config": json.loads(json.dumps(asdict(trainer.cfg), default=str)),
            "model_shape": {f: getattr(trainer.cfg.model, f) for f in _SHAPE_FIELDS}}


def check_model_shape(saved: dict, trainer, where: str) -> None:
    """One line naming every model-shape field that differs between a checkpoint and the run."""
    m = trainer.cfg.model
    fields = [f for f in _SHAPE_FIELDS if f != "max_positions" or m.position_embedding_type == "learned_absolute"]
    diffs = [f"{f} {saved[f]} (checkpoint) vs {getattr(m, f)} (run)"
             for f in fields if f in saved and saved[f] != getattr(m, f)]
    if diffs:
        raise CheckpointError(f"{where} does not fit this model: {'; '.join(diffs)}; pass the model flags it was "
                              f"saved with")


# -- saving --------------------------------------------------------------------------------------
def save_checkpoint(trainer, root: str, fmt: str = "sharded", keep_last: Optional[int] = None) -> str:
    """Save the run at its current iteration under ``root`` (collective: every rank calls it)."""
    ps, it = trainer.ps, trainer.iteration
    final = iteration_dir(root, it)
    tmp = final + ".tmp"
    if ps.rank == 0:
        os.makedirs(root, exist_ok=True)
        for stale in os.listdir(root):  # saves killed earlier
            if stale.startswith("iter_") and stale.endswith((".tmp", ".old")):
                shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
        os.makedirs(tmp)
    ps.barrier()
    trainer.optimizer.finish_param_gather()
    # fp32 main weights are the model weights: not stored twice (collective over DP, one key at a time on CPU)
    full_opt = trainer.optimizer.full_state_dict(include_main=trainer.optimizer.half, to_cpu=True)
    if fmt == "sharded":
        _save_sharded(trainer, tmp, full_opt)
    elif fmt == "torch":
        _save_torch(trainer, tmp, full_opt)
    else:
        raise CheckpointError(f"unknown --ckpt-format {fmt!r}; use sharded or torch")
    if ps.rank == 0:
        _write_json(os.path.join(tmp, "meta.json"), {**_meta(trainer), "format": fmt})
    ps.barrier()  # every rank's files are in tmp
    if ps.rank == 0:
        old = final + ".old"
        if os.path.exists(final):  # saving the same iteration again: it stays loadable until replaced
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
        _write_latest(root, it)
        shutil.rmtree(old, ignore_errors=True)
        if keep_last:
            _prune(root, keep_last, it)
    ps.barrier()
    logger.info(f"saved checkpoint at iteration {it} to {root} ({fmt} format)")
    return final


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot sync a directory
        pass
    finally:
        os.close(fd)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _save_synced(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_latest(root: str, it: int) -> None:
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(it))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    _fsync_dir(root)


def _prune(root: str, keep_last: int, latest: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints; never the one latest names."""
    its = sorted(int(d[5:]) for d in os.listdir(root) if d.startswith("iter_") and d[5:].isdigit())
    for old in its[:-keep_last]:
        if old != latest:
            shutil.rmtree(iteration_dir(root, old), ignore_errors=True)


def _save_sharded(trainer, tmp: str, full_opt: dict) -> None:
    ps = trainer.ps
    state: Dict[str, torch.Tensor] = {}
    index: List[dict] = []
    if ps.dp_rank == 0:  # DP replicas hold the same tensors: one writes them
        params = {(i, n): p for i, c in enumerate(trainer.chunks) for n, p in c.named_parameters()}
        for (i, name), blocks in chunk_blocks(trainer.chunks, for_write=True).items():
            sources = {"model": params[(i, name)].detach()}
            sources.update({f"optim.{k}": full_opt[name][k] for k in OPTIM_KEYS if k in full_opt.get(name, {})})
            for prefix, tensor in sources.items():
                for b in blocks:
                    key = f"{prefix}/{b.key}"
                    state[key] = b.local(tensor).contiguous()  # written before anything changes
                    index.append({"key": key, "prefix": prefix, "name": b.name, "shape": list(b.global_shape),
                                  "offsets": list(b.offsets), "sizes": list(b.sizes),
                                  "dtype": str(tensor.dtype).replace("torch.", "")})
    with _quiet_single_process():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))
    _write_json(os.path.join(tmp, f"index_{ps.rank:05d}.json"), index)
    _save_synced(_rng_state(trainer), os.path.join(tmp, f"rng_{ps.rank:05d}.pt"))


def _legacy_dir(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")


def _save_torch(trainer, tmp: str, full_opt: dict) -> None:
    ps = trainer.ps
    rngs: List[Optional[dict]] = [None] * ps.dp_size
    if ps.dp_size > 1:
        dist.all_gather_object(rngs, _rng_state(trainer), group=ps.dp_group)
    else:
        rngs = [_rng_state(trainer)]
    if ps.dp_rank != 0:
        return
    models = {("model" if len(trainer.chunks) == 1 else f"model{i}"): c.state_dict()
              for i, c in enumerate(trainer.chunks)}
    meta = _meta(trainer)
    state = {"args": meta["config"], "checkpoint_version": 3.0, "iteration": trainer.iteration,
             "consumed_samples": trainer.consumed_samples, **models,
             "optimizer": {"state": full_opt, "scaler": meta["scaler"], "group_steps": meta["group_steps"]},
             "opt_param_scheduler": meta["scheduler"], "rng_state": rngs,
             "counters": {"skipped_iters": trainer.skipped_iters, "nan_iters": trainer.nan_iters},
             "layout": meta["layout"], "model_shape": meta["model_shape"]}
    d = os.path.join(tmp, _legacy_dir(ps.tp_rank, ps.pp_rank, ps.pp_size))
    os.makedirs(d, exist_ok=True)
    _save_synced(state, os.path.join(d, "model_optim_rng.pt"))


# -- loading -------------------------------------------------------------------------------------
def saved_stage_layers(root: str, step: Optional[int], pp: int, vp: int) -> Optional[Tuple[int, ...]]:
    """The per-stage layer split the checkpoint to load was trained with, when its pp and vp match.

    ``--pipeline-balance measured`` resumes with it instead of measuring again: timing noise could
    choose another split, which a torch-format checkpoint refuses and which changes the RNG layout.
    """
    it = step if step is not None else read_latest(root)
    path = os.path.join(iteration_dir(root, it), "meta.json") if it is not None else None
    if path is None or not os.path.exists(path):
        return None
    layout = _read_json(path).get("layout", {})
    if layout.get("pp") == pp and layout.get("vp") == vp and layout.get("stage_layers"):
        return tuple(int(n) for n in layout["stage_layers"])
    return None


def load_checkpoint(trainer, root: str, *, step: Optional[int] = None, finetune: bool = False,
                    load_optim: bool = True, load_rng: bool = True) -> Optional[int]:
    """Load ``root`` (latest, or iteration ``step``) into the trainer; returns the iteration loaded.

    With no checkpoint there, warns and returns None (the run starts from scratch,
    as Megatron does). ``finetune`` loads the weights only and restarts the counters.
    """
    it = step if step is not None else read_latest(root)
    if it is None:
        if finetune:
            raise CheckpointError(f"--finetune: no checkpoint in {root} (no {LATEST}); check --load")
        logger.warning(f"no {LATEST} in {root}: starting from scratch")
        return None
    d = iteration_dir(root, it)
    meta_path = os.path.join(d, "meta.json")
    if not os.path.exists(meta_path):
        have = sorted(x[5:] for x in os.listdir(root) if x.startswith("iter_") and x[5:].isdigit()) \
            if os.path.isdir(root) else []
        raise CheckpointError(f"{d} is not a complete megalite checkpoint (no meta.json); iterations in {root}: "
                              f"{', '.join(have) or 'none'}; pick one with --ckpt-step or check --load")
    meta = _read_json(meta_path)
    check_model_shape(meta["model_shape"], trainer, d)
    load_optim = load_optim and not finetune
    trainer.optimizer.finish_param_gather()
    if meta.get("format") == "torch":
        rng = _load_torch(trainer, d, meta, load_optim)
    else:
        rng = _load_sharded(trainer, d, meta, load_optim)
    if not finetune:
        trainer.iteration, trainer.consumed_samples = meta["iteration"], meta["consumed_samples"]
        trainer.skipped_iters, trainer.nan_iters = meta["skipped_iters"], meta["nan_iters"]
    if load_optim:
        trainer.scheduler.load_state_dict(meta["scheduler"])
        if trainer.optimizer.scaler is not None and meta["scaler"]:
            trainer.optimizer.scaler.load_state_dict(meta["scaler"])
    if load_rng and not finetune:
        if rng is not None:
            _set_rng_state(trainer, rng)
        else:
            logger.warning("checkpoint saved in another layout: random states are not restored")
    logger.info(f"loaded checkpoint {d} (iteration {meta['iteration']}, {meta.get('format')} format)")
    return it


def _optimizer_state(tensors: Dict[str, Dict[str, torch.Tensor]], meta: dict) -> dict:
    step = torch.tensor(meta["adam_step"], dtype=torch.float32)
    # Adam's moments exist once a step has been taken (fp16 may skip the first ones)
    return {n: {**t, "step": step.clone()} if "exp_avg" in t else dict(t) for n, t in tensors.items()}


def _stage_counts(layout: dict, num_layers: int) -> str:
    """Layers of every virtual stage, resolved (``2,2``), so an even split given as a list and the
    same split given by default compare equal; older files lack the list."""
    from megalite.pipeline.partition import stage_layer_counts
    try:
        counts = stage_layer_counts(num_layers, layout["pp"], layout["vp"], layout["first"] or None,
                                    layout["last"] or None, layout.get("stage_layers") or None)
    except ValueError:  # a layout this model cannot have: show it as saved
        return f"first {layout['first']} last {layout['last']} list {layout.get('stage_layers')}"
    return ",".join(map(str, counts))


def _load_torch(trainer, d: str, meta: dict, load_optim: bool) -> Optional[dict]:
    ps, here = trainer.ps, _layout(trainer)
    saved = meta["layout"]
    split = lambda layout: _stage_counts(layout, trainer.cfg.model.num_layers)  # noqa: E731
    if any(saved[k] != here[k] for k in ("tp", "pp", "vp")) or split(saved) != split(here):
        raise CheckpointError(
            f"{d} is a torch-format checkpoint saved with tp={saved['tp']} pp={saved['pp']} vp={saved['vp']} "
            f"(layers per stage: {split(saved)}); this run has tp={here['tp']} pp={here['pp']} vp={here['vp']} "
            f"({split(here)}): run with the saved layout (--pipeline-stage-layers) or save with --ckpt-format "
            f"sharded, which loads into any layout")
    path = os.path.join(d, _legacy_dir(ps.tp_rank, ps.pp_rank, ps.pp_size), "model_optim_rng.pt")
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
    state = safe_torch_load(path)
    models = [state["model" if len(trainer.chunks) == 1 else f"model{i}"] for i in range(len(trainer.chunks))]
    for chunk, sd in zip(trainer.chunks, models):
        for name, p in chunk.named_parameters():
            if name not in sd or tuple(sd[name].shape) != tuple(p.shape):
                got = tuple(sd[name].shape) if name in sd else "missing"
                raise CheckpointError(f"{path}: {name} is {got} in the checkpoint, {tuple(p.shape)} in this run "
                                      f"(check --make-vocab-size-divisible-by and the model flags)")
        chunk.load_state_dict(sd)
    opt_state = state["optimizer"]["state"] if load_optim else {}
    optimized = {n for n, _ in trainer.optimizer.named}
    for sd in models:  # no fp32 main weights saved (fp32 run, or optimizer not loaded): the weights are them
        for name, t in sd.items():
            if "param" not in opt_state.get(name, {}) and (load_optim or trainer.optimizer.half) \
                    and name in optimized:
                opt_state.setdefault(name, {})["param"] = t.float()
    if opt_state:
        trainer.optimizer.load_full_state_dict(opt_state)
    if load_optim:
        _set_group_steps(trainer, meta)
    rngs = state["rng_state"]
    return rngs[ps.dp_rank] if saved["dp"] == here["dp"] and len(rngs) == ps.dp_size else None


def _set_group_steps(trainer, meta: dict) -> None:
    for g, s in zip(trainer.optimizer.optimizer.param_groups, meta.get("group_steps") or []):
        if s is not None:
            g["step"] = s


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"cannot read {path} ({e}); the checkpoint is damaged: load another iteration "
                              f"with --ckpt-step") from None


def _read_index(d: str) -> Dict[Tuple[str, str], List[dict]]:
    out: Dict[Tuple[str, str], List[dict]] = {}
    for fn in sorted(os.listdir(d)):
        if fn.startswith("index_") and fn.endswith(".json"):
            for e in _read_json(os.path.join(d, fn)):
                out.setdefault((e["prefix"], e["name"]), []).append(e)
    return out


def _plan_reads(d, index, needs, saved_optim, model_out, optim_out, wanted, copies) -> None:
    """Which saved blocks this rank reads, and where each part of them goes."""
    for (i, name), blocks in needs.items():
        for prefix in ["model"] + [f"optim.{k}" for k in saved_optim]:
            target = model_out[(i, name)] if prefix == "model" else optim_out[name][prefix.split(".", 1)[1]]
            for b in blocks:
                entries = index.get((prefix, b.name))
                if not entries:
                    raise CheckpointError(f"{d} has no {prefix} tensor {b.name!r}: it was saved from another "
                                          f"model; check the model flags")
                if entries[0]["shape"] != list(b.global_shape):
                    raise CheckpointError(f"{d}: {b.name} has shape {entries[0]['shape']} in the checkpoint, "
                                          f"{list(b.global_shape)} in this run; check the model flags")
                for e in entries:
                    sl = intersect(b, e["offsets"], e["sizes"])
                    if sl is None:
                        continue
                    dst = b.local(target)[sl[0]]
                    exact = (e["offsets"] == list(b.offsets) and e["sizes"] == list(b.sizes)
                             and e["dtype"] == "float32" and e["key"] not in wanted)
                    if exact:  # read straight into place
                        wanted[e["key"]] = dst
                        continue
                    if e["key"] not in wanted:
                        wanted[e["key"]] = torch.empty(e["sizes"], dtype=getattr(torch, e["dtype"]))
                    copies.append((dst, e["key"], sl[1]))


def _agree_on_error(trainer, error: Optional[CheckpointError]) -> None:
    """Raise everywhere if any rank failed (that rank's message locally, a pointer to it elsewhere)."""
    failed = torch.tensor([1.0 if error is not None else 0.0], device=trainer.ps.device)
    if dist.is_initialized() and trainer.ps.world_size > 1:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if error is not None:
        raise error
    if failed.item() > 0:
        raise CheckpointError("another rank could not read this checkpoint (its error is printed above); "
                              "check --load and the model flags")


def _load_sharded(trainer, d: str, meta: dict, load_optim: bool) -> Optional[dict]:
    SafeFileSystemReader(d).read_metadata()  # refuse a tampered index before torch.distributed.checkpoint reads it
    index = _read_index(d)
    params = {(i, n): p for i, c in enumerate(trainer.chunks) for n, p in c.named_parameters()}
    needs = chunk_blocks(trainer.chunks, for_write=False)
    saved_optim = [k for k in OPTIM_KEYS if any(pre == f"optim.{k}" for pre, _ in index)] if load_optim else []
    # destinations: fp32 full local tensors (vocabulary padding stays zero)
    model_out = {k: torch.zeros(p.shape, dtype=torch.float32) for k, p in params.items()}
    optim_out: Dict[str, Dict[str, torch.Tensor]] = {
        name: {k: torch.zeros(p.shape, dtype=torch.float32) for k in saved_optim}
        for (i, name), p in params.items()} if saved_optim else {}
    wanted: Dict[str, torch.Tensor] = {}
    copies: list = []  # (destination view, key, source slices) where a saved block is not exactly a needed one
    error = None
    try:
        _plan_reads(d, index, needs, saved_optim, model_out, optim_out, wanted, copies)
    except CheckpointError as e:
        error = e
    _agree_on_error(trainer, error)  # a rank that cannot plan must not leave the others in the collective read
    dcp_read(wanted, d, "load another iteration with --ckpt-step")  # collective
    for dst, key, src in copies:
        dst.copy_(wanted[key][src])
    with torch.no_grad():
        for k, p in params.items():
            p.data.copy_(model_out[k].to(p.device))
    if "param" not in saved_optim and (optim_out or trainer.optimizer.half):
        # no fp32 main weights saved (fp32 run, or optimizer not loaded): the loaded weights are them
        for (i, name), t in model_out.items():
            optim_out.setdefault(name, {})["param"] = t
    if optim_out:
        trainer.optimizer.load_full_state_dict(_optimizer_state(optim_out, meta))
    if load_optim:
        _set_group_steps(trainer, meta)
    if meta["layout"] == _layout(trainer):
        path = os.path.join(d, f"rng_{trainer.ps.rank:05d}.pt")
        if not os.path.exists(path):
            raise CheckpointError(f"{path} is missing: the checkpoint is incomplete; pass --no-load-rng to "
                                  f"load it without random states")
        return safe_torch_load(path)
    return None
