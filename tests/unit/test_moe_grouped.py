"""The grouped-GEMM experts (torch._grouped_mm; chosen on CUDA bf16 only) against the loop over experts.

torch's CPU build has a reference _grouped_mm, so the grouped path's layout (rows padded to the
kernels' alignment by one gather, offsets computed on the device) is checked here, forward and
backward; the device check runs the same comparison on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from megalite.moe import moe_layers
from megalite.moe.experts import aligned_groups
from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from tests.helpers.moe_parity import moe_cfg
from tests.helpers.moe_syncs import count_syncs


def test_aligned_groups_pad_each_group_by_repeating_its_last_row():
    counts = [0, 3, 8, 9, 0, 1]
    src, rows, offs = aligned_groups(counts, torch.tensor(counts))
    assert offs.dtype == torch.int32 and offs.tolist() == [0, 8, 16, 32, 32, 40]
    assert src.tolist() == [0, 1, 2, 2, 2, 2, 2, 2] + list(range(3, 11)) + list(range(11, 20)) + [19] * 7 + [20] * 8
    assert rows.tolist() == [0, 1, 2] + list(range(8, 16)) + list(range(16, 25)) + [32]
    assert torch.equal(src[rows], torch.arange(21))  # every real row comes back from its own place


def _grouped_mm_on_cpu() -> bool:
    try:
        w = torch.zeros(2, 8, 8, dtype=torch.bfloat16)
        torch._grouped_mm(torch.zeros(16, 8, dtype=torch.bfloat16), w, offs=torch.tensor([8, 16], dtype=torch.int32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


@pytest.mark.skipif(not _grouped_mm_on_cpu(), reason="this torch has no CPU torch._grouped_mm")
def test_grouped_experts_equal_the_loop_forward_and_backward():
    trainer = Trainer(moe_cfg({"moe_ffn_hidden_size": 48}), ParallelState.single())
    ex = moe_layers(trainer.chunks)[0].experts.to(torch.bfloat16)
    experts = list(ex.local_experts.values())
    counts = [5, 0, 17, 10]
    torch.manual_seed(0)
    x = torch.randn(sum(counts), 32, dtype=torch.bfloat16)
    r = torch.randn(sum(counts), 32)
    results = []
    for grouped in (False, True):
        xi = x.clone().requires_grad_()
        if grouped:  # nothing in it waits for the device: the sizes come from the host's counts
            dev = torch.tensor(counts)
            out, seen = count_syncs(lambda: ex._grouped_forward(xi, counts, dev, experts))
            assert seen == [], seen
        else:
            out = ex(xi, counts)
        (out.float() * r).sum().backward()
        grads = [p.grad.clone() for p in ex.parameters()]
        ex.zero_grad(set_to_none=True)
        results.append((out.detach(), xi.grad, grads))
    (out, gx, gw), (gout, ggx, ggw) = results
    assert out.abs().max() > 1e-3 and all(g.abs().max() > 1e-2 for i, g in enumerate(gw) if i // 2 != 1)
    torch.testing.assert_close(gout, out)  # bf16's tolerances
    torch.testing.assert_close(ggx, gx)
    for a, b in zip(ggw, gw):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper GPU"
)
def test_grouped_path_is_taken_on_hopper_and_equals_the_loop():
    ps = ParallelState.single(torch.device("cuda"))
    ex = moe_layers(Trainer(moe_cfg({"moe_ffn_hidden_size": 48}), ps).chunks)[0].experts.to(torch.bfloat16)
    counts = [5, 0, 17, 10]
    x = torch.randn(sum(counts), 32, device="cuda", dtype=torch.bfloat16)
    assert ex._grouped(x)
    r = torch.randn(sum(counts), 32, device="cuda")
    results = []
    for grouped in (False, True):
        xi = x.clone().requires_grad_()
        if grouped:
            out = ex(xi, counts, device_counts=torch.tensor(counts, device="cuda"))
        else:
            out = torch.cat([e(p) for e, p in zip(ex.local_experts.values(), xi.split(counts))])
        (out.float() * r).sum().backward()
        results.append((out.detach(), xi.grad, [p.grad.clone() for p in ex.parameters()]))
        ex.zero_grad(set_to_none=True)
    (out, gx, gw), (gout, ggx, ggw) = results
    torch.testing.assert_close(gout, out)
    torch.testing.assert_close(ggx, gx)
    for a, b in zip(ggw, gw):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "model",
    [{}, {"swiglu": False, "add_bias_linear": True, "normalization": "LayerNorm"}],
    ids=["swiglu-no-bias", "gelu-bias"],
)
def test_loop_experts_equal_each_expert_on_its_own_rows(model):
    """The loop path (one autograd node per linear over the grouped weights, gradients written into their
    slices) against each expert's own F.linear on its slices of the weights, forward and backward, with an
    expert that gets no rows."""
    trainer = Trainer(moe_cfg({"moe_ffn_hidden_size": 48, **model}), ParallelState.single())
    ex = moe_layers(trainer.chunks)[0].experts
    counts = [5, 0, 17, 10]
    torch.manual_seed(0)
    x, r = torch.randn(sum(counts), 32), torch.randn(sum(counts), 32)
    results = []
    for path in ("loop", "each"):
        xi = x.clone().requires_grad_()
        if path == "loop":
            out = ex(xi, counts)
        else:
            out = torch.cat([view(part) for view, part in zip(ex.local_experts.values(), xi.split(counts))])
        (out * r).sum().backward()
        results.append((out.detach(), xi.grad, [p.grad.clone() for p in ex.parameters()]))
        ex.zero_grad(set_to_none=True)
    (a, ga, pa), (b, gb, pb) = results
    assert len(pa) == (4 if model else 2) and all(g.abs().sum() > 0 for g in pa)
    assert torch.allclose(a, b, atol=1e-6) and torch.allclose(ga, gb, atol=1e-6)
    assert all(torch.allclose(u, v, atol=1e-6) for u, v in zip(pa, pb))
    assert all(float(g[1].abs().max()) == 0 for g in pa)  # expert 1 saw no rows
