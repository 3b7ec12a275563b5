"""`dflash-train`: stage two from the command line."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import click

from dflash_pipeline.shared.runtime.config import config_from_cli, config_option, config_options
from dflash_pipeline.shared.runtime.device import resolve_device
from dflash_pipeline.shared.runtime.errors import cli_errors
from dflash_pipeline.train.config import RESUME_HINT, TrainConfig

if TYPE_CHECKING:
    from dflash_pipeline.train.loop import RankResult


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@config_option("train")
@config_options(TrainConfig)
@cli_errors("dflash-train", stopped_hint=RESUME_HINT)
def main(**opts) -> None:
    """Train a DFlash drafter from a feature store."""
    from dflash_pipeline.train.run import run_training

    cfg = config_from_cli(TrainConfig, opts)
    cfg = replace(cfg, device=resolve_device("dflash-train", cfg.device))
    result = run_training(cfg)
    if result is not None:
        click.echo("\n".join(summary_lines(result, cfg)))


def summary_lines(result: RankResult, cfg: TrainConfig) -> list[str]:
    """The closing summary. It says why a run ended short of --max-steps, and a rerun of a finished
    run says so and shows that run's last results (not an empty session's n/a and 0 tok/s)."""
    tau = "n/a" if result.eval_tau is None else f"{result.eval_tau:.3f}"
    loss = "n/a" if result.final_loss is None else f"{result.final_loss:.4f}"
    window = "last window of the finished run" if result.already_complete else "last window"
    lines = ["", "dflash-train summary", f"drafter    {result.out}/drafter"]
    if result.already_complete:
        lines.append(f"status     already complete at step {result.steps}: nothing left to train (--resume)")
    if result.epoch_limit:
        lines.append(f"stopped    at the epoch limit (--epochs {cfg.epochs}) before --max-steps {cfg.max_steps}")
    return lines + [
        f"steps      {result.steps}   final loss {loss}   offline acceptance (tau) {tau}",
        f"throughput {result.tokens_per_s:,.0f} context tok/s ({window})" if result.tokens_per_s else "throughput n/a",
        f"metrics    {result.out}/metrics.jsonl",
    ]


if __name__ == "__main__":
    main()
