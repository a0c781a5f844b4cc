"""Megatron-compatible command line -> typed ``Config`` sections, validated up front.

Flag names follow Megatron-LM so launch scripts port with few edits. The parser is built from
the flag declarations next to the config fields (config.py): one option per declared flag, in
Megatron's help groups, with the field's default. ``config_from_args`` reads the parsed values
back into the sections the same way, and validate.py checks them before any process group
exists, failing with one line (``ConfigError``) saying what is wrong and what to do. Flags that
belong to features not built yet are accepted by name only to say so, never ignored.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import textwrap
import typing
from dataclasses import Field, fields
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from megalite.config import HELP_GROUPS, Config, ConfigError
from megalite.config.flags import FieldFlags, Flag, flag_fields
from megalite.config.validate import validate
from megalite.pipeline.registry import SCHEDULES

__all__ = ["NOT_IMPLEMENTED", "build_parser", "config_from_args", "declared_fields", "parse_args", "validate"]

# Flags a later milestone implements: recognised so they fail loudly instead of being ignored.
NOT_IMPLEMENTED: Dict[str, str] = {}

# Choice sets a field names by key because config.py may not import the pipeline package.
_CHOICES: Dict[str, Tuple[str, ...]] = {"schedules": tuple(SCHEDULES)}


def declared_fields() -> Iterator[Tuple[type, Field, Any, FieldFlags]]:
    """(section class, field, resolved type, declaration) of every field with flags, in section order."""
    for section in fields(Config):
        cls = section.default_factory
        hints = typing.get_type_hints(cls)
        for f, cli in flag_fields(cls):
            yield cls, f, hints[f.name], cli


def _unwrap_optional(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp


def _is_list_flag(tp: Any) -> bool:
    """Tuple[str, ...] fields: a flag taking any number of values (parsed as a list, or None if absent)."""
    return typing.get_origin(tp) is tuple and typing.get_args(tp)[:1] == (str,)


def _own_options(f: Field, tp: Any, flag: Flag) -> Dict[str, Any]:
    """argparse keywords of a field's own flag: dest = the field, the rest inferred from its type and default."""
    options = dict(flag.options)
    base = _unwrap_optional(tp)
    options["default"] = options.pop("parser_default", None if _is_list_flag(base) else f.default)
    options["dest"] = f.name
    if base is bool:
        options.setdefault("action", "store_false" if f.default else "store_true")
        return options
    if _is_list_flag(base):
        options.setdefault("nargs", "*")
    elif base in (int, float):
        options.setdefault("type", base)
    if isinstance(options.get("choices"), str):
        options["choices"] = _CHOICES[options["choices"]]
    if "choices" not in options:  # the metavar argparse would derive from the flag name
        options.setdefault("metavar", flag.name.lstrip("-").replace("-", "_").upper())
    return options


def _ordered_flags() -> List[Tuple[Flag, Dict[str, Any]]]:
    """Every declared flag with its argparse keywords, in --help order within each group."""
    out: List[Tuple[Flag, Dict[str, Any]]] = []
    moves: List[Tuple[str, str]] = []
    for _cls, f, tp, cli in declared_fields():
        for flag in cli.flags:
            out.append((flag, _own_options(f, tp, flag) if flag is cli.own else dict(flag.options)))
        if cli.listed_after:
            moves.append((cli.own.name, cli.listed_after))
    for name, after in moves:  # fields of another section listed among a group's flags
        item = next(i for i in out if i[0].name == name)
        out.remove(item)
        out.insert(next(k for k, i in enumerate(out) if i[0].name == after) + 1, item)
    return out


class _HelpFormatter(argparse.HelpFormatter):
    """Every option that takes a value shows its default (the config dataclasses' value); lines
    never break inside a flag name (argparse would split --context-parallel-size at a hyphen)."""

    def _split_lines(self, text: str, width: int) -> List[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(
            " ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
        )

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            text
            and action.option_strings
            and action.nargs != 0
            and action.default is not argparse.SUPPRESS
            and "%(default)" not in text
        ):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    """The full CLI (Megatron flag names), built from the flag declarations of the config fields."""
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        allow_abbrev=False,
        exit_on_error=False,
        description="Pretrain a GPT with tensor, pipeline and data parallelism.",
        formatter_class=_HelpFormatter,
    )
    flags = _ordered_flags()
    for group in HELP_GROUPS:
        g = p.add_argument_group(group.title)
        for flag, options in flags:
            if flag.group == group.title:
                g.add_argument(flag.name, help=flag.help, **options)
    for flag in NOT_IMPLEMENTED:  # recognised to fail with a clear line; listed in the epilog, not as options
        p.add_argument(flag, nargs="?", const=True, default=None, help=argparse.SUPPRESS)
    if NOT_IMPLEMENTED:
        p.epilog = (
            "Recognised but not implemented yet (they stop with an error): "
            + ", ".join(f"{f} ({what})" for f, what in NOT_IMPLEMENTED.items())
            + "."
        )
    return p


def config_from_args(a: argparse.Namespace) -> Config:
    """The config sections of a parsed command line (each field from its flags; the rest default)."""
    values: Dict[type, Dict[str, Any]] = {}
    for cls, f, tp, cli in declared_fields():
        v = cli.value(a) if cli.value is not None else getattr(a, f.name)
        values.setdefault(cls, {})[f.name] = tuple(v or ()) if _is_list_flag(_unwrap_optional(tp)) else v
    return Config(**{s.name: s.default_factory(**values.get(s.default_factory, {})) for s in fields(Config)})


def _join_negative_values(argv: Sequence[str]) -> List[str]:
    """``--lr -1e-3`` -> ``--lr=-1e-3``: argparse would take a negative exponent literal for a flag."""
    out: List[str] = []
    for tok in argv:
        # argparse itself takes -1 and -0.5 as values (and a weighted --data-path needs them as
        # separate tokens); only forms it would read as flags, like -1e-3, are joined.
        if (
            out
            and out[-1].startswith("--")
            and "=" not in out[-1]
            and re.fullmatch(r"-(\d+\.?\d*|\.\d+)e[-+]?\d+|-inf|-nan", tok, re.IGNORECASE)
        ):
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


def _unknown_flag_error(parser: argparse.ArgumentParser, unknown: List[str]) -> ConfigError:
    flags = [u.split("=")[0] for u in unknown if u.startswith("-")]
    known = [o for a in parser._actions for o in a.option_strings]
    for flag in flags:
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        if close:
            return ConfigError(f"unrecognized argument {flag}; did you mean {close[0]}? (see --help)")
    return ConfigError(f"unrecognized arguments: {' '.join(unknown)} (see --help)")


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> Config:
    """Parse and validate a command line; ``world_size`` defaults to $WORLD_SIZE (or 1)."""
    parser = build_parser()
    argv = _join_negative_values(sys.argv[1:] if argv is None else list(argv))
    try:
        args, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ConfigError(str(e)) from None
    if unknown:
        raise _unknown_flag_error(parser, unknown)
    used: List[str] = [f for f in NOT_IMPLEMENTED if getattr(args, f[2:].replace("-", "_")) is not None]
    if used:
        flag = used[0]
        raise ConfigError(f"{flag} is not implemented yet ({NOT_IMPLEMENTED[flag]} is on the roadmap); remove the flag")
    cfg = config_from_args(args)
    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size)
    return cfg
