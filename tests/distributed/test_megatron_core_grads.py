"""megalite's GPT against megatron-core's GPTModel: logits, loss and every parameter's gradient.

The model the Megatron-LM tp2 x pp2 fixture uses (tests/fixtures/megatron_lm, style "mp"): linear biases,
SwiGLU, LayerNorm, learned positions, grouped-query attention, tied output; dropout 0, tp 1. megatron-core
(local spec, CPU) runs in a worker (it needs torch.distributed); megalite gets its weights and must give
its logits, loss and gradients.

The vocabulary (256) needs no padding: megatron-core's softmax also runs over its padding rows, megalite's
excludes them (tensor_parallel/cross_entropy.py), so with padding the two losses differ by design.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from megalite.testing import free_port

VOCAB, SEQ = 256, 12
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48)


def _batch():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _megatron_core_side(ps) -> bytes:
    """megatron-core's model (biases and norms moved off their 0/1 init), its logits and the gradients of the
    mean per-token loss; as bytes (tensors through the queue would live in the exiting worker's memory)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    torch.cuda.current_device = lambda: "cpu"  # no CUDA device, RNG tracker or default mask on CPU
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    torch.manual_seed(3)
    cfg = TransformerConfig(
        **MODEL,
        normalization="LayerNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=True,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        layernorm_epsilon=1e-5,
        init_method_std=0.3,
    )
    model = GPTModel(
        cfg,
        get_gpt_layer_local_spec(normalization="LayerNorm"),
        vocab_size=VOCAB,
        max_sequence_length=16,
        position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=True,
    ).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    tokens, labels = _batch()
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    pos = torch.arange(SEQ)[None].expand(2, SEQ)
    logits = model(tokens, pos, mask)
    loss = model(tokens, pos, mask, labels=labels).mean()  # per-token losses [b, s]: megalite's mean
    loss.backward()
    out = io.BytesIO()
    torch.save(
        {
            "state": {n: p.detach().clone() for n, p in model.named_parameters()},
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "logits": logits.detach().clone(),
            "loss": loss.item(),
        },
        out,
    )
    return out.getvalue()


@pytest.mark.slow
def test_bias_swiglu_gqa_model_gives_megatron_core_logits_and_gradients(run_distributed):
    pytest.importorskip("megatron.core")
    from megalite.config import ModelConfig
    from megalite.interop.megatron import qkv_from_megatron
    from megalite.model.gpt import GPTModel
    from megalite.parallel.state import ParallelState
    from megalite.tensor_parallel.random import RNGTracker

    theirs = torch.load(io.BytesIO(run_distributed(_megatron_core_side, 1)[0]), weights_only=True)
    cfg = ModelConfig(
        **MODEL,
        seq_length=16,
        vocab_size=VOCAB,
        swiglu=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.3,
    )
    ps = ParallelState.single()
    model = GPTModel(cfg, ps, RNGTracker(1, 0, 0, ps.device), seed=1).train()
    assert model.padded_vocab == VOCAB
    convert = {
        n: (lambda t: qkv_from_megatron(cfg, t)) if ".linear_qkv." in n else (lambda t: t) for n in theirs["state"]
    }
    ours = dict(model.named_parameters())
    assert set(ours) == set(theirs["state"])
    with torch.no_grad():
        for n, p in ours.items():
            p.copy_(convert[n](theirs["state"][n]))
    tokens, labels = _batch()
    logits = model(tokens)
    loss = model.loss(logits, labels, torch.ones_like(tokens))
    loss.backward()
    assert theirs["logits"].abs().max() > 1.0
    assert (logits.detach().transpose(0, 1) - theirs["logits"]).abs().max() < 1e-4
    assert abs(loss.item() - theirs["loss"]) < 1e-5
    for n, p in ours.items():
        want = convert[n](theirs["grads"][n])
        assert want.abs().max() > 0, n
        assert (p.grad - want).abs().max() <= 1e-4 * want.abs().max(), n
