"""Zero-bubble schedules and overlapped p2p reproduce the single-process run.

Losses, grad norms and final weights equal the one-process run within 1e-5.

ZB-H1 (one chunk per rank), ZB-V and DualPipeV (two chunks in a V: rank 0
holds the first and the last stage) split every backward into B (input gradients) and a
deferred W (weight GEMMs). The matrix covers pp 2 and 4; tp 2 with dp 2;
m in {pp, 2pp, 3pp}; tied embeddings (in a V both uses of the embedding sit
on rank 0) and untied; and the features whose gradients W must still land
right: sequence parallelism (W gathers the sequence again), full
recomputation (W reads the recomputed inputs), the distributed optimizer
with overlapped reduce-scatter (grads arrive through the grad buffer's hooks).
The overlapped placement (--overlap-p2p-communication: sends right after
their compute, receives one compute ahead) runs 1F1B, interleaved 1F1B and
the zero-bubble schedules.
"""

from dataclasses import replace

import pytest

from tests.helpers.parity import GPT2_STYLE, LLAMA_STYLE, assert_close_run, reference_run, run_steps, tiny_config

STEPS = 3
LAYERS = 8


def _reference(emb, gbs, model=None):
    style = {**(GPT2_STYLE if emb == "tied" else LLAMA_STYLE), **(model or {})}
    return reference_run(tiny_config(style, gbs=gbs, mbs=1, num_layers=LAYERS), STEPS)  # cached


def _check(run_distributed, schedule, tp, pp, vp, dp, m, emb, parallel=None, optim=None, model=None):
    gbs = m * dp
    ref = _reference(emb, gbs)
    style = {**(GPT2_STYLE if emb == "tied" else LLAMA_STYLE), **(model or {})}
    cfg = tiny_config(style, gbs=gbs, mbs=1, num_layers=LAYERS, schedule=schedule, tp=tp, pp=pp, vp=vp)
    cfg = cfg.with_(parallel=replace(cfg.parallel, **(parallel or {})), optim=replace(cfg.optim, **(optim or {})))
    results = run_distributed(run_steps, tp * pp * dp, cfg, STEPS, ref["state"], tp=tp, pp=pp)
    assert all(len(r["losses"]) == STEPS for r in results)
    assert any(r["last_stage"] and None not in r["losses"] for r in results)  # the loss was checked somewhere
    assert_close_run(results, ref)


# (schedule, tp, pp, vp, dp, m, embeddings)
CASES = [
    ("zb_h1", 1, 2, 1, 1, 2, "tied"),
    ("zb_h1", 1, 4, 1, 1, 8, "untied"),
    ("zb_h1", 1, 4, 1, 2, 12, "tied"),
    ("zb_h1", 2, 2, 1, 2, 6, "untied"),
    ("zbv", 1, 2, 2, 1, 2, "untied"),
    ("zbv", 1, 2, 2, 1, 4, "tied"),
    ("zbv", 1, 4, 2, 1, 12, "untied"),
    ("zbv", 2, 2, 2, 2, 6, "tied"),
    ("dualpipev", 1, 2, 2, 1, 4, "tied"),
    ("dualpipev", 1, 4, 2, 1, 8, "untied"),
    ("dualpipev", 2, 2, 2, 2, 6, "untied"),
]
OVERLAP_CASES = [
    ("1f1b", 1, 4, 1, 1, 8, "tied"),
    ("interleaved_1f1b", 1, 2, 2, 1, 4, "untied"),
    ("interleaved_1f1b", 2, 2, 2, 2, 2, "tied"),
    ("zb_h1", 1, 4, 1, 1, 4, "untied"),
    ("zbv", 1, 4, 2, 1, 4, "tied"),
    ("dualpipev", 1, 2, 2, 1, 5, "tied"),
]


@pytest.mark.parametrize(
    "schedule,tp,pp,vp,dp,m,emb", CASES, ids=[f"{c[0]}-tp{c[1]}pp{c[2]}vp{c[3]}dp{c[4]}-m{c[5]}-{c[6]}" for c in CASES]
)
def test_zero_bubble_matches_single_process(schedule, tp, pp, vp, dp, m, emb, run_distributed):
    _check(run_distributed, schedule, tp, pp, vp, dp, m, emb)


@pytest.mark.parametrize(
    "schedule,tp,pp,vp,dp,m,emb",
    OVERLAP_CASES,
    ids=[f"{c[0]}-tp{c[1]}pp{c[2]}vp{c[3]}dp{c[4]}-m{c[5]}-{c[6]}" for c in OVERLAP_CASES],
)
def test_overlapped_p2p_matches_single_process(schedule, tp, pp, vp, dp, m, emb, run_distributed):
    _check(run_distributed, schedule, tp, pp, vp, dp, m, emb, parallel=dict(overlap_p2p_comm=True))


def test_zb_h1_with_sequence_parallel_and_full_recompute(run_distributed):
    _check(
        run_distributed,
        "zb_h1",
        2,
        2,
        1,
        1,
        4,
        "tied",
        parallel=dict(sequence_parallel=True),
        model=dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    )


def test_zbv_with_distributed_optimizer_and_overlapped_reduce(run_distributed):
    _check(
        run_distributed,
        "zbv",
        1,
        2,
        2,
        2,
        4,
        "untied",
        optim=dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True),
    )
