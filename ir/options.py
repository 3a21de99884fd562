"""Options as dataclass fields: one source of truth for each option's name, type, default and help.

A pass, a target or a device declares its options as fields whose metadata comes from `option()`;
the CLI generates its flags from them (`--max-cu-depth` from `max_cu_depth`), and code builds the
same objects with `from_text` from the strings a user typed. A field without `option()` metadata is
not an option (a pass's result, say).

    @dataclass(frozen=True)
    class WasmOptions:
        opt_level: str = field(default="2", metadata=option("0 plain loops ... z smaller code",
                                                            choices=OPT_LEVELS))
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from ir.errors import CortexError

_KEY = "cortex.option"


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    help: str
    parse: Callable[[str], Any] | None = None    # text -> value; raises CortexError naming the flag
    show: Callable[[Any], str] | None = None     # value -> the text the CLI shows as its default
    choices: Sequence[str] | None = None
    flag: str | None = None                      # default: --field-name
    repeat: bool = False                         # the flag may be given several times; parse gets the list


def option(help: str, *, parse=None, show=None, choices=None, flag=None, repeat=False) -> dict:
    return {_KEY: OptionSpec(help, parse, show, choices, flag, repeat)}


def option_fields(cls) -> list[tuple[dataclasses.Field, OptionSpec]]:
    return [(f, f.metadata[_KEY]) for f in dataclasses.fields(cls) if _KEY in f.metadata]


def flag_of(field: dataclasses.Field, spec: OptionSpec) -> str:
    return spec.flag or "--" + field.name.replace("_", "-")


def parses_text(field: dataclasses.Field, spec: OptionSpec) -> bool:
    """Whether the CLI hands this field a string to parse (rather than a typed value)."""
    return spec.parse is not None or spec.choices is not None


def default_text(field: dataclasses.Field, spec: OptionSpec) -> Any:
    value = field.default
    return spec.show(value) if spec.show else value


def from_text(cls, **given):
    """`cls` from option values as a user typed them (None: the field's default). Text fields go
    through their parser or choices; the class's own `__post_init__` checks how fields combine."""
    values = {}
    for field, spec in option_fields(cls):
        text = given.pop(field.name, None)
        if text is None:
            continue
        if spec.choices is not None and str(text) not in spec.choices:
            raise CortexError(f"unknown {flag_of(field, spec)} {text!r}: expected one of {', '.join(spec.choices)}")
        as_typed = isinstance(text, list) if spec.repeat else isinstance(text, str)
        values[field.name] = spec.parse(text) if spec.parse and as_typed else text
    if given:
        raise TypeError(f"{cls.__name__} has no options {sorted(given)}")
    return cls(**values)
