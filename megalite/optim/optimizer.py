"""The optimizer layer: gradient buffer, fp32 main weights, finalize, clip, loss scale, step.

::

    model params (fp32 | bf16 | fp16)  --.main_grad-->  GradBuffer (fp32 or param dtype)
          ^                                                  | finalize_grads():
          | copy / all-gather                                |   tied-embedding sum (embedding group)
          |                                                  |   dp x cp all-reduce | reduce-scatter
    main params: fp32 pieces  <--.grad = main_grad slice-----+   sequence-parallel norm grads (tp)
      plain optimizer: one piece per parameter
      distributed (ZeRO-1): the pieces of this rank's 1/(dp x cp) shard of every bucket
    step(): unscale + found-inf (fp16) -> global norm, clip -> Adam on the pieces -> copy back

Megatron's MixedPrecision/Distributed optimizer in one class: the only
difference the distributed optimizer makes is which elements a rank owns and
whether the reduction is an all-reduce or a reduce-scatter + all-gather.
NVIDIA apex's FusedAdam is used when importable on a GPU run; torch's fused
AdamW on CUDA otherwise, foreach AdamW on CPU.

"The replicas" are the ranks holding the same model shard: dp x cp (``ps.dp_cp``).
The CP ranks of a replica see different tokens of the same samples, so their
gradients are partial sums like other replicas' and are averaged with them; the
distributed optimizer shards over the same group.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megalite.config import OptimConfig
from megalite.data_parallel.fsdp import DTensor, FSDPGrads, ShardedPart, local_shard_range
from megalite.data_parallel.grad_buffer import GradBuffer
from megalite.data_parallel.grad_buffers import GradBuffers
from megalite.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megalite.parallel.state import ParallelState
from megalite.tensor_parallel.layers import is_counted_once, per_expert_names

try:
    from apex.optimizers import FusedAdam as _ApexFusedAdam  # type: ignore
except Exception:  # noqa: BLE001
    _ApexFusedAdam = None


class _Piece:
    """Elements [start, end) of one model parameter's flat view, owned by this rank's optimizer."""

    def __init__(self, name: str, param: nn.Parameter, start: int, end: int, main: torch.Tensor):
        self.name, self.param, self.start, self.end, self.main = name, param, start, end, main

    @property
    def model_slice(self) -> torch.Tensor:
        return self.param.data.view(-1)[self.start : self.end]

    @property
    def grad_slice(self) -> torch.Tensor:
        return self.param.main_grad.view(-1)[self.start : self.end]


class _ShardPiece(_Piece):
    """An FSDP shard (data_parallel/fsdp.py): the shard itself, fp32, is the main weight; its gradient is the
    reduced shard FSDP leaves in ``param.grad``. ``model_slice`` is the weight in the compute dtype (a copy
    when that is 16-bit: what a checkpoint stores as the model's)."""

    def __init__(self, name: str, param: nn.Parameter, dtype: torch.dtype):
        start, end = local_shard_range(param)
        # shares the shard's storage: the optimizer's step updates the weight FSDP gathers next
        super().__init__(name, param, start, end, nn.Parameter(param._local_tensor.detach()))
        self.dtype = dtype

    @property
    def model_slice(self) -> torch.Tensor:
        flat = self.main.detach().view(-1)
        return flat if self.dtype == torch.float32 else flat.to(self.dtype)

    @property
    def grad_slice(self) -> torch.Tensor:
        g = self.param.grad
        return g._local_tensor.view(-1) if g is not None else torch.zeros_like(self.main).view(-1)


def _grad_of(p: nn.Parameter) -> torch.Tensor:
    """Where a parameter's gradient is accumulated: the grad buffer's ``main_grad``, or this rank's reduced
    FSDP shard (every rank of a TP or embedding group shards a replicated parameter alike)."""
    if hasattr(p, "main_grad"):
        return p.main_grad
    if p.grad is None:  # unused in this step: FSDP gave it no gradient
        p.grad = torch.zeros_like(p)
    return p.grad._local_tensor


def param_groups(params: Sequence[nn.Parameter], weight_decay: float) -> List[dict]:
    """Split parameters into decayed (matrices) and non-decayed (biases, norms) groups."""
    decay = [p for p in params if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in params if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _adamw(groups: List[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    kwargs = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    on_cuda = any(p.is_cuda for g in groups for p in g["params"])
    if on_cuda and _ApexFusedAdam is not None:
        return _ApexFusedAdam(groups, adam_w_mode=True, **kwargs)
    if on_cuda:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    return torch.optim.AdamW(groups, foreach=True, **kwargs)


def build_optimizer(params: Sequence[nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """Plain AdamW over ``params`` with Megatron's weight-decay groups (no main weights)."""
    return _adamw(param_groups(params, cfg.weight_decay), cfg)


class MegatronOptimizer:
    """Everything between backward and the next forward, for one rank's model chunks."""

    def __init__(
        self,
        named_params: Sequence[Tuple[str, nn.Parameter]],
        cfg: OptimConfig,
        ps: ParallelState,
        *,
        shared: Sequence[nn.Parameter] = (),
        sequence_parallel_params: Sequence[nn.Parameter] = (),
        moe: bool = False,
        grads: Optional[FSDPGrads] = None,
    ):
        """``grads``: the gradient side FSDP2 gives (data_parallel/fsdp.py); None builds the grad buffers."""
        self.cfg, self.ps = cfg, ps
        self.named = [(n, p) for n, p in named_params if p.requires_grad]
        self.params = [p for _, p in self.named]
        self.shared, self.sp_params = list(shared), [p for p in sequence_parallel_params if p.requires_grad]
        self.fsdp = grads if isinstance(grads, FSDPGrads) else None
        dtype = self.fsdp.compute_dtype if self.fsdp is not None else self.params[0].dtype
        self.dtype = dtype  # the compute dtype: 16-bit runs keep fp32 main weights
        self.half = dtype in (torch.bfloat16, torch.float16)
        # ZeRO-1, or FSDP (which shards the main weights as well): the norm sums over the replicas
        self.distributed = (cfg.use_distributed_optimizer or self.fsdp is not None) and ps.dp_cp_size > 1
        experts = [p for p in self.params if getattr(p, "expert_parallel", False)]  # MoE: their own replicas
        self.has_experts = moe or bool(experts)  # the model's, not this stage's: the norm's collective differs
        self.grads = grads if grads is not None else self._grad_buffers(dtype, experts)
        self.pieces = self._build_pieces()
        groups = [
            {"params": [pc.main for pc in self.pieces if pc.param.ndim > 1], "weight_decay": cfg.weight_decay},
            {"params": [pc.main for pc in self.pieces if pc.param.ndim <= 1], "weight_decay": 0.0},
        ]
        self.optimizer = _adamw([g for g in groups if g["params"]], cfg)
        self.scaler = None
        if dtype == torch.float16:
            self.scaler = (
                ConstantGradScaler(cfg.loss_scale)
                if cfg.loss_scale
                else DynamicGradScaler(
                    cfg.initial_loss_scale, cfg.min_loss_scale, cfg.loss_scale_window, cfg.hysteresis
                )
            )

    def _grad_buffers(self, dtype: torch.dtype, experts: List[nn.Parameter]) -> GradBuffers:
        """The dense parameters' buffer (over dp x cp) and, in an MoE, the experts' (over expert DP)."""
        cfg, ps = self.cfg, self.ps
        fp32_grads = dtype == torch.float32 or cfg.accumulate_allreduce_grads_in_fp32 or dtype == torch.bfloat16
        buffer = dict(
            grad_dtype=torch.float32 if fp32_grads else dtype,
            bucket_elements=cfg.ddp_bucket_size,
            overlap=cfg.overlap_grad_reduce,
        )
        parts = [
            GradBuffer(
                [p for p in self.params if not getattr(p, "expert_parallel", False)],
                ps.dp_cp,
                shard=self.distributed,
                deferred=self.shared if ps.embedding.size > 1 else (),
                recorder=ps.recorder,
                **buffer,
            )
        ]
        if experts:
            parts.append(
                GradBuffer(
                    experts,
                    ps.edp,
                    shard=cfg.use_distributed_optimizer and ps.edp_size > 1,
                    average_over=ps.dp_cp_size,
                    recorder=ps.recorder,
                    **buffer,
                )
            )
        return GradBuffers(parts)

    def _build_pieces(self) -> List[_Piece]:
        """This rank's main parameters: whole params (plain) or its shard of every bucket (ZeRO-1)."""
        names = {id(p): n for n, p in self.named}
        pieces = []
        whole = {id(p) for part in self.grads.parts if not part.shard_grads for p in part.params}
        for n, p in self.named:
            if id(p) in whole:  # fp32 weights are their own main weights; half weights get an fp32 copy.
                main = p if not self.half else nn.Parameter(p.detach().float().clone())
                pieces.append(_Piece(n, p, 0, p.numel(), main))
        for b in [b for part in self.grads.parts if part.shard_grads for b in part.buckets]:
            s0, s1 = b.shard
            for p in b.params:
                a, e = self.grads.index[p]
                lo, hi = max(a, s0), min(e, s1)
                if lo >= hi:
                    continue
                piece = _Piece(names[id(p)], p, lo - a, hi - a, None)
                piece.main = nn.Parameter(piece.model_slice if not self.half else piece.model_slice.float().clone())
                pieces.append(piece)
        for part in self.grads.parts if self.fsdp is not None else ():
            for p in part.params if isinstance(part, ShardedPart) else ():
                piece = _ShardPiece(names[id(p)], p, self.dtype)
                if piece.end > piece.start:  # FSDP leaves the last ranks no rows of a short parameter
                    pieces.append(piece)
        return pieces

    # -- the step ------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """Factor the loss is multiplied by before backward (1 unless fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def zero_grad(self, num_microbatches: int) -> None:
        """Clear the gradient buffer; ``num_microbatches`` backward passes make one step."""
        self.grads.start_step(num_microbatches)

    def finish_param_gather(self) -> None:
        """Wait for every weight all-gather still in flight (--overlap-param-gather).

        Forward passes wait for their own modules' weights; anything else that reads
        weights after a step (saving, tests, export) calls this first.
        """
        self.grads.wait_params()

    def finalize_grads(self) -> None:
        """Tied-embedding sum over the embedding group, DP reduction, sequence-parallel norm grads."""
        if self.ps.embedding.size > 1:
            for p in self.shared:  # before the DP reduction: its bucket waits for this sum
                self.ps.recorder.call("embedding", dist.all_reduce, _grad_of(p), group=self.ps.embedding.group)
        self.grads.finish()
        if self.sp_params and self.ps.tp_size > 1:
            grads = [_grad_of(p).view(-1) for p in self.sp_params]
            flat = torch.cat(grads)
            self.ps.recorder.call("tp", dist.all_reduce, flat, group=self.ps.tp_group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()])
                offset += g.numel()

    def _main_grads(self) -> List[torch.Tensor]:
        for pc in self.pieces:
            g = pc.grad_slice.view_as(pc.main)
            pc.main.grad = g if g.dtype == torch.float32 else g.float()
        return [pc.main.grad for pc in self.pieces]

    def _all_reduce_world(self, t: torch.Tensor, op=dist.ReduceOp.SUM, over_dp: bool = True) -> torch.Tensor:
        dp = self.grads.dp  # the replicas, dp x cp (hybrid sharding: those sharing one copy of the state)
        if over_dp and dp.size > 1:
            self.ps.recorder.call("dp_cp", dist.all_reduce, t, op=op, group=dp.group)
        if self.ps.mp.size > 1:
            self.ps.recorder.call("mp", dist.all_reduce, t, op=op, group=self.ps.mp.group)
        return t

    def _unscale_and_check(self, grads: List[torch.Tensor]) -> bool:
        """Divide by the loss scale; True when any rank saw an inf or NaN (agreed everywhere)."""
        found = torch.zeros(1, device=self.ps.device)
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
            found += (~torch.stack([torch.isfinite(g).all() for g in grads])).any().float()
        return bool(self._all_reduce_world(found, dist.ReduceOp.MAX).item() > 0)

    def grad_norm(self, grads: Optional[List[torch.Tensor]] = None) -> float:
        """L2 norm of the whole model's gradient: each element counted once over tp, pp and dp x cp."""
        grads = self._main_grads() if grads is None else grads
        counted = [g for pc, g in zip(self.pieces, grads) if is_counted_once(pc.param, self.ps.tp_rank)]
        if self.has_experts:
            return self._moe_grad_norm(grads)
        sq = torch.zeros(1, device=self.ps.device)
        if counted:
            sq += torch.stack([torch.linalg.vector_norm(g) for g in counted]).square().sum()
        return float(self._all_reduce_world(sq, over_dp=self.distributed).sqrt())

    def _moe_grad_norm(self, grads: List[torch.Tensor]) -> float:
        """The norm with experts: one sum over the world, each replica's share divided by its replica
        count (dp x cp for dense weights, expert DP for experts) unless the optimizer shards them."""
        sq = torch.zeros(2, device=self.ps.device)
        for pc, g in zip(self.pieces, grads):
            if is_counted_once(pc.param, self.ps.tp_rank):
                sq[int(getattr(pc.param, "expert_parallel", False))] += torch.linalg.vector_norm(g).square()
        for k, part in enumerate(self.grads.parts):
            if not part.shard_grads:
                sq[k] /= part.dp.size
            else:  # hybrid sharding: each shard is held by that many ranks
                sq[k] /= getattr(part, "num_copies", 1)
        if self.ps.world_size > 1:
            self.ps.recorder.call("world", dist.all_reduce, sq)
        return float(sq.sum().sqrt())

    def step(self) -> Tuple[bool, Optional[float]]:
        """Update the weights; returns (update applied, global grad norm or None when skipped on overflow)."""
        self.finish_param_gather()  # a weight no forward used may still be in flight
        grads = self._main_grads()
        if self.scaler is not None:
            found_inf = self._unscale_and_check(grads)
            self.scaler.update(found_inf)
            if found_inf:
                return False, None
        norm = self.grad_norm(grads)
        if not math.isfinite(norm):
            return False, norm
        if self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad and grads:
            torch._foreach_mul_(grads, self.cfg.clip_grad / (norm + 1e-6))
        self.optimizer.step()
        self._copy_main_to_model()
        return True, norm

    def _copy_main_to_model(self) -> None:
        if self.half:
            for pc in self.pieces:
                if not isinstance(pc, _ShardPiece):  # a shard is its own main weight; FSDP casts it when gathering
                    pc.model_slice.copy_(pc.main.detach().view(-1))
        # ZeRO-1 (buffers that shard): with overlap, the next forward waits bucket by bucket
        self.grads.gather_params(async_op=self.cfg.overlap_param_gather)

    def install_param_gather_hooks(self, modules: Sequence[nn.Module]) -> None:
        """With --overlap-param-gather: each module waits for its weights' gather on first use."""
        if self.cfg.overlap_param_gather:
            self.grads.install_param_gather_hooks(modules)

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    @property
    def param_groups(self) -> List[dict]:
        return self.optimizer.param_groups

    # -- state ---------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes this rank holds for the optimizer: Adam moments plus fp32 main weights it owns."""
        total = sum(
            t.numel() * t.element_size()
            for s in self.optimizer.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
        if self.half:  # fp32 weights are their own main weights; half ones have an fp32 copy (not FSDP's shards,
            # which are fp32 and the model's weights themselves: counted once, as the model's)
            total += sum(pc.main.numel() * 4 for pc in self.pieces if not isinstance(pc, _ShardPiece))
        return total

    def step_state(self) -> Dict[str, object]:
        """The counters a checkpoint keeps besides tensors, as plain numbers (``meta.json``'s values).

        ``adam_step``: Adam's step count (the same for every parameter; 0.0 before the first
        update); ``group_steps``: the per-group counts apex's FusedAdam keeps (None where a
        group has none); ``scaler``: the fp16 loss scaler's state (None without one).
        """
        steps = [s["step"] for s in self.optimizer.state.values() if "step" in s]
        return {
            "adam_step": float(steps[0]) if steps else 0.0,
            "group_steps": [
                float(g["step"]) if torch.is_tensor(g.get("step")) else g.get("step")
                for g in self.optimizer.param_groups
            ],
            "scaler": self.scaler.state_dict() if self.scaler else None,
        }

    def load_step_state(self, state: Dict[str, object]) -> None:
        """Restore the group step counts and the loss scaler from :meth:`step_state`'s output.

        Adam's per-parameter step arrives with the moments (:meth:`load_full_state_dict`).
        """
        for g, step in zip(self.optimizer.param_groups, state.get("group_steps") or []):
            if step is not None:
                g["step"] = step
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def sharded_state_dict(self) -> Dict[str, object]:
        """This rank's own state: per piece (name, start, end) its fp32 main weight and Adam moments."""
        out = {}
        for pc in self.pieces:
            st = self.optimizer.state.get(pc.main, {})
            out[f"{pc.name}[{pc.start}:{pc.end}]"] = {
                "param": pc.main.detach().view(-1).float().clone(),
                **{
                    k: (
                        v.detach().view(-1).clone()
                        if torch.is_tensor(v) and v.dim() > 0
                        else v.detach().clone()
                        if torch.is_tensor(v)
                        else v
                    )
                    for k, v in st.items()
                },
            }
        # apex's FusedAdam counts steps per param group rather than per parameter
        group_steps = [g.get("step") for g in self.optimizer.param_groups]
        return {"pieces": out, "scaler": self.scaler.state_dict() if self.scaler else None, "group_steps": group_steps}

    def load_sharded_state_dict(self, state: Dict[str, object]) -> None:
        """Inverse of :meth:`sharded_state_dict` for the same layout."""
        self.finish_param_gather()
        for pc in self.pieces:
            self._load_piece(pc, state["pieces"][f"{pc.name}[{pc.start}:{pc.end}]"])
        for g, step in zip(self.optimizer.param_groups, state.get("group_steps") or []):
            if step is not None:
                g["step"] = step
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self._sync_loaded_weights()

    def _sync_loaded_weights(self) -> None:
        """After a load, every rank's weights must hold every shard: gather them (ZeRO-1)."""
        self.grads.gather_params()  # no-op for buffers that do not shard

    def _load_piece(self, pc: _Piece, entry: Dict[str, object]) -> None:
        if "param" in entry:  # absent for fp32 weights saved once, as the model's own
            with torch.no_grad():
                pc.main.view(-1).copy_(entry["param"])
                if self.half:
                    pc.model_slice.copy_(entry["param"])
        elif self.half:
            raise KeyError(f"{pc.name}: no fp32 main weights in the optimizer state of a half-precision run")
        st = {}
        for k, v in entry.items():
            if k == "param":
                continue
            if torch.is_tensor(v):  # moments shaped like the piece; a 0-dim step on the piece's device
                st[k] = (
                    v.reshape(pc.main.shape).clone().to(pc.main.device) if v.dim() > 0 else v.clone().to(pc.main.device)
                )
            else:
                st[k] = v
        if st:
            self.optimizer.state[pc.main] = st

    def _state_keys(self, include_main: bool) -> List[str]:
        return (["param"] if include_main else []) + sorted(
            {k for s in self.optimizer.state.values() for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0}
        )

    def _source(self, pc: _Piece, key: str) -> Optional[torch.Tensor]:
        if key == "param":
            return pc.main.detach()
        t = self.optimizer.state.get(pc.main, {}).get(key)
        return t.detach() if t is not None else None

    def _step_value(self):
        steps = [s["step"] for s in self.optimizer.state.values() if "step" in s]
        if not steps:
            return None
        return steps[0].clone() if torch.is_tensor(steps[0]) else steps[0]

    def state_snapshot(self, include_main: bool, copy: Callable[[torch.Tensor, tuple], torch.Tensor]) -> dict:
        """This rank's own optimizer state, every tensor passed through ``copy(tensor, where)`` (host
        copies for a background save): what :meth:`full_state_dict` reads with ``snapshot=``, off the
        training thread, while the live state moves on. No collective."""
        keys = self._state_keys(include_main)
        pieces = []
        for i, pc in enumerate(self.pieces):
            own = {k: self._source(pc, k) for k in keys}
            pieces.append({k: copy(t, (i, k)) for k, t in own.items() if t is not None})
        return {"keys": keys, "pieces": pieces, "step": self._step_value()}

    def full_state_dict(
        self,
        include_main: bool = True,
        to_cpu: bool = False,
        snapshot: Optional[dict] = None,
        group=None,
        expert_group=None,
    ) -> Dict[str, Dict[str, torch.Tensor]]:
        """Every parameter's whole fp32 main weight ("param") and Adam moments (collective over dp x cp,
        and over expert DP for an MoE's experts: ``expert_group`` is that group's gloo copy for a snapshot).

        The plain optimizer returns views of its live state (copy before the next
        step if you keep them); the distributed optimizer's shards are summed into
        full-size tensors over the dp x cp group (the pieces are disjoint), one state
        key at a time (moved to CPU with ``to_cpu`` before the next), so every rank
        returns the same. With ``snapshot`` (:meth:`state_snapshot`) the shards are read from it
        instead of the live state, on the CPU, over ``group`` (a gloo copy of the dp x cp group).
        """
        keys = snapshot["keys"] if snapshot is not None else self._state_keys(include_main)
        out: Dict[str, Dict[str, torch.Tensor]] = {n: {} for n, _ in self.named}

        def source(i: int, pc: _Piece, key: str) -> Optional[torch.Tensor]:
            return snapshot["pieces"][i].get(key) if snapshot is not None else self._source(pc, key)

        groups = [group, expert_group]  # gloo copies for a snapshot; None: the buffer's own group
        for k, part in enumerate(self.grads.parts):
            members = {id(p) for p in part.params}
            mine = [(i, pc) for i, pc in enumerate(self.pieces) if id(pc.param) in members]
            if groups[k] is not None and not getattr(part, "writes", True):
                mine = []  # a hybrid-sharding copy: over all of dp x cp only the first copy's shards are summed
            if not part.shard_grads:  # one piece per parameter: views, no copies
                for i, pc in mine:
                    for key in keys:
                        t = source(i, pc, key)
                        if t is not None:
                            out[pc.name][key] = (t.cpu() if to_cpu else t).float().view(pc.param.shape)
                continue
            named = [(n, p) for n, p in self.named if id(p) in members]
            offsets, total = {}, 0
            for n, p in named:
                offsets[n], total = total, total + p.numel()
            device = torch.device("cpu") if snapshot is not None else self.ps.device
            for key in keys:
                flat = torch.zeros(total, device=device)
                for i, pc in mine:
                    t = source(i, pc, key)
                    if t is not None:
                        flat[offsets[pc.name] + pc.start : offsets[pc.name] + pc.end] = t.view(-1)
                dist.all_reduce(flat, group=groups[k] if groups[k] is not None else part.dp.group)
                flat = flat.cpu() if to_cpu else flat
                for n, p in named:
                    out[n][key] = flat[offsets[n] : offsets[n] + p.numel()].view(p.shape)
        step = snapshot["step"] if snapshot is not None else self._step_value()
        if step is not None:
            for n in out:
                out[n]["step"] = step.clone() if torch.is_tensor(step) else step
        return self._per_expert(out)

    def _per_expert(self, out: Dict[str, Dict[str, torch.Tensor]]) -> Dict[str, Dict[str, torch.Tensor]]:
        """A grouped expert parameter's state under its per-expert names (each expert's slice), as saved."""
        for n, p in self.named:
            names = per_expert_names(n, p)
            if names and n in out:
                entry = out.pop(n)
                for i, e in enumerate(names):
                    out[e] = {k: (v[i] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in entry.items()}
        return out

    def _grouped_entry(self, full: Dict[str, Dict[str, torch.Tensor]], name: str, p) -> Dict[str, torch.Tensor]:
        """A parameter's whole state from ``full``: under its own name, or a grouped expert parameter's
        joined from its per-expert entries."""
        if name in full:
            return full[name]
        parts = [full[e] for e in per_expert_names(name, p)]
        if not parts:
            return full[name]  # the KeyError names the missing parameter
        return {
            k: (torch.stack([q[k] for q in parts]) if torch.is_tensor(v) and v.dim() > 0 else v)
            for k, v in parts[0].items()
        }

    def load_full_state_dict(self, full: Dict[str, Dict[str, torch.Tensor]]) -> None:
        """Load whole-parameter state (from :meth:`full_state_dict`, any DP size or sharding)."""
        self.finish_param_gather()
        joined = {n: self._grouped_entry(full, n, p) for n, p in self.named if per_expert_names(n, p)}
        for pc in self.pieces:
            entry = {
                k: (v.reshape(-1)[pc.start : pc.end] if torch.is_tensor(v) and v.dim() > 0 else v)
                for k, v in (joined[pc.name] if pc.name in joined else full[pc.name]).items()
            }
            self._load_piece(pc, entry)
        self._sync_loaded_weights()

    def model_destinations(self, p: nn.Parameter) -> List[Tuple[int, int, torch.Tensor]]:
        """Where a checkpoint's model weights of ``p`` go on this rank: [(start, end, flat tensor)] of its
        flattening. The whole parameter, or under FSDP this rank's shard (its fp32 main weight; none in a
        16-bit run, whose main weights are read as the optimizer's ``param``)."""
        if self.fsdp is None or not isinstance(p, DTensor):
            return [(0, p.numel(), p.data.view(-1))]
        if self.half:
            return []
        return [(pc.start, pc.end, pc.main.detach().view(-1)) for pc in self.pieces if pc.param is p]

    def load_targets(self, keys: Sequence[str]) -> List[Tuple[_Piece, Dict[str, torch.Tensor]]]:
        """Where a checkpoint reader puts this rank's state: per piece, a flat fp32 tensor for each of
        ``keys`` ("param": the main weight itself; a moment: new and uninitialised, on the piece's
        device). Only this rank's pieces: the distributed optimizer gets its shard, nothing full-size.
        Fill every element, then :meth:`install_loaded`."""
        return [
            (
                pc,
                {
                    k: pc.main.detach().view(-1)
                    if k == "param"
                    else torch.empty(pc.main.numel(), dtype=torch.float32, device=pc.main.device)
                    for k in keys
                },
            )
            for pc in self.pieces
        ]

    def install_loaded(self, targets: List[Tuple[_Piece, Dict[str, torch.Tensor]]], adam_step: float) -> None:
        """Adopt :meth:`load_targets`' filled tensors as :meth:`load_full_state_dict` would (half runs'
        weights become the loaded main weights; Adam's step is ``adam_step``); collective over dp x cp."""
        with torch.no_grad():
            for pc, tensors in targets:
                if self.half and "param" in tensors:
                    pc.model_slice.copy_(tensors["param"])
                st: Dict[str, object] = {k: t.view(pc.main.shape) for k, t in tensors.items() if k != "param"}
                if "exp_avg" in st:
                    st["step"] = torch.tensor(adam_step, dtype=torch.float32).to(pc.main.device)
                if st:
                    self.optimizer.state[pc.main] = st
        self._sync_loaded_weights()
