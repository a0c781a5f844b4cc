"""How a config field declares its command-line flag(s): the vocabulary config.py is written in.

A field the CLI sets carries a ``FieldFlags`` in its dataclass metadata: its own flag (name,
help group, help sentence, argparse options), companion flags for options that do not map
one-to-one onto a field, the function that works the field out of them, and the range its
value must lie in. arguments.py builds the parser from these declarations and validate.py
checks the ranges (README, Architecture: a flag is declared once, next to its field).
"""

from __future__ import annotations

import argparse
from dataclasses import Field, dataclass, field, fields
from typing import Any, Callable, Iterator, Mapping, Optional, Tuple, Union


@dataclass(frozen=True)
class Flag:
    """One command-line option: its name, help group, help sentence and further argparse keywords."""

    name: str
    group: str
    help: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FieldFlags:
    """What the CLI knows of one field (``field.metadata["cli"]``).

    ``own`` is the flag whose parsed value is the field's (argparse dest = the field name; type,
    action and nargs follow the field's type unless given; ``parser_default`` in its options when
    the parser's default differs from the field's); ``flags`` lists it with its companions in
    --help order. ``value`` works the field out of the parsed namespace when the flags do not map
    one-to-one. ``gt``/``ge``/``lt`` bound the value. ``listed_after`` places the flag after
    another flag of its help group (for groups that mix config sections).
    """

    flags: Tuple[Flag, ...]
    own: Optional[Flag] = None
    value: Optional[Callable[[argparse.Namespace], Any]] = None
    gt: Optional[float] = None
    ge: Optional[float] = None
    lt: Optional[float] = None
    listed_after: Optional[str] = None


def _as_tuple(flags: Union[Flag, Tuple[Flag, ...]]) -> Tuple[Flag, ...]:
    return flags if isinstance(flags, tuple) else (flags,)


class HelpGroup:
    """One argparse group of --help; calling it declares a field whose own flag is in the group."""

    def __init__(self, title: str):
        self.title = title

    def flag(self, name: str, help: str, **options: Any) -> Flag:
        """A companion flag in this group (it sets no field by itself)."""
        return Flag(name, self.title, help, options)

    def __call__(
        self,
        name: str,
        default: Any,
        help: str,
        *,
        before: Union[Flag, Tuple[Flag, ...]] = (),
        then: Union[Flag, Tuple[Flag, ...]] = (),
        value: Optional[Callable] = None,
        gt: Optional[float] = None,
        ge: Optional[float] = None,
        lt: Optional[float] = None,
        listed_after: Optional[str] = None,
        **options: Any,
    ) -> Any:
        """A dataclass field defaulting to ``default`` whose flag ``name`` has ``help`` (see FieldFlags)."""
        own = Flag(name, self.title, help, options)
        cli = FieldFlags((*_as_tuple(before), own, *_as_tuple(then)), own, value, gt, ge, lt, listed_after)
        return field(default=default, metadata={"cli": cli})


def derived(default: Any, *flags: Flag, value: Callable[[argparse.Namespace], Any]) -> Any:
    """A field with no flag of its own: ``value`` works it out of its companion ``flags``."""
    return field(default=default, metadata={"cli": FieldFlags(flags, None, value)})


def flag_fields(section: Any) -> Iterator[Tuple[Field, FieldFlags]]:
    """(field, declaration) of every field of a config section (class or instance) that has flags."""
    for f in fields(section):
        if "cli" in f.metadata:
            yield f, f.metadata["cli"]
