"""`dflash-extract`: stage one from the command line."""

from __future__ import annotations

import json

import click

from dflash_pipeline.shared.config import config_option
from dflash_pipeline.shared.device import device_option, resolve_device
from dflash_pipeline.shared.errors import cli_errors


def _int_list(value: str | None) -> tuple[int, ...]:
    if value in (None, ""):
        return ()
    try:
        return tuple(int(x) for x in str(value).split(",") if x.strip())
    except ValueError as exc:
        raise click.BadParameter(f"{value!r}: expected comma-separated integers") from exc


class JsonObject(click.ParamType):
    """A JSON object: text from the command line or a TOML string, or a TOML table from --config."""

    name = "JSON"

    def convert(self, value, param, ctx) -> dict:
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
@click.option("--chat-template-kwargs", default=None, type=JsonObject(),
              help='Options of the chat template, e.g. \'{"enable_thinking": false}\' for Qwen3.')
@click.option("--gpus", default=None, help="GPU ids, one process each [default: 5 if available, else all].")
@device_option()
@click.option("--workers", default=1, type=click.IntRange(1), help="Processes with --device cpu.")
@click.option("--collective-timeout", default=300.0, type=click.FloatRange(1),
              help="torchrun: seconds a rank may go without answering (frozen or cut-off node) before the others "
                   "stop naming it; slow work is waited for while its rank answers.")
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
@click.option("--top-k", default=0, type=click.IntRange(0), help="--regenerate: sample among the k likeliest tokens (0: all).")
@click.option("--seed", default=0, type=int, help="--regenerate: sampling seed.")
@click.option("--samples-per-prompt", default=1, type=click.IntRange(1),
              help="--regenerate: replies per conversation, each stored as its own sample (needs --temperature > 0).")
@click.option("--gen-batch-size", default=None, type=click.IntRange(1),
              help="--regenerate: requests decoded together (continuous batching) [default: 512 on GPU, 16 on CPU].")
@cli_errors("dflash-extract")
def main(**opts) -> None:
    """Run the frozen target over the data and store the drafter's training features."""
    from dflash_pipeline.extract.config import ExtractConfig
    from dflash_pipeline.extract.regenerate import RegenerateSettings
    from dflash_pipeline.extract.run import run_extraction

    try:
        generation = RegenerateSettings(
            max_new_tokens=opts.pop("max_new_tokens"), temperature=opts.pop("temperature"), top_p=opts.pop("top_p"),
            top_k=opts.pop("top_k"), seed=opts.pop("seed"), samples_per_prompt=opts.pop("samples_per_prompt"),
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    opts["regenerate"] = generation.to_dict() if opts.pop("regenerate") else None
    gpus = _int_list(opts.pop("gpus"))
    opts["data"] = tuple(opts["data"])
    opts["device"] = resolve_device("dflash-extract", opts["device"])
    cfg = ExtractConfig(gpus=gpus, **opts)
    summary = run_extraction(cfg)
    if summary is not None:
        click.echo("\n".join(["", "dflash-extract summary", *summary.lines()]))


if __name__ == "__main__":
    main()
