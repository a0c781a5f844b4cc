"""Megatron-Core's distributed-optimizer state in a torch_dist checkpoint, as megalite's optimizer state.

Megatron-LM's ``save_checkpoint`` stores the distributed optimizer in its default
``dp_reshardable`` mode (``--dist-ckpt-optim-fully-reshardable`` not given) as flat
gradient-bucket tensors, one per state key, per model-parallel rank g and buffer i::

    optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<i>.dtype_<(param, grad dtype)>.bucket_idx_<b>.<key>
        key: param (fp32 main weights), exp_avg, exp_avg_sq; length: the bucket's unpadded size
    optimizer.distributed.dp_group_idx_<g>.optimizer/shard_0_1   bytes: the torch optimizer's param_groups
        (with Adam's ``step``; params removed) and, for fp16, ``grad_scaler`` next to it
    common.pt["optimizer"]["param_state_sharding_type"]          "dp_reshardable"

Which parameter sits where is not recorded: megatron-core's DistributedDataParallel lays
the module's ``named_parameters()`` out in reverse order, each start padded to a multiple
of 64 elements, and closes a bucket after the parameter that reaches its ``bucket_size``
(the padding to the data-parallel size after each bucket is not saved). This module
rebuilds that order for megatron-core's local layer spec (``--transformer-impl local``) and
a checkpoint of tensor and pipeline size 1, and accepts it only when the walk ends each
bucket exactly where the checkpoint's bucket tensors end. Anything else (transformer_engine
modules, whose registration order is not verified here; tp or pp > 1; virtual stages;
experts; other sharding modes) raises :class:`Unmappable`: the caller loads the weights only.
"""
from __future__ import annotations

import io
import math
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from megalite.checkpointing.interchange import OUTPUT, WORD, full_shape, layer_names, layer_prefix, post_names, \
    pre_names
from megalite.checkpointing.layout import chunk_blocks
from megalite.checkpointing.megatron import qkv_from_megatron
from megalite.checkpointing.safe_load import CheckpointError, SafeFileSystemReader
from megalite.checkpointing.sharded import quiet_single_process
from megalite.checkpointing.torch_dist import TorchDistSource

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
_BUCKET = re.compile(r"(chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                     r"\.bucket_idx_(\d+)\.(\w+)")
_PARAM_GROUPS = "optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"
_SCALER = "optimizer.distributed.dp_group_idx_0.grad_scaler/shard_0_1"
# megatron-core's TransformerLayer (local spec) registers its modules in this order; Attention
# builds linear_proj before SelfAttention adds linear_qkv
_LOCAL_LAYER_ORDER = ("input_layernorm", "self_attention.linear_proj", "self_attention.linear_qkv",
                      "pre_mlp_layernorm", "mlp.linear_fc1", "mlp.linear_fc2")

__all__ = ["Unmappable", "read_distributed_optimizer", "local_optimizer_state", "load_torch_dist_optimizer"]


class Unmappable(Exception):
    """The optimizer state is there but cannot be mapped exactly; the message says why (one clause)."""


def _megatron_order(cfg, vocab_rows: int) -> List[Tuple[str, Tuple[int, ...]]]:
    """megalite's global names in megatron-core GPTModel's ``named_parameters()`` order, with Megatron's
    shapes (padded vocabulary rows)."""
    rel = layer_names(cfg)
    in_layer = [n for m in _LOCAL_LAYER_ORDER for n in rel if n.rpartition(".")[0] == m]
    names = pre_names(cfg) + [layer_prefix(i) + n for i in range(cfg.num_layers) for n in in_layer]
    names += post_names(cfg)
    return [(n, (vocab_rows,) + full_shape(cfg, n)[1:] if n in (WORD, OUTPUT) else full_shape(cfg, n))
            for n in names]


def _bucket_layout(order, sizes: Sequence[int]) -> Dict[str, Tuple[int, int, int]]:
    """name -> (bucket, start, end) as megatron-core's _ParamAndGradBuffer places it, checked against
    the saved (unpadded) bucket lengths."""
    out, b, pos = {}, 0, 0
    for name, shape in reversed(order):
        if b >= len(sizes):
            raise Unmappable(f"its buckets end before parameter {name}")
        pos = -(-pos // 64) * 64
        end = pos + math.prod(shape)
        if end > sizes[b]:
            raise Unmappable(f"parameter {name} would cross the end of bucket {b} ({sizes[b]} elements)")
        out[name] = (b, pos, end)
        b, pos = (b + 1, 0) if end == sizes[b] else (b, end)
    if b != len(sizes):
        raise Unmappable(f"{len(sizes) - b} bucket(s) are left over after the last parameter")
    return out


class _BytesPlanner(DefaultLoadPlanner):
    """Keeps each bytes item as it is stored: it is unpickled with the allow-list, never by DCP."""

    def __init__(self):
        super().__init__()
        self.raw: Dict[str, bytes] = {}

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.raw[read_item.dest_index.fqn] = value.read()


def _read_object(d: str, key: str):
    planner = _BytesPlanner()
    try:
        with quiet_single_process():
            dcp.load({key: io.BytesIO()}, storage_reader=SafeFileSystemReader(d), planner=planner, no_dist=True)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - DCP wraps a damaged file in its own exception types
        first = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        raise CheckpointError(f"reading {key} of {d} failed ({first[:160]}); the checkpoint is damaged") from None
    try:
        obj = torch.load(io.BytesIO(planner.raw[key]), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - the weights-only unpickler's refusal or a damaged item
        raise CheckpointError(f"refusing to load {key} of {d}: {str(e).strip().splitlines()[0][:160]}; only load "
                              f"checkpoints you trust to be data") from None
    return obj[0] if isinstance(obj, list) and len(obj) == 1 else obj  # megatron-core saves [object]


def _check_supported(src) -> Dict[int, List[str]]:
    """The bucket keys of a mappable checkpoint (bucket -> its keys); Unmappable says what is not."""
    opt = src.common.get("optimizer")
    mode = opt.get("param_state_sharding_type") if isinstance(opt, dict) else None
    if mode is None:
        raise Unmappable("it holds no distributed-optimizer state (saved with --no-save-optim or without "
                         "--use-distributed-optimizer)")
    if mode != "dp_reshardable":
        raise Unmappable(f"its optimizer state is in {mode!r} mode (only Megatron-LM's default dp_reshardable is read)")
    a = src.args
    for flag, ok in (("tensor_model_parallel_size", 1), ("pipeline_model_parallel_size", 1)):
        if (getattr(a, flag, 1) or 1) != ok:
            raise Unmappable(f"it was saved with --{flag.replace('_', '-')} {getattr(a, flag)} (only 1 is mapped)")
    if getattr(a, "virtual_pipeline_model_parallel_size", None) or getattr(a, "num_experts", None):
        raise Unmappable("it was saved with virtual pipeline stages or experts")
    if getattr(a, "transformer_impl", "transformer_engine") != "local":
        raise Unmappable("it was saved with --transformer-impl transformer_engine, whose parameter order in the "
                         "optimizer's buckets is not mapped (only the local spec is)")
    buckets: Dict[int, List[str]] = {}
    for key in src.md.state_dict_metadata:
        m = _BUCKET.fullmatch(key)
        if m is None:
            continue
        if m.group(1) or m.group(2) != "0" or m.group(3) != "0":
            raise Unmappable(f"it holds {key!r} (several optimizers, model-parallel ranks or buffers)")
        buckets.setdefault(int(m.group(5)), []).append(key)
    if not buckets or sorted(buckets) != list(range(len(buckets))):
        raise Unmappable("its bucket tensors are missing or not numbered 0..n-1")
    return buckets


def read_distributed_optimizer(src, wanted: Optional[set] = None) -> dict:
    """The full optimizer state in ``src`` (a TorchDistSource): ``{"state": {megalite name: {param,
    exp_avg, exp_avg_sq} in megalite's layout, vocabulary rows only}, "step": Adam's step count,
    "scaler": Megatron's grad-scaler state or None}``; only the names in ``wanted`` (default all).

    Raises :class:`Unmappable` when the layout cannot be rebuilt exactly, CheckpointError when
    the file is damaged or holds code.
    """
    buckets = _check_supported(src)
    md = src.md.state_dict_metadata
    sizes = []
    for b in range(len(buckets)):
        lengths = {tuple(md[k].size) for k in buckets[b]}
        keys = {k.rpartition(".")[2] for k in buckets[b]}
        if len(lengths) != 1 or not set(STATE_KEYS) <= keys:
            raise Unmappable(f"bucket {b} does not hold param, exp_avg and exp_avg_sq of one length")
        sizes.append(next(iter(lengths))[0])
    cfg = src.cfg
    layout = _bucket_layout(_megatron_order(cfg, tuple(md[WORD].size)[0]), sizes)
    names = [n for n in layout if wanted is None or n in wanted]
    regions, spans = {}, {}
    for b in range(len(buckets)):  # per bucket one read spanning the parameters wanted
        inside = [layout[n][1:] for n in names if layout[n][0] == b]
        if inside:
            spans[b] = (min(s for s, _ in inside), max(e for _, e in inside))
            for k in buckets[b]:
                if k.rpartition(".")[2] in STATE_KEYS:
                    regions[k] = ((spans[b][0],), (spans[b][1] - spans[b][0],))
    got = src.read_regions(regions)
    key_of = {(b, k.rpartition(".")[2]): k for b in buckets for k in buckets[b]}
    state = {}
    shapes = dict(_megatron_order(cfg, tuple(md[WORD].size)[0]))
    for n in names:
        b, s, e = layout[n]
        shape = shapes[n]
        entry = {}
        for k in STATE_KEYS:
            t = got[key_of[(b, k)]][s - spans[b][0]:e - spans[b][0]].float().view(shape)
            if n in (WORD, OUTPUT):
                t = t[:cfg.vocab_size]
            elif ".linear_qkv." in n:
                t = qkv_from_megatron(cfg, t)
            entry[k] = t
        state[n] = entry
    _check_against_weights(src, state)
    groups = _read_object(src.dir, _PARAM_GROUPS) if _PARAM_GROUPS in _bytes_keys(md) else {}
    if not isinstance(groups, dict):
        raise Unmappable(f"its {_PARAM_GROUPS} is a {type(groups).__name__}, not the optimizer's settings")
    steps = {g.get("step") for g in (groups.get("param_groups") or []) if isinstance(g, dict)} - {None}
    if len(steps) != 1:
        raise Unmappable("its param_groups do not record one Adam step count")
    step = next(iter(steps))
    scaler = _read_object(src.dir, _SCALER) if _SCALER in _bytes_keys(md) else None
    return {"state": state, "step": float(step.item() if torch.is_tensor(step) else step), "scaler": scaler}


def _check_against_weights(src, state: Dict[str, Dict[str, torch.Tensor]]) -> None:
    """Refuse the rebuilt layout unless every parameter's fp32 main copy is the weight saved beside it.

    The bucket boundaries alone cannot tell two same-sized parameters apart (a norm's weight and bias,
    or another megatron-core version's build order); the model's own weights can.
    """
    layers = sorted({int(n.split(".")[2]) for n in state if n.startswith("decoder.layers.")})
    weights = {**src.pre(), **src.post(),
               **{f"decoder.layers.{i}.{n}": t for i in layers for n, t in src.layer(i).items()}}
    for name, entry in state.items():
        w = weights.get(name)
        if w is None or not torch.equal(entry["param"].to(w.dtype), w):
            raise Unmappable(f"the optimizer's fp32 copy of {name} is not the weight saved beside it, so its "
                             f"bucket layout is not the one megalite rebuilds")


def _bytes_keys(md) -> set:
    return {k for k, v in md.items() if not hasattr(v, "size")}


def local_optimizer_state(full: dict, chunks: Sequence[nn.Module]) -> Dict[str, Dict[str, torch.Tensor]]:
    """This rank's parameters' state (any tp/pp/vp) cut from :func:`read_distributed_optimizer`'s global
    tensors, as ``MegatronOptimizer.load_full_state_dict`` takes it (vocabulary padding zero)."""
    params = {(i, n): p for i, c in enumerate(chunks) for n, p in c.named_parameters()}
    step = torch.tensor(full["step"], dtype=torch.float32)
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, blocks in chunk_blocks(chunks, for_write=False).items():
        entry = {k: torch.zeros(params[key].shape, dtype=torch.float32) for k in STATE_KEYS}
        for b in blocks:
            where = tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))
            for k in STATE_KEYS:
                b.local(entry[k]).copy_(full["state"][b.name][k][where])
        out[key[1]] = {**entry, "step": step.clone()}
    return out


def scaler_state(saved) -> Optional[dict]:
    """Megatron's DynamicGradScaler state as megalite's scaler takes it, or None when not recorded."""
    if not isinstance(saved, dict) or not {"scale", "growth_tracker", "hysteresis_tracker"} <= set(saved):
        return None
    scale = saved["scale"]
    return {"scale": float(scale.item() if torch.is_tensor(scale) else scale),
            "growth_tracker": int(saved["growth_tracker"]), "hysteresis_tracker": int(saved["hysteresis_tracker"])}


def load_torch_dist_optimizer(src: TorchDistSource, chunks: Sequence[nn.Module], optimizer) -> Optional[str]:
    """Load the distributed-optimizer state of ``src`` (:func:`torch_dist.open_for_run`) into ``optimizer``
    (this rank's parameters, any layout): fp32 main weights, Adam moments and step, the fp16 loss scaler as far as
    recorded. Returns None when loaded, else why not (the weights stay as loaded). No collective."""
    wanted = {b.name for blocks in chunk_blocks(chunks, for_write=False).values() for b in blocks}
    try:
        full = read_distributed_optimizer(src, wanted)
    except Unmappable as e:
        return str(e)
    optimizer.load_full_state_dict(local_optimizer_state(full, chunks))
    scaler = scaler_state(full["scaler"])
    optimizer.load_step_state({"group_steps": [full["step"] if "step" in g else None
                                               for g in optimizer.param_groups], "scaler": scaler})
    return None
