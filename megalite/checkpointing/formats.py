"""Checkpoint formats as one small protocol and a registry, instead of format names branched on as strings.

::

    FormatInfo       what config, validation and conversion need to know of a format (format_info.py:
                     name, --help words, whether it loads into any layout, whether it writes one file
                     set per TP rank; plain data the config package reads)
    Format           a run format: FormatInfo + how a save snapshots the run and writes it, and how a
                     load reads it back (implemented in run_formats.py: ShardedFormat, TorchFormat)
    LoadSource       another project's directory a run may --load in place (Megatron-Core's torch_dist,
                     implemented in interop/ and handed in by the composition root)
    FormatRegistry   the run formats by name plus the load sources; immutable (``with_sources`` returns
                     a new registry), so no process-wide state changes when interop is added

The run's own load path asks the registry; it never imports interop.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Protocol, Sequence, Tuple

from megalite.checkpointing.format_info import FormatInfo
from megalite.checkpointing.run import RunParts
from megalite.checkpointing.safe_load import CheckpointError

__all__ = ["Format", "LoadSource", "FormatRegistry"]


class Format(Protocol):
    """A run format: how a save writes it and how a load reads it back."""

    info: FormatInfo

    def background_group(self, run: RunParts):
        """The process group an --async-save write uses for its collectives (None: it needs none)."""

    def snapshot(
        self, run: RunParts, tmp: str, meta: dict, rng: dict, keep: Callable, background: bool
    ) -> Callable[[], None]:
        """Take this rank's state (``keep(tensor_tree, name)``: a view, or a host copy with --async-save)
        and return the function that writes it into ``tmp`` (may run in a background thread)."""

    def read(self, run: RunParts, d: str, meta: dict, load_optim: bool) -> Optional[dict]:
        """Load ``d`` into the run's model (and optimizer with ``load_optim``); this rank's saved random
        states when the layout allows restoring them, else None (collective)."""


class LoadSource(Protocol):
    """Another project's checkpoint directory that a run can --load in place."""

    name: str

    def find(self, root: str, step: Optional[int]) -> Optional[str]:
        """The directory under ``root`` (latest, or iteration ``step``) when it is in this format, else None."""

    def load(self, run: RunParts, d: str, finetune: bool, load_optim: bool) -> int:
        """Load ``d`` into the run (collective); returns the iteration loaded."""


class FormatRegistry:
    """The run formats by name and the load sources, looked up instead of branching on names."""

    def __init__(self, formats: Sequence[Format], sources: Sequence[LoadSource] = ()):
        self._formats: Dict[str, Format] = {f.info.name: f for f in formats}
        self.sources: Tuple[LoadSource, ...] = tuple(sources)

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(self._formats)

    def get(self, name: str) -> Format:
        """The run format called ``name`` (meta.json's ``format``, ``--ckpt-format``); one line if unknown."""
        if name not in self._formats:
            raise CheckpointError(f"unknown --ckpt-format {name!r}; use {' or '.join(self.names)}")
        return self._formats[name]

    def with_sources(self, *sources: LoadSource) -> "FormatRegistry":
        """A registry with the same run formats and ``sources`` added (this one unchanged)."""
        return FormatRegistry(list(self._formats.values()), self.sources + tuple(sources))

    def find_source(self, root: str, step: Optional[int]) -> Optional[Tuple[LoadSource, str]]:
        """The first load source that recognises ``root`` (latest, or ``step``), with its directory."""
        for source in self.sources:
            d = source.find(root, step)
            if d is not None:
                return source, d
        return None
