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


def copy_sources(sequence: Sequence[int], max_ngram: int, min_ngram: int) -> list[int]:
    """`source[end]`: where the copied drafts after `sequence[:end]` start, i.e. the end of the most
    recent earlier occurrence of its longest suffix of `max_ngram`..`min_ngram` tokens (-1: none
    occurs earlier). One pass with an index of each n-gram's last end, so replies of thousands of
    tokens cost milliseconds."""
    last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
    source = [-1] * (len(sequence) + 1)
    for end in range(1, len(sequence) + 1):
        for n in range(min(max_ngram, end), min_ngram - 1, -1):
            earlier = last[n].get(tuple(sequence[end - n : end]))
            if earlier is not None:
                source[end] = earlier
                break
        for n in range(min_ngram, min(max_ngram, end) + 1):  # this end is earlier for every later one
            last[n][tuple(sequence[end - n : end])] = end
    return source


def ngram_matches(prompt: Sequence[int], reply: Sequence[int], max_ngram: int, min_ngram: int):
    """`matches(i, size)` for `chain_accepted`: how many of the size - 1 copied drafts of the block
    anchored at reply token i equal the reply after it (the drafts never reach past the text so far)."""
    sequence = [*prompt, *reply]
    source = copy_sources(sequence, max_ngram, min_ngram)

    def matches(index: int, size: int) -> int:
        end = len(prompt) + index + 1  # the text up to and including the anchor
        start, n = source[end], 0
        if start < 0:
            return 0
        while n < size - 1 and start + n < end and end + n < len(sequence) and sequence[start + n] == sequence[end + n]:
            n += 1
        return n

    return matches


def copy_accepted(
    prompt: Sequence[int], reply: Sequence[int], max_new_tokens: int, block_size: int, stops: set[int], ngram=(2, 4)
) -> list[int]:
    """The copy drafter's greedy verify steps on `reply` (tokens accepted per step, `dflash-eval --chain`'s
    count), drafting with the longest earlier n-gram of `ngram` = (min, max) tokens."""
    from dflash_pipeline.train.chain_tau import chain_accepted

    return chain_accepted(reply, ngram_matches(prompt, reply, ngram[1], ngram[0]), max_new_tokens, block_size, stops)


def main(argv: list[str] | None = None) -> dict:
    from dflash_pipeline.data.chat import stop_token_ids
    from dflash_pipeline.shared.target.assets import load_tokenizer
    from dflash_pipeline.shared.target.loading import load_full_target
    from dflash_pipeline.train.chain_tau import greedy_replies
    from dflash_pipeline.train.eval_cli import EvalConfig, prompts_from, taus

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
    prompts = prompts_from(args.prompts, tokenizer, args.limit, EvalConfig.max_prompt_tokens)
    replies = greedy_replies(target, prompts, args.max_new_tokens, stops)
    result = {
        "target": args.target,
        "prompts": len(prompts),
        "generated_tokens": sum(map(len, replies)),
        "block_size": args.block_size,
        "ngram": [args.min_ngram, args.max_ngram],
        "windows": {},
    }
    ngram = (args.min_ngram, args.max_ngram)
    for n in sorted({args.max_new_tokens, *args.windows}, reverse=True):
        accepted = [copy_accepted(p, r, n, args.block_size, stops, ngram) for p, r in zip(prompts, replies)]
        result["windows"][str(n)] = taus(accepted)
        if n == args.max_new_tokens:
            result["per_prompt"] = [
                {"prompt_tokens": len(p), "new_tokens": len(r), "accepted": a, "target_tokens": r}
                for p, r, a in zip(prompts, replies, accepted)
            ]
        print(f"n-gram drafter, {n} new tokens: tau {result['windows'][str(n)]['tau']:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
