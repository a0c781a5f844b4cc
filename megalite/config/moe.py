"""Mixture-of-experts flags (Megatron-LM's names, meaning and defaults), mixed into the config sections.

``MoEModelFields`` is a base of ``ModelConfig`` (the model's shape and routing), ``ExpertParallelFields``
of ``ParallelConfig`` (the expert rank grid and the token dispatcher) and ``MoELoggingFields`` of
``LoggingConfig``; the flags sit in Megatron's "moe" help group. A model is a mixture of experts
exactly when ``num_experts`` is set; every other MoE field is then read by megalite/moe.
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from typing import Optional, Tuple, Union

from megalite.config.flags import HelpGroup

MOE = HelpGroup("moe")


def layer_freq(text: str) -> Union[int, Tuple[int, ...]]:
    """--moe-layer-freq: ``2`` (every 2nd layer, from layer 0) or a Megatron-style pattern of 0/1 per layer
    such as ``([0]*1+[1]*3)`` or ``[1,0,1,0]``: lists of integers, ``+`` and ``*`` only (nothing is executed)."""

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = ev(node.left), ev(node.right)
            if (
                isinstance(node.op, ast.Mult)
                and max(len(v) if isinstance(v, list) else abs(v) for v in (a, b))
                * min(len(v) if isinstance(v, list) else abs(v) for v in (a, b))
                > 100_000
            ):
                raise ValueError  # one entry per layer: no model has that many
            return a + b if isinstance(node.op, ast.Add) else a * b
        raise ValueError

    try:
        value = ev(ast.parse(text.strip(), mode="eval").body)
        if isinstance(value, list) and all(v in (0, 1) for v in value) and value:
            return tuple(value)
        if isinstance(value, int) and value > 0:
            return value
    except (SyntaxError, ValueError, TypeError):
        pass
    raise argparse.ArgumentTypeError(
        f"--moe-layer-freq expects a positive integer or a list of 0/1 per layer such as '([0]*1+[1]*3)', got {text!r}"
    )


@dataclass(frozen=True)
class MoEModelFields:
    num_experts: Optional[int] = MOE("--num-experts", None, "experts per MoE layer (unset: a dense model)", gt=0)
    moe_ffn_hidden_size: Optional[int] = MOE(
        "--moe-ffn-hidden-size", None, "hidden size of each expert's MLP (default: --ffn-hidden-size)", gt=0
    )
    moe_layer_freq: Union[int, Tuple[int, ...]] = MOE(
        "--moe-layer-freq",
        1,
        "which layers are MoE: N = every N-th layer from layer 0, or a 0/1 pattern per layer such as '([0]*1+[1]*3)'",
        type=layer_freq,
    )
    moe_router_topk: int = MOE("--moe-router-topk", 2, "experts each token is routed to", gt=0)
    moe_router_score_function: str = MOE(
        "--moe-router-score-function", "softmax", "router scores", choices=("softmax", "sigmoid")
    )
    moe_router_pre_softmax: bool = MOE(
        "--moe-router-pre-softmax",
        False,
        "softmax over all experts before top-k (default: top-k of the logits, then softmax over the k)",
    )
    moe_router_dtype: str = MOE(
        "--moe-router-dtype", "fp32", "precision of the router's logits and scores", choices=("fp32", "fp64")
    )
    moe_router_load_balancing_type: str = MOE(
        "--moe-router-load-balancing-type",
        "aux_loss",
        "aux_loss: GShard/Switch loss over the micro-batch; seq_aux_loss: per sequence (DeepSeek-V2); none",
        choices=("aux_loss", "seq_aux_loss", "none"),
    )
    moe_aux_loss_coeff: float = MOE("--moe-aux-loss-coeff", 0.0, "load-balancing loss coefficient", ge=0)
    moe_z_loss_coeff: Optional[float] = MOE("--moe-z-loss-coeff", None, "router z-loss coefficient (ST-MoE)", ge=0)
    moe_router_enable_expert_bias: bool = MOE(
        "--moe-router-enable-expert-bias",
        False,
        "auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias "
        "added to the scores for choosing experts, moved after each step toward equal loads",
    )
    moe_router_bias_update_rate: float = MOE(
        "--moe-router-bias-update-rate", 1e-3, "step of the expert bias update", ge=0
    )
    moe_expert_capacity_factor: Optional[float] = MOE(
        "--moe-expert-capacity-factor",
        None,
        "each expert takes at most factor x tokens x topk / experts tokens "
        "of a micro-batch, dropping the rest (default: dropless)",
    )
    moe_token_drop_policy: str = MOE(
        "--moe-token-drop-policy",
        "probs",
        "which tokens over capacity are dropped: lowest probabilities, or latest positions",
        choices=("probs", "position"),
    )
    moe_pad_expert_input_to_capacity: bool = MOE(
        "--moe-pad-expert-input-to-capacity", False, "pad every expert's input to its capacity (static shapes)"
    )
    moe_shared_expert_intermediate_size: Optional[int] = MOE(
        "--moe-shared-expert-intermediate-size",
        None,
        "hidden size of the shared expert every token passes through (all shared experts together; default: none)",
        gt=0,
    )
    moe_shared_expert_gate: bool = MOE(
        "--moe-shared-expert-gate", False, "scale the shared expert's output by a learned sigmoid gate (Qwen2-MoE)"
    )
    moe_grouped_gemm: bool = MOE(
        "--moe-grouped-gemm",
        False,
        "accepted for Megatron's scripts: the experts run "
        "as one grouped GEMM where torch has one (torch._grouped_mm on CUDA), else a loop",
    )
    moe_permute_fusion: bool = MOE(
        "--moe-permute-fusion",
        False,
        "accepted for Megatron's scripts: tokens are always permuted to their experts and back "
        "on the device, with one host sync per dispatch (megalite/moe/permute.py)",
    )
    moe_router_fusion: bool = MOE(
        "--moe-router-fusion",
        False,
        "accepted for Megatron's scripts: the router's top-k, scores and balancing losses always run "
        "on the device without host syncs",
    )

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def moe_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size  # type: ignore[attr-defined]

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) has an MoE block in place of the MLP."""
        if not self.is_moe:
            return False
        f = self.moe_layer_freq
        return bool(f[layer]) if isinstance(f, tuple) else layer % f == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))  # type: ignore[attr-defined]


@dataclass(frozen=True)
class ExpertParallelFields:
    ep: int = MOE(
        "--expert-model-parallel-size",
        1,
        "ranks the experts of a layer are split over (expert parallelism; within one pipeline stage)",
        gt=0,
    )
    etp: Optional[int] = MOE(
        "--expert-tensor-parallel-size",
        None,
        "ranks each expert is split over like a TP layer (default: --tensor-model-parallel-size)",
        gt=0,
    )
    moe_token_dispatcher_type: str = MOE(
        "--moe-token-dispatcher-type",
        "allgather",
        "allgather: every expert-parallel rank sees all tokens; "
        "alltoall: each token is sent to its experts' ranks only",
        choices=("allgather", "alltoall"),
    )

    overlap_moe_expert_parallel_comm: bool = MOE(
        "--overlap-moe-expert-parallel-comm",
        False,
        "with --pipeline-schedule dualpipev: run each paired forward "
        "and backward of two micro-batches side by side (the forward on a second thread with communicators of its "
        "own), so one's expert all-to-alls overlap the other's compute; needs dropout 0",
    )

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp  # type: ignore[attr-defined]


@dataclass(frozen=True)
class MoELoggingFields:
    moe_per_layer_logging: bool = MOE(
        "--moe-per-layer-logging", False, "log the MoE losses and tokens per expert of every MoE layer"
    )
