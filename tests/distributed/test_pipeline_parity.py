"""Every pipeline schedule reproduces the single-process run (losses, grad norms, final weights).

Layouts follow the issue: (tp, pp, vp, dp) in (1,2,1,1), (1,4,1,1), (1,2,2,1), (1,4,2,1),
(2,2,2,2) on 8 ranks and (1,4,1,2), with m in {pp, 2pp, 3pp} where the schedule allows,
tied and untied embeddings. Models have 8 layers so pp=4, vp=2 holds one layer per chunk.
"""

import pytest

from tests.helpers.parity import GPT2_STYLE, LLAMA_STYLE, assert_close_run, reference_run, run_steps, tiny_config

STEPS = 3
LAYERS = 8


def _reference(style_name, gbs, mbs, layers):
    style = GPT2_STYLE if style_name == "tied" else LLAMA_STYLE
    return reference_run(tiny_config(style, gbs=gbs, mbs=mbs, num_layers=layers), STEPS)  # cached


# (schedule, tp, pp, vp, dp, m, embeddings)
CASES = [
    ("1f1b", 1, 2, 1, 1, 2, "tied"),
    ("1f1b", 1, 2, 1, 1, 6, "tied"),
    ("gpipe", 1, 2, 1, 1, 6, "untied"),
    ("interleaved_1f1b", 1, 2, 2, 1, 2, "untied"),
    ("interleaved_1f1b", 1, 2, 2, 1, 4, "tied"),
    ("gpipe", 1, 4, 2, 1, 4, "tied"),
    ("gpipe", 2, 2, 2, 2, 2, "untied"),
    ("1f1b", 1, 4, 1, 2, 8, "untied"),
    ("gpipe", 1, 2, 1, 1, 2, "tied"),
    ("1f1b", 1, 2, 1, 1, 4, "untied"),
    ("interleaved_1f1b", 1, 2, 2, 1, 6, "tied"),
    ("1f1b", 1, 4, 1, 1, 4, "tied"),
    ("gpipe", 1, 4, 1, 1, 8, "untied"),
    ("1f1b", 1, 4, 1, 1, 12, "untied"),
    ("interleaved_1f1b", 1, 4, 2, 1, 4, "untied"),
    ("interleaved_1f1b", 1, 4, 2, 1, 8, "tied"),
    ("gpipe", 1, 2, 2, 1, 4, "untied"),
    ("interleaved_1f1b", 2, 2, 2, 2, 2, "tied"),
    ("1f1b", 2, 2, 1, 2, 4, "untied"),
    ("1f1b", 1, 4, 1, 2, 4, "tied"),
    ("interleaved_1f1b", 1, 4, 2, 2, 4, "untied"),
]


@pytest.mark.parametrize(
    "schedule,tp,pp,vp,dp,m,emb", CASES, ids=[f"{c[0]}-tp{c[1]}pp{c[2]}vp{c[3]}dp{c[4]}-m{c[5]}-{c[6]}" for c in CASES]
)
def test_schedule_matches_single_process(schedule, tp, pp, vp, dp, m, emb, run_distributed):
    _check(run_distributed, schedule, tp, pp, vp, dp, m, emb)


@pytest.mark.parametrize("first,last", [(3, 5), (1, 7)])
def test_uneven_stages_match_single_process(first, last, run_distributed):
    _check(run_distributed, "1f1b", 1, 2, 1, 1, 4, "tied", first, last)


def test_uneven_interleaved_stages_match_single_process(run_distributed):
    # pp=4, vp=2, 12 layers: first/last ranks hold 1 layer per chunk, the middle two 2 each
    _check(run_distributed, "interleaved_1f1b", 1, 4, 2, 1, 4, "untied", 2, 2, layers=12)


def _check(run_distributed, schedule, tp, pp, vp, dp, m, emb, first=None, last=None, layers=LAYERS):
    mbs = 1
    gbs = m * mbs * dp
    ref = _reference(emb, gbs, mbs, layers)
    style = GPT2_STYLE if emb == "tied" else LLAMA_STYLE
    cfg = tiny_config(
        style, gbs=gbs, mbs=mbs, num_layers=layers, schedule=schedule, tp=tp, pp=pp, vp=vp, first=first, last=last
    )
    results = run_distributed(run_steps, tp * pp * dp, cfg, STEPS, ref["state"], tp=tp, pp=pp)
    assert_close_run(results, ref)
