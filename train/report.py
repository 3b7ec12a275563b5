"""`dflash-report`: loss and offline acceptance curves of a training run, drawn to a PNG."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click

from dflash_pipeline.shared.runtime.config import config_from_cli, config_options, option
from dflash_pipeline.shared.runtime.errors import cli_errors
from dflash_pipeline.train.metrics import LOSS_TERMS, read_records


def read_metrics(run: Path) -> tuple[list[dict], list[dict]]:
    """(loss rows, eval rows); a last line cut short by a crash is skipped with a warning, since a
    crashed run is exactly the one whose curves are wanted; any other bad line is a `MetricsError`."""
    path = run / "metrics.jsonl"
    if not path.exists():
        raise click.UsageError(f"{path}: no metrics (is --run a dflash-train output folder?)")
    rows, warning = read_records(path)
    if warning:
        click.echo(f"dflash-report: warning: {warning}", err=True)
    train = [r for r in rows if "loss" in r]
    if not train:  # an empty plot would look like a report of a run that learned nothing
        raise click.UsageError(f"{path}: no training loss rows yet (has the run logged its first step?)")
    return train, [r for r in rows if r.get("type") == "eval"]


def loss_curves(train: list[dict], evals: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """The loss panel's curves by label: the training loss and, for a DFlash-2 run, its CE and selector
    terms, in training and held out (DFlash records have neither: the loss alone)."""
    curves = {"loss": ([r["step"] for r in train], [r["loss"] for r in train])}
    for key in LOSS_TERMS.values():
        for label, rows in ((key, train), (f"held-out {key}", evals)):
            points = [r for r in rows if key in r]
            if points:
                curves[label] = ([r["step"] for r in points], [r[key] for r in points])
    return curves


def draw(run: Path, png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = read_metrics(run)
    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(11, 4))
    curves = loss_curves(train, evals)
    for label, (steps, values) in curves.items():
        ax_loss.plot(steps, values, lw=1, label=label, marker="o" if label.startswith("held-out") else None)
    if len(curves) > 1:
        ax_loss.legend()
    ax_loss.set(xlabel="step", ylabel="weighted loss", title="training loss")
    ax_loss.grid(alpha=0.3)
    for key, label in (
        ("tau", "drawn anchors (tau)"),
        ("tau_decode", "decoding chain (tau_decode)"),
        ("tau_decode_head", "chain, first tokens of each reply (tau_decode_head)"),
    ):
        points = [(r["step"], r[key]) for r in evals if key in r]
        if points:
            ax_tau.plot(*zip(*points), marker="o", label=label)
    if any("tau_decode" in r for r in evals):
        ax_tau.legend()
    ax_tau.set(xlabel="step", ylabel="accepted tokens per block", title="held-out offline acceptance")
    ax_tau.grid(alpha=0.3)
    fig.suptitle(str(run))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


@dataclass(frozen=True)
class ReportConfig:
    """What `dflash-report` draws; its options derive from these fields."""

    run: str = option(type=click.Path(file_okay=False, exists=True), help="dflash-train --out folder.")
    png: str | None = option(None, help="Output image [default: RUN/report.png].")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@config_options(ReportConfig)
@cli_errors("dflash-report")
def main(**opts) -> None:
    """Draw loss and acceptance curves of a run."""
    cfg = config_from_cli(ReportConfig, opts)
    out = draw(Path(cfg.run), Path(cfg.png) if cfg.png else Path(cfg.run) / "report.png")
    click.echo(f"report written to {out}")


if __name__ == "__main__":
    main()
