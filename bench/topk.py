"""The DFlash-2 selector's top-k over the draft logits: `torch.topk` against an exact two-stage top-k.

In the compiled DFlash-2 training step on an H100, `aten::topk` over SmolLM2's 49,152-token vocabulary
was the largest kernel: 4 calls (two 2,048-row chunks, forward and checkpointed recompute), 4.7 ms of
the step's 15.9 ms of GPU work (bench/RESULTS.md), reading 0.4 GB a call at ~10% of the copy bandwidth.
The two-stage form takes the top k of each group of `group` vocabulary entries, then the top k of
those candidates: the same k values (every global top-k entry is in its group's top k), sorted. The
bound is one read of the logits at the device-to-device copy bandwidth measured in the same run.

    python -m bench.topk --vocab 49152 --vocab 151936 --group 512 --group 1024 --group 4096
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

from bench import emit
from bench.regenerate import copy_bandwidth
from bench.train import seconds_per_call


def two_stage_topk(logits: torch.Tensor, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the top `k` of each row of [R, V] `logits`, sorted descending, as
    `torch.topk` gives them (among tied values the indices may differ)."""
    rows, vocab = logits.shape
    padded = -(-vocab // group) * group
    grouped = F.pad(logits, (0, padded - vocab), value=float("-inf")) if padded != vocab else logits
    values, local = grouped.view(rows, padded // group, group).topk(k, dim=-1, sorted=False)
    offsets = torch.arange(0, padded, group, device=logits.device)[None, :, None]
    best, pick = values.flatten(1).topk(k, dim=-1)
    return best, (local + offsets).flatten(1).gather(1, pick)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2048, help="rows per call (the selector loss's chunk_tokens)")
    ap.add_argument("--vocab", type=int, action="append", help="[default: 49152, SmolLM2's]")
    ap.add_argument("--k", type=int, default=16, help="dflash-train --selector-top-k")
    ap.add_argument("--group", type=int, action="append", help="[default: 1024]")
    ap.add_argument("--repeats", type=int, default=30, help="timed calls of each")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    copy_bps = copy_bandwidth(device)
    rows = []
    for vocab in args.vocab or [49152]:
        logits = torch.randn(args.rows, vocab, device=device, generator=torch.Generator(device).manual_seed(vocab))
        want = logits.topk(args.k, dim=-1)
        base = seconds_per_call(functools.partial(logits.topk, args.k, dim=-1), args.repeats)
        bound = logits.numel() * logits.element_size() / copy_bps
        row = {"vocab": vocab, "torch_topk_s": base, "bound_s": bound, "torch_of_bound": bound / base, "two_stage": []}
        for group in args.group or [1024]:
            values, indices = two_stage_topk(logits, args.k, group)
            exact = torch.equal(values, want.values) and torch.equal(logits.gather(1, indices), want.values)
            took = seconds_per_call(functools.partial(two_stage_topk, logits, args.k, group), args.repeats)
            row["two_stage"].append(
                {"group": group, "exact": exact, "seconds": took, "vs_torch": base / took, "of_bound": bound / took}
            )
        rows.append(row)
    result = {"device": str(device), "rows": args.rows, "k": args.k, "copy_bytes_per_s": copy_bps, "shapes": rows}
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
