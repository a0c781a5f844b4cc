"""What config, validation and conversion know of the run's checkpoint formats: plain data, no file I/O.

``FormatInfo``: a format's name, its words in ``--ckpt-format``'s help, whether it loads into any
layout, whether it writes one file set per TP rank. The config package reads these (it is imported
before the checkpointing room is), the run formats in run_formats.py carry them, and the
FormatRegistry (formats.py) is keyed on their names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

from megalite.checkpointing.safe_load import CheckpointError

__all__ = [
    "FormatInfo",
    "SHARDED_INFO",
    "TORCH_INFO",
    "RUN_FORMAT_INFOS",
    "format_info",
    "format_names",
    "ckpt_format_help",
    "layout_free_format",
]


@dataclass(frozen=True)
class FormatInfo:
    """A run format as config, validation and conversion see it (no code that reads or writes files)."""

    name: str
    summary: str  # its words in --ckpt-format's help
    layout_free: bool  # loads into any tp/pp/vp/dp/ep layout (else: the saved layout only)
    files_per_tp_rank: bool  # one file set per tensor-parallel rank (cannot hold experts split finer than TP)


SHARDED_INFO = FormatInfo(
    "sharded", "layout-free, loads into any tp/pp/vp/dp", layout_free=True, files_per_tp_rank=False
)
TORCH_INFO = FormatInfo(
    "torch",
    "Megatron-LM's legacy mp_rank_XX/model_optim_rng.pt files (same tp/pp/vp to load)",
    layout_free=False,
    files_per_tp_rank=True,
)
RUN_FORMAT_INFOS: Tuple[FormatInfo, ...] = (SHARDED_INFO, TORCH_INFO)  # the first is the default


def format_names(infos: Sequence[FormatInfo] = RUN_FORMAT_INFOS) -> Tuple[str, ...]:
    """The formats' names, in declaration order (``--ckpt-format``'s choices)."""
    return tuple(i.name for i in infos)


def ckpt_format_help(infos: Sequence[FormatInfo] = RUN_FORMAT_INFOS) -> str:
    """``--ckpt-format``'s help sentence: each format's name and summary."""
    return "; ".join(f"{i.name}: {i.summary}" for i in infos)


def format_info(name: str, infos: Sequence[FormatInfo] = RUN_FORMAT_INFOS) -> FormatInfo:
    """The run format called ``name``; an unknown one is one CheckpointError line naming the known ones."""
    for i in infos:
        if i.name == name:
            return i
    raise CheckpointError(f"unknown --ckpt-format {name!r}; use {' or '.join(format_names(infos))}")


def layout_free_format(infos: Sequence[FormatInfo] = RUN_FORMAT_INFOS) -> str:
    """The first run format that loads into any layout: what to suggest when a layout-bound one cannot do."""
    return next(i.name for i in infos if i.layout_free)
