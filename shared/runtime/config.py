"""Run settings from a TOML file, with command-line flags taking precedence.

One file can hold both stages (`[extract]`, `[train]` tables, keys named like the CLI options with
dashes or underscores); click reads the table as its default map, so an explicit flag always wins.

Each command's settings are one frozen dataclass whose fields are declared with `option(...)`: the
field's default, help and range are written there once, `config_options` turns the fields into the
command's click options, `check_options` makes the dataclass refuse what the CLI refuses, and
`config_from_cli` builds the dataclass from the parsed options.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import tomllib
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from dflash_pipeline.shared.runtime.errors import UserError

T = TypeVar("T")


def read_section(path: str | Path, section: str) -> dict[str, Any]:
    """The `[section]` table of a TOML file, keys normalised to click parameter names."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise click.BadParameter(f"{path}: cannot read ({exc.strerror})", param_hint="--config") from exc
    except tomllib.TOMLDecodeError as exc:
        raise click.BadParameter(f"{path}: not valid TOML ({exc})", param_hint="--config") from exc
    table = doc.get(section, {})
    if not isinstance(table, dict):
        raise click.BadParameter(f"{path}: [{section}] must be a table", param_hint="--config")
    return {key.replace("-", "_"): value for key, value in table.items()}


def config_option(section: str):
    """A `--config FILE` option whose TOML `[section]` becomes the command's defaults."""

    def load(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
        if value:
            values = read_section(value, section)
            known = {p.name for p in ctx.command.params}
            unknown = sorted(set(values) - known)
            if unknown:
                raise click.BadParameter(
                    f"{value}: unknown keys in [{section}]: {', '.join(unknown)}", param_hint="--config"
                )
            ctx.default_map = {**(ctx.default_map or {}), **values}
        return value

    return click.option(
        "--config",
        type=click.Path(dir_okay=False),
        callback=load,
        is_eager=True,
        expose_value=False,
        help=f"TOML file whose [{section}] table sets defaults for these options (flags override it).",
    )


class IntList(click.ParamType):
    """Comma-separated integers, e.g. GPU ids "0,1,2" -> (0, 1, 2); empty -> ()."""

    name = "text"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:
        if isinstance(value, tuple):  # the default, or already converted
            return value
        try:
            return tuple(int(x) for x in str(value).split(",") if x.strip())
        except ValueError:
            self.fail(f"{value!r}: expected comma-separated integers", param, ctx)


class ChoiceList(click.ParamType):
    """Comma-separated words, each one of `choices`, e.g. "a,b,a" -> ("a", "b", "a"); empty -> ()."""

    name = "text"

    def __init__(self, choices: tuple[str, ...]) -> None:
        self.choices = choices

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[str, ...]:
        words = tuple(value) if isinstance(value, (tuple, list)) else tuple(w.strip() for w in str(value).split(","))
        words = tuple(w for w in words if w)
        bad = [w for w in words if w not in self.choices]
        if bad:
            self.fail(f"{bad[0]!r} is not one of {', '.join(self.choices)}", param, ctx)
        return words


class JsonObject(click.ParamType):
    """A JSON object: text from the command line or a TOML string, or a TOML table from --config."""

    name = "JSON"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> dict:
        parsed = value
        if isinstance(value, str):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as exc:
                self.fail(f"expected a JSON object, got {value!r} ({exc})", param, ctx)
        if not isinstance(parsed, dict):
            self.fail(f"expected a JSON object, got {value!r}", param, ctx)
        try:
            return json.loads(json.dumps(parsed))  # as the manifest stores them
        except TypeError as exc:  # a TOML table may hold dates
            self.fail(f"expected a JSON object, got {value!r} ({exc})", param, ctx)


class ConfigError(UserError, ValueError):
    """A setting out of its option's range or at odds with another; the message names the option."""


@dataclasses.dataclass(frozen=True)
class Cli:
    """How a config field shows on the command line (see `option`)."""

    help: str | None = None
    flag: str | None = None  # the option's declaration when not --field-name, e.g. "--compile/--no-compile"
    type: click.ParamType | None = None  # when neither the annotation nor range/choices say it
    range: tuple[float | None, float | None] | None = None  # (min, max), inclusive unless min_open
    min_open: bool = False
    choices: tuple[str, ...] | None = None
    multiple: bool = False  # repeatable; the field holds a tuple
    settings: type | None = None  # a flag that turns on these settings, whose fields are options too

    def click_type(self, base: type) -> click.ParamType | type | None:
        if self.type is not None:
            return self.type
        if self.choices is not None:
            return click.Choice(self.choices)
        if self.range is not None:
            lo, hi = self.range
            return (click.IntRange if base is int else click.FloatRange)(lo, hi, min_open=self.min_open)
        return base if base in (int, float) else None


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str | None = None,
    flag: str | None = None,
    type: click.ParamType | None = None,
    range: tuple[float | None, float | None] | None = None,
    min_open: bool = False,
    choices: tuple[str, ...] | None = None,
    multiple: bool = False,
    settings: type | None = None,
) -> Any:
    """A dataclass field that is also a command-line option (no default: a required option)."""
    cli = Cli(
        help=help,
        flag=flag,
        type=type,
        range=range,
        min_open=min_open,
        choices=choices,
        multiple=multiple,
        settings=settings,
    )
    return dataclasses.field(default=default, metadata={"cli": cli})


def option_name(f: dataclasses.Field) -> str:
    """The flag a field is set with, as error messages name it."""
    flag = f.metadata["cli"].flag
    return flag.split("/")[0] if flag else "--" + f.name.replace("_", "-")


@functools.cache
def _base_types(cls: type) -> dict[str, type]:
    """Each field's annotated type without `| None` (what its option parses)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for name, hint in hints.items():
        args = [a for a in typing.get_args(hint) if a is not types.NoneType]
        out[name] = args[0] if isinstance(hint, types.UnionType) and len(args) == 1 else typing.get_origin(hint) or hint
    return out


def _cli_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "cli" in f.metadata]


def _click_options(cls: type) -> list[Callable]:
    options = []
    for f in _cli_fields(cls):
        cli: Cli = f.metadata["cli"]
        base = _base_types(cls)[f.name]
        kwargs: dict[str, Any] = {"help": cli.help}
        if f.default is dataclasses.MISSING:
            kwargs["required"] = True
        elif cli.settings is None:
            kwargs["default"] = f.default
        if base is bool or cli.settings is not None:
            kwargs["is_flag"] = True
        elif cli.multiple:
            kwargs["multiple"] = True
        else:
            kwargs["type"] = cli.click_type(base)
        options.append(click.option(option_name(f) if cli.flag is None else cli.flag, f.name, **kwargs))
        if cli.settings is not None:
            options += _click_options(cli.settings)
    return options


def config_options(cls: type) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorate a click command with one option per `option` field of `cls` (and of the settings a
    flag field turns on, right after it), in field order."""

    def decorate(fn: Callable[..., T]) -> Callable[..., T]:
        for add in reversed(_click_options(cls)):
            fn = add(fn)
        return fn

    return decorate


def check_options(cfg: Any) -> None:
    """Refuse a field outside its option's range or choices, as the CLI would: library callers get
    the same rules. Call from `__post_init__`."""
    for f in _cli_fields(type(cfg)):
        cli: Cli = f.metadata["cli"]
        value = getattr(cfg, f.name)
        if value is None or (cli.range is None and cli.choices is None and not isinstance(cli.type, ChoiceList)):
            continue
        try:
            cli.click_type(_base_types(type(cfg))[f.name]).convert(value, None, None)
        except click.BadParameter as exc:
            raise ConfigError(f"{option_name(f)}: {exc.message}") from None


def config_from_cli(cls: type[T], opts: dict[str, Any]) -> T:
    """The config of a command's parsed options (`config_options(cls)`); a `ConfigError` becomes
    click's usage error (exit code 2). A settings flag's field holds `settings.to_dict()` when set,
    else None; its settings are checked either way."""
    values = dict(opts)
    try:
        for f in _cli_fields(cls):
            settings = f.metadata["cli"].settings
            if settings is not None:
                chosen = settings(**{s.name: values.pop(s.name) for s in _cli_fields(settings)})
                values[f.name] = chosen.to_dict() if values[f.name] else None
        return cls(**values)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
