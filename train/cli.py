"""`dflash-train`: stage two from the command line."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from dflash_pipeline.extract.cli import _int_list
from dflash_pipeline.shared.config import config_option
from dflash_pipeline.shared.device import device_option, resolve_device
from dflash_pipeline.shared.errors import cli_errors

if TYPE_CHECKING:
    from dflash_pipeline.train.config import TrainConfig
    from dflash_pipeline.train.loop import RankResult


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@config_option("train")
@click.option("--store", required=True, type=click.Path(file_okay=False), help="Store written by dflash-extract.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Run folder: checkpoints, metrics, drafter/.")
@click.option("--target", default=None, help="Optional: refuse the store unless it was extracted from this target.")
@click.option("--num-layers", default=5, type=click.IntRange(1), help="Drafter decoder layers.")
@click.option("--block-size", default=16, type=click.IntRange(2), help="Tokens per draft block.")
@click.option("--mask-token-id", default=None, type=int, help="[default: tokenizer mask token, else first unused row]")
@click.option("--gamma", default=None, type=float, help="Loss decay over block positions [default: 7 for B=16].")
@click.option("--pack-tokens", default=4096, type=click.IntRange(128), help="Context tokens per pack (multiple of 128).")
@click.option("--num-blocks", default=256, type=click.IntRange(1), help="Blocks (anchors) per pack.")
@click.option("--max-anchors-per-sample", default=512, type=click.IntRange(1))
@click.option("--packs-per-step", default=1, type=click.IntRange(1), help="Packs per GPU per optimizer step.")
@click.option("--eval-samples", default=64, type=click.IntRange(0), help="Held-out samples for offline acceptance.")
@click.option("--loader-workers", default=None, type=click.IntRange(0),
              help="DataLoader worker processes per rank [default: on GPU the host's cores shared by its ranks, on CPU 2].")
@click.option("--epochs", default=6, type=click.IntRange(1))
@click.option("--max-steps", default=None, type=click.IntRange(1))
@click.option("--lr", default=6e-4, type=float)
@click.option("--min-lr-ratio", default=0.0, type=float)
@click.option("--warmup-ratio", default=0.04, type=float)
@click.option("--weight-decay", default=0.0, type=float)
@click.option("--grad-clip", default=1.0, type=float)
@click.option("--seed", default=0, type=int)
@click.option("--gpus", default=None, help="GPU ids, one DDP process each [default: 3 if available, else all].")
@device_option()
@click.option("--workers", default=1, type=click.IntRange(1), help="DDP processes with --device cpu (gloo).")
@click.option("--collective-timeout", default=300.0, type=click.FloatRange(1),
              help="Several processes: seconds a rank may go without answering (frozen or cut-off node) before "
                   "the others stop naming it; slow work is waited for while its rank answers.")
@click.option("--attention", type=click.Choice(["auto", "flex_compiled", "flex_eager", "sdpa_dense"]), default="auto",
              help="auto: compiled flex_attention on GPU, dense SDPA on CPU.")
@click.option("--log-every", default=1, type=click.IntRange(1))
@click.option("--eval-every", default=100, type=click.IntRange(1))
@click.option("--checkpoint-every", default=200, type=click.IntRange(1))
@click.option("--keep-checkpoints", default=2, type=click.IntRange(1))
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in --out.")
@cli_errors("dflash-train")
def main(**opts) -> None:
    """Train a DFlash drafter from a feature store."""
    from dflash_pipeline.train.config import TrainConfig
    from dflash_pipeline.train.run import run_training

    opts["device"] = resolve_device("dflash-train", opts["device"])
    cfg = TrainConfig(gpus=_int_list(opts.pop("gpus")), **opts)
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
