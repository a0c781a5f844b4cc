"""benchmarks/bench_moe.py runs end to end at the smallest sizes and prints its four tables
(structure only: no timing is asserted)."""

import os
import subprocess
import sys

import pytest

from benchmarks.bench_moe import main
from tests.helpers import REPO

TINY = [
    "--quick",
    "--hidden-size",
    "32",
    "--heads",
    "2",
    "--seq-length",
    "16",
    "--vocab-size",
    "64",
    "--ffn-hidden-size",
    "64",
    "--warmup",
    "1",
    "--steps",
    "1",
    "--eps",
    "2",
    "--memory-eps",
    "2",
]


@pytest.mark.usefixtures("run_distributed")  # the benchmark forks gloo workers: 1, 2, 4 and 2 ranks
@pytest.mark.slow  # ~15 s on 2 cores
def test_bench_moe_prints_every_table(capsys):
    assert main(TINY) == 0
    out = capsys.readouterr().out
    assert out.startswith("$ python benchmarks/bench_moe.py --quick")
    for header in ("[1] dense vs MoE", "[2] token dispatchers", "[3] dispatch overlap", "[4] memory per rank"):
        assert header in out, header
    rows = out.splitlines()
    assert any(r.split()[:2] == ["2", "allgather"] for r in rows) and any(
        r.split()[:2] == ["2", "alltoall"] for r in rows
    )
    assert any(r.split()[:1] == ["on"] for r in rows) and any(r.split()[:1] == ["off"] for r in rows)
    assert sum(r.split()[:2] in (["2", "adam"], ["2", "zero1"]) for r in rows) == 2


@pytest.mark.slow  # a subprocess that imports torch: ~8-20 s on 2 cores
def test_bench_moe_gpu_runs_on_cpu_smoke():
    """``bench_moe.py --gpu``'s script at tiny shapes on CPU (no GPU here: the real run is not tested): both tables,
    three training rows with positive rates, and the grouped row reported as not run off a Hopper GPU."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29900 + os.getpid() % 90)}
    res = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_moe.py"), "--gpu", "--cpu-smoke", "--iters", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = res.stdout
    assert "[1] training steps" in out and "[2] one layer's experts" in out
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith(("dense,", "MoE "))]
    assert len(rows) == 3 and all(float(r[-5]) > 0 for r in rows), rows  # tokens/s
    assert "grouped GEMM  not run" in out
