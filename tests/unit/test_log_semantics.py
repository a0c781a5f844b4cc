"""What the log line's counters mean and what a finished run leaves behind (issue 33, "log semantics").

``number of skipped iterations`` (and ``number of nan iterations``) count the log interval, reset at
each log line as Megatron-LM's training_log does, so tools reading Megatron logs read megalite's alike.
"""

import re

import pretrain_gpt
from tests.helpers import TINY_RUN

RUN = TINY_RUN + ["--eval-iters", "0", "--num-threads", "1"]


def test_skipped_iterations_count_the_log_interval(capsys):
    # fp16 with a loss scale of 2^20 overflows this tiny model's gradients twice (2^20, then 2^19 with
    # --hysteresis 1), then trains: iterations 1 and 2 are skipped, 3 and 4 are not.
    flags = ["--fp16", "--initial-loss-scale", "1048576", "--hysteresis", "1", "--train-iters", "4"]
    assert pretrain_gpt.main(RUN + flags + ["--log-interval", "2"]) == 0
    out = capsys.readouterr().out
    skipped = [int(x) for x in re.findall(r"number of skipped iterations: +(\d+)", out)]
    nans = [int(x) for x in re.findall(r"number of nan iterations: +(\d+)", out)]
    assert skipped == [2, 0] and nans == [0, 0], out
