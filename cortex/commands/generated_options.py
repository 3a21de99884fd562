"""CLI options generated from the option fields of a dataclass (`ir.options`): a pass's, a
target's. Name, type, default and help are written once, on the field.

    @app.command()
    @with_options(PartitionIntoCUs, into="limits")
    def decompose(model: ..., limits: PartitionIntoCUs): ...

A command may show its own default for a field (`defaults=`, as typed) and leave fields out
(`exclude=`: they keep the class's default).
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Annotated, Callable

import typer

from ir.options import default_text, flag_of, from_text, option_fields, parses_text


def option_parameters(cls, defaults: dict | None = None, exclude: tuple[str, ...] = ()) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(cls)
    defaults = defaults or {}
    params = []
    for field, spec in option_fields(cls):
        if field.name in exclude:
            continue
        # A repeatable flag hands its parser the list of texts given (None: not given).
        kind = list[str] | None if spec.repeat else str if parses_text(field, spec) else hints[field.name]
        help_text = spec.help
        annotation = Annotated[kind, typer.Option(flag_of(field, spec), help=help_text, show_default=True)]
        default = defaults[field.name] if field.name in defaults else default_text(field, spec)
        params.append(inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                                        default=default))
    return params


def with_options(cls, into: str, defaults: dict | None = None, exclude: tuple[str, ...] = ()) -> Callable:
    """Replace the parameter `into` of a command by one CLI option per option field of `cls`
    (but those in `exclude`; `defaults`: the command's own defaults, as typed); the command
    receives the `cls` instance built from them (`ir.options.from_text`)."""
    names = [field.name for field, _ in option_fields(cls) if field.name not in exclude]

    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command, eval_str=True)

        @functools.wraps(command)
        def wrapper(**kwargs):
            values = {name: kwargs.pop(name) for name in names}
            return command(**kwargs, **{into: from_text(cls, **values)})

        params = [p for p in signature.parameters.values() if p.name != into]
        keyword = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params]
        wrapper.__signature__ = signature.replace(parameters=keyword + option_parameters(cls, defaults, exclude))
        wrapper.__annotations__ = {p.name: p.annotation for p in wrapper.__signature__.parameters.values()}
        del wrapper.__wrapped__      # typer must read the new signature, not the command's
        # `cortex build` resolves the options it records through the same classes.
        wrapper.option_classes = (*getattr(command, "option_classes", ()), cls)
        return wrapper

    return decorate
