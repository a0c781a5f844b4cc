"""The context-parallel axis of the rank grid, below the model: what reduces, shards and saves over
the replicas (dp x cp).

A stand-in model built here (no attention: every token's loss depends on its own token and position,
so a CP rank can compute its chunks' share exactly) is trained by the optimizer layer itself on
cp 2 x dp 2 (4 ranks), each CP rank holding chunks r and 2CP-1-r of every sequence and scaling its
loss share by cp, as the GPT path does:

* gradients averaged over dp_cp, the plain and the distributed optimizer (sharded over dp_cp, with
  overlapped bucket reduction) equal one process given the same global batches: the first step's
  averaged gradient, the logged loss (mean_over_data_parallel) and the grad norm per step, the final
  weights (fp32, 1e-5);
* a sharded checkpoint saved there stores every element once (the writers deal over dp_cp) and loads
  at cp 1 x dp 2 (distributed optimizer) and in one process bit-equal: weights, fp32 main weights,
  Adam moments and step; a torch-format one (written by dp_cp rank 0; saved with --async-save, so the
  optimizer shards are gathered in the background over dp_cp's gloo group) loads in one process bit-equal;
* the real Trainer's checkpoint saved at cp 2 x dp 2 resumes in one process with the losses of an
  uninterrupted run.
"""

import glob
import json
import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megalite.checkpointing.async_save import conclude, start_save
from megalite.checkpointing.manager import load_checkpoint, save_checkpoint
from megalite.checkpointing.run import RunParts
from megalite.checkpointing.run_formats import RUN_FORMATS
from megalite.config import Config, OptimConfig, ParallelConfig
from megalite.data.samplers import PretrainingSampler
from megalite.observability.logging import mean_over_data_parallel
from megalite.optim.lr_scheduler import LRScheduler
from megalite.optim.optimizer import MegatronOptimizer
from megalite.parallel.state import ParallelState
from megalite.tensor_parallel.random import RNGTracker
from megalite.training.state import TrainState
from tests.helpers.parity import GPT2_STYLE, tiny_config, train_losses

SEQ, VOCAB, HIDDEN = 16, 64, 32
GBS, MBS, STEPS = 4, 1, 3


class StandIn(nn.Module):
    """Token-wise: embedding + position -> norm -> head; initialised from a fixed seed on every rank."""

    def __init__(self, ps: ParallelState):
        super().__init__()
        self.tp = ps.tp  # what checkpointing.layout reads of a chunk (no tensor parallelism here)
        g = torch.Generator().manual_seed(7)
        self.embed, self.pos = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ, HIDDEN)
        self.norm, self.head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, tokens, positions, labels):  # per-token loss [b, s_local]
        logits = self.head(self.norm(self.embed(tokens) + self.pos(positions)))
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")


def _data():
    return torch.randint(0, VOCAB, (STEPS * GBS, SEQ + 1), generator=torch.Generator().manual_seed(3))


def _local_index(cp_size, cp_rank):
    """Chunks r and 2CP-1-r of 2CP (the load-balanced split), concatenated in that order."""
    c = SEQ // (2 * cp_size)
    idx = list(range(cp_rank * c, (cp_rank + 1) * c)) + list(
        range((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c)
    )
    return torch.tensor(idx)


def _optim_cfg(distopt):
    return OptimConfig(
        lr=0.05,
        min_lr=0.0,
        lr_warmup_iters=0,
        lr_decay_style="constant",
        clip_grad=0.5,
        weight_decay=0.1,
        use_distributed_optimizer=distopt,
        overlap_grad_reduce=distopt,
        ddp_bucket_size=1024,
    )


def _build(ps, distopt):
    model = StandIn(ps)
    opt = MegatronOptimizer(list(model.named_parameters()), _optim_cfg(distopt), ps)
    return model, opt


def _train(ps, distopt):
    """STEPS iterations of the stand-in on this rank's share; (model, optimizer, logged losses, norms,
    first step's averaged gradient, flattened)."""
    model, opt = _build(ps, distopt)
    data, idx = _data(), _local_index(ps.cp_size, ps.cp_rank)
    sampler = iter(PretrainingSampler(len(data), 0, MBS, ps.dp_rank, ps.dp_size))
    m = GBS // (MBS * ps.dp_size)
    losses, norms, first_grad = [], [], None
    for step in range(STEPS):
        opt.zero_grad(m)
        mb_losses = []
        for _ in range(m):
            sample = data[next(sampler)]
            tokens, labels = sample[:, :-1][:, idx], sample[:, 1:][:, idx]
            per_token = model(tokens, idx.expand_as(tokens), labels)
            # the GPT path's rule: this rank's share of the full sequence's mean, times cp
            loss = per_token.sum() / (MBS * SEQ) * ps.cp_size
            (loss / m).backward()
            mb_losses.append(loss.detach())
        opt.finalize_grads()
        if step == 0 and not opt.distributed:
            first_grad = torch.cat([p.main_grad.reshape(-1) for p in model.parameters()]).tolist()
        applied, norm = opt.step()
        assert applied
        losses.append(mean_over_data_parallel(mb_losses, ps))
        norms.append(norm)
    opt.finish_param_gather()
    return model, opt, losses, norms, first_grad


def _flat_weights(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _full_state(model, opt):
    """Weights and the whole optimizer state (collective over dp_cp), as plain tensors."""
    full = opt.full_state_dict(include_main=True, to_cpu=True)
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optim": {n: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for n, s in full.items()},
    }


def _cfg(ps):
    return Config(parallel=ParallelConfig(tp=1, pp=1, cp=ps.cp_size))


def _save(ps, root, fmt, model, opt, background=False):
    run = RunParts(
        _cfg(ps),
        ps,
        [model],
        opt,
        LRScheduler(opt, opt.cfg, STEPS),
        TrainState(iteration=STEPS, consumed_samples=STEPS * GBS),
        RNGTracker(1, 0, 0, ps.device),
    )
    if not background:
        save_checkpoint(run, root, fmt)
        return
    # --async-save: host snapshot, the optimizer shards gathered in a thread over dp_cp's gloo copy
    job = start_save(run, root, RUN_FORMATS.get(fmt), None, copy=True)
    job.run(background=True)
    conclude(job, ps)


def _cp_run(ps, tmp):
    out = {"grid": (ps.cp_rank, ps.dp_rank, ps.dp_cp.ranks)}
    for distopt in (False, True):
        model, opt, losses, norms, first_grad = _train(ps, distopt)
        w = _flat_weights(model)
        # the CP ranks (and every replica) hold the same weights after each step
        gathered = [torch.empty_like(w) for _ in range(ps.dp_cp_size)]
        torch.distributed.all_gather(gathered, w, group=ps.dp_cp_group)
        assert all(torch.equal(g, w) for g in gathered)
        out[distopt] = {"losses": losses, "norms": norms, "weights": w.tolist(), "first_grad": first_grad}
        _save(ps, os.path.join(tmp, f"sharded_{int(distopt)}"), "sharded", model, opt)
        if distopt:
            _save(ps, os.path.join(tmp, "torch_1"), "torch", model, opt, background=True)
        state = _full_state(model, opt)
        if ps.rank == 0 and distopt:
            torch.save(state, os.path.join(tmp, "saved_state.pt"))
    return out


def _load(ps, tmp, fmt, tag):
    model, opt = _build(ps, distopt=True)
    scheduler, state = LRScheduler(opt, opt.cfg, STEPS), TrainState()
    got = load_checkpoint(
        RunParts(_cfg(ps), ps, [model], opt, scheduler, state, RNGTracker(1, 0, 0, ps.device)),
        os.path.join(tmp, f"{fmt}_1"),
    )
    assert got == STEPS and state.consumed_samples == STEPS * GBS
    full = _full_state(model, opt)
    if ps.rank == 0:
        torch.save(full, os.path.join(tmp, f"loaded_{tag}.pt"))
    return ps.dp_cp_size


def _assert_bit_equal(got, want, where):
    for name, w in want["model"].items():
        assert torch.equal(got["model"][name], w), f"{where}: weight {name}"
    for name, s in want["optim"].items():
        for k, v in s.items():
            g = got["optim"][name][k]
            assert torch.equal(g, v) if torch.is_tensor(v) else g == v, f"{where}: optimizer {name} {k}"


@pytest.mark.slow
def test_cp2_dp2_grads_optimizer_and_checkpoints(tmp_path, run_distributed):
    tmp = str(tmp_path)
    results = run_distributed(_cp_run, 4, tmp, cp=2)
    assert [r["grid"] for r in results] == [
        (0, 0, [0, 1, 2, 3]),
        (1, 0, [0, 1, 2, 3]),
        (0, 1, [0, 1, 2, 3]),
        (1, 1, [0, 1, 2, 3]),
    ]  # tp-cp-dp-pp: cp before dp
    single = ParallelState.single()
    for distopt in (False, True):
        model, _, losses, norms, first_grad = _train(single, distopt)
        ref = _flat_weights(model)
        for r in results:
            got = r[distopt]
            assert got["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6), (distopt, got["losses"], losses)
            assert got["norms"] == pytest.approx(norms, rel=1e-5, abs=1e-6), (distopt, got["norms"], norms)
            assert torch.allclose(torch.tensor(got["weights"]), ref, rtol=1e-5, atol=1e-6), distopt
            if not distopt:
                assert torch.allclose(torch.tensor(got["first_grad"]), torch.tensor(first_grad), rtol=1e-5, atol=1e-6)

    # the writers dealt their pieces over dp_cp: every element once, every rank writing a share
    for tag in ("sharded_0", "sharded_1"):
        d = glob.glob(os.path.join(tmp, tag, "iter_*"))[0]
        per_rank = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(d, "index_*.json")))]
        keys = [e["key"] for entries in per_rank for e in entries]
        assert len(keys) == len(set(keys)) and all(per_rank), (tag, [len(e) for e in per_rank])
        meta = json.load(open(os.path.join(d, "meta.json")))
        assert (meta["layout"]["cp"], meta["layout"]["dp"], meta["layout"]["world"]) == (2, 2, 4)

    saved = torch.load(os.path.join(tmp, "saved_state.pt"))
    assert run_distributed(_load, 2, tmp, "sharded", "sharded_dp2") == [2, 2]  # cp 1 x dp 2
    _assert_bit_equal(torch.load(os.path.join(tmp, "loaded_sharded_dp2.pt")), saved, "sharded cp2 dp2 -> cp1 dp2")
    for fmt in ("sharded", "torch"):
        _load(single, tmp, fmt, f"{fmt}_single")
        _assert_bit_equal(
            torch.load(os.path.join(tmp, f"loaded_{fmt}_single.pt")), saved, f"{fmt} cp2 dp2 -> one process"
        )


def _trainer_cfg(cp):
    cfg = tiny_config(GPT2_STYLE, gbs=4, mbs=1, num_layers=2)
    return cfg.with_(
        parallel=replace(cfg.parallel, cp=cp),
        optim=replace(cfg.optim, use_distributed_optimizer=True),
        train=replace(cfg.train, train_iters=4),
    )


@pytest.mark.slow
def test_trainer_checkpoint_saved_at_cp2_resumes_in_one_process(tmp_path, run_distributed):
    """The real Trainer (mock data, the GPT path's CP slicing and ring attention): saved at cp 2 x dp 2
    with the distributed optimizer at iteration 2, resumed in one process, the last two losses equal
    the uninterrupted one-process run's."""
    root = str(tmp_path / "cp2")
    ref = train_losses(ParallelState.single(), _trainer_cfg(1))
    first = run_distributed(train_losses, 4, _trainer_cfg(2), root, None, "sharded", 2, cp=2)
    for losses in first:
        assert losses == pytest.approx(ref[:2], rel=1e-5)
    resumed = train_losses(ParallelState.single(), _trainer_cfg(1), load=root)
    assert resumed == pytest.approx(ref[2:], rel=1e-5)
