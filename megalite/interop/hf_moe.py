"""The mixture-of-experts part of hf.py: Hugging Face ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM``.

Attention, norms and embeddings are Llama's (hf.py). An MoE layer's tensors (the name map is the
model spec's, model/spec.py; this module reads and writes their config.json fields)::

    Mixtral     model.layers.N.block_sparse_moe.gate.weight [E, h]       mlp.router.weight
                block_sparse_moe.experts.<e>.w1 / w3 / w2                expert e: linear_fc1 = [w1 (gate); w3 (up)],
                                                                         linear_fc2 = w2
    Qwen2-MoE   model.layers.N.mlp.gate.weight [E, h]                    mlp.router.weight
                mlp.experts.<e>.{gate,up,down}_proj                      expert e: [gate; up], down
                mlp.shared_expert.{gate,up,down}_proj                    mlp.shared_experts.linear_fc1 / fc2
                mlp.shared_expert_gate.weight [1, h]                     mlp.shared_experts.gate_weight
    read too    model.layers.N.mlp.experts.gate_up_proj [E, 2f, h] and .down_proj [E, h, f]: the fused
                layout transformers 5 holds in memory (its save_pretrained writes the per-expert names above)

Routing as megalite computes it: Mixtral's softmax over all experts, top-k, renormalised, is the
softmax over the top-k logits (megalite's default); Qwen2-MoE's ``norm_topk_prob=False`` (softmax
over all, top-k, not renormalised) is ``--moe-router-pre-softmax``. Qwen2-MoE's layer i is sparse
when i is not in ``mlp_only_layers`` and (i + 1) % ``decoder_sparse_step`` == 0: a 0/1
``--moe-layer-freq`` pattern (the other layers are dense MLPs of ``intermediate_size``). HF's MoE
is dropless: an export of a model trained with ``--moe-expert-capacity-factor`` computes without
dropping. megalite has biases on all linear layers or none, not on Q, K, V alone (Megatron's
``--add-qkv-bias``): a Qwen2-MoE with ``qkv_bias`` imports only when those biases are all zero (as
a fresh initialization has them), and is exported with ``qkv_bias: false``.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch

from megalite.checkpointing.safe_load import CheckpointError
from megalite.config import ModelConfig
from megalite.model.spec import HF_MOE_ARCHS, MIXTRAL, QWEN2_MOE, hf_expert_projections, hf_moe_block

MOE_ARCHS = HF_MOE_ARCHS
MODEL_TYPES = {"mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE}


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise CheckpointError(f"{where}: {what}, which megalite's model does not have")


def moe_fields(c: dict, arch: str, where: str) -> dict:
    """ModelConfig's MoE fields (and the dense ffn) from an HF MoE config.json."""
    layers, k = c["num_hidden_layers"], c.get("num_experts_per_tok", 2)
    fields = dict(
        moe_router_topk=k,
        moe_aux_loss_coeff=float(c.get("router_aux_loss_coef", 0.0)),
        moe_router_load_balancing_type="aux_loss",
    )
    if arch == MIXTRAL:
        _need(not c.get("sliding_window"), where, "sliding-window attention is used")
        return dict(
            fields,
            num_experts=c.get("num_local_experts", 8),
            ffn_hidden_size=c["intermediate_size"],
            moe_ffn_hidden_size=c["intermediate_size"],
            moe_layer_freq=1,
        )
    _need(not c.get("use_sliding_window"), where, "sliding-window attention is used")
    shared = c.get("shared_expert_intermediate_size", 0)
    _need(shared > 0, where, "MoE layers without a shared expert (shared_expert_intermediate_size 0)")
    step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or ())
    pattern = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))
    _need(c.get("num_experts", 0) > 0 and any(pattern), where, "no MoE layer")
    return dict(
        fields,
        num_experts=c["num_experts"],
        ffn_hidden_size=c["intermediate_size"],
        moe_ffn_hidden_size=c["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=True,
        moe_router_pre_softmax=not c.get("norm_topk_prob", False),
        moe_layer_freq=1 if all(pattern) else pattern,
    )


def moe_config(cfg: ModelConfig, arch: str) -> dict:
    """config.json entries of an MoE class (added to the Llama-style ones hf.py writes)."""
    common = {
        "num_experts_per_tok": cfg.moe_router_topk,
        "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
        "output_router_logits": False,
    }
    if arch == MIXTRAL:
        return {
            **common,
            "model_type": "mixtral",
            "num_local_experts": cfg.num_experts,
            "intermediate_size": cfg.moe_ffn_size,
            "sliding_window": None,
            "router_jitter_noise": 0.0,
        }
    return {
        **common,
        "model_type": "qwen2_moe",
        "num_experts": cfg.num_experts,
        "intermediate_size": cfg.ffn_size,
        "moe_intermediate_size": cfg.moe_ffn_size,
        "shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size,
        "norm_topk_prob": not cfg.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)],
        "qkv_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 0,
        "layer_types": ["full_attention"] * cfg.num_layers,
    }


def fused_expert_reader(
    arch: str, i: int, get: Callable[[str], torch.Tensor], has: Callable[[str], bool]
) -> Callable[[str], torch.Tensor]:
    """``get`` for MoE layer ``i``'s HF names (model/spec.py's map) that also reads the layout transformers 5
    holds in memory: the router as ``mlp.gate.weight`` and the experts fused in ``mlp.experts.gate_up_proj``
    [E, 2f, h] ([gate; up] per expert) and ``mlp.experts.down_proj`` [E, h, f]; each fused tensor read once."""
    block, fused = hf_moe_block(arch, i), f"model.layers.{i}.mlp."
    projections = hf_expert_projections(arch)
    held: Dict[str, torch.Tensor] = {}

    def read(name: str) -> torch.Tensor:
        if name == f"{block}gate.weight" and not has(name) and has(f"{fused}gate.weight"):
            return get(f"{fused}gate.weight")
        rest = name[len(f"{block}experts.") :].split(".") if name.startswith(f"{block}experts.") else []
        if len(rest) != 3 or rest[1] not in projections or not has(f"{fused}experts.gate_up_proj"):
            return get(name)
        key = "down_proj" if rest[1] == projections[2] else "gate_up_proj"
        if key not in held:
            held[key] = get(f"{fused}experts.{key}")
        t = held[key][int(rest[0])]
        if key == "down_proj":
            return t.clone()
        half = t.shape[0] // 2  # gate rows, then up rows
        return t[:half].clone() if rest[1] == projections[0] else t[half:].clone()

    return read


def check_zero_qkv_bias(get: Callable[[str], torch.Tensor], i: int, where: str) -> None:
    """A Qwen2-MoE's Q, K, V biases must be zero: megalite cannot hold a bias on them alone."""
    for n in ("q_proj", "k_proj", "v_proj"):
        if get(f"model.layers.{i}.self_attn.{n}.bias").abs().max() > 0:
            raise CheckpointError(
                f"{where}: layer {i}'s {n} has a nonzero bias (qkv_bias) and megalite has no bias "
                f"on Q, K, V alone (Megatron's --add-qkv-bias): this model cannot be converted"
            )
