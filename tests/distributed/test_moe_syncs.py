"""Host syncs of one MoE forward and backward across ranks: the all-to-all exchanges its counts on the
device and reads every size once (tests/unit/test_moe_syncs.py counts the calls that would wait)."""

import pytest
import torch

from megalite.moe import moe_layers
from megalite.training import Trainer
from tests.helpers.moe_parity import moe_config
from tests.helpers.moe_syncs import count_syncs


def _syncs(ps, cfg):
    layer = moe_layers(Trainer(cfg, ps).chunks)[0]
    torch.manual_seed(ps.rank)  # each rank routes tokens of its own
    x = torch.randn(8, 2, 32, requires_grad=True)  # this rank's sequence shard [s/tp, b, h]

    def step():
        layer(x).square().sum().backward()

    return count_syncs(step)[1]


@pytest.mark.slow
@pytest.mark.parametrize("etp,dispatcher", [(1, "alltoall"), (2, "alltoall"), (2, "allgather")])
def test_one_host_sync_per_dispatch_over_tp2_ep2(etp, dispatcher, run_distributed):
    cfg = moe_config(tp=2, ep=2, etp=etp, dispatcher=dispatcher)
    for seen in run_distributed(_syncs, 4, cfg, tp=2, ep=2, etp=etp):
        assert seen == ["tolist"], seen
