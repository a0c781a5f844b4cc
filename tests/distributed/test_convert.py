"""Checkpoint conversion against outside oracles and real sharded sources.

- megatron-core's GPTModel (CPU, local spec) makes the Megatron-LM fixture: its own state dict
  (names, fused per-group QKV, [gate; up], vocabulary padding) wrapped as Megatron-LM saves it
  (``args`` Namespace with an AttnBackend enum, numpy RNG state, optimizer entry). The converter
  CLI runs in a fresh interpreter (not the worker that imported megatron.core); the converted
  megalite model must give megatron-core's logits, and converting back must give its files.
  (Files from Megatron-LM's own save_checkpoint: tests/unit/test_megatron_files.py.)
- A tp2 x pp2 megalite run saves in the torch format; its HF export gives the same logits
  as the single-process model with the same weights.
"""
from __future__ import annotations

import argparse
import contextlib
import random

import numpy as np
import pytest
import torch

from megalite.checkpointing import save_checkpoint
from megalite.training import Trainer
from megalite.testing import free_port, run_distributed
from tests.distributed.common import tiny_config
from megalite.checkpointing.safe_load import load_megatron_file
from tests.unit.test_convert import VOCAB, convert, loaded, make_trainer, megalite_logits, state
from tests.unit.test_megatron_files import run_convert

pytestmark = pytest.mark.multiprocess

STYLES = {"gpt2": dict(normalization="LayerNorm", swiglu=False, pos="learned_absolute", bias=True, groups=None,
                       tied=True),
          "llama": dict(normalization="RMSNorm", swiglu=True, pos="rope", bias=False, groups=2, tied=False)}


def _megatron_core_model(style: str):
    """A 2-layer megatron-core GPTModel on CPU (hidden 32, 4 heads, vocab padded to 256), weights drawn large."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    s = STYLES[style]
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=s["groups"],
                            ffn_hidden_size=128, normalization=s["normalization"],
                            gated_linear_unit=s["swiglu"], activation_func=F.silu if s["swiglu"] else F.gelu,
                            add_bias_linear=s["bias"], use_cpu_initialization=True, hidden_dropout=0.0,
                            attention_dropout=0.0, layernorm_epsilon=1e-5, init_method_std=0.3)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization=s["normalization"]), vocab_size=256,
                     max_sequence_length=16, position_embedding_type=s["pos"],
                     share_embeddings_and_output_weights=s["tied"]).eval()
    with torch.no_grad():  # biases and norms away from their 0/1 init, so a mix-up would show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _megatron_args(style: str) -> argparse.Namespace:
    from megatron.core.transformer.enums import AttnBackend
    s = STYLES[style]
    return argparse.Namespace(
        num_layers=2, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4,
        group_query_attention=s["groups"] is not None, num_query_groups=s["groups"], kv_channels=8, seq_length=16,
        max_position_embeddings=16, position_embedding_type=s["pos"], rotary_base=10000, rotary_percent=1.0,
        normalization=s["normalization"], norm_epsilon=1e-5, swiglu=s["swiglu"],
        untie_embeddings_and_output_weights=not s["tied"], add_bias_linear=s["bias"], add_qkv_bias=s["bias"],
        vocab_size=None, padded_vocab_size=256, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None, params_dtype=torch.float32,
        bf16=False, fp16=False, transformer_impl="local", attention_backend=AttnBackend.auto, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.3, iteration=7)


def _megatron_core_oracle(ps, style: str, root: str):
    """In a worker process (megatron-core needs torch.distributed): fixture, conversions, logits."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(3)
    model = _megatron_core_model(style)
    sd = model.state_dict()
    # Megatron-LM's checkpoint dict (checkpointing.py: generate_state_dict + rng state)
    ckpt = {"args": _megatron_args(style), "checkpoint_version": 3.0, "iteration": 7, "model": sd,
            "optimizer": {"state": {}, "param_groups": [{"lr": 1e-3, "params": [0]}]},
            "opt_param_scheduler": {"num_steps": 7}, "num_floating_point_operations_so_far": 0,
            "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                           "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.zeros(4),
                           "rng_tracker_states": {}}]}
    import os
    os.makedirs(f"{root}/mt/iter_0000007/mp_rank_00")
    torch.save(ckpt, f"{root}/mt/iter_0000007/mp_rank_00/model_optim_rng.pt")
    with open(f"{root}/mt/latest_checkpointed_iteration.txt", "w") as f:
        f.write("7")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    # megatron-core's forward on CPU: no CUDA device, RNG tracker or default mask
    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    mask = torch.triu(torch.ones(12, 12, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        theirs = model(ids, torch.arange(12)[None].expand(2, 12), mask)[..., :VOCAB]
    # plain Python values only: tensors sent through the queue would outlive the worker's shared memory
    return {"theirs": theirs.tolist()}


def _differences(ours: dict, theirs: dict) -> list:
    """Keys whose tensors differ; vocabulary tables compare their real rows, and our padding must be zero."""
    bad = sorted(set(ours) ^ set(theirs))
    for k, v in theirs.items():
        b = ours.get(k)
        if v is None or b is None:
            bad += [] if v is None and b is None else [k]
        elif k.endswith(("word_embeddings.weight", "output_layer.weight")):
            bad += [] if b.shape == v.shape and torch.equal(b[:VOCAB], v[:VOCAB]) and not b[VOCAB:].any() else [k]
        elif not torch.equal(b, v):
            bad.append(k)
    return bad


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_megatron_core_checkpoint_converts_with_its_logits(tmp_path, style):
    pytest.importorskip("megatron.core")
    out = run_distributed(_megatron_core_oracle, 1, style, str(tmp_path))[0]
    # the converter runs as users run it, in a fresh interpreter: megatron.core's import (in the worker)
    # registers its classes with torch's safe globals, which must not be what lets the files load
    for done in (run_convert("megatron", "megalite", tmp_path / "mt", tmp_path / "ml", "--true-vocab-size", VOCAB),
                 run_convert("megalite", "megatron", tmp_path / "ml", tmp_path / "mt2")):
        assert done.returncode == 0, done.stderr
    t = loaded(style, tmp_path / "ml")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    ours = megalite_logits(t, ids)
    theirs = torch.tensor(out["theirs"])
    assert theirs.abs().max() > 1.0
    assert (ours - theirs).abs().max() < 1e-4
    # converting back gives Megatron-Core's state dict: same keys (with _extra_state), same tensors, the
    # vocabulary padding rows zero (their random values are not part of the model)
    sd = load_megatron_file(str(tmp_path / "mt" / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt"))["model"]
    back = load_megatron_file(str(tmp_path / "mt2" / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt"))
    assert _differences(back["model"], sd) == []
    assert (back["args"].padded_vocab_size, back["args"].vocab_size) == (256, VOCAB)


def _save_sharded_run(ps, cfg, root: str, fmt: str) -> bool:
    t = Trainer(cfg, ps)
    save_checkpoint(t.cfg, ps, t.chunks, t.optimizer, t.scheduler, t.state, t.tracker, root, fmt)  # iteration 0
    return True


@pytest.mark.parametrize("style,tp,pp,vp,layers,fmt", [("llama", 2, 2, 1, 2, "torch"), ("llama", 2, 1, 1, 2, "sharded"),
                                                       ("gpt2", 1, 2, 2, 4, "torch")])
def test_hf_export_of_tp_pp_sharded_run(tmp_path, style, tp, pp, vp, layers, fmt):
    transformers = pytest.importorskip("transformers")
    one = make_trainer(style, num_layers=layers)  # initialization does not depend on the layout
    cfg = tiny_config(tp=tp, pp=pp, vp=vp).with_(model=one.cfg.model)
    run_distributed(_save_sharded_run, tp * pp, cfg, str(tmp_path / "run"), fmt, tp=tp, pp=pp)
    assert convert("megalite", "hf", tmp_path / "run", tmp_path / "hf") == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (megalite_logits(one, ids) - hf(ids).logits).abs().max()
    assert diff < 1e-4
    assert convert("hf", "megalite", tmp_path / "hf", tmp_path / "back") == 0
    before, after = state(one), state(loaded(style, tmp_path / "back", num_layers=layers))
    assert all(torch.equal(before[k], after[k]) for k in before)
