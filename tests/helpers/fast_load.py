"""The sharded-load tests' run (GPT-2 style, 4 layers): save after one step, load into one process, and
compare every weight and the whole optimizer state."""

import io
from dataclasses import replace

import torch

from megalite.checkpointing import load_checkpoint, save_checkpoint
from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from megalite.training.mock import MockFeed
from tests.helpers.parity import GPT2_STYLE, tiny_config


def _cfg(tp=1, pp=1, distopt=False, dtype="float32"):
    cfg = tiny_config(GPT2_STYLE, gbs=4, mbs=1, num_layers=4, tp=tp, pp=pp)
    return cfg.with_(
        model=replace(cfg.model, params_dtype=dtype), optim=replace(cfg.optim, use_distributed_optimizer=distopt)
    )


def _parts(t):
    return t.run_parts


def _state(t):
    """Every weight and the whole optimizer state (collective over DP)."""
    return {
        "model": {n: p.detach().clone() for c in t.chunks for n, p in c.named_parameters()},
        "optim": t.optimizer.full_state_dict(include_main=True, to_cpu=True),
    }


def _save_trained(ps, cfg, root):
    t = Trainer(cfg, ps)
    t.train_step(MockFeed(t, 1).next())  # Adam's moments exist
    t.state.iteration = 1
    save_checkpoint(_parts(t), root, "sharded")
    state = _state(t)
    buf = io.BytesIO()  # plain bytes: tensors through the result queue would outlive their rank
    torch.save(state, buf)
    return buf.getvalue() if ps.tp_size == ps.pp_size == 1 and ps.rank == 0 else None


def _loaded(root, cfg):
    t = Trainer(cfg, ParallelState.single())
    assert load_checkpoint(_parts(t), root) == 1
    return _state(t)


def _assert_equal(a, b, what):
    for part in ("model", "optim"):
        assert a[part].keys() == b[part].keys(), what
        for n in a[part]:
            x, y = a[part][n], b[part][n]
            if isinstance(x, dict):
                assert x.keys() == y.keys(), (what, n)
                for k in x:
                    assert torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k])), (what, n, k)
            else:
                assert torch.equal(x, y), (what, n)
