"""Megatron-Core's distributed-optimizer state in a torch_dist checkpoint, against megatron-core itself.

megatron-core runs in its own interpreter (this file run as a script): a tiny GPTModel under its
DistributedDataParallel + DistributedOptimizer (Adam) on CPU with gloo, two optimizer steps, then
``dist_checkpointing.save`` of the state dict Megatron-LM's ``save_checkpoint`` builds (default
``dp_reshardable`` optimizer sharding). It records its fp32 main weights and Adam moments per
parameter, then takes a third step on a fixed batch and records the weights after it.

megalite's ``load_checkpoint`` (pretrain_gpt.py --load) must restore the same main weights, moments
and step count, and its own next step on the same batch must give megatron-core's weights.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1


def _batch(vocab: int, seed: int):
    ids = torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


# -- the megatron-core side (run as a script: a fresh interpreter) ----------------------------------
def _cpu_stand_ins() -> None:
    """What megatron-core's DDP, DistributedOptimizer and writer ask of CUDA, answered on CPU."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    for fn in ("tensor", "zeros", "empty"):  # e.g. DistributedOptimizer's overflow buffer, device="cuda"
        orig = getattr(torch, fn)

        def on_cpu(*a, _orig=orig, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return _orig(*a, **k)

        setattr(torch, fn, on_cpu)
    kind = torch.nn.Parameter.type  # it accepts only torch.cuda.*Tensor parameters
    torch.nn.Parameter.type = lambda self, *a, **k: (
        kind(self, *a, **k) if a or k else kind(self).replace("torch.", "torch.cuda.", 1)
    )


def _megatron_core_main(root: str, style: str) -> None:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    _cpu_stand_ins()
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from tests.helpers.megatron_core import _megatron_args, _megatron_core_model

    filesystem_async._process_memory = lambda: 0  # its memory log needs psutil
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    torch.manual_seed(3)
    model = _megatron_core_model(style).train()
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True), model
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=LR,
            min_lr=LR,
            weight_decay=WD,
            adam_beta1=BETAS[0],
            adam_beta2=BETAS[1],
            adam_eps=EPS,
            use_distributed_optimizer=True,
            clip_grad=0.0,
        ),
        [ddp],
    )
    for g in opt.param_groups:  # what Megatron-LM's OptimizerParamScheduler sets each step: no decay on norms
        g["weight_decay"] = WD * g.get("wd_mult", 1.0)
    mask = torch.triu(torch.ones(12, 12, dtype=torch.bool), 1)[None, None]

    def step(seed: int) -> None:
        tokens, labels = _batch(200, seed)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(tokens, torch.arange(12)[None].expand(2, 12), mask, labels=labels)
        loss.float().mean().backward()  # megalite's loss: the mean over the batch's tokens
        ddp.finish_grad_sync()
        assert opt.step()[0]

    for seed in (5, 6):
        step(seed)
    inner = opt.chained_optimizers[0]
    state = {}
    for name, p in model.named_parameters():
        t = inner._get_main_param_and_optimizer_states(p)
        state[name] = {k: v.detach().clone().view(p.shape) for k, v in t.items() if k != "step"}
    args = _megatron_args(style)
    args.ckpt_format, args.consumed_train_samples, args.use_distributed_optimizer = "torch_dist", 4, True
    d = os.path.join(root, "iter_0000002")
    os.makedirs(d)
    # Megatron-LM's save_checkpoint: unwrap_model, then generate_state_dict with _build_sharded_state_dict_metadata
    meta = {
        "distrib_optim_sharding_type": "dp_reshardable",
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": parallel_state.get_data_parallel_group(),
    }
    sd = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": 2,
        "model": model.sharded_state_dict(metadata=meta),
        "num_floating_point_operations_so_far": 0,
    }
    sd["optimizer"] = opt.sharded_state_dict(sd, metadata=meta)
    sd["opt_param_scheduler"] = {"max_lr": LR, "num_steps": 4}
    dist_checkpointing.save(sd, d, content_metadata={k: v for k, v in meta.items() if k != "dp_cp_group"})
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    step(7)
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save({"state": state, "step": 2, "after": after}, os.path.join(root, "megatron_core_state.pt"))


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    _megatron_core_main(*sys.argv[1:])
    sys.exit(0)

# -- the tests (megalite's side) -----------------------------------------------------------------------
from dataclasses import replace  # noqa: E402

from megalite.checkpointing import load_checkpoint  # noqa: E402
from megalite.interop import checkpoint_formats
from megalite.parallel.state import ParallelState  # noqa: E402
from megalite.training import Trainer  # noqa: E402
from tests.helpers.convert import STYLES  # noqa: E402
from tests.helpers.parity import tiny_config  # noqa: E402


def _trainer(style: str, **checkpoint) -> Trainer:
    """megalite's model of the megatron-core one (all 256 rows are vocabulary there), its Adam settings."""
    cfg = tiny_config(STYLES[style], gbs=2, mbs=2)
    optim = replace(
        cfg.optim,
        lr=LR,
        min_lr=LR,
        lr_warmup_iters=0,
        lr_decay_style="constant",
        weight_decay=WD,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_eps=EPS,
        clip_grad=0.0,
    )
    cfg = cfg.with_(model=replace(cfg.model, vocab_size=256, init_method_std=0.01), optim=optim)
    return Trainer(cfg, ParallelState.single())


@pytest.fixture(scope="module")
def saved_by_megatron_core(tmp_path_factory, launch):
    """megatron-core's side (this file as a script) in an interpreter and gloo world of its own."""
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp("megatron_core_optim")
    p = launch([sys.executable, __file__, str(root), "llama"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return root, torch.load(root / "megatron_core_state.pt")


@pytest.mark.slow
def test_distributed_optimizer_state_loads_and_steps_as_megatron_core(saved_by_megatron_core, caplog):
    from megalite.interop.megatron import qkv_from_megatron

    root, theirs = saved_by_megatron_core
    t = _trainer("llama")
    assert load_checkpoint(t.run_parts, str(root), formats=checkpoint_formats()) == 2
    assert "distributed-optimizer state" in caplog.text and "not restored (" not in caplog.text
    full = t.optimizer.full_state_dict()
    for name, want in theirs["state"].items():
        for k, v in want.items():
            v = qkv_from_megatron(t.cfg.model, v) if ".linear_qkv." in name else v
            assert (full[name][k] - v).abs().max() < 1e-6, (name, k)
    assert t.optimizer.step_state()["adam_step"] == theirs["step"]
    tokens, labels = _batch(200, 7)  # megatron-core's third step, on the same batch
    t.train_step([{"tokens": tokens, "labels": labels, "loss_mask": torch.ones_like(tokens)}])
    params = dict(t.chunks[0].named_parameters())
    for name, want in theirs["after"].items():
        want = qkv_from_megatron(t.cfg.model, want) if ".linear_qkv." in name else want
        assert (params[name].detach() - want).abs().max() < 1e-5, name


@pytest.mark.slow
def test_no_load_optim_and_unmappable_layouts_load_weights_only(saved_by_megatron_core, tmp_path, caplog):
    root, theirs = saved_by_megatron_core
    t = _trainer("llama")
    load_checkpoint(t.run_parts, str(root), load_optim=False, formats=checkpoint_formats())
    assert "not restored (--no-load-optim)" in caplog.text and t.optimizer.step_state()["adam_step"] == 0.0
    # a checkpoint whose args say transformer_engine: its bucket order is not mapped; one warning, weights load
    import shutil

    shutil.copytree(root / "iter_0000002", tmp_path / "iter_0000002")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    common = torch.load(tmp_path / "iter_0000002" / "common.pt", weights_only=False)
    common["args"].transformer_impl = "transformer_engine"
    torch.save(common, tmp_path / "iter_0000002" / "common.pt")
    caplog.clear()
    t = _trainer("llama")
    assert load_checkpoint(t.run_parts, str(tmp_path), formats=checkpoint_formats()) == 2
    assert "transformer_engine" in caplog.text and "Adam starts fresh" in caplog.text
    assert t.optimizer.step_state()["adam_step"] == 0.0
    w = theirs["state"]["decoder.final_layernorm.weight"]["param"]
    assert (dict(t.chunks[0].named_parameters())["decoder.final_layernorm.weight"].detach() - w).abs().max() < 1e-6


def _load_megatron_lm_tp2pp2(ps, d: str):
    """One rank of a megalite tp 2 run loading Megatron-LM's tp 2 x pp 2 file: its parameters' state."""
    from megalite.interop.torch_dist import TorchDistSource

    t = Trainer(tiny_config(tp=2).with_(model=TorchDistSource(d).cfg), ps)
    assert load_checkpoint(t.run_parts, d, formats=checkpoint_formats()) == 2
    out = io.BytesIO()  # tensors through the result queue would live in the exiting rank's shared memory
    torch.save({n: {k: v.clone() for k, v in e.items()} for n, e in t.optimizer.full_state_dict().items()}, out)
    return out.getvalue()


@pytest.mark.slow
def test_megatron_lm_tp2_pp2_state_loads_into_a_tp2_run(tmp_path, run_distributed):
    """megalite at tp 2 (its own split: [Q; K; V] pieces, its vocabulary padding) restores Megatron-LM's tp 2 x
    pp 2 dp_reshardable state: the tp pieces put back together are what Megatron's own fully_reshardable file
    holds."""
    from megalite.interop.interchange import merge_tp
    from megalite.interop.torch_dist import TorchDistSource
    from tests.helpers.convert import _megatron_model_space_state, unpack_tp2pp2

    root = unpack_tp2pp2(tmp_path) / "untied"
    cfg = TorchDistSource(str(root / "ckpt")).cfg
    truth = _megatron_model_space_state(root / "ckpt_full" / "iter_0000002", cfg)
    ranks = [torch.load(io.BytesIO(b)) for b in run_distributed(_load_megatron_lm_tp2pp2, 2, str(root / "ckpt"), tp=2)]
    assert set(ranks[0]) == set(truth)
    for name, want in truth.items():
        for k, v in want.items():
            got = merge_tp(cfg, name, [ranks[0][name][k], ranks[1][name][k]])
            assert torch.equal(got, v.float()), (name, k)
