"""megatron-core's side of the conversion oracles: a tiny GPTModel of either style on CPU and the
``args`` Megatron-LM saves beside it (tests/distributed/test_convert.py, test_torch_dist.py,
test_torch_dist_optim.py; imported only where megatron-core is installed)."""

from __future__ import annotations

import argparse

import torch

STYLES = {
    "gpt2": dict(normalization="LayerNorm", swiglu=False, pos="learned_absolute", bias=True, groups=None, tied=True),
    "llama": dict(normalization="RMSNorm", swiglu=True, pos="rope", bias=False, groups=2, tied=False),
}


def _megatron_core_model(style: str):
    """A 2-layer megatron-core GPTModel on CPU (hidden 32, 4 heads, vocab padded to 256), weights drawn large."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    s = STYLES[style]
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=s["groups"],
        ffn_hidden_size=128,
        normalization=s["normalization"],
        gated_linear_unit=s["swiglu"],
        activation_func=F.silu if s["swiglu"] else F.gelu,
        add_bias_linear=s["bias"],
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        layernorm_epsilon=1e-5,
        init_method_std=0.3,
    )
    model = GPTModel(
        cfg,
        get_gpt_layer_local_spec(normalization=s["normalization"]),
        vocab_size=256,
        max_sequence_length=16,
        position_embedding_type=s["pos"],
        share_embeddings_and_output_weights=s["tied"],
    ).eval()
    with torch.no_grad():  # biases and norms away from their 0/1 init, so a mix-up would show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _megatron_args(style: str) -> argparse.Namespace:
    from megatron.core.transformer.enums import AttnBackend

    s = STYLES[style]
    return argparse.Namespace(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=128,
        num_attention_heads=4,
        group_query_attention=s["groups"] is not None,
        num_query_groups=s["groups"],
        kv_channels=8,
        seq_length=16,
        max_position_embeddings=16,
        position_embedding_type=s["pos"],
        rotary_base=10000,
        rotary_percent=1.0,
        normalization=s["normalization"],
        norm_epsilon=1e-5,
        swiglu=s["swiglu"],
        untie_embeddings_and_output_weights=not s["tied"],
        add_bias_linear=s["bias"],
        add_qkv_bias=s["bias"],
        vocab_size=None,
        padded_vocab_size=256,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        transformer_impl="local",
        attention_backend=AttnBackend.auto,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.3,
        iteration=7,
    )
