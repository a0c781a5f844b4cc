"""FP8 linears sharded over TP=2 against the same FP8 linears in one process: amaxes of sharded
tensors are reduced over the TP group, so every scale, and so every result, is the unsharded one."""

from dataclasses import replace

import pytest

from tests.helpers.fp8 import fp8_count, fp8_tp_parity
from tests.helpers.parity import LLAMA_STYLE, assert_close_run, reference_run, run_steps, tiny_config


@pytest.mark.parametrize(
    "recipe,fp8_format,sp",
    [("tensorwise", "hybrid", False), ("rowwise", "e4m3", True), ("delayed", "hybrid", True)],
)
def test_fp8_linears_sharded_match_one_process(recipe, fp8_format, sp, run_distributed):
    for rank, res in enumerate(run_distributed(fp8_tp_parity, 2, recipe, fp8_format, sp, tp=2)):
        assert res.pop("fp8_vs_plain") > 1e-3, "FP8 rounding should be visible against plain linears"
        for what, err in res.items():
            assert err < 2e-6, f"rank {rank}: {what} differs from one process by {err:.2e}"


def test_fp8_training_at_tp2_with_sequence_parallelism_matches_one_process(run_distributed):
    """Three training steps (delayed scaling, history 2, GQA + SwiGLU + RoPE) at TP=2 with SP reproduce one
    process: losses, grad norms and final weights. Tolerance 1e-4, not bf16 layouts' 1e-5: a last-bit
    difference of fp32 sums moves an element across an FP8 rounding boundary now and then."""
    fp8 = dict(LLAMA_STYLE, fp8_format="hybrid", fp8_recipe="delayed", fp8_amax_history_len=2)
    ref = reference_run(tiny_config(fp8), 3)
    cfg = tiny_config(fp8, tp=2)
    cfg = cfg.with_(parallel=replace(cfg.parallel, sequence_parallel=True))
    results = run_distributed(run_steps, 2, cfg, 3, ref["state"], fp8_count, tp=2)
    assert [r["fp8_linears"] for r in results] == [8, 8]  # 2 layers x (qkv, proj, fc1, fc2)
    assert_close_run(results, ref, rtol=1e-4, param_rtol=1e-4)
