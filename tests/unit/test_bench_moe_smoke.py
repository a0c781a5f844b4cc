"""benchmarks/bench_moe.py runs end to end at the smallest sizes and prints its four tables
(structure only: no timing is asserted)."""

import pytest

from benchmarks.bench_moe import main

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
