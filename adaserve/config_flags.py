"""Flags generated from the config dataclasses: every field is `--field-name` (or a positional,
flag_table.POSITIONALS), its type from the annotation, its default from config.py, its help,
group and choices from flag_table.py. The parsed namespace holds each field under its own name,
so `Config(**{f.name: getattr(a, f.name)})` builds a config from it.

Types: int, float, str; bool -> `--x/--no-x`; `X | None` (the text `none` gives None);
`tuple[X, ...]` -> a comma-separated list (tuples of str: repeatable, the first use replaces
the default). A field of another type needs a parser in FIELD_PARSERS.
"""

from __future__ import annotations

import argparse
import json
import typing
from collections.abc import Callable, Iterable
from dataclasses import MISSING, Field, fields
from typing import Any

from adaserve import flag_table
from adaserve.config import parse_slo_classes

Parse = Callable[[str], Any]


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _scalar(tp: type) -> Parse:
    def parse(text: str) -> Any:
        try:
            return tp(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {tp.__name__}, got {text!r}") from None

    return parse


def _optional(parse: Parse) -> Parse:
    def parse_optional(text: str) -> Any:
        return None if text.strip().lower() in ("none", "null") else parse(text)

    return parse_optional


def split_list(text: str) -> list[str]:
    """'a,b' or a JSON list '["a", "b"]' (as vLLM writes --allowed-origins) -> ['a', 'b']."""
    if text.strip().startswith("["):
        return [str(item) for item in json.loads(text)]
    return [part.strip() for part in text.split(",") if part.strip()]


def _list_of(parse: Parse) -> Parse:
    def parse_list(text: str) -> tuple[Any, ...]:
        return tuple(parse(part) for part in split_list(text))

    return parse_list


def slo_classes_arg(text: str) -> tuple[tuple[str, float], ...]:
    """--slo-classes 'urgent=50,relaxed=inf' (or a JSON object {"urgent": 50, ...})."""
    if text.strip().startswith("{"):
        text = ",".join(f"{name}={bound}" for name, bound in json.loads(text).items())
    try:
        return parse_slo_classes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


FIELD_PARSERS: dict[str, Parse] = {
    "slo_classes": slo_classes_arg,
    "default_slo_tpot_ms": _optional(positive_float),
    "api_keys": lambda text: (text.strip(),),  # one key per use: a key is never split
}


def value_parser(tp: Any) -> Parse:
    """How a flag's text becomes a value of the annotated type `tp`."""
    args = typing.get_args(tp)
    if type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return _optional(value_parser(inner))
    if tp is bool:
        return parse_bool
    if tp in (int, float, str):
        return _scalar(tp)
    if typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _list_of(value_parser(args[0]))
    raise TypeError(f"no flag type for {tp!r}: give the field a parser in FIELD_PARSERS")


class ExtendList(argparse.Action):
    """A repeatable list flag: the first use replaces the default, later uses add to it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        kept = () if current is self.default or current is None else tuple(current)
        setattr(namespace, self.dest, kept + tuple(values))


def config_fields(classes: Iterable[type]) -> dict[str, tuple[type, Field[Any]]]:
    """Field name -> (its dataclass, the field); the first class wins a name two share."""
    out: dict[str, tuple[type, Field[Any]]] = {}
    for cls in classes:
        for f in fields(cls):
            out.setdefault(f.name, (cls, f))
    return out


def field_default(f: Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    assert f.default_factory is not MISSING, f"config field {f.name} has no default"
    return f.default_factory()


def argument_group(p: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """The `--help` group `title` of `p`, made on first use."""
    for group in p._action_groups:
        if group.title == title:
            return group
    return p.add_argument_group(title, flag_table.GROUPS.get(title))


def add_field_argument(
    p: argparse.ArgumentParser, cls: type, f: Field[Any], default: Any, extra: tuple[str, ...]
) -> None:
    """One config field as a flag (or positional) of `p`, in its `--help` group."""
    name = f.name
    group = argument_group(p, flag_table.group_of(cls, name))
    text = flag_table.field_help(cls, name)
    tp = typing.get_type_hints(cls)[name]
    if name in flag_table.POSITIONALS:
        group.add_argument(name, nargs="?", default=default, metavar=name.upper(), help=text)
        return
    flags = (flag_name(name), *flag_table.EXTRA_FLAGS.get(name, ()), *extra)
    kw: dict[str, Any] = dict(dest=name, default=default, help=text)
    if tp is bool:
        group.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
        return
    kw["type"] = FIELD_PARSERS.get(name) or value_parser(tp)
    if name in flag_table.VALUE_ALIASES:
        kw["type"] = _aliased(kw["type"], flag_table.VALUE_ALIASES[name])
    kw["metavar"] = flag_table.METAVARS.get(name) or _metavar(tp)
    if name in flag_table.CHOICES:
        kw.update(choices=flag_table.CHOICES[name], metavar=None)
    if typing.get_origin(tp) is tuple and typing.get_args(tp)[0] is str:
        kw["action"] = ExtendList
    group.add_argument(*flags, **kw)


def _aliased(parse: Parse, aliases: dict[str, str]) -> Parse:
    def parse_aliased(text: str) -> Any:
        return parse(aliases.get(text.strip(), text))

    return parse_aliased


def _metavar(tp: Any) -> str:
    inner = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    if typing.get_origin(tp) is tuple:
        return "LIST"
    return {int: "N", float: "X"}.get(inner[0], "TEXT")


def add_config_arguments(
    p: argparse.ArgumentParser,
    classes: Iterable[type],
    defaults: dict[str, Any] | None = None,
    spellings: dict[str, tuple[str, ...]] | None = None,
) -> None:
    """A flag for every field of `classes` that `p` has no flag for yet.

    defaults: field name -> the flag's default where it is not config.py's.
    spellings: field name -> further option strings (e.g. vLLM's).
    """
    taken = {action.dest for action in p._actions}
    for name, (cls, f) in config_fields(classes).items():
        if name in taken:
            continue
        default = (defaults or {}).get(name, field_default(f))
        add_field_argument(p, cls, f, default, (spellings or {}).get(name, ()))


def show_default(value: Any) -> str:
    """A default as the flag's text would give it: lists comma-separated, SLO classes as
    name=ms."""
    if isinstance(value, tuple):
        return ",".join(
            f"{v[0]}={v[1]:g}" if isinstance(v, tuple) else show_default(v) for v in value
        )
    return str(value)
