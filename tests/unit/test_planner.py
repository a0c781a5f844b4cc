"""Layout planner: memory estimate against measured CPU runs, the search, the CLI's flags."""

from __future__ import annotations

import shlex

import pytest

from benchmarks.bench_plan import GPT2, LLAMA, compare
from megalite.analysis.planner import (
    GiB,
    Layout,
    _in_flight_pattern,
    _simulate,
    activation_bytes_per_rank,
    estimate_memory,
)
from megalite.analysis.search import plan
from megalite.analysis.simulate import simulate_schedule
from megalite.config import ModelConfig
from megalite.config.arguments import parse_args

PARTS = ("weights", "grads", "optimizer", "activations")


@pytest.mark.parametrize(
    "name,layout,gbs",
    [
        ("gpt2", Layout(1, 1, 1, mbs=2, recompute="selective"), 4),
        # 2 gloo ranks (bench_plan forks them): marked by hand, as a fixture cannot mark one parameter
        pytest.param("llama", Layout(1, 2, 1, vp=2, mbs=1), 4, marks=pytest.mark.multiprocess),
    ],
)
@pytest.mark.slow
def test_memory_estimate_within_10_percent_of_measured(name, layout, gbs):
    """Measured: saved-tensor bytes replayed in schedule order + weights, grad buffer, Adam state."""
    got, est = compare(name, layout, gbs)
    for part in ("weights", "grads", "optimizer"):  # counted from the model's shapes: exact
        assert est[part] == pytest.approx(got[part], rel=1e-6), part
    assert est["activations"] == pytest.approx(got["activations"], rel=0.10)
    assert sum(est[p] for p in PARTS) == pytest.approx(sum(got[p] for p in PARTS), rel=0.10)


def test_options_move_memory_the_right_way():
    cfg = ModelConfig(**GPT2)
    base = estimate_memory(cfg, Layout(2, 2, 2, mbs=2), 16)
    assert estimate_memory(cfg, Layout(2, 2, 2, mbs=2, sp=True), 16).activations < base.activations
    sel = estimate_memory(cfg, Layout(2, 2, 2, mbs=2, recompute="selective"), 16)
    full = estimate_memory(cfg, Layout(2, 2, 2, mbs=2, recompute="full"), 16)
    assert full.activations < sel.activations < base.activations
    zero = estimate_memory(cfg, Layout(2, 2, 2, mbs=2, dist_opt=True), 16)
    assert zero.optimizer == pytest.approx(base.optimizer / 2) and zero.weights == base.weights
    # 1F1B: rank 0 holds pp micro-batches, the last rank one (plus the loss's fp32 softmax)
    acts = activation_bytes_per_rank(ModelConfig(**LLAMA), Layout(1, 4, 1, mbs=1), 16)
    assert acts[0] > acts[1] > acts[2]


def test_long_schedules_are_simulated_short_but_exactly():
    for name, pp, vp, m in (("1f1b", 4, 1, 200), ("interleaved_1f1b", 4, 2, 160)):
        full = simulate_schedule(name, pp, vp, m, f_cost=1.0, b_cost=2.5)
        makespan, bubble = _simulate(name, pp, vp, m, 0.5)
        assert makespan == pytest.approx(full.makespan) and bubble == pytest.approx(max(full.bubble_fraction))
        peaks = [max(sum(h) for h in _in_flight_pattern(name, pp, vp, m, r)) for r in range(pp)]
        assert peaks == full.peak_in_flight


@pytest.mark.slow
def test_plan_fits_is_sorted_and_its_flags_parse():
    cfg = ModelConfig(
        num_layers=24,
        hidden_size=2048,
        num_attention_heads=16,
        seq_length=2048,
        vocab_size=50257,
        params_dtype="bfloat16",
    )
    plans = plan(cfg, num_gpus=16, gpu_memory_gib=40, global_batch_size=64, headroom=0.1)
    assert plans and all(p.memory.total <= 36 * GiB for p in plans)
    assert plans[0].step_s <= 1.02 * min(p.step_s for p in plans)
    layouts = {p.layout for p in plans}
    assert any(x.pp > 1 for x in layouts) and any(x.dist_opt for x in layouts) and any(x.tp > 1 for x in layouts)
    for p in plans[:5]:
        argv = [
            "--mock-data",
            "--vocab-size",
            "50257",
            "--num-layers",
            "24",
            "--hidden-size",
            "2048",
            "--num-attention-heads",
            "16",
            "--seq-length",
            "2048",
            "--max-position-embeddings",
            "2048",
            "--global-batch-size",
            "64",
            "--bf16",
        ] + p.layout.flags(24)
        got = parse_args(argv, world_size=16)
        assert (got.parallel.tp, got.parallel.pp, got.parallel.vp) == (p.layout.tp, p.layout.pp, p.layout.vp)
        assert got.optim.use_distributed_optimizer == p.layout.dist_opt


@pytest.mark.slow
def test_plan_cli_prints_flags_that_pretrain_gpt_accepts(capsys):
    from tools.plan import main

    assert (
        main(
            [
                "--num-gpus",
                "16",
                "--gpu-memory",
                "80",
                "--model-size",
                "llama2-7b",
                "--global-batch-size",
                "64",
                "--seq-length",
                "4096",
                "--top",
                "3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    command = out.strip().splitlines()[-1]
    assert command.startswith("torchrun --nnodes 2")
    argv = shlex.split(command.split("pretrain_gpt.py", 1)[1])
    cfg = parse_args(argv + ["--mock-data", "--vocab-size", "32000"], world_size=16)
    assert cfg.model.swiglu and cfg.model.num_layers == 32 and cfg.model.params_dtype == "bfloat16"
    assert main(["--num-gpus", "8", "--gpu-memory", "80", "--global-batch-size", "8", "--seq-length", "128"]) == 2
    assert "--model-size or --num-layers" in capsys.readouterr().err
    assert (
        main(
            [
                "--num-gpus",
                "1",
                "--gpu-memory",
                "1",
                "--model-size",
                "gpt3-13b",
                "--global-batch-size",
                "8",
                "--seq-length",
                "2048",
            ]
        )
        == 1
    )
    assert "no layout fits" in capsys.readouterr().err


_PLAN = "--num-gpus 8 --gpu-memory 80 --num-layers 4 --hidden-size 512 --num-attention-heads 8 --global-batch-size 64"
# (extra flags, the one line after "tools/plan.py: error: "): every number is finite and in its range
_BAD_PLANS = [
    ("--efficiency 0", "argument --efficiency: must be > 0 and <= 1, got 0 (a fraction of the peak: 0.5 for 50%)"),
    ("--efficiency nan", "argument --efficiency: must be a finite number, got nan"),
    ("--peak-tflops nan", "argument --peak-tflops: must be a finite number, got nan"),
    ("--intra-node-gbps 0", "argument --intra-node-gbps: must be > 0, got 0"),
    ("--inter-node-gbps=-5", "argument --inter-node-gbps: must be > 0, got -5"),
    ("--gpu-memory inf", "argument --gpu-memory: must be a finite number, got inf"),
    ("--gpus-per-node 0", "argument --gpus-per-node: must be >= 1, got 0"),
    ("--top 0", "argument --top: must be >= 1, got 0"),
    ("--vocab-size 0", "argument --vocab-size: must be >= 1, got 0"),
    ("--headroom 15", "argument --headroom: must be >= 0 and < 1, got 15 (a fraction of --gpu-memory: 0.15 keeps"),
    ("--context-parallel-sizes 3", "--context-parallel-sizes 3 does not divide --num-gpus 8"),
    ("--context-parallel-sizes 8 --seq-length 1000", "--context-parallel-sizes 8: --seq-length 1000 is not divisible"),
    ("--hidden-size 500", "--hidden-size 500 is not divisible by --num-attention-heads 8"),
    ("--num-query-groups 3", "--num-attention-heads 8 is not divisible by --num-query-groups 3"),
    ("--num-layers 0", "--num-layers must be > 0, got 0"),
    ("--position-embedding-type rope --hidden-size 520", "rope needs an even head dim, got 65"),
]


@pytest.mark.parametrize("extra, expected", _BAD_PLANS, ids=[e for e, _ in _BAD_PLANS])
def test_plan_refuses_bad_numbers_and_models_in_one_line(extra, expected, capsys):
    """Once: a traceback on a zero/nan rate, the batch blamed (with an empty list) for a CP size that does
    not divide the GPUs, the wrong flag named for a percent headroom, a launch command for a model
    pretrain_gpt.py refuses."""
    from tools.plan import main

    argv = (_PLAN + " --seq-length 1024 " + extra).split()  # a flag given twice: argparse keeps the last
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's one line
        code = e.code
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"tools/plan.py: error: {expected}"), err
    assert "torchrun" not in captured.out


def test_plan_refuses_a_model_with_pretrain_gpts_own_words():
    """The same rules (config.validate.check_model), so the same line as pretrain_gpt.py's."""
    import subprocess
    import sys

    from tests.helpers import REPO

    model = ["--num-layers", "4", "--hidden-size", "500", "--num-attention-heads", "8"]
    with pytest.raises(ValueError) as run:
        parse_args(model + ["--mock-data", "--seq-length", "1024"], world_size=1)
    out = subprocess.run(
        [sys.executable, "tools/plan.py", "--num-gpus", "8", "--gpu-memory", "80", "--global-batch-size", "64"]
        + ["--seq-length", "1024"]
        + model,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.splitlines() == [f"tools/plan.py: error: {run.value}"]


@pytest.mark.parametrize(
    "seq, cp_sizes, expected",
    [
        (1024, (3,), "context-parallel size 3 does not divide 8 GPUs: no layout exists"),
        (1022, (2, 4), "--seq-length 1022 does not split into 2 x 2 chunks for context-parallel size 2: no layout"),
    ],
)
def test_why_no_plan_names_the_context_parallel_size_when_no_split_exists(seq, cp_sizes, expected):
    # called from Python (tools/plan.py checks its flags first): the batch was blamed with an empty list of sizes
    from megalite.analysis.search import why_no_plan

    cfg = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=seq, vocab_size=1000)
    assert plan(cfg, 8, 80, 32, cp_sizes=cp_sizes) == []
    why, bad_input = why_no_plan(cfg, 8, 80, 32, cp_sizes=cp_sizes)
    assert why.startswith(expected) and bad_input, why
    assert "[]" not in why and "batch" not in why and "sizes this model allows on 8 GPUs are" not in why
