"""Command-line pieces shared by the tools that load a checkpoint (tools/generate.py, tools/evaluate.py).

Their contract: bad input is one ``prog: error: ...`` line and exit code 2, never a usage block
or a traceback.
"""
from __future__ import annotations

import argparse

import torch


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (``prog: error: ...``, exit code 2), without the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_load_args(p: argparse.ArgumentParser) -> None:
    """--load, --ckpt-step, --device, --dtype: which checkpoint, and where and how to run it."""
    g = p.add_argument_group("checkpoint")
    g.add_argument("--load", required=True, help="checkpoint directory (pretrain_gpt.py --save), any format and layout")
    g.add_argument("--ckpt-step", type=int, help="load this iteration, not the latest")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="weights and activations (default: the run's, from --bf16/--fp16)")


def one_line(e: BaseException) -> str:
    """An exception's message on one line (the CLIs' error contract)."""
    return " ".join(str(e).split()) or type(e).__name__
