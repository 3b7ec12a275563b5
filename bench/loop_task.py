"""Can a DFlash drafter learn to copy? Conversations whose replies repeat a random phrase, and the
greedy tau a drafter that only copies (bench/ngram_baseline.py) gets on them, for comparison with a
drafter trained on them.

A 135M target's greedy replies loop, and the trained drafters did not accept where copying would
(bench/RESULTS.md). Here every reply is nothing but copying: the user asks for a phrase of 3..10
words drawn from 60 (so no drafter can know the next word without reading the context), the reply
repeats it to ~900 characters. Extract a store from them with any target (the replies are stored
as given), train a drafter on it, and read its held-out tau against `copy-tau` on the same store.

    python -m bench.loop_task write --out loops.jsonl --conversations 700
    dflash-extract --target T --data loops.jsonl --out store ...; dflash-train --store store ...
    python -m bench.loop_task copy-tau --store store
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from bench import emit

WORDS = (
    "apple river stone cloud green quick table window silver garden market yellow ocean paper bridge candle "
    "forest mirror pencil rocket summer thunder velvet winter button castle dragon engine falcon harbor island "
    "jacket kettle ladder meadow needle orange pillow quartz ribbon saddle tunnel umbrella valley wagon zipper "
    "anchor basket copper desert feather glacier hammer insect jungle lantern marble nickel oyster parrot"
).split()


def loop_conversations(n: int, seed: int, reply_chars: int = 900) -> list[dict]:
    """`n` records: the user asks for a random phrase again and again, the reply repeats it."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        phrase = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))
        reply = ", ".join([phrase] * max(2, reply_chars // (len(phrase) + 2)))
        messages = [
            {"role": "user", "content": f"Say '{phrase}' again and again."},
            {"role": "assistant", "content": reply},
        ]
        rows.append({"messages": messages})
    return rows


def copy_tau(store: Path, block_size: int, max_ngram: int, min_ngram: int) -> dict:
    """The copy drafter's greedy tau along each stored sample's reply (its loss-masked span, the
    prompt before it), counted as `dflash-eval --chain` counts steps."""
    import numpy as np

    from bench.ngram_baseline import ngram_matches
    from dflash_pipeline.shared.store.reader import FeatureStore
    from dflash_pipeline.train.chain_tau import chain_accepted
    from dflash_pipeline.train.eval_cli import taus

    features = FeatureStore(store)
    accepted = []
    for i in range(len(features)):
        sample = features[i]
        ids, mask = sample.input_ids.tolist(), sample.loss_mask.numpy().astype(bool)
        first, last = int(np.argmax(mask)), len(mask) - int(np.argmax(mask[::-1]))
        prompt, reply = ids[:first], ids[first:last]
        matches = ngram_matches(prompt, reply, max_ngram, min_ngram)
        accepted.append(chain_accepted(reply, matches, len(reply), block_size, set()))
    return {"store": str(store), "samples": len(accepted), "block_size": block_size, **taus(accepted)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="the conversations as JSONL")
    w.add_argument("--out", type=Path, required=True)
    w.add_argument("--conversations", type=int, default=700)
    w.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("copy-tau", help="the copy drafter's tau on a store's replies")
    c.add_argument("--store", type=Path, required=True)
    c.add_argument("--block-size", type=int, default=16)
    c.add_argument("--max-ngram", type=int, default=4)
    c.add_argument("--min-ngram", type=int, default=2)
    c.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.command == "write":
        rows = loop_conversations(args.conversations, args.seed)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
        result = {"out": str(args.out), "conversations": len(rows)}
        print(json.dumps(result))
        return result
    from dflash_pipeline.shared.runtime.errors import UserError

    try:
        result = copy_tau(args.store, args.block_size, args.max_ngram, args.min_ngram)
    except UserError as e:  # not a store, or an incomplete one: the store's own one-line reason
        sys.exit(f"bench.loop_task: {e}")
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
