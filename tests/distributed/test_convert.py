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

import contextlib
import random

import numpy as np
import pytest
import torch

from megalite.checkpointing import save_checkpoint
from megalite.checkpointing.run import RunParts
from megalite.checkpointing.safe_load import load_megatron_file
from megalite.testing import free_port
from megalite.training import Trainer
from tests.helpers.convert import (
    VOCAB,
    _differences,
    convert,
    loaded,
    make_trainer,
    megalite_logits,
    run_convert,
    state,
)
from tests.helpers.megatron_core import _megatron_args, _megatron_core_model
from tests.helpers.parity import tiny_config


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
    ckpt = {
        "args": _megatron_args(style),
        "checkpoint_version": 3.0,
        "iteration": 7,
        "model": sd,
        "optimizer": {"state": {}, "param_groups": [{"lr": 1e-3, "params": [0]}]},
        "opt_param_scheduler": {"num_steps": 7},
        "num_floating_point_operations_so_far": 0,
        "rng_state": [
            {
                "random_rng_state": random.getstate(),
                "np_rng_state": np.random.get_state(),
                "torch_rng_state": torch.get_rng_state(),
                "cuda_rng_state": torch.zeros(4),
                "rng_tracker_states": {},
            }
        ],
    }
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


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_megatron_core_checkpoint_converts_with_its_logits(tmp_path, style, run_distributed):
    pytest.importorskip("megatron.core")
    out = run_distributed(_megatron_core_oracle, 1, style, str(tmp_path))[0]
    # the converter runs as users run it, in a fresh interpreter: megatron.core's import (in the worker)
    # registers its classes with torch's safe globals, which must not be what lets the files load
    for done in (
        run_convert("megatron", "megalite", tmp_path / "mt", tmp_path / "ml", "--true-vocab-size", VOCAB),
        run_convert("megalite", "megatron", tmp_path / "ml", tmp_path / "mt2"),
    ):
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
    save_checkpoint(
        RunParts(t.cfg, ps, t.chunks, t.optimizer, t.scheduler, t.state, t.tracker), root, fmt
    )  # iteration 0
    return True


@pytest.mark.parametrize(
    "style,tp,pp,vp,layers,fmt",
    [("llama", 2, 2, 1, 2, "torch"), ("llama", 2, 1, 1, 2, "sharded"), ("gpt2", 1, 2, 2, 4, "torch")],
)
def test_hf_export_of_tp_pp_sharded_run(tmp_path, style, tp, pp, vp, layers, fmt, run_distributed):
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
