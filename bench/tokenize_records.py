"""Tokenizing conversations for `dflash-extract`: records/s in this process against `--tokenize-processes N`
(`dflash_pipeline.data.tokenize_pool`), on real conversations and a real target's tokenizer and chat
template. The bound is N times the one-process rate measured in the same run (perfect scaling); the
pooled time includes the workers' start.

    python -m bench.tokenize_records --target T --data conversations.jsonl[.xz] --records 4000 --processes 2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench import emit
from bench.regenerate import chat_records


def rate(records: list, tokenizer, max_length: int, processes: int) -> tuple[float, int]:
    """(records/s, tokens) of `tokenize_many` over `records`."""
    from dflash_pipeline.data.tokenize_pool import tokenize_many
    from dflash_pipeline.data.tokens import TokenizedSample

    start = time.perf_counter()
    outcomes = tokenize_many(records, tokenizer, max_length, processes)
    tokens = sum(len(o.input_ids) for o in outcomes if isinstance(o, TokenizedSample))
    return len(records) / (time.perf_counter() - start), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True, help="a folder with the target's tokenizer")
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--records", type=int, default=4000)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--processes", type=int, action="append", required=True)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    records = [record for _, record in chat_records(args.data, args.records)]
    one, tokens = rate(records, tokenizer, args.max_length, 1)
    rows = []
    for n in args.processes:
        pooled, pooled_tokens = rate(records, tokenizer, args.max_length, n)
        assert pooled_tokens == tokens, (pooled_tokens, tokens)
        rows.append(
            {"processes": n, "records_per_s": pooled, "vs_one_process": pooled / one, "of_bound": pooled / (n * one)}
        )
    emit({"records": len(records), "tokens": tokens, "one_process_records_per_s": one, "pooled": rows}, args.json)


if __name__ == "__main__":
    main()
