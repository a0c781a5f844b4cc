"""The optimizer layer's pieces in one process: loss-scaler rules, main weights, state round trips,
attention paths and activation recomputation."""

import pytest
import torch

from megalite.config import ModelConfig, OptimConfig
from megalite.model.transformer import Attention
from megalite.optim.grad_scaler import DynamicGradScaler
from megalite.optim.optimizer import MegatronOptimizer
from megalite.parallel.state import ParallelState
from megalite.tensor_parallel.random import RNGTracker, checkpoint


def test_dynamic_scaler_follows_megatron_rules():
    s = DynamicGradScaler(initial_scale=2.0**10, min_scale=4.0, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 1024 and s.hysteresis_tracker == 1  # first overflow: hysteresis absorbs it
    s.update(True)
    assert s.scale == 512  # second: halve
    s.update(True)
    assert s.scale == 256  # still out of hysteresis budget: halve again
    for _ in range(2):
        s.update(False)
    assert s.scale == 256
    s.update(False)
    assert s.scale == 512 and s.hysteresis_tracker == 2  # 3 clean steps: double, budget refilled
    for _ in range(20):
        s.update(True)
    assert s.scale == 4.0  # never below --min-loss-scale
    t = DynamicGradScaler(1.0, 1.0, 1, 1)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()


def _tiny_params(dtype):
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 5).to(dtype)
    norm = torch.nn.LayerNorm(5).to(dtype)
    return [("lin.weight", lin.weight), ("lin.bias", lin.bias), ("norm.weight", norm.weight)], (lin, norm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_and_fp32_main_weights(dtype):
    cfg = OptimConfig(lr=0.1, clip_grad=0.0, lr_warmup_iters=0, accumulate_allreduce_grads_in_fp32=True)
    named, (lin, norm) = _tiny_params(dtype)
    opt = MegatronOptimizer(named, cfg, ParallelState.single())
    for _ in range(2):
        opt.zero_grad(1)
        norm(lin(torch.randn(3, 6, dtype=dtype))).float().square().sum().backward()
        opt.finalize_grads()
        assert opt.step()[0]
    main = {pc.name: pc.main for pc in opt.pieces}
    assert all(m.dtype == torch.float32 for m in main.values())
    # the model weight is the main weight rounded to the model dtype
    assert torch.equal(lin.weight.data, main["lin.weight"].detach().to(dtype))
    full = opt.full_state_dict()
    assert set(full) == {"lin.weight", "lin.bias", "norm.weight"}
    assert set(full["lin.weight"]) >= {"param", "exp_avg", "exp_avg_sq", "step"}
    named2, (lin2, _) = _tiny_params(dtype)
    opt2 = MegatronOptimizer(named2, cfg, ParallelState.single())
    opt2.load_full_state_dict(full)
    assert torch.equal(lin2.weight.data, lin.weight.data)
    for a, b in zip(opt.sharded_state_dict()["pieces"].values(), opt2.sharded_state_dict()["pieces"].values()):
        assert all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)


def _attention(backend, groups, dropout=0.0):
    cfg = ModelConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=groups,
        attention_dropout=dropout,
        attention_backend=backend,
    )
    ps = ParallelState.single()
    return Attention(cfg, ps.tp, RNGTracker(1, 0, 0, ps.device), seed=3, prefix="a")


@pytest.mark.parametrize("groups", [None, 2, 1])
def test_unfused_attention_equals_sdpa_with_grouped_queries(groups):
    torch.manual_seed(0)
    x = torch.randn(12, 2, 32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = _attention("auto", groups), _attention("unfused", groups)
    ya, yb = a(xa), b(xb)
    assert torch.allclose(ya, yb, atol=1e-5)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert torch.allclose(xa.grad, xb.grad, atol=1e-5)
    assert torch.allclose(a.linear_qkv.weight.grad, b.linear_qkv.weight.grad, atol=1e-5)


def test_checkpoint_reproduces_dropout_masks_of_both_rng_streams():
    ps = ParallelState.single()
    tracker = RNGTracker(5, 0, 0, ps.device)
    w = torch.randn(8, 8, requires_grad=True)

    def fn(x):  # draws from the default stream and from the tensor-parallel stream
        h = torch.nn.functional.dropout(x @ w, 0.5, True)
        with tracker.fork("tp"):
            return torch.nn.functional.dropout(h.tanh(), 0.5, True)

    x = torch.randn(4, 8, requires_grad=True)
    states = tracker.get_states()
    ref = fn(x)
    ref.sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    tracker.set_states(states)
    out = checkpoint(fn, tracker, x)
    after_forward = tracker.get_states()
    out.sum().backward()
    assert torch.equal(out, ref) and torch.equal(x.grad, gx) and torch.equal(w.grad, gw)
    # recomputing in backward leaves the streams where the forward left them
    assert all(torch.equal(a, b) for a, b in zip(after_forward.values(), tracker.get_states().values()))
