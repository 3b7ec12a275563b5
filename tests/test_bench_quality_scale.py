"""bench/quality_scale.py's stages at toy size on CPU (a tiny random target): a second store built from
the first one's replies, training on a named store, evaluations several at a time, the report; and
bench/scale_plan.sh, which runs the stages of a plan file against deadlines. The tests marked slow
share one run of the stages' CLIs as processes (~35 s on 2 cores)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.quality_scale import conversation_prompts, main, parse, run_summary

REPO = Path(__file__).resolve().parents[1]


def chat(*users: str) -> dict:
    turns = [t for u in users for t in ({"from": "human", "value": u}, {"from": "gpt", "value": "a reply"})]
    return {"id": users[0][:8], "conversations": turns}


def stage(*argv: str) -> subprocess.CompletedProcess:
    """One stage as a user runs it: its own process, the output kept."""
    return subprocess.run(
        [sys.executable, "-m", "bench.quality_scale", *argv], cwd=REPO, capture_output=True, text=True
    )


def run_ok(*argv: str) -> str:
    done = stage(*argv)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def scale_run(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path) -> SimpleNamespace:
    """A bf16 store, an fp8 store of its replies, a drafter trained on each (`on_fp8` on fp8, `on_bf16`
    on the default store) and both evaluated at T=0 two at a time; the stages' outputs kept."""
    root = tmp_path_factory.mktemp("quality_scale")
    records = [
        chat("Write a python function that sorts a list", "Now make it faster please, in place"),
        chat("Tell me about the history of the Roman empire"),
        chat("What is the capital of France and why?", "And of Italy?"),
        chat("Give me three tips for sleeping better at night"),
        chat("Explain photosynthesis to a ten year old child"),
        chat("Debug this javascript code that throws a TypeError"),
        chat("Solve the equation 3x + 4 = 19 for x, step by step"),
        chat("Write a short poem about autumn leaves falling"),
        chat("What should I pack for a week of hiking in the Alps?"),
    ]
    source = root / "sharegpt.json"
    source.write_text(json.dumps(records))
    prompts, out = root / "prompts", root / "run"
    conversation_prompts(prompts, 5, 1, source)
    where = ["--out", str(out), "--prompts", str(prompts), "--device", "cpu"]
    regen = [*where, "--target", str(tiny_target_dir), "--max-new-tokens", "8", "--max-length", "256"]
    train = [*where, "--num-layers", "1", "--steps", "1", "--eval-every", "1", "--eval-samples", "1"]
    logs = {
        "bf16": run_ok("regenerate", *regen),
        "fp8": run_ok(
            "regenerate", *regen, "--store", "fp8", "--store-dtype", "float8_e4m3fn", "--replies-from", "store"
        ),
    }
    run_ok(
        "train",
        *train,
        "--name",
        "on_fp8",
        "--store",
        "fp8",
        "--num-blocks",
        "8",
        "--no-eval-decode",
        "--checkpoint-every",
        "3",
    )
    run_ok("train", *train, "--name", "on_bf16")
    evaluate = [*where, "--target", str(tiny_target_dir), "--limit", "2", "--max-new-tokens", "8"]
    logs["evaluate"] = run_ok("evaluate", *evaluate, "--temperature", "0", "--parallel", "2")
    report = json.loads(run_ok("report", *where[:4]))
    return SimpleNamespace(out=out, prompts=prompts, target=tiny_target_dir, logs=logs, report=report)


@pytest.mark.slow
def test_second_store_reuses_the_first_stores_replies(scale_run: SimpleNamespace) -> None:
    from dflash_pipeline.shared.store.reader import FeatureStore

    assert "0 reused from an earlier run" in scale_run.logs["bf16"]
    assert "5 reused from an earlier run" in scale_run.logs["fp8"]
    assert "nothing generated now" in scale_run.logs["fp8"]
    bf16, fp8 = FeatureStore(scale_run.out / "store"), FeatureStore(scale_run.out / "fp8")
    assert (bf16.manifest.hidden_dtype, fp8.manifest.hidden_dtype) == ("bfloat16", "float8_e4m3fn")
    assert len(bf16) == len(fp8) == 5
    for i in range(len(bf16)):
        assert bf16[i].input_ids.tolist() == fp8[i].input_ids.tolist()
        assert bf16[i].loss_mask.tolist() == fp8[i].loss_mask.tolist()
    stores = scale_run.report["stores"]
    assert stores["fp8"]["counts"]["regenerated"]["reused"] == 5
    assert {name: (s["complete"], s["hidden_dtype"], s["store_topk"]) for name, s in stores.items()} == {
        "store": (True, "bfloat16", 0),
        "fp8": (True, "float8_e4m3fn", 0),
    }
    assert all(s["shard_bytes_per_token"] > 0 for s in stores.values())
    assert all(
        s["regenerate"]["method"] == "greedy" and s["regenerate"]["max_new_tokens"] == 8 for s in stores.values()
    )


@pytest.mark.slow
def test_replies_from_needs_a_complete_store_with_the_same_reply_settings(
    scale_run: SimpleNamespace, tmp_path: Path
) -> None:
    shutil.copytree(scale_run.out / "store", tmp_path / "store")
    where = ["--out", str(tmp_path), "--prompts", str(scale_run.prompts), "--device", "cpu"]
    where += ["--target", str(scale_run.target), "--max-length", "256"]
    with pytest.raises(SystemExit) as missing:
        main(["regenerate", *where, "--store", "other", "--replies-from", "nope"])
    assert (
        str(missing.value.code)
        == f"quality_scale regenerate: --replies-from nope: no {tmp_path / 'nope' / 'regenerated'}"
    )
    assert not (tmp_path / "other").exists()
    shutil.copytree(tmp_path / "store", tmp_path / "half")
    manifest = json.loads((tmp_path / "half" / "manifest.json").read_text())
    (tmp_path / "half" / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    with pytest.raises(SystemExit, match="--replies-from half: store half is not complete; regenerate it first"):
        main(["regenerate", *where, "--store", "other", "--replies-from", "half"])
    assert not (tmp_path / "other").exists()
    # a train line after a regenerate line cut at its deadline: one line, nothing trained
    train = ["train", "--out", str(tmp_path), "--prompts", str(scale_run.prompts), "--device", "cpu", "--name", "d"]
    with pytest.raises(SystemExit, match="^quality_scale train d: store half is not complete; regenerate it first"):
        main([*train, "--store", "half"])
    with pytest.raises(SystemExit) as absent:
        main([*train, "--store", "never"])
    assert str(absent.value.code) == f"quality_scale train d: no store in {tmp_path / 'never'}; regenerate it first"
    assert not (tmp_path / "d").exists()
    # the copy carries the source's settings: dflash-extract names the one that differs
    done = stage("regenerate", *where, "--store", "longer", "--replies-from", "store", "--max-new-tokens", "9")
    assert done.returncode != 0
    assert "holds a store made with other settings" in done.stderr
    assert "data.regenerate.max_new_tokens: 8 -> 9" in done.stderr


@pytest.mark.slow
def test_a_store_built_elsewhere_from_its_packed_replies_generates_none(
    scale_run: SimpleNamespace, tmp_path: Path
) -> None:
    """`pack-replies` then `regenerate --replies-archive` in another run folder (another machine's): the
    same conversations, none generated; a missing or foreign archive is one line and no store."""
    from dflash_pipeline.shared.store.reader import FeatureStore

    archive = tmp_path / "replies.tar.xz"
    packed = run_ok("pack-replies", "--out", str(scale_run.out), "--store", "fp8", "--archive", str(archive))
    assert f"pack-replies: {archive} (" in packed and archive.stat().st_size > 0
    out, target = tmp_path / "elsewhere", tmp_path / "target"  # the same target, at another path
    shutil.copytree(scale_run.target, target)
    where = ["--out", str(out), "--prompts", str(scale_run.prompts), "--device", "cpu"]
    where += ["--target", str(target), "--max-new-tokens", "8", "--max-length", "256"]
    log = run_ok("regenerate", *where, "--replies-archive", str(archive))
    assert "5 reused from an earlier run" in log and "nothing generated now" in log
    source, rebuilt = FeatureStore(scale_run.out / "fp8"), FeatureStore(out / "store")
    assert (source.manifest.hidden_dtype, rebuilt.manifest.hidden_dtype) == ("float8_e4m3fn", "bfloat16")
    assert len(rebuilt) == len(source) == 5
    for i in range(len(source)):
        assert rebuilt[i].input_ids.tolist() == source[i].input_ids.tolist()
        assert rebuilt[i].loss_mask.tolist() == source[i].loss_mask.tolist()
    # the manifest says where this store's data and target are
    assert rebuilt.manifest.data["paths"] == [str(out / "train_conversations.jsonl")]
    assert rebuilt.manifest.target["location"] == str(target.resolve())
    with pytest.raises(SystemExit) as missing:
        main(["regenerate", *where, "--store", "other", "--replies-archive", "nope.tar.xz"])
    assert str(missing.value.code) == f"--replies-archive {scale_run.prompts / 'nope.tar.xz'}: no such file"
    (tmp_path / "junk.tar.xz").write_bytes(b"not an archive")
    with pytest.raises(SystemExit, match=r"^--replies-archive .*junk.tar.xz: unreadable \("):
        main(["regenerate", *where, "--store", "other", "--replies-archive", str(tmp_path / "junk.tar.xz")])
    assert not (out / "other").exists() and not (out / "other.partial").exists()


@pytest.mark.slow
def test_train_uses_the_named_store(scale_run: SimpleNamespace) -> None:
    runs = scale_run.report["runs"]
    assert {name: (r["store"], r["store_dtype"], r["loss"]) for name, r in runs.items()} == {
        "on_fp8": ("fp8", "float8_e4m3fn", "ce"),
        "on_bf16": ("store", "bfloat16", "ce"),
    }
    config = json.loads((scale_run.out / "on_fp8" / "train_config.json").read_text())
    assert (config["store"], config["num_blocks"]) == (str(scale_run.out / "fp8"), 8)
    bf16_config = json.loads((scale_run.out / "on_bf16" / "train_config.json").read_text())
    assert bf16_config["num_blocks"] == 256
    assert (config["eval_decode"], bf16_config["eval_decode"]) == (False, True)
    assert (config["checkpoint_every"], bf16_config["checkpoint_every"]) == (3, 1)  # --eval-every's by default
    # the learning curve's points carry the seconds each evaluation took
    assert all(p["eval_s"] > 0 for run in runs.values() for p in run["curve"])
    # the learning curve carries both held-out acceptances, or the drawn-anchor one alone
    assert runs["on_bf16"]["curve"] and all(
        p["tau_decode"] >= 1 and p["offline_tau"] >= 1 for p in runs["on_bf16"]["curve"]
    )
    assert runs["on_fp8"]["curve"] and all("tau_decode" not in p for p in runs["on_fp8"]["curve"])


@pytest.mark.slow
def test_train_passes_the_selectors_candidates_on(scale_run: SimpleNamespace, monkeypatch) -> None:
    from bench import quality_scale

    commands = []
    monkeypatch.setattr(quality_scale, "run_step", lambda _name, cmd: commands.append(cmd))
    monkeypatch.setattr(quality_scale, "timed", lambda _record, _name, stage: stage())  # the run's record untouched
    line = ["train", "--out", str(scale_run.out), "--device", "cpu", "--name", "k", "--arch", "dflash2"]
    for extra in (["--selector-top-k", "64"], []):
        quality_scale.train(parse(line + extra))
    with_k, without = commands
    assert with_k[with_k.index("--selector-top-k") + 1] == "64" and "--selector-top-k" not in without


def test_regenerate_passes_the_generation_batch_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.quality_scale as quality_scale

    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps([chat("Write a python function that sorts a list"), chat("Tell me a story")]))
    conversation_prompts(tmp_path / "prompts", 1, 1, source)
    commands = []
    monkeypatch.setattr(quality_scale, "run_step", lambda name, cmd: commands.append(cmd))
    where = ["--out", str(tmp_path / "run"), "--prompts", str(tmp_path / "prompts"), "--target", "t"]
    main(["regenerate", *where, "--gen-batch-size", "64"])
    main(["regenerate", *where])
    given, default = commands
    assert given[given.index("--gen-batch-size") + 1] == "64"
    assert "--gen-batch-size" not in default  # dflash-extract's own default


@pytest.mark.slow
def test_evaluations_run_two_at_a_time_and_say_so(scale_run: SimpleNamespace) -> None:
    out = scale_run.out
    assert sorted(p.name for p in out.glob("eval_*.json")) == ["eval_on_bf16_T0_N8.json", "eval_on_fp8_T0_N8.json"]
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["eval_on_bf16_T0_N8.log", "eval_on_fp8_T0_N8.log"]
    finished = [line for line in scale_run.logs["evaluate"].splitlines() if ": tau " in line]
    assert sorted(line.split(":")[0] for line in finished) == ["evaluate on_bf16 T=0 N=8", "evaluate on_fp8 T=0 N=8"]
    seconds = json.loads((out / "seconds.json").read_text())
    assert "evaluate (2 at a time)" in seconds and not any(k.startswith("evaluate on_") for k in seconds)
    rows = {row["run"]: row for row in scale_run.report["evaluations"]}
    assert {run: (row["concurrent"], row["temperature"], row["max_new_tokens"]) for run, row in rows.items()} == {
        "on_fp8": (2, 0.0, 8),
        "on_bf16": (2, 0.0, 8),
    }
    assert all(row["all_lossless"] for row in rows.values())
    assert all(row["tau_pooled_first96"] >= 1 for row in rows.values())  # 8 new tokens: no step after 96
    assert all(row["tau_pooled_after96"] is None for row in rows.values())


@pytest.mark.slow
def test_a_failed_evaluation_fails_the_stage_after_the_others(scale_run: SimpleNamespace, tmp_path: Path) -> None:
    shutil.copytree(scale_run.out / "on_fp8" / "drafter", tmp_path / "good" / "drafter")
    (tmp_path / "broken" / "drafter").mkdir(parents=True)
    (tmp_path / "broken" / "drafter" / "config.json").write_text("{}")
    evaluate = ["--out", str(tmp_path), "--prompts", str(scale_run.prompts), "--device", "cpu"]
    evaluate += ["--target", str(scale_run.target), "--limit", "1", "--max-new-tokens", "8", "--temperature", "0"]
    done = stage("evaluate", *evaluate, "--parallel", "2", "--runs", "broken", "--runs", "good")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == "quality_scale evaluate: 1 of 2 failed: broken T=0 N=8"
    assert "evaluate broken T=0 N=8: failed (exit code " in done.stdout
    assert "evaluate good T=0 N=8: tau " in done.stdout
    assert (tmp_path / "eval_good_T0_N8.json").exists() and not (tmp_path / "eval_broken_T0_N8.json").exists()
    assert list(json.loads((tmp_path / "evaluations.json").read_text())) == ["eval_good_T0_N8.json"]
    with pytest.raises(SystemExit, match="--runs nothing: no drafter"):
        main(["evaluate", *evaluate, "--runs", "nothing"])


@pytest.mark.slow
def test_a_run_cut_before_its_final_drafter_is_evaluated_at_its_latest_checkpoint(
    scale_run: SimpleNamespace, tmp_path: Path
) -> None:
    """A train line cut at its deadline leaves checkpoints and no final drafter: evaluate takes the
    latest checkpoint, names the report by its step (a later one is a new report) and the report row
    says which run and step it was."""
    shutil.copytree(scale_run.out / "on_bf16" / "checkpoints", tmp_path / "cut" / "checkpoints")
    evaluate = ["--out", str(tmp_path), "--prompts", str(scale_run.prompts), "--device", "cpu", "--limit", "1"]
    evaluate += ["--target", str(scale_run.target), "--max-new-tokens", "8", "--temperature", "0"]
    done = stage("evaluate", *evaluate, "--runs", "cut")
    assert done.returncode == 0, done.stderr
    assert "evaluate cut_S1 T=0 N=8: tau " in done.stdout
    report = json.loads((tmp_path / "eval_cut_S1_T0_N8.json").read_text())
    assert Path(report["drafter"]) == tmp_path / "cut" / "checkpoints" / "step-00000001"
    row = json.loads(stage("report", "--out", str(tmp_path), "--prompts", str(scale_run.prompts)).stdout)
    assert [(r["run"], r["drafter_step"]) for r in row["evaluations"]] == [("cut", 1)]


@pytest.mark.slow
def test_sharded_evaluations_merge_and_a_rerun_finishes_a_cut_shard(scale_run: SimpleNamespace, tmp_path: Path) -> None:
    """`evaluate --shards 2`: two dflash-eval split the prompts, their reports (shards/) merge into the
    evaluation's, with the counts one process decoded and the domains of the prompts each row is of; a
    shard cut short leaves the merged report incomplete, and a rerun resumes that shard alone."""
    from dflash_pipeline.train.eval_cli import merge_reports

    shutil.copytree(scale_run.out / "on_bf16" / "drafter", tmp_path / "on_bf16" / "drafter")
    evaluate = ["--out", str(tmp_path), "--prompts", str(scale_run.prompts), "--device", "cpu", "--limit", "4"]
    evaluate += ["--target", str(scale_run.target), "--max-new-tokens", "8", "--temperature", "0", "--shards", "2"]
    done = stage("evaluate", *evaluate, "--parallel", "2")
    assert done.returncode == 0, done.stderr
    assert "evaluate on_bf16 T=0 N=8 (2 shards): tau " in done.stdout
    parts = [tmp_path / "shards" / f"eval_on_bf16_T0_N8.{i}of2.json" for i in range(2)]
    merged = json.loads((tmp_path / "eval_on_bf16_T0_N8.json").read_text())
    whole = json.loads((scale_run.out / "eval_on_bf16_T0_N8.json").read_text())  # one process, --limit 2

    def decoded(rows: list[dict]) -> list[tuple]:
        return [(r["prompt_index"], r["dflash_tokens"], r["accepted"]) for r in rows]

    assert decoded(merged["per_prompt"][:2]) == decoded(whole["per_prompt"])
    assert (merged["complete"], merged["num_prompts"], merged["shards"], merged["all_lossless"]) == (True, 4, 2, True)
    index = json.loads((tmp_path / "evaluations.json").read_text())
    assert index == {
        "eval_on_bf16_T0_N8.json": {
            "concurrent": 2,
            "seconds": index["eval_on_bf16_T0_N8.json"]["seconds"],
            "shards": 2,
        }
    }
    domains = json.loads((scale_run.prompts / "eval_domains.json").read_text())
    assert len(set(domains)) == 4  # one prompt of each: a row's domain is told by its prompt alone
    cut = json.loads(parts[0].read_text())  # shard 0 (prompts 0 and 2) as if stopped after its first
    cut["per_prompt"], cut["num_prompts"], cut["complete"] = cut["per_prompt"][:1], 1, False
    parts[0].write_text(json.dumps(cut))
    (tmp_path / "eval_on_bf16_T0_N8.json").write_text(
        json.dumps(merge_reports([cut, json.loads(parts[1].read_text())]))
    )
    row = json.loads(stage("report", "--out", str(tmp_path), "--prompts", str(scale_run.prompts)).stdout)
    row = row["evaluations"][0]
    assert (row["prompts"], row["complete"], row["shards"]) == (3, False, 2)
    present = {domains[0], domains[1], domains[3]}  # prompt 2 is not decoded
    assert {d for d in ("code", "math", "writing", "other") if row[f"tau_{d}"] is not None} == present
    rerun = stage("evaluate", *evaluate, "--parallel", "2")
    assert rerun.returncode == 0, rerun.stderr
    assert [line.split(":")[0] for line in rerun.stdout.splitlines() if ": tau " in line] == [
        "evaluate on_bf16 T=0 N=8 shard 0/2",
        "evaluate on_bf16 T=0 N=8 (2 shards)",
    ]
    commands = [
        [line for line in (tmp_path / "logs" / f"{part.stem}.log").read_text().splitlines() if "eval_cli" in line]
        for part in parts
    ]
    assert [[c.endswith(f"--resume --shards 2 --shard {i}") for c in cs] for i, cs in enumerate(commands)] == [
        [False, True],
        [False],
    ]
    again = json.loads((tmp_path / "eval_on_bf16_T0_N8.json").read_text())
    assert decoded(again["per_prompt"]) == decoded(merged["per_prompt"]) and again["complete"]
    assert again["per_prompt"][0] == merged["per_prompt"][0]  # the cut shard's prompt kept, timings too


@pytest.mark.slow
def test_a_larger_limit_extends_a_complete_evaluation(scale_run: SimpleNamespace, tmp_path: Path) -> None:
    """A line with a larger --limit than a complete report's decodes only the prompts it lacks (dflash-eval
    --resume); the same --limit again runs nothing."""
    shutil.copytree(scale_run.out / "on_bf16" / "drafter", tmp_path / "on_bf16" / "drafter")
    evaluate = ["--out", str(tmp_path), "--prompts", str(scale_run.prompts), "--device", "cpu"]
    evaluate += ["--target", str(scale_run.target), "--max-new-tokens", "8", "--temperature", "0"]
    assert stage("evaluate", *evaluate, "--limit", "1").returncode == 0
    report = tmp_path / "eval_on_bf16_T0_N8.json"
    first = json.loads(report.read_text())["per_prompt"]
    extended = stage("evaluate", *evaluate, "--limit", "2")
    assert extended.returncode == 0, extended.stderr
    assert "evaluate on_bf16 T=0 N=8: tau " in extended.stdout
    log = (tmp_path / "logs" / "eval_on_bf16_T0_N8.log").read_text()
    assert [line.endswith("--resume") for line in log.splitlines() if "eval_cli" in line] == [False, True]
    rows = json.loads(report.read_text())["per_prompt"]
    whole = json.loads((scale_run.out / "eval_on_bf16_T0_N8.json").read_text())["per_prompt"]  # --limit 2 at once
    assert rows[0] == first[0] and len(rows) == 2
    assert [(r["dflash_tokens"], r["accepted"]) for r in rows] == [(r["dflash_tokens"], r["accepted"]) for r in whole]
    again = stage("evaluate", *evaluate, "--limit", "2")
    assert again.returncode == 0 and "== evaluate" not in again.stdout
    sharded = [*evaluate, "--shards", "2", "--parallel", "2"]
    sharded[1] = str(tmp_path / "sharded")
    shutil.copytree(tmp_path / "on_bf16", tmp_path / "sharded" / "on_bf16")
    assert stage("evaluate", *sharded, "--limit", "2").returncode == 0  # one prompt a shard
    merged = tmp_path / "sharded" / "eval_on_bf16_T0_N8.json"
    before = json.loads(merged.read_text())["per_prompt"]
    extended = stage("evaluate", *sharded, "--limit", "4")  # two a shard: each shard resumed
    assert extended.returncode == 0, extended.stderr
    after = json.loads(merged.read_text())
    assert (after["num_prompts"], after["complete"]) == (4, True)
    assert [r["prompt_index"] for r in after["per_prompt"]] == [0, 1, 2, 3]
    assert after["per_prompt"][:2] == before  # the rows decoded first are kept, timings too


@pytest.mark.slow
def test_chain_evaluations_count_what_decoding_counted(scale_run: SimpleNamespace, tmp_path: Path) -> None:
    """`evaluate --chain`: the same greedy counts as the decoding evaluation of the same drafter, tau at
    each window, no speedup."""
    shutil.copytree(scale_run.out / "on_bf16" / "drafter", tmp_path / "on_bf16" / "drafter")
    evaluate = ["--out", str(tmp_path), "--prompts", str(scale_run.prompts), "--device", "cpu", "--limit", "2"]
    evaluate += ["--target", str(scale_run.target), "--max-new-tokens", "8", "--temperature", "0"]
    done = stage("evaluate", *evaluate, "--chain", "--windows", "4", "2")
    assert done.returncode == 0, done.stderr
    assert "evaluate on_bf16 T=0_chain N=8: tau " in done.stdout and "speedup" not in done.stdout
    chained = json.loads((tmp_path / "eval_on_bf16_T0_chain_N8.json").read_text())
    decoded = json.loads((scale_run.out / "eval_on_bf16_T0_N8.json").read_text())
    assert [p["accepted"] for p in chained["per_prompt"]] == [p["accepted"] for p in decoded["per_prompt"]]
    row = json.loads(stage("report", "--out", str(tmp_path), "--prompts", str(scale_run.prompts)).stdout)
    row = row["evaluations"][0]
    assert (row["method"], row["speedup"], sorted(k for k in row if k.startswith("tau_N"))) == (
        "chain",
        None,
        ["tau_N2", "tau_N4"],
    )
    with pytest.raises(SystemExit):
        main(["evaluate", *evaluate, "--temperature", "1", "--chain"])


# put first on a dflash-eval's PYTHONPATH: its second prompt marks the process as started, then waits 3 s
SLOW_SECOND_PROMPT = """
import os, pathlib, time
from dflash_pipeline.shared.generation import speculative
decode, calls = speculative.dflash_generate, []
def second_prompt_slow(*args, **kwargs):
    calls.append(1)
    if len(calls) == 3:  # after the warm-up and the first prompt
        pathlib.Path(os.environ["EVAL_STARTED"], str(os.getpid())).touch()
        time.sleep(3)
    return decode(*args, **kwargs)
speculative.dflash_generate = second_prompt_slow
"""


@pytest.mark.slow
@pytest.mark.parametrize("to", ["stage", "group"])
def test_evaluate_stopped_by_sigterm_keeps_the_prompts_decoded_and_a_rerun_finishes_them(
    scale_run: SimpleNamespace, tmp_path: Path, to: str
) -> None:
    """SIGTERM to the evaluate stage alone (a scheduler) or to its process group (a plan line's `timeout`)
    while two of three evaluations decode their second prompt: the third never starts, the two get it
    (passed on, or from the group too), drop that prompt and write the first (complete: false), and the
    stage exits 1 saying so. The rerun resumes those two and runs the third; its reports are complete and
    equal an uninterrupted evaluation's counts."""
    import signal

    out, hook, started = tmp_path / "out", tmp_path / "hook", tmp_path / "started"
    for name in ("a", "b", "c"):
        shutil.copytree(scale_run.out / "on_bf16" / "drafter", out / name / "drafter")
    hook.mkdir()
    started.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_SECOND_PROMPT)
    evaluate = ["--out", str(out), "--prompts", str(scale_run.prompts), "--device", "cpu", "--limit", "2"]
    evaluate += ["--target", str(scale_run.target), "--max-new-tokens", "8", "--temperature", "0", "--parallel", "2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.quality_scale", "evaluate", *evaluate],
        cwd=REPO,
        env={**env, "EVAL_STARTED": str(started)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.time() + 120
    while len(list(started.iterdir())) < 2:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    if to == "group":
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)  # it must pass it on
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert (
        stderr.strip().splitlines()[-1] == "quality_scale evaluate: stopped by SIGTERM; a rerun finishes what was left"
    )
    assert "evaluate: stopped by SIGTERM; not started: c T=0 N=8" in stdout
    assert stdout.count("(stopped: 1 of 2 prompts)") == 2, stdout
    reports = {name: out / f"eval_{name}_T0_N8.json" for name in ("a", "b", "c")}
    assert not reports["c"].exists()
    kept = {n: json.loads(reports[n].read_text())["per_prompt"] for n in "ab"}
    assert [len(rows) for rows in kept.values()] == [1, 1]
    rerun = stage("evaluate", *evaluate)
    assert rerun.returncode == 0, rerun.stderr

    def last_command(name: str) -> str:
        log = (out / "logs" / f"eval_{name}_T0_N8.log").read_text()
        return [line for line in log.splitlines() if line.startswith(sys.executable)][-1]

    assert [last_command(n).endswith(" --resume") for n in "abc"] == [True, True, False]
    whole = json.loads((scale_run.out / "eval_on_bf16_T0_N8.json").read_text())["per_prompt"]
    for name, report in reports.items():
        r = json.loads(report.read_text())
        assert r["complete"] and [p["accepted"] for p in r["per_prompt"]] == [p["accepted"] for p in whole]
        assert name == "c" or r["per_prompt"][:1] == kept[name]  # the stopped run's prompt, timings too
    rows = json.loads(stage("report", "--out", str(out), "--prompts", str(scale_run.prompts)).stdout)["evaluations"]
    assert [(row["run"], row["complete"], row["prompts"]) for row in rows] == [(n, True, 2) for n in "abc"]


@pytest.mark.slow
def test_ngram_stage_reports_the_copy_drafters_tau(scale_run: SimpleNamespace, tmp_path: Path) -> None:
    where = ["--out", str(tmp_path), "--prompts", str(scale_run.prompts), "--device", "cpu"]
    run_ok(
        "ngram", *where, "--target", str(scale_run.target), "--limit", "2", "--max-new-tokens", "8", "--windows", "4"
    )
    ngram = json.loads(run_ok("report", *where[:4]))["ngram"]
    assert list(ngram) == ["ngram_N8.json"] and set(ngram["ngram_N8.json"]["windows"]) == {"8", "4"}
    assert ngram["ngram_N8.json"]["prompts"] == 2 and "ngram N=8" in json.loads((tmp_path / "seconds.json").read_text())


def test_tokens_per_step_count_every_process(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 10, "type": "eval", "tau": 1.5}) + "\n")
    config = {"store": str(tmp_path / "nowhere"), "pack_tokens": 4096, "packs_per_step": 2, "workers": 1}
    for device, gpus, processes in (("cuda", [0, 1, 2], 3), ("cpu", [], 1)):
        (tmp_path / "train_config.json").write_text(json.dumps({**config, "device": device, "gpus": gpus}))
        run = run_summary(tmp_path)
        assert run["world_size"] == processes
        assert run["curve"][0]["train_tokens"] == 10 * 4096 * 2 * processes
        assert (run["store"], run["store_dtype"]) == ("nowhere", None)  # a store gone: its dtype unknown


def plan_lines(plan: Path) -> list[list[str]]:
    """A plan's lines to run, split as bench/scale_plan.sh splits them (a last `&` runs it beside the next)."""
    lines = [line.split() for line in plan.read_text().splitlines() if line.split() and not line.startswith("#")]
    return [words[:-1] if words[-1] == "&" else words for words in lines]


def test_bundled_plans_parse_as_stage_options() -> None:
    plans = sorted((REPO / "bench" / "plans").glob("*.plan"))
    assert plans
    for plan in plans:
        deadlines = []
        for deadline, name, *args in plan_lines(plan):
            deadlines.append(int(deadline))
            where = ["--out", "o", "--prompts", "p"] + ([] if name == "train" else ["--target", "t"])
            assert name in ("regenerate", "train", "evaluate", "ngram")
            assert parse([name, *where, *args]).stage == name
        assert deadlines == sorted(deadlines) and deadlines[-1] < 585, plan  # within the scale step's limit


def scale_plan(tmp_path: Path, plan: str, started: int, **extra_env: str) -> subprocess.CompletedProcess:
    (tmp_path / "test.plan").write_text(plan)
    # python3: this one; bench/ importable from another folder, as gpu_session.sh's PYTHONPATH makes it
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        **extra_env,
    }
    args = ["test.plan", "run", "prompts", "target", "report.json", str(started)]
    return subprocess.run(
        ["bash", str(REPO / "bench" / "scale_plan.sh"), *args], cwd=tmp_path, env=env, capture_output=True, text=True
    )


def test_scale_plan_checks_every_line_before_running_any(tmp_path: Path) -> None:
    done = scale_plan(tmp_path, "# a comment\n\n100 train --name x\n200 report\n", int(time.time()))
    assert (done.returncode, done.stdout) == (
        2,
        "test.plan:4: stage 'report' is not regenerate, train, evaluate or ngram\n",
    )
    done = scale_plan(tmp_path, "100 train --name x\n2m evaluate --temperature 0", int(time.time()))
    assert (done.returncode, done.stdout) == (2, "test.plan:2: deadline '2m' is not whole seconds\n")


def test_scale_plan_skips_a_line_past_its_deadline_and_still_reports(tmp_path: Path) -> None:
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "eval_domains.json").write_text("[]")
    done = scale_plan(tmp_path, "  # indented comment\n60 train --name x", int(time.time()) - 58)
    assert done.returncode == 1
    assert done.stdout == "--- plan line 2: train --name x: skipped, its deadline (60 s) has passed\n"
    assert json.loads((tmp_path / "report.json").read_text())["runs"] == {}


def test_scale_train_flags_reach_every_train_line_and_no_other(tmp_path: Path) -> None:
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "eval_domains.json").write_text("[]")
    plan = "60 train --name x\n61 evaluate --temperature 0\n62 train --name y --steps 5\n"
    done = scale_plan(tmp_path, plan, int(time.time()) - 120, SCALE_TRAIN_FLAGS="--no-compile-drafter")
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        f"--- plan line {n}: {line}: skipped, its deadline ({n + 59} s) has passed"
        for n, line in enumerate(
            [
                "train --name x --no-compile-drafter",
                "evaluate --temperature 0",
                "train --name y --steps 5 --no-compile-drafter",
            ],
            start=1,
        )
    ]
    train = ["train", "--out", "o", "--prompts", "p", "--name", "x"]
    assert [parse(train + flag).compile_drafter for flag in ([], ["--compile-drafter"], ["--no-compile-drafter"])] == [
        None,
        True,
        False,
    ]


STAGE_STAND_IN = """#!/usr/bin/env bash
# python3 for scale_plan.sh: a stage (-m bench.quality_scale STAGE --out RUN ... --name NAME) logs its start
# and end around a second's sleep (two for NAME=slow) and fails for NAME=bad; NAME=stuck ignores SIGTERM
# for a minute; report is logged; anything else is the real python
log=$PWD/stages.log
if [ "$3" = report ]; then echo "report $(date +%s.%N)" >> $log; exit 0; fi
if [ "$1" = -m ] && [ "$2" = bench.quality_scale ]; then
  name=${@: -1}
  if [ "$name" = stuck ]; then trap '' TERM; echo "start stuck $(date +%s.%N)" >> $log; sleep 60; exit 0; fi
  echo "start $name $(date +%s.%N)" >> $log; sleep 1; [ "$name" = slow ] && sleep 1; echo "end $name $(date +%s.%N)" >> $log
  [ "$name" != bad ]; exit $?
fi
exec REAL "$@"
"""


def stand_in_path(tmp_path: Path) -> str:
    """A PATH whose python3 is STAGE_STAND_IN."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(STAGE_STAND_IN.replace("REAL", sys.executable))
    (bin_dir / "python3").chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def test_scale_plan_runs_a_line_ending_in_ampersand_beside_the_next_and_waits_for_it(tmp_path: Path) -> None:
    plan = "60 train --name slow &\n60 train --name b\n70 train --name c\n80 train --name bad &\n"
    done = scale_plan(tmp_path, plan, int(time.time()), PATH=stand_in_path(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr  # the failed background line counts
    assert "--- plan line 1: train --name slow (until 60 s: " in done.stdout
    assert done.stdout.count("in the background") == 2
    log = [line.split() for line in (tmp_path / "stages.log").read_text().splitlines()]
    at = {tuple(words[:-1]): float(words[-1]) for words in log if words[0] != "report"}
    reports = [float(words[1]) for words in log if words[0] == "report"]
    assert len(reports) == 3 and log[-1][0] == "report"  # after lines 1-2, line 3, and line 4 at the end
    assert at[("start", "b")] < at[("end", "slow")]  # slow beside b
    assert at[("end", "slow")] <= reports[0] <= at[("start", "c")]  # and waited for though b ended first
    assert reports[1] <= at[("start", "bad")] and at[("end", "bad")] <= reports[2]


def test_scale_plan_kills_a_line_that_ignores_its_deadline_and_goes_on(tmp_path: Path) -> None:
    path = stand_in_path(tmp_path)
    began = time.monotonic()
    done = scale_plan(
        tmp_path, "8 train --name stuck\n30 train --name b\n", int(time.time()), PATH=path, PLAN_KILL_AFTER="1"
    )
    assert time.monotonic() - began < 25, done.stdout  # not the stuck line's minute
    assert done.returncode == 1
    assert "--- plan line 1: killed 1 s after its deadline: it did not stop on SIGTERM" in done.stdout
    assert "--- plan line 2: rc=0" in done.stdout
    log = [" ".join(line.split()[:-1]) for line in (tmp_path / "stages.log").read_text().splitlines()]
    assert log == ["start stuck", "report", "start b", "end b", "report"]


def test_online_tau_splits_where_the_trainers_head_ends() -> None:
    from bench.quality_scale import head_and_tail

    # prompt 1 anchors at offsets 0, 3 (head of 4), then 4 and 6; prompt 2's only step at 0
    assert head_and_tail([[3, 1, 2, 5], [1]], 4) == ((3 + 1 + 1) / 3, (2 + 5) / 2)
    assert head_and_tail([[2, 2]], 100) == (2.0, None)


def test_a_stage_runner_passes_sigterm_to_its_stage_and_waits_for_it(tmp_path) -> None:
    """A plan line's deadline (or a scheduler) sends SIGTERM to the runner: the stage gets it too and the
    runner waits for what it makes of it (dflash-train writes a checkpoint), then exits with its code."""
    import signal

    stage = (
        "import signal, sys, time, pathlib\n"
        "def stop(signum, frame):\n"
        "    time.sleep(1); pathlib.Path(sys.argv[1]).write_text('checkpoint'); sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, stop); pathlib.Path(sys.argv[1] + '.ready').touch(); time.sleep(60)\n"
    )
    done = tmp_path / "done"
    runner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from dflash_pipeline.demo import run_step; run_step('stage', sys.argv[1:])",
            sys.executable,
            "-c",
            stage,
            str(done),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 60
    while not (tmp_path / "done.ready").exists():
        assert runner.poll() is None and time.time() < deadline
        time.sleep(0.05)
    runner.send_signal(signal.SIGTERM)  # the runner alone: it must pass it on
    out, _ = runner.communicate(timeout=60)
    assert runner.returncode == 3 and "stage failed (exit code 3)" in out, out
    assert done.read_text() == "checkpoint"
