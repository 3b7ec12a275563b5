"""Run settings from a TOML file, with command-line flags taking precedence.

One file can hold both stages (`[extract]`, `[train]` tables, keys named like the CLI options with
dashes or underscores); click reads the table as its default map, so an explicit flag always wins.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import click


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
                raise click.BadParameter(f"{value}: unknown keys in [{section}]: {', '.join(unknown)}", param_hint="--config")
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
