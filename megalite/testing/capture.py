"""One training iteration's tensors, captured on every rank as boxes of full, layout-free tensors.

The parity machinery of tools/compare_runs.py (megalite.analysis.divergence reads and compares
what this writes). One iteration of a built Trainer runs as ``train_step`` runs it, up to
``finalize_grads`` (no clipping, no optimizer step), and records, under global names::

    weight      every parameter as the forward used it      decoder.layers.1.mlp.linear_fc1.weight
    activation  the embedding's output, each layer's output, the final norm's output, the logits, the loss
    act_grad    the gradient of the global batch's loss with respect to each of those activations
                (layer L's output gradient is layer L+1's input gradient); the executor's 1/m and the
                fp16 loss scale are divided out and the replicas' (dp x cp) averaging applied, so it
                does not depend on the layout
    grad        each parameter's main_grad after finalize_grads (DP-reduced, tied embeddings and
                sequence-parallel norms summed), divided by the fp16 loss scale

Each rank writes ``rank_<R>.pt``: {"meta": ..., "pieces": [...]}; a piece is one box of a full
tensor: kind, name, shape (the full tensor's), offsets, data (float32, CPU), index (the parameter's
place on its rank, for ordering). Activations are [s, global batch, h] (logits [s, global batch,
vocab]) with samples in the global batch's order: a micro-batch's box sits at its samples'
place (PretrainingSampler's order), a sequence-parallel shard and a context-parallel rank's two
chunks at their positions, a vocab shard at its rows (padding dropped). Parameters are cut as the
sharded checkpoint cuts them (checkpointing.layout.param_blocks, for_write) and written by the
first replica (dp x cp rank 0; expert DP rank 0 for a routed expert): every element is written by exactly
one rank.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megalite.checkpointing.layout import param_blocks
from megalite.config.checks import check_perturb_found
from megalite.context_parallel.sequence import cp_token_index
from megalite.data.samplers import PretrainingSampler
from megalite.parallel.agreement import flag_on_any_rank
from megalite.pipeline.actions import Compute
from megalite.tensor_parallel.random import full_normal
from megalite.training.mock import MockFeed
from megalite.training.trainer import Trainer

CAPTURE_VERSION = 1


class _Recorder:
    """Hooks on one rank's chunks that keep each micro-batch's activations and their gradients."""

    def __init__(self, trainer):
        self.trainer, ps, cfg = trainer, trainer.ps, trainer.cfg
        self.pieces: List[dict] = []
        self.handles: list = []
        self.grad_div = trainer.optimizer.grads.dp.size * trainer.optimizer.loss_scale
        t = cfg.train
        self.gbs, self.s, self.vocab = t.global_batch_size, cfg.model.seq_length, cfg.model.vocab_size
        consumed = trainer.state.consumed_samples
        sampler = PretrainingSampler(consumed + self.gbs, consumed, t.micro_batch_size, ps.dp_rank, ps.dp_size)
        self.sample_offset = [mb[0] - consumed for mb in sampler][: trainer.m]  # micro-batch -> first sample
        self.tp_rank = ps.tp_rank
        cp = getattr(ps, "cp", None)  # global position of each local token (CP: chunks r and 2CP-1-r)
        self.positions = (
            cp_token_index(self.s, cp.size, cp.rank) if cp is not None and cp.size > 1 else torch.arange(self.s)
        ).tolist()
        layout, actions = trainer.executor.layout, trainer.actions
        has_w = any(isinstance(a, Compute) and a.kind == "W" for a in actions)
        self.forward_order, self.backward_order = [], []
        for c in range(len(trainer.chunks)):
            whole_in_w = has_w and layout.stage(ps.pp_rank, c) == 0 and layout.whole_first_backward

            def mbs(kind: str, c: int = c) -> list:
                return [a.mb for a in actions if isinstance(a, Compute) and a.kind == kind and a.chunk == c]

            self.forward_order.append(mbs("F"))
            self.backward_order.append(mbs("W" if whole_in_w else "B"))
        self.mb: Dict[int, Optional[int]] = {}  # chunk -> micro-batch whose forward runs now (None: outside)
        self.forwards: Dict[int, int] = defaultdict(int)
        self.recomputed_grads: Dict[str, int] = defaultdict(int)
        for c, chunk in enumerate(trainer.chunks):
            self._hook_chunk(c, chunk)

    # -- hooks ---------------------------------------------------------------------------------
    def _hook_chunk(self, c: int, chunk) -> None:
        def pre(_module, _args):
            self.mb[c] = self.forward_order[c][self.forwards[c]]
            self.forwards[c] += 1

        def post(_module, _args, out):
            if chunk.post_process:  # logits [s, b, V/tp], vocab-sharded, whole sequence
                self._activation(c, "logits", out, seq_sharded=False, vocab_sharded=True)
            self.mb[c] = None

        self.handles += [chunk.register_forward_pre_hook(pre), chunk.register_forward_hook(post)]
        sp = chunk.sequence_parallel
        if chunk.pre_process:
            embed = chunk.embed

            def embed_and_record(*args, **kwargs):
                x = embed(*args, **kwargs)
                self._activation(c, "embedding", x, seq_sharded=sp)
                return x

            chunk.embed = embed_and_record  # an instance attribute: ``restore`` deletes it
        for idx, layer in chunk.decoder.layers.items():
            self.handles.append(
                layer.register_forward_hook(
                    lambda _m, _a, out, name=f"decoder.layers.{idx}": self._activation(c, name, out, seq_sharded=sp)
                )
            )
        if chunk.post_process:
            self.handles.append(
                chunk.decoder.final_layernorm.register_forward_hook(
                    lambda _m, _a, out: self._activation(c, "decoder.final_layernorm", out, seq_sharded=sp)
                )
            )

    def _activation(self, c: int, name: str, x: torch.Tensor, seq_sharded: bool, vocab_sharded: bool = False):
        mb = self.mb.get(c)
        if mb is None:  # a recomputation in backward: the value was kept in the forward; hook its gradient
            if x.requires_grad:

                def on_grad(g, name=name):
                    mb_b = self.backward_order[c][self.recomputed_grads[name]]
                    self.recomputed_grads[name] += 1
                    self._box("act_grad", name, g, mb_b, seq_sharded, vocab_sharded)

                x.register_hook(on_grad)
            return
        self._box("activation", name, x, mb, seq_sharded, vocab_sharded)
        if x.requires_grad:
            x.register_hook(lambda g: self._box("act_grad", name, g, mb, seq_sharded, vocab_sharded))

    def _box(self, kind: str, name: str, x: torch.Tensor, mb: int, seq_sharded: bool, vocab_sharded: bool):
        if not (seq_sharded or vocab_sharded) and self.tp_rank != 0:
            return  # replicated over TP: written once
        data = x.detach().float()
        if kind == "act_grad":
            data = data / self.grad_div
        shape, cols = [self.s, self.gbs] + list(x.shape[2:]), []
        if vocab_sharded:
            start = x.shape[2] * self.tp_rank
            real = max(0, min(x.shape[2], self.vocab - start))
            if real == 0:
                return
            data, shape[2], cols = data[:, :, :real], self.vocab, [start]
        n = x.shape[0]
        positions = self.positions[n * self.tp_rank : n * (self.tp_rank + 1)] if seq_sharded else self.positions
        for first, lo, length in _runs(positions[:n]):  # CP: this rank's two chunks of the sequence
            offsets = [first, self.sample_offset[mb]] + cols
            offsets += [0] * (len(shape) - len(offsets))
            self.pieces.append(
                {
                    "kind": kind,
                    "name": name,
                    "shape": tuple(shape),
                    "offsets": tuple(offsets),
                    "data": data[lo : lo + length].cpu().clone(),
                    "index": 0,
                }
            )

    def restore(self) -> None:
        for h in self.handles:
            h.remove()
        for chunk in self.trainer.chunks:
            chunk.__dict__.pop("embed", None)


def _runs(positions: List[int]) -> List[Tuple[int, int, int]]:
    """Contiguous runs of global positions: (first position, first local row, length)."""
    runs: List[Tuple[int, int, int]] = []
    for i, pos in enumerate(positions):
        if runs and runs[-1][0] + runs[-1][2] == pos:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((pos, i, 1))
    return runs


def _first_replica(trainer, p) -> bool:
    """This rank writes ``p``: the first of its replicas, over dp x cp for a dense parameter and over
    expert DP for a routed expert's (an expert lives on one EP rank, which dp x cp rank 0 may not be)."""
    ps = trainer.ps
    return (ps.edp_rank if getattr(p, "expert_parallel", False) else trainer.optimizer.grads.dp.rank) == 0


def _param_pieces(trainer, kind: str, values: Dict[int, torch.Tensor]) -> List[dict]:
    """Boxes of full parameters (``values``: id(param) -> the local tensor to cut) this rank writes."""
    out, index = [], 0
    for chunk in trainer.chunks:
        for name, p in chunk.named_parameters():
            index += 1
            if not _first_replica(trainer, p):
                continue
            for b in param_blocks(chunk, name, p, for_write=True):
                data = b.local(values[id(p)]).detach().float().cpu().clone()
                out.append(
                    {
                        "kind": kind,
                        "name": b.name,
                        "shape": b.global_shape,
                        "offsets": b.offsets,
                        "data": data.reshape(b.sizes),
                        "index": index,
                    }
                )
    return out


def _full_main_grads(trainer) -> Dict[int, torch.Tensor]:
    """Every parameter's reduced main_grad on this rank, read from its own buffer: the dense one (over
    dp x cp) or, in a mixture of experts, the experts' (over expert DP). A buffer whose gradients the
    distributed optimizer sharded holds only this rank's shards reduced, so they are gathered over
    that buffer's group (one all-reduce of a copy)."""
    scale = trainer.optimizer.loss_scale
    out: Dict[int, torch.Tensor] = {}
    for part in trainer.optimizer.grads.parts:
        flat = part.grad_data
        if part.shard_grads and part.dp.size > 1:
            flat = torch.zeros_like(part.grad_data)
            for b in part.buckets:
                flat[b.shard[0] : b.shard[1]] = part.grad_data[b.shard[0] : b.shard[1]]
            dist.all_reduce(flat, group=part.dp.group)
        out.update({id(p): flat[a:e].view_as(p).float() / scale for p, (a, e) in part.index.items()})
    return out


def perturb_parameter(trainer, name: str, eps: float) -> bool:
    """Add ``eps`` x a fixed standard-normal pattern (drawn from ``name``: the same full tensor in every
    layout) to global parameter ``name`` where this rank holds it, the tied output copy included.
    compare_runs's self-test hook: the run must then diverge there first. True if this rank holds it."""
    found = False
    with torch.no_grad():
        for chunk in trainer.chunks:
            for local, p in chunk.named_parameters():
                for b in param_blocks(chunk, local, p, for_write=False):
                    if b.name != name:
                        continue
                    noise = full_normal(b.global_shape, 1.0, 0, f"perturb {name}")
                    box = tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))
                    b.local(p.data).add_(noise[box].to(p.device, p.dtype), alpha=eps)
                    found = True
    return found


def capture_step(
    trainer, batches: list, out_dir: str, perturb: Optional[Tuple[str, float]] = None, argv: Optional[List[str]] = None
) -> Optional[float]:
    """Run one iteration of ``trainer`` on ``batches`` (this rank's micro-batch dicts) and write this
    rank's ``rank_<R>.pt`` under ``out_dir``. Collective: every rank calls it. Returns the loss
    (last stage; None elsewhere). ``perturb`` = (name, eps) alters that parameter first."""
    ps, cfg = trainer.ps, trainer.cfg
    par = cfg.parallel
    if perturb is not None:
        held = perturb_parameter(trainer, *perturb)
        check_perturb_found(perturb[0], flag_on_any_rank(held, ps))
    trainer.optimizer.finish_param_gather()
    write_dp = trainer.optimizer.grads.dp.rank == 0
    pieces = _param_pieces(trainer, "weight", {id(p): p for p in trainer.params})
    recorder = _Recorder(trainer)
    try:
        for c in trainer.chunks:
            c.train()
        trainer.optimizer.zero_grad(trainer.m)
        stats = trainer.executor.run(
            trainer.actions, lambda mb: batches[mb], trainer.m, loss_scale=trainer.optimizer.loss_scale
        )
        trainer.optimizer.finalize_grads()
    finally:
        recorder.restore()
    loss = trainer._loss(stats.losses)
    main_grads = _full_main_grads(trainer)
    pieces += recorder.pieces
    pieces += _param_pieces(trainer, "grad", main_grads)
    holds_head = any(c.post_process for c in trainer.chunks)
    if loss is not None and holds_head and ps.tp_rank == 0 and write_dp:
        pieces.append(
            {
                "kind": "activation",
                "name": "loss",
                "shape": (1,),
                "offsets": (0,),
                "data": torch.tensor([float(loss)]),
                "index": 0,
            }
        )
    meta = {
        "version": CAPTURE_VERSION,
        "rank": ps.rank,
        "world": ps.world_size,
        "tp": ps.tp_size,
        "cp": getattr(par, "cp", 1),
        "pp": ps.pp_size,
        "dp": ps.dp_size,
        "vp": par.vp,
        "sequence_parallel": bool(par.sequence_parallel),
        "dtype": str(cfg.model.torch_dtype).replace("torch.", ""),
        "num_layers": cfg.model.num_layers,
        "micro_batches": trainer.m,
        "global_batch_size": cfg.train.global_batch_size,
        "schedule": trainer.schedule_name,
        "argv": list(argv or []),
        "perturb": list(perturb) if perturb else None,
    }
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"rank_{ps.rank:05d}.pt")
    torch.save({"meta": meta, "pieces": pieces}, path + ".tmp")
    os.replace(path + ".tmp", path)
    return loss


def capture_mock(ps, cfg, out_dir: str, perturb: Optional[Tuple[str, float]] = None) -> Optional[float]:
    """Build a Trainer for ``cfg`` and capture its first iteration on mock data (tests: run_distributed's fn)."""
    trainer = Trainer(cfg, ps)
    return capture_step(trainer, MockFeed(trainer, 1).next(), out_dir, perturb)
