"""TP x DP runs reproduce the single-process run: loss of every step, grad norm, final weights."""
import pytest

from megalite.testing import run_distributed
from tests.distributed.common import (GPT2_STYLE, LLAMA_STYLE, assert_close_run, reference_run,
                                      run_steps, tiny_config)

STEPS = 5


@pytest.fixture(scope="module")
def gpt2_reference():
    return reference_run(tiny_config(GPT2_STYLE), STEPS)


@pytest.mark.parametrize("tp,dp", [(1, 2), (2, 1), (2, 2), (4, 1), (4, 2)])
@pytest.mark.multiprocess
def test_gpt2_style_matches_single_process(gpt2_reference, tp, dp):
    cfg = tiny_config(GPT2_STYLE, tp=tp)
    results = run_distributed(run_steps, tp * dp, cfg, STEPS, gpt2_reference["state"], tp=tp)
    assert_close_run(results, gpt2_reference)


@pytest.mark.multiprocess
def test_llama_style_gqa_matches_single_process():
    ref = reference_run(tiny_config(LLAMA_STYLE), STEPS)
    cfg = tiny_config(LLAMA_STYLE, tp=2)
    results = run_distributed(run_steps, 4, cfg, STEPS, ref["state"], tp=2)
    assert_close_run(results, ref)


def test_loss_falls_in_reference_run(gpt2_reference):
    losses = gpt2_reference["losses"]
    assert losses[-1] < losses[0] - 0.05, losses
