"""Does a trained drafter accept where copying earlier text would? Its greedy tau split by regions of
the replies that a drafter which only copies (bench/ngram_baseline.py) accepts long blocks in.

Both reports count the same greedy replies to the same prompts (`dflash-eval --chain` and
`bench.ngram_baseline` at the same --max-new-tokens, --limit and prompts file; their per-prompt
`accepted` lists, and the replies themselves where both reports hold them: one count per verify step, the reply's first token coming from the prefill, so
step i begins at reply position 1 + the counts before it). A reply position is *copyable* when the
copy drafter's step covering it accepted at least `--min-copy` tokens. Each of the drafter's steps is
put on the side where it begins; its mean count there is its tau on that side. A drafter that learned
to copy would accept about as much as the copy drafter does in the copyable regions.

    python -m bench.copy_regions --drafter eval_dflash5_T0_chain_N2048.json --copy ngram_N2048.json

Without `--copy`, the copy drafter runs here on the replies the drafter report holds (its `target_tokens`):
`--target` gives the tokenizer and stop ids, `--prompts` the report's prompts, whose token counts must
equal the report's. No target forward, so a CPU reads a GPU session's reports without generating again:

    python -m bench.copy_regions --drafter eval_dflash5_T0_chain_N2048.json --target T --prompts eval_prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import emit, report_prompts


def step_starts(accepted: list[int]) -> list[int]:
    """Reply position where each verify step begins (position 0 is the prefill's token)."""
    starts, at = [], 1
    for n in accepted:
        starts.append(at)
        at += n
    return starts


def copyable_positions(accepted: list[int], min_copy: int) -> set[int]:
    """Reply positions covered by a copy-drafter step that accepted at least `min_copy` tokens."""
    return {p for start, n in zip(step_starts(accepted), accepted) if n >= min_copy for p in range(start, start + n)}


def split(drafter_rows: list[dict], copy_rows: list[dict], min_copy: int) -> dict:
    """The drafter's steps on copyable and other positions, pooled over prompts (module doc)."""
    if len(drafter_rows) != len(copy_rows):
        raise ValueError(f"the drafter report has {len(drafter_rows)} prompts, the copy report {len(copy_rows)}")
    sides = {"copyable": [0, 0], "elsewhere": [0, 0]}  # [steps, accepted tokens]
    positions = copyable = copy_steps = copy_tokens = 0
    for i, (d, c) in enumerate(zip(drafter_rows, copy_rows)):
        if sum(d["accepted"]) != sum(c["accepted"]):
            raise ValueError(
                f"prompt {i}: the drafter's steps cover {sum(d['accepted'])} reply tokens and the copy "
                f"drafter's {sum(c['accepted'])}: not the same replies (same prompts, --limit, --max-new-tokens?)"
            )
        if "target_tokens" in d and "target_tokens" in c and d["target_tokens"] != c["target_tokens"]:
            raise ValueError(f"prompt {i}: the two reports hold different replies of the same length")
        covered = copyable_positions(c["accepted"], min_copy)
        positions += sum(c["accepted"])
        copyable += len(covered)
        long_steps = [n for n in c["accepted"] if n >= min_copy]
        copy_steps, copy_tokens = copy_steps + len(long_steps), copy_tokens + sum(long_steps)
        for start, n in zip(step_starts(d["accepted"]), d["accepted"]):
            side = sides["copyable" if start in covered else "elsewhere"]
            side[0] += 1
            side[1] += n
    return {
        "min_copy": min_copy,
        "prompts": len(drafter_rows),
        "positions": positions,
        "copyable_share": copyable / positions if positions else 0.0,
        "copy_tau_copyable": copy_tokens / copy_steps if copy_steps else None,
        **{f"drafter_steps_{k}": steps for k, (steps, _) in sides.items()},
        **{f"drafter_tau_{k}": (tokens / steps if steps else None) for k, (steps, tokens) in sides.items()},
    }


def copy_rows_on_replies(report: dict, target: str, prompts_file: str) -> list[dict]:
    """bench.ngram_baseline's per-prompt rows for the replies of a `dflash-eval --chain` report (module
    doc); ValueError naming the prompt whose tokens differ from the report's count."""
    from transformers import GenerationConfig

    from bench.ngram_baseline import copy_accepted
    from dflash_pipeline.data.chat import stop_token_ids
    from dflash_pipeline.shared.target.assets import load_tokenizer

    tokenizer = load_tokenizer(target)
    stops = stop_token_ids(tokenizer, GenerationConfig.from_pretrained(target).eos_token_id)
    rows = report["per_prompt"]
    copy = []
    for prompt, row in zip(report_prompts(report, prompts_file, tokenizer, target), rows):
        reply = row["target_tokens"]
        accepted = copy_accepted(prompt, reply, report["max_new_tokens"], report["block_size"], stops)
        copy.append({"accepted": accepted, "target_tokens": reply})
    return copy


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", type=Path, required=True, help="dflash-eval --chain --json report")
    ap.add_argument("--copy", type=Path, default=None, help="bench.ngram_baseline --json report")
    ap.add_argument("--target", default=None, help="without --copy: the target folder (tokenizer, stop ids)")
    ap.add_argument("--prompts", default=None, help="without --copy: the drafter report's prompts file")
    ap.add_argument("--min-copy", type=int, default=4, help="a copy step's count that makes its positions copyable")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.min_copy < 2:
        ap.error("--min-copy must be >= 2 (a count of 1 accepts no drafted token)")
    if args.copy is None and not (args.target and args.prompts):
        ap.error("give --copy, or --target and --prompts (the copy drafter on the drafter report's replies)")
    if args.copy is not None and (args.target or args.prompts):
        ap.error("--copy reads the copy drafter's steps: --target and --prompts are for running it here instead")
    reports, rows = {}, {}
    for name in ("drafter", "copy") if args.copy else ("drafter",):
        try:
            reports[name] = json.loads(getattr(args, name).read_text())
            rows[name] = reports[name]["per_prompt"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            sys.exit(f"bench.copy_regions: {getattr(args, name)}: not a report with per_prompt steps ({e})")
    try:
        if args.copy is None:
            rows["copy"] = copy_rows_on_replies(reports["drafter"], args.target, args.prompts)
        result = split(rows["drafter"], rows["copy"], args.min_copy)
    except ValueError as e:
        sys.exit(f"bench.copy_regions: {e}")
    emit(result, args.json)
    print(
        f"copyable (copy steps of >= {args.min_copy}): {result['copyable_share']:.0%} of {result['positions']:,} "
        f"positions, where the copy drafter's tau is {result['copy_tau_copyable'] or 0:.2f}; the drafter's tau there "
        f"{result['drafter_tau_copyable'] or 0:.3f} ({result['drafter_steps_copyable']} steps), elsewhere "
        f"{result['drafter_tau_elsewhere'] or 0:.3f} ({result['drafter_steps_elsewhere']} steps)"
    )
    return result


if __name__ == "__main__":
    main()
