"""Greedy tau of a drafter that only copies earlier text (prompt lookup / n-gram drafting, as vLLM's
`ngram` speculative method), on the target's own greedy replies: the baseline a trained drafter's tau
should be read against.

At each step the last `n` tokens (n from --max-ngram down to --min-ngram) are looked up in the text
so far (prompt and reply); after their most recent earlier occurrence, the next B-1 tokens are the
block's drafts (none if nothing matches). The steps greedy speculative decoding takes with these
drafts are counted as `dflash-eval --chain` counts them (train/chain_tau.py), at --max-new-tokens
and at each --windows length. A 135M target's greedy replies often loop past ~100 tokens (bench/
RESULTS.md), where copying is easy: the gap between this baseline and a drafter's tau is what the
drafter learned beyond copying.

    python -m bench.ngram_baseline --target T --prompts eval_prompts.jsonl --limit 32 --max-new-tokens 256 --windows 96
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import torch


def copied_drafts(text: Sequence[int], count: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to `count` drafts after `text`: what followed the most recent earlier occurrence of its
    longest suffix of `max_ngram`..`min_ngram` tokens that occurs earlier ([] if none does)."""
    for n in range(min(max_ngram, len(text) - 1), min_ngram - 1, -1):
        suffix = list(text[-n:])
        for start in range(len(text) - n - 1, -1, -1):  # most recent first, never the suffix itself
            if list(text[start : start + n]) == suffix:
                return list(text[start + n : start + n + count])
    return []


def ngram_matches(prompt: Sequence[int], reply: Sequence[int], max_ngram: int, min_ngram: int):
    """`matches(i, size)` for `chain_accepted`: copied drafts of the block anchored at reply token i
    that equal the reply after it."""
    sequence = [*prompt, *reply]

    def matches(index: int, size: int) -> int:
        end = len(prompt) + index + 1  # the text up to and including the anchor
        drafts = copied_drafts(sequence[:end], size - 1, max_ngram, min_ngram)
        n = 0
        while n < len(drafts) and end + n < len(sequence) and drafts[n] == sequence[end + n]:
            n += 1
        return n

    return matches


def main(argv: list[str] | None = None) -> dict:
    from dflash_pipeline.data.chat import stop_token_ids
    from dflash_pipeline.shared.target.assets import load_tokenizer
    from dflash_pipeline.shared.target.loading import load_full_target
    from dflash_pipeline.train.chain_tau import chain_accepted, greedy_replies
    from dflash_pipeline.train.eval_cli import prompts_from, taus

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", required=True, help="records as dflash-eval --prompts reads them")
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--windows", type=int, nargs="*", default=[], help="also tau at these shorter lengths")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-ngram", type=int, default=4)
    ap.add_argument("--min-ngram", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not 1 <= args.min_ngram <= args.max_ngram:
        ap.error("need 1 <= --min-ngram <= --max-ngram")
    if any(not 1 <= w <= args.max_new_tokens for w in args.windows):
        ap.error("--windows must lie in 1..--max-new-tokens")
    target = load_full_target(args.target, device=torch.device(args.device), dtype=getattr(torch, args.dtype))
    tokenizer = load_tokenizer(args.target)
    stops = stop_token_ids(tokenizer, target.generation_config.eos_token_id)
    prompts = prompts_from(args.prompts, tokenizer, args.limit, 1024)
    replies = greedy_replies(target, prompts, args.max_new_tokens, stops)
    result = {
        "target": args.target,
        "prompts": len(prompts),
        "generated_tokens": sum(map(len, replies)),
        "block_size": args.block_size,
        "ngram": [args.min_ngram, args.max_ngram],
        "windows": {},
    }
    for n in sorted({args.max_new_tokens, *args.windows}, reverse=True):
        accepted = [
            chain_accepted(r, ngram_matches(p, r, args.max_ngram, args.min_ngram), n, args.block_size, stops)
            for p, r in zip(prompts, replies)
        ]
        result["windows"][str(n)] = taus(accepted)
        print(f"n-gram drafter, {n} new tokens: tau {result['windows'][str(n)]['tau']:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
