"""compare_runs across layouts: captures of 2-rank runs (tp 2 with sequence parallelism, pp 2 x vp 2,
cp 2, dp 2 with the distributed optimizer, an MoE at ep 2) put back together equal the one-process capture within the fp32
band; a weight perturbed on a tensor-parallel run is named where it first shows; the command itself
under torchrun."""

import sys
from dataclasses import replace

import pytest

from megalite.analysis.divergence import compare, load_capture
from megalite.model.spec import is_expert
from megalite.parallel.state import ParallelState
from megalite.testing.capture import capture_mock
from tests.helpers import REPO, TINY_RUN
from tests.helpers.moe_parity import moe_config, one_process
from tests.helpers.parity import LLAMA_STYLE, tiny_config

FC1 = "decoder.layers.1.mlp.linear_fc1.weight"


def _cfg(**parallel):
    cfg = tiny_config(
        LLAMA_STYLE, num_layers=4, tp=parallel.pop("tp", 1), pp=parallel.pop("pp", 1), vp=parallel.pop("vp", 1)
    )
    return cfg.with_(parallel=replace(cfg.parallel, **parallel))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-process capture (RMSNorm, SwiGLU, RoPE, grouped-query attention, untied output)."""
    path = str(tmp_path_factory.mktemp("reference"))
    capture_mock(ParallelState.single(), _cfg(), path)
    return load_capture(path)


@pytest.mark.parametrize(
    "name,cfg,tp,pp,cp",
    [
        ("tp2-sp", _cfg(tp=2, sequence_parallel=True), 2, 1, 1),
        ("pp2-vp2", _cfg(pp=2, vp=2), 1, 2, 1),
        ("cp2", _cfg(cp=2), 1, 1, 2),
    ],
)
def test_layouts_agree_with_one_process(reference, tmp_path, name, cfg, tp, pp, cp, run_distributed):
    run_distributed(capture_mock, 2, cfg, str(tmp_path), tp=tp, pp=pp, cp=cp)
    report = compare(reference, load_capture(str(tmp_path)))
    assert report.first is None, report.table()
    assert len(report.rows) == len(reference.tensors) == 69
    assert max(r.rel for r in report.rows) < 1e-5  # far inside the 1e-4 band


def test_distributed_optimizer_gradients_are_whole(reference, tmp_path, run_distributed):
    cfg = _cfg()
    cfg = cfg.with_(optim=replace(cfg.optim, use_distributed_optimizer=True))
    run_distributed(capture_mock, 2, cfg, str(tmp_path))  # dp 2: each rank reduced only its shard
    report = compare(reference, load_capture(str(tmp_path)))
    assert report.first is None, report.table()


def test_perturbed_sharded_weight_is_named_first(reference, tmp_path, run_distributed):
    run_distributed(capture_mock, 2, _cfg(tp=2), str(tmp_path), (FC1, 1e-3), tp=2)
    report = compare(reference, load_capture(str(tmp_path)))
    first = report.first
    assert (first.kind, first.name) == ("weight", FC1)
    assert not any(r.over for r in report.rows if r.layer in ("embedding", "0") and r.kind in ("weight", "activation"))
    assert next(r for r in report.rows if r.over and r.kind == "activation").name == "decoder.layers.1"


@pytest.mark.slow
def test_command_tp1_against_tp2_under_torchrun(tmp_path, launch):
    flags = TINY_RUN + ["--train-iters", "1", "--num-threads", "1"]
    proc = launch(
        [
            sys.executable,
            "tools/compare_runs.py",
            "--b",
            "--tensor-model-parallel-size 2",
            "--nproc-b",
            "2",
            "--keep",
            str(tmp_path),
            "--",
        ]
        + flags,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("side A: tp 1 pp 1 dp 1, float32, 4 micro-batches")
    assert lines[1].startswith("side B: tp 2 pp 1 dp 1, float32, 4 micro-batches")
    assert lines[-1] == "agree: all 67 tensors within the band (rtol 1e-04, atol 0e+00 (float32 band))"
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]


def test_expert_parallel_capture_agrees_with_one_process(tmp_path, run_distributed):
    """ep 2 (dp 2, the distributed optimizer): each expert's weights and gradients are written by its
    first expert-DP replica (dp rank 1 holds experts no dp-rank-0 writer has), and the experts' sharded
    gradients are gathered over expert DP."""
    cfg = moe_config(ep=2, optim=dict(use_distributed_optimizer=True))
    capture_mock(ParallelState.single(), one_process(cfg), str(tmp_path / "ref"))
    run_distributed(capture_mock, 2, cfg, str(tmp_path / "ep2"), ep=2)
    ref = load_capture(str(tmp_path / "ref"))
    report = compare(ref, load_capture(str(tmp_path / "ep2")))
    assert report.first is None, report.table()
    assert len(report.rows) == len(ref.tensors) and any(is_expert(r.name) for r in report.rows)


@pytest.mark.slow
def test_command_moe_one_process_against_ep2_under_torchrun(tmp_path, launch):
    """The issue's probe: compare_runs on any MoE model failed in the capture of the expert gradients."""
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48"]
    flags = TINY_RUN + moe + ["--train-iters", "1", "--num-threads", "1"]
    proc = launch(
        [sys.executable, "tools/compare_runs.py", "--b", "--expert-model-parallel-size 2", "--nproc-b", "2"]
        + ["--keep", str(tmp_path), "--"]
        + flags,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("side B: tp 1 pp 1 dp 2, float32, 2 micro-batches")
    assert lines[-1].startswith("agree: all ") and lines[-1].endswith("(rtol 1e-04, atol 0e+00 (float32 band))")
    assert any(".experts." in line and "grad" in line for line in lines)  # the experts' gradients compared
