"""`dflash-eval`: real speculative decoding with a trained drafter against target-only decoding.

For every prompt both decoders run in the same process, one after the other. Greedy (the default),
the speculative output must equal the target's own (lossless) and is checked; sampled
(`--temperature` > 0), outputs differ by chance, so only tau and speed are reported. tau is counted
as the z-lab reference (`dflash` 0.1.0) counts it: the mean over prompts of each prompt's mean
acceptance length; `tau_pooled` is all tokens over all verify steps. Reported as JSON.
`--chain` counts greedy tau without decoding step by step (train/chain_tau.py): the same counts where
the numerics agree, in seconds for replies of thousands of tokens, and no speedup.
SIGTERM (a deadline's `timeout`, a scheduler) or Ctrl-C stops decoding at once, dropping the prompt in progress:
the report of the prompts done is written, marked `complete: false`, and `--resume` finishes it. Prompt
n's outputs depend on n alone (its own seed), so a resumed report has the tokens of an uninterrupted one,
and `--shards N --shard I` splits an evaluation among N processes (a small target decoding one sequence
is bound by launches and leaves a GPU mostly idle) whose reports `merge_reports` joins into the one a
single process would have written, timings apart.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import click
import torch

from dflash_pipeline.shared.runtime.config import (
    ConfigError,
    IntList,
    check_options,
    config_from_cli,
    config_options,
    option,
)
from dflash_pipeline.shared.runtime.device import DEVICE_HELP, resolve_device
from dflash_pipeline.shared.runtime.durable import write_bytes_durably
from dflash_pipeline.shared.runtime.errors import UserError, cli_errors, first_line
from dflash_pipeline.shared.runtime.progress import progress_bar, progress_note
from dflash_pipeline.shared.runtime.stop import (
    Interrupted,
    interrupting_on_stop,
    stop_cause,
    stopping_at_once,
    stopping_gracefully,
)

# what a resumed report must share with the stopped one, so that its prompts mean the same thing
RESUME_KEYS = (
    "target",
    "drafter",
    "prompts",
    "method",
    "max_new_tokens",
    "block_size",
    "dtype",
    "sampling",
    "shard",
)
HEAD_KEYS = (*RESUME_KEYS, "device")  # a decoding report's fields before its counts (report_head's)


class EvaluationStopped(UserError):
    """SIGTERM or Ctrl-C stopped decoding; the prompts done are in the report (complete: false)."""


@dataclass(frozen=True)
class EvalConfig:
    """What `dflash-eval` runs; its options derive from these fields."""

    target: str = option(help="The target model folder (as given to dflash-extract).")
    drafter: str = option(help="A trained drafter folder (dflash-train's OUT/drafter).")
    prompts: str = option(
        help='Prompt records: the formats of --data of dflash-extract, also without replies, or {"prompt": ...}.'
    )
    limit: int = option(16, range=(1, None), help="Number of prompts.")
    max_new_tokens: int = option(128, range=(1, None))
    block_size: int | None = option(None, range=(2, None), help="[default: the drafter's]")
    device: str = option("auto", help=DEVICE_HELP + " Also an indexed device, e.g. cuda:1.")
    dtype: str = option("auto", choices=("auto", "bfloat16", "float16", "float32"))
    temperature: float = option(0.0, range=(0, None), help="0: greedy, checked lossless.")
    top_p: float = option(1.0, range=(0, 1), min_open=True)
    top_k: int = option(0, range=(0, None), help="0: no top-k filter.")
    seed: int = option(0, help="Seed of the sampling (prompt n uses seed + n).")
    json_path: str | None = option(None, flag="--json", help="Write the full report here.")
    chain: bool = option(
        False,
        help="Greedy tau without decoding step by step: the target's greedy replies first (all prompts "
        "batched), then the blocks greedy decoding would draft along them (train/chain_tau.py); no speedup. "
        "For long replies and many prompts: seconds where decoding takes minutes.",
    )
    windows: tuple[int, ...] = option(
        (),
        type=IntList(),
        help="With --chain, also tau at these shorter --max-new-tokens, comma-separated (from the same replies).",
    )
    resume: bool = option(
        False,
        help="Finish the --json report of a run stopped by SIGTERM or Ctrl-C (complete: false), or extend one to a larger "
        "--limit: its prompts are kept, the rest decoded. Without that file, a fresh run.",
    )
    shards: int = option(
        1,
        range=(1, None),
        help="Split the --limit prompts among this many processes, each run with its own --shard and --json "
        "(merge_reports joins the reports).",
    )
    shard: int = option(0, range=(0, None), help="With --shards N: decode prompts n with n % N == this (seed + n).")
    max_prompt_tokens: int = 1024  # a prompt's last tokens kept

    def __post_init__(self) -> None:
        check_options(self)
        if self.chain and self.temperature > 0:
            raise ConfigError("--chain measures greedy decoding: it needs --temperature 0")
        if self.windows and not self.chain:
            raise ConfigError("--windows needs --chain")
        if any(not 1 <= w <= self.max_new_tokens for w in self.windows):
            raise ConfigError(f"--windows must lie in 1..--max-new-tokens ({self.max_new_tokens})")
        if self.resume and (self.chain or not self.json_path):
            raise ConfigError("--resume continues a --json report of decoding: it needs --json and no --chain")
        if self.shard >= self.shards:
            raise ConfigError(f"--shard must lie in 0..--shards - 1 ({self.shards - 1})")
        if self.chain and self.shards > 1:
            raise ConfigError("--shards splits decoding; --chain batches all prompts in one process")


def prompts_from(path: str, tokenizer, limit: int, max_prompt_tokens: int) -> list[list[int]]:
    """Chat prompts with the generation prompt: a conversation that ends in a user turn (prompt-only
    records: OpenAI/ShareGPT without replies, `{"prompt": ...}`) whole, one with replies up to its
    first assistant turn; plain text records as they are. None usable is a `UserError` saying what
    was read."""
    from dflash_pipeline.data.records import ReadStats, iter_records

    prompts: list[list[int]] = []
    stats, replies_first = ReadStats(), 0
    for record in iter_records(path, skip_bad=True, stats=stats, prompts=True):
        if len(prompts) >= limit:
            break
        if record.messages:
            roles = [m["role"] for m in record.messages]
            head = record.messages
            if roles[-1] != "user":
                head = head[: roles.index("assistant")] if "assistant" in roles else []
            if not head:
                replies_first += 1
                continue
            ids = tokenizer.apply_chat_template(head, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(record.text)["input_ids"]
        prompts.append(list(ids)[-max_prompt_tokens:])
    if not prompts:
        why = [stats.summary()]
        if replies_first:
            why.append(f"{replies_first} open with a reply, with no prompt before it")
        if stats.first_skipped:
            why.append(f"the first skipped: {stats.first_skipped}")
        raise UserError(f"{path}: no usable prompts ({'; '.join(why)})")
    return prompts


def taus(accepted: list[list[int]]) -> dict[str, float]:
    """`tau` as the reference benchmark reports it, the mean over prompts (those with a verify step) of
    each prompt's mean acceptance length; `tau_pooled`, all tokens over all verify steps, weighs long
    outputs more."""
    means = [sum(a) / len(a) for a in accepted if a]
    steps = sum(len(a) for a in accepted)
    return {
        "tau": sum(means) / len(means) if means else float("nan"),
        "tau_pooled": sum(map(sum, accepted)) / steps if steps else float("nan"),
    }


def evaluate(cfg: EvalConfig) -> dict:
    from dflash_pipeline.data.chat import stop_token_ids
    from dflash_pipeline.shared.generation.sampling import SamplingParams
    from dflash_pipeline.shared.generation.speculative import dflash_generate, target_generate
    from dflash_pipeline.shared.model.config import CONFIG_FILE
    from dflash_pipeline.shared.model.drafter import DFlashDrafter
    from dflash_pipeline.shared.target.assets import load_tokenizer
    from dflash_pipeline.shared.target.identity import (
        TargetIdentity,
        check_config,
        check_drafter_fits,
        check_weights,
        config_hash,
    )
    from dflash_pipeline.shared.target.loading import HiddenStateCapture, load_full_target, load_target_config
    from dflash_pipeline.train.checkpoint import run_folder_note

    target_path, drafter_path, prompts_path = cfg.target, cfg.drafter, cfg.prompts
    dev = torch.device(cfg.device)
    torch_dtype = (
        getattr(torch, cfg.dtype) if cfg.dtype != "auto" else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    )
    if not (Path(drafter_path) / CONFIG_FILE).exists() and (note := run_folder_note(Path(drafter_path))):
        raise UserError(f"{drafter_path}: {note}")
    drafter = DFlashDrafter.from_pretrained(
        drafter_path, attention_backend="sdpa_dense", device=dev, dtype=torch_dtype
    ).eval()
    identity = TargetIdentity.load(drafter_path)
    target_config = load_target_config(target_path)
    if identity is not None:  # refused before the target's weights are read
        check_config(identity, f"the drafter {drafter_path}", target_path, config_hash(target_config))
    check_drafter_fits(drafter.config, drafter_path, target_path, target_config)
    tokenizer = load_tokenizer(target_path)
    prompts = prompts_from(prompts_path, tokenizer, cfg.limit, cfg.max_prompt_tokens)
    head = report_head(cfg, dev, torch_dtype, drafter)
    mine = range(cfg.shard, len(prompts), cfg.shards)  # the prompts this process decodes, by index
    # --resume: a report of another run is refused before the target's weights are read
    rows = done_rows(cfg, head, prompts, mine) if cfg.resume else []
    target = load_full_target(target_path, device=dev, dtype=torch_dtype)
    if identity is not None:
        check_weights(identity, f"the drafter {drafter_path}", target_path, target)
    stop_ids = stop_token_ids(tokenizer, target.generation_config.eos_token_id)
    capture = HiddenStateCapture(target, drafter.config.target_layer_ids)
    if cfg.chain:
        try:
            return chain_report(cfg, target, drafter, capture, prompts, stop_ids, torch_dtype)
        finally:
            capture.close()
    sampling = SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k)

    def generator(n: int) -> torch.Generator:
        """Prompt n's random stream: the same for both decoders, any --limit and any --shards."""
        return torch.Generator(dev).manual_seed(cfg.seed + n)

    left = mine[len(rows) :]
    if left:  # one warm-up of each path: the first prompt timed pays no lazy setup
        warm = torch.tensor(prompts[left[0]], device=dev)
        target_generate(target, warm, 4, stop_ids, sampling, generator(0))
        dflash_generate(target, drafter, capture, warm, 4, stop_ids, cfg.block_size, sampling, generator(0))
    bar = progress_bar(total=len(mine), initial=len(rows), unit="prompt", desc="dflash-eval")
    for n in left:
        ids = prompts[n]
        p = torch.tensor(ids, device=dev)
        try:  # SIGTERM or Ctrl-C stops at once: the prompt in progress is dropped (a --resume decodes it)
            with interrupting_on_stop():
                base = target_generate(target, p, cfg.max_new_tokens, stop_ids, sampling, generator(n))
                spec = dflash_generate(
                    target, drafter, capture, p, cfg.max_new_tokens, stop_ids, cfg.block_size, sampling, generator(n)
                )
        except Interrupted:
            break
        rows.append(
            {
                "prompt_index": n,
                "prompt_tokens": len(ids),
                "new_tokens": len(spec.tokens),
                "tau": spec.tau,
                "lossless": spec.tokens == base.tokens if sampling.greedy else None,
                "target_s": base.seconds,
                "dflash_s": spec.seconds,
                "accepted": spec.accepted,
                "target_tokens": base.tokens,
                "dflash_tokens": spec.tokens,
            }
        )
        bar.set_postfix_str(running_summary(rows), refresh=False)  # shown at the update's refresh
        bar.update()
    bar.close()
    capture.close()
    return decoding_report(head, rows, len(mine))


def running_summary(rows: list[dict]) -> str:
    """The progress bar's note on the prompts decoded so far: pooled tau, and the speedup where timed."""
    note = f"tau {taus([r['accepted'] for r in rows])['tau_pooled']:.2f}"
    return note + (f", speedup {speedup(rows):.2f}x" if "dflash_s" in rows[0] else "")


def speedup(rows: list[dict]) -> float | None:
    """Target-only decoding's seconds over speculative decoding's, summed over the prompts decoded."""
    return sum(r["target_s"] for r in rows) / sum(r["dflash_s"] for r in rows) if rows else None


def decoding_report(head: dict, rows: list[dict], planned: int) -> dict:
    """The report of decoding `planned` prompts, of which `rows` are done: tau, speedup, lossless."""
    greedy = head["sampling"]["temperature"] == 0
    return {
        **head,
        "num_prompts": len(rows),
        "prompts_planned": planned,
        "complete": len(rows) == planned,
        **taus([r["accepted"] for r in rows]),
        "speedup": speedup(rows),
        "all_lossless": all(r["lossless"] for r in rows) if greedy else None,
        "lossless_check": "greedy: dflash_tokens must equal target_tokens"
        if greedy
        else "skipped: with sampling the two decodings draw different tokens by chance",
        "per_prompt": rows,
    }


def merge_reports(parts: list[dict]) -> dict:
    """The report of an evaluation split by --shards, from its shards' reports: the prompts in order,
    tau and speedup over all of them; incomplete if any shard's is (rerunning that shard with --resume
    and merging again finishes it). Its `shard` is null: it is no shard, and nothing resumes it."""
    first = parts[0]
    shards = first["shard"][1]
    if sorted(tuple(p["shard"]) for p in parts) != [(i, shards) for i in range(shards)]:
        got = ", ".join("/".join(map(str, p["shard"])) for p in parts)
        raise UserError(f"merge_reports: these are not the shards 0..N-1 of one evaluation (shard/shards: {got})")
    if differ := [k for k in RESUME_KEYS if k != "shard" and any(p[k] != first[k] for p in parts)]:
        raise UserError(f"merge_reports: the shards were made with other {', '.join(differ)}")
    head = {k: first[k] for k in HEAD_KEYS} | {"shard": None, "shards": shards}
    rows = sorted((r for p in parts for r in p["per_prompt"]), key=lambda r: r["prompt_index"])
    return decoding_report(head, rows, sum(p["prompts_planned"] for p in parts))


def report_head(cfg: EvalConfig, dev: torch.device, dtype: torch.dtype, drafter) -> dict:
    """What a decoding report was made of and how (RESUME_KEYS among them)."""
    return {
        "target": cfg.target,
        "drafter": cfg.drafter,
        "prompts": cfg.prompts,
        "method": "decode",
        "max_new_tokens": cfg.max_new_tokens,
        "block_size": cfg.block_size or drafter.config.block_size,
        "device": str(dev),
        "dtype": str(dtype).removeprefix("torch."),
        "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k, "seed": cfg.seed},
        "shard": [cfg.shard, cfg.shards],
    }


def done_rows(cfg: EvalConfig, head: dict, prompts: list[list[int]], mine: range) -> list[dict]:
    """`--resume`: the rows of the --json report, if it exists, after checking it was made the same way
    and of the same first prompts of this process's."""
    path = Path(cfg.json_path)
    if not path.exists():
        return []
    try:
        old = json.loads(path.read_text())
        rows = old["per_prompt"]
        differ = [k for k in RESUME_KEYS if old[k] != head[k]]
        done = [r["prompt_index"] for r in rows]
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path}: not a dflash-eval report to resume ({first_line(exc)})") from None
    if differ:
        raise UserError(f"{path}: made with other {', '.join(differ)}; --resume continues a report of the same run")
    if done != list(mine[: len(rows)]) or any(r["prompt_tokens"] != len(prompts[n]) for r, n in zip(rows, done)):
        raise UserError(f"{path}: its prompts are not the first {len(rows)} of {cfg.prompts} now")
    return rows


def chain_report(cfg: EvalConfig, target, drafter, capture, prompts: list[list[int]], stop_ids, dtype) -> dict:
    """`--chain`: greedy tau from the target's replies and the drafter's blocks along them (module
    train.chain_tau), at --max-new-tokens and at each of --windows."""
    from dflash_pipeline.shared.model.target_head import TargetHead
    from dflash_pipeline.train.chain_tau import BlockMatches, chain_accepted, greedy_replies, sequence_features

    block_size = drafter.config.block_size
    if cfg.block_size not in (None, block_size):
        raise click.UsageError(f"--chain drafts blocks of the drafter's size ({block_size}); leave --block-size out")
    dev = torch.device(cfg.device)
    head = TargetHead(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    progress_note(
        f"dflash-eval: the target's greedy replies to {len(prompts)} prompts, {cfg.max_new_tokens} tokens each"
    )
    replies = greedy_replies(target, prompts, cfg.max_new_tokens, stop_ids)
    lengths = sorted({cfg.max_new_tokens, *cfg.windows})
    accepted: dict[int, list[list[int]]] = {n: [] for n in lengths}
    rows = []
    bar = progress_bar(total=len(prompts), unit="prompt", desc="dflash-eval --chain")
    for index, (ids, reply) in enumerate(zip(prompts, replies)):
        sequence = torch.tensor([*ids, *reply], device=dev)
        features = sequence_features(target, capture, sequence)
        matches = BlockMatches(drafter, head, features, sequence, len(ids))
        for n in lengths:
            accepted[n].append(chain_accepted(reply, matches, n, block_size, stop_ids))
        rows.append(
            {
                "prompt_index": index,
                "prompt_tokens": len(ids),
                "new_tokens": len(reply),
                "tau": taus(accepted[cfg.max_new_tokens][-1:])["tau"],
                "accepted": accepted[cfg.max_new_tokens][-1],
                "target_tokens": reply,
            }
        )
        bar.set_postfix_str(running_summary(rows), refresh=False)  # shown at the update's refresh
        bar.update()
    bar.close()
    return {
        "target": cfg.target,
        "drafter": cfg.drafter,
        "prompts": cfg.prompts,
        "method": "chain",
        "num_prompts": len(rows),
        "max_new_tokens": cfg.max_new_tokens,
        "block_size": block_size,
        "device": str(dev),
        "dtype": str(dtype).removeprefix("torch."),
        "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": cfg.seed},
        **taus(accepted[cfg.max_new_tokens]),
        "windows": {str(n): taus(accepted[n]) for n in cfg.windows},
        "speedup": None,
        "all_lossless": None,
        "lossless_check": "skipped: --chain decodes nothing step by step",
        "per_prompt": rows,
    }


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@config_options(EvalConfig)
@cli_errors("dflash-eval")
def main(**opts) -> None:
    """Measure acceptance length and speedup of a drafter; check lossless greedy decoding."""
    cfg = config_from_cli(EvalConfig, opts)
    with stopping_at_once() if cfg.chain else stopping_gracefully():  # --chain's replies are batched: all or none
        report = evaluate(replace(cfg, device=resolve_device("dflash-eval", cfg.device)))
        if cfg.json_path and (report["per_prompt"] or report.get("complete")):  # a shard may have no prompts
            write_bytes_durably(Path(cfg.json_path), json.dumps(report, indent=1).encode())
        click.echo(json.dumps({k: v for k, v in report.items() if k != "per_prompt"}, indent=1))
        if not report.get("complete", True):
            done, planned = report["num_prompts"], report["prompts_planned"]
            kept = (
                f"their report is {cfg.json_path}: rerun with --resume to finish it" if cfg.json_path and done else ""
            )
            raise EvaluationStopped(
                f"stopped by {stop_cause()} after {done} of {planned} prompts; {kept or 'nothing was written'}"
            )
    if report["all_lossless"] is False:
        click.echo("dflash-eval: error: speculative output differs from target greedy output", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
