"""pretrain_gpt.py and the CPU example script as real torchrun jobs of several processes: TP x DP
losses equal the one-process run's, a bad flag or bad data is said once for the whole job,
--pipeline-balance measured picks and trains a split on two ranks, and examples/debug_3d_cpu.sh trains
on 8 ranks. The one-process halves of these checks stay in tests/unit (test_pretrain_cli.py,
test_bad_inputs.py, test_balance.py, test_examples.py); the flag lists and data both use are in
tests/helpers (bad_inputs.py, pretrain_cli.py).
"""

import os
import re
import subprocess
import sys

import pytest

from megalite.checkpointing.save_lock import release_save_locks
from tests.helpers import REPO
from tests.helpers.bad_inputs import DATA, MOCK, _argv, write_data_dir
from tests.helpers.pretrain_cli import TINY, _losses

SLOW_RANK0 = os.path.join("tests", "helpers", "slow_rank0.py")  # rank 0 starts 5 s late


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_data_dir(tmp_path_factory.mktemp("bad_inputs"))


@pytest.mark.slow
def test_torchrun_tp2_dp2_matches_single_process(launch):
    args = TINY + ["--train-iters", "3", "--eval-iters", "0"]
    single = subprocess.run(
        [sys.executable, "pretrain_gpt.py"] + args, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert single.returncode == 0, single.stderr
    multi = launch(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            "pretrain_gpt.py",
            "--tensor-model-parallel-size",
            "2",
            "--num-threads",
            "1",
        ]
        + args,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert multi.returncode == 0, multi.stderr[-3000:]
    assert "world 4 = tp 2 x dp 2 x pp 1" in multi.stdout
    a, b = _losses(single.stdout), _losses(multi.stdout)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-5 * abs(x), (a, b)


def _torchrun(launch, nproc, argv, wrapper=()):
    return launch(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            *wrapper,
            "pretrain_gpt.py",
            "--num-threads",
            "1",
        ]
        + argv,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_bad_flag_under_torchrun_is_said_once_when_rank_0_is_slow(launch):
    """Rank 0 starts 5 s late: the other ranks exit on the flag first and torchrun stops rank 0 (which
    was the only rank to say it: the job ended with exit codes only); now the first rank says it."""
    proc = _torchrun(launch, 3, MOCK + ["--hidden-dropout", "1.5"], wrapper=[SLOW_RANK0])
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if "pretrain_gpt.py:" in line]
    assert ours == ["pretrain_gpt.py: error: --hidden-dropout must be in [0, 1), got 1.5"], proc.stderr[-3000:]
    assert "[rank" not in proc.stderr  # no per-rank traceback


@pytest.mark.slow
def test_a_damaged_shard_read_by_two_replicas_is_said_once(tmp_path, launch):
    """At dp2 both replicas read the same damaged shard: it was said by each (two copies, at times glued
    on one line); now once, on its own line."""
    import pretrain_gpt

    ck = tmp_path / "ck"
    run = MOCK + ["--eval-iters", "0", "--num-threads", "1", "--lr-warmup-iters", "1", "--train-iters", "2"]
    assert pretrain_gpt.main(run + ["--save", str(ck)]) == 0
    release_save_locks()
    shard = ck / "iter_0000002" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[1000:200000:7] = bytes(b ^ 0xFF for b in data[1000:200000:7])
    shard.write_bytes(data)
    proc = _torchrun(launch, 2, run + ["--load", str(ck)])
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if "pretrain_gpt.py:" in line]
    assert len(ours) == 1 and ours[0].count("pretrain_gpt.py:") == 1, proc.stderr[-3000:]
    assert ours[0].startswith(f"pretrain_gpt.py: error: {shard}: ") and "the checkpoint is damaged" in ours[0]


def test_out_of_vocabulary_ids_stop_every_rank_the_same_way_at_tp2(data_dir, launch):
    """tp=2 pads the vocabulary to 256, so id 150 has a row; unchecked it trained on an infinite loss."""
    proc = _torchrun(launch, 2, _argv(DATA, "--data-path $T/oov --tensor-model-parallel-size 2", data_dir))
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("pretrain_gpt.py:")]
    assert len(ours) == 1 and "holds token id 150, outside the model's vocabulary [0, 101)" in ours[0], proc.stderr
    assert "[rank" not in proc.stderr and " iteration        3/" not in proc.stdout


def test_pretrain_gpt_measured_balance_on_two_pipeline_ranks_prints_the_split_and_trains(launch):
    # vocabulary 8000 at hidden 32: the output layer + loss cost well over a layer
    args = [
        "--mock-data",
        "--vocab-size",
        "8000",
        "--num-layers",
        "4",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--lr-warmup-iters",
        "1",
        "--log-interval",
        "1",
        "--train-iters",
        "3",
        "--eval-iters",
        "0",
        "--num-threads",
        "1",
        "--pipeline-model-parallel-size",
        "2",
        "--pipeline-balance",
        "measured",
    ]
    proc = launch(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "pretrain_gpt.py"]
        + args,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "pipeline balance: 1f1b, pp 2 x vp 1, 4 micro-batches" in out
    even = re.search(r"even +2,2 layers per stage: predicted step ([0-9.e+]+) ms, bubble ([0-9.]+)%", out)
    chosen = re.search(r"balanced +(\d+),(\d+) layers per stage: predicted step ([0-9.e+]+) ms, bubble", out)
    assert even and chosen, out
    assert int(chosen[1]) + int(chosen[2]) == 4 and float(chosen[3]) <= float(even[1])
    assert f"training with --pipeline-stage-layers {chosen[1]},{chosen[2]}" in out
    assert len(re.findall(r"\| lm loss: [0-9.E+-]+ \|", out)) == 3


@pytest.mark.slow
def test_cpu_3d_script_trains(tmp_path, launch):
    env = {**os.environ, "TRAIN_ITERS": "2"}
    res = launch(
        ["bash", str(REPO / "examples" / "debug_3d_cpu.sh"), "--eval-iters", "1", "--log-interval", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "world 8 = tp 2 x dp 2 x pp 2 (vp 2)" in res.stdout
    assert " iteration        2/       2 |" in res.stdout and "training done: 2 iterations" in res.stdout
