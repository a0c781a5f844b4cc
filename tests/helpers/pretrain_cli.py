"""The pretrain_gpt.py CLI tests' tiny run (no dropout, a log line per iteration) and the losses its log
lines report."""

import re

from tests.helpers import TINY_RUN

TINY = TINY_RUN + ["--hidden-dropout", "0", "--attention-dropout", "0", "--lr-warmup-iters", "1", "--log-interval", "1"]


def _losses(text):
    return [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", text)]
