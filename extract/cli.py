"""`dflash-extract`: stage one from the command line."""

from __future__ import annotations

import sys

import click

from dflash.shared.config import config_option


def _int_list(value: str | None) -> tuple[int, ...]:
    if value in (None, ""):
        return ()
    try:
        return tuple(int(x) for x in str(value).split(",") if x.strip())
    except ValueError as exc:
        raise click.BadParameter(f"{value!r}: expected comma-separated integers") from exc


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@config_option("extract")
@click.option("--target", required=True, help="HF model folder (or a folder with one .gguf) of the frozen target.")
@click.option("--data", "data", multiple=True, required=True,
              help="JSONL/JSON/Parquet/Arrow file or folder of them; repeat for several.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Store folder (created; reruns resume it).")
@click.option("--layers", default=None, help="Target layer ids to store, e.g. 1,9,17,25,33 [default: reference spacing].")
@click.option("--max-length", default=3072, type=click.IntRange(2), help="Truncate samples to this many tokens.")
@click.option("--batch-tokens", default=16384, type=click.IntRange(1), help="Padded tokens per forward batch.")
@click.option("--max-batch-size", default=64, type=click.IntRange(1), help="Samples per forward batch at most.")
@click.option("--skip-bad", is_flag=True, help="Skip and count malformed records instead of failing.")
@click.option("--limit", default=None, type=click.IntRange(1), help="Use only the first N records.")
@click.option("--gpus", default=None, help="GPU ids, one process each [default: 5 if available, else all].")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", help="cpu for runs without GPUs.")
@click.option("--workers", default=1, type=click.IntRange(1), help="Processes with --device cpu.")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]), default="auto",
              help="Compute dtype (auto: bf16 on GPU, fp32 on CPU).")
@click.option("--store-dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16")
@click.option("--compile/--no-compile", "compile", default=None,
              help="Compile the decoder layers (fused norms/activations) [default: on GPU, off on CPU].")
@click.option("--compression", default=None, help="Store codec, e.g. none, zstd:1 [default: the store's measured default].")
@click.option("--chunk-tokens", default=None, type=click.IntRange(1), help="Tokens per zarr chunk.")
@click.option("--shard-tokens", default=None, type=click.IntRange(1), help="Tokens per zarr shard (multiple of chunk).")
@click.option("--write-streams", default=None, type=click.IntRange(1),
              help="Shard files each rank writes at once (more for disks that want deeper queues) [default: 4].")
@click.option("--overwrite", is_flag=True, help="Replace an existing store made with other settings.")
@click.option("--regenerate", is_flag=True, help="First replace every assistant reply by the target's own.")
@click.option("--max-new-tokens", default=512, type=click.IntRange(1), help="--regenerate: reply length limit.")
@click.option("--temperature", default=0.0, type=click.FloatRange(0), help="--regenerate: 0 = greedy, else sampled.")
@click.option("--top-p", default=1.0, type=click.FloatRange(0, 1, min_open=True), help="--regenerate: nucleus sampling.")
@click.option("--seed", default=0, type=int, help="--regenerate: sampling seed.")
@click.option("--gen-batch-size", default=32, type=click.IntRange(1), help="--regenerate: prompts per generate call.")
def main(**opts) -> None:
    """Run the frozen target over the data and store the drafter's training features."""
    from dflash.data import DataError
    from dflash.extract.config import ExtractConfig
    from dflash.extract.run import ExtractError, run_extraction
    from dflash.extract.target import TargetError
    from dflash.shared.manifest import StoreIncomplete, StoreMismatch

    from dflash.extract.regenerate import RegenerateSettings

    generation = RegenerateSettings(
        max_new_tokens=opts.pop("max_new_tokens"), temperature=opts.pop("temperature"),
        top_p=opts.pop("top_p"), seed=opts.pop("seed"), batch_size=opts.pop("gen_batch_size"),
    )
    opts["regenerate"] = generation.to_dict() if opts.pop("regenerate") else None
    gpus = _int_list(opts.pop("gpus"))
    opts["data"] = tuple(opts["data"])
    cfg = ExtractConfig(gpus=gpus, **opts)
    try:
        summary = run_extraction(cfg)
    except (DataError, TargetError, ExtractError, StoreMismatch, StoreIncomplete) as exc:
        click.echo(f"dflash-extract: error: {exc}", err=True)
        sys.exit(1)
    if summary is not None:
        click.echo("\n".join(["", "dflash-extract summary", *summary.lines()]))


if __name__ == "__main__":
    main()
