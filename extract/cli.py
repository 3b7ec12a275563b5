"""`dflash-extract`: stage one from the command line."""

from __future__ import annotations

from dataclasses import replace

import click

from dflash_pipeline.extract.config import ExtractConfig
from dflash_pipeline.shared.runtime.config import config_from_cli, config_option, config_options
from dflash_pipeline.shared.runtime.device import resolve_device
from dflash_pipeline.shared.runtime.errors import cli_errors
from dflash_pipeline.shared.store.errors import RESUME_HINT


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@config_option("extract")
@config_options(ExtractConfig)
@cli_errors("dflash-extract", stopped_hint=RESUME_HINT)
def main(**opts) -> None:
    """Run the frozen target over the data and store the drafter's training features."""
    from dflash_pipeline.extract.run import run_extraction

    cfg = config_from_cli(ExtractConfig, opts)
    cfg = replace(cfg, device=resolve_device("dflash-extract", cfg.device))
    summary = run_extraction(cfg)
    if summary is not None:
        click.echo("\n".join(["", "dflash-extract summary", *summary.lines()]))


if __name__ == "__main__":
    main()
