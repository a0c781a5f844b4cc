"""FP8 linears sharded over TP=2 against the same FP8 linears in one process: amaxes of sharded
tensors are reduced over the TP group, so every scale, and so every result, is the unsharded one."""

import pytest

from tests.helpers.fp8 import fp8_tp_parity


@pytest.mark.parametrize(
    "recipe,fp8_format,sp",
    [("tensorwise", "hybrid", False), ("rowwise", "e4m3", True), ("delayed", "hybrid", True)],
)
def test_fp8_linears_sharded_match_one_process(recipe, fp8_format, sp, run_distributed):
    for rank, res in enumerate(run_distributed(fp8_tp_parity, 2, recipe, fp8_format, sp, tp=2)):
        assert res.pop("fp8_vs_plain") > 1e-3, "FP8 rounding should be visible against plain linears"
        for what, err in res.items():
            assert err < 2e-6, f"rank {rank}: {what} differs from one process by {err:.2e}"
