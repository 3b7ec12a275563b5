"""Stage one end to end on tiny real-architecture targets (CPU): stored states equal the HF forward."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_pipeline.data import sample_corpus_path
from dflash_pipeline.data.records import iter_records
from dflash_pipeline.data.tokens import tokenize_record
from dflash_pipeline.extract.config import ExtractConfig
from dflash_pipeline.extract.run import ExtractError, RunSummary, run_extraction
from dflash_pipeline.shared.store.manifest import load_manifest
from dflash_pipeline.shared.store.reader import FeatureStore


def small_corpus(tmp_path: Path, n: int) -> Path:
    lines = sample_corpus_path().read_text().splitlines()[:n]
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def extract(target: Path, data: Path, out: Path, **kw) -> RunSummary:
    cfg = ExtractConfig(
        target=str(target),
        data=(str(data),),
        out=str(out),
        device="cpu",
        batch_tokens=kw.pop("batch_tokens", 512),
        max_length=kw.pop("max_length", 256),
        **kw,
    )
    return run_extraction(cfg)


@pytest.mark.parametrize(
    "fixture, compiled",
    [
        ("tiny_target_dir", False),
        ("tiny_llama_dir", False),
        pytest.param("tiny_target_dir", True, marks=pytest.mark.slow),
    ],
)
def test_stored_states_equal_hf_hidden_states(fixture, compiled, request, tmp_path):
    target = request.getfixturevalue(fixture)
    data = small_corpus(tmp_path, 12)
    out = tmp_path / "store"
    extract(target, data, out, layers="0,2", store_dtype="float32", workers=1 if compiled else 2, compile=compiled)

    store = FeatureStore(out)
    assert store.layer_ids == [0, 2]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target)
    expected = {r.index: tokenize_record(r, tok, 256) for r in iter_records(data)}
    assert len(store) == len(expected)
    seen = set()
    for i in range(len(store)):
        s = store[i]
        ref = expected[s.sample_index]
        seen.add(s.sample_index)
        assert np.array_equal(s.input_ids.numpy(), ref.input_ids)
        assert np.array_equal(s.loss_mask.numpy().astype(np.uint8), ref.loss_mask)
        with torch.no_grad():
            hs = model(torch.from_numpy(ref.input_ids.astype(np.int64))[None], output_hidden_states=True).hidden_states
        want = torch.cat([hs[0 + 1][0], hs[2 + 1][0]], dim=-1)
        torch.testing.assert_close(s.hidden_states.float(), want, rtol=1e-4, atol=1e-4)
    assert seen == set(expected)


@pytest.mark.slow
def test_compiled_layers_compile_once_for_all_layers_and_shapes(tiny_target_dir):
    """One graph serves every decoder layer and batch shape: a recompile per layer would soon hit
    dynamo's cache limit and silently fall back to eager."""
    from dflash_pipeline.shared.model.attention import CompileCounter
    from dflash_pipeline.shared.target.loading import HiddenStateCapture, compile_decoder_layers, forward_hidden_states

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    capture = HiddenStateCapture(model, [0, 1, 3])
    ids = [torch.randint(0, 100, shape) for shape in [(2, 37), (3, 64), (1, 129)]]
    with torch.inference_mode():
        eager = [forward_hidden_states(model, capture, x) for x in ids]
        compile_decoder_layers(model)
        with CompileCounter() as counter:
            compiled = [forward_hidden_states(model, capture, x) for x in ids]
    capture.close()
    assert 1 <= counter.count <= 2  # automatic dynamic may compile a static graph first
    for want, got in zip(eager, compiled):
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_bf16_store_within_bf16_tolerance_and_manifest(tiny_target_dir, tmp_path):
    data = small_corpus(tmp_path, 8)
    out = tmp_path / "store"
    extract(tiny_target_dir, data, out)
    m = load_manifest(out)
    assert m.complete and m.hidden_dtype == "bfloat16"
    assert m.target["layer_ids"] and m.target["config_hash"]
    assert (out / "target" / "target_head.safetensors").exists()
    assert (out / "target" / "tokenizer").is_dir()
    store = FeatureStore(out)
    s = store[0]
    assert s.hidden_states.dtype == torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = model(s.input_ids[None], output_hidden_states=True).hidden_states
    want = torch.cat([hs[i + 1][0] for i in store.layer_ids], dim=-1)
    torch.testing.assert_close(s.hidden_states.float(), want, rtol=1.6e-2, atol=1e-2)


# The wall-clock record of a store (docs/FORMAT.md): the only bytes two identical runs may differ in.
RUN_TIME_MANIFEST_KEYS = ("created", "finished")


def store_files(root: Path) -> dict[str, bytes]:
    """Every file under `root` by relative path, the manifest with its timestamps left out."""
    files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    manifest = json.loads(files["manifest.json"])
    assert all(manifest[k] for k in RUN_TIME_MANIFEST_KEYS)
    files["manifest.json"] = json.dumps({k: v for k, v in manifest.items() if k not in RUN_TIME_MANIFEST_KEYS}).encode()
    return files


def test_identical_runs_write_identical_bytes(tiny_target_dir, tmp_path):
    """Every file of the store, the target head (whose hash is the manifest's weights fingerprint)
    and the rank summaries included; two runs give four chances to a run-dependent order. The second
    run tokenizes in two processes per rank (`--tokenize-processes`), which changes no byte."""
    data = small_corpus(tmp_path, 8)
    trees = []
    for name, processes in (("a", None), ("b", 2)):
        extract(tiny_target_dir, data, tmp_path / name, workers=2, tokenize_processes=processes)
        trees.append(store_files(tmp_path / name))
    assert "target/target_head.safetensors" in trees[0] and "shards/rank-00001.summary.json" in trees[0]
    assert trees[0].keys() == trees[1].keys()
    assert [k for k in trees[0] if trees[0][k] != trees[1][k]] == []


def test_truncated_model_skips_later_layers_and_head(tiny_target_dir):
    from dflash_pipeline.shared.target.loading import decoder_layers, drop_unused_modules, load_truncated_target

    model = load_truncated_target(tiny_target_dir, [0, 1], device=torch.device("cpu"), dtype=torch.float32)
    assert len(decoder_layers(model)) == 2
    drop_unused_modules(model)
    assert isinstance(model.lm_head, torch.nn.Identity)


def test_rerun_of_complete_store_does_nothing_and_other_settings_refused(tiny_target_dir, tmp_path):
    data = small_corpus(tmp_path, 6)
    out = tmp_path / "store"
    extract(tiny_target_dir, data, out, layers="0,2")
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    extract(tiny_target_dir, data, out, layers="0,2")
    assert before == {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ExtractError, match="other settings.*layer"):
        extract(tiny_target_dir, data, out, layers="1,2")


def test_bad_record_fails_with_file_and_line_and_store_stays_incomplete(tiny_target_dir, tmp_path):
    data = small_corpus(tmp_path, 5)
    with open(data, "a") as f:
        f.write("{not json\n")
    out = tmp_path / "store"
    args = ("--target", str(tiny_target_dir), "--data", str(data), "--device", "cpu", "--max-length", "128")
    proc = run_cli(*args, "--out", str(out))
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()[-1]
    assert "corpus.jsonl:6" in err, err
    assert not load_manifest(out).complete

    proc = run_cli(*args, "--out", str(tmp_path / "store2"), "--skip-bad")
    assert proc.returncode == 0, proc.stderr
    m = load_manifest(tmp_path / "store2")
    assert m.complete and m.data["counts"]["samples"] == 5
    assert sum(m.data["counts"]["skipped"].values()) == 1
    assert "skipped" in proc.stdout


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_pipeline.extract.cli", *args], capture_output=True, text=True)


@pytest.mark.parametrize(
    "content, flags, skipped",
    [
        ("", [], None),
        ("{not json\n[1]\n", ["--skip-bad"], "2 skipped by --skip-bad"),  # every record bad at reading
        (None, ["--skip-bad", "--max-length", "2"], "5 skipped by --skip-bad: no_loss_tokens=5"),  # ... at tokenizing
    ],
)
def test_input_without_usable_records_is_refused_in_one_line_and_leaves_no_store(
    tiny_target_dir, tmp_path, content, flags, skipped
):
    data = small_corpus(tmp_path, 5)
    if content is not None:
        data.write_text(content)
    out = tmp_path / "store"
    proc = run_cli("--target", str(tiny_target_dir), "--data", str(data), "--out", str(out), "--device", "cpu", *flags)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert f"{data}: no usable records found" in err, err
    assert (skipped in err) if skipped else ("skipped" not in err), err
    assert not out.exists()  # a corrected rerun into the same --out starts fresh


def test_the_summary_gives_the_bytes_per_token_without_the_targets_frozen_assets(tiny_target_dir, tmp_path):
    """A trial run's B/token x a dataset's tokens is how a user sizes a disk (README); the target's
    embedding, LM head and tokenizer are stored once, whatever the tokens, so they stay out of it."""
    out = tmp_path / "store"
    summary = extract(tiny_target_dir, small_corpus(tmp_path, 6), out)
    sizes = {p: p.stat().st_size for p in out.rglob("*") if p.is_file()}
    assets = sum(n for p, n in sizes.items() if p.is_relative_to(out / "target"))
    assert assets > 0 and summary.tokens > 0
    per_token = (sum(sizes.values()) - assets) / summary.tokens
    line = next(line for line in summary.lines() if line.startswith("on disk"))
    assert line == (
        f"on disk    {sum(sizes.values()) / 2**20:,.1f} MiB: {per_token:,.0f} B/token for the samples, "
        f"{assets / 2**20:,.1f} MiB for the target's embedding, LM head and tokenizer"
    )


def test_the_summary_gives_the_forwards_own_rate_beside_the_whole_runs_time(tiny_target_dir, tmp_path):
    """The whole run's seconds count reading, loading and sealing too: a rate over them would not be
    the extraction's. The forward's rate is per process (their seconds added up) and in all (the slowest's)."""
    summary = extract(tiny_target_dir, small_corpus(tmp_path, 12), tmp_path / "store", workers=2)
    assert 0 < summary.forward_wall_s <= summary.forward_seconds < 2 * summary.forward_wall_s
    assert summary.forward_wall_s < summary.seconds
    line = next(line for line in summary.lines() if line.startswith("computed"))
    assert line == (
        f"computed   {summary.computed_tokens} tokens in {summary.seconds:.1f} s all told, the forward "
        f"{summary.forward_wall_s:.1f} s ({summary.computed_tokens / summary.forward_seconds:,.0f} tok/s per process, "
        f"{summary.computed_tokens / summary.forward_wall_s:,.0f} in all)"
    )


def test_rank_without_records_is_fine_when_others_have_some(tiny_target_dir, tmp_path):
    out = tmp_path / "store"
    extract(tiny_target_dir, small_corpus(tmp_path, 1), out, workers=2)
    m = load_manifest(out)
    assert m.complete and m.data["counts"]["samples"] == 1


def test_a_ranks_bad_record_is_named_without_advice_to_rerun_what_fails_again(tiny_target_dir, tmp_path):
    """A rank that crashed is resumed by rerunning the same command; one that met a bad record is not."""
    data = small_corpus(tmp_path, 6)
    lines = data.read_text().splitlines()
    data.write_text("\n".join([*lines[:2], "{not json", *lines[2:]]) + "\n")
    out = tmp_path / "store"
    failed = run_cli(
        "--target", str(tiny_target_dir), "--data", str(data), "--out", str(out), "--device", "cpu", "--workers", "2"
    )
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr
    line = failed.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"dflash-extract: error: rank [01]: {re.escape(str(data))}:3: [^;]+", line), line


def test_rerun_after_fixing_a_malformed_line_starts_over_and_equals_a_clean_run(tiny_target_dir, tmp_path):
    """The failed run committed nothing, so its store is no conflict for the fixed data."""
    data = small_corpus(tmp_path, 5)
    good = data.read_text()
    lines = good.splitlines()
    data.write_text("\n".join([*lines[:2], "{not json", *lines[2:]]) + "\n")
    out = tmp_path / "store"
    args = (
        "--target",
        str(tiny_target_dir),
        "--data",
        str(data),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--max-length",
        "128",
    )
    failed = run_cli(*args)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr
    assert f"{data}:3" in failed.stderr.strip().splitlines()[-1], failed.stderr
    data.write_text(good)
    rerun = run_cli(*args)
    assert rerun.returncode == 0, rerun.stderr
    assert "Traceback" not in rerun.stderr
    assert f"{out}: the earlier run committed nothing; starting over" in rerun.stderr
    extract(tiny_target_dir, data, tmp_path / "clean", max_length=128, batch_tokens=16384)
    assert store_files(out) == store_files(tmp_path / "clean")


class Interrupted(Exception):
    """Stands for a kill after some batches were committed."""


# Small batches and shards, so that an interrupted run has committed some batches but not all.
SMALL_PLAN = {"max_length": 96, "batch_tokens": 96, "max_batch_size": 2, "chunk_tokens": 16, "shard_tokens": 64}
SMALL_PLAN_ARGS = ("--device", "cpu", *(a for k, v in SMALL_PLAN.items() for a in (f"--{k.replace('_', '-')}", str(v))))


def interrupted_store(target: str, data: str, out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store left incomplete with committed batches; paths are taken as typed, relative to the
    folder of `out`."""
    from dflash_pipeline.shared.store.progress import any_rank_committed
    from dflash_pipeline.shared.store.writer import StoreWriter

    def interrupt(self):
        self.flush_shards()  # commits the batches in whole shards, as a run killed later would have
        raise Interrupted

    with monkeypatch.context() as m:
        m.chdir(out.parent)
        m.setattr(StoreWriter, "finalize", interrupt)
        with pytest.raises(Interrupted):
            run_extraction(ExtractConfig(target=target, data=(data,), out=str(out), device="cpu", **SMALL_PLAN))
    assert not load_manifest(out).complete and any_rank_committed(out)


def test_data_and_target_spelled_otherwise_resume_and_equal_a_clean_run(tiny_target_dir, tmp_path, monkeypatch):
    from dflash_pipeline.shared.store.reader import stores_equal

    data = small_corpus(tmp_path, 6)
    (tmp_path / "model").symlink_to(tiny_target_dir)
    out = tmp_path / "store"
    interrupted_store("model", "./corpus.jsonl", out, monkeypatch)
    rerun = run_cli("--target", str(tiny_target_dir), "--data", str(data), "--out", str(out), *SMALL_PLAN_ARGS)
    assert rerun.returncode == 0, rerun.stderr
    assert "resumed from committed batches" in rerun.stdout
    assert load_manifest(out).data["paths"] == ["./corpus.jsonl"]  # as first typed, for people
    extract(tiny_target_dir, data, tmp_path / "clean", **SMALL_PLAN)
    assert stores_equal(out, tmp_path / "clean")


def test_other_data_content_is_refused_when_samples_are_committed(tiny_target_dir, tmp_path, monkeypatch):
    data = small_corpus(tmp_path, 6)
    out = tmp_path / "store"
    interrupted_store(str(tiny_target_dir), str(data), out, monkeypatch)
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    data.write_text(data.read_text().replace("a", "b", 1))
    refused = run_cli("--target", str(tiny_target_dir), "--data", str(data), "--out", str(out), *SMALL_PLAN_ARGS)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    err = refused.stderr.strip().splitlines()[-1]
    assert f"{out}: holds a store made with other settings (data.fingerprint:" in err, err
    assert before == {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_reading_tokenizing_and_loading_are_shown_before_the_first_batch(tiny_target_dir, tmp_path):
    out = tmp_path / "store"
    proc = run_cli(
        "--target",
        str(tiny_target_dir),
        "--data",
        str(small_corpus(tmp_path, 4)),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--workers",
        "2",
        "--max-length",
        "64",
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.replace("\r", "\n").splitlines()
    steps = [
        "starting 2 worker processes on cpu",
        "read rank 0: 4 records",
        "tokenize rank 0: 100%",
        "extract rank 0: loading the target's layers",
        "extract rank 0:   0%",
        "extract rank 0: sealing the store shard",
    ]
    first = [next((i for i, line in enumerate(lines) if step in line), None) for step in steps]
    assert None not in first and first == sorted(first), proc.stderr
    # notes carry the time they were written, so a log shows how long each step took
    notes = [lines[first[0]], lines[first[3]], lines[first[5]]]
    assert all(re.fullmatch(r"\d\d:\d\d:\d\d (dflash-extract|extract rank 0): .+", note) for note in notes), notes
    assert not any("rank 1" in line for line in lines)  # one rank speaks for all
    # ... transformers' bar too: another rank's, left mid-line, would swallow rank 0's next note
    assert sum(line.startswith("Loading weights:   0%") for line in lines) == 1, proc.stderr
    assert len(lines) < 30, proc.stderr  # no line per record


def test_other_settings_are_refused_while_regenerated_replies_would_be_lost(tiny_target_dir, tmp_path):
    """Regenerated replies are hours of work: a store holding some is not started over silently."""
    from dflash_pipeline.extract.run import prepare_store
    from dflash_pipeline.shared.store.layout import StoreLayout

    data, out = small_corpus(tmp_path, 2), tmp_path / "store"
    cfg = ExtractConfig(target=str(tiny_target_dir), data=(str(data),), out=str(out), device="cpu")
    prepare_store(cfg, 1)
    StoreLayout(out).regenerated_dir.mkdir()
    StoreLayout(out).regenerated_file(0).write_text(
        '{"index": 0, "messages": []}\n'
    )  # as a run killed while generating leaves it
    with pytest.raises(
        ExtractError, match=f"{re.escape(str(out))}: holds a store made with other settings .*data.max_length"
    ):
        prepare_store(ExtractConfig(**{**cfg.to_dict(), "max_length": 64}), 1)


def test_store_written_before_target_location_was_recorded_still_resumes(tiny_target_dir, tmp_path):
    from dflash_pipeline.extract.run import prepare_store

    data, out = small_corpus(tmp_path, 2), tmp_path / "store"
    cfg = ExtractConfig(target=str(tiny_target_dir), data=(str(data),), out=str(out), device="cpu")
    prepare_store(cfg, 1)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["target"]["location"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    old = (out / "manifest.json").read_bytes()
    assert prepare_store(cfg, 1)[1] is False
    assert (out / "manifest.json").read_bytes() == old  # resumed as it is, not started over
