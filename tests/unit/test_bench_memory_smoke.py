"""benchmarks/bench_memory.py's sharding table runs end to end at the smallest sizes: every strategy's
measured per-rank state agrees with the planner within 5% (its step-time table is left to the benchmark)."""

import pytest

from benchmarks.bench_memory import main
from megalite.config.sections import SHARDING_STRATEGIES


def _rows(out: str, header: str):
    table = out.split(header, 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[3:] if line.startswith("|")]


@pytest.mark.usefixtures("run_distributed")  # the benchmark forks gloo workers: 2 and 4 ranks
@pytest.mark.slow  # ~15 s on 2 idle cores
def test_bench_memory_sharding_tables_agree_with_the_planner(capsys):
    assert main(["--quick", "--tables", "sharding"]) == 0
    out = capsys.readouterr().out
    memory = _rows(out, "## Data-parallel sharding")
    assert {(int(r[0]), r[1]) for r in memory} == {(dp, s) for dp in (1, 2, 4) for s in SHARDING_STRATEGIES}
    for dp, strategy, *_, ratio, vs_plain, _gathered in memory:
        assert 0.95 <= float(ratio) <= 1.05, (dp, strategy, ratio)
        if dp == "4" and strategy.startswith("optim_grads"):
            assert float(vs_plain) < 0.3  # 16 bytes / 4 against 18: weights, gradients and state sharded
