"""`python -m dflash_pipeline.demo`: the whole pipeline on CPU in a few minutes, on an embedded tiny default.

It builds a tiny random Qwen3-architecture target with a tokenizer trained on the bundled sample
corpus, extracts its hidden states with two worker processes, trains a small drafter with two gloo
DDP processes, checks real speculative decoding with it (`dflash-eval`), draws the curves
(`dflash-report`) and prints where everything went.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import click

from dflash_pipeline.data import sample_corpus_path
from dflash_pipeline.shared.runtime.durable import folder_bytes
from dflash_pipeline.shared.runtime.stop import stopping_gracefully


def run_step(step: str, args: list[str]) -> None:
    """Print and run one stage as a subprocess (the real CLI, as a user would run it); exit with its
    code if it fails, so a broken stage stops the whole run. SIGTERM or Ctrl-C goes on to the stage, and
    this process waits for it to stop. Shared with the benchmarks in bench/."""
    click.echo(f"\n== {step}: {' '.join(args)}")
    proc = subprocess.Popen(args)

    def running() -> list[int]:
        return [proc.pid] if proc.poll() is None else []

    with stopping_gracefully(forward_to=running):  # the stage stops itself (dflash-train after a checkpoint): wait
        try:
            code = proc.wait()
        except KeyboardInterrupt:  # a second Ctrl-C, sent on: the stage stops at once
            code = proc.wait()
    if code != 0:
        click.echo(f"{step} failed (exit code {code})", err=True)
        sys.exit(code)


@click.command()
@click.option("--out", default="runs/demo", show_default=True, type=click.Path(file_okay=False))
@click.option("--steps", default=120, show_default=True, help="Training steps.")
def main(out: str, steps: int) -> None:
    """Run extract -> train on the tiny default and summarise."""
    from dflash_pipeline.data.tiny_target import build_tiny_target
    from dflash_pipeline.shared.store.reader import FeatureStore

    root = Path(out)
    started = time.perf_counter()
    target = root / "target"
    if not (target / "config.json").exists():
        click.echo(f"== building the tiny default target in {target}")
        build_tiny_target(target, arch="qwen3", num_layers=6, hidden=128)
    store, run = root / "store", root / "train"
    run_step(
        "extract",
        [
            sys.executable,
            "-m",
            "dflash_pipeline.extract.cli",
            "--target",
            str(target),
            "--data",
            str(sample_corpus_path()),
            "--out",
            str(store),
            "--device",
            "cpu",
            "--workers",
            "2",
            "--max-length",
            "512",
            "--batch-tokens",
            "4096",
        ],
    )
    # --epochs as large as --steps: every epoch holds at least one step (dflash-train refuses a store
    # that does not fill one), so the epoch limit can never end the run before the steps asked for
    run_step(
        "train",
        [
            sys.executable,
            "-m",
            "dflash_pipeline.train.cli",
            "--store",
            str(store),
            "--out",
            str(run),
            "--device",
            "cpu",
            "--workers",
            "2",
            "--num-layers",
            "2",
            "--block-size",
            "8",
            "--pack-tokens",
            "512",
            "--num-blocks",
            "32",
            "--max-steps",
            str(steps),
            "--epochs",
            str(steps),
            "--lr",
            "2e-3",
            "--eval-every",
            "40",
            "--checkpoint-every",
            "60",
            "--eval-samples",
            "24",
            "--loader-workers",
            "1",
            "--resume",
        ],
    )
    evaluate = [
        sys.executable, "-m", "dflash_pipeline.train.eval_cli", "--target", str(target),
        "--drafter", str(run / "drafter"), "--prompts", str(sample_corpus_path()), "--limit", "4",
        "--max-new-tokens", "32", "--device", "cpu", "--dtype", "float32",
    ]  # fmt: skip
    evaluation, sampled_evaluation = root / "eval.json", root / "eval_t1.json"
    run_step("speculative decoding check", [*evaluate, "--json", str(evaluation)])
    run_step(
        "speculative sampling at temperature 1",
        [*evaluate, "--temperature", "1", "--json", str(sampled_evaluation)],
    )
    run_step("report", [sys.executable, "-m", "dflash_pipeline.train.report", "--run", str(run)])
    spec = json.loads(evaluation.read_text())
    sampled = json.loads(sampled_evaluation.read_text())
    fs = FeatureStore(store)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
    losses = [r["loss"] for r in records if "loss" in r]
    held_out = [r for r in records if r.get("type") == "eval"]
    taus = [r["tau"] for r in held_out]
    size = folder_bytes(store)
    click.echo(
        "\n".join(
            [
                "",
                "== demo summary",
                f"target       {target}",
                f"store        {store}  ({len(fs)} samples, {fs.num_tokens} tokens, {size / 2**20:.1f} MiB)",
                f"drafter      {run / 'drafter'}",
                f"metrics      {run / 'metrics.jsonl'}",
                f"loss         {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps"
                if losses
                else "loss         n/a",
                f"offline tau  {taus[0]:.3f} -> {taus[-1]:.3f} (accepted tokens per block, held-out; along the "
                f"decoding chain {held_out[-1]['tau_decode']:.3f})"
                if taus
                else "offline tau  n/a",
                f"dflash-eval  tau {spec['tau']:.2f} (the reference's: mean of per-prompt means; pooled "
                f"{spec['tau_pooled']:.2f}) on {spec['num_prompts']} prompts, lossless {spec['all_lossless']}, "
                f"speedup {spec['speedup']:.2f}x  ({evaluation})",
                f"             at temperature 1: tau {sampled['tau']:.2f} (pooled {sampled['tau_pooled']:.2f})  ({sampled_evaluation})",
                f"report       {run / 'report.png'}",
                f"wall time    {time.perf_counter() - started:.0f} s",
            ]
        )
    )


if __name__ == "__main__":
    main()
