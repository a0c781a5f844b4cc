"""The planner's mixture-of-experts terms: an MoE layer's parameters, saved activations, dispatch
buffers and traffic on one rank (planner.py combines them with the dense terms).

An MoE layer's MLP block on one rank of a pipeline stage (the stage's tp x cp x dp ranks seen as
ETP x EP x expert-DP, megalite/moe)::

    router       E x h, whole on every rank (reduced over dp x cp with the dense weights)
    experts      E/EP experts, each an MLP of --moe-ffn-hidden-size split over ETP (fc2 bias whole)
    shared       the shared expert: a TP MLP of --moe-shared-expert-intermediate-size (+ its gate, h)

Expert weights are reduced (and, with the distributed optimizer, their optimizer state sharded)
over expert-DP = tp x cp x dp / (ep x etp); the dense ones over dp x cp.

Tokens: a rank routes its T tokens (s/cp x b, / tp under SP) to topk experts; with balanced
routing each rank's experts compute R = T x topk x ETP rows (each of the ETP ranks of an EP rank
gets the same rows). The dispatch buffers of one layer are live while it runs (not kept per
micro-batch): alltoall, R rows of h out and back; allgather, the expert-MP group's T x EP x ETP
tokens gathered (and their probabilities) and an output of that size before the reduce-scatter.
"""

from __future__ import annotations

from typing import Tuple

from megalite.config import ModelConfig
from megalite.model.spec import ModelSpec, split_counts


def expert_tp(tp: int, etp) -> int:
    """The expert tensor-parallel size (None: tp, Megatron's default)."""
    return tp if etp is None else etp


def mlp_params(cfg: ModelConfig, ffn: int) -> Tuple[int, int]:
    """(split, replicated) parameters of one MLP of hidden size ``ffn``: what its tensor-parallel group
    splits (both weights, fc1's bias) and its fc2 bias, held whole."""
    return split_counts(ModelSpec.of(cfg).mlp_of_size(ffn).params())


def moe_block_params(cfg: ModelConfig, tp: int, ep: int, etp: int) -> Tuple[int, int, int]:
    """(dense, expert, fp32 without gradient) parameters of one MoE layer's MLP block on one rank.

    dense: the router and the shared expert (reduced over dp x cp); expert: this rank's E/EP experts'
    ETP shards (reduced over expert-DP); the last: the expert bias (aux-loss-free balancing, fp32)."""
    moe = ModelSpec.of(cfg).moe
    split, whole = split_counts(moe.expert_params(0))
    expert = moe.num_experts // ep * (split // etp + whole)
    router = moe.router_params()
    dense = sum(p.numel for p in router if p.trainable)
    s_split, s_whole = split_counts(moe.shared_params())  # its gate [1, h] is whole
    dense += s_split // tp + s_whole
    return dense, expert, sum(p.numel for p in router if not p.trainable)


def routed_rows(cfg: ModelConfig, tokens: float, etp: int) -> float:
    """Rows the rank's local experts compute for ``tokens`` tokens routed on each rank (balanced)."""
    return tokens * cfg.moe_router_topk * etp


def moe_block_activation_bytes(cfg: ModelConfig, tokens: float, tp: int, etp: int, e: int) -> float:
    """What one MoE block saves for backward per micro-batch on one rank, ``tokens`` being the tokens
    this rank routes (its SP / CP share of the micro-batch); ``e``: bytes per element.

    Router: the fp32 copy of its input and about four [T, E] fp32 tensors (logits, softmax, top-k
    probabilities, the balancing loss's scores). Experts, per routed row: the input (h), fc1's output,
    the activation's (SwiGLU: silu(gate) and the product), the output (h, weighted by its fp32 probability).
    Shared expert: a dense MLP's terms at its size, split over tp."""
    h, moe = cfg.hidden_size, ModelSpec.of(cfg).moe
    router = tokens * (4 * h + 4 * 4 * moe.num_experts)
    rows = routed_rows(cfg, tokens, etp)
    f = moe.expert.ffn / etp
    experts = rows * (e * (2 * h + f * (4 if moe.expert.gated else 2)) + 4)
    shared = 0.0
    if moe.shared is not None:
        fs = moe.shared.ffn
        shared = e * tokens * fs * (4 if moe.shared.gated else 2)  # tokens x tp (SP) rows, fs / tp columns
    return router + experts + shared


def dispatch_buffer_bytes(cfg: ModelConfig, tokens: float, ep: int, etp: int, dispatcher: str, e: int) -> float:
    """Bytes one MoE layer's token exchange holds while it runs (transient: counted once per rank)."""
    h = cfg.hidden_size
    if dispatcher == "alltoall":
        return 2 * e * routed_rows(cfg, tokens, etp) * h  # rows sent to the experts and their outputs back
    gathered = tokens * ep * etp
    return gathered * (2 * e * h + 4 * cfg.num_experts)  # gathered tokens, output before reduce-scatter, probs


def dispatch_bytes_per_layer(cfg: ModelConfig, tokens: float, ep: int, etp: int, dispatcher: str, e: int) -> float:
    """Bytes one rank sends and receives in one MoE layer's forward (dispatch and combine);
    the backward moves the same again, twice over (a third forward, two thirds backward as compute)."""
    g = ep * etp
    if g == 1:
        return 0.0
    h = cfg.hidden_size
    if dispatcher == "alltoall":
        return 2 * (g - 1) / g * e * routed_rows(cfg, tokens, etp) * h
    return 2 * (g - 1) * e * tokens * h  # all-gather and reduce-scatter of the group's tokens
