"""Command-line pieces shared by the tools that load a checkpoint (tools/generate.py, tools/evaluate.py).

Their contract: bad input is one ``prog: error: ...`` line and exit code 2, never a usage block
or a traceback.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, Optional

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
    g.add_argument(
        "--device",
        type=check_device,
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu, cuda or cuda:N (default: cuda where available)",
    )
    g.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="weights and activations (default: the run's, from --bf16/--fp16)",
    )


def check_device(name: str) -> str:
    """``--device``'s type: a device torch knows and this machine has, else one argparse error line."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown device {name!r}; give cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():  # torch's own check is an AssertionError with a traceback
            raise argparse.ArgumentTypeError(
                f"{name!r} needs CUDA, which this machine lacks (no GPU visible, or torch built without "
                "CUDA); use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{name!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                f"cuda:0 to cuda:{torch.cuda.device_count() - 1}"
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError("'mps' is not available on this machine; use --device cpu")
    elif device.type not in ("cpu", "mps"):
        raise argparse.ArgumentTypeError(f"{name!r}: not a device to run a model on; give cpu, cuda or cuda:N")
    return name


def one_line(e: BaseException) -> str:
    """An exception's message on one line (the CLIs' error contract)."""
    return " ".join(str(e).split()) or type(e).__name__


def number(
    kind: type = float,
    gt: Optional[float] = None,
    ge: Optional[float] = None,
    lt: Optional[float] = None,
    le: Optional[float] = None,
    hint: str = "",
) -> Callable[[str], float]:
    """An argparse ``type`` for a finite number of ``kind`` (int or float) above ``gt`` / at least ``ge`` and
    below ``lt`` / at most ``le``: anything else (nan, inf, out of range, not a number) is one argparse error line, which
    argparse prefixes with the flag's name; ``hint`` is added to a range error (e.g. what unit is meant)."""
    what = "an integer" if kind is int else "a number"
    hint = f" ({hint})" if hint else ""

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(v):  # nan passes every comparison below as False: refuse it by name
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}{hint}")
        low = f"> {gt:g}" if gt is not None else f">= {ge:g}" if ge is not None else None
        high = f"< {lt:g}" if lt is not None else f"<= {le:g}" if le is not None else None
        outside = (gt is not None and not v > gt) or (ge is not None and not v >= ge)
        if outside or (lt is not None and not v < lt) or (le is not None and not v <= le):
            bounds = " and ".join(b for b in (low, high) if b)
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}{hint}")
        return v

    return parse
