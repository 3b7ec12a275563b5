"""What a target's sampled replies leave to any drafter: how spread its next-token distributions are along
its temperature-1 replies (those a `dflash-eval` report holds, `target_tokens` of its target-only decoding)
and along its greedy replies, and the T=1 tau of an oracle drafter that drafts the target's own greedy
continuation.

The oracle knows the target exactly but drafts one block at a time, as a parallel drafter does: after
the block's first token (the last one produced) it proposes the next B-1 tokens of the target's greedy
continuation. The reference's sampled acceptance takes a one-hot proposal x with probability p(x), so
its drafted token j is kept with the target's max probability m_j after the ones before it, and a step
adds 1 + m_1 + m_1 m_2 + ... + m_1...m_{B-1} tokens on average. Averaged over anchors every `--every`
reply positions of the T=1 replies, that is the oracle's tau. A trained drafter samples its proposals,
so it can beat a one-hot one on spread distributions; the oracle's tau says how far knowing the greedy
path goes, the statistics how spread the paths are.

    python -m bench.oracle_drafter --report eval_dflash2_t1_T1_N256.json --target T --prompts eval_prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

from bench import emit, report_prompts
from dflash_pipeline.shared.generation.speculative import cache_kwarg, truncate_cache


def distribution_stats(logits: torch.Tensor, tokens: torch.Tensor) -> dict[str, float]:
    """Sums over positions of the entropy (nats), the max probability and the probability of the token
    that followed, for `logits` [n, V] predicting `tokens` [n]."""
    logp = torch.log_softmax(logits.float(), -1)
    p = logp.exp()
    return {
        "entropy": float(-(p * logp).sum(-1).sum()),
        "max_p": float(p.max(-1).values.sum()),
        "p_token": float(p.gather(1, tokens[:, None]).sum()),
    }


@torch.no_grad()
def oracle_counts(model, prompt: list[int], reply: list[int], block_size: int, every: int) -> list[float]:
    """The oracle's expected tokens per step (module doc) at anchors 0, every, 2 every, ... of `reply`
    (the anchor is the block's first token; replies are teacher-forced after `prompt`). One forward over
    the whole text, then per anchor, latest first, the cache cut back to the anchor and B-2 greedy steps."""
    device = next(model.parameters()).device
    ids = torch.tensor([[*prompt, *reply]], device=device)
    cache = DynamicCache()
    kv = {cache_kwarg(model): cache}
    logits = model(ids, use_cache=True, **kv).logits[0]
    counts = []
    for anchor in range(0, len(reply), every)[::-1]:
        end = len(prompt) + anchor + 1  # the text through the anchor
        truncate_cache(cache, end)
        probs = torch.softmax(logits[end - 1].float(), -1)
        kept, count = 1.0, 1.0
        for j in range(block_size - 1):
            m, token = probs.max(-1)
            kept *= float(m)
            count += kept
            if j < block_size - 2:
                step = model(token.view(1, 1), use_cache=True, **kv).logits[0, -1]
                probs = torch.softmax(step.float(), -1)
        counts.append(count)
    return counts[::-1]


@torch.no_grad()
def reply_stats(model, prompts: list[list[int]], replies: list[list[int]]) -> dict[str, float | int]:
    """Mean entropy, max probability and probability of the reply's own token over all reply positions
    (the first reply token predicted by the prompt's last position)."""
    device = next(model.parameters()).device
    sums = {"entropy": 0.0, "max_p": 0.0, "p_token": 0.0}
    n = 0
    for prompt, reply in zip(prompts, replies, strict=True):
        if not reply:
            continue
        ids = torch.tensor([[*prompt, *reply]], device=device)
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
        for k, v in distribution_stats(logits, ids[0, len(prompt) :]).items():
            sums[k] += v
        n += len(reply)
    return {"positions": n, **{f"mean_{k}": (v / n if n else None) for k, v in sums.items()}}


def main(argv: list[str] | None = None) -> dict:
    from dflash_pipeline.data.chat import stop_token_ids
    from dflash_pipeline.shared.target.assets import load_tokenizer
    from dflash_pipeline.shared.target.loading import load_full_target
    from dflash_pipeline.train.chain_tau import greedy_replies

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--report", type=Path, required=True, help="dflash-eval --json report at temperature 1")
    ap.add_argument("--target", required=True, help="the report's target folder")
    ap.add_argument("--prompts", required=True, help="the report's prompts file")
    ap.add_argument("--every", type=int, default=16, help="anchor the oracle at every this many reply positions")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.every < 1:
        ap.error("--every must be >= 1")
    try:
        report = json.loads(args.report.read_text())
        rows, block_size, max_new = report["per_prompt"], report["block_size"], report["max_new_tokens"]
        temperature = report["sampling"]["temperature"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"bench.oracle_drafter: {args.report}: not a dflash-eval report ({e})")
    if temperature != 1.0 or any("target_tokens" not in r for r in rows):
        sys.exit(f"bench.oracle_drafter: {args.report}: needs a temperature-1 report with target_tokens")
    target = load_full_target(args.target, device=torch.device(args.device), dtype=torch.float32)
    tokenizer = load_tokenizer(args.target)
    try:
        prompts = report_prompts(report, args.prompts, tokenizer, args.target)
    except ValueError as e:
        sys.exit(f"bench.oracle_drafter: {e}")
    sampled = [r["target_tokens"] for r in rows]
    stops = stop_token_ids(tokenizer, target.generation_config.eos_token_id)
    greedy = greedy_replies(target, prompts, max_new, stops)
    counts = [c for p, r in zip(prompts, sampled) for c in oracle_counts(target, p, r, block_size, args.every)]
    result = {
        "report": str(args.report),
        "prompts": len(prompts),
        "block_size": block_size,
        "every": args.every,
        "drafter_tau": report["tau"],
        "oracle_anchors": len(counts),
        "oracle_tau": sum(counts) / len(counts) if counts else None,
        "t1_replies": reply_stats(target, prompts, sampled),
        "greedy_replies": reply_stats(target, prompts, greedy),
    }
    emit(result, args.json)
    t1, g = result["t1_replies"], result["greedy_replies"]
    print(
        f"T=1 replies: entropy {t1['mean_entropy']:.2f} nats, max p {t1['mean_max_p']:.3f} ({t1['positions']:,} "
        f"positions); greedy replies: entropy {g['mean_entropy']:.2f}, max p {g['mean_max_p']:.3f}; T=1 tau of the "
        f"greedy-path oracle {result['oracle_tau']:.3f} ({len(counts)} anchors), of the report's drafter {report['tau']:.3f}"
    )
    return result


if __name__ == "__main__":
    main()
