"""Can a DFlash drafter learn to copy? A synthetic check of the architecture and the trainer's loss.

On a 135M target's greedy replies a drafter that only copies earlier text (bench/ngram_baseline.py)
reaches a higher tau than the drafters trained so far (bench/RESULTS.md). Copying is the simplest thing
a drafter conditioned on the context can learn, so this bench asks whether ours learns it when the data
asks for nothing else: each sequence is a prompt of random tokens and a reply that repeats a span of
it, on the repository's tiny random target. The drafter trains with the trainer's own loss
(`train.step.pack_loss`: position-weighted CE, blocks at random reply positions, the target's features as
context; fresh sequences every step, so nothing can be memorised), and its greedy tau on held-out
sequences is counted by the chain of `dflash-eval --chain`, beside the copy drafter's on the same
sequences (the ceiling for this data: once two reply tokens are known, the rest is in the prompt).

    python -m bench.copy_task --steps 400 --num-layers 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from dflash_pipeline.shared.model.blocks import build_blocks, sample_anchors


def make_sequence(rng: torch.Generator, vocab: int, prompt: int, reply: int) -> torch.Tensor:
    """Random prompt ids, then a reply that repeats a random span of the prompt."""
    ids = torch.randint(4, vocab - 1, (prompt,), generator=rng)
    start = int(torch.randint(0, prompt - reply + 1, (1,), generator=rng))
    return torch.cat([ids, ids[start : start + reply]])


def main(argv: list[str] | None = None) -> dict:
    from bench.ngram_baseline import ngram_matches
    from dflash_pipeline.data.tiny_target import build_tiny_target
    from dflash_pipeline.shared.model.config import DFlashConfig, default_target_layer_ids
    from dflash_pipeline.shared.model.drafter import DFlashDrafter
    from dflash_pipeline.shared.model.target_head import TargetHead
    from dflash_pipeline.shared.target.loading import HiddenStateCapture, load_full_target
    from dflash_pipeline.train.chain_tau import BlockMatches, chain_accepted, sequence_features
    from dflash_pipeline.train.eval_cli import taus
    from dflash_pipeline.train.step import pack_loss

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=96, help="prompt tokens per sequence")
    ap.add_argument("--reply", type=int, default=64, help="reply tokens (a span of the prompt)")
    ap.add_argument("--sequences", type=int, default=4, help="sequences per step (one block at each of 32 anchors)")
    ap.add_argument("--held-out", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--target-hidden", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_target(tmp, hidden=args.target_hidden)
        target = load_full_target(tmp, device=torch.device("cpu"), dtype=torch.float32)
    vocab, B = target.config.vocab_size, args.block_size
    cfg = DFlashConfig.for_target(
        target.config,
        default_target_layer_ids(target.config.num_hidden_layers),
        num_layers=args.num_layers,
        block_size=B,
        mask_token_id=vocab - 1,
    )
    drafter = DFlashDrafter(cfg, attention_backend="sdpa_dense")
    head = TargetHead(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    capture = HiddenStateCapture(target, cfg.target_layer_ids)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.0)
    train_rng, eval_rng = torch.Generator().manual_seed(args.seed + 1), torch.Generator().manual_seed(10**6)
    held_out = [make_sequence(eval_rng, vocab, args.prompt, args.reply) for _ in range(args.held_out)]
    n = args.reply  # every held-out reply decoded whole

    def greedy_tau(matches_of) -> float:
        return taus([chain_accepted(s[args.prompt :].tolist(), matches_of(s), n, B, set()) for s in held_out])["tau"]

    def drafter_tau() -> float:
        drafter.eval()
        tau = greedy_tau(lambda s: BlockMatches(drafter, head, sequence_features(target, capture, s), s, args.prompt))
        drafter.train()
        return tau

    copy_tau = greedy_tau(lambda s: ngram_matches(s[: args.prompt].tolist(), s[args.prompt :].tolist(), 4, 2))
    curve = [{"step": 0, "tau": drafter_tau()}]
    print(f"copy drafter (n-gram) tau {copy_tau:.3f}; untrained drafter tau {curve[0]['tau']:.3f}", flush=True)
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        seqs = [make_sequence(train_rng, vocab, args.prompt, args.reply) for _ in range(args.sequences)]
        ids = torch.cat(seqs)
        S = len(ids)
        doc = torch.arange(args.sequences).repeat_interleave(len(seqs[0]))
        mask = (torch.arange(S) % len(seqs[0])) >= args.prompt
        context = torch.cat([sequence_features(target, capture, s)[0] for s in seqs])
        anchors = sample_anchors(mask, 32 * args.sequences, train_rng, doc=doc)
        blocks = build_blocks(ids, doc, torch.arange(S) % len(seqs[0]), mask, anchors, len(anchors), B, vocab - 1)
        batch = {"context_hidden": context, "context_doc": doc, "context_positions": torch.arange(S) % len(seqs[0])}
        batch = {k: v[None] for k, v in {**batch, **blocks}.items()}
        loss_sum, weight, _ = pack_loss(drafter, head, batch, gamma=7.0)
        optimizer.zero_grad()
        (loss_sum / weight).backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        if step % args.eval_every == 0 or step == args.steps:
            curve.append({"step": step, "loss": float(loss_sum.detach() / weight), "tau": drafter_tau()})
            print(f"step {step}: loss {curve[-1]['loss']:.3f}, tau {curve[-1]['tau']:.3f}", flush=True)
    capture.close()
    result = {
        "copy_tau": copy_tau,
        "curve": curve,
        "train_seconds": time.perf_counter() - started,
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
