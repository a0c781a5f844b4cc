"""Tensor-parallel layers against their torch counterparts: outputs and gradients."""

import pytest

from tests.helpers.tensor_parallel import _all_checks


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_match_torch(tp, run_distributed):
    for rank, res in enumerate(run_distributed(_all_checks, tp, tp=tp)):
        same_outside, distinct_inside = res.pop("rng")
        assert same_outside, f"rank {rank}: dropout outside the TP region differs across TP ranks"
        assert distinct_inside, f"rank {rank}: dropout inside the TP region repeats across TP ranks"
        assert res.pop("copy_grad_allreduced") == tp
        for what, err in res.items():
            assert err < 1e-5, f"rank {rank}: {what} differs by {err:.2e}"
