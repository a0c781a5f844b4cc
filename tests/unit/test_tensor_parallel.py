"""Tensor-parallel layers in one process (TP 1) against their torch counterparts: outputs and gradients.
(TP 2 and 4 on gloo ranks: tests/distributed/test_tensor_parallel.py.)"""

from megalite.parallel.state import ParallelState
from tests.helpers.tensor_parallel import _all_checks


def test_single_process_layers_match_torch():
    res = _all_checks(ParallelState.single())
    res.pop("rng")
    res.pop("copy_grad_allreduced")
    for what, err in res.items():
        assert err < 1e-6, f"{what} differs by {err:.2e}"
