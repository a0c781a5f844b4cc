"""TP x DP runs reproduce the single-process run: loss of every step, grad norm, final weights."""

import pytest

from tests.helpers.parity import (
    GPT2_STYLE,
    LLAMA_STYLE,
    REFERENCE_STEPS,
    assert_close_run,
    reference_run,
    run_steps,
    tiny_config,
)

STEPS = REFERENCE_STEPS  # the gpt2_reference fixture's (tests/conftest.py)


@pytest.mark.parametrize("tp,dp", [(1, 2), (2, 1), (2, 2), (4, 1), (4, 2)])
def test_gpt2_style_matches_single_process(gpt2_reference, tp, dp, run_distributed):
    cfg = tiny_config(GPT2_STYLE, tp=tp)
    results = run_distributed(run_steps, tp * dp, cfg, STEPS, gpt2_reference["state"], tp=tp)
    assert_close_run(results, gpt2_reference)


def test_llama_style_gqa_matches_single_process(run_distributed):
    ref = reference_run(tiny_config(LLAMA_STYLE), STEPS)
    cfg = tiny_config(LLAMA_STYLE, tp=2)
    results = run_distributed(run_steps, 4, cfg, STEPS, ref["state"], tp=2)
    assert_close_run(results, ref)
