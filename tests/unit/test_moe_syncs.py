"""Host syncs of one MoE forward and backward, counted on CPU.

On CUDA every host read of a device value (``.tolist()``, ``.item()``, ``int(t)``, ``bool(t)``) and
every op whose output size depends on the data (``nonzero``, boolean masks, ``bincount``,
``unique``, ``repeat_interleave`` without ``output_size``) waits for the device. On CPU nothing
waits, so the test counts those calls instead: the Python-level reads through a TorchFunctionMode,
the data-dependent ops through a TorchDispatchMode (which also sees the backward's ops).
"""

from __future__ import annotations

import pytest
import torch

from megalite.moe import moe_layers
from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from tests.helpers.moe_parity import moe_cfg
from tests.helpers.moe_syncs import count_syncs


@pytest.mark.parametrize(
    "dispatcher,model",
    [
        ("alltoall", {}),
        ("allgather", {}),
        ("alltoall", {"moe_expert_capacity_factor": 0.5}),
        ("alltoall", {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}),
        ("allgather", {"moe_expert_capacity_factor": 0.5, "moe_token_drop_policy": "position"}),
    ],
)
def test_one_host_sync_per_dispatch(dispatcher, model):
    trainer = Trainer(moe_cfg(model, moe_token_dispatcher_type=dispatcher), ParallelState.single())
    layer = moe_layers(trainer.chunks)[0]
    assert type(layer.dispatch).__name__.lower().startswith(dispatcher)
    x = torch.randn(16, 2, 32, requires_grad=True)

    def step():
        out = layer(x)
        out.square().sum().backward()
        return out

    out, seen = count_syncs(step)
    assert seen == ["tolist"], seen  # the sizes the dispatch reads, once; nothing else waits
    assert x.grad is not None and torch.isfinite(out).all()


def test_the_counter_sees_what_would_sync():
    t = torch.tensor([0, 2, 1])
    _, seen = count_syncs(lambda: (t.nonzero(), t[t > 0], torch.bincount(t), t.repeat_interleave(t), int(t[0])))
    assert seen == ["nonzero", "index", "bincount", "repeat_interleave", "__int__"]
    _, seen = count_syncs(lambda: t.repeat_interleave(t, output_size=3))
    assert seen == []


def test_megatron_fusion_flags_are_accepted():
    from megalite.config.arguments import parse_args

    small = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    cfg = parse_args(small + ["--num-experts", "4", "--moe-permute-fusion", "--moe-router-fusion"], world_size=1)
    assert cfg.model.moe_permute_fusion and cfg.model.moe_router_fusion


@pytest.mark.gpu  # torch.cuda.set_sync_debug_mode
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_cuda_sync_per_dispatch(dtype):
    """On a GPU the driver says when the host waits: one warning per dispatch (the sizes' tolist); in bf16
    on Hopper that is the grouped-GEMM path."""
    import warnings

    ps = ParallelState.single(torch.device("cuda"))
    layer = moe_layers(Trainer(moe_cfg(moe_token_dispatcher_type="alltoall"), ps).chunks)[0].to(dtype)
    x = torch.randn(16, 2, 32, device="cuda", dtype=dtype, requires_grad=True)
    layer(x).float().square().sum().backward()  # warm-up: lazy initialisations may sync once
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            layer(x).float().square().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, syncs
