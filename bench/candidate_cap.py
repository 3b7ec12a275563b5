"""A drafter's expected sampled tau, with its own q and with q cut to its k best candidates (DFlash-2's support).

Why a drafter accepts what it does at temperature > 0, and what drafting from its k best candidates only (the
DFlash-2 selector's support) caps it at: the expected tau along the target-only replies of a `dflash-eval`
report at temperature > 0 (`target_tokens`, sampled from the target itself).

Speculative sampling keeps a draft drawn from q with probability sum_x min(p(x), q(x)) (the rule of
`speculative._speculative_sample`). At anchors every `--every` reply positions, with a whole block of reply
after each, the drafter drafts the block from the target's features of the text before the anchor, as in
decoding, and p_j is the target's distribution at the block's position j, teacher-forced along the reply; a
step then adds 1 + a_1 + a_1 a_2 + ... tokens on average (a_j: the acceptance at position j). Three q's:
- the drafter's own: DFlash its filtered softmax (what `dflash_generate` samples from), DFlash-2 its
  selector's softmax over its candidates given the reply's previous token;
- the draft distribution cut to its k likeliest tokens and renormalised (a selector with no transition term);
- the bound over those k: p's mass on them, the most any q on k candidates can be accepted.
Later positions are conditioned on the reply's own tokens, not on accepted drafts, so the model is checked
against the report's measured tau in the same output.

    python -m bench.candidate_cap --report eval_dflash_t1_T1_N256.json --drafter RUN/drafter --target T \
        --prompts eval_prompts.jsonl --top-k 16 --top-k 64
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench import emit, report_prompts
from dflash_pipeline.shared.generation.sampling import SamplingParams, filtered_probs
from dflash_pipeline.shared.model.drafter import DFlashDrafter, DrafterCache, DrafterError
from dflash_pipeline.shared.model.loss import SelectorWeights, selector_scores


def acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per row of p, q [n, V]: the probability that a draft drawn from q is kept, sum_x min(p, q)."""
    return torch.minimum(p, q).sum(-1)


def expected_tokens(accept: torch.Tensor) -> float:
    """Tokens a step adds on average, 1 + a_1 + a_1 a_2 + ..., for acceptances `accept` [B-1]."""
    return 1.0 + float(torch.cumprod(accept.double(), 0).sum())


def top_k_cut(q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [n, V] kept on each row's k likeliest tokens and renormalised, the 0/1 mask of those tokens)."""
    keep = torch.zeros_like(q).scatter_(-1, q.topk(k, dim=-1).indices, 1.0)
    cut = q * keep
    return cut / cut.sum(-1, keepdim=True), keep


@dataclass
class Anchor:
    """One block's acceptances per position [B-1]: with the drafter's own q, and per k of the cut q and of the bound."""

    own: torch.Tensor
    cut: dict[int, torch.Tensor] = field(default_factory=dict)
    bound: dict[int, torch.Tensor] = field(default_factory=dict)


@torch.no_grad()
def reply_anchors(
    target,
    drafter: DFlashDrafter,
    capture,
    prompt: list[int],
    reply: list[int],
    sampling: SamplingParams,
    every: int,
    top_ks: list[int],
) -> list[Anchor]:
    """The acceptances of the blocks anchored at reply positions 0, every, ... (module doc): one target
    forward over prompt + reply, then the drafter fed the target's features up to each anchor in turn."""
    block_size = drafter.config.block_size
    device = drafter.fc.weight.device
    dtype = drafter.fc.weight.dtype
    ids = torch.tensor([[*prompt, *reply]], device=device)
    logits = target(input_ids=ids).logits[0]
    features = torch.cat(capture.take(), dim=-1).to(dtype)  # [1, P + R, n_layers * H]
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings().weight.to(dtype)
    scale, mask_id = drafter.config.input_embedding_scale, drafter.config.mask_token_id
    selector = drafter.candidate_selector
    weights = SelectorWeights.of(selector) if selector is not None else None
    cache, fed, out = DrafterCache(), 0, []
    for a in range(0, len(reply) - block_size + 1, every):
        start = len(prompt) + a  # the anchor's position: the block's first token, not yet seen by the target
        block = torch.full((1, block_size), mask_id, dtype=torch.long, device=device)
        block[0, 0] = reply[a]
        hidden = drafter.forward_step(
            features[:, fed:start],
            torch.arange(fed, start, device=device)[None],
            embed(block).to(dtype) * scale,
            torch.arange(start, start + block_size, device=device)[None],
            cache,
        )[:, 1:]
        fed = start
        draft_logits = drafter.compute_logits(hidden, lm_head)[0]  # [B-1, V]
        p = filtered_probs(logits[start : start + block_size - 1], sampling)  # reply tokens a+1 .. a+B-1
        q = filtered_probs(draft_logits, sampling)
        if selector is not None:  # DFlash-2: the selector's q, each position after the reply's previous token
            unary, candidates = torch.topk(draft_logits, selector.top_k, dim=-1, sorted=False)
            previous = torch.tensor(reply[a : a + block_size - 1], device=device)
            scores = selector_scores(weights, hidden[0], unary, candidates, previous)
            own_q = torch.zeros_like(q).scatter_(-1, candidates, torch.softmax(scores / sampling.temperature, -1))
        else:
            own_q = q
        anchor = Anchor(acceptance(p, own_q))
        for k in top_ks:
            cut, keep = top_k_cut(q, k)
            anchor.cut[k], anchor.bound[k] = acceptance(p, cut), (p * keep).sum(-1)
        out.append(anchor)
    return out


def summary(anchors: list[Anchor], top_ks: list[int]) -> dict:
    """Mean expected tokens per step and mean first-position acceptance over `anchors`, per q."""

    def of(rows: list[torch.Tensor]) -> dict[str, float]:
        return {
            "tau": sum(expected_tokens(r) for r in rows) / len(rows),
            "first_acceptance": sum(float(r[0]) for r in rows) / len(rows),
        }

    return {
        "own": of([a.own for a in anchors]),
        "top_k": {
            str(k): {"cut": of([a.cut[k] for a in anchors]), "bound": of([a.bound[k] for a in anchors])} for k in top_ks
        },
    }


def main(argv: list[str] | None = None) -> dict:
    from dflash_pipeline.shared.target.assets import load_tokenizer
    from dflash_pipeline.shared.target.identity import TargetMismatch, check_drafter_fits
    from dflash_pipeline.shared.target.loading import HiddenStateCapture, load_full_target, load_target_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--report", type=Path, required=True, help="dflash-eval --json report at temperature > 0")
    ap.add_argument("--drafter", required=True, help="the report's drafter folder")
    ap.add_argument("--target", required=True, help="the report's target folder")
    ap.add_argument("--prompts", required=True, help="the report's prompts file")
    ap.add_argument("--every", type=int, default=16, help="anchor a block at every this many reply positions")
    ap.add_argument("--top-k", type=int, action="append", help="candidates kept (repeatable; default 16, 64)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    top_ks = sorted(set(args.top_k or [16, 64]))
    if args.every < 1 or top_ks[0] < 1:
        ap.error("--every and --top-k must be >= 1")
    try:
        report = json.loads(args.report.read_text())
        rows, drawn = report["per_prompt"], report["sampling"]
        sampling = SamplingParams(drawn["temperature"], drawn["top_p"], drawn["top_k"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"bench.candidate_cap: {args.report}: not a dflash-eval report ({e})")
    if sampling.greedy or any("target_tokens" not in r for r in rows):
        sys.exit(f"bench.candidate_cap: {args.report}: needs a report at temperature > 0 with target_tokens")
    device = torch.device(args.device)
    try:  # a drafter that cannot read this target's hidden states is refused before the target's weights are read
        drafter = DFlashDrafter.from_pretrained(
            args.drafter, attention_backend="sdpa_dense", device=device, dtype=torch.float32
        ).eval()
        check_drafter_fits(drafter.config, args.drafter, args.target, load_target_config(args.target))
    except (DrafterError, TargetMismatch) as e:
        sys.exit(f"bench.candidate_cap: {e}")
    if drafter.config.block_size != report["block_size"]:
        sys.exit(
            f"bench.candidate_cap: {args.drafter} drafts blocks of {drafter.config.block_size}, the report "
            f"{report['block_size']}"
        )
    if top_ks[-1] > drafter.config.vocab_size:
        sys.exit(f"bench.candidate_cap: --top-k {top_ks[-1]} exceeds the vocabulary of {drafter.config.vocab_size}")
    target = load_full_target(args.target, device=device, dtype=torch.float32)
    try:
        prompts = report_prompts(report, args.prompts, load_tokenizer(args.target), args.target)
    except ValueError as e:
        sys.exit(f"bench.candidate_cap: {e}")
    capture = HiddenStateCapture(target, drafter.config.target_layer_ids)
    anchors = []
    for prompt, row in zip(prompts, rows, strict=True):
        anchors += reply_anchors(target, drafter, capture, prompt, row["target_tokens"], sampling, args.every, top_ks)
    capture.close()
    if not anchors:
        sys.exit(f"bench.candidate_cap: {args.report}: no reply holds a whole block")
    result = {
        "report": str(args.report),
        "drafter": args.drafter,
        "arch": "dflash2" if drafter.candidate_selector is not None else "dflash",
        "sampling": report["sampling"],
        "prompts": len(prompts),
        "anchors": len(anchors),
        "every": args.every,
        "measured_tau": report["tau"],
        "measured_tau_pooled": report.get("tau_pooled"),
        **summary(anchors, top_ks),
    }
    emit(result, args.json)
    cuts = ", ".join(
        f"k={k}: {v['cut']['tau']:.3f} (bound {v['bound']['tau']:.3f})" for k, v in result["top_k"].items()
    )
    print(
        f"{result['arch']} at T={sampling.temperature:g}: measured tau {report['tau']:.3f}; modelled with its own q "
        f"{result['own']['tau']:.3f}, with q cut to its top {cuts} ({len(anchors)} anchors)"
    )
    return result


if __name__ == "__main__":
    main()
