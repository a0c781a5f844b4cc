"""Converted MoE checkpoints load into expert-parallel runs.

A transformers MixtralForCausalLM (random init, save_pretrained) is converted by the CLI to
megalite's torch format at ep2 (mp_rank_00_000 / mp_rank_00_001) and to the sharded format; a
2-rank run at ep2 (dp2, each rank holding two of the four experts) loads each with --finetune and
computes transformers' logits within 1e-4, every local tensor equal to the full model's.

megatron-core's own MoE GPTModel (local spec, SequentialMLP: expert bias, gated shared expert, a
dense second layer) saved as Megatron-LM saves it converts to megalite and back to its very state
dict (names, _extra_state entries, tensors). Its MoE forward needs Transformer Engine on CPU, so
logits are checked against transformers above, not against megatron-core.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

import pytest
import torch

from megalite.checkpointing import load_checkpoint
from megalite.checkpointing.run import RunParts
from megalite.checkpointing.safe_load import load_megatron_file
from megalite.inference import config_from_dict
from megalite.interop.native_io import MegaliteSource
from megalite.testing import free_port
from megalite.training import Trainer
from tests.helpers.convert import _differences, run_convert
from tests.helpers.convert_moe import IDS, VOCAB, hf_model, logits, run_cli
from tests.helpers.grouped_experts import per_expert_tensors


def _load_and_run(ps, root: str, full_root: str):
    source = MegaliteSource(full_root)
    full = source.full_model()
    cfg = config_from_dict(source.meta["config"])
    cfg = cfg.with_(
        parallel=replace(cfg.parallel, tp=1, pp=1, vp=1, ep=2, etp=None),
        data=replace(cfg.data, mock_data=True, tokenizer_type=None),
        train=replace(cfg.train, micro_batch_size=2, global_batch_size=4),
    )
    t = Trainer(cfg, ps)
    load_checkpoint(RunParts(cfg, ps, t.chunks, t.optimizer, t.scheduler, t.state, t.tracker), root, finetune=True)
    model = t.chunks[0].eval()
    want = model.local_from_full(full)
    have = per_expert_tensors(model)
    experts = sorted({n.split("local_experts.")[1].split(".")[0] for n in have if "local_experts" in n})
    bad = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), want[n])]
    with torch.no_grad():
        out = model(IDS).transpose(0, 1)[..., :VOCAB]
    return {"bad": bad, "experts": experts, "logits": out.tolist()}


@pytest.mark.slow
def test_converted_mixtral_loads_at_ep2_in_both_formats(tmp_path, run_distributed):
    hf = hf_model("mixtral")
    hf.save_pretrained(tmp_path / "hf")
    theirs = logits(hf, IDS, True)
    done = run_cli("hf", "megalite", tmp_path / "hf", tmp_path / "sharded")
    assert done.returncode == 0, done.stderr
    done = run_cli(
        "hf",
        "megalite",
        tmp_path / "hf",
        tmp_path / "torch",
        "--ckpt-format",
        "torch",
        "--target-expert-parallel-size",
        2,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "torch" / "iter_0000000" / "mp_rank_00_001" / "model_optim_rng.pt").exists()
    for fmt in ("torch", "sharded"):
        results = run_distributed(_load_and_run, 2, str(tmp_path / fmt), str(tmp_path / "sharded"), ep=2)
        assert [r["experts"] for r in results] == [["0", "1"], ["2", "3"]]
        for r in results:
            assert r["bad"] == [], (fmt, r["bad"])
            diff = (torch.tensor(r["logits"]) - theirs).abs().max().item()
            assert diff < 1e-4, (fmt, diff)


def _megatron_core_moe(ps, root: str):
    """In a worker (megatron-core needs torch.distributed): its MoE GPTModel written as Megatron-LM saves it."""
    import torch.distributed as dist
    import torch.nn.functional as F

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    torch.cuda.current_device = lambda: "cpu"  # the router places its expert bias on the current device
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(3)
    moe = dict(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=24,
        moe_shared_expert_gate=True,
        moe_router_enable_expert_bias=True,
        moe_layer_freq=[1, 0],
        moe_router_score_function="sigmoid",
    )
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.3,
        **moe,
    )
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")  # honours the freq
    model = GPTModel(
        cfg,
        spec,
        vocab_size=256,
        max_sequence_length=16,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    sd = model.state_dict()
    sd["decoder.layers.0.mlp.router.expert_bias"].copy_(torch.arange(4.0) / 10)
    args = argparse.Namespace(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        group_query_attention=True,
        num_query_groups=2,
        kv_channels=8,
        seq_length=16,
        max_position_embeddings=16,
        position_embedding_type="rope",
        rotary_base=10000,
        rotary_percent=1.0,
        normalization="RMSNorm",
        norm_epsilon=1e-5,
        swiglu=True,
        untie_embeddings_and_output_weights=True,
        add_bias_linear=False,
        add_qkv_bias=False,
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
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.3,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=24,
        moe_shared_expert_gate=True,
        moe_router_enable_expert_bias=True,
        moe_layer_freq=[1, 0],
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=1,
        moe_grouped_gemm=False,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.01,
        moe_router_score_function="sigmoid",
        moe_router_pre_softmax=False,
    )
    os.makedirs(f"{root}/mt/iter_0000007/mp_rank_00")
    torch.save(
        {"args": args, "checkpoint_version": 3.0, "iteration": 7, "model": sd},
        f"{root}/mt/iter_0000007/mp_rank_00/model_optim_rng.pt",
    )
    with open(f"{root}/mt/latest_checkpointed_iteration.txt", "w") as f:
        f.write("7")
    return sorted(sd)


@pytest.mark.slow
def test_megatron_core_moe_state_dict_round_trips(tmp_path, run_distributed):
    pytest.importorskip("megatron.core")
    keys = run_distributed(_megatron_core_moe, 1, str(tmp_path))[0]
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight" in keys
    assert "decoder.layers.1.mlp.linear_fc1.weight" in keys  # layer 1 dense (moe_layer_freq [1, 0])
    for done in (
        run_convert("megatron", "megalite", tmp_path / "mt", tmp_path / "ml", "--true-vocab-size", 250),
        run_convert("megalite", "megatron", tmp_path / "ml", tmp_path / "mt2"),
    ):
        assert done.returncode == 0, done.stderr
    sd = load_megatron_file(str(tmp_path / "mt" / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt"))["model"]
    back = load_megatron_file(str(tmp_path / "mt2" / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt"))
    assert _differences(back["model"], sd) == []
    assert (back["args"].num_experts, back["args"].moe_layer_freq, back["args"].moe_shared_expert_gate) == (
        4,
        [1, 0],
        True,
    )
