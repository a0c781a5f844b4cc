"""--compile reproduces the eager run (fp32, 2 steps): every loss and grad norm, the last step's gradients and
the final parameters within 1e-5.

One process compiles with inductor (what a run uses; its C++ kernels are built on CPU, the slow part).
The multi-rank cases use the aot_eager backend: dynamo's graph capture with its breaks at the
collectives and the recompute checkpoint, and AOTAutograd's joint forward/backward graph, which is where
compile bugs live; inductor's kernel builds on 2 ranks x 3 configurations would cost minutes on 2 cores.
"""

from dataclasses import replace

import pytest

from tests.helpers.compile import assert_same, eager_and_compiled
from tests.helpers.parity import GPT2_STYLE, LLAMA_STYLE, tiny_config

pytestmark = pytest.mark.slow


def _with(cfg, **model):
    return cfg.with_(model=replace(cfg.model, **model))


def test_compiled_layers_match_eager_in_one_process():
    from megalite.model.compile import cannot_compile
    from megalite.parallel.state import ParallelState

    ps = ParallelState.single()
    if cannot_compile(ps.device):
        pytest.skip(cannot_compile(ps.device))
    cfg = _with(tiny_config(LLAMA_STYLE), recompute_granularity="selective")
    for name, pair in eager_and_compiled(ps, [("one process, selective recompute", cfg)]).items():
        assert_same(name, pair)


def test_compiled_layers_match_eager_under_tp_sp_and_recompute(run_distributed):
    """With dropout too: the TP-stream masks are drawn eagerly, the others by the graph (aot_eager runs torch's
    own random ops in eager's order, so every mask equals eager's)."""
    tp = _with(tiny_config(LLAMA_STYLE, tp=2), hidden_dropout=0.1, attention_dropout=0.1)
    cases = [
        ("tp2 + SP, dropout", tp.with_(parallel=replace(tp.parallel, sequence_parallel=True))),
        (
            "tp2, full recompute",
            _with(tiny_config(GPT2_STYLE, tp=2), recompute_granularity="full", recompute_method="uniform"),
        ),
    ]
    results = run_distributed(eager_and_compiled, 2, cases, 2, "aot_eager", tp=2)
    for result in results:
        for name, pair in result.items():
            assert_same(name, pair)


def test_compiled_layers_match_eager_in_every_pipeline_stage(run_distributed):
    cases = [("pp2 1f1b", tiny_config(GPT2_STYLE, pp=2))]
    results = run_distributed(eager_and_compiled, 2, cases, 2, "aot_eager", pp=2)
    for result in results:
        for name, pair in result.items():
            assert_same(name, pair)


def test_compiled_layers_match_eager_under_cp_and_with_moe(run_distributed):
    """CP's attention and the MoE block run eagerly inside the compiled layer (a graph break each)."""
    from megalite.parallel.state import ParallelState

    cp = tiny_config(LLAMA_STYLE)
    results = run_distributed(
        eager_and_compiled, 2, [("cp2", cp.with_(parallel=replace(cp.parallel, cp=2)))], 2, "aot_eager", cp=2
    )
    moe = _with(tiny_config(GPT2_STYLE), num_experts=4, moe_router_topk=2)
    results.append(eager_and_compiled(ParallelState.single(), [("moe", moe)], 2, "aot_eager"))
    for result in results:
        for name, pair in result.items():
            assert_same(name, pair)
