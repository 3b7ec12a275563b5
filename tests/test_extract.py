"""Stage one end to end on tiny real-architecture targets (CPU): stored states equal the HF forward."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_pipeline.data import sample_corpus_path
from dflash_pipeline.data.records import iter_records
from dflash_pipeline.data.tokenize import tokenize_record
from dflash_pipeline.extract.config import ExtractConfig
from dflash_pipeline.extract.run import ExtractError, run_extraction
from dflash_pipeline.shared.store import FeatureStore
from dflash_pipeline.shared.manifest import load_manifest


def small_corpus(tmp_path: Path, n: int) -> Path:
    lines = sample_corpus_path().read_text().splitlines()[:n]
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def extract(target: Path, data: Path, out: Path, **kw) -> None:
    cfg = ExtractConfig(target=str(target), data=(str(data),), out=str(out), device="cpu",
                        batch_tokens=kw.pop("batch_tokens", 512), max_length=kw.pop("max_length", 256), **kw)
    run_extraction(cfg)


@pytest.mark.parametrize("fixture, compiled", [("tiny_target_dir", False), ("tiny_llama_dir", False),
                                               pytest.param("tiny_target_dir", True, marks=pytest.mark.slow)])
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
    from dflash_pipeline.extract.target import HiddenStateCapture, compile_decoder_layers, forward_hidden_states
    from dflash_pipeline.shared.attention import CompileCounter

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
    and the rank summaries included; two runs give four chances to a run-dependent order."""
    data = small_corpus(tmp_path, 8)
    trees = []
    for name in ("a", "b"):
        extract(tiny_target_dir, data, tmp_path / name, workers=2)
        trees.append(store_files(tmp_path / name))
    assert "target/target_head.safetensors" in trees[0] and "shards/rank-00001.summary.json" in trees[0]
    assert trees[0].keys() == trees[1].keys()
    assert [k for k in trees[0] if trees[0][k] != trees[1][k]] == []


def test_truncated_model_skips_later_layers_and_head(tiny_target_dir):
    from dflash_pipeline.extract.target import load_truncated_target, drop_unused_modules, decoder_layers

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
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_pipeline.extract.cli", "--target", str(tiny_target_dir), "--data", str(data),
         "--out", str(out), "--device", "cpu", "--max-length", "128"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()[-1]
    assert "corpus.jsonl:6" in err, err
    assert not load_manifest(out).complete

    proc = subprocess.run(
        [sys.executable, "-m", "dflash_pipeline.extract.cli", "--target", str(tiny_target_dir), "--data", str(data),
         "--out", str(tmp_path / "store2"), "--device", "cpu", "--max-length", "128", "--skip-bad"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    m = load_manifest(tmp_path / "store2")
    assert m.complete and m.data["counts"]["samples"] == 5
    assert sum(m.data["counts"]["skipped"].values()) == 1
    assert "skipped" in proc.stdout


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_pipeline.extract.cli", *args], capture_output=True, text=True)


@pytest.mark.parametrize("content, flags, skipped", [
    ("", [], None),
    ("{not json\n[1]\n", ["--skip-bad"], "2 skipped by --skip-bad"),  # every record bad at reading
    (None, ["--skip-bad", "--max-length", "2"], "5 skipped by --skip-bad: no_loss_tokens=5"),  # ... at tokenizing
])
def test_input_without_usable_records_is_refused_in_one_line_and_leaves_no_store(
        tiny_target_dir, tmp_path, content, flags, skipped):
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


def test_rank_without_records_is_fine_when_others_have_some(tiny_target_dir, tmp_path):
    out = tmp_path / "store"
    extract(tiny_target_dir, small_corpus(tmp_path, 1), out, workers=2)
    m = load_manifest(out)
    assert m.complete and m.data["counts"]["samples"] == 1
