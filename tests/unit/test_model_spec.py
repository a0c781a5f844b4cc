"""The model spec (megalite/model/spec.py) against the model it describes: every parameter of a built
GPT-2, Llama and MoE model has the spec's name, shape, split and order; the counts are the sums of
their numel; the FLOP terms are 6 x the weights a token multiplies; the Megatron-LM and Hugging Face
name maps cover every parameter."""

from __future__ import annotations

from typing import Dict

import pytest
import torch

from megalite.config import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.model.spec import (
    COLUMN,
    GPT2,
    LLAMA,
    MIXTRAL,
    QWEN2_MOE,
    REPLICATED,
    ROW,
    VOCAB,
    ModelSpec,
    SpecError,
    hf_architecture,
    hf_layer_map,
    hf_top_map,
    layer_prefix,
    megatron_name,
)
from megalite.parallel.state import ParallelState
from megalite.tensor_parallel.random import RNGTracker
from tests.helpers.grouped_experts import per_expert_parameters

LLAMA_STYLE = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    untie_embeddings_and_output_weights=True,
    add_bias_linear=False,
)
MOE = dict(num_experts=4, moe_router_topk=2, ffn_hidden_size=48)
CASES: Dict[str, dict] = {
    "gpt2": dict(),
    "gpt2_tanh_untied": dict(openai_gelu=True, untie_embeddings_and_output_weights=True, ffn_hidden_size=96),
    "llama_gqa": dict(LLAMA_STYLE, num_query_groups=2),
    "mixtral": dict(LLAMA_STYLE, num_query_groups=2, **MOE),
    "qwen2_moe": dict(
        LLAMA_STYLE,
        **MOE,
        moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=40,
        moe_shared_expert_gate=True,
        moe_layer_freq=(1, 0, 1, 1),
        moe_router_pre_softmax=True,
    ),
    "moe_gpt2_bias": dict(
        **MOE,
        moe_layer_freq=2,
        moe_shared_expert_intermediate_size=32,
        moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid",
    ),
}
HF_ARCH = {"gpt2": GPT2, "gpt2_tanh_untied": GPT2, "llama_gqa": LLAMA, "mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE}


def config(case: str) -> ModelConfig:
    return ModelConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        vocab_size=250,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **CASES[case],
    )


def built(cfg: ModelConfig) -> GPTModel:
    """The single-process model (tp = 1: padded vocabulary, every layer, embedding and head)."""
    ps = ParallelState.single()
    return GPTModel(cfg, ps, RNGTracker(1, 0, 0, ps.device), 1)


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    cfg = config(request.param)
    return request.param, cfg, ModelSpec.of(cfg), built(cfg)


def test_params_are_the_built_models_in_name_shape_and_order(case):
    _, cfg, spec, model = case
    params = [(p.name, p.shape) for p in spec.params(cfg.padded_vocab_size(1))]
    tensors = [(x.name, tuple(x.tensor.shape)) for x in per_expert_parameters(model)]
    assert dict(params) == dict(tensors) and len(params) == len(tensors)
    # the same order, but for the shared expert's gate: a parameter of the module, listed by torch before
    # the module's linear layers, and by the spec (the conversion stream's order) after them
    gate = [n for n, _ in params if n.endswith("shared_experts.gate_weight")]
    assert [x for x in params if x[0] not in gate] == [x for x in tensors if x[0] not in gate]
    assert spec.num_params(cfg.padded_vocab_size(1)) == sum(t.numel() for t in model.parameters())


def test_split_pieces_and_expert_tags_are_the_built_models(case):
    _, cfg, spec, model = case
    tensors = {x.name: x for x in per_expert_parameters(model)}
    dims = {COLUMN: 0, VOCAB: 0, ROW: 1, REPLICATED: -1}
    for p in spec.params(cfg.padded_vocab_size(1)):
        t = tensors[p.name]
        assert t.partition_dim == dims[p.split], p.name
        assert getattr(t.param, "expert_parallel", False) == (p.expert is not None), p.name
        assert t.param.requires_grad == p.trainable, p.name
        if p.split == COLUMN:
            assert t.module.output_sizes == list(p.pieces), p.name


def test_shapes_and_pieces_by_name_agree_with_the_parameter_list(case):
    _, cfg, spec, _ = case
    for p in spec.params():  # the real (unpadded) vocabulary
        rel = p.name.split(".", 3)[3] if p.name.startswith("decoder.layers.") else p.name
        assert spec.shape_of(p.name) == spec.shape_of(rel) == p.shape, p.name
        assert spec.pieces_of(p.name) == (list(p.pieces) if p.split == COLUMN else None), p.name


def test_active_parameters_leave_out_the_unrouted_experts(case):
    _, cfg, spec, _ = case
    total = spec.num_params()
    if spec.moe is None:
        assert spec.num_active_params() == total
        return
    expert = sum(p.numel for p in spec.moe.expert_params(0))
    assert spec.num_active_params() == total - cfg.num_moe_layers * (cfg.num_experts - cfg.moe_router_topk) * expert


def test_flop_terms_are_six_times_the_weights_a_token_multiplies(case):
    _, cfg, spec, _ = case
    weights = {p.name: p.numel for p in spec.layer().params()}
    proj, core, mlp = spec.layer_flops_per_token(causal=True)
    assert proj == 6 * (weights["self_attention.linear_qkv.weight"] + weights["self_attention.linear_proj.weight"])
    assert core == 6 * cfg.seq_length * cfg.num_attention_heads * cfg.head_dim
    assert spec.layer_flops_per_token(causal=False)[1] == 2 * core
    active = 0  # per token over all layers: the dense MLP, or topk routed experts and the shared expert
    for i in range(cfg.num_layers):
        layer = {p.name: p.numel for p in spec.layer(i).params()}
        if spec.layer(i).moe is None:
            active += layer["mlp.linear_fc1.weight"] + layer["mlp.linear_fc2.weight"]
            continue
        routed = sum(n for k, n in layer.items() if ".experts." in k and k.endswith("weight"))
        shared = sum(layer.get(f"mlp.shared_experts.linear_fc{k}.weight", 0) for k in (1, 2))
        active += routed * cfg.moe_router_topk // cfg.num_experts + shared
    assert spec.mlp_flops_per_token() == 6 * active
    assert mlp == 6 * active / cfg.num_layers
    vocab = cfg.padded_vocab_size(1)
    assert spec.flops(8, vocab) == pytest.approx(
        8 * (cfg.num_layers * (proj + core) + 6 * active + 6 * cfg.hidden_size * vocab), rel=1e-15
    )


def test_megatron_names_cover_every_parameter(case):
    _, cfg, spec, model = case
    for i in range(cfg.num_layers):
        rel = [p.name for p in spec.layer(i).params()]
        per = cfg.num_experts // 2 if spec.layer(i).moe is not None else 0  # experts over ep = 2
        legacy = [megatron_name(n, False, per) for n in rel]
        te = [megatron_name(n, True, per) for n in rel]
        for ep_rank in range(2 if per else 1):  # one Megatron name per parameter in each EP rank's file
            held = [
                k
                for k, n in enumerate(rel)
                if ".local_experts." not in n or int(n.split(".local_experts.")[1].split(".")[0]) // per == ep_rank
            ]
            assert len({legacy[k] for k in held}) == len({te[k] for k in held}) == len(held)
        assert [n for n in legacy if ".local_experts." not in n] == [n for n in rel if ".local_experts." not in n]
        assert all(int(n.split(".local_experts.")[1].split(".")[0]) < per for n in legacy if ".local_experts." in n)
        fused = [n for n in te if ".layer_norm_" in n]  # Transformer Engine: the norms inside the next linear
        assert len(fused) == len([n for n in rel if n.startswith("input_layernorm.")]) + (
            0 if per else len([n for n in rel if n.startswith("pre_mlp_layernorm.")])
        )


def test_hf_maps_cover_every_parameter_once(case):
    name, cfg, spec, model = case
    if name not in HF_ARCH:
        with pytest.raises(SpecError, match="neither"):
            hf_architecture(spec)
        return
    arch = hf_architecture(spec)
    assert arch == HF_ARCH[name]
    ours, theirs = [], []
    top = hf_top_map(spec, arch)
    for p in spec.pre_params() + spec.post_params():
        ours.append(p.name)
        theirs.append(top[p.name])
    for i in range(cfg.num_layers):
        for m in hf_layer_map(spec, arch, i):
            ours.append(layer_prefix(i) + m.ours)
            theirs += m.theirs
            shape = spec.shape_of(m.ours)
            assert sum(m.rows) == shape[0] if len(m.theirs) > 1 else not m.rows
    assert sorted(ours) == sorted(x.name for x in per_expert_parameters(model))
    assert len(set(theirs)) == len(theirs)


def test_hf_layer_map_round_trips_tensors(case):
    """The maps are invertible: to HF names and back gives the same tensors (hf.py's to/from_hf_layer)."""
    name, cfg, spec, _ = case
    if name not in HF_ARCH:
        return
    import megalite.checkpointing  # noqa: F401  (interop imports the checkpointing package first)
    from megalite.interop.hf import from_hf_layer, to_hf_layer

    arch = HF_ARCH[name]
    g = torch.Generator().manual_seed(0)
    for i in range(cfg.num_layers):
        ours = {p.name: torch.randn(p.shape, generator=g) for p in spec.layer(i).params()}
        theirs = to_hf_layer(cfg, arch, i, ours)
        back = from_hf_layer(cfg, arch, i, theirs.__getitem__, theirs.__contains__)
        assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
