"""Megatron-Core's distributed-optimizer state in a torch_dist checkpoint, as megalite's optimizer state.

Megatron-LM's ``save_checkpoint`` stores the distributed optimizer in its default
``dp_reshardable`` mode (``--dist-ckpt-optim-fully-reshardable`` not given) as flat
gradient-bucket tensors, one per state key, per model-parallel rank g and buffer i::

    optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<i>.dtype_<(param, grad dtype)>.bucket_idx_<b>.<key>
        key: param (fp32 main weights), exp_avg, exp_avg_sq; length: the bucket's unpadded size
    optimizer.distributed.dp_group_idx_<g>.optimizer/shard_0_1   bytes: the torch optimizer's param_groups
        (with Adam's ``step``; params removed) and, for fp16, ``grad_scaler`` next to it
    common.pt["optimizer"]["param_state_sharding_type"]          "dp_reshardable"

Which parameter sits where is not recorded; megatron_buckets.py rebuilds it (any tensor and
pipeline size, local or transformer_engine spec, tied embeddings split over the stages) and
this module joins each parameter's tp pieces from the ranks holding them.

With ``--dist-ckpt-optim-fully-reshardable`` each parameter's state is a global tensor beside
its weight, sharded like it, and the settings are plain values in common.pt::

    optimizer.state.<param|exp_avg|exp_avg_sq>.<the weight's key>
    common.pt["optimizer"]["optimizer"]["param_groups"], ["optimizer"]["grad_scaler"] (fp16)

Neither layout depends on the data- or context-parallel size (Megatron shards over dp x cp, but a
bucket is saved whole, without its padding to a multiple of that size), so a run saved with
--context-parallel-size > 1 maps the same way. Either way the state is used only when every
parameter's fp32 copy equals the weight saved beside it. Anything else (virtual stages, experts, other sharding modes, a layout that does
not check out) raises :class:`Unmappable`: the caller loads the weights only.
"""

from __future__ import annotations

import io
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from megalite.checkpointing.layout import chunk_blocks
from megalite.checkpointing.safe_load import CheckpointError, SafeFileSystemReader
from megalite.checkpointing.sharded import quiet_single_process
from megalite.interop.interchange import OUTPUT, WORD, layer_names, layer_prefix, merge_tp, post_names, pre_names
from megalite.interop.megatron import qkv_from_megatron
from megalite.interop.megatron_buckets import TIED_COPY, Unmappable, bucket_layout, rank_order
from megalite.interop.torch_dist import STACKED, TorchDistSource

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
_BUCKET = re.compile(
    r"(chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
    r"\.bucket_idx_(\d+)\.(\w+)"
)
_PARAM_GROUPS = "optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"
_SCALER = "optimizer.distributed.dp_group_idx_0.grad_scaler/shard_0_1"
_MODEL_SPACE = "optimizer.state."  # fully_reshardable: optimizer.state.<key>.<the weight's key>
_UNEVEN = (
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "pipeline_model_parallel_layout",
    "num_layers_per_virtual_pipeline_stage",
)

__all__ = ["Unmappable", "read_distributed_optimizer", "local_optimizer_state", "load_torch_dist_optimizer"]


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
        raise CheckpointError(
            f"refusing to load {key} of {d}: {str(e).strip().splitlines()[0][:160]}; only load "
            f"checkpoints you trust to be data"
        ) from None
    return obj[0] if isinstance(obj, list) and len(obj) == 1 else obj  # megatron-core saves [object]


def _check_supported(src) -> str:
    """The optimizer's sharding type when its layout can be mapped; Unmappable says what cannot."""
    opt = src.common.get("optimizer")
    mode = opt.get("param_state_sharding_type") if isinstance(opt, dict) else None
    if mode is None:
        raise Unmappable(
            "it holds no distributed-optimizer state (saved with --no-save-optim or without "
            "--use-distributed-optimizer)"
        )
    if mode not in ("dp_reshardable", "fully_reshardable"):
        raise Unmappable(f"its optimizer state is in {mode!r} mode (dp_reshardable and fully_reshardable are read)")
    a = src.args
    if (getattr(a, "virtual_pipeline_model_parallel_size", None) or 1) > 1 or getattr(a, "num_experts", None):
        raise Unmappable("it was saved with virtual pipeline stages or experts")
    if mode == "dp_reshardable":
        uneven = [f for f in _UNEVEN if getattr(a, f, None)]
        if uneven:
            raise Unmappable(f"it was saved with --{uneven[0].replace('_', '-')}, whose stage split is not mapped")
        if getattr(a, "transformer_impl", "transformer_engine") not in ("local", "transformer_engine"):
            raise Unmappable(
                f"it was saved with --transformer-impl {a.transformer_impl}, whose parameter order in "
                f"the optimizer's buckets is not mapped"
            )
    return mode


def _bucket_keys(src) -> Dict[int, Dict[int, Dict[str, str]]]:
    """model-parallel rank -> bucket -> state key -> checkpoint key, numbered 0..n-1 each."""
    out: Dict[int, Dict[int, Dict[str, str]]] = {}
    for key in src.md.state_dict_metadata:
        m = _BUCKET.fullmatch(key)
        if m is None:
            continue
        if m.group(1) or m.group(3) != "0":
            raise Unmappable(f"it holds {key!r} (several optimizers or gradient buffers)")
        out.setdefault(int(m.group(2)), {}).setdefault(int(m.group(5)), {})[m.group(6)] = key
    tp, pp = src.layout.tp, src.layout.pp
    if sorted(out) != list(range(tp * pp)) or any(sorted(b) != list(range(len(b))) for b in out.values()):
        raise Unmappable(f"its bucket tensors are not numbered 0..n-1 for each of its {tp * pp} model-parallel ranks")
    return out


def _dp_reshardable(src, wanted: Optional[set]) -> Dict[str, Dict[str, torch.Tensor]]:
    """Each parameter's state from the flat bucket tensors of every model-parallel rank, tp pieces joined."""
    cfg, lay, md = src.cfg, src.layout, src.md.state_dict_metadata
    keys, rows = _bucket_keys(src), tuple(md[WORD].size)[0]
    te = getattr(src.args, "transformer_impl", "transformer_engine") == "transformer_engine"
    stages = {r: rng for r, _, rng in lay.stages(cfg.num_layers)}
    places: Dict[str, Dict[int, Tuple[int, int, int, int]]] = {}  # name -> tp rank -> (m, bucket, start, end)
    for m in range(lay.tp * lay.pp):
        t, p = m % lay.tp, m // lay.tp
        sizes = []
        for b in range(len(keys[m])):
            lengths = {tuple(md[k].size) for k in keys[m][b].values()}
            if len(lengths) != 1 or not set(STATE_KEYS) <= set(keys[m][b]):
                raise Unmappable(f"bucket {b} of rank {m} does not hold param, exp_avg and exp_avg_sq of one length")
            sizes.append(next(iter(lengths))[0])
        order = rank_order(cfg, stages[p], p == 0, p == lay.pp - 1, rows, lay.tp, te)
        for name, (b, s, e) in bucket_layout(order, sizes).items():
            if name != TIED_COPY:
                places.setdefault(name, {})[t] = (m, b, s, e)
    names = [n for n in places if wanted is None or n in wanted]
    spans: Dict[Tuple[int, int], Tuple[int, int]] = {}
    for n in names:  # per bucket one read spanning the parameters wanted
        for m, b, s, e in places[n].values():
            lo, hi = spans.get((m, b), (s, e))
            spans[(m, b)] = (min(lo, s), max(hi, e))
    got = src.read_regions(
        {keys[m][b][k]: ((lo,), (hi - lo,)) for (m, b), (lo, hi) in spans.items() for k in STATE_KEYS}
    )
    shapes = {}
    for p in range(lay.pp):
        shapes.update({n: sh for n, sh, _ in rank_order(cfg, stages[p], p == 0, p == lay.pp - 1, rows, lay.tp, te)})
    state = {}
    for n in names:
        entry = {}
        for k in STATE_KEYS:
            shards = []
            for t in range(lay.tp):
                m, b, s, e = places[n][t]
                lo = spans[(m, b)][0]
                shards.append(got[keys[m][b][k]][s - lo : e - lo].float().view(shapes[n]))
            entry[k] = qkv_from_megatron(cfg, torch.cat(shards)) if ".linear_qkv." in n else merge_tp(cfg, n, shards)
        state[n] = entry
    return state


def _fully_reshardable(src, wanted: Optional[set]) -> Dict[str, Dict[str, torch.Tensor]]:
    """Each parameter's state from its own global tensors, stored beside the weights' keys."""
    cfg, md = src.cfg, src.md.state_dict_metadata
    names = pre_names(cfg) + [layer_prefix(i) + n for i in range(cfg.num_layers) for n in layer_names(cfg)]
    names = [n for n in names + post_names(cfg) if wanted is None or n in wanted]
    layers: Dict[str, List[int]] = {}  # stacked key -> the layers wanted
    regions = {}
    for n in names:
        stacked = n.startswith(STACKED)
        base = src.keys[n.split(".", 3)[3]] if stacked else n
        for k in STATE_KEYS:
            key = _MODEL_SPACE + f"{k}.{base}"
            if key not in md or tuple(getattr(md[key], "size", ())) != tuple(md[base].size):
                raise Unmappable(f"it has no tensor {key} shaped as {base}")
        if stacked:
            layers.setdefault(base, []).append(int(n.split(".")[2]))
        else:
            shape = tuple(md[base].size)
            shape = (cfg.vocab_size,) + shape[1:] if n in (WORD, OUTPUT) else shape
            regions.update({_MODEL_SPACE + f"{k}.{base}": ((0,) * len(shape), shape) for k in STATE_KEYS})
    for base, got in layers.items():
        lo, hi, rest = min(got), max(got) + 1, tuple(md[base].size)[1:]
        regions.update(
            {_MODEL_SPACE + f"{k}.{base}": ((lo,) + (0,) * len(rest), (hi - lo,) + rest) for k in STATE_KEYS}
        )
    got = src.read_regions(regions)
    state = {}
    for n in names:
        if n.startswith(STACKED):
            base, i = src.keys[n.split(".", 3)[3]], int(n.split(".")[2])
            entry = {k: got[_MODEL_SPACE + f"{k}.{base}"][i - min(layers[base])].float() for k in STATE_KEYS}
        else:
            entry = {k: got[_MODEL_SPACE + f"{k}.{n}"].float() for k in STATE_KEYS}
        state[n] = {k: qkv_from_megatron(cfg, v) if ".linear_qkv." in n else v for k, v in entry.items()}
    return state


def read_distributed_optimizer(src, wanted: Optional[set] = None) -> dict:
    """The full optimizer state in ``src`` (a TorchDistSource): ``{"state": {megalite name: {param,
    exp_avg, exp_avg_sq} in megalite's layout, vocabulary rows only}, "step": Adam's step count,
    "scaler": Megatron's grad-scaler state or None}``; only the names in ``wanted`` (default all).

    Raises :class:`Unmappable` when the layout cannot be rebuilt exactly, CheckpointError when
    the file is damaged or holds code.
    """
    mode = _check_supported(src)
    md = src.md.state_dict_metadata
    state = (_dp_reshardable if mode == "dp_reshardable" else _fully_reshardable)(src, wanted)
    _check_against_weights(src, state, mode)
    if mode == "fully_reshardable":  # the optimizer's settings and scaler are plain values in common.pt
        opt = src.common["optimizer"]
        groups, scaler = opt.get("optimizer", {}), opt.get("grad_scaler")
    else:
        groups = _read_object(src.dir, _PARAM_GROUPS) if _PARAM_GROUPS in _bytes_keys(md) else {}
        scaler = _read_object(src.dir, _SCALER) if _SCALER in _bytes_keys(md) else None
    if not isinstance(groups, dict):
        raise Unmappable(f"its optimizer settings are a {type(groups).__name__}, not the optimizer's param_groups")
    steps = {g.get("step") for g in (groups.get("param_groups") or []) if isinstance(g, dict)} - {None}
    steps = {float(s.item() if torch.is_tensor(s) else s) for s in steps}
    if len(steps) != 1:
        raise Unmappable("its param_groups do not record one Adam step count")
    return {"state": state, "step": next(iter(steps)), "scaler": scaler}


def _check_against_weights(src, state: Dict[str, Dict[str, torch.Tensor]], mode: str) -> None:
    """Refuse the rebuilt layout unless every parameter's fp32 main copy is the weight saved beside it.

    The bucket boundaries alone cannot tell two same-sized parameters apart (a norm's weight and bias,
    or another megatron-core version's build order); the model's own weights can.
    """
    layers = sorted({int(n.split(".")[2]) for n in state if n.startswith("decoder.layers.")})
    weights = {
        **src.pre(),
        **src.post(),
        **{f"decoder.layers.{i}.{n}": t for i in layers for n, t in src.layer(i).items()},
    }
    for name, entry in state.items():
        w = weights.get(name)
        if w is None or not torch.equal(entry["param"].to(w.dtype), w):
            how = (
                f"bucket layout is not the one megalite rebuilds for --transformer-impl "
                f"{getattr(src.args, 'transformer_impl', 'transformer_engine')}"
                if mode == "dp_reshardable"
                else "state is not the model's"
            )
            raise Unmappable(f"the optimizer's fp32 copy of {name} is not the weight saved beside it, so its {how}")


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
    return {
        "scale": float(scale.item() if torch.is_tensor(scale) else scale),
        "growth_tracker": int(saved["growth_tracker"]),
        "hysteresis_tracker": int(saved["hysteresis_tracker"]),
    }


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
    optimizer.load_step_state(
        {"group_steps": [full["step"] if "step" in g else None for g in optimizer.param_groups], "scaler": scaler}
    )
    return None
