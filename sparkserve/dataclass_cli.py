"""Command-line flags generated from dataclass fields, so a setting is written once: its name,
type, default, help and choices live on the field (`metadata={"help": ..., "choices": ...}`).

`--field-name` per field; a bool that defaults to False is a switch, one that defaults to True
gets `--no-field-name`; a `list[...]` field takes comma-separated values."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

_SCALARS: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _parser_of(type_text: str) -> Callable[[str], Any]:
    """The value parser for a field annotation written as text (`from __future__ import annotations`)."""
    base = type_text.replace(" ", "").split("|")[0]
    if base.startswith("list["):
        item = _SCALARS[base[len("list["):-1]]
        return lambda text: [item(x) for x in text.split(",") if x.strip()]
    return _SCALARS.get(base, str)


def add_dataclass_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                       skip: Callable[[dataclasses.Field], bool] = lambda f: False) -> None:
    for f in dataclasses.fields(cls):
        if skip(f) or f.metadata.get("cli") is False:
            continue
        help_ = f.metadata.get("help", "")
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            parser.add_argument(flag_name(f.name), type=_parser_of(str(f.type)), required=True, help=help_)
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if str(f.type) in ("bool", "<class 'bool'>"):
            if default:
                parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                                    help=help_ + " (on by default; this turns it off)")
            else:
                parser.add_argument(flag_name(f.name), action="store_true", help=help_)
            continue
        kw: dict[str, Any] = {"type": _parser_of(str(f.type)), "default": default, "help": help_}
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        if default not in (None, []):     # for None the help text says what happens
            kw["help"] = f"{help_} (default: %(default)s)"
        parser.add_argument(flag_name(f.name), **kw)


def dataclass_from_args(cls: type, ns: argparse.Namespace, **override: Any):
    """An instance of `cls` from the parsed flags (fields without a flag keep their defaults)."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    return cls(**{**values, **override})
